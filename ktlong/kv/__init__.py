"""The KV cache: its head-major layout, the device pages prefill reuses, the pinned DRAM cache
with side tables, the dense cache of normal mode, and the memory plan. In: a model config and options; out: buffers and byte counts."""
