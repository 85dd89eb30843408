"""Sessions: the state of one conversation in the model (dense, or long-context with prefill into
DRAM and sparse decode), built from the config in one place. In: a model and a Config; out: logits per prompt and token."""
