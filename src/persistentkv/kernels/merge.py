"""Merge of split partials: rows whose tokens were read by several tasks get their final output here."""
import triton
import triton.language as tl

from .softmax import merge_states


@triton.jit
def merge_partials_kernel(meta_ptr, merge_rows_ptr, part_o_ptr, part_lse_ptr, out_ptr, lse_ptr,
                          stride_ob, stride_oh, num_rows, split_tokens,
                          NUM_QO_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
                          HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, RETURN_LSE: tl.constexpr):
    """out[row, heads of KV head] = exact softmax-weighted merge of the row's cdiv(seq_len, split) partials.

    Grid: (number of merged rows, KV heads). Partials: o fp32 [slots, Hq, HEAD_DIM], lse2 fp32 [slots, Hq].
    """
    row = tl.load(merge_rows_ptr + tl.program_id(0))
    kv_head = tl.program_id(1)
    seq_len = tl.load(meta_ptr + row)
    slot_start = tl.load(meta_ptr + 2 * num_rows + row).to(tl.int64)
    num_splits = tl.cdiv(seq_len, split_tokens)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    g_mask = offs_g < GROUP
    mask = g_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    heads = kv_head * GROUP + offs_g
    o = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    lse = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    for split in tl.range(0, num_splits):
        slot = slot_start + split
        o_s = tl.load(part_o_ptr + (slot * NUM_QO_HEADS + heads[:, None]) * HEAD_DIM + offs_d[None, :],
                      mask=mask, other=0.0)
        lse_s = tl.load(part_lse_ptr + slot * NUM_QO_HEADS + heads, mask=g_mask, other=0.0)
        o, lse = merge_states(o, lse, o_s, lse_s)
    dst = out_ptr + row.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=mask)
    if RETURN_LSE:
        tl.store(lse_ptr + row.to(tl.int64) * NUM_QO_HEADS + heads, lse * 0.6931471805599453, mask=g_mask)
