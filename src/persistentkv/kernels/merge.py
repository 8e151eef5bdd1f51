"""Merge of a row's split partials, run by the last task of the row inside the decode kernel."""
import triton
import triton.language as tl


@triton.jit
def merge_partials(part_o_ptr, part_lse_ptr, slot_start, num_splits, first_head,
                   NUM_QO_HEADS: tl.constexpr, GROUP: tl.constexpr, G_MERGE: tl.constexpr,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """Exact merge of partials slot_start .. slot_start + num_splits - 1 for heads
    first_head .. first_head + GROUP - 1.

    Partials: o fp32 [slots, Hq, HEAD_DIM] (normalized), lse2 fp32 [slots, Hq] (base 2). One
    partial per step, the group padded only to a power of two (G_MERGE), not to the 16 rows of
    tl.dot; the loop's loads are software-pipelined. (Loading 8 partials at once as one
    [8, G, D] block measured 1.5-6 us slower per step on the H200: see docs/perf-notes.md.) The
    loads skip L1 (.cg): other programs wrote these partials during this launch.
    Returns (o [G_MERGE, D_PAD], lse2 [G_MERGE]); rows past GROUP are padding.
    """
    offs_g = tl.arange(0, G_MERGE)
    offs_d = tl.arange(0, D_PAD)
    heads = first_head + offs_g
    g_mask = offs_g < GROUP
    hd_mask = g_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    acc = tl.zeros([G_MERGE, D_PAD], dtype=tl.float32)
    m = tl.full([G_MERGE], float("-inf"), dtype=tl.float32)
    total = tl.zeros([G_MERGE], dtype=tl.float32)
    for split in tl.range(0, num_splits):
        slot = slot_start + split
        lse = tl.load(part_lse_ptr + slot * NUM_QO_HEADS + heads, mask=g_mask, other=float("-inf"),
                      cache_modifier=".cg")                                           # [G]
        o = tl.load(part_o_ptr + (slot * NUM_QO_HEADS + heads[:, None]) * HEAD_DIM + offs_d[None, :],
                    mask=hd_mask, other=0.0, cache_modifier=".cg")                   # [G, D]
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)     # padding heads stay at -inf
        alpha = tl.math.exp2(m - m_safe)
        w = tl.math.exp2(lse - m_safe)
        acc = acc * alpha[:, None] + o * w[:, None]
        total = total * alpha + w
        m = m_new
    total = tl.where(total > 0, total, 1.0)
    return acc / total[:, None], m + tl.math.log2(total)
