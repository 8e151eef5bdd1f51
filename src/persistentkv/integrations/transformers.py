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

Every request goes through the decode kernel, in rows of at most 16 of its query tokens (fewer
where 16 x the group's heads would pass a tile's 128 rows), each row over the request's tokens
through its last query (causal): a decode token or a few speculative ones make one row, a
prompt or a prefill chunk of n tokens ceil(n / 16) rows. Per layer group:
  * full attention: the rows read the group's cache, one launch a layer;
  * sliding window (transformers keeps each request's last `sliding_window` tokens in a ring of
    slots, which wraps): a request of one query token is a row over its ring, whose slots after
    the write hold exactly the tokens in its window (the softmax does not depend on their
    order). Every other request (a prompt, a prefill chunk, a ring out of page order) is
    staged: its cached tokens, read before the write (which may overwrite them), then its new
    ones, copied in order into a staging pool of its own pages, which its rows read with the
    window in the plan (window_left = sliding_window - 1). Two launches a layer where a step
    stages any request.
Attention sinks (gpt-oss's `s_aux`, one logit per head) and logit soft-capping (Gemma-2's
`softcap`) go to every launch. The model's dtype must be float16 or bfloat16.

The host read of each step does not go into a CUDA graph; transformers 5.17 turns its graphs on
by default only for flash-attention implementations (by name), so generate_batch's defaults run
without them, and a capture asked for (ContinuousBatchingConfig(use_cuda_graph=True)) is refused
with a ValueError that says so. Requires transformers 5.17 (`pip install
"persistentkv[transformers]"`).
"""
from __future__ import annotations

import numpy as np
import torch

from ..checks import check_attention_shape
from ..queries import MAX_QUERIES_PER_ROW, MAX_TILE_ROWS
from ..wrapper import DecodeWrapper

NAME = "paged|persistentkv"


def register() -> str:
    """Register "paged|persistentkv" with transformers' AttentionInterface; returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, paged_attention_forward)
    return NAME


class StepRows:
    """Rows of the decode kernel: block_table int32 [R, max pages], seq_lens int32 [R],
    qo_indptr int32 [R + 1] and decode_queries int64 [qo_indptr[-1]] (each row's queries'
    positions in the step)."""

    def __init__(self, block_table, seq_lens, qo_indptr, decode_queries):
        self.block_table, self.seq_lens, self.qo_indptr = block_table, seq_lens, qo_indptr
        self.decode_queries = decode_queries


class StagedRows(StepRows):
    """Rows over a staging pool of num_pages pages: a window group's requests that are not rows
    of its ring (several queries, or a ring out of page order). Each staged request's tokens,
    its cached ones (read before the step's write may overwrite them) then its new ones, fill
    pages of the pool from offset 0: slot cached_dst[i] takes the cache's slot
    reads[cached_reads[i]], slot new_dst[i] the new token at step position new_queries[i]
    (int64 arrays); the pool's other slots are zeros."""

    def __init__(self, rows: StepRows, *, num_pages, cached_dst, cached_reads, new_dst,
                 new_queries):
        super().__init__(rows.block_table, rows.seq_lens, rows.qo_indptr, rows.decode_queries)
        self.num_pages, self.cached_dst, self.cached_reads = num_pages, cached_dst, cached_reads
        self.new_dst, self.new_queries = new_dst, new_queries


def split_step(cu_q: np.ndarray, cu_k: np.ndarray, reads: np.ndarray, writes: np.ndarray,
               block_size: int, *, window: int | None = None,
               max_queries: int = MAX_QUERIES_PER_ROW) -> tuple[StepRows, StagedRows | None]:
    """A step's requests for one layer group as rows of the decode kernel (vectorized over the
    requests: no Python loop per request): (rows over the group's cache, staged rows or None).

    Request b's queries are q[cu_q[b]:cu_q[b+1]], its new tokens, written to the slots
    writes[cu_q[b]:cu_q[b+1]]. Its reads[cu_k[b]:cu_k[b+1]] are the slots of every token it
    attends to, in order, the new ones last (slot // block_size is the page); an empty `reads`
    means a step of fresh prompts only (nothing cached). window: the group's sliding window
    (its reads then hold at most window - 1 cached tokens and a placeholder per new one), None
    for full attention. Every request is rows of at most max_queries of its queries
    (consecutive ones), each over its tokens through its last query: in the cache for full
    attention; in a window group, a request of one query whose ring after the write is a row
    (the tokens of its window, in pages filled from offset 0) reads its ring, and every other
    request is staged. A request with no query this step is in no row."""
    cu_q, cu_k = np.asarray(cu_q, dtype=np.int64), np.asarray(cu_k, dtype=np.int64)
    reads, writes = np.asarray(reads, dtype=np.int64), np.asarray(writes, dtype=np.int64)
    n_q, q_lo = np.diff(cu_q), cu_q[:-1]
    if len(reads):   # the cached tokens: a request's reads before its new ones
        c_lo, c_hi = cu_k[:-1], cu_k[1:] - n_q
    else:
        c_lo = c_hi = np.zeros_like(n_q)
    cached = c_hi - c_lo
    if window is None:
        req = np.flatnonzero(n_q > 0)
        b, first_query, counts, lens = _query_rows(req, n_q, cached, max_queries)
        src, first = (reads, cu_k[:-1][b]) if len(reads) else (writes, q_lo[b])
        row, col = _ragged(-(-lens // block_size))            # (row, its j-th page)
        pages = src[first[row] + col * block_size] // block_size
        return _step_rows(q_lo[b] + first_query, counts, lens, row, col, pages), None
    cand = np.flatnonzero(n_q == 1)
    ring_row, j = _ragged(cached[cand] + 1)                   # cached slots, then the new one
    last = j == cached[cand][ring_row]
    slots = (np.where(last, writes[q_lo[cand][ring_row]],
                      reads[np.minimum(c_lo[cand][ring_row] + j, len(reads) - 1)])
             if len(reads) else writes[q_lo[cand][ring_row]])
    ok, row, col, pages = _ring_rows(slots, ring_row, len(cand), block_size)
    b, lens = cand[ok], np.bincount(ring_row, minlength=len(cand))[ok]
    keep = ok[row]
    row, col, pages = (np.cumsum(ok) - 1)[row[keep]], col[keep], pages[keep]
    rows = _step_rows(q_lo[b], n_q[b], lens, row, col, pages)
    staged = np.setdiff1d(np.flatnonzero(n_q > 0), b)
    if not len(staged):
        return rows, None
    tokens = cached[staged] + n_q[staged]                     # cached ones, then new ones
    pages_each = -(-tokens // block_size)
    base = np.cumsum(pages_each) - pages_each                 # first page in the pool, each
    t_req, t = _ragged(tokens)                                 # every staged token
    dst = base[t_req] * block_size + t
    old = t < cached[staged][t_req]                            # cached (else new)
    s, first_query, counts, lens = _query_rows(np.arange(len(staged)), n_q[staged],
                                               cached[staged], max_queries)
    row, col = _ragged(-(-lens // block_size))
    staged_rows = _step_rows(q_lo[staged][s] + first_query, counts, lens, row, col,
                             base[s][row] + col)
    return rows, StagedRows(staged_rows, num_pages=int(pages_each.sum()),
                            cached_dst=dst[old], cached_reads=(c_lo[staged][t_req] + t)[old],
                            new_dst=dst[~old],
                            new_queries=(q_lo[staged][t_req] + t - cached[staged][t_req])[~old])


def _query_rows(req: np.ndarray, n_q: np.ndarray, cached: np.ndarray, max_queries: int):
    """Rows of at most max_queries consecutive queries of each request in req (per request:
    n_q queries after `cached` tokens): (the request of each row, its first query, counted in
    the request's, its number of queries, its tokens through its last query)."""
    r, chunk = _ragged(-(-n_q[req] // max_queries))
    first_query = chunk * max_queries
    counts = np.minimum(max_queries, n_q[req][r] - first_query)
    return req[r], first_query, counts, cached[req][r] + first_query + counts


def _step_rows(first_query, counts, lens, row, col, pages) -> StepRows:
    """StepRows from each row's first query (its step position), queries and tokens, and the
    (row, column, page) of each of its pages."""
    table = np.zeros((len(lens), int(col.max()) + 1 if len(col) else 1), dtype=np.int32)
    table[row, col] = pages
    qo_indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    query_row, query_j = _ragged(counts)
    return StepRows(table, np.asarray(lens, dtype=np.int32), qo_indptr,
                    first_query[query_row] + query_j)


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


class _Rows:
    """A wrapper and the rows it runs this step: `count` queries of the step, at the positions
    `queries` (None: the step's first `count`), its plan's arguments but the soft-cap and the
    scale, and the (soft-cap, scale) it has planned this step (None: none yet)."""

    def __init__(self):
        self.wrapper = DecodeWrapper("NHD")
        self.count, self.queries, self.plan_kwargs, self.planned = 0, None, None, None

    def set(self, rows: StepRows | None, device: torch.device, **plan_kwargs) -> None:
        self.count, self.planned = (0 if rows is None else int(rows.qo_indptr[-1])), None
        if not self.count:
            return
        prefix = np.array_equal(rows.decode_queries, np.arange(self.count))
        self.queries = None if prefix else torch.from_numpy(rows.decode_queries).to(device)
        self.plan_kwargs = dict(block_table=torch.from_numpy(rows.block_table).to(device),
                                seq_lens=torch.from_numpy(rows.seq_lens),
                                qo_indptr=torch.from_numpy(rows.qo_indptr), **plan_kwargs)

    def run(self, q: torch.Tensor, pools, out: torch.Tensor, *, soft_cap: float, scale: float,
            sinks) -> None:
        """Attend this step's rows over pools (k, v) [pages, block, Hkv, D] into out."""
        if not self.count:
            return
        if self.planned != (soft_cap, scale):   # the group's first layer, or one unlike it
            self.wrapper.plan(**self.plan_kwargs, logits_soft_cap=soft_cap, sm_scale=scale)
            self.planned = (soft_cap, scale)
        if self.queries is None:
            self.wrapper.run(q[:self.count].contiguous(), pools, out=out[:self.count],
                             sinks=sinks)
        else:
            out[self.queries] = self.wrapper.run(q[self.queries], pools, sinks=sinks)


class _Staging:
    """A step's staging pool on the device (StagedRows' maps): num_pages, and int64 tensors
    cached_dst, cached_slots (the cache's slots of the staged cached tokens), new_dst and
    new_queries."""

    def __init__(self, staged: StagedRows, reads: np.ndarray, device: torch.device):
        self.num_pages = staged.num_pages
        self.cached_dst, self.cached_slots, self.new_dst, self.new_queries = (
            torch.from_numpy(x).to(device) for x in (staged.cached_dst,
                                                     reads[staged.cached_reads],
                                                     staged.new_dst, staged.new_queries))

    def pool(self, cache_kv: torch.Tensor, new: torch.Tensor, block_size: int) -> torch.Tensor:
        """The staged tokens of one of K or V: cache_kv [slots, Hkv, D] (read before the step's
        write), new [total_q, Hkv, D]; returns [num_pages, block_size, Hkv, D]."""
        pool = cache_kv.new_zeros((self.num_pages * block_size,) + tuple(cache_kv.shape[1:]))
        pool.index_copy_(0, self.cached_dst, cache_kv.index_select(0, self.cached_slots))
        pool.index_copy_(0, self.new_dst, new.index_select(0, self.new_queries))
        return pool.view(self.num_pages, block_size, *cache_kv.shape[1:])


class _GroupPlan:
    """One layer group's rows of the current step: over its cache, and (window groups) over a
    staging pool."""

    def __init__(self):
        self.cache_rows, self.staged_rows = _Rows(), _Rows()
        self.staging: _Staging | None = None


# what paged_attention_forward reads of transformers' PagedAttentionCache
CACHE_ATTRIBUTES = ("num_key_value_heads", "head_dim", "block_size",
                    "layer_index_to_group_indices", "key_cache", "value_cache")


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
    if kwargs.get("dropout"):   # transformers passes the module's dropout only when training
        raise ValueError(f"{NAME} is decode attention and applies no dropout; got "
                         f"dropout={kwargs['dropout']} (put the model in eval mode)")
    _check_step(module, query, cache, cu_seq_lens_q=cu_seq_lens_q, cu_seq_lens_k=cu_seq_lens_k,
                write_index=write_index)       # before anything is written to the cache
    layer = module.layer_idx
    group, in_group = cache.layer_index_to_group_indices[layer]
    # cap * tanh(s / cap) is odd in cap: a negative cap caps as its magnitude does
    variant = dict(soft_cap=abs(float(softcap)) if softcap else 0.0,
                   scale=kwargs.get("scaling") or module.scaling,
                   sinks=None if s_aux is None else s_aux.detach().float().reshape(-1))
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
    k_cache, v_cache = cache.key_cache[in_group], cache.value_cache[in_group]
    q = query[0].transpose(0, 1)                          # [total_q (padded), Hq, D]
    new_k, new_v = key[0].transpose(0, 1), value[0].transpose(0, 1)      # [total_q, Hkv, D]
    staged = None
    if state.staging is not None:                         # before the write overwrites a ring
        staged = (state.staging.pool(k_cache, new_k, cache.block_size),
                  state.staging.pool(v_cache, new_v, cache.block_size))
    k_cache.index_copy_(0, write_index[group], new_k)
    v_cache.index_copy_(0, write_index[group], new_v)

    out = torch.zeros_like(q)
    shape = (-1, cache.block_size, cache.num_key_value_heads, cache.head_dim)
    state.cache_rows.run(q, (k_cache.view(shape), v_cache.view(shape)), out, **variant)
    if staged is not None:
        state.staged_rows.run(q, staged, out, **variant)
    return out.unsqueeze(0), None


def _check_step(module, query: torch.Tensor, cache, **metadata) -> None:
    """What paged_attention_forward needs of its arguments, checked before it writes the cache:
    query [1, Hq, total_q, D] of heads and head dim the kernels take, the module's layer in the
    cache's groups, and continuous batching's step metadata."""
    for name, value in metadata.items():
        if value is None:
            raise ValueError(f"{NAME} needs continuous batching's {name}; got None")
    missing = [name for name in CACHE_ATTRIBUTES if not hasattr(cache, name)]
    if missing:
        raise TypeError(f"{NAME} takes continuous batching's paged cache; the cache given "
                        f"({type(cache).__name__}) has no {', '.join(missing)}")
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(f"{NAME} takes query [1, num_heads, tokens, head_dim], got shape "
                         f"{list(query.shape)}")
    check_attention_shape(num_qo_heads=query.shape[1], num_kv_heads=cache.num_key_value_heads,
                          head_dim=cache.head_dim, page_size=cache.block_size)
    layer = getattr(module, "layer_idx", None)
    groups = getattr(cache, "layer_index_to_group_indices", None)
    if groups is None or layer not in groups:
        raise ValueError(f"{NAME} needs the module's layer_idx among the cache's layers; got "
                         f"layer_idx={layer!r}")
    config = getattr(module, "config", None)
    if (getattr(config, "sliding_window", None) == 1
            and "sliding_attention" in (getattr(config, "layer_types", None) or ())):
        raise ValueError(f"{NAME} cannot serve sliding_window=1: the cache marks full-attention "
                         f"layers with a window of 1, so its sliding layers look full")


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
    heads = dict(num_qo_heads=query.shape[1], num_kv_heads=cache.num_key_value_heads,
                 head_dim=cache.head_dim, page_size=cache.block_size)
    for i, g in enumerate(groups):
        cu_k, writes, reads = pieces[1 + 3 * i: 4 + 3 * i]
        rows, staged = split_step(pieces[0], cu_k, reads, writes, cache.block_size,
                                  window=windows[g], max_queries=row_queries)
        state = plans.setdefault(g, _GroupPlan())
        state.cache_rows.set(rows, query.device, **heads)
        state.staged_rows.set(staged, query.device, window_left=(windows[g] or 0) - 1, **heads)
        state.staging = None if staged is None else _Staging(staged, reads, query.device)


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
