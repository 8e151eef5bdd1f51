"""The decode as a registered PyTorch op, so that torch.compile(fullgraph=True) traces through it.

`DecodeWrapper.run` calls it while torch.compile traces; eager calls take the wrapper's own lean
launch path. The op mutates only the plan's workspace (partials, merge counters and the claim
counter, which the kernel leaves at zero).
"""
from __future__ import annotations

import torch

from .kernels.decode import decode_constexprs, paged_decode_kernel
from .kernels.guard import GUARD_BLOCK, guard_grid, guard_pages_kernel
from .launch import LOG2_E, cache_strides, check_run_inputs, use_pdl
from .quant import FP8, check_scale
from .runtime import interpreting


@torch.library.custom_op("persistentkv::paged_decode",
                         mutates_args=("info", "part_o", "part_lse", "counters"))
def paged_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                 qo_indptr: torch.Tensor, sinks: torch.Tensor | None,
                 kv_scales: torch.Tensor | None, k_scale: float, v_scale: float,
                 tasks: torch.Tensor, first_pages: torch.Tensor, info: torch.Tensor,
                 part_o: torch.Tensor, part_lse: torch.Tensor, counters: torch.Tensor,
                 row_lens: torch.Tensor, cache_strides: list[int], sm_scale: float,
                 num_kv_heads: int, page_size: int, programs: int, block_n: int, num_warps: int,
                 num_stages: int, max_queries: int, window_left: int,
                 logits_soft_cap: float, pdl: bool = False,
                 v_transposed: bool = False, max_registers: int | None = None,
                 long_block_n: int = 0, long_from_tokens: int = 0,
                 m_blocks: int = 1, g_pad: int = 0, d_blocks: int = 1,
                 read_first_pages: bool = False, page_prefetch_tiles: int = 0,
                 page_prefetch_task: bool = False, keep_page_table: bool = False) -> torch.Tensor:
    """out [total_q, Hq, D] = paged decode attention of q [total_q, Hq, D] (kernels/decode.py;
    max_queries 1: one query per row, qo_indptr unread; window_left -1, logits_soft_cap 0 and
    sinks None: off; an fp8 k, v: scaled by k_scale and v_scale, or per token by kv_scales;
    pdl: launched with programmatic dependent launch, as launch.use_pdl decided; v_transposed:
    V's blocks in the HND_VT layout; max_registers: Triton's maxnreg, None for the compiler's
    choice; long_block_n, long_from_tokens: the tile of long tasks, 0 for none; m_blocks:
    programs that share a task's tile rows; g_pad: rows of a program's tile, 0 for the
    tile's own; d_blocks: programs that share a task's output columns; read_first_pages: the
    first K/V tile's pages from the planner's copy in first_pages, KernelConfig.first_pages;
    page_prefetch_tiles, page_prefetch_task, keep_page_table: KernelConfig's, how the page
    indices are fetched).

    cache_strides: (page, head, token, K-to-V) strides of the pool in elements.

    Internal: the arguments are a plan's (traced_decode, from DecodeWrapper.run, passes them after
    run()'s checks); the op checks none of them, and inconsistent ones read or write wrongly.
    """
    total, num_qo_heads, head_dim = q.shape
    out = torch.empty((total, num_qo_heads, head_dim), dtype=q.dtype, device=q.device)
    if total == 0:
        return out
    paged_decode_kernel[(programs,)](
        q, k, v, out, out, indices, qo_indptr, indices if sinks is None else sinks,
        indices if kv_scales is None else kv_scales, k_scale, v_scale, tasks, first_pages, info,
        part_o, part_lse, counters, row_lens, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), *cache_strides, sm_scale * LOG2_E, total, window_left,
        logits_soft_cap or 1.0, k.shape[0],
        **decode_constexprs(num_kv_heads=num_kv_heads, group=num_qo_heads // num_kv_heads,
                            head_dim=head_dim, page_size=page_size, block_n=block_n,
                            return_lse=False, upcast=interpreting(), max_queries=max_queries,
                            window=window_left >= 0, soft_cap=logits_soft_cap > 0,
                            sinks=sinks is not None, kv_fp8=k.dtype == FP8,
                            token_scales=kv_scales is not None, pdl=pdl,
                            v_transposed=v_transposed, long_block_n=long_block_n,
                            long_from_tokens=long_from_tokens, m_blocks=m_blocks,
                            g_pad=g_pad or None, d_blocks=d_blocks,
                            first_pages=read_first_pages,
                            page_prefetch_tiles=page_prefetch_tiles,
                            page_prefetch_task=page_prefetch_task,
                            keep_page_table=keep_page_table),
        num_warps=num_warps, num_stages=num_stages, **({"launch_pdl": True} if pdl else {}),
        **({"maxnreg": max_registers} if max_registers is not None and not interpreting() else {}))
    return out


@paged_decode.register_fake
def _paged_decode_fake(q, k, v, indices, qo_indptr, sinks, kv_scales, k_scale, v_scale, tasks,
                       first_pages, info, part_o, part_lse, counters,
                       row_lens, cache_strides, sm_scale, num_kv_heads, page_size, programs,
                       block_n, num_warps, num_stages, max_queries, window_left, logits_soft_cap,
                       pdl=False, v_transposed=False, max_registers=None, long_block_n=0,
                       long_from_tokens=0, m_blocks=1, g_pad=0, d_blocks=1,
                       read_first_pages=False, page_prefetch_tiles=0,
                       page_prefetch_task=False, keep_page_table=False):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


@torch.library.custom_op("persistentkv::guard_pages", mutates_args=("safe", "info"))
def guard_pages(indices: torch.Tensor, meta: torch.Tensor, safe: torch.Tensor, info: torch.Tensor,
                num_rows: int, row_stride: int, width: int, span: int, num_pages: int,
                page_size: int, csr: bool) -> None:
    """safe = the page table with entries outside the pool replaced by 0 (see kernels/guard.py)."""
    guard_pages_kernel[guard_grid(span)](
        indices, meta, safe, info, num_rows, row_stride, width, span, num_pages,
        PAGE_SIZE=page_size, CSR=csr, BLOCK=GUARD_BLOCK)


@guard_pages.register_fake
def _guard_pages_fake(indices, meta, safe, info, num_rows, row_stride, width, span, num_pages,
                      page_size, csr):
    return None


def traced_decode(plan, q, kv_cache, out, return_lse: bool, sinks=None,
                  scales=(None, None, None), *, kv_layout: str) -> torch.Tensor:
    """run() under torch.compile: the registered op, which the compiler can trace."""
    if out is not None or return_lse:
        raise ValueError("under torch.compile, run() returns a new output and no lse: "
                         "call it without out= and return_lse=")
    k_scale, v_scale, kv_scales = scales
    k, v = check_run_inputs(plan, q, kv_cache, kv_layout=kv_layout, sinks=sinks,
                            tensor_scales=k_scale is not None or v_scale is not None,
                            kv_scales=kv_scales)
    if k_scale is not None or v_scale is not None:
        k_scale, v_scale = check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)
    strides = list(cache_strides(k, kv_layout))
    if isinstance(kv_cache, torch.Tensor):
        k = v = kv_cache
        strides.append(kv_cache.stride(1))
    else:
        strides.append(0)
    ws, cfg, guard = plan.workspace, plan.config, plan.guard
    if guard is not None:   # a trusted table: its copy, at every layer (no host state when traced)
        guard_pages(*guard.leading, *guard.fixed, k.shape[0], guard.page_size, guard.csr)
    queries = plan.queries
    max_queries = 1 if queries is None else queries.max_per_row
    tile_rows = max_queries * (plan.num_qo_heads // plan.num_kv_heads)
    tile = cfg.tile_shape(tile_rows=tile_rows, kv_fp8=k.dtype == FP8)
    return paged_decode(q, k, v, plan.indices,
                        plan.indices if queries is None else queries.indptr, sinks, kv_scales,
                        1.0 if k_scale is None else k_scale, 1.0 if v_scale is None else v_scale,
                        ws.tasks, ws.first_pages, ws.info,
                        ws.part_o, ws.part_lse, ws.counters, ws.row_lens, strides, plan.sm_scale,
                        plan.num_kv_heads, plan.page_size, plan.programs,
                        tile["block_n"], cfg.num_warps, cfg.stages(tile_rows=tile_rows),
                        max_queries,
                        plan.window_left,
                        plan.logits_soft_cap, use_pdl(cfg, q.device), kv_layout == "HND_VT",
                        cfg.registers(tile_rows=tile_rows), tile["long_block_n"],
                        tile["long_from_tokens"], tile["m_blocks"], tile["g_pad"],
                        tile["d_blocks"], cfg.first_pages, cfg.page_prefetch_tiles,
                        cfg.page_prefetch_task, cfg.keep_page_table)
