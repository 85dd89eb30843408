"""Numba CPU operators for sparse decode attention over the DRAM KV cache: KV storage types,
block anchors, block scoring and top-k, sparse attention with log-sum-exp. In: numpy arrays;
out: numpy arrays. Never imports ktlong."""
