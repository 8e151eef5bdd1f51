"""A lean launch path for a Triton kernel: Triton's own binding on the first call of a
specialization, a direct call into the compiled launcher after that.

Triton's `kernel[grid](...)` binds and specializes every argument on every call (tens of us of host
time with two dozen arguments), and its launcher calls `data_ptr()` and a driver query
(cuPointerGetAttribute) for every tensor argument. A `BoundLaunch` fixes everything but the first
few pointer arguments once: the key pins everything Triton specializes on (dtypes, pointer
alignment, the int arguments' values), the fixed tensors go to the compiled launcher as integer
addresses, and a call pays for one `data_ptr()` per leading tensor and the launch itself.
"""
from __future__ import annotations

import functools

import torch
from triton import knobs

from .cache import check_v_transposed_cache
from .quant import FP8, check_cache_scales, check_scale
from .runtime import interpreting

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (   # what Triton itself uses
    lambda index: torch.cuda.current_stream(index).cuda_stream)


_runtime_knobs = knobs.runtime


def _hooked() -> bool:
    """A profiler (or anything else) has registered a launch hook with Triton: launches then go
    through Triton's own path, which calls the hooks. Triton 3.6 keeps the hooks in a HookChain
    (never None); an older Triton in a plain attribute."""
    enter, exit_ = _runtime_knobs.launch_enter_hook, _runtime_knobs.launch_exit_hook
    return bool(getattr(enter, "calls", enter) or getattr(exit_, "calls", exit_))


class Launcher:
    """The compiled specializations of one kernel, shared by every BoundLaunch of it."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict[tuple, object] = {}
        self.names = list(kernel.arg_names)

    def bind(self, *, grid: tuple[int, ...], key: tuple, fixed: tuple, constexprs: dict,
             num_warps: int, num_stages: int, device_index: int,
             launch_pdl: bool = False, max_registers: int | None = None) -> BoundLaunch:
        """A launch whose arguments after the leading tensors are `fixed` (tensors and scalars, in
        signature order), followed by `constexprs`. launch_pdl: Triton's launch option for
        programmatic dependent launch (the compiled kernel keeps it in its metadata, which the
        direct call reads); max_registers: Triton's maxnreg (None: the compiler's choice)."""
        return BoundLaunch(self, grid=grid, key=key, fixed=fixed, constexprs=constexprs,
                           num_warps=num_warps, num_stages=num_stages, device_index=device_index,
                           launch_pdl=launch_pdl, max_registers=max_registers)


class BoundLaunch:
    """launch(*leading): launch with the leading tensor arguments on the current stream of the
    bound device; launch.with_pointers(leading, pointers) when the caller already holds their
    data_ptr()s. The fixed tensors must outlive it (the caller holds them)."""

    def __init__(self, launcher: Launcher, *, grid, key, fixed, constexprs, num_warps, num_stages,
                 device_index, launch_pdl: bool = False, max_registers: int | None = None):
        self.launcher, self.key, self.fixed, self.constexprs = launcher, key, fixed, constexprs
        self.options = dict(num_warps=num_warps, num_stages=num_stages)
        if launch_pdl:   # only when on: Triton's default otherwise
            self.options["launch_pdl"] = True
        if max_registers is not None and not interpreting():   # a compile option
            self.options["maxnreg"] = max_registers
        self.grid, self.device_index = grid, device_index
        self.interpreted = interpreting()
        self.trailing = (*(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in fixed),
                         *constexprs.values())
        self.direct = None
        compiled = None if self.interpreted else launcher.compiled.get(key)
        if compiled is not None:
            self._set_direct(compiled)

    def _set_direct(self, compiled) -> None:
        g = self.grid + (1,) * (3 - len(self.grid))
        self.direct = (compiled.run, g[0], g[1], g[2], compiled.function, compiled.packed_metadata)

    def __call__(self, *leading) -> None:
        """Leading tensors go by their data_ptr(), leading scalars as they are."""
        self.with_pointers(leading, [t.data_ptr() if isinstance(t, torch.Tensor) else t
                                     for t in leading])

    def with_pointers(self, leading: tuple, pointers: list) -> None:
        """Launch; pointers[i] is leading[i].data_ptr()."""
        direct = self.direct
        if direct is not None and not _hooked():
            run, g0, g1, g2, function, metadata = direct
            run(g0, g1, g2, _raw_stream(self.device_index), function, metadata, None, None, None,
                *pointers, *self.trailing)
            return
        # Triton's own path: the first call of a specialization, the interpreter, or a profiler's
        # launch hook. The direct call passes arguments by position: they must follow the signature.
        names, n_args = self.launcher.names, len(leading) + len(self.fixed)
        if names != [*names[:n_args], *self.constexprs]:
            raise TypeError(f"{self.launcher.kernel.__name__}: constexprs {list(self.constexprs)} do "
                            f"not follow the signature {names[n_args:]}")
        compiled = self.launcher.kernel[self.grid](*leading, *self.fixed, **self.constexprs,
                                                   **self.options)
        if not self.interpreted:
            self.launcher.compiled[self.key] = compiled
            self._set_direct(compiled)


class DecodeLauncher:
    """run()'s side of a DecodeWrapper: checks run()'s arguments in full once per argument
    signature and plan binding (shapes, dtypes, devices, strides, alignment), then launches the
    decode kernel through a BoundLaunch; later layers only pay for the signature itself."""

    def __init__(self, kv_layout: str):
        from .kernels.decode import paged_decode_kernel   # kernels load after the interpreter choice

        self.kv_layout = kv_layout
        self._launcher = Launcher(paged_decode_kernel)
        self._prepared: dict = {}

    @property
    def compiled_kernels(self) -> tuple:
        """The kernel's compiled specializations so far (none under the interpreter)."""
        return tuple(self._launcher.compiled.values())

    def run(self, plan, q, kv_cache, out, return_lse: bool, sinks=None, scales=(None, None, None)):
        """Launch one layer; returns (out, lse or None). scales: (k_scale, v_scale, kv_scales) of
        an fp8 cache (run()'s arguments), all None for fp16/bf16."""
        k_scale, v_scale, kv_scales = scales
        if k_scale is not None or v_scale is not None:   # per call: the values change by layer
            k_scale, v_scale = check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)
        try:
            if isinstance(kv_cache, torch.Tensor):
                k = v = kv_cache
            else:
                k, v = kv_cache
            qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
            op = 0 if out is None else out.data_ptr()
            sig = (plan.launch_key, q.shape, q.dtype, q.device, q.stride(), qp % 16,
                   k.shape, k.dtype, k.device, k.stride(), kp % 16,
                   None if v is k else (v.shape, v.dtype, v.device, v.stride(), vp % 16),
                   None if out is None else (out.shape, out.dtype, out.device, out.stride(), op % 16),
                   return_lse,
                   None if sinks is None else (sinks.shape, sinks.dtype, sinks.device, sinks.stride(),
                                               sinks.data_ptr() % 16),
                   k_scale is None,
                   None if kv_scales is None else (kv_scales.shape, kv_scales.dtype,
                                                   kv_scales.device, kv_scales.stride(),
                                                   kv_scales.data_ptr() % 16))
        except (AttributeError, TypeError, ValueError):
            sig = None
        prepared = self._prepared.get(sig)
        if prepared is not None and plan.total_queries not in (None, q.shape[0]):
            check_q_rows(plan, q)   # launches are shared by plans of any batch: not by sig
        if prepared is None:
            prepared = self._prepare(plan, q, kv_cache, out, return_lse, sinks,
                                     k_scale is not None, kv_scales)
            if sig is not None:
                if len(self._prepared) > 64:   # launches of old plan bindings
                    self._prepared.clear()
                self._prepared[sig] = prepared
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
            op = out.data_ptr()
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
        if plan.batch_size and plan.total_queries != 0:
            if sig is None:   # checked by _prepare: a tensor or a (k, v) pair
                k, v = (kv_cache, kv_cache) if isinstance(kv_cache, torch.Tensor) else kv_cache
            if plan.guard is not None:   # a trusted table: its copy, once per plan() and pool
                plan.guard.ensure(k.shape[0])
            qo = plan.indices if plan.queries is None else plan.queries.indptr   # unread for decode
            sk = plan.indices if sinks is None else sinks                      # unread without
            ks = plan.indices if kv_scales is None else kv_scales
            kf, vf = (1.0, 1.0) if k_scale is None else (k_scale, v_scale)
            if sig is None:
                prepared(q, k, v, out, out if lse is None else lse, plan.indices, qo, sk, ks, kf, vf)
            else:
                prepared.with_pointers((q, k, v, out, out if lse is None else lse, plan.indices, qo,
                                        sk, ks, kf, vf),
                                       [qp, kp, vp, op, op if lse is None else lse.data_ptr(),
                                        plan.indices_ptr, qo.data_ptr(), sk.data_ptr(),
                                        ks.data_ptr(), kf, vf])
        return out, lse

    def _prepare(self, plan, q, kv_cache, out, return_lse: bool, sinks, tensor_scales: bool,
                 kv_scales) -> BoundLaunch:
        """Check run()'s arguments in full; the launch with everything but q, k, v, out, lse, the
        page indices, qo_indptr, the sinks and the fp8 scales bound."""
        from .checks import check_tensor
        from .kernels.decode import decode_constexprs

        k, v = check_run_inputs(plan, q, kv_cache, kv_layout=self.kv_layout, sinks=sinks,
                                tensor_scales=tensor_scales, kv_scales=kv_scales)
        fp8 = k.dtype == FP8
        if out is None:
            out_strides, out_align = (q.shape[1] * q.shape[2], q.shape[2], 1), 0
        else:
            check_tensor("out", out, dtype=q.dtype, dim=3)
            if out.shape != q.shape or out.device != q.device or out.stride(-1) != 1:
                raise ValueError(f"out must be like q ({list(q.shape)} on {q.device}, contiguous "
                                 f"along head_dim), got {list(out.shape)} on {out.device}")
            if q.shape[0] * q.shape[1] > 1 and 0 in out.stride()[:2]:
                raise ValueError(f"out must not overlap itself, got strides {out.stride()}")
            out_strides, out_align = out.stride(), out.data_ptr() % 16
        stride_page, stride_head, stride_tok = cache_strides(k, self.kv_layout)
        # V's offset from the pointer passed for it: the pool's K/V stride, or 0 for a (k, v) pair
        stride_kv = kv_cache.stride(1) if isinstance(kv_cache, torch.Tensor) else 0
        strides = (q.stride(0), q.stride(1), out_strides[0], out_strides[1], stride_page, stride_head,
                   stride_tok, stride_kv)
        ws = plan.workspace
        fixed = (ws.tasks, ws.first_pages, ws.info, ws.part_o, ws.part_lse, ws.counters,
                 ws.row_lens, *strides, plan.sm_scale * LOG2_E, q.shape[0], plan.window_left,
                 plan.logits_soft_cap or 1.0, k.shape[0])
        group = plan.num_qo_heads // plan.num_kv_heads
        max_queries = 1 if plan.queries is None else plan.queries.max_per_row
        cfg = plan.config
        constexprs = decode_constexprs(
            num_kv_heads=plan.num_kv_heads, group=group, head_dim=plan.head_dim,
            page_size=plan.page_size, return_lse=return_lse, upcast=interpreting(),
            pdl=use_pdl(cfg, q.device),
            max_queries=max_queries,
            window=plan.window_left >= 0, soft_cap=plan.logits_soft_cap > 0,
            sinks=sinks is not None, kv_fp8=fp8, token_scales=kv_scales is not None,
            v_transposed=self.kv_layout == "HND_VT", first_pages=cfg.first_pages,
            page_prefetch_tiles=cfg.page_prefetch_tiles,
            page_prefetch_task=cfg.page_prefetch_task, keep_page_table=cfg.keep_page_table,
            **cfg.tile_shape(tile_rows=max_queries * group, kv_fp8=fp8))
        max_registers = cfg.registers(tile_rows=max_queries * group)
        num_stages = cfg.stages(tile_rows=max_queries * group)
        # Everything Triton specializes on: the constexprs (PDL among them), the launch options,
        # the dtypes, the strides (by value) and the 16-byte alignment of the pointers (workspace
        # and fresh outputs come from torch's allocator, always aligned); a compiled kernel is
        # loaded on one device.
        key = (q.device.index, tuple(constexprs.values()), cfg.num_warps, num_stages,
               max_registers,
               q.dtype, strides,
               q.data_ptr() % 16, out_align,
               k.data_ptr() % 16, v.data_ptr() % 16, plan.indices.data_ptr() % 16,
               None if sinks is None else sinks.data_ptr() % 16,
               None if kv_scales is None else kv_scales.data_ptr() % 16)
        return self._launcher.bind(grid=(plan.programs,), key=key, fixed=fixed,
                                   constexprs=constexprs, num_warps=cfg.num_warps,
                                   num_stages=num_stages, device_index=q.device.index,
                                   launch_pdl=constexprs["PDL"],
                                   max_registers=max_registers)


def check_q_rows(plan, q: torch.Tensor) -> None:
    """q [total_q, Hq, D] as planned: total_q the batch size, qo_indptr[-1], or (graph mode's
    qo_indptr) any."""
    want = (plan.total_queries, plan.num_qo_heads, plan.head_dim)
    if plan.total_queries is None:
        want = (q.shape[0], *want[1:])
    if tuple(q.shape) != want:
        rows = "batch_size" if plan.queries is None else "qo_indptr[-1]"
        raise ValueError(f"q must be [{rows}, num_qo_heads, head_dim] = {list(want)} as "
                         f"planned, got {list(q.shape)}")


def check_run_inputs(plan, q, kv_cache, *, kv_layout: str, sinks, tensor_scales: bool,
                     kv_scales) -> tuple[torch.Tensor, torch.Tensor]:
    """run()'s checks of q [total_q, Hq, D], the cache (and an fp8 cache's scales) and the sinks
    against the plan, for the eager launch and for torch.compile's op alike; returns the cache's
    (k, v) views. tensor_scales: k_scale and v_scale were given (checked by the caller)."""
    from .cache import CACHE_DTYPES
    from .checks import check_same_device, check_sinks, check_tensor
    from .page_inputs import cache_views

    check_tensor("q", q, dtype=CACHE_DTYPES, dim=3)
    check_q_rows(plan, q)
    if q.stride(-1) != 1:
        raise ValueError(f"q must be contiguous along head_dim, got strides {q.stride()}")
    k, v, (num_pages, heads, page, dim) = cache_views(kv_cache, kv_layout)
    if kv_layout == "HND_VT":
        check_v_transposed_cache(k, page_size=page, head_dim=dim)
    check_cache_scales(cache_dtype=k.dtype, planned=plan.kv_data_type,
                       tensor_scales=tensor_scales, kv_scales=kv_scales, num_pages=num_pages,
                       num_kv_heads=heads, page_size=page, device=k.device)
    if k.dtype != FP8 and k.dtype != q.dtype:
        raise TypeError(f"q.dtype={q.dtype} differs from the kv_cache dtype {k.dtype}")
    check_same_device(plan.indices.device, q=q, kv_cache=k)
    if (heads, page, dim) != (plan.num_kv_heads, plan.page_size, plan.head_dim):
        raise ValueError(f"kv_cache ({kv_layout}) has num_kv_heads={heads}, page_size={page}, "
                         f"head_dim={dim}; the plan has {plan.num_kv_heads}, {plan.page_size}, "
                         f"{plan.head_dim}")
    if num_pages == 0 and plan.guard is not None and plan.batch_size:
        raise ValueError(f"kv_cache has no pages (shape {list(k.shape)}): a trusted page table's "
                         f"entries outside the pool read page 0 (check_page_table=False)")
    if plan.max_page_index >= num_pages:
        raise ValueError(f"{plan.max_page_at}={plan.max_page_index} is a page index outside "
                         f"the pool of {num_pages} pages")
    if sinks is not None:
        check_sinks(sinks, num_qo_heads=plan.num_qo_heads, device=plan.indices.device)
    return k, v


LOG2_E = 1.4426950408889634


def use_pdl(config, device: torch.device) -> bool:
    """Whether the decode kernel is compiled and launched with programmatic dependent launch:
    config.pdl, on a GPU of compute capability 9.0 or later (never under the interpreter, which
    has no griddepcontrol and no launch_pdl)."""
    return (config.pdl and not interpreting() and device.type == "cuda"
            and _capability(device.index if device.index is not None
                            else torch.cuda.current_device()) >= (9, 0))


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cache_strides(k: torch.Tensor, kv_layout: str) -> tuple[int, int, int]:
    """(page, head, token) strides of K in elements: k is [P, H, S, D] (HND) or [P, S, H, D] (NHD)."""
    if kv_layout != "NHD":   # HND, and HND_VT's K
        return k.stride(0), k.stride(1), k.stride(2)
    return k.stride(0), k.stride(2), k.stride(1)
