"""GPU-side operators: CompactAttention (block selectors, block unions, FlashInfer paged
execution), block summaries, window attention and the merge of attention states, each with a
pure-torch reference. In: torch tensors on the device; out: tensors. Never imports ktlong."""
