"""Plain-torch float64 decode attention over a paged cache: the ground truth for tests and the benchmark.

It shares no code with the kernels or the planner: it reads the page table row by row, gathers each
row's K and V into a dense tensor, and runs softmax(q k^T * sm_scale) v in float64.
"""
from __future__ import annotations

import math

import torch


def _split_pool(kv_cache, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as [P, S, H, D] views, whatever the layout."""
    if isinstance(kv_cache, (tuple, list)):
        k, v = kv_cache
    else:
        k, v = kv_cache[:, 0], kv_cache[:, 1]
    if layout in ("HND", "HND_VT"):  # [P, H, S, D] -> [P, S, H, D]
        if layout == "HND_VT":       # each head's V block holds V^T: [D, S] in its S x D elements
            v = v.contiguous().view(v.shape[0], v.shape[1], v.shape[3], v.shape[2]).transpose(2, 3)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k, v


def reference_decode(q: torch.Tensor, kv_cache, *, layout: str, sm_scale: float | None = None,
                     kv_indptr=None, kv_indices=None, kv_last_page_len=None,
                     block_table=None, seq_lens=None, qo_indptr=None, window_left: int = -1,
                     logits_soft_cap: float = 0.0, sinks=None, k_scale: float | None = None,
                     v_scale: float | None = None,
                     kv_scales=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact decode attention. q: [B, Hq, D], or [qo_indptr[B], Hq, D] with qo_indptr (row b's
    queries q[qo_indptr[b]:qo_indptr[b+1]] are its last n tokens; query j sees positions
    < length - n + j + 1). Returns (out like q in float64, lse [q.shape[0], Hq] float64).

    Scores s = sm_scale * q.k; logits_soft_cap > 0: s = cap * tanh(s / cap). window_left >= 0: the
    query at position p sees positions p - window_left .. p only. sinks [Hq]: one more logit per
    head in the softmax's denominator, with no value (out = sum_j e^(s_j) v_j / (e^sink +
    sum_j e^(s_j))). lse is the natural-log log-sum-exp of the scores (and the sink). Give the
    page table as CSR (kv_indptr, kv_indices, kv_last_page_len) or as (block_table, seq_lens).
    An fp8 cache is read as the values it stands for: K = k_scale * K8 and V = v_scale * V8, or
    per token and KV head from kv_scales [P, 2, Hkv, S].
    """
    k_pool, v_pool = _split_pool(kv_cache, layout)
    total, num_qo_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    group = num_qo_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    rows = len(seq_lens) if block_table is not None else len(kv_indptr) - 1
    starts = list(range(rows + 1)) if qo_indptr is None else [int(x) for x in qo_indptr]
    out = torch.empty(total, num_qo_heads, head_dim, dtype=torch.float64, device=q.device)
    lse = torch.empty(total, num_qo_heads, dtype=torch.float64, device=q.device)
    for row in range(rows):
        if block_table is not None:
            length = int(seq_lens[row])
            pages = block_table[row, : -(-length // page_size)].long()
        else:
            lo, hi = int(kv_indptr[row]), int(kv_indptr[row + 1])
            pages = kv_indices[lo:hi].long()
            length = (hi - lo - 1) * page_size + int(kv_last_page_len[row])
        pages = pages.to(k_pool.device)
        keys = k_pool[pages].reshape(-1, num_kv_heads, head_dim)[:length].double()    # [L, Hkv, D]
        values = v_pool[pages].reshape(-1, num_kv_heads, head_dim)[:length].double()  # [L, Hkv, D]
        if kv_scales is not None:   # [P, 2, Hkv, S] -> per token [L, Hkv]
            token = kv_scales[pages.to(kv_scales.device)].double().transpose(2, 3)   # [n, 2, S, Hkv]
            keys = keys * token[:, 0].reshape(-1, num_kv_heads)[:length, :, None].to(keys.device)
            values = values * token[:, 1].reshape(-1, num_kv_heads)[:length, :, None].to(keys.device)
        elif k_scale is not None:
            keys, values = keys * k_scale, values * v_scale
        keys, values = keys.to(q.device), values.to(q.device)
        first, n = starts[row], starts[row + 1] - starts[row]
        for j in range(n):
            seen = length - n + j + 1
            start = 0 if window_left < 0 else max(0, seen - 1 - window_left)
            qg = q[first + j].double().view(num_kv_heads, group, head_dim)               # [Hkv, G, D]
            scores = torch.einsum("kgd,lkd->kgl", qg, keys[start:seen]) * scale          # [Hkv, G, L]
            if logits_soft_cap > 0:
                scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
            logits = scores
            if sinks is not None:   # the sink's logit joins the softmax, its value is zero
                sink = sinks.double().to(q.device).view(num_kv_heads, group, 1)
                logits = torch.cat([scores, sink], dim=2)
            lse[first + j] = torch.logsumexp(logits, dim=2).reshape(num_qo_heads)
            probs = torch.softmax(logits, dim=2)[..., :scores.shape[2]]
            out[first + j] = torch.einsum("kgl,lkd->kgd", probs,
                                          values[start:seen]).reshape(num_qo_heads, head_dim)
    return out, lse


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (inf when actual holds a NaN)."""
    actual, expected = actual.double(), expected.double().to(actual.device)
    if not torch.isfinite(actual).all():
        return math.inf
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-300))


TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
"""Relative-norm error bound per dtype: fp16 keeps 11 bits of mantissa, bf16 8."""
