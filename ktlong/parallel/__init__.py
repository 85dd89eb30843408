"""Tensor parallelism over torch.distributed (NCCL between GPUs, gloo on the CPU): each rank
holds its share of the attention heads and MLP columns, its own KV heads' pages, DRAM cache,
side tables and decode threads; ranks all-reduce after the output projection and the MLP, and
after scoring blocks when selection is shared across heads. In: the tensor_parallel option and
torchrun's environment; out: a `TensorParallel` handle the model and the selector use."""
