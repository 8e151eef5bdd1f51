"""Merge of a row's split partials, run inside the decode kernel by the task that completes them."""
import triton
import triton.language as tl

MERGE_UNROLL = tl.constexpr(4)   # partials in flight (measured against 1 and 8: docs/perf-notes.md, v6)
# bytes of partial outputs in flight at most: the unroll halves (to 2, then 1) where MERGE_UNROLL
# partials of a large tile (several queries a row) would pass it. v20 (fp32 partials, a cap of 64
# KB) at group 4, d 128: 16 queries a row merged 2 partials at a time (compiled for sm_90a: 72 B
# of stack instead of 208; measured 1.03-1.14x on the small q_len 16 cells, against 0.93-1.08x
# for 1 at a time), 8 queries 4 (2 at a time spilled nothing, yet measured 0.98-1.00x). v26: the
# partials in the output's 16-bit dtype and a cap of 32 KB keep those unrolls (16 B of stack at
# 16 queries; 4 at a time there, 64 KB, took 120 B: docs/perf-notes.md).
MERGE_IN_FLIGHT_BYTES = tl.constexpr(32768)


@triton.jit
def merge_partials(part_o_ptr, part_lse_ptr, first_slot, count, slot_stride, rows, row_mask,
                   cols, col_mask, SLOT_ROWS: tl.constexpr, LSE_SLOT_ROWS: tl.constexpr,
                   G_MERGE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """Exact merge of the partials in slots first_slot + i * slot_stride, i < count, for the slot
    rows `rows` [G_MERGE] (row_mask: which are real) and columns `cols` [D_PAD] (col_mask).

    Partials: o [slots, SLOT_ROWS, HEAD_DIM] (normalized; in the output's dtype, part_o_ptr's
    element type), lse2 fp32 [slots, LSE_SLOT_ROWS] (base 2). One partial per step, the tile padded
    only to a power of two (G_MERGE), not to the 16 rows of tl.dot; the loop is unrolled
    MERGE_UNROLL times (fewer past MERGE_IN_FLIGHT_BYTES), so that that many partials' loads are
    in flight at once (a partial's loads do not depend on the running state). The loads skip L1
    (.cg): other programs wrote these partials during this launch.
    Returns (o [G_MERGE, D_PAD], lse2 [G_MERGE]); rows not in row_mask are padding.
    """
    hd_mask = row_mask[:, None] & col_mask[None, :]
    acc = tl.zeros([G_MERGE, D_PAD], dtype=tl.float32)
    m = tl.full([G_MERGE], float("-inf"), dtype=tl.float32)
    total = tl.zeros([G_MERGE], dtype=tl.float32)
    ELEMENT_BYTES: tl.constexpr = part_o_ptr.dtype.element_ty.primitive_bitwidth // 8
    PARTIAL_BYTES: tl.constexpr = G_MERGE * D_PAD * ELEMENT_BYTES
    UNROLL: tl.constexpr = (MERGE_UNROLL if PARTIAL_BYTES * MERGE_UNROLL <= MERGE_IN_FLIGHT_BYTES
                            else 2 if PARTIAL_BYTES * 2 <= MERGE_IN_FLIGHT_BYTES else 1)
    for i in tl.range(0, count, loop_unroll_factor=UNROLL):
        slot = first_slot + i * slot_stride
        lse = tl.load(part_lse_ptr + slot * LSE_SLOT_ROWS + rows, mask=row_mask,
                      other=float("-inf"), cache_modifier=".cg")                      # [G]
        o = tl.load(part_o_ptr + (slot * SLOT_ROWS + rows[:, None]) * HEAD_DIM + cols[None, :],
                    mask=hd_mask, other=0.0, cache_modifier=".cg").to(tl.float32)    # [G, D]
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)     # padding heads stay at -inf
        alpha = tl.math.exp2(m - m_safe)
        w = tl.math.exp2(lse - m_safe)
        acc = acc * alpha[:, None] + o * w[:, None]
        total = total * alpha + w
        m = m_new
    total = tl.where(total > 0, total, 1.0)
    return acc / total[:, None], m + tl.math.log2(total)
