"""Paged GQA decode: one program computes every query head of one KV-head group over a token range.

A task is (row, KV head, split): tokens [tok_lo, tok_hi) of the row, as the planner wrote them
(kernels/plan.py). Each K/V tile is loaded once and used for all GROUP query heads (padded to
G_PAD >= 16 rows for tl.dot; a whole tile of more than 16 to KernelConfig.min_tile_rows, 64 by
default up to head dim 128, which Triton compiles to the warp-group MMA on sm_90). A task of
more rows (several queries a row x GROUP) than KernelConfig.max_tile_rows runs as M_BLOCKS
programs of G_PAD rows each. A row read by one task writes its output directly; a row cut into
several tasks writes normalized partials (o, lse) that merge.py combines.

Grid: (programs,), persistent: each program runs one item, then the rest of its chunk (a balanced
plan) or the items it claims from a counter (a split or grouped step of more than one round).
"""
from typing import NamedTuple

import triton
import triton.language as tl

from ..runtime import interpreting, next_power_of_2
from .merge import merge_partials
from .plan import FIRST_PAGE_SLOTS, QUERY_FIELDS_AT, READ_FIELDS, query_fields
from .softmax import online_softmax_step

ONE_LEVEL_SPLITS = tl.constexpr(16)   # rows of more splits merge in two levels (_merge_split)
LOG2_E = tl.constexpr(1.4426950408889634)
HW_TANH = tl.constexpr(not interpreting())   # _tanh: the hardware instruction, off the interpreter
HW_PREFETCH = tl.constexpr(not interpreting())   # _prefetch_l2: PTX, which the interpreter lacks


class Task(NamedTuple):
    """One planner record (kernels/plan.py): tokens [tok_lo, tok_hi) of row `row`, split `split`
    of the row's num_splits; the row's pages from indices[page_start]; its partials from slot
    slot_start (-1: the row is this one task). With first pages (Tile.FIRST_PAGES), the pages
    of its first tile of BLOCK_N tokens, and of BLOCK_N_LONG; with Tile.QUERY_FIELDS, its row's
    first query, query count and length (_load_task; else zeros)."""
    row: tl.tensor
    split: tl.tensor
    tok_lo: tl.tensor
    tok_hi: tl.tensor
    page_start: tl.tensor
    slot_start: tl.tensor
    num_splits: tl.tensor
    first_pages: tl.tensor
    first_pages_long: tl.tensor
    q_start: tl.tensor
    q_count: tl.tensor
    row_len: tl.tensor


class Buffers(NamedTuple):
    """paged_decode_kernel's pointer arguments, less the plan's own (tasks, info)."""
    q: tl.tensor
    k: tl.tensor
    v: tl.tensor
    out: tl.tensor
    lse: tl.tensor
    indices: tl.tensor
    qo_indptr: tl.tensor
    sinks: tl.tensor
    kv_scales: tl.tensor
    part_o: tl.tensor
    part_lse: tl.tensor
    counters: tl.tensor
    row_lens: tl.tensor


class Strides(NamedTuple):
    """Element strides: q's and out's rows and heads; the pool's pages, heads, tokens and K -> V."""
    qb: tl.tensor
    qh: tl.tensor
    ob: tl.tensor
    oh: tl.tensor
    page: tl.tensor
    head: tl.tensor
    tok: tl.tensor
    kv: tl.tensor


class Scalars(NamedTuple):
    """The step's runtime scalars (paged_decode_kernel's arguments of the same names)."""
    k_scale: tl.tensor
    v_scale: tl.tensor
    scale_log2: tl.tensor
    num_q_rows: tl.tensor
    window_left: tl.tensor
    soft_cap: tl.tensor


class Tile(NamedTuple):
    """The tile's compile-time shape (decode_constexprs' fields of the same names)."""
    NUM_KV_HEADS: tl.constexpr
    GROUP: tl.constexpr
    Q_PAD: tl.constexpr
    G_PAD: tl.constexpr
    HEAD_DIM: tl.constexpr
    D_PAD: tl.constexpr
    PAGE_SIZE: tl.constexpr
    BLOCK_N: tl.constexpr
    BLOCK_N_LONG: tl.constexpr
    LONG_FROM: tl.constexpr
    G_MERGE: tl.constexpr
    M_BLOCKS: tl.constexpr
    D_BLOCKS: tl.constexpr
    FIRST_PAGES: tl.constexpr
    QUERY_FIELDS: tl.constexpr
    PAGE_PREFETCH: tl.constexpr
    PAGE_PREFETCH_TASK: tl.constexpr
    KEEP_PAGE_TABLE: tl.constexpr


class Features(NamedTuple):
    """What the kernel computes, each off unless set (decode_constexprs' fields of these names)."""
    RETURN_LSE: tl.constexpr
    UPCAST: tl.constexpr
    WINDOW: tl.constexpr
    SOFT_CAP: tl.constexpr
    SINKS: tl.constexpr
    KV_FP8: tl.constexpr
    TOKEN_SCALES: tl.constexpr
    V_T: tl.constexpr


@triton.jit
def _tanh(x):
    """tanh. On a GPU one MUFU.TANH (tanh.approx.f32: relative error about 2^-11; FlashInfer's
    and TensorRT-LLM's soft-caps use it too). The interpreter, which runs no PTX, takes one exp2
    (e^(-2|x|) never overflows), and below |x| = 1/64, where 1 - e^(-2|x|) loses the digits
    (to 0 under 6e-8: a huge soft-cap's scores), tanh's series to x^5 (its next term is
    under 1e-11 of x)."""
    if HW_TANH:
        y = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                      is_pure=True, pack=1)
    else:
        t = tl.math.exp2(-2.0 * LOG2_E * tl.abs(x))
        y = (1.0 - t) / (1.0 + t)
        y = tl.where(x < 0, -y, y)
        x2 = x * x
        y = tl.where(tl.abs(x) < 0.015625, x * (1.0 - x2 * (1.0 / 3.0 - x2 * (2.0 / 15.0))), y)
    return y


@triton.jit
def _prefetch_l2(ptrs):
    """Asks the L2 for the lines at ptrs (prefetch.global.L2::evict_last: kept ahead of the K/V
    stream's lines); nothing waits for them."""
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                              [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_task_pages(row_pages_ptr, tok_lo, tok_hi, offs_n, PAGE_SIZE: tl.constexpr):
    """Asks the L2 for the page indices of tokens [tok_lo, tok_hi) of a row whose table starts
    at row_pages_ptr: one index of each 32-byte sector (8 int32), offs_n's length of them at a
    time (_prefetch_l2); nothing waits for them."""
    SECTOR: tl.constexpr = 8
    first = tok_lo // PAGE_SIZE
    last = (tok_hi - 1) // PAGE_SIZE
    for at in tl.range(first, last + 1, offs_n.shape[0] * SECTOR, num_stages=1):
        _prefetch_l2(row_pages_ptr + tl.minimum(at + offs_n * SECTOR, last))


@triton.jit
def _load_pages(ptrs, mask, KEEP: tl.constexpr):
    """The page indices at ptrs (0 where masked); KEEP: marked evict_last in the L2, so that the
    page table, which every layer of a step reads, outlasts the K/V stream between layers."""
    if KEEP:
        return tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_last")
    return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def _whole_pages(start, offs_n, tok_hi, PAGE_SIZE: tl.constexpr):
    """The pages of the tile at `start` (a whole page, or BLOCK_N-aligned inside one), written so
    that the compiler sees them constant over a page, and a mask of the whole pages that hold
    tokens before tok_hi (constant over a page too: a page's vector loads can take it)."""
    page = start // PAGE_SIZE + offs_n // PAGE_SIZE
    return page, page * PAGE_SIZE < tok_hi


@triton.jit
def _attend_range(q, k_base, v_base, scales_base, indices_ptr, page_start, first_pages, tok_lo,
                  tok_hi, limit, lower, offs_d, d_mask, offs_dv, dv_mask, scale_log2, soft_cap,
                  strides, tile, feat, BLOCK_N: tl.constexpr):
    """Unnormalized state (acc [G_PAD, DV_PAD], m [G_PAD], l [G_PAD]) over tokens [tok_lo, tok_hi):
    the scores from all of q and K (offs_d), the output's columns offs_dv of V (DV_PAD of them:
    the tile's D_PAD over its D_BLOCKS), in tiles of BLOCK_N tokens (strides: Strides, tile: Tile,
    feat: Features).

    V_T: each (page, head) block of V holds V transposed (the HND_VT layout: V[s, d] at
    d * PAGE_SIZE + s), read with a page's tokens contiguous. It relies on tok_lo being a whole
    page (the planner cuts at pages) and PAGE_SIZE a power of two (the layout's check), so that
    a tile's slots are known from its offsets.

    FIRST_PAGES (tile.FIRST_PAGES > 0): the first tile's pages are first_pages [BLOCK_N], loaded
    with the task's record (_load_task), the later tiles' from the table.

    CAUSAL (several queries a row): tile row r sees positions <= limit[r] only;
    WINDOW: positions >= lower[r] only.
    KV_FP8: K/V are e4m3, converted to q's dtype per tile; TOKEN_SCALES: each token's K and V
    rows have their own scale (scales fp32 [pages, 2, Hkv, PAGE_SIZE], scales_base at this KV
    head's K scales, V's NUM_KV_HEADS x PAGE_SIZE further).
    SOFT_CAP: scores s = soft_cap * tanh(s / soft_cap) (s = sm_scale * q.k). A hidden score is
    -1e30, not -inf, so that a tile hiding a whole row stays finite; a row that sees none of
    [tok_lo, tok_hi) holds garbage, which the caller drops (its lse is set to -inf)."""
    G_PAD: tl.constexpr = tile.G_PAD
    DV_PAD: tl.constexpr = tile.D_PAD // tile.D_BLOCKS
    PAGE_SIZE: tl.constexpr = tile.PAGE_SIZE
    SCALE_KV: tl.constexpr = tile.NUM_KV_HEADS * tile.PAGE_SIZE
    CAUSAL: tl.constexpr = tile.Q_PAD > 1   # several queries a row
    acc = tl.zeros([G_PAD, DV_PAD], dtype=tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    r_i = tl.zeros([G_PAD], dtype=tl.float32)   # TOKEN_SCALES: acc's unit (online_softmax_step)
    offs_n = tl.arange(0, BLOCK_N)
    # Each tile's page indices are loaded one iteration ahead: K/V addresses then never wait on an
    # index load of their own iteration, and the compiler pipelines the K/V loads num_stages - 1
    # tiles deep (with the index load inside the iteration it could only wait for all of them).
    if feat.V_T:   # tasks start at whole pages: tell the compiler, so that it sees a page's slots
        tok_lo = tl.multiple_of(tok_lo, PAGE_SIZE)
    if feat.V_T:
        pages, in_pages = _whole_pages(tok_lo, offs_n, tok_hi, PAGE_SIZE)
    else:
        tok = tok_lo + offs_n
        pages, in_pages = tok // PAGE_SIZE, tok < tok_hi
    if HW_PREFETCH and tile.PAGE_PREFETCH_TASK:   # all the task's page indices, into the L2
        _prefetch_task_pages(indices_ptr + page_start, tok_lo, tok_hi, offs_n, PAGE_SIZE)
    if tile.FIRST_PAGES > 0:   # loaded beside the record: one dependent load less
        page = first_pages
    else:
        page = _load_pages(indices_ptr + page_start + pages, in_pages, tile.KEEP_PAGE_TABLE)
    for start in tl.range(tok_lo, tok_hi, BLOCK_N):
        if feat.V_T:
            start = tl.multiple_of(start, PAGE_SIZE if PAGE_SIZE < BLOCK_N else BLOCK_N)
        tok = start + offs_n
        valid = tok < tok_hi
        offs = page.to(tl.int64) * strides.page + (tok % PAGE_SIZE).to(tl.int64) * strides.tok
        if feat.TOKEN_SCALES:     # the tile's scale slots, from its page (before `page` moves on)
            s_off = page.to(tl.int64) * (2 * SCALE_KV) + tok % PAGE_SIZE                    # [N]
        if feat.V_T:   # V's column in its page, with slots in a form the compiler sees contiguous
            if BLOCK_N >= PAGE_SIZE:      # the tile is whole pages
                slot = offs_n % PAGE_SIZE
            else:                         # the tile lies BLOCK_N-aligned inside one page
                slot = tl.multiple_of(start % PAGE_SIZE, BLOCK_N) + offs_n
            v_offs = page.to(tl.int64) * strides.page + slot.to(tl.int64)                   # [N]
        if feat.V_T:
            pages, in_pages = _whole_pages(start + BLOCK_N, offs_n, tok_hi, PAGE_SIZE)
        else:
            nxt = tok + BLOCK_N
            pages, in_pages = nxt // PAGE_SIZE, nxt < tok_hi
        page = _load_pages(indices_ptr + page_start + pages, in_pages, tile.KEEP_PAGE_TABLE)
        if HW_PREFETCH and tile.PAGE_PREFETCH > 0:   # a later tile's page indices, into the L2
            ahead = tl.minimum((start + tile.PAGE_PREFETCH * BLOCK_N + offs_n) // PAGE_SIZE,
                               (tok_hi - 1) // PAGE_SIZE)
            _prefetch_l2(indices_ptr + page_start + ahead)
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_base + offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        if feat.V_T:   # whole pages: the slots of a row's last page past its length are read too
            v_rows = _whole_pages(start, offs_n, tok_hi, PAGE_SIZE)[1]                 # (finite:
            v = tl.load(v_base + v_offs[:, None] + offs_dv[None, :] * PAGE_SIZE,    # the layout's
                        mask=v_rows[:, None] & dv_mask[None, :], other=0.0)         # contract)
        else:
            v = tl.load(v_base + offs[:, None] + offs_dv[None, :],
                        mask=valid[:, None] & dv_mask[None, :], other=0.0)
        v_sc = 1.0
        if feat.TOKEN_SCALES:
            k_sc = tl.load(scales_base + s_off, mask=valid, other=0.0)                     # [N]
            v_sc = tl.load(scales_base + SCALE_KV + s_off, mask=valid, other=0.0)          # [N]
        if feat.UPCAST:
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            v = v.to(tl.float32)
        elif feat.KV_FP8:
            scores = tl.dot(q, tl.trans(k.to(q.dtype)))
            v = v.to(q.dtype)
        else:
            scores = tl.dot(q, tl.trans(k))
        if feat.TOKEN_SCALES:
            scores = scores * k_sc[None, :]
        if feat.SOFT_CAP:   # base 2: soft_cap * log2(e) * tanh(sm_scale * q.k / soft_cap)
            scores = (soft_cap * LOG2_E) * _tanh(scores * (scale_log2 / (LOG2_E * soft_cap)))
        else:
            scores = scores * scale_log2
        if CAUSAL:
            scores = tl.where(tok[None, :] <= limit[:, None], scores, -1e30)
        if feat.WINDOW:
            scores = tl.where(tok[None, :] >= lower[:, None], scores, -1e30)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        acc, m_i, l_i, r_i = online_softmax_step(acc, m_i, l_i, r_i, scores, v, v_sc,
                                                 feat.TOKEN_SCALES)
    if feat.TOKEN_SCALES:
        acc = acc * r_i[:, None]
    return acc, m_i, l_i


@triton.jit
def _store_final(o, lse2, q_rows, heads, out_ptr, lse_ptr, stride_ob, stride_oh, offs_d, mask,
                 g_mask, NUM_QO_HEADS: tl.constexpr, RETURN_LSE: tl.constexpr):
    """Tile row r -> out[q_rows[r], heads[r]] (and lse)."""
    q_rows = q_rows.to(tl.int64)
    dst = out_ptr + q_rows[:, None] * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=mask)
    if RETURN_LSE:  # natural log
        tl.store(lse_ptr + q_rows * NUM_QO_HEADS + heads, lse2 * 0.6931471805599453, mask=g_mask)


@triton.jit
def _decode_task(task, head_item, buffers, strides, scalars, tile, feat):
    """One (row, KV head, split) task (Task) for head item head_item (_item_blocks: a KV head, the
    M-block of its tile rows and the value block of its output columns); the last split of a
    row to finish merges the row's block. buffers: Buffers, strides: Strides, scalars: Scalars,
    tile: Tile, feat: Features.

    Tile row m (of M-block b: m = b * G_PAD + i) is query token m // GROUP of the row (its
    qo_indptr range; 1 without Q_PAD > 1) and query head kv_head * GROUP + m % GROUP. Positions
    are the planner's: from the first page it kept of the row (a window drops the pages before
    it), row_lens[row] of them."""
    GROUP: tl.constexpr = tile.GROUP
    G_PAD: tl.constexpr = tile.G_PAD
    NUM_QO_HEADS: tl.constexpr = tile.NUM_KV_HEADS * GROUP
    DV_PAD: tl.constexpr = tile.D_PAD // tile.D_BLOCKS
    tok_lo, tok_hi = task.tok_lo, task.tok_hi
    kv_head, m_block, d_block = _item_blocks(head_item, tile.M_BLOCKS, tile.D_BLOCKS)
    offs_m = m_block * G_PAD + tl.arange(0, G_PAD)
    offs_d = tl.arange(0, tile.D_PAD)
    offs_dv = d_block * DV_PAD + tl.arange(0, DV_PAD)       # this program's output columns
    q_start, n_q, limit = _row_queries(task, offs_m, buffers.qo_indptr, buffers.row_lens,
                                       GROUP, tile.Q_PAD, tile.QUERY_FIELDS, feat.WINDOW)
    lower = limit - scalars.window_left   # WINDOW: the first position each tile row sees
    g_mask = _query_mask(offs_m, q_start, n_q, scalars.num_q_rows, GROUP, tile.Q_PAD)
    d_mask = offs_d < tile.HEAD_DIM
    dv_mask = offs_dv < tile.HEAD_DIM
    mask = g_mask[:, None] & dv_mask[None, :]
    heads = kv_head * GROUP + offs_m % GROUP                                           # [G_PAD]
    q_rows = q_start + offs_m // GROUP                                                 # [G_PAD]
    q = tl.load(buffers.q + q_rows.to(tl.int64)[:, None] * strides.qb
                + heads[:, None] * strides.qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)                   # [G_PAD, D]
    if feat.UPCAST:
        q = q.to(tl.float32)
    head_off = kv_head * strides.head  # < H * S * D: int32 is enough
    scale_log2 = scalars.scale_log2
    if feat.KV_FP8:                         # a per-tensor K scale folds into the score scale
        scale_log2 = scale_log2 * scalars.k_scale
    k_head, v_head = buffers.k + head_off, buffers.v + strides.kv + head_off
    scales_head = buffers.kv_scales + kv_head * tile.PAGE_SIZE
    pages = task.page_start.to(tl.int64)
    if tile.BLOCK_N_LONG > 0:  # a task of at least LONG_FROM tokens reads tiles of BLOCK_N_LONG
        if tok_hi - tok_lo >= tile.LONG_FROM:
            acc, m_i, l_i = _attend_range(
                q, k_head, v_head, scales_head, buffers.indices, pages, task.first_pages_long,
                tok_lo, tok_hi, limit, lower, offs_d, d_mask, offs_dv, dv_mask, scale_log2,
                scalars.soft_cap, strides, tile, feat, tile.BLOCK_N_LONG)
        else:
            acc, m_i, l_i = _attend_range(
                q, k_head, v_head, scales_head, buffers.indices, pages, task.first_pages,
                tok_lo, tok_hi, limit, lower, offs_d, d_mask, offs_dv, dv_mask, scale_log2,
                scalars.soft_cap, strides, tile, feat, tile.BLOCK_N)
    else:
        acc, m_i, l_i = _attend_range(
            q, k_head, v_head, scales_head, buffers.indices, pages, task.first_pages, tok_lo,
            tok_hi, limit, lower, offs_d, d_mask, offs_dv, dv_mask, scale_log2, scalars.soft_cap,
            strides, tile, feat, tile.BLOCK_N)
    l_safe = tl.where(g_mask, l_i, 1.0)
    o = acc / l_safe[:, None]
    if feat.KV_FP8:                         # and a per-tensor V scale into the output
        o = o * scalars.v_scale
    lse2 = m_i + tl.math.log2(l_safe)
    if (tile.Q_PAD > 1) | feat.WINDOW:      # a query that sees none of this task's tokens
        seen = limit >= tok_lo
        if feat.WINDOW:
            seen = seen & (lower < tok_hi)
        lse2 = tl.where(seen, lse2, float("-inf"))
        o = tl.where(seen[:, None], o, 0.0)
    if feat.SINKS:                          # the row's first split counts each head's sink once
        o, lse2 = _add_sink(o, lse2, buffers.sinks, heads, g_mask & (task.split == 0))
    if task.slot_start < 0:                 # the row is one task: write the output directly
        _store_final(o, lse2, q_rows, heads, buffers.out, buffers.lse, strides.ob, strides.oh,
                     offs_dv, mask, g_mask, NUM_QO_HEADS, feat.RETURN_LSE)
    else:                                   # write the partial; the task completing them merges
        _merge_split(o, lse2, task, head_item, q_start, n_q, offs_m // GROUP * NUM_QO_HEADS + heads,
                     offs_dv, mask, g_mask, dv_mask, buffers, strides, scalars.num_q_rows, tile,
                     feat)


@triton.jit
def _item_blocks(head_item, M_BLOCKS: tl.constexpr, D_BLOCKS: tl.constexpr):
    """Head item -> (KV head, M-block, value block): a KV head's M_BLOCKS x D_BLOCKS items are
    consecutive, value blocks innermost, so that the programs reading one K/V tile run side by
    side and meet in L2."""
    blocks = head_item % (M_BLOCKS * D_BLOCKS)
    return head_item // (M_BLOCKS * D_BLOCKS), blocks // D_BLOCKS, blocks % D_BLOCKS


@triton.jit
def _query_mask(offs_m, q_start, n_q, num_q_rows, GROUP: tl.constexpr, Q_PAD: tl.constexpr):
    """The tile rows that are real queries: token m // GROUP < n_q, and (several queries per
    row) inside q's num_q_rows rows, so that a wrong qo_indptr never reads or writes past them."""
    real = (offs_m // GROUP < n_q) & (offs_m < Q_PAD * GROUP)
    if Q_PAD > 1:
        q_rows = q_start + offs_m // GROUP
        real = real & (q_rows >= 0) & (q_rows < num_q_rows)
    return real


@triton.jit
def _row_queries(task, offs_m, qo_indptr_ptr, row_lens_ptr, GROUP: tl.constexpr,
                 Q_PAD: tl.constexpr, QUERY_FIELDS: tl.constexpr, WINDOW: tl.constexpr):
    """(first query token of the task's row, its query count, per tile row the last KV
    position it sees): query j of n sees positions < seq_len - n + j + 1. Decode (Q_PAD 1):
    (row, 1, the row's last position, read only for a window). QUERY_FIELDS: from the task's
    first reads (the planner's copy, clamped alike), not from qo_indptr and row_lens."""
    row = task.row
    if QUERY_FIELDS:
        q_start = task.q_start
        n_q = task.q_count
        limit = task.row_len - n_q + offs_m // GROUP
    elif Q_PAD > 1:   # a trusted (graph-mode) qo_indptr is clamped: n_q in [0, Q_PAD]
        q_start = tl.load(qo_indptr_ptr + row)
        n_q = tl.minimum(tl.maximum(tl.load(qo_indptr_ptr + row + 1) - q_start, 0), Q_PAD)
        limit = tl.load(row_lens_ptr + row) - n_q + offs_m // GROUP
    else:
        q_start = row
        n_q = row * 0 + 1
        if WINDOW:
            limit = tl.load(row_lens_ptr + row) - 1 + offs_m * 0
        else:
            limit = offs_m
    return q_start, n_q, limit


@triton.jit
def _add_sink(o, lse2, sinks_ptr, heads, rows):
    """Fold each tile row's sink logit (sinks fp32 [Hq], natural log; rows: which rows take it)
    into its normalized state (o [G_PAD, D_PAD], lse2 [G_PAD], base 2): one more term in the
    softmax's denominator, with no value."""
    sink2 = tl.load(sinks_ptr + heads, mask=rows, other=float("-inf")) * LOG2_E
    top = tl.maximum(lse2, sink2)
    top = tl.where(top == float("-inf"), 0.0, top)
    own, extra = tl.math.exp2(lse2 - top), tl.math.exp2(sink2 - top)
    total = own + extra
    keep = tl.where(total > 0, own / tl.where(total > 0, total, 1.0), 0.0)
    return o * keep[:, None], top + tl.math.log2(total)


@triton.jit
def _arrive(counter_ptr, expected):
    """Count one arrival; True for the arrival that completes `expected` of them (which resets
    the counter for the next launch). acq_rel: what the earlier arrivals wrote is visible to it."""
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = done == expected - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def _store_partial(o, lse2, slot, part_rows, offs_d, mask, g_mask, part_o_ptr, part_lse_ptr,
                   SLOT_ROWS: tl.constexpr, LSE_SLOT_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Tile row r -> row part_rows[r] of partial slot `slot` (SLOT_ROWS rows per slot; o in
    part_o_ptr's element type), its lse to part_lse_ptr + slot * LSE_SLOT_ROWS + part_rows[r]."""
    slot = slot.to(tl.int64)
    tl.store(part_o_ptr + (slot * SLOT_ROWS + part_rows[:, None]) * HEAD_DIM + offs_d[None, :],
             o.to(part_o_ptr.dtype.element_ty), mask=mask)
    tl.store(part_lse_ptr + slot * LSE_SLOT_ROWS + part_rows, lse2, mask=g_mask)
    tl.debug_barrier()                      # every thread's stores precede the release


@triton.jit
def _merge_split(o, lse2, task, head_item, q_start, n_q, part_rows, offs_d, mask, g_mask, d_mask,
                 buffers, strides, num_q_rows, tile, feat):
    """Write the task's partial (split `split` of the row's num_splits: Task) to slot slot_start +
    split; the task that completes a row's partials merges them. A row of more than
    ONE_LEVEL_SPLITS splits S merges in two levels of about sqrt(S) partials each, not one of S
    (one program's merge is a chain of memory round trips): each group of ceil(sqrt(S)) splits
    is merged by the task completing it into the group's first slot, and the task completing
    the groups merges those. Counters (int32 [slots, HEAD_ITEMS], by slot and head item): a
    group's at its first slot, the row's at the row's first slot, or its second one when it merges in two levels. A slot holds
    Q_PAD x Hq rows (query token j, head h at j * Hq + h); the merge tile has G_MERGE rows, the
    M-block's share of Q_PAD x GROUP (each M-block merges its own rows), and the value block's
    columns offs_d (D_PAD of them: each value block merges its own). The value blocks' lse are
    equal, but each keeps its own (slot s's at lse row s * D_BLOCKS + value block, SLOT_ROWS
    each), since a group's merge overwrites its first slot while another value block may still
    read it.
    Partial outputs are kept in the output's dtype (fp16/bf16: half the bytes the merge reads;
    in the first half of the fp32 workspace; v26 measured 5-13% off the small multi-token steps)
    and merged in fp32; their lse in fp32."""
    split, slot_start, num_splits = task.split, task.slot_start, task.num_splits
    part_o_ptr, part_lse_ptr, counters_ptr = buffers.part_o, buffers.part_lse, buffers.counters
    NUM_KV_HEADS: tl.constexpr = tile.NUM_KV_HEADS
    GROUP: tl.constexpr = tile.GROUP
    Q_PAD: tl.constexpr = tile.Q_PAD
    HEAD_DIM: tl.constexpr = tile.HEAD_DIM
    G_MERGE: tl.constexpr = tile.G_MERGE
    D_PAD: tl.constexpr = tile.D_PAD // tile.D_BLOCKS     # this value block's columns (offs_d)
    M_BLOCKS: tl.constexpr = tile.M_BLOCKS
    D_BLOCKS: tl.constexpr = tile.D_BLOCKS
    NUM_QO_HEADS: tl.constexpr = NUM_KV_HEADS * GROUP
    SLOT_ROWS: tl.constexpr = Q_PAD * NUM_QO_HEADS
    LSE_SLOT_ROWS: tl.constexpr = SLOT_ROWS * D_BLOCKS
    HEAD_ITEMS: tl.constexpr = NUM_KV_HEADS * M_BLOCKS * D_BLOCKS
    kv_head, m_block, d_block = _item_blocks(head_item, M_BLOCKS, D_BLOCKS)
    part_lse_ptr += d_block * SLOT_ROWS          # this value block's lse rows of each slot
    part_o_ptr = part_o_ptr.to(tl.pointer_type(buffers.out.dtype.element_ty))
    _store_partial(o, lse2, slot_start + split, part_rows, offs_d, mask, g_mask, part_o_ptr,
                   part_lse_ptr, SLOT_ROWS, LSE_SLOT_ROWS, HEAD_DIM)
    offs_m = m_block * G_MERGE + tl.arange(0, G_MERGE)
    m_mask = _query_mask(offs_m, q_start, n_q, num_q_rows, GROUP, Q_PAD)
    merge_mask = m_mask[:, None] & d_mask[None, :]
    merge_heads = kv_head * GROUP + offs_m % GROUP
    merge_rows = offs_m // GROUP * NUM_QO_HEADS + merge_heads
    ready = num_splits > 0
    count = num_splits
    stride = num_splits * 0 + 1
    row_counter = slot_start
    if num_splits > ONE_LEVEL_SPLITS:       # level one: this split's group
        fanin = tl.ceil(tl.sqrt_rn(num_splits.to(tl.float32))).to(tl.int32)
        first = split - split % fanin
        members = tl.minimum(num_splits - first, fanin)
        ready = _arrive(counters_ptr + (slot_start + first) * HEAD_ITEMS + head_item, members)
        if ready:
            o_g, lse_g = merge_partials(part_o_ptr, part_lse_ptr, (slot_start + first).to(tl.int64),
                                        members, 1, merge_rows, m_mask, offs_d, d_mask,
                                        SLOT_ROWS, LSE_SLOT_ROWS, G_MERGE, HEAD_DIM, D_PAD)
            # the group's result overwrites its first partial: every thread's loads of it first
            # (a value is held by several threads where the tile has fewer elements than threads)
            tl.debug_barrier()
            _store_partial(o_g, lse_g, slot_start + first, merge_rows, offs_d, merge_mask,
                           m_mask, part_o_ptr, part_lse_ptr, SLOT_ROWS, LSE_SLOT_ROWS, HEAD_DIM)
        count = tl.cdiv(num_splits, fanin)
        stride = fanin
        row_counter = slot_start + 1
    if ready:
        if _arrive(counters_ptr + row_counter * HEAD_ITEMS + head_item, count):
            o_row, lse_row = merge_partials(part_o_ptr, part_lse_ptr, slot_start.to(tl.int64),
                                            count, stride, merge_rows, m_mask, offs_d, d_mask,
                                            SLOT_ROWS, LSE_SLOT_ROWS, G_MERGE, HEAD_DIM, D_PAD)
            _store_final(o_row, lse_row, q_start + offs_m // GROUP, merge_heads, buffers.out,
                         buffers.lse, strides.ob, strides.oh, offs_d, merge_mask, m_mask,
                         NUM_QO_HEADS, feat.RETURN_LSE)


@triton.jit
def _first_pages(first_pages_ptr, record, valid, num_pages, PAGE_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """The pages of a task's first tile of BLOCK_N tokens (a page per token) from the planner's
    copy, first_pages[record] (its address is the record's index: the load is issued beside the
    record's own; tasks start at whole pages, and the planner wrote 0 past a task's last page),
    each outside [0, num_pages) read as page 0 (the page guard's rule: the planner copies the
    table before the guard does)."""
    page = tl.load(first_pages_ptr + record.to(tl.int64) * READ_FIELDS
                   + tl.arange(0, BLOCK_N) // PAGE_SIZE, mask=valid, other=0)
    return tl.where((page >= 0) & (page < num_pages), page, 0)


@triton.jit
def _load_task(tasks_ptr, first_pages_ptr, record, valid, num_pages, tile):
    """Task record -> (Task, the record of the next task in its chunk or -1): independent loads
    from one 32-byte record (and with tile.FIRST_PAGES, its first tiles' pages from the
    planner's copy, _first_pages; with tile.QUERY_FIELDS, its row's queries from there too);
    zeros (and -1) where not valid."""
    rec = tasks_ptr + record.to(tl.int64) * 8
    first = record * 0
    first_long = first
    if tile.FIRST_PAGES > 0:
        first = _first_pages(first_pages_ptr, record, valid, num_pages, tile.PAGE_SIZE,
                             tile.BLOCK_N)
        first_long = first
        if tile.BLOCK_N_LONG > 0:
            first_long = _first_pages(first_pages_ptr, record, valid, num_pages, tile.PAGE_SIZE,
                                      tile.BLOCK_N_LONG)
    q_start = record * 0
    q_count = q_start
    row_len = q_start
    if tile.QUERY_FIELDS:
        side = first_pages_ptr + record.to(tl.int64) * READ_FIELDS + QUERY_FIELDS_AT
        q_start = tl.load(side, mask=valid, other=0)
        q_count = tl.load(side + 1, mask=valid, other=0)
        row_len = tl.load(side + 2, mask=valid, other=0)
    task = Task(tl.load(rec, mask=valid, other=0), tl.load(rec + 1, mask=valid, other=0),
                tl.load(rec + 2, mask=valid, other=0), tl.load(rec + 3, mask=valid, other=0),
                tl.load(rec + 4, mask=valid, other=0), tl.load(rec + 5, mask=valid, other=0),
                tl.load(rec + 6, mask=valid, other=0), first, first_long, q_start, q_count,
                row_len)
    return task, tl.load(rec + 7, mask=valid, other=-1)


@triton.jit(do_not_specialize=["num_q_rows", "window_left", "num_pages"])
def paged_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, indices_ptr, qo_indptr_ptr,
                        sinks_ptr, kv_scales_ptr, k_scale, v_scale,
                        tasks_ptr, first_pages_ptr, info_ptr, part_o_ptr, part_lse_ptr,
                        counters_ptr, row_lens_ptr, stride_qb, stride_qh, stride_ob, stride_oh,
                        stride_page, stride_head, stride_tok, stride_kv, scale_log2, num_q_rows,
                        window_left, soft_cap, num_pages,
                        NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, Q_PAD: tl.constexpr,
                        G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                        PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, G_MERGE: tl.constexpr,
                        RETURN_LSE: tl.constexpr, UPCAST: tl.constexpr, WINDOW: tl.constexpr,
                        SOFT_CAP: tl.constexpr, SINKS: tl.constexpr, KV_FP8: tl.constexpr,
                        TOKEN_SCALES: tl.constexpr, PDL: tl.constexpr, V_T: tl.constexpr,
                        BLOCK_N_LONG: tl.constexpr, LONG_FROM: tl.constexpr,
                        M_BLOCKS: tl.constexpr, D_BLOCKS: tl.constexpr,
                        FIRST_PAGES: tl.constexpr, QUERY_FIELDS: tl.constexpr,
                        PAGE_PREFETCH: tl.constexpr, PAGE_PREFETCH_TASK: tl.constexpr,
                        KEEP_PAGE_TABLE: tl.constexpr):
    """out[b, h] = softmax(q[b, h] . K[b, h // GROUP]^T * sm_scale) V[b, h // GROUP] over paged K/V
    (with the variants: a window of window_left positions before each query, soft_cap, and a
    sink logit per head, sinks fp32 [Hq]; each off unless its constexpr is set). An e4m3 cache
    (KV_FP8): K = k_scale * K8 and V = v_scale * V8, or (TOKEN_SCALES) per token and KV head
    from kv_scales fp32 [pages, 2, Hkv, PAGE_SIZE] (k_scale = v_scale = 1).

    tasks: int32 [capacity, 8] records from the planner (kernels/plan.py); info: int32 [8] with
    the task count at 0, the claim counter at 3 and a balanced plan's chunk count at 5. Items
    are (task, head item) pairs, item = task * HEAD_ITEMS + head_item, HEAD_ITEMS = NUM_KV_HEADS x
    M_BLOCKS x D_BLOCKS: a head item is a KV head's M-block (G_PAD of the tile's rows) and value
    block (head_dim / D_BLOCKS of the output's columns; each computes the scores from all of q
    and K), a KV head's items consecutive (_item_blocks), so that they run side by side and its
    K/V tiles meet in L2. Grid:
    (programs,), persistent: program p runs item p, that is record p // HEAD_ITEMS for head item
    p % HEAD_ITEMS, then, in a balanced plan, the records its `next` fields link (the rest of
    that chunk). A split or grouped step with more items than programs is claimed instead: each
    program then claims item programs + c, c = 0, 1, ... from the counter (one claim per item
    run, issued before the item and read after it, so that its latency hides behind it; the
    claim that draws the last value resets the counter for the next launch). counters: int32
    [partial capacity, HEAD_ITEMS], by partial slot (_merge_split), zero between launches (the
    merging tasks reset their own).
    PDL (launched with programmatic dependent launch): the kernel may start before the one ahead
    of it on the stream has finished; it waits for that kernel's writes first of all
    (griddepcontrol.wait), so that every load, the task records' included, sees them.
    FIRST_PAGES > 0: first_pages int32 [capacity, FIRST_READ_FIELDS] holds each record's first
    pages as the planner copied them from the table (KernelConfig.first_pages), which the first
    K/V tile reads instead of the table; num_pages: the pool's pages (they are clamped to it).
    QUERY_FIELDS (several query tokens a row, with first pages): each task's row's first query,
    query count and length come from there too, not from qo_indptr and row_lens.
    """
    if PDL:
        tl.extra.cuda.gdc_wait()
    HEAD_ITEMS: tl.constexpr = NUM_KV_HEADS * M_BLOCKS * D_BLOCKS
    buffers = Buffers(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, indices_ptr, qo_indptr_ptr, sinks_ptr,
                      kv_scales_ptr, part_o_ptr, part_lse_ptr, counters_ptr, row_lens_ptr)
    strides = Strides(stride_qb, stride_qh, stride_ob, stride_oh, stride_page, stride_head,
                      stride_tok, stride_kv)
    scalars = Scalars(k_scale, v_scale, scale_log2, num_q_rows, window_left, soft_cap)
    # constexpr tuples stay compile-time only when annotated so
    tile: tl.constexpr = Tile(NUM_KV_HEADS, GROUP, Q_PAD, G_PAD, HEAD_DIM, D_PAD, PAGE_SIZE,
                              BLOCK_N, BLOCK_N_LONG, LONG_FROM, G_MERGE, M_BLOCKS, D_BLOCKS,
                              FIRST_PAGES, QUERY_FIELDS, PAGE_PREFETCH, PAGE_PREFETCH_TASK,
                              KEEP_PAGE_TABLE)
    feat: tl.constexpr = Features(RETURN_LSE, UPCAST, WINDOW, SOFT_CAP, SINKS, KV_FP8,
                                  TOKEN_SCALES, V_T)
    programs = tl.num_programs(0)
    item = tl.program_id(0)
    head_item = item % HEAD_ITEMS
    # the first task record loads beside the task count, not after it
    task, nxt = _load_task(tasks_ptr, first_pages_ptr, item // HEAD_ITEMS, True, num_pages, tile)
    num_items = tl.load(info_ptr) * HEAD_ITEMS
    chained = tl.load(info_ptr + 5) * HEAD_ITEMS
    if (chained > 0) | (num_items <= programs):
        # One round: each program its item and, in a balanced plan, the rest of its chunk; no
        # claims. The first item is straight-line code: measured 0.6-1.0 us faster per launch on
        # small steps than a loop run once.
        if item < tl.where(chained > 0, chained, num_items):
            _decode_task(task, head_item, buffers, strides, scalars, tile, feat)
            while nxt >= 0:          # the rest of a balanced chunk (a link is a rare extra load)
                task, nxt = _load_task(tasks_ptr, first_pages_ptr, nxt, True, num_pages, tile)
                _decode_task(task, head_item, buffers, strides, scalars, tile, feat)
    else:
        while item < num_items:
            claim = tl.atomic_add(info_ptr + 3, 1, sem="relaxed", scope="gpu")   # read after the task
            _decode_task(task, item % HEAD_ITEMS, buffers, strides, scalars, tile, feat)
            if claim == num_items - 1:       # the last of the launch's num_items claims
                tl.atomic_xchg(info_ptr + 3, 0, sem="relaxed", scope="gpu")
            item = programs + claim
            task, nxt = _load_task(tasks_ptr, first_pages_ptr, item // HEAD_ITEMS,
                                   item < num_items, num_pages, tile)


def decode_constexprs(*, num_kv_heads: int, group: int, head_dim: int, page_size: int, block_n: int,
                      return_lse: bool, upcast: bool, max_queries: int = 1, window: bool = False,
                      soft_cap: bool = False, sinks: bool = False, kv_fp8: bool = False,
                      token_scales: bool = False, pdl: bool = False,
                      v_transposed: bool = False, long_block_n: int = 0,
                      long_from_tokens: int = 0, m_blocks: int = 1,
                      g_pad: int | None = None, d_blocks: int = 1,
                      first_pages: bool = False, page_prefetch_tiles: int = 0,
                      page_prefetch_task: bool = False, keep_page_table: bool = False) -> dict:
    """paged_decode_kernel's compile-time arguments, in signature order. max_queries: the most
    query tokens of a row (a power of two; 1 for decode): the tile has max_queries x group rows.
    window, soft_cap, sinks: which variants the kernel computes (each off costs nothing);
    kv_fp8: an e4m3 cache, token_scales: with a scale per token and KV head; pdl: the kernel
    waits for the previous kernel's writes (launched with launch_pdl=True; compute capability
    9.0+, never under the interpreter: launch.use_pdl decides); v_transposed: the HND_VT layout's
    V blocks; long_block_n: the tile of the tasks of at least long_from_tokens tokens (0: block_n
    for every task; KernelConfig.long_tile_tokens); m_blocks: programs that share a task's
    tile rows (KernelConfig.row_blocks); g_pad: rows of one program's tile (None: the tile's
    rows over m_blocks, at least 16; KernelConfig.program_rows pads them); d_blocks: programs
    that share a task's output columns, head_dim / d_blocks each (KernelConfig.value_blocks);
    first_pages: the first K/V tile's pages come from the planner's copy
    (KernelConfig.first_pages), where a tile spans at most FIRST_PAGE_SLOTS pages, and with
    max_queries > 1 each task's row's queries too (wherever its pages come from);
    page_prefetch_tiles: each tile asks the L2 for the page indices of the tile this many ahead
    (KernelConfig.page_prefetch_tiles; 0: off; the interpreter compiles it out);
    page_prefetch_task: each task asks the L2 for all its page indices at its start
    (KernelConfig.page_prefetch_task; compiled out by the interpreter too); keep_page_table: the
    page indices are loaded marked evict_last (KernelConfig.keep_page_table)."""
    rows = next_power_of_2(max_queries * group)
    if m_blocks != 1 and (m_blocks < 1 or rows % m_blocks or rows // m_blocks < 16):
        raise ValueError(f"m_blocks must cut the tile's {rows} rows into blocks of at least 16, "
                         f"got {m_blocks}")
    if d_blocks != 1 and (d_blocks < 1 or d_blocks & (d_blocks - 1)
                          or next_power_of_2(head_dim) // d_blocks < 16):
        raise ValueError(f"d_blocks must cut head_dim {head_dim} (padded to a power of two) into "
                         f"blocks of at least 16 columns, got {d_blocks}")
    block = max(16, rows) // m_blocks
    if g_pad is None:
        g_pad = block
    elif g_pad & (g_pad - 1) or g_pad < block or (m_blocks > 1 and g_pad != block):
        raise ValueError(f"g_pad must be a power of two of at least the {block} rows of a "
                         f"program (exactly them with M-blocks), got {g_pad}")
    return dict(NUM_KV_HEADS=num_kv_heads, GROUP=group, Q_PAD=max_queries,
                G_PAD=g_pad, HEAD_DIM=head_dim,
                D_PAD=next_power_of_2(head_dim), PAGE_SIZE=page_size, BLOCK_N=block_n,
                G_MERGE=rows // m_blocks, RETURN_LSE=return_lse, UPCAST=upcast,
                WINDOW=window, SOFT_CAP=soft_cap, SINKS=sinks, KV_FP8=kv_fp8,
                TOKEN_SCALES=token_scales, PDL=pdl, V_T=v_transposed, BLOCK_N_LONG=long_block_n,
                LONG_FROM=long_from_tokens if long_block_n else 0, M_BLOCKS=m_blocks,
                D_BLOCKS=d_blocks,
                FIRST_PAGES=FIRST_PAGE_SLOTS if first_pages and -(-max(block_n, long_block_n)
                                                                 // page_size) <= FIRST_PAGE_SLOTS
                else 0,
                QUERY_FIELDS=query_fields(first_pages=first_pages, max_queries=max_queries),
                PAGE_PREFETCH=page_prefetch_tiles, PAGE_PREFETCH_TASK=page_prefetch_task,
                KEEP_PAGE_TABLE=keep_page_table)
