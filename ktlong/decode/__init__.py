"""Hybrid decode: block selection, the device window, device block scores, and one decode body run
eagerly or replayed from CUDA graphs. In: the prefilled DRAM cache and a token; out: its logits."""
