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
transformers would write them. Every row goes through the decode kernel: a row of more than 16
query tokens (a prompt or a prefill chunk) is cut into pieces of at most 16 queries, each a row
of its own whose causal horizon ends at its last query, reading the same pages. The plan reads
the step's lengths on the host once (one synchronization per step, not per layer).

Full-attention layers only (Llama, Qwen2, Mistral without a window); a model with sliding-window
layers or attention sinks is refused with a ValueError. The model's dtype must be float16 or
bfloat16. The host read of each step does not go into a CUDA graph: on a GPU run generate_batch
with ContinuousBatchingConfig(use_cuda_graph=False) (transformers turns graphs on by default for
an implementation that needs no attention mask). Requires transformers 5.17
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
    """One continuous-batching cache's wrapper and the last step it planned."""

    def __init__(self):
        self.wrapper = DecodeWrapper("NHD")
        self.total_q = 0


def step_rows(cu_q: np.ndarray, cu_k: np.ndarray, slots: np.ndarray, block_size: int,
              pieces_of: int = MAX_QUERIES_PER_ROW):
    """The step's rows as the kernel takes them: (block_table int32 [R, max pages], seq_lens
    int32 [R], qo_indptr int32 [R + 1]). Request b's q rows cu_q[b]:cu_q[b+1] are the last
    tokens of its cu_k[b+1] - cu_k[b]; slots[cu_k[b] + t] is the cache slot of its token t (a
    token's page is slot // block_size). A request of n > pieces_of queries becomes
    ceil(n / pieces_of) rows of at most pieces_of queries, piece p's length ending at its last
    query."""
    q_lens, k_lens = np.diff(cu_q), np.diff(cu_k)
    rows_pages, seq_lens, counts = [], [], []
    for b, (n_q, n_k) in enumerate(zip(q_lens.tolist(), k_lens.tolist())):
        pages = slots[cu_k[b]: cu_k[b] + n_k: block_size] // block_size
        for first in range(0, max(n_q, 1), pieces_of):
            n = max(0, min(pieces_of, n_q - first))
            rows_pages.append(pages)
            seq_lens.append(n_k - n_q + first + n if n else 0)
            counts.append(n)
    width = max(1, max(len(p) for p in rows_pages))
    table = np.zeros((len(rows_pages), width), dtype=np.int32)
    for r, pages in enumerate(rows_pages):
        table[r, : len(pages)] = pages
    qo_indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return table, np.asarray(seq_lens, dtype=np.int32), qo_indptr


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
    if module.layer_idx == min(cache.layer_index_to_group_indices):   # a new step: plan it
        if _capturing():
            raise ValueError(f"{NAME} plans each step on the host: run generate_batch with "
                             f"ContinuousBatchingConfig(use_cuda_graph=False)")
        cu_q_host = cu_seq_lens_q.cpu().numpy().astype(np.int64)
        cu_k_host = cu_k.cpu().numpy().astype(np.int64)
        reads = read_index[group] if read_index is not None and len(read_index) else None
        slots = (reads if reads is not None and reads.numel() else write_index[group])
        table, seq_lens, qo_indptr = step_rows(cu_q_host, cu_k_host, slots.cpu().numpy(),
                                               cache.block_size)
        device = k_cache.device
        state.wrapper.plan(block_table=torch.from_numpy(table).to(device),
                           seq_lens=torch.from_numpy(seq_lens), qo_indptr=torch.from_numpy(qo_indptr),
                           num_qo_heads=query.shape[1], num_kv_heads=cache.num_key_value_heads,
                           head_dim=cache.head_dim, page_size=cache.block_size,
                           sm_scale=module.scaling)
        state.total_q = int(qo_indptr[-1])
    q = query[0].transpose(0, 1)                          # [total_q (padded), Hq, D]
    out = torch.zeros_like(q)
    shape = (-1, cache.block_size, cache.num_key_value_heads, cache.head_dim)
    state.wrapper.run(q[: state.total_q].contiguous(), (k_cache.view(shape), v_cache.view(shape)),
                      out=out[: state.total_q])
    return out.unsqueeze(0), None


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _layer_type(module) -> str:
    return "sliding_attention" if getattr(module, "sliding_window", None) else "full_attention"
