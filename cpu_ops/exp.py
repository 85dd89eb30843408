"""e**x for x <= 0 in float32, inlined into Numba loops that LLVM vectorises.

Without Intel's SVML, Numba's exp is a call per element: over a row of attention scores it cost
7x this (measured on the 2-core CPU machine), and it keeps the loop around it scalar.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cpu_ops.bf16 import bits_as_float32

LOG2E = np.float32(1.4426950408889634)


@nb.njit(inline="always", fastmath=True)
def exp_nonpositive(x):
    """e**x in float32 for x <= 0 (relative error under 4e-6; below -87, a number under 1e-38): 2**(x log2 e)
    split into 2**n, built in the exponent bits, times a degree-6 polynomial of 2**f, |f| <= 1/2."""
    y = max(x * LOG2E, np.float32(-126.0))
    n = -np.int32(np.float32(0.5) - y)  # y rounded to nearest: truncation of a positive number, which vectorises
    f = y - np.float32(n)
    p = np.float32(1.5353362e-4)
    p = p * f + np.float32(1.3398874e-3)
    p = p * f + np.float32(9.6181291e-3)
    p = p * f + np.float32(5.5504109e-2)
    p = p * f + np.float32(2.4022652e-1)
    p = p * f + np.float32(6.9314718e-1)
    p = p * f + np.float32(1.0)
    return p * bits_as_float32(np.uint32((n + 127) << 23))


