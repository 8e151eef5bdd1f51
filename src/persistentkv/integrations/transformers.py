"""transformers' continuous batching through PersistentKV: the attention implementation
"paged|persistentkv" for `model.generate_batch(...)`.

    from persistentkv.integrations.transformers import register
    model.set_attn_implementation(register())        # "paged|persistentkv"
    outputs = model.generate_batch(prompts, generation_config=...)

transformers' paged cache is read in place: each layer's key_cache / value_cache
[pages x block_size, Hkv, D] is a (k, v) pair of NHD pools [pages, block_size, Hkv, D]. The
cache groups layers by attention type, each group with its own blocks. Each forward pass (one
continuous-batching step) is planned once per group, at the step's first layer, from its
cu_seq_lens_q / cu_seq_lens_k and the read and write indices transformers computed for its own
path (one host read for the whole step); the new tokens' K/V are written where transformers
would write them.

Which request goes where, per layer group:
  * full attention: every request is attended by the decode kernel, in rows of at most 16 of
    its query tokens (fewer where 16 x the group's heads would pass a tile's 128 rows), each row
    over the request's tokens through its last query (causal): a decode token or a few
    speculative ones make one row, a prompt or a prefill chunk of n tokens ceil(n / 16) rows
    in the same launch as the step's decode rows;
  * sliding window (transformers keeps each request's last `sliding_window` tokens in a ring of
    slots, which wraps): a request of one query token is a row of the decode kernel over its ring,
    whose slots after the write hold exactly the tokens in its window (the softmax does not depend
    on their order);
  * a window layer's request of several queries (a prompt, a prefill chunk) is attended with
    torch on its tokens: the cached ones gathered from the cache before the write
    (a ring slot may be overwritten by it), then the step's new ones, causal with the queries at
    the end, inside the window where there is one. Not this kernel's work.
Attention sinks (gpt-oss's `s_aux`, one logit per head) and logit soft-capping (Gemma-2's
`softcap`) go to the kernel and to the torch path alike. The model's dtype must be float16 or
bfloat16.

The host read of each step does not go into a CUDA graph; transformers 5.17 turns its graphs on
by default only for flash-attention implementations (by name), so generate_batch's defaults run
without them, and a capture asked for (ContinuousBatchingConfig(use_cuda_graph=True)) is refused
with a ValueError that says so. Requires transformers 5.17 (`pip install
"persistentkv[transformers]"`).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..queries import MAX_QUERIES_PER_ROW, MAX_TILE_ROWS
from ..wrapper import DecodeWrapper

NAME = "paged|persistentkv"
GATHER_SCORES = 1 << 26   # the torch path's float32 scores per chunk of queries (256 MB)


def register() -> str:
    """Register "paged|persistentkv" with transformers' AttentionInterface; returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, paged_attention_forward)
    return NAME


class StepRows:
    """One layer group's share of a step. The decode kernel's rows: block_table int32 [R, max
    pages], seq_lens int32 [R], qo_indptr int32 [R + 1] and decode_queries int64 [qo_indptr[-1]]
    (each row's queries' positions in the step). gathers: (q_lo, q_hi, c_lo, c_hi) per request
    attended with torch: its queries q[q_lo:q_hi] (also its new tokens' K/V) and its cached
    tokens, the read slots reads[c_lo:c_hi], which come before them."""

    def __init__(self, block_table, seq_lens, qo_indptr, decode_queries, gathers):
        self.block_table, self.seq_lens, self.qo_indptr = block_table, seq_lens, qo_indptr
        self.decode_queries, self.gathers = decode_queries, gathers


def split_step(cu_q: np.ndarray, cu_k: np.ndarray, reads: np.ndarray, writes: np.ndarray,
               block_size: int, *, window: int | None = None,
               max_queries: int = MAX_QUERIES_PER_ROW) -> StepRows:
    """A step's requests for one layer group, split into decode rows and gathers (vectorized
    over the requests: no Python loop per request).

    Request b's queries are q[cu_q[b]:cu_q[b+1]], its new tokens, written to the slots
    writes[cu_q[b]:cu_q[b+1]]. Its reads[cu_k[b]:cu_k[b+1]] are the slots of every token it
    attends to, in order, the new ones last (slot // block_size is the page); an empty `reads`
    means a step of fresh prompts only (nothing cached). window: the group's sliding window
    (its reads then hold at most window - 1 cached tokens and a placeholder per new one), None
    for full attention: every request is then rows of at most max_queries of its queries
    (consecutive ones), each over its tokens through its last query. A request with no query
    this step is neither a row nor a gather."""
    cu_q, cu_k = np.asarray(cu_q, dtype=np.int64), np.asarray(cu_k, dtype=np.int64)
    reads, writes = np.asarray(reads, dtype=np.int64), np.asarray(writes, dtype=np.int64)
    n_q, q_lo = np.diff(cu_q), cu_q[:-1]
    if len(reads):   # the cached tokens: a request's reads before its new ones
        c_lo, c_hi = cu_k[:-1], cu_k[1:] - n_q
    else:
        c_lo = c_hi = np.zeros_like(n_q)
    if window is None:   # every request, in rows of at most max_queries of its queries
        req = np.flatnonzero(n_q > 0)
        req_of, chunk = _ragged(-(-n_q[req] // max_queries))
        b = req[req_of]                                       # the request of each row
        first_query = chunk * max_queries                     # of the request's queries
        counts = np.minimum(max_queries, n_q[b] - first_query)
        lens = (c_hi - c_lo)[b] + first_query + counts        # its tokens through its last query
        src, first = (reads, cu_k[:-1][b]) if len(reads) else (writes, q_lo[b])
        row, col = _ragged(-(-lens // block_size))            # (row, its j-th page)
        pages = src[first[row] + col * block_size] // block_size
        row_q_lo = q_lo[b] + first_query
    else:
        cand = np.flatnonzero(n_q == 1)
        ring_row, j = _ragged(c_hi[cand] - c_lo[cand] + 1)    # cached slots, then the new one
        last = j == (c_hi - c_lo)[cand][ring_row]
        cached = reads[np.minimum(c_lo[cand][ring_row] + j, max(len(reads) - 1, 0))] \
            if len(reads) else np.zeros_like(j)
        slots = np.where(last, writes[q_lo[cand][ring_row]], cached)
        ok, row, col, pages = _ring_rows(slots, ring_row, len(cand), block_size)
        b, lens = cand[ok], np.bincount(ring_row, minlength=len(cand))[ok]
        renumber = np.cumsum(ok) - 1
        keep = ok[row]
        row, col, pages = renumber[row[keep]], col[keep], pages[keep]
        counts, row_q_lo = n_q[b], q_lo[b]
    table = np.zeros((len(b), int(col.max()) + 1 if len(col) else 1), dtype=np.int32)
    table[row, col] = pages
    qo_indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    query_row, query_j = _ragged(counts)
    decode_queries = row_q_lo[query_row] + query_j
    gathered = np.setdiff1d(np.flatnonzero(n_q > 0), b)
    gathers = [(int(q_lo[r]), int(cu_q[r + 1]), int(c_lo[r]), int(c_hi[r])) for r in gathered]
    return StepRows(table, lens.astype(np.int32), qo_indptr, decode_queries, gathers)


def rows_of_queries(group: int) -> int:
    """The most query tokens of a kernel row: MAX_QUERIES_PER_ROW, fewer where
    a tile of them x the group's heads would pass MAX_TILE_ROWS (a power of two)."""
    most = MAX_QUERIES_PER_ROW
    while most > 1 and most * group > MAX_TILE_ROWS:
        most //= 2
    return most


def _ragged(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(i, j) for every j < lengths[i], i-major: the index pairs of a ragged array."""
    lengths = np.asarray(lengths, dtype=np.int64)
    i = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.cumsum(lengths) - lengths
    return i, np.arange(len(i)) - starts[i]


def _ring_rows(slots: np.ndarray, ring: np.ndarray, rings: int, block_size: int):
    """Window rings as rows of the decode kernel: slots int64 [n], ring[i] the ring of slots[i]
    (i-major, rings of them). A ring is a row when its slots are distinct and fill each of its
    pages from offset 0, at most one page partly (a row's tokens fill its pages in order): its
    full pages, then the partly filled one. Returns (ok bool [rings], and per page of every ring:
    its ring, its column, the page)."""
    pages, offsets = slots // block_size, slots % block_size
    ok = np.ones(rings, dtype=bool)
    if not len(slots):
        return ok, ring, ring, ring
    by_slot = np.lexsort((slots, ring))
    same = (slots[by_slot][1:] == slots[by_slot][:-1]) & (ring[by_slot][1:] == ring[by_slot][:-1])
    ok[ring[by_slot][1:][same]] = False                               # a slot twice
    by_page = np.lexsort((pages, ring))
    edge = np.r_[True, (pages[by_page][1:] != pages[by_page][:-1])
                 | (ring[by_page][1:] != ring[by_page][:-1])]
    starts = np.flatnonzero(edge)
    g_ring, g_page = ring[by_page][starts], pages[by_page][starts]
    g_count = np.diff(np.r_[starts, len(slots)])
    g_top = np.maximum.reduceat(offsets[by_page], starts)
    ok[g_ring[g_top != g_count - 1]] = False                          # not offsets 0 .. count-1
    partial = g_count < block_size
    ok[np.bincount(g_ring, weights=partial, minlength=rings) > 1] = False
    order = np.lexsort((g_page, partial, g_ring))                     # full pages, then partial
    g_ring, g_page = g_ring[order], g_page[order]
    col = np.arange(len(g_ring)) - np.searchsorted(g_ring, g_ring)   # g_ring ascends
    return ok, g_ring, col, g_page


class _GroupPlan:
    """One layer group's wrapper and its rows of the current step."""

    def __init__(self):
        self.wrapper = DecodeWrapper("NHD")
        self.rows = None                 # StepRows of the step
        self.decode_index = None         # None: the decode queries are the step's first ones
        self.plan_kwargs = None          # the plan's arguments but the soft-cap and the scale
        self.planned = None              # (soft-cap, scale) of the wrapper's plan; None: none


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None, *,
                            cache=None, cu_seq_lens_q=None, cu_seq_lens_k=None,
                            read_index=None, write_index=None, s_aux=None, softcap=None,
                            **kwargs):
    """transformers' attention-function interface: query [1, Hq, total_q, D], key / value
    [1, Hkv, total_q, D] (the step's new tokens); s_aux: sinks [Hq] (gpt-oss), softcap: a
    float or None (Gemma-2). Returns ([1, total_q, Hq, D], None)."""
    if cache is None:
        raise ValueError(f"{NAME} runs inside continuous batching (model.generate_batch); it was "
                         f"called without a paged cache")
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"{NAME} runs float16 or bfloat16 models; this one computes in "
                        f"{query.dtype} (load it with dtype=torch.bfloat16)")
    layer = module.layer_idx
    group, in_group = cache.layer_index_to_group_indices[layer]
    window = _window(cache, layer)
    soft_cap = float(softcap) if softcap else 0.0
    scale = kwargs.get("scaling") or module.scaling
    sinks = None if s_aux is None else s_aux.detach().float().reshape(-1)
    plans = getattr(cache, "_persistentkv", None)
    if plans is None:
        plans = cache._persistentkv = {}
    if layer == min(cache.layer_index_to_group_indices):   # a new step: split it
        if _capturing():
            raise ValueError(f"{NAME} plans each step on the host: run generate_batch with "
                             f"ContinuousBatchingConfig(use_cuda_graph=False)")
        _split_groups(plans, cache, query, cu_seq_lens_q, cu_seq_lens_k, read_index,
                      write_index)
    state = plans[group]
    rows = state.rows
    k_cache, v_cache = cache.key_cache[in_group], cache.value_cache[in_group]
    reads = _reads(read_index, group, write_index)
    q = query[0].transpose(0, 1)                          # [total_q (padded), Hq, D]
    new_k, new_v = key[0].transpose(0, 1), value[0].transpose(0, 1)      # [total_q, Hkv, D]
    cached = [(k_cache.index_select(0, reads[c_lo:c_hi]), v_cache.index_select(0, reads[c_lo:c_hi]))
              if c_hi > c_lo else None for _, _, c_lo, c_hi in rows.gathers]   # before the write
    k_cache.index_copy_(0, write_index[group], new_k)
    v_cache.index_copy_(0, write_index[group], new_v)

    out = torch.zeros_like(q)
    rows_q = int(rows.qo_indptr[-1])
    if rows_q:
        if state.planned != (soft_cap, scale):   # the group's first layer, or one unlike it
            state.wrapper.plan(**state.plan_kwargs, logits_soft_cap=soft_cap, sm_scale=scale)
            state.planned = (soft_cap, scale)
        shape = (-1, cache.block_size, cache.num_key_value_heads, cache.head_dim)
        pools = (k_cache.view(shape), v_cache.view(shape))
        if state.decode_index is None:                    # the step's first rows_q queries
            state.wrapper.run(q[:rows_q].contiguous(), pools, out=out[:rows_q], sinks=sinks)
        else:
            out[state.decode_index] = state.wrapper.run(q[state.decode_index], pools, sinks=sinks)
    for (q_lo, q_hi, _, _), old in zip(rows.gathers, cached):
        k, v = new_k[q_lo:q_hi], new_v[q_lo:q_hi]
        if old is not None:
            k, v = torch.cat([old[0], k]), torch.cat([old[1], v])
        out[q_lo:q_hi] = attend(q[q_lo:q_hi], k, v, scale=scale, window=window,
                                sinks=sinks, soft_cap=soft_cap)
    return out.unsqueeze(0), None


def _split_groups(plans: dict, cache, query: torch.Tensor, cu_seq_lens_q, cu_seq_lens_k,
                  read_index, write_index) -> None:
    """Split the step for every layer group, from one host read of its indices (the plans are
    made at each group's first layer, with that layer's soft-cap)."""
    windows, kinds = {}, {}
    for layer, (g, _) in cache.layer_index_to_group_indices.items():
        windows[g] = _window(cache, layer)
        kinds[g] = "full_attention" if windows[g] is None else "sliding_attention"
    groups = sorted(windows)
    row_queries = rows_of_queries(query.shape[1] // cache.num_key_value_heads)
    parts = [cu_seq_lens_q]
    for g in groups:
        parts += [cu_seq_lens_k[kinds[g]] if isinstance(cu_seq_lens_k, dict) else cu_seq_lens_k,
                  write_index[g], _reads(read_index, g, write_index)]
    host = torch.cat([p.reshape(-1).to(torch.int64) for p in parts]).cpu().numpy()
    pieces = np.split(host, np.cumsum([p.numel() for p in parts])[:-1])
    for i, g in enumerate(groups):
        cu_k, writes, reads = pieces[1 + 3 * i: 4 + 3 * i]
        rows = split_step(pieces[0], cu_k, reads, writes, cache.block_size, window=windows[g],
                          max_queries=row_queries)
        state = plans.setdefault(g, _GroupPlan())
        rows_q = int(rows.qo_indptr[-1])
        prefix = np.array_equal(rows.decode_queries, np.arange(rows_q))
        state.rows, state.planned = rows, None
        state.decode_index = (None if prefix
                              else torch.from_numpy(rows.decode_queries).to(query.device))
        state.plan_kwargs = dict(
            block_table=torch.from_numpy(rows.block_table).to(query.device),
            seq_lens=torch.from_numpy(rows.seq_lens), qo_indptr=torch.from_numpy(rows.qo_indptr),
            num_qo_heads=query.shape[1], num_kv_heads=cache.num_key_value_heads,
            head_dim=cache.head_dim, page_size=cache.block_size)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
           window: int | None = None, sinks: torch.Tensor | None = None,
           soft_cap: float = 0.0) -> torch.Tensor:
    """Attention of one request's queries over its tokens, with torch: q [n_q, Hq, D], k / v
    [n_k, Hkv, D], the queries the last n_q tokens (causal), each seeing its last `window` tokens
    (itself included; None: all); sinks float32 [Hq], soft_cap > 0: scores cap * tanh(s / cap).
    Returns [n_q, Hq, D] in q's dtype."""
    n_q, n_k, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    q4, k4, v4 = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    plain = sinks is None and not soft_cap
    if plain and n_q == n_k and window is None:   # a whole prompt: causal, a flash kernel, no mask
        return sdpa(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)
    pos = torch.arange(n_k - n_q, n_k, device=q.device)[:, None]        # [n_q, 1]
    key_pos = torch.arange(n_k, device=q.device)[None, :]               # [1, n_k]
    seen = key_pos <= pos
    if window is not None:
        seen &= key_pos > pos - window
    if plain:                                     # a masked kernel takes every head's K/V
        return sdpa(q4, k4.repeat_interleave(group, dim=1), v4.repeat_interleave(group, dim=1),
                    attn_mask=seen, scale=scale)[0].transpose(0, 1)
    kf = k4.float().repeat_interleave(group, dim=1)[0]                  # [Hq, n_k, D]
    vf = v4.float().repeat_interleave(group, dim=1)[0]
    out = torch.empty_like(q)
    chunk = max(1, GATHER_SCORES // (q.shape[1] * n_k))
    for lo in range(0, n_q, chunk):
        s = scale * q4[0, :, lo:lo + chunk].float() @ kf.transpose(1, 2)  # [Hq, c, n_k]
        if soft_cap:
            s = soft_cap * torch.tanh(s / soft_cap)
        s = s.masked_fill(~seen[lo:lo + chunk], -math.inf)
        if sinks is not None:
            s = torch.cat([s, sinks.float()[:, None, None].expand(-1, s.shape[1], 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :n_k]
        out[lo:lo + chunk] = (p @ vf).transpose(0, 1).to(q.dtype)
    return out


def _window(cache, layer: int) -> int | None:
    """The layer's sliding window in tokens, None for full attention (transformers' 1 or 0)."""
    window = cache.sliding_windows[layer]
    return window if window > 1 else None


def _reads(read_index, group: int, write_index) -> torch.Tensor:
    """The group's read slots, empty in a step of fresh prompts only."""
    if read_index is None or len(read_index) <= group:
        return write_index[group][:0]
    return read_index[group]


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
