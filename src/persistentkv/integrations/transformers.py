"""transformers' continuous batching through PersistentKV: the attention implementation
"paged|persistentkv" for `model.generate_batch(...)`.

    from persistentkv.integrations.transformers import register
    model.set_attn_implementation(register())        # "paged|persistentkv"
    outputs = model.generate_batch(prompts, generation_config=...)

transformers' paged cache is read in place: each layer's key_cache / value_cache
[pages x block_size, Hkv, D] is a (k, v) pair of NHD pools [pages, block_size, Hkv, D]. Each
forward pass (one continuous-batching step) is planned once, at its first layer, from the
step's cu_seq_lens_q / cu_seq_lens_k and the read (or, for a step of fresh prompts, write)
indices transformers computed for its own path; the new tokens' K/V are written where
transformers would write them. A request of at most 16 query tokens this step (a decode token,
or a few speculative ones) is a row of the decode kernel; a longer one (a prompt or a prefill
chunk) goes to torch's scaled_dot_product_attention on its own tokens, gathered from the cache,
causal with its queries aligned to the end (the prefill is not this kernel's work). The plan
reads the step's lengths on the host once (one synchronization per step, not per layer).

Full-attention layers only (Llama, Qwen2, Mistral without a window); a model with sliding-window
layers or attention sinks is refused with a ValueError. The model's dtype must be float16 or
bfloat16. The host read of each step does not go into a CUDA graph; transformers 5.17 turns its
graphs on by default only for flash-attention implementations (by name), so generate_batch's
defaults run without them, and a capture asked for (ContinuousBatchingConfig(use_cuda_graph=True))
is refused with a ValueError that says so. Requires transformers 5.17
(`pip install "persistentkv[transformers]"`).
"""
from __future__ import annotations

import numpy as np
import torch

from ..queries import MAX_QUERIES_PER_ROW
from ..wrapper import DecodeWrapper

NAME = "paged|persistentkv"


def register() -> str:
    """Register "paged|persistentkv" with transformers' AttentionInterface; returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, paged_attention_forward)
    return NAME


class _StepPlan:
    """One continuous-batching cache's wrapper and the last step it planned: `rows` decode rows
    with `rows_q` queries, at positions `decode_index` of the step's queries (None: its first
    rows_q), and `prefills`, (q_lo, q_hi, k_lo, k_hi) per prefill request."""

    def __init__(self):
        self.wrapper = DecodeWrapper("NHD")
        self.rows, self.rows_q, self.decode_index, self.prefills = 0, 0, None, []


def split_step(cu_q: np.ndarray, cu_k: np.ndarray, slots: np.ndarray, block_size: int,
               max_queries: int = MAX_QUERIES_PER_ROW):
    """The step's requests, split. Request b's q rows cu_q[b]:cu_q[b+1] are the last tokens of its
    cu_k[b+1] - cu_k[b]; slots[cu_k[b] + t] is the cache slot of its token t (its page: slot //
    block_size). A request of at most max_queries queries is a decode row; the others are
    prefills. Returns (block_table int32 [R, max pages], seq_lens int32 [R], qo_indptr int32
    [R + 1], decode_queries int64 [qo_indptr[-1]]: each row's queries' positions in the step,
    prefills: [(q_lo, q_hi, k_lo, k_hi)])."""
    rows_pages, seq_lens, counts, queries, prefills = [], [], [], [], []
    for b in range(len(cu_q) - 1):
        q_lo, q_hi, k_lo, k_hi = (int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1]))
        if q_hi - q_lo > max_queries:
            prefills.append((q_lo, q_hi, k_lo, k_hi))
            continue
        rows_pages.append(slots[k_lo: k_hi: block_size] // block_size)
        seq_lens.append(k_hi - k_lo if q_hi > q_lo else 0)
        counts.append(q_hi - q_lo)
        queries.append(np.arange(q_lo, q_hi))
    width = max(1, max((len(p) for p in rows_pages), default=1))
    table = np.zeros((len(rows_pages), width), dtype=np.int32)
    for r, pages in enumerate(rows_pages):
        table[r, : len(pages)] = pages
    qo_indptr = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int32)
    decode_queries = np.concatenate(queries) if queries else np.zeros(0, dtype=np.int64)
    return table, np.asarray(seq_lens, dtype=np.int32), qo_indptr, decode_queries, prefills


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None, *,
                            cache=None, cu_seq_lens_q=None, cu_seq_lens_k=None,
                            read_index=None, write_index=None, **kwargs):
    """transformers' attention-function interface: query [1, Hq, total_q, D], key / value
    [1, Hkv, total_q, D] (the step's new tokens); returns ([1, total_q, Hq, D], None)."""
    if cache is None:
        raise ValueError(f"{NAME} runs inside continuous batching (model.generate_batch); it was "
                         f"called without a paged cache")
    if getattr(module, "sliding_window", None) or "s_aux" in kwargs:
        raise ValueError(f"{NAME} serves full-attention layers; this model has sliding-window "
                         f"layers or attention sinks")
    group, in_group = cache.layer_index_to_group_indices[module.layer_idx]
    k_cache, v_cache = cache.key_cache[in_group], cache.value_cache[in_group]
    new_k = key[0].transpose(0, 1)                       # [total_q, Hkv, D]
    new_v = value[0].transpose(0, 1)
    k_cache.index_copy_(0, write_index[group], new_k)
    v_cache.index_copy_(0, write_index[group], new_v)

    state = getattr(cache, "_persistentkv", None)
    if state is None:
        state = cache._persistentkv = _StepPlan()
    cu_k = cu_seq_lens_k[_layer_type(module)] if isinstance(cu_seq_lens_k, dict) else cu_seq_lens_k
    reads = read_index[group] if read_index is not None and len(read_index) else None
    slots = reads if reads is not None and reads.numel() else write_index[group]
    if module.layer_idx == min(cache.layer_index_to_group_indices):   # a new step: plan it
        if _capturing():
            raise ValueError(f"{NAME} plans each step on the host: run generate_batch with "
                             f"ContinuousBatchingConfig(use_cuda_graph=False)")
        _plan_step(state, module, query, cache, cu_seq_lens_q.cpu().numpy().astype(np.int64),
                   cu_k.cpu().numpy().astype(np.int64), slots)
    q = query[0].transpose(0, 1)                          # [total_q (padded), Hq, D]
    out = torch.zeros_like(q)
    if state.rows:
        shape = (-1, cache.block_size, cache.num_key_value_heads, cache.head_dim)
        pools = (k_cache.view(shape), v_cache.view(shape))
        if state.decode_index is None:                    # the step's first rows_q queries
            state.wrapper.run(q[: state.rows_q].contiguous(), pools, out=out[: state.rows_q])
        else:
            out[state.decode_index] = state.wrapper.run(q[state.decode_index], pools)
    for q_lo, q_hi, k_lo, k_hi in state.prefills:
        out[q_lo:q_hi] = _prefill(q[q_lo:q_hi], k_cache, v_cache, slots[k_lo:k_hi], module.scaling)
    return out.unsqueeze(0), None


def _plan_step(state: _StepPlan, module, query, cache, cu_q: np.ndarray, cu_k: np.ndarray,
               slots: torch.Tensor) -> None:
    """Plan the step's decode rows (one host read of its slots) and keep its prefills."""
    table, seq_lens, qo_indptr, decode_q, state.prefills = split_step(
        cu_q, cu_k, slots.cpu().numpy(), cache.block_size)
    state.rows, state.rows_q = len(seq_lens), int(qo_indptr[-1])
    device = query.device
    prefix = np.array_equal(decode_q, np.arange(state.rows_q))
    state.decode_index = None if prefix else torch.from_numpy(decode_q).to(device)
    if state.rows:
        state.wrapper.plan(block_table=torch.from_numpy(table).to(device),
                           seq_lens=torch.from_numpy(seq_lens), qo_indptr=torch.from_numpy(qo_indptr),
                           num_qo_heads=query.shape[1], num_kv_heads=cache.num_key_value_heads,
                           head_dim=cache.head_dim, page_size=cache.block_size,
                           sm_scale=module.scaling)


def _prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             scale: float) -> torch.Tensor:
    """One request's prefill: q [n_q, Hq, D], its n_k tokens' cache slots [n_k] (the queries
    are the last n_q of them, causal) -> [n_q, Hq, D]."""
    n_q, n_k = q.shape[0], slots.shape[0]
    k = k_cache.index_select(0, slots).transpose(0, 1)[None]          # [1, Hkv, n_k, D]
    v = v_cache.index_select(0, slots).transpose(0, 1)[None]
    sdpa, q4 = torch.nn.functional.scaled_dot_product_attention, q.transpose(0, 1)[None]
    if n_q == n_k:   # a whole prompt: causal from the start (a flash kernel, K/V heads shared)
        o = sdpa(q4, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:            # a later chunk: query i sits at position n_k - n_q + i
        pos = torch.arange(n_k - n_q, n_k, device=q.device)
        mask = torch.arange(n_k, device=q.device)[None, :] <= pos[:, None]
        group = q.shape[1] // k.shape[1]   # a masked kernel takes every head's K/V
        o = sdpa(q4, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
                 attn_mask=mask, scale=scale)
    return o[0].transpose(0, 1)


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _layer_type(module) -> str:
    return "sliding_attention" if getattr(module, "sliding_window", None) else "full_attention"
