"""Merge of a row's split partials, run by the last task of the row inside the decode kernel."""
import triton
import triton.language as tl

from .softmax import merge_states


@triton.jit
def merge_partials(part_o_ptr, part_lse_ptr, slot_start, num_splits, heads, offs_d, mask, g_mask,
                   NUM_QO_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, G_PAD: tl.constexpr,
                   D_PAD: tl.constexpr):
    """Exact merge of partials slot_start .. slot_start + num_splits - 1 for `heads`.

    Partials: o fp32 [slots, Hq, HEAD_DIM] (normalized), lse2 fp32 [slots, Hq] (base 2). The loads
    skip L1 (.cg): other programs wrote these partials during this launch. Returns (o, lse2).
    """
    o = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    lse = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    for split in tl.range(0, num_splits):
        slot = slot_start + split
        o_s = tl.load(part_o_ptr + (slot * NUM_QO_HEADS + heads[:, None]) * HEAD_DIM + offs_d[None, :],
                      mask=mask, other=0.0, cache_modifier=".cg")
        lse_s = tl.load(part_lse_ptr + slot * NUM_QO_HEADS + heads, mask=g_mask, other=0.0,
                        cache_modifier=".cg")
        o, lse = merge_states(o, lse, o_s, lse_s)
    return o, lse
