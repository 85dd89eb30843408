"""A software prefetch hint for Numba kernels: start loading memory that the next loop
iteration will read, so the load overlaps the current iteration's compute."""

from __future__ import annotations

import numba as nb
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

CACHE_LINE = 64


@intrinsic
def _prefetch_element(typingctx, array, index):
    """Hint that array.ravel()[index] (a C-contiguous array) will be read soon."""
    if not isinstance(array, types.Array) or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        arr = context.make_array(array_type)(context, builder, args[0])
        pointer = builder.gep(arr.data, [args[1]])
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        # read, keep in every cache level, data cache
        builder.call(fn, [builder.bitcast(pointer, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(array, index), codegen


@nb.njit(inline="always", cache=True)
def prefetch(flat):
    """Prefetch every cache line of a C-contiguous array."""
    step = max(1, CACHE_LINE // flat.itemsize)
    for i in range(0, flat.size, step):
        _prefetch_element(flat, i)
