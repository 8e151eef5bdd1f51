"""DecodeWrapper: plan() once per decode step, run() once per layer.

    wrapper = DecodeWrapper(kv_layout="NHD")
    wrapper.plan(kv_indptr=..., kv_indices=..., kv_last_page_len=..., num_qo_heads=32,
                 num_kv_heads=8, head_dim=128, page_size=16)          # backend="auto"
    out = wrapper.run(q, kv_cache)           # q [B, Hq, D] -> out [B, Hq, D]

plan() is one launch of the planner on the device (planner.py), in every mode; run() launches the
decode kernel (launch.py). This module checks the options and delegates.
"""
from __future__ import annotations

import math
import numbers

import torch

from .cache import check_layout, check_v_transposed_page
from .checks import check_attention_shape, check_device, check_fp32_scale, check_positive_int
from .launch import LOG2_E, DecodeLauncher
from .page_inputs import page_table_args
from .planner import DecodePlan, Planner, PlanOptions
from .policy import Policy
from .quant import FP8
from .queries import MAX_QUERIES_PER_ROW, graph_query_layout, host_seq_lens, query_layout
from .runtime import check_interpreter_numpy, interpreting, next_power_of_2
from .schedule import DETERMINISTIC_SPLIT_TOKENS, MAX_SPLIT_TOKENS, SCHEDULES, Choice
from .tuning import KernelConfig, default_config

KV_DATA_TYPES = (torch.float16, torch.bfloat16, FP8)

BACKENDS = (*SCHEDULES, "auto")


class DecodeWrapper:
    """Paged GQA decode attention with a page-aware schedule, planned once per step on the device.

    plan() never waits for the device (unless check_page_table=True) and can be captured in a
    CUDA graph together with the runs. With use_cuda_graph=True its buffers are sized once, for
    max_batch_size rows and max_num_pages page entries (kv_indices' length, or block_table's rows
    x width), so that one captured plan() + run()
    replays for every batch composition: fill the same page-table tensors in place before each
    replay; rows with no pages (CSR) or seq_lens 0 are inactive and their output rows and lse
    entries are left untouched (in every mode; uninitialized where run() allocates them).
    max_queries_per_row: the tile's query tokens per row of a plan(qo_indptr=...) (default 1:
    sized by each batch; graph mode and deterministic mode need it fixed). policy: for
    backend="auto"; default: the one shipped for the GPU. num_sms: the SMs
    the plans fill (default: the device's; FlashAttention-3's sm_margin is the same knob counted
    the other way): fewer where kernels on another stream share the GPU with the decode step,
    or, on the CPU, a GPU's count, to see the plans it would get.
    """

    def __init__(self, kv_layout: str = "NHD", *, device: torch.device | str | None = None,
                 use_cuda_graph: bool = False, max_batch_size: int | None = None,
                 max_num_pages: int | None = None, max_queries_per_row: int = 1,
                 policy: Policy | None = None, num_sms: int | None = None):
        self.kv_layout = check_layout(kv_layout, name="kv_layout")
        if policy is not None and not isinstance(policy, Policy):
            raise TypeError(f"policy must be a persistentkv.policy.Policy, got "
                            f"{type(policy).__name__}")
        self._device = None if device is None else check_device(device)
        if (self._device is not None and self._device.type == "cuda"
                and self._device.index is None and torch.cuda.is_available()):
            self._device = torch.device("cuda", torch.cuda.current_device())   # "cuda" = cuda:N
        if not isinstance(use_cuda_graph, bool):
            raise TypeError(f"use_cuda_graph must be a bool, got {use_cuda_graph!r}")
        self.use_cuda_graph = use_cuda_graph
        if use_cuda_graph:
            max_batch_size = check_positive_int("max_batch_size", max_batch_size)
            max_num_pages = check_positive_int("max_num_pages", max_num_pages)
        elif max_batch_size is not None or max_num_pages is not None:
            raise ValueError("max_batch_size and max_num_pages size the buffers of "
                             "use_cuda_graph=True; leave them out otherwise")
        max_queries_per_row = check_positive_int("max_queries_per_row", max_queries_per_row)
        if max_queries_per_row > MAX_QUERIES_PER_ROW:
            raise ValueError(f"max_queries_per_row must be at most {MAX_QUERIES_PER_ROW}, got "
                             f"{max_queries_per_row}")
        self.max_batch_size, self.max_num_pages = max_batch_size, max_num_pages
        self.max_queries_per_row = max_queries_per_row
        if num_sms is not None:
            num_sms = check_positive_int("num_sms", num_sms)
        self.num_sms = num_sms
        self._planner = Planner(policy=policy, fixed_rows=max_batch_size, fixed_pages=max_num_pages,
                                num_sms=num_sms)
        self._launcher = DecodeLauncher(self.kv_layout)
        self._options: dict[tuple, PlanOptions] = {}
        self._plan: DecodePlan | None = None

    @property
    def policy(self) -> Policy | None:
        """The policy given, else the one shipped for the GPU at the last plan's shape (None
        before a plan)."""
        plan = self._plan
        if plan is None:
            return self._planner.policy
        return self._planner.policy_for(plan.indices.device,
                                        (plan.num_qo_heads, plan.num_kv_heads, plan.head_dim),
                                        kv_fp8=plan.kv_data_type == FP8)

    def check(self) -> None:
        """ValueError when a step since the last check() had a page table its values do not fit:
        used entries outside the pool, or rows whose lengths the table cannot hold; or, in graph
        mode, a qo_indptr with rows of more query tokens than the tile holds (max_queries_per_row
        rounded up to a power of two) or of a negative count.
        A table whose values plan() did not check (check_page_table=False, graph mode) is read
        through a guarded copy: an entry outside the pool reads page 0 instead (that row's output
        is wrong), and a row longer than its table (seq_lens past block_table's width, negative,
        or kv_indptr / kv_last_page_len out of range) is cut to what the table holds; both are
        counted on the device. check() reads the counts (one device read, a synchronization,
        where the caller chooses: after a step, or every N steps) and resets them."""
        ws = self._planner.workspace
        outside, cut, queries = (0, 0, 0) if ws is None else ws.info[6:9].tolist()
        if not (outside or cut or queries):
            return
        ws.info[6:9].zero_()
        found = []
        if outside:
            found.append(f"{outside} used page-table entries were outside the pool (they read "
                         f"page 0)")
        if cut:
            found.append(f"{cut} rows had lengths their page table cannot hold (seq_lens past "
                         f"block_table's width or negative, or kv_indptr / kv_last_page_len out "
                         f"of range; they were cut to the table)")
        if queries:
            found.append(f"{queries} rows had query counts (qo_indptr) negative or over the "
                         f"tile's max_queries_per_row (their outputs are wrong)")
        raise ValueError(f"since the last check(), {' and '.join(found)}: the page table or "
                         f"qo_indptr is wrong")

    @property
    def compiled_kernels(self) -> tuple:
        """The decode kernels run() has compiled, one per specialization (Triton's compiled
        kernels: `.metadata` holds num_warps, num_stages, shared memory and launch_pdl, `.n_regs`
        the registers once launched). Empty under Triton's interpreter, which compiles none."""
        return self._launcher.compiled_kernels

    @property
    def current_plan(self) -> DecodePlan:
        """The last plan() result."""
        if self._plan is None:
            raise RuntimeError("run() called before plan()")
        return self._plan

    def plan(self, *, kv_indptr: torch.Tensor | None = None, kv_indices: torch.Tensor | None = None,
             kv_last_page_len: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
             seq_lens: torch.Tensor | None = None, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, backend: str = "auto",
             split_pages: int | None = None, sm_scale: float | None = None,
             config: KernelConfig | None = None, deterministic: bool = False,
             check_page_table: bool = False,
             qo_indptr: torch.Tensor | None = None, window_left: int = -1,
             logits_soft_cap: float = 0.0, kv_data_type: torch.dtype | None = None) -> DecodePlan:
        """Plan one decode step from a CSR page table or from block_table + seq_lens.

        CSR (FlashInfer): kv_indptr int32 [B+1], kv_indices int32 [nnz], kv_last_page_len int32 [B]
        (in [1, page_size]). Block table (vLLM): block_table int32 [B, max_pages], seq_lens int32 [B].
        kv_indices and block_table live on the kernel's device; kv_indptr, kv_last_page_len and
        seq_lens may be there too or on the host (copied without waiting for the device).
        backend: "auto" (the policy decides per step, on the device), "grouped" (one task per row
        and KV head), "split" (splits of split_pages pages, default: the split rule of
        schedule.py) or "balanced" (every program an equal share of the step's pages, one
        round; schedule.py); sm_scale defaults to 1/sqrt(head_dim); config: the kernel's tile and launch
        shape (default: tuning.default_config; a step whose table can hold little K/V, by
        kv_indices' length or block_table's rows x width, may run its tile in halves, and one
        whose kv_indices hold much, in wider blocks: KernelConfig.for_step, so pass the step's
        width and kv_indptr[-1] entries). deterministic=True makes the output
        batch-invariant: splits of a fixed size in tokens (split_pages, default
        schedule.DETERMINISTIC_SPLIT_TOKENS), so a row's result is bitwise the same whatever else
        is in the batch. check_page_table=True reads the page table back to check its values
        (lengths, offsets, page indices against the pool at run()): a synchronization. Without
        it the table is trusted, as FlashInfer and vLLM trust theirs.
        qo_indptr int32 [B+1] (host or device; its values are read on the host): several query
        tokens per row, q[qo_indptr[b]:qo_indptr[b+1]] of q [qo_indptr[B], Hq, D] are row b's
        last tokens (already in the cache), causal: query j of n sees positions
        < seq_len - n + j + 1 (queries.py; up to 16 per row). In graph mode qo_indptr is a
        device tensor refilled in place like the page table (its values are not read; the
        wrapper is built with max_queries_per_row), and q has any number of rows. Eagerly,
        max_queries_per_row > 1 fixes the tile's query rows (else the batch's most decides):
        deterministic=True needs it, so that a row's result does not depend on the batch.
        window_left >= 0 (FlashInfer's name): a sliding window, the query at position p sees
        positions p - window_left .. p; the planner drops the pages before each row's window, so
        that only window tokens are read and split (the table may still list every page).
        logits_soft_cap > 0: scores s = sm_scale * q.k become cap * tanh(s / cap) (Gemma-2).
        Both hold for the step, like every plan option; a model whose layers differ keeps one
        wrapper per kind of layer. Sinks (per layer) go to run().
        kv_data_type (FlashInfer's name): the cache's dtype, torch.float16, torch.bfloat16 or
        torch.float8_e4m3fn; run() then refuses a cache of another dtype, and an fp8 plan takes
        the policy fitted on fp8 steps where one is shipped. None: any cache.
        """
        check_interpreter_numpy()
        raw = (num_qo_heads, num_kv_heads, head_dim, page_size, backend, split_pages, sm_scale,
               config, deterministic, check_page_table, window_left, logits_soft_cap,
               kv_data_type)
        try:
            key = tuple((type(v), v) for v in raw)
            options = self._options.get(key)
        except TypeError:   # an unhashable argument: checked (and refused) below
            key, options = None, None
        if options is None:
            options = _plan_options(*raw)
            check_v_transposed_page(self.kv_layout, options.page_size)   # as run() would
            if len(self._options) > 64:
                self._options.clear()
            if key is not None:
                self._options[key] = options
        tensors = (kv_indptr, kv_indices, kv_last_page_len, block_table, seq_lens, qo_indptr)
        graph = self.max_batch_size is not None
        plan = self._planner.replan(tensors, options, tile_queries=(
            None if self.max_queries_per_row == 1 else self.max_queries_per_row))
        if plan is None:
            table = page_table_args(kv_indptr=kv_indptr, kv_indices=kv_indices,
                                    kv_last_page_len=kv_last_page_len, block_table=block_table,
                                    seq_lens=seq_lens, page_size=page_size,
                                    check_values=check_page_table)
            if self._device is not None and table.device != self._device:
                raise ValueError(f"page table is on {table.device}, but the wrapper was built for "
                                 f"{self._device}")
            if table.device.type != "cuda" and not interpreting():
                raise ValueError(f"page table is on {table.device}: the kernels run on a CUDA "
                                 f"device, or on the CPU under Triton's interpreter "
                                 f"(TRITON_INTERPRET=1)")
            queries = None
            if qo_indptr is not None and graph:
                if self.max_queries_per_row == 1:
                    raise ValueError("graph mode takes qo_indptr when the wrapper is built with "
                                     "max_queries_per_row > 1 (its tile is sized then)")
                queries = graph_query_layout(
                    qo_indptr, rows=table.rows, device=table.device,
                    group=options.num_qo_heads // options.num_kv_heads,
                    max_queries_per_row=self.max_queries_per_row)
            elif qo_indptr is not None:
                if deterministic and self.max_queries_per_row == 1:
                    raise ValueError("deterministic=True with qo_indptr needs a tile that does "
                                     "not depend on the batch: build the DecodeWrapper with "
                                     "max_queries_per_row=N (the most queries of any row)")
                queries = query_layout(
                    qo_indptr, rows=table.rows, group=options.num_qo_heads // options.num_kv_heads,
                    device=table.device,
                    seq_lens=host_seq_lens(kv_indptr=kv_indptr, kv_last_page_len=kv_last_page_len,
                                           seq_lens=seq_lens, page_size=options.page_size),
                    tile_queries=None if self.max_queries_per_row == 1 else self.max_queries_per_row)
            plan = self._planner.plan(tensors, table, options, queries)
        self._plan = plan
        return plan

    def run(self, q: torch.Tensor, kv_cache, *, out: torch.Tensor | None = None,
            return_lse: bool = False, sinks: torch.Tensor | None = None,
            k_scale: float | None = None, v_scale: float | None = None,
            kv_scales: torch.Tensor | None = None):
        """Decode attention for one layer.

        q: [B, Hq, D] fp16/bf16, the cache's dtype. kv_cache: [P, 2, H, S, D] (HND) or [P, 2, S, H, D]
        (NHD), or a (k, v) pair of [P, H, S, D] / [P, S, H, D]. Returns out [B, Hq, D] in q's dtype,
        and with return_lse=True also lse [B, Hq] float32: the natural-log log-sum-exp of the
        scaled scores, sm_scale * q.k (and of the sink). sinks: float32 [Hq] on q's device, one
        learned logit per query head that joins each softmax's denominator with no value
        (gpt-oss): out = sum_j e^(s_j) v_j / (e^sink + sum_j e^(s_j)).
        An fp8 (e4m3) kv_cache takes its scales: k_scale and v_scale (floats, per tensor: K =
        k_scale * K8) or kv_scales (fp32 [num_pages, 2, num_kv_heads, page_size], per token and
        KV head, as PagedKVCache(kv_scale="token") keeps them); `cache.scales(layer)` gives
        either. q stays fp16/bf16 and out is in q's dtype.
        """
        plan = self.current_plan
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
        if torch.compiler.is_compiling():
            from .op import traced_decode

            return traced_decode(plan, q, kv_cache, out, return_lse, sinks,
                                 (k_scale, v_scale, kv_scales), kv_layout=self.kv_layout)
        out, lse = self._launcher.run(plan, q, kv_cache, out, return_lse, sinks,
                                      (k_scale, v_scale, kv_scales))
        return (out, lse) if return_lse else out


def _plan_options(num_qo_heads, num_kv_heads, head_dim, page_size, backend, split_pages, sm_scale,
                  config, deterministic, check_page_table, window_left,
                  logits_soft_cap, kv_data_type) -> PlanOptions:
    """plan()'s options, checked; every error names the argument and its value."""
    num_qo_heads, num_kv_heads, head_dim, page_size = check_attention_shape(
        num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        page_size=page_size)
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if split_pages is not None:
        split_pages = check_positive_int("split_pages", split_pages)
        if split_pages * page_size > MAX_SPLIT_TOKENS:   # schedule.MAX_SPLIT_TOKENS
            raise ValueError(f"split_pages x page_size must be at most 2^30 tokens, got "
                             f"split_pages={split_pages} at page_size={page_size}")
    for name, flag in (("deterministic", deterministic), ("check_page_table", check_page_table)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    if config is None:
        config = default_config(head_dim=head_dim, num_kv_heads=num_kv_heads)
    elif not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a KernelConfig, got {type(config).__name__}")
    elif next_power_of_2(head_dim) // config.value_blocks < 16:
        raise ValueError(f"config.value_blocks={config.value_blocks} must cut head_dim "
                         f"{head_dim} (padded to a power of two) into blocks of at least 16 "
                         f"columns")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    else:   # the kernels take sm_scale * log2(e)
        sm_scale = check_fp32_scale("sm_scale", sm_scale, factor=LOG2_E)
    if not isinstance(window_left, numbers.Integral) or isinstance(window_left, bool):
        raise TypeError(f"window_left must be an int (-1: no window), got {window_left!r}")
    if not -1 <= window_left < 2**30:   # the kernels' int32 positions, with room for the queries
        raise ValueError(f"window_left must be -1 (no window) or in [0, 2^30), got {window_left}")
    logits_soft_cap = check_fp32_scale("logits_soft_cap", logits_soft_cap, zero=True,
                                       factor=LOG2_E)   # 0: none; the kernel takes cap * log2(e)
    if deterministic:   # a per-step choice of schedule or split would break batch invariance
        if backend in ("grouped", "balanced"):
            raise ValueError(f"deterministic=True cuts rows into splits of a fixed size; "
                             f"backend={backend!r} cuts them by the batch: use 'split' or 'auto'")
        choice = Choice("split", split_pages or max(1, -(-DETERMINISTIC_SPLIT_TOKENS // page_size)))
    elif backend == "auto":
        if split_pages is not None:
            raise ValueError(f"backend='auto' chooses the split itself; split_pages={split_pages} "
                             f"needs backend='split'")
        choice = None
    elif backend in ("grouped", "balanced"):
        if split_pages is not None:
            raise ValueError(f"backend={backend!r} sizes its own splits; split_pages={split_pages} "
                             f"needs backend='split'")
        choice = Choice(backend)
    else:
        choice = Choice("split", split_pages)
    if kv_data_type is not None and not isinstance(kv_data_type, torch.dtype):
        raise TypeError(f"kv_data_type must be a torch.dtype or None, got {kv_data_type!r}")
    if kv_data_type is not None and kv_data_type not in KV_DATA_TYPES:
        raise ValueError(f"kv_data_type must be one of {KV_DATA_TYPES} or None, got {kv_data_type}")
    return PlanOptions(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       page_size=page_size, choice=choice, sm_scale=sm_scale, config=config,
                       check_page_table=check_page_table, window_left=int(window_left),
                       logits_soft_cap=float(logits_soft_cap), kv_data_type=kv_data_type,
                       tile_by_step=not deterministic)
