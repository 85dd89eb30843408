"""Rounding float32 values to a narrower float type inside Triton kernels, the same on a GPU and
in Triton's interpreter (the CPU's tests): the interpreter narrows float32 to bfloat16 by
truncation, a GPU to nearest. Kernels that must round where torch's ops round use this."""

import triton
import triton.language as tl


@triton.jit
def narrow(x, DTYPE: tl.constexpr):
    """float32 x -> the nearest DTYPE value (ties to even), as float32. bfloat16 by its bits;
    other types by conversion."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)
