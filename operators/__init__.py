"""GPU-side operators (CompactAttention, Triton kernels) and their pure-torch references."""
