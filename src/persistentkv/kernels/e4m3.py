"""An e4m3 cache's tile products on e4m3 operands (the HND_VT layout): no K/V conversion.

The transposed products put a tile's tokens in the MMA's M dimension, so that K [N, D] and V's
transposed blocks V^T [D, N] (HND_VT: tokens contiguous) are both operands in the layout the
fp8 tensor cores read from shared memory (the reduction dimension contiguous):
    scores^T [N, G] = K . q^T,    acc^T [D, G] += V^T . P^T.
q and P cannot be e4m3 as they are (3 mantissa bits: about 3.5e-2 of the output, the error of
products that round them once). Each is split into PARTS e4m3 parts, x = x0 + x1 / 16 + x2 / 256
(each part the previous remainder scaled by 16, so that it stays in e4m3's range), and each
product runs once per part: one part is 3.5e-2 from the float64 reference on the cache's values,
two about 8e-4, three about 2e-5 (emulated; docs/perf-notes.md v23).
"""
import triton
import triton.language as tl

from ..runtime import interpreting

E4M3_MAX = tl.constexpr(448.0)
NATIVE_CAST = tl.constexpr(not interpreting())   # the interpreter's fp32 -> e4m3 cast misrounds


@triton.jit
def to_e4m3(x):
    """fp32 -> e4m3, round to nearest even (|x| <= 448). On a GPU the hardware conversion; under
    the interpreter, whose own cast misrounds (31.5 -> 16), the value is rounded in fp32 first
    (to a multiple of its e4m3 step, 2^(e - 3), or 2^-9 below the normal range) and then cast,
    which the interpreter does exactly for values e4m3 holds."""
    if NATIVE_CAST:
        y = x.to(tl.float8e4nv)
    else:
        e = tl.math.floor(tl.math.log2(tl.maximum(tl.abs(x), 0.015625)))
        step = tl.math.exp2(e - 3.0)
        v = x / step
        v = (v + 12582912.0) - 12582912.0     # rounds to an integer, ties to even (|v| < 2^22)
        y = tl.minimum(tl.maximum(v * step, -E4M3_MAX), E4M3_MAX).to(tl.float8e4nv)
    return y


@triton.jit
def split_e4m3(x):
    """x fp32 (|x| <= 448) -> e4m3 parts (x0, x1, x2) with x ~ x0 + x1 / 16 + x2 / 256; a
    caller that uses fewer parts leaves the rest to dead-code elimination. Each remainder is at
    most half the previous part's step, so times 16 it stays within 448."""
    x0 = to_e4m3(x)
    r = (x - x0.to(tl.float32)) * 16.0
    x1 = to_e4m3(r)
    r = (r - x1.to(tl.float32)) * 16.0
    x2 = to_e4m3(r)
    return x0, x1, x2


@triton.jit
def dot_parts(a, b0, b1, b2, PARTS: tl.constexpr):
    """a . (b0 + b1 / 16 + b2 / 256) over the first PARTS parts, fp32 (smallest part first)."""
    if PARTS >= 3:
        t = tl.dot(a, b2)
        t = tl.dot(a, b1, t * 0.0625)
        t = tl.dot(a, b0, t * 0.0625)
    elif PARTS == 2:
        t = tl.dot(a, b1)
        t = tl.dot(a, b0, t * 0.0625)
    else:
        t = tl.dot(a, b0)
    return t
