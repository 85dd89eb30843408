"""Numba CPU operators for sparse decode attention over the DRAM KV cache."""
