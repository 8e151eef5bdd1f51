"""The decode as a registered PyTorch op, so that torch.compile(fullgraph=True) traces through it.

`DecodeWrapper.run` calls it while torch.compile traces; eager calls take the wrapper's own lean
launch path. The op mutates only the wrapper's workspace (partials and merge counters, which the
kernel leaves at zero).
"""
from __future__ import annotations

import torch

from .kernels.decode import decode_constexprs, paged_decode_kernel
from .runtime import interpreting


@torch.library.custom_op("persistentkv::paged_decode", mutates_args=("part_o", "part_lse", "counters"))
def paged_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                 meta: torch.Tensor, tasks: torch.Tensor, plan_info: torch.Tensor | None,
                 part_o: torch.Tensor,
                 part_lse: torch.Tensor, counters: torch.Tensor, cache_strides: list[int],
                 split_tokens: int, sm_scale: float, num_kv_heads: int, page_size: int,
                 persistent: bool, grid: list[int], block_n: int, num_warps: int,
                 num_stages: int) -> torch.Tensor:
    """out [B, Hq, D] = paged decode attention of q [B, Hq, D] (see kernels/decode.py).

    cache_strides: (page, head, token, K-to-V) strides of the pool in elements.
    """
    batch, num_qo_heads, head_dim = q.shape
    out = torch.empty((batch, num_qo_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    group = num_qo_heads // num_kv_heads
    paged_decode_kernel[tuple(grid)](
        q, k, v, out, out, indices, meta, tasks, meta if plan_info is None else plan_info, part_o,
        part_lse, counters, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *cache_strides,
        batch, tasks.shape[1], tasks.shape[1], split_tokens, sm_scale * 1.4426950408889634,
        **decode_constexprs(num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                            page_size=page_size, block_n=block_n, persistent=persistent,
                            tasks_on_device=plan_info is not None, return_lse=False,
                            upcast=interpreting()),
        num_warps=num_warps, num_stages=num_stages)
    return out


@paged_decode.register_fake
def _paged_decode_fake(q, k, v, indices, meta, tasks, plan_info, part_o, part_lse, counters, cache_strides,
                       split_tokens, sm_scale, num_kv_heads, page_size, persistent, grid, block_n,
                       num_warps, num_stages):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
