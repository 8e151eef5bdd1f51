"""The planner's host side: one plan type, one device launch per step, in every mode.

`Planner.plan` checks what it can without reading the device (shapes, dtypes, devices; the page
table's values only when asked), keeps the device buffers big enough (`Workspace`), and launches
the planner kernel (kernels/plan.py), which reads the page table, decides the schedule (from the
policy's device table, or the one given) and writes the task list. It never waits for the device
unless check_page_table is set. A plan() with the same page-table tensors and options as the
last one only relaunches the planner.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from .kernels.plan import (FIRST_PAGE_SLOTS, FIRST_READ_FIELDS, INFO_FIELDS, POLICY_EDGES,
                           TASK_FIELDS, plan_kernel, query_fields)
from .guard import PageGuard, guarded_extent
from .launch import BoundLaunch, Launcher
from .page_inputs import PageTableArgs
from .queries import QueryLayout, refilled_query_layout
from .policy import EDGES, Policy, fallback_choice, load_policy
from .runtime import next_power_of_2, sm_count
from .schedule import (ONE_ROUND_SLACK, ONE_ROUND_STEPS, WHOLE_ROW_SLACK, Choice,
                       chunks_per_head, min_split_tokens, partial_bound, split_task_target,
                       task_bound, whole_row_min_rows)
from .tuning import KernelConfig

_WORKSPACE_SERIALS = itertools.count()
CAPACITY_QUANTUM = 256   # task buffers grow in steps of this many tasks


@dataclass(frozen=True, eq=False)
class PlanOptions:
    """What plan() was asked for, checked once (DecodeWrapper.plan). choice None: the policy's.
    Compared by identity (the wrapper keeps one object per set of options), so that the caches
    keyed by it hash it in nanoseconds."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    choice: Choice | None
    sm_scale: float
    config: KernelConfig
    check_page_table: bool
    window_left: int = -1          # positions before each query it sees, -1: all
    logits_soft_cap: float = 0.0   # > 0: scores soft-capped (cap * tanh(s / cap))
    kv_data_type: torch.dtype | None = None   # the cache's dtype run() must get (None: any)
    tile_by_step: bool = True      # the step's size may cut the tile (KernelConfig.for_step);
                                   # off in deterministic mode, where the batch must not matter


class Workspace:
    """A planner's device buffers, grow-only: task records int32 [capacity, 8], each task's first
    reads int32 [capacity, FIRST_READ_FIELDS] (KernelConfig.first_pages: its first K/V tile's
    page indices and, several query tokens a row, its row's queries and length), plan
    info int32 [9] (task count, split tokens, choice code, claim counter, tasks that did not fit,
    chunks, and check()'s three counts: used entries outside the pool, rows cut to their table,
    rows whose query counts the tile cannot hold),
    partial outputs [slots * Hq * D] fp32 words (the kernel keeps them in the output's dtype,
    in the first half where it is 16-bit) and lse fp32 [slots * Hq * value blocks], with slots
    the partial capacity (tasks of rows cut in two or more: schedule.partial_bound), merge
    counters int32 [slots * head items] (KV heads x M-blocks x value blocks), by partial slot
    and head item (zero between launches), and the
    page guard's copy of a trusted page table, int32 [entries] (guard.py), and the rows' lengths
    int32 [rows] (the planner's). `generation` names the buffers (a new number at every
    reallocation, never one used before, so that launches bound to earlier buffers are never
    taken for later ones); `serial` tells workspaces apart (an id() is reused once a workspace
    is freed). A plan that fails after reserve() puts the buffers back (snapshot, restore)."""

    BUFFERS = ("tasks", "first_pages", "info", "part_o", "part_lse", "counters", "safe_pages",
               "row_lens")

    def __init__(self, device: torch.device):
        self.device = device
        self.tasks = torch.zeros(0, TASK_FIELDS, dtype=torch.int32, device=device)
        self.first_pages = torch.zeros(0, FIRST_READ_FIELDS, dtype=torch.int32, device=device)
        self.info = torch.zeros(INFO_FIELDS, dtype=torch.int32, device=device)
        self.part_o = torch.empty(0, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(0, dtype=torch.float32, device=device)
        self.counters = torch.zeros(0, dtype=torch.int32, device=device)
        self.safe_pages = torch.zeros(0, dtype=torch.int32, device=device)
        self.row_lens = torch.zeros(0, dtype=torch.int32, device=device)
        self.generation = 0
        self._generations = itertools.count(1)
        self.serial = next(_WORKSPACE_SERIALS)

    def snapshot(self) -> tuple:
        """The buffers and their generation, for restore()."""
        return tuple(getattr(self, name) for name in self.BUFFERS) + (self.generation,)

    def restore(self, snapshot: tuple) -> None:
        """The buffers of snapshot() again (after a plan that failed once it had grown them)."""
        *buffers, self.generation = snapshot
        for name, buffer in zip(self.BUFFERS, buffers):
            setattr(self, name, buffer)

    @property
    def capacity(self) -> int:
        return self.tasks.shape[0]

    def partial_capacity(self, *, partial_heads: int, head_dim: int, kv_heads: int,
                         value_blocks: int = 1) -> int:
        """Tasks with a partial the buffers hold for plans of this shape (the planner refuses a
        plan of more; value_blocks: lse rows a partial row keeps, KernelConfig.column_blocks)."""
        return min(self.part_lse.numel() // (partial_heads * value_blocks),
                   self.part_o.numel() // (partial_heads * head_dim),
                   self.counters.numel() // kv_heads)

    def fits(self, *, tasks: int, partial_tasks: int, partial_heads: int, head_dim: int,
             kv_heads: int, pages: int, rows: int, value_blocks: int = 1) -> bool:
        return (self.capacity >= tasks and self.safe_pages.numel() >= pages
                and self.row_lens.numel() >= rows
                and self.partial_capacity(partial_heads=partial_heads, head_dim=head_dim,
                                          kv_heads=kv_heads,
                                          value_blocks=value_blocks) >= partial_tasks)

    def reserve(self, *, tasks: int, partial_tasks: int, partial_heads: int, head_dim: int,
                kv_heads: int, pages: int, rows: int, value_blocks: int = 1) -> None:
        """Room for `tasks` task records, the partials of `partial_tasks` of them (partial_heads
        rows each) and their merge counters, a copy of `pages` page-table entries, and `rows`
        row lengths. Every new buffer is allocated before any is replaced: an allocation that
        fails leaves the workspace as it was."""
        grown = {}
        zeros = dict(dtype=torch.int32, device=self.device)
        if self.row_lens.numel() < rows:
            grown["row_lens"] = torch.zeros(rows, **zeros)
        if self.safe_pages.numel() < pages:
            grown["safe_pages"] = torch.zeros(pages, **zeros)
        if self.tasks.shape[0] < tasks:
            tasks = -(-tasks // CAPACITY_QUANTUM) * CAPACITY_QUANTUM
            grown["tasks"] = torch.zeros(tasks, TASK_FIELDS, **zeros)
            grown["first_pages"] = torch.zeros(tasks, FIRST_READ_FIELDS, **zeros)
        partial_tasks = -(-max(partial_tasks, 1) // CAPACITY_QUANTUM) * CAPACITY_QUANTUM
        slots = partial_tasks * partial_heads
        if self.part_lse.numel() < slots * value_blocks or self.part_o.numel() < slots * head_dim:
            grown["part_lse"] = torch.empty(slots * value_blocks, dtype=torch.float32,
                                            device=self.device)
            grown["part_o"] = torch.empty(slots * head_dim, dtype=torch.float32,
                                          device=self.device)
        if self.counters.numel() < partial_tasks * kv_heads:
            grown["counters"] = torch.zeros(partial_tasks * kv_heads, **zeros)
        if grown:
            for name, buffer in grown.items():
                setattr(self, name, buffer)
            self.generation = next(self._generations)


@dataclass(frozen=True)
class DecodePlan:
    """One step's plan: shapes and options, the page indices, and the device buffers the planner
    filled. launch_key: what run()'s bound launches depend on besides their own arguments."""

    batch_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    sm_scale: float
    config: KernelConfig
    window_left: int             # -1: no window
    logits_soft_cap: float       # 0: no soft-cap
    kv_data_type: torch.dtype | None   # the cache dtype run() takes (None: any)
    choice: Choice | None        # None: decided per step on the device by the policy
    indices: torch.Tensor        # flat page indices the kernels read: kv_indices, block_table
                                 # (row-major), or a trusted table's guarded copy
    indices_ptr: int
    workspace: Workspace
    programs: int                # persistent programs of run()'s launch
    max_page_index: int          # largest used page index, -1 when not read (trusted)
    max_page_at: str             # where it is in the table given ("" when not read)
    guard: PageGuard | None      # trusted tables: run() reads the guard's copy of `indices`
    queries: QueryLayout | None  # several query tokens per row (qo_indptr), else one
    total_queries: int | None    # q.shape[0] at run(): batch_size, qo_indptr[B], None: any
                                 # (graph mode's qo_indptr)
    launch_key: tuple

    def info(self) -> dict:
        """What the planner decided (reads the device): task count, split size (a balanced
        plan's chunk size), choice, the tasks that did not fit, a balanced plan's chunks."""
        count, split, code, _, overflow, chunks = self.workspace.info[:6].tolist()
        return {"num_tasks": count, "split_tokens": split, "choice": Choice.from_code(code),
                "tasks_over_capacity": overflow, "num_chunks": chunks}

    def task_records(self) -> np.ndarray:
        """int64 [num_tasks, 8]: (row, split, tok_lo, tok_hi, page_start, slot_start, num_splits,
        next) as the planner wrote them (reads the device); `next` is the record that follows in a
        balanced plan's chunk, else -1."""
        count = int(self.workspace.info[0])
        return self.workspace.tasks[:count].cpu().numpy().astype(np.int64)


class Planner:
    """Plans steps for one DecodeWrapper. With fixed_rows (graph mode) the buffers are sized once,
    for fixed_rows rows and fixed_pages pages, so a captured plan + run serves every later step.
    num_sms: the SMs the plans fill (None: the device's)."""

    def __init__(self, *, policy: Policy | None, fixed_rows: int | None = None,
                 fixed_pages: int | None = None, num_sms: int | None = None):
        self.policy = policy
        self.fixed_rows, self.fixed_pages = fixed_rows, fixed_pages
        self.num_sms = num_sms
        self.workspace: Workspace | None = None
        self._launcher = Launcher(plan_kernel)
        self._policy_tensors: dict = {}
        self._shipped: dict = {}           # (GPU name, (Hq, Hkv, head_dim)) -> shipped policy
        self._setups: dict = {}            # (options, device, head items) -> _setup(...)
        self._step_configs: dict = {}      # (options, q_pad, step size) -> _step_config(...)
        self._bound: dict = {}             # planner launches by options, table form, workspace
        # the last plan: (tensors, shapes, options, plan, planner launch, its leading tensors)
        self._memo: tuple | None = None

    def sms(self, device: torch.device) -> int:
        """The SMs the plans on `device` fill."""
        return self.num_sms or sm_count(device)

    def replan(self, tensors: tuple, options: PlanOptions, *,
               tile_queries: int | None = None) -> DecodePlan | None:
        """The last plan again when `tensors` are the last plan's page-table tensors (the same
        objects and shapes, all on the device, refilled in place) and `options` the same object:
        only the planner's launch, about one bare launch of host time. None otherwise, and always
        with check_page_table: refilled tables must have their values checked again (and run()
        the page range of the new values). An eager plan of several query tokens a row
        (tensors' last, qo_indptr: the same object, on the host or the device) has its new
        values read and checked and copied to the plan's device buffer first
        (queries.refilled_query_layout; tile_queries: the wrapper's fixed tile, else None); None
        when they need another tile."""
        memo = self._memo
        if (memo is None or memo[2] is not options or options.check_page_table
                or len(memo[0]) != len(tensors)):
            return None
        for t, known in zip(tensors, memo[0]):
            if t is not known:
                return None
        if memo[1] != tuple(None if t is None else t.shape for t in tensors):
            return None
        plan = memo[3]
        if plan.queries is not None and plan.queries.total is not None:   # eager qo_indptr
            queries = refilled_query_layout(
                plan.queries, tensors[-1], group=options.num_qo_heads // options.num_kv_heads,
                tile_queries=tile_queries)
            if queries is None:
                return None
            plan = replace(plan, queries=queries, total_queries=queries.total)
            self._memo = (*memo[:3], plan, *memo[4:])
        memo[4].with_pointers(*memo[5])
        if plan.guard is not None:
            plan.guard.arm()
        return plan

    def plan(self, tensors: tuple, table: PageTableArgs, options: PlanOptions,
             queries: QueryLayout | None = None) -> DecodePlan:
        """Plan a step from its checked page table (and query layout, several query tokens per
        row); `tensors` as the caller gave them."""
        device, ws = table.device, self.workspace
        if self.fixed_rows is not None and table.rows != self.fixed_rows:
            raise ValueError(f"graph mode takes page tables of max_batch_size={self.fixed_rows} "
                             f"rows, got {table.rows}")
        if self.fixed_pages is not None and table.pages > self.fixed_pages:
            raise ValueError(f"the page table holds {table.pages} page entries, over "
                             f"max_num_pages={self.fixed_pages}")
        extent = guarded_extent(table)      # the entries the guard copies
        if self.fixed_pages is not None and extent > self.fixed_pages:
            raise ValueError(f"block_table's rows are {table.row_stride} entries apart: its "
                             f"{table.rows} rows of {table.width} span {extent} "
                             f"entries, over max_num_pages={self.fixed_pages} (pass rows that "
                             f"are contiguous, or a larger max_num_pages)")
        q_pad = 1 if queries is None else queries.max_per_row
        rows = self.fixed_rows or table.rows
        pages = self.fixed_pages or table.pages
        config = self._step_config(options, q_pad=q_pad, rows=rows, pages=pages,
                                   exact=table.csr and self.fixed_pages is None, device=device)
        head_items = _head_items(options, config, q_pad)
        setup = self._setups.get((options, device, head_items))
        if setup is None:
            if len(self._setups) > 64:   # as the wrapper's options: new options, new setups
                self._setups.clear()
            setup = self._setups[options, device, head_items] = self._setup(options, device,
                                                                            head_items)
        code_bins, target, chunks, fixed_tail = setup
        need = dict(tasks=max(task_bound(c, rows=rows, pages=pages, target_tasks=target,
                                         chunks=chunks, max_row_pages=table.max_row_pages)
                              for c in code_bins),
                    partial_tasks=max(partial_bound(c, rows=min(rows, most_rows or rows),
                                                    pages=pages, target_tasks=target,
                                                    chunks=chunks,
                                                    max_row_pages=_row_pages(
                                                        table.max_row_pages, longest,
                                                        options.page_size))
                                      for c, bins in code_bins.items()
                                      for most_rows, longest in bins),
                    partial_heads=options.num_qo_heads * q_pad, head_dim=options.head_dim,
                    kv_heads=head_items, rows=rows,
                    value_blocks=config.column_blocks(
                        tile_rows=q_pad * (options.num_qo_heads // options.num_kv_heads)),
                    # graph mode sizes the guard's copy for any later plan, checked or not
                    pages=0 if options.check_page_table and self.fixed_pages is None
                    else max(extent, self.fixed_pages or 0))
        previous, saved = ws, None if ws is None else ws.snapshot()
        try:
            return self._plan_into(ws, need, tensors, table, options, queries, config,
                                   head_items, fixed_tail, extent, q_pad)
        except BaseException:      # a failed plan leaves the last one's buffers as they were
            failed = self.workspace
            if failed is not None and (failed is not previous or failed.generation != saved[-1]):
                discarded = (failed.serial, failed.generation)   # let its buffers go
                self._bound = {k: v for k, v in self._bound.items() if k[:2] != discarded}
            self.workspace = previous
            if previous is not None:
                previous.restore(saved)
            raise

    def _plan_into(self, ws: Workspace | None, need: dict, tensors: tuple, table: PageTableArgs,
                   options: PlanOptions, queries: QueryLayout | None, config: KernelConfig,
                   head_items: int, fixed_tail, extent: int, q_pad: int) -> DecodePlan:
        """plan()'s second half: grow the workspace to `need`, bind and launch the planner."""
        device = table.device
        if ws is None or ws.device != device:
            ws = self.workspace = Workspace(device)
        if not ws.fits(**need):
            if self.fixed_rows is not None and ws.generation:
                raise ValueError("graph mode sized its buffers at the first plan(); this plan "
                                 "needs more (smaller splits, more heads or a larger head_dim): "
                                 "build a new DecodeWrapper")
            ws.reserve(**need)
        block_rows = next_power_of_2(max(table.rows, 1))
        # the planner's tensors (qo_indptr, or the table again where it reads none)
        tables = (*table.leading, table.indices,
                  table.indices if queries is None else queries.indptr)
        leading = (*tables, table.rows, table.num_indices, table.row_stride, table.width)
        align = tuple(t.data_ptr() % 16 for t in tables)
        count_queries = queries is not None and queries.total is None   # graph mode's qo_indptr
        bind_key = (ws.serial, ws.generation, options, config.max_tile_rows, device, table.csr,
                    block_rows, align, q_pad, count_queries)
        launch = self._bound.get(bind_key)
        if launch is None:
            if len(self._bound) > 64:
                self._bound.clear()
            launch = self._bound[bind_key] = self._bind(options, config, table, ws, fixed_tail,
                                                        block_rows, align, q_pad, count_queries)
        # at least a program per head item: a balanced plan runs one chunk (>= 1) of each
        programs = min(max(config.programs_per_sm * self.sms(device), head_items),
                       ws.capacity * head_items)
        guard = None if options.check_page_table else PageGuard(
            table, safe=ws.safe_pages, info=ws.info, page_size=options.page_size)
        indices = table.indices if guard is None else ws.safe_pages
        plan = DecodePlan(
            batch_size=table.rows, num_qo_heads=options.num_qo_heads,
            num_kv_heads=options.num_kv_heads, head_dim=options.head_dim,
            page_size=options.page_size, sm_scale=options.sm_scale, config=config,
            window_left=options.window_left, logits_soft_cap=options.logits_soft_cap,
            kv_data_type=options.kv_data_type, choice=options.choice, indices=indices,
            indices_ptr=indices.data_ptr(),
            workspace=ws, programs=programs, max_page_index=table.max_page,
            max_page_at=table.max_page_at, guard=guard,
            queries=queries, total_queries=table.rows if queries is None else queries.total,
            launch_key=(ws.serial, ws.generation, options, config.max_tile_rows, programs,
                        table.max_page, q_pad,
                        None if queries is None else queries.indptr.data_ptr() % 16))
        call = (leading, [*(t.data_ptr() for t in tables), *leading[len(tables):]])
        launch.with_pointers(*call)
        # replan() needs the table on the device (its values are not read) and qo_indptr, read
        # on the host in eager mode, on either side
        on_device = all(t is None or t.device == device for t in tensors[:-1]) and (
            tensors[-1] is None or tensors[-1].device in (device, torch.device("cpu")))
        self._memo = (tensors, tuple(None if t is None else t.shape for t in tensors), options,
                      plan, launch, call) if on_device else None
        return plan

    def _step_config(self, options: PlanOptions, *, q_pad: int, rows: int, pages: int,
                     exact: bool, device: torch.device) -> KernelConfig:
        """The kernel configuration of a step of at most `rows` rows and `pages` page entries
        (graph mode: the buffers' bounds, so that one graph keeps one tile; exact: the step
        reads every entry, a CSR page list outside graph mode): options.config, or its tile for
        the step's size (KernelConfig.step_size, for_step), by the K/V the table can hold (with
        a window, the window's tokens a row at most) at 16 bits an element."""
        config = options.config
        if not options.tile_by_step or not config.small_step_kv_bytes_per_sm:
            return config
        tokens = pages * options.page_size
        if options.window_left >= 0:
            tokens = min(tokens, rows * (options.window_left + q_pad + options.page_size))
            exact = False
        kv_bytes = tokens * options.num_kv_heads * options.head_dim * 2 * 2
        size = config.step_size(kv_bytes=kv_bytes, exact=exact, sm_count=self.sms(device))
        key = (options, q_pad, size)
        step_config = self._step_configs.get(key)   # one object per outcome: the caches key by it
        if step_config is None:
            if len(self._step_configs) > 64:
                self._step_configs.clear()
            group = options.num_qo_heads // options.num_kv_heads
            step_config = self._step_configs[key] = config.for_step(tile_rows=q_pad * group,
                                                                    size=size)
        return step_config

    def _setup(self, options: PlanOptions, device: torch.device, head_items: int) -> tuple:
        """What plan() needs of a set of options, once: the choice codes the step may take, each
        with the policy bins it decides (Policy.code_bins), the split rule's task target, a
        balanced plan's chunks per KV head, and the planner's fixed arguments after the
        workspace buffers. head_items: programs a task's KV heads take (_head_items); the
        targets count them as KV heads."""
        cfg, sms = options.config, self.sms(device)
        target = split_task_target(num_kv_heads=head_items, sm_count=sms, config=cfg)
        chunks = chunks_per_head(programs=cfg.programs_per_sm * sms, num_kv_heads=head_items)
        choice = options.choice
        policy = self.policy_for(device, (options.num_qo_heads, options.num_kv_heads,
                                          options.head_dim),
                                 kv_fp8=options.kv_data_type == torch.float8_e4m3fn)
        if choice is None and not policy.applies_to(
                num_qo_heads=options.num_qo_heads, num_kv_heads=options.num_kv_heads,
                head_dim=options.head_dim):
            choice = fallback_choice()
        dense = None if choice is not None else policy.dense_codes(page_size=options.page_size)
        code_bins = ({choice.code(): {(None, None)}} if dense is None
                     else policy.code_bins(page_size=options.page_size))
        edges, table = self._device_table(device, dense)
        # the kernel's scalars before and after the smallest split, which depends on the tile's
        # query rows too (_bind puts it between them)
        before_split = (choice.code() if dense is None else 0, target, chunks)
        after_split = (cfg.balanced_from_tokens,
                       whole_row_min_rows(num_kv_heads=head_items, sm_count=sms),
                       WHOLE_ROW_SLACK, ONE_ROUND_SLACK, len(EDGES[1]) + 1, len(EDGES[2]) + 1)
        return code_bins, target, chunks, (edges, table, before_split, after_split,
                                           dense is not None)

    def _bind(self, options: PlanOptions, config: KernelConfig, table: PageTableArgs,
              ws: Workspace, fixed_tail: tuple, block_rows: int, align: tuple,
              q_pad: int, count_queries: bool) -> BoundLaunch:
        """The planner's launch with everything but the page table and its sizes bound. config:
        the step's (_step_config); q_pad: the tile's query tokens per row (a window keeps
        window_left + q_pad positions a row); count_queries: graph mode's qo_indptr, whose rows
        the tile cannot hold the planner counts."""
        edges, dense, before_split, after_split, use_policy = fixed_tail
        group = options.num_qo_heads // options.num_kv_heads
        smallest_split = min_split_tokens(config,
                                          tile_rows=config.block_rows(tile_rows=q_pad * group))
        window_tokens = -1 if options.window_left < 0 else options.window_left + q_pad
        constexprs = dict(PAGE_SIZE=options.page_size, BLOCK_ROWS=block_rows, BLOCK_SPLITS=32,
                          CSR=table.csr, POLICY=use_policy,
                          ONE_ROUND_STEPS=ONE_ROUND_STEPS if config.one_round else 0,
                          EDGES=POLICY_EDGES, Q_PAD=q_pad if count_queries else 0,
                          FIRST_PAGES=FIRST_PAGE_SLOTS if config.first_pages else 0,
                          QUERY_FIELDS=query_fields(first_pages=config.first_pages,
                                                    max_queries=q_pad))
        # Triton specializes on the pointers' alignment
        key = (*constexprs.values(), table.device.index, *align)
        return self._launcher.bind(grid=(block_rows,), key=key,
                                   fixed=(edges, dense, ws.tasks, ws.first_pages, ws.info,
                                          ws.row_lens, ws.capacity,
                                          ws.partial_capacity(
                                              partial_heads=options.num_qo_heads * q_pad,
                                              head_dim=options.head_dim,
                                              kv_heads=_head_items(options, config, q_pad),
                                              value_blocks=config.column_blocks(
                                                  tile_rows=q_pad * group)),
                                          *before_split, smallest_split, *after_split,
                                          window_tokens),
                                   constexprs=constexprs, num_warps=4, num_stages=2,
                                   device_index=table.device.index)

    def policy_for(self, device: torch.device, shape: tuple[int, int, int], *,
                   kv_fp8: bool = False) -> Policy:
        """The policy given, else the one shipped for the GPU at shape (Hq, Hkv, head_dim) (for
        an fp8 cache, load_policy's fp8 file first)."""
        if self.policy is not None:
            return self.policy
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        if (name, shape, kv_fp8) not in self._shipped:
            self._shipped[name, shape, kv_fp8] = load_policy(name, shape=shape, kv_fp8=kv_fp8)
        return self._shipped[name, shape, kv_fp8]

    def _device_table(self, device: torch.device, codes: list[int] | None):
        """The policy's bin edges (float64 [3, POLICY_EDGES], padded with +inf) and dense choice
        codes (int32), uploaded once per device; placeholders when a choice is given."""
        key = (device, None if codes is None else tuple(codes))
        tensors = self._policy_tensors.get(key)
        if tensors is None:
            edges = np.full((len(EDGES), POLICY_EDGES), math.inf)
            for i, feature_edges in enumerate(EDGES):
                edges[i, :len(feature_edges)] = feature_edges
            tensors = (torch.from_numpy(edges).to(device),
                       torch.tensor(codes or [0], dtype=torch.int32, device=device))
            self._policy_tensors[key] = tensors
        return tensors


def _head_items(options: PlanOptions, config: KernelConfig, q_pad: int) -> int:
    """Programs that one task takes: a program per KV head, or per M-block and value block of
    each where the step's config cuts a tile of q_pad query tokens x group rows
    (KernelConfig.head_items)."""
    group = options.num_qo_heads // options.num_kv_heads
    return options.num_kv_heads * config.head_items(tile_rows=q_pad * group)


def _row_pages(max_row_pages: int | None, longest: int | None, page_size: int) -> int | None:
    """Most pages a row of a plan holds: the table's widest row, and a policy bin's longest row
    in tokens (None: not known)."""
    if longest is None:
        return max_row_pages
    longest_pages = -(-longest // page_size)
    return longest_pages if max_row_pages is None else min(max_row_pages, longest_pages)
