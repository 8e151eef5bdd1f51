"""Merge of a row's split partials, run by the last task of the row inside the decode kernel."""
import triton
import triton.language as tl


@triton.jit
def merge_partials(part_o_ptr, part_lse_ptr, slot_start, num_splits, first_head,
                   NUM_QO_HEADS: tl.constexpr, GROUP: tl.constexpr, G_MERGE: tl.constexpr,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Exact merge of partials slot_start .. slot_start + num_splits - 1 for heads
    first_head .. first_head + GROUP - 1.

    Partials: o fp32 [slots, Hq, HEAD_DIM] (normalized), lse2 fp32 [slots, Hq] (base 2). CHUNK
    partials are loaded at once ([CHUNK, G_MERGE, D_PAD]), so a row of S splits costs S / CHUNK
    memory round trips, not S. The loads skip L1 (.cg): other programs wrote these partials during
    this launch. Returns (o [G_MERGE, D_PAD], lse2 [G_MERGE]); rows past GROUP are padding.
    """
    offs_c = tl.arange(0, CHUNK)
    offs_g = tl.arange(0, G_MERGE)
    offs_d = tl.arange(0, D_PAD)
    heads = first_head + offs_g
    hd_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]             # [G, D]
    acc = tl.zeros([G_MERGE, D_PAD], dtype=tl.float32)
    m = tl.full([G_MERGE], float("-inf"), dtype=tl.float32)
    total = tl.zeros([G_MERGE], dtype=tl.float32)
    for c0 in tl.range(0, num_splits, CHUNK):
        split = c0 + offs_c
        slot = slot_start + split                                                     # [C]
        s_mask = split < num_splits
        lse = tl.load(part_lse_ptr + slot[:, None] * NUM_QO_HEADS + heads[None, :],
                      mask=s_mask[:, None] & (offs_g < GROUP)[None, :], other=float("-inf"),
                      cache_modifier=".cg")                                           # [C, G]
        o = tl.load(part_o_ptr + (slot[:, None, None] * NUM_QO_HEADS + heads[None, :, None]) * HEAD_DIM
                    + offs_d[None, None, :], mask=s_mask[:, None, None] & hd_mask[None, :, :],
                    other=0.0, cache_modifier=".cg")                                  # [C, G, D]
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)     # padding heads stay at -inf
        alpha = tl.math.exp2(m - m_safe)
        w = tl.math.exp2(lse - m_safe[None, :])                                       # [C, G]
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], axis=0)
        total = total * alpha + tl.sum(w, axis=0)
        m = m_new
    total = tl.where(total > 0, total, 1.0)
    return acc / total[:, None], m + tl.math.log2(total)


def merge_chunk(*, group: int, head_dim: int) -> tuple[int, int]:
    """(G_MERGE, CHUNK): the group padded to a power of two, and partials per load, so that one
    [CHUNK, G_MERGE, D] fp32 block stays near 4K elements (32 registers a thread at 4 warps: a
    larger block raised the split kernel from 168 to 222 registers, 3 to 2 programs per SM)."""
    g_merge = triton.next_power_of_2(group)
    chunk = max(1, min(16, 4096 // (g_merge * triton.next_power_of_2(head_dim))))
    return g_merge, chunk
