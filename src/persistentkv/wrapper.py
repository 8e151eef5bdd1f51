"""DecodeWrapper: plan() once per decode step on the host, run() once per layer.

    wrapper = DecodeWrapper(kv_layout="NHD")
    wrapper.plan(kv_indptr=..., kv_indices=..., kv_last_page_len=..., num_qo_heads=32,
                 num_kv_heads=8, head_dim=128, page_size=16, backend="workqueue")
    out = wrapper.run(q, kv_cache)           # q [B, Hq, D] -> out [B, Hq, D]
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .cache import CACHE_DTYPES, check_layout
from .checks import check_positive_int, check_same_device, check_tensor
from .kernels.decode import decode_constexprs, paged_decode_kernel
from .kernels.plan import plan_workqueue_kernel
from .launch import BoundLaunch, Launcher
from .page_inputs import block_rows, cache_views, check_block_shapes, check_csr_shapes, csr_rows
from .runtime import check_interpreter_numpy, interpreting, next_power_of_2, sm_count
from .schedule import (BACKENDS, ONE_ROUND_SLACK, ONE_ROUND_STEPS, WHOLE_ROW_SLACK, Schedule,
                       balanced_task_count, build_schedule, whole_row_min_rows)
from .tuning import KernelConfig, default_config

MAX_GROUP = 64
DETERMINISTIC_SPLIT_TOKENS = 512  # split size of deterministic (batch-invariant) plans
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class DecodePlan:
    """Everything run() needs, fixed by plan(). meta and tasks: views into one int32 upload
    (host plans) or the static buffers of graph mode."""

    batch_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    sm_scale: float
    schedule: Schedule
    indices: torch.Tensor       # flat page indices: kv_indices, or block_table (row-major)
    meta: torch.Tensor          # int32 [3, B]
    tasks: torch.Tensor         # int32 [2, task capacity]
    max_page_index: int
    device: torch.device
    config: KernelConfig
    plan_info: torch.Tensor | None = None   # int32 [2] (task count, split tokens), planned on the GPU
    exact_max_page: Callable[[], int] | None = None  # when max_page_index is only an upper bound


class DecodeWrapper:
    """Paged GQA decode attention with a page-aware schedule, planned once per step.

    With use_cuda_graph=True, plan() runs on the GPU (no host sync, no host reads of the page
    table) into buffers sized for max_batch_size rows and max_num_pages pages referenced per step,
    so that plan() + run() can be captured in one CUDA graph and replayed for every batch
    composition: fill the same page-table tensors in place before each replay; rows with no pages
    (CSR) or seq_lens 0 are inactive and their output rows are left untouched. Graph mode uses the
    work-queue schedule; the GPU planner picks each step's split size from that step's lengths by
    the host planner's rule (schedule.default_split_pages), or uses split_pages when given (then
    max_num_pages bounds the task buffer). It trusts the page table: it checks shapes and dtypes,
    not the indices' values.
    """

    def __init__(self, kv_layout: str = "NHD", *, device: torch.device | str | None = None,
                 use_cuda_graph: bool = False, max_batch_size: int | None = None,
                 max_num_pages: int | None = None, policy=None):
        self.kv_layout = check_layout(kv_layout)
        self.policy = policy   # for backend="auto"; default: the policy shipped for the GPU
        self._device = None if device is None else torch.device(device)
        self.use_cuda_graph = bool(use_cuda_graph)
        if self.use_cuda_graph:
            check_positive_int("max_batch_size", max_batch_size)
            check_positive_int("max_num_pages", max_num_pages)
        elif max_batch_size is not None or max_num_pages is not None:
            raise ValueError("max_batch_size and max_num_pages size the buffers of "
                             "use_cuda_graph=True; leave them out otherwise")
        self.max_batch_size, self.max_num_pages = max_batch_size, max_num_pages
        self._graph_buffers: dict[str, torch.Tensor] = {}
        self._planner = Launcher(plan_workqueue_kernel)
        self._graph_memo: _GraphMemo | None = None
        self._plan: DecodePlan | None = None
        self._part_o = torch.empty(0)
        self._part_lse = torch.empty(0)
        self._counters = torch.zeros(0, dtype=torch.int32)
        self._launcher = Launcher(paged_decode_kernel)
        self._prepared: dict = {}

    @property
    def plan_info(self) -> DecodePlan:
        if self._plan is None:
            raise RuntimeError("run() called before plan()")
        return self._plan

    def plan(self, *, kv_indptr: torch.Tensor | None = None, kv_indices: torch.Tensor | None = None,
             kv_last_page_len: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
             seq_lens: torch.Tensor | None = None, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, backend: str = "workqueue",
             split_pages: int | None = None, sm_scale: float | None = None,
             config: KernelConfig | None = None, deterministic: bool = False,
             check_indices: bool = True) -> DecodePlan:
        """Plan one decode step from a CSR page table or from block_table + seq_lens.

        CSR (FlashInfer): kv_indptr int32 [B+1], kv_indices int32 [nnz], kv_last_page_len int32 [B]
        (in [1, page_size]). Block table (vLLM): block_table int32 [B, max_pages], seq_lens int32 [B].
        kv_indices and block_table live on the kernel's device; kv_indptr, kv_last_page_len and
        seq_lens may be there too or on the host (then plan() copies nothing back from the device
        but its one check of the page indices' range; with check_indices=False not even that: the
        page table is trusted, as in graph mode, and plan() never waits for the device).
        backend: "grouped", "split", "workqueue" or "auto" (the adaptive policy's choice among
        them, policy.py); split_pages: pages per split (default: about
        config.waves tasks per SM); sm_scale defaults to 1/sqrt(head_dim); config: the kernel's
        tile and launch shape (default: tuning.default_config). deterministic=True makes the output
        batch-invariant: splits of a fixed size in tokens (split_pages, default
        DETERMINISTIC_SPLIT_TOKENS), so a row's result is bitwise the same whatever else is in the
        batch (the merge order is fixed in every mode); with backend="auto" it plans "split".
        """
        check_interpreter_numpy()
        if self.use_cuda_graph:   # the same page-table tensors and options as the last plan()?
            tables = (kv_indptr, kv_indices, kv_last_page_len, block_table, seq_lens)
            options = (num_qo_heads, num_kv_heads, head_dim, page_size, backend, split_pages,
                       sm_scale, config, deterministic, check_indices)
            if self._graph_replan(tables, options):
                return self._plan
        for name, value in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("page_size", page_size)):
            check_positive_int(name, value)
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} must be a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        if num_qo_heads // num_kv_heads > MAX_GROUP:
            raise ValueError(f"group size num_qo_heads/num_kv_heads={num_qo_heads // num_kv_heads} "
                             f"is over the supported {MAX_GROUP}")
        if head_dim % 16 or head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be a multiple of 16 up to {MAX_HEAD_DIM}, got {head_dim}")
        if backend not in BACKENDS + ("auto",):
            raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
        if split_pages is not None:
            check_positive_int("split_pages", split_pages)
        for name, flag in (("deterministic", deterministic), ("check_indices", check_indices)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        if deterministic and split_pages is None:
            split_pages = _fixed_split_pages(page_size)
        if config is None:
            config = default_config(head_dim=head_dim)
        elif not isinstance(config, KernelConfig):
            raise TypeError(f"config must be a KernelConfig, got {type(config).__name__}")
        if sm_scale is not None and not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale)
                                         and sm_scale > 0):
            raise ValueError(f"sm_scale must be a positive finite float, got {sm_scale!r}")

        csr = (kv_indptr, kv_indices, kv_last_page_len)
        block = (block_table, seq_lens)
        if self.use_cuda_graph:
            plan, launch, leading = self._plan_on_device(
                csr, block, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, page_size=page_size, backend=backend, split_pages=split_pages,
                sm_scale=sm_scale, config=config)
            self._graph_memo = _GraphMemo(tables, tuple(t.shape for t in tables if t is not None),
                                          options, plan, launch, leading)
            return plan
        if all(t is not None for t in csr) and all(t is None for t in block):
            lens, starts, (lo, hi), exact_used = csr_rows(*csr, page_size, bounds=check_indices)
            indices, device = kv_indices, kv_indices.device
        elif all(t is not None for t in block) and all(t is None for t in csr):
            lens, starts, (lo, hi), exact_used = block_rows(*block, page_size, bounds=check_indices)
            indices, device = block_table, block_table.device
        else:
            raise ValueError("give either kv_indptr, kv_indices and kv_last_page_len (CSR) or "
                             "block_table and seq_lens, not a mix")
        if self._device is not None and device != self._device:
            raise ValueError(f"page table is on {device}, but the wrapper was built for {self._device}")
        zero = np.flatnonzero(lens < 1)
        if len(zero):
            raise ValueError(f"row {int(zero[0])} has length {int(lens[zero[0]])}: every row needs at "
                             f"least one token")
        # lo, hi bound the whole table; entries past the used ones (padding, stale pages) may be
        # out of range, so an inconclusive bound is settled on the used entries alone.
        max_page = hi   # an upper bound; run() checks it against the pool (exactly if needed)
        if check_indices and lo < 0:
            used = exact_used()
            lo, max_page = (int(x) for x in torch.aminmax(used)) if used.numel() else (0, -1)
            if lo < 0:
                raise ValueError(f"page index {lo} in the page table is negative")

        if backend == "auto" and deterministic:
            backend = "split"   # a per-step choice of schedule would break batch invariance
        if backend == "auto":
            choice = self._choose(lens, device=device, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                  page_size=page_size, group=num_qo_heads // num_kv_heads)
            backend = choice.backend.removeprefix("pkv-")
            if backend == "graph":   # the work-queue with the default split, planned on the GPU
                backend = "workqueue"
            if split_pages is None:
                split_pages = choice.split_pages
        schedule = build_schedule(lens, starts, backend=backend, page_size=page_size,
                                  num_kv_heads=num_kv_heads, sm_count=sm_count(device),
                                  split_pages=split_pages, config=config)
        packed = np.concatenate([schedule.meta.ravel(), schedule.tasks.ravel()])
        packed = torch.from_numpy(packed.astype(np.int32)).to(device, non_blocking=True)
        batch, n_tasks = len(lens), schedule.tasks.shape[1]
        meta = packed[: 3 * batch].view(3, batch)
        tasks = packed[3 * batch:].view(2, n_tasks)
        self._reserve_workspace(max(1, schedule.num_slots * num_qo_heads), head_dim,
                                max(1, batch * num_kv_heads), device)
        self._plan = DecodePlan(
            batch_size=batch, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, page_size=page_size,
            sm_scale=float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim),
            schedule=schedule, indices=indices, meta=meta, tasks=tasks, max_page_index=max_page,
            device=device, config=config,
            exact_max_page=(lambda: _max_or(exact_used(), -1)) if check_indices else None)
        self._prepared = {}
        return self._plan

    def _choose(self, lens, *, device, num_kv_heads, head_dim, page_size, group):
        """backend="auto": the policy's PersistentKV choice for this step (policy.py)."""
        from .policy import StepFeatures, load_policy

        if self.policy is None:
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            self.policy = load_policy(name)
        features = StepFeatures.of(lens, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                   elem_size=2, sm_count=sm_count(device), page_size=page_size,
                                   group=group)
        return self.policy.decide(features, pkv_only=True)

    def _graph_replan(self, tables: tuple, options: tuple) -> bool:
        """plan() of graph mode with the page-table tensors (the same objects, of the same shapes)
        and options of the last one, already checked: only the GPU planner's launch again. The
        plan, and run()'s prepared launches, stay as they are."""
        memo = self._graph_memo
        if memo is None or memo.options != options:
            return False
        for t, known in zip(tables, memo.tables):
            if t is not known:
                return False
        if tuple(t.shape for t in tables if t is not None) != memo.shapes:
            return False
        memo.launch(*memo.leading)
        self._plan = memo.plan
        return True

    def _plan_on_device(self, csr, block, *, num_qo_heads, num_kv_heads, head_dim, page_size,
                        backend, split_pages, sm_scale, config):
        """plan() of graph mode: one launch of the GPU planner; capturable. Returns the plan, the
        planner's bound launch and its page-table arguments."""
        if backend not in ("workqueue", "auto"):
            raise ValueError(f"use_cuda_graph=True plans the work-queue schedule; got backend={backend!r}")
        max_b = self.max_batch_size
        if all(t is not None for t in csr) and all(t is None for t in block):
            kv_indptr, kv_indices, kv_last_page_len = csr
            if check_csr_shapes(*csr) != max_b:
                raise ValueError(f"graph mode takes page tables of max_batch_size={max_b} rows: "
                                 f"kv_indptr [{max_b + 1}] and kv_last_page_len [{max_b}], got "
                                 f"{list(kv_indptr.shape)} and {list(kv_last_page_len.shape)}")
            indices, lens_src, is_csr, row_stride = kv_indices, kv_last_page_len, True, 0
            check_same_device(kv_indices.device, kv_indptr=kv_indptr, kv_last_page_len=kv_last_page_len)
        elif all(t is not None for t in block) and all(t is None for t in csr):
            block_table, seq_lens = block
            if check_block_shapes(*block) != max_b:
                raise ValueError(f"graph mode takes page tables of max_batch_size={max_b} rows: "
                                 f"block_table [{max_b}, W] and seq_lens [{max_b}], got "
                                 f"{list(block_table.shape)} and {list(seq_lens.shape)}")
            check_same_device(block_table.device, seq_lens=seq_lens)
            indices, lens_src, is_csr, row_stride = block_table, seq_lens, False, block_table.stride(0)
            kv_indptr = kv_last_page_len = seq_lens
        else:
            raise ValueError("give either kv_indptr, kv_indices and kv_last_page_len (CSR) or "
                             "block_table and seq_lens, not a mix")
        device = indices.device
        sms = sm_count(device)
        target_tasks = balanced_task_count(num_kv_heads=num_kv_heads, sm_count=sms, config=config)
        adaptive = split_pages is None
        if adaptive:   # split size chosen on the GPU: at most one task per row past target_tasks
            split_tokens, capacity = 0, max_b + target_tasks
        else:
            split_tokens = split_pages * page_size
            capacity = max_b + -(-self.max_num_pages * page_size // split_tokens)
        bufs = self._graph_buffers
        if (not bufs or bufs["tasks"].shape[1] != capacity or bufs["meta"].device != device):
            bufs.update(meta=torch.zeros(3, max_b, dtype=torch.int32, device=device),
                        tasks=torch.zeros(2, capacity, dtype=torch.int32, device=device),
                        plan_info=torch.zeros(2, dtype=torch.int32, device=device))
        self._reserve_workspace(capacity * num_qo_heads, head_dim, max_b * num_kv_heads, device)
        # one launch of the GPU planner, with everything but the page-table tensors bound (a key
        # compiled before launches directly; _graph_replan reuses this launch)
        fixed = (bufs["meta"], bufs["tasks"], bufs["plan_info"], max_b, capacity, split_tokens,
                 row_stride, target_tasks, config.min_split_tokens,
                 whole_row_min_rows(num_kv_heads=num_kv_heads, sm_count=sms), WHOLE_ROW_SLACK,
                 ONE_ROUND_SLACK)
        constexprs = dict(PAGE_SIZE=page_size, BLOCK_ROWS=next_power_of_2(max_b),
                          BLOCK_SPLITS=32, CSR=is_csr, ADAPTIVE=adaptive,
                          ONE_ROUND_STEPS=ONE_ROUND_STEPS if config.one_round else 0)
        leading = (kv_indptr, kv_last_page_len, lens_src)
        key = (*fixed[3:], *constexprs.values(), device.index, *(t.data_ptr() % 16 for t in leading))
        launch = self._planner.bind(grid=(max_b,), key=key, fixed=fixed, constexprs=constexprs,
                                    num_warps=4, num_stages=3, device_index=device.index)
        launch(*leading)
        # no more programs than (task, KV head) pairs the buffers can hold: a program that can never
        # get a task would still take a slot on an SM
        programs = min(config.programs_per_sm * sms, capacity * num_kv_heads)
        # split_pages and split_tokens 0: chosen per step on the GPU (plan_info holds them)
        schedule = Schedule(backend="workqueue", split_pages=split_pages or 0,
                            split_tokens=split_tokens,
                            meta=np.zeros((3, 0), np.int32), tasks=np.zeros((2, 0), np.int32),
                            num_slots=capacity, grid=(programs,))
        self._plan = DecodePlan(
            batch_size=max_b, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, page_size=page_size,
            sm_scale=float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim),
            schedule=schedule, indices=indices, meta=bufs["meta"], tasks=bufs["tasks"],
            max_page_index=-1, device=device, config=config, plan_info=bufs["plan_info"])
        self._prepared = {}
        return self._plan, launch, leading

    def _reserve_workspace(self, partials: int, head_dim: int, counters: int,
                           device: torch.device) -> None:
        """Grow-only buffers: partial outputs and lse, and the per-(row, KV head) merge counters
        (zeroed once; the kernel leaves them at zero)."""
        if self._part_lse.numel() < partials or self._part_lse.device != device:
            self._part_lse = torch.empty(partials, dtype=torch.float32, device=device)
        if self._part_o.numel() < partials * head_dim or self._part_o.device != device:
            self._part_o = torch.empty(partials * head_dim, dtype=torch.float32, device=device)
        if self._counters.numel() < counters or self._counters.device != device:
            self._counters = torch.zeros(counters, dtype=torch.int32, device=device)

    def run(self, q: torch.Tensor, kv_cache, *, out: torch.Tensor | None = None,
            return_lse: bool = False):
        """Decode attention for one layer.

        q: [B, Hq, D] fp16/bf16, the cache's dtype. kv_cache: [P, 2, H, S, D] (HND) or [P, 2, S, H, D]
        (NHD), or a (k, v) pair of [P, H, S, D] / [P, S, H, D]. Returns out [B, Hq, D] in q's dtype,
        and with return_lse=True also lse [B, Hq] float32: the natural-log log-sum-exp of the
        scaled scores, sm_scale * q.k.
        """
        plan = self._plan
        if plan is None:
            raise RuntimeError("run() called before plan()")
        if torch.compiler.is_compiling():
            return self._run_traced(plan, q, kv_cache, out, return_lse)
        # The arguments are checked in full once per plan and argument signature (shapes, dtypes,
        # devices, strides, alignment); later layers with the same signature only pay for the
        # signature itself, and the data pointers it reads go straight to the launch.
        try:
            if isinstance(kv_cache, torch.Tensor):
                k = v = kv_cache
            else:
                k, v = kv_cache
            qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
            op = 0 if out is None else out.data_ptr()
            sig = (q.shape, q.dtype, q.device, q.stride(), qp % 16,
                   k.shape, k.dtype, k.device, k.stride(), kp % 16,
                   None if v is k else (v.shape, v.dtype, v.device, v.stride(), vp % 16),
                   None if out is None else (out.shape, out.dtype, out.device, out.stride(), op % 16),
                   return_lse)
        except (AttributeError, TypeError, ValueError):
            sig = None
        prepared = self._prepared.get(sig)
        if prepared is None:
            prepared = self._prepare(plan, q, kv_cache, out, return_lse)
            if sig is not None:
                self._prepared[sig] = prepared
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
            op = out.data_ptr()
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else out
        if plan.batch_size:
            if sig is None:   # checked by _prepare: a tensor or a (k, v) pair
                k, v = (kv_cache, kv_cache) if isinstance(kv_cache, torch.Tensor) else kv_cache
                prepared(q, k, v, out, lse)
            else:
                prepared.with_pointers((q, k, v, out, lse),
                                       [qp, kp, vp, op, lse.data_ptr() if return_lse else op])
        return (out, lse) if return_lse else out

    def _run_traced(self, plan: DecodePlan, q, kv_cache, out, return_lse: bool) -> torch.Tensor:
        """run() under torch.compile: the registered op (see op.py), which the compiler can trace."""
        from .op import paged_decode

        if out is not None or return_lse:
            raise ValueError("under torch.compile, run() returns a new output and no lse: "
                             "call it without out= and return_lse=")
        k, v, _ = cache_views(kv_cache, self.kv_layout)
        stride_page = k.stride(0)
        stride_head, stride_tok = ((k.stride(1), k.stride(2)) if self.kv_layout == "HND"
                                   else (k.stride(2), k.stride(1)))
        if isinstance(kv_cache, torch.Tensor):
            k = v = kv_cache
            stride_kv = kv_cache.stride(1)
        else:
            stride_kv = 0
        sched, cfg = plan.schedule, plan.config
        return paged_decode(q, k, v, plan.indices, plan.meta, plan.tasks, plan.plan_info,
                            self._part_o,
                            self._part_lse, self._counters,
                            [stride_page, stride_head, stride_tok, stride_kv], sched.split_tokens,
                            plan.sm_scale, plan.num_kv_heads, plan.page_size,
                            sched.backend == "workqueue", list(sched.grid), cfg.block_n,
                            cfg.num_warps, cfg.num_stages)

    def _prepare(self, plan: DecodePlan, q, kv_cache, out, return_lse: bool) -> BoundLaunch:
        """Check run()'s arguments in full; return the launch with everything but q, k, v, out and
        lse bound."""
        check_tensor("q", q, dtype=CACHE_DTYPES, dim=3)
        want = (plan.batch_size, plan.num_qo_heads, plan.head_dim)
        if tuple(q.shape) != want:
            raise ValueError(f"q must be [batch_size, num_qo_heads, head_dim] = {list(want)} as "
                             f"planned, got {list(q.shape)}")
        if q.stride(-1) != 1:
            raise ValueError(f"q must be contiguous along head_dim, got strides {q.stride()}")
        k, v, (num_pages, heads, page, dim) = cache_views(kv_cache, self.kv_layout)
        if k.dtype != q.dtype:
            raise TypeError(f"q.dtype={q.dtype} differs from the kv_cache dtype {k.dtype}")
        check_same_device(plan.device, q=q, kv_cache=k)
        if (heads, page, dim) != (plan.num_kv_heads, plan.page_size, plan.head_dim):
            raise ValueError(f"kv_cache ({self.kv_layout}) has num_kv_heads={heads}, page_size={page}, "
                             f"head_dim={dim}; the plan has {plan.num_kv_heads}, {plan.page_size}, "
                             f"{plan.head_dim}")
        if plan.max_page_index >= num_pages:
            exact = plan.exact_max_page() if plan.exact_max_page else plan.max_page_index
            if exact >= num_pages:
                raise ValueError(f"page index {exact} in the page table is outside the pool of "
                                 f"{num_pages} pages")
        if out is None:
            out_strides, out_align = (q.shape[1] * q.shape[2], q.shape[2], 1), 0
        else:
            check_tensor("out", out, dtype=q.dtype, dim=3)
            if out.shape != q.shape or out.device != q.device or out.stride(-1) != 1:
                raise ValueError(f"out must be like q ({list(q.shape)} on {q.device}, contiguous "
                                 f"along head_dim), got {list(out.shape)} on {out.device}")
            out_strides, out_align = out.stride(), out.data_ptr() % 16
        if self.kv_layout == "HND":   # k: [P, H, S, D]
            stride_page, stride_head, stride_tok = k.stride(0), k.stride(1), k.stride(2)
        else:                         # k: [P, S, H, D]
            stride_page, stride_head, stride_tok = k.stride(0), k.stride(2), k.stride(1)
        # V's offset from the pointer passed for it: the pool's K/V stride, or 0 for a (k, v) pair
        stride_kv = kv_cache.stride(1) if isinstance(kv_cache, torch.Tensor) else 0
        strides = (q.stride(0), q.stride(1), out_strides[0], out_strides[1], stride_page, stride_head,
                   stride_tok, stride_kv)
        # the launch's arguments after q, k, v, out and lse, fixed by the plan and the signature
        fixed = (plan.indices, plan.meta, plan.tasks,
                 plan.meta if plan.plan_info is None else plan.plan_info,
                 self._part_o, self._part_lse, self._counters, *strides, plan.batch_size,
                 plan.schedule.tasks.shape[1], plan.tasks.shape[1], plan.schedule.split_tokens,
                 plan.sm_scale * 1.4426950408889634)
        group = plan.num_qo_heads // plan.num_kv_heads
        constexprs = decode_constexprs(
            num_kv_heads=plan.num_kv_heads, group=group, head_dim=plan.head_dim,
            page_size=plan.page_size, block_n=plan.config.block_n,
            persistent=plan.schedule.backend == "workqueue",
            tasks_on_device=plan.plan_info is not None, return_lse=return_lse,
            upcast=interpreting())
        # Everything Triton specializes on: the constexprs, the dtypes, the strides (by value) and
        # the 16-byte alignment of the pointers (workspace and fresh outputs come from torch's
        # allocator, always aligned); num_rows, num_tasks and split_tokens are not specialized.
        key = (tuple(constexprs.values()), q.dtype, strides, q.data_ptr() % 16, out_align,
               k.data_ptr() % 16, v.data_ptr() % 16, plan.indices.data_ptr() % 16,
               plan.meta.data_ptr() % 16, plan.tasks.data_ptr() % 16)
        return self._launcher.bind(grid=plan.schedule.grid, key=key, fixed=fixed,
                                   constexprs=constexprs, num_warps=plan.config.num_warps,
                                   num_stages=plan.config.num_stages, device_index=q.device.index)


@dataclass(frozen=True)
class _GraphMemo:
    """The last graph-mode plan() and what it was given (tensors compared by identity)."""

    tables: tuple
    shapes: tuple
    options: tuple
    plan: DecodePlan
    launch: BoundLaunch
    leading: tuple


def _fixed_split_pages(page_size: int) -> int:
    """Pages per split of deterministic and graph-mode plans: DETERMINISTIC_SPLIT_TOKENS, rounded up."""
    return max(1, -(-DETERMINISTIC_SPLIT_TOKENS // page_size))


def _max_or(t: torch.Tensor, default: int) -> int:
    return int(t.max()) if t.numel() else default
