"""GPU-side operators: CompactAttention (block selectors, block unions, FlashInfer paged
execution), block summaries, window attention and the merge of attention states, each with a
pure-torch reference. In: torch tensors on the device; out: tensors. Never imports ktlong."""

import functools
import importlib.util


@functools.cache
def triton_installed() -> bool:
    """Whether triton (the GPU extra) is installed: the Triton kernels (operators/*_kernel.py) are
    imported only then, and their torch versions run otherwise."""
    return importlib.util.find_spec("triton") is not None
