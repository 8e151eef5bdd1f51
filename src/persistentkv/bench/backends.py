"""The decode backends the benchmark compares, behind one small interface.

A backend is planned once per step from a `StepInputs` (the page table and shapes), then run once
per layer. Every backend reads the same pools and queries and writes its own output buffers.
Ours: 'pkv-grouped', 'pkv-split', 'pkv-split@N' (N pages per split) and 'pkv-auto' (the policy
decides per step, on the device), each optionally with KernelConfig suffixes (`_pkv_variant`).
"""
from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..policy import Policy
from ..schedule import SCHEDULES
from ..tuning import KernelConfig, default_config

PKV_BACKENDS = (*SCHEDULES, "auto")   # DecodeWrapper.plan's backends (wrapper.BACKENDS, which
                                      # is not imported here: it imports triton)
FLASHINFER_BACKENDS = ("fi-cuda-core", "fi-tensor-core", "fi-xqa", "fi-prefill")
BASELINES = ("padded-sdpa", "per-sequence")
ALL_BACKENDS = tuple(f"pkv-{b}" for b in PKV_BACKENDS) + FLASHINFER_BACKENDS + BASELINES


class Unsupported(Exception):
    """The backend cannot serve this configuration (reported, not timed)."""


@dataclass
class StepInputs:
    """One decode step: page table in both forms (int32, on the device), per-layer q and pools."""

    kv_indptr: torch.Tensor        # [B+1]
    kv_indices: torch.Tensor       # [nnz]
    kv_last_page_len: torch.Tensor # [B]
    block_table: torch.Tensor      # [B, max_pages]
    seq_lens: torch.Tensor         # [B]
    seq_lens_host: list[int]
    queries: list[torch.Tensor]    # per layer [B, Hq, D], or [qo_indptr[B], Hq, D]
    pools: list[torch.Tensor]      # per layer [P, 2, ...] in `layout`
    layout: str
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    qo_indptr: torch.Tensor | None = None   # host int32 [B+1]: several query tokens per row
    window_left: int = -1                    # attention variants (DecodeWrapper.plan's names)
    logits_soft_cap: float = 0.0
    sinks: list[torch.Tensor] | None = None  # per layer float32 [Hq]
    scales: list[dict] = field(default_factory=list)   # per layer: an fp8 cache's run() scales
    _host_table: tuple | None = field(default=None, init=False, repr=False)

    @property
    def kv_fp8(self) -> str | None:
        """None, or the fp8 cache's scale granularity: "tensor" or "token"."""
        if not self.scales or not self.scales[0]:
            return None
        return "token" if "kv_scales" in self.scales[0] else "tensor"

    def per_tensor_scales(self, backend: str) -> tuple[float, float]:
        """(k_scale, v_scale): (1, 1) for fp16/bf16; Unsupported for per-token scales."""
        if self.kv_fp8 == "token":
            raise Unsupported(f"{backend} takes per-tensor fp8 scales only")
        s = self.scales[0] if self.scales else {}
        return s.get("k_scale", 1.0), s.get("v_scale", 1.0)

    def one_query_per_row(self, backend: str) -> None:
        """Unsupported for a backend that takes one query token per row, on a multi-token step."""
        if self.qo_indptr is not None:
            raise Unsupported(f"{backend} takes one query token per row")

    def refuse_variants(self, backend: str, *, window: bool = True, soft_cap: bool = True,
                        sinks: bool = True) -> None:
        """Unsupported for a backend without the step's variants (True: it lacks that one)."""
        lacks = [name for name, on, lacking in (
            ("a sliding window", self.window_left >= 0, window),
            ("soft-capped logits", self.logits_soft_cap > 0, soft_cap),
            ("sinks", self.sinks is not None, sinks)) if on and lacking]
        if lacks:
            raise Unsupported(f"{backend} does not take {', '.join(lacks)}")

    def host_page_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv_indptr, kv_last_page_len) on the host, copied once per step (outside any timing)."""
        if self._host_table is None:
            self._host_table = (self.kv_indptr.cpu(), self.kv_last_page_len.cpu())
        return self._host_table

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_host)

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


class Backend:
    """plan(step) once per step; run(layer) launches the layer's attention.

    capture_plan: plan() is capturable and belongs in the CUDA graph with the runs.
    fp8_error_bound: on an fp8 cache, the error against the reference accepted from a baseline
    that multiplies in e4m3 (None: the dtype's usual bound), reported with its timing.
    refusals: the exceptions by which the library behind the backend refuses a configuration
    when the step's first plan() raises them: reported unsupported, not failed (from run(), an
    error is a failure).
    """

    name = "backend"
    capture_plan = False
    fp8_error_bound: float | None = None
    refusals: tuple[type[Exception], ...] = ()

    def plan(self, step: StepInputs) -> None:
        raise NotImplementedError

    def run(self, layer: int) -> torch.Tensor:
        raise NotImplementedError

    def last_choice(self) -> str:
        """What the backend chose for the last planned step ('' when it chooses nothing); may
        read the device: call it outside timed code."""
        return ""

    def allocate_outputs(self, step: StepInputs) -> None:
        """self.outs, an output per layer, allocated when the step changes: planning a step
        again allocates nothing, in every backend alike (an allocation per plan was timed in
        FlashInfer's eager steps only)."""
        if self.__dict__.get("outs_step") is not step or self.__dict__.get("outs") is None:
            self.outs_step, self.outs = step, [torch.empty_like(q) for q in step.queries]

    def release(self) -> None:
        """Drop what plan() kept of the last step (which holds every layer's pool): called
        between traces, so that one trace's cache is freed before the next is allocated."""
        for attr in ("step", "outs", "outs_step", "static", "index", "mask", "rows"):
            if attr in self.__dict__:
                setattr(self, attr, None)


class PersistentKV(Backend):
    """DecodeWrapper.plan(backend=...) and run(): "grouped", "split" (split_pages pages per
    split, default: the split rule) or "auto" (policy: the one to decide with, default the one
    shipped for the GPU). config, overrides: the launch configuration (KernelConfig fields over
    config, or over the head dim's default). plan() is one planner launch on the device and is
    captured with the runs; planning a step again with its own page-table tensors only
    relaunches the planner (as a server that refills its page-table buffers in place)."""

    capture_plan = True

    def __init__(self, backend: str, *, layout: str, split_pages: int | None = None,
                 config: KernelConfig | None = None, overrides: dict | None = None,
                 policy: Policy | None = None):
        from ..wrapper import DecodeWrapper  # imported late: the CLI picks the interpreter first

        if backend not in PKV_BACKENDS:
            raise ValueError(f"backend must be one of {PKV_BACKENDS}, got {backend!r}")
        self.overrides = dict(overrides or {})
        dataclasses.replace(config or KernelConfig(), **self.overrides)   # checks the values
        self.name = (f"pkv-{backend}" + (f"@{split_pages}" if split_pages else "")
                     + _override_suffix(self.overrides))
        self.backend, self.split_pages, self.config = backend, split_pages, config
        self.wrapper = DecodeWrapper(layout, policy=policy)
        self._configs: dict[tuple, KernelConfig | None] = {}   # (head_dim, Hkv) -> config
        self.step = None

    def plan(self, step: StepInputs) -> None:
        shape = (step.head_dim, step.num_kv_heads)
        if shape not in self._configs:
            self._configs[shape] = _with_overrides(self.config, self.overrides,
                                                   head_dim=step.head_dim,
                                                   num_kv_heads=step.num_kv_heads)
        config = self._configs[shape]
        self.step = step
        self.allocate_outputs(step)
        self.wrapper.plan(kv_indptr=step.kv_indptr, kv_indices=step.kv_indices,
                          kv_last_page_len=step.kv_last_page_len, num_qo_heads=step.num_qo_heads,
                          num_kv_heads=step.num_kv_heads, head_dim=step.head_dim,
                          page_size=step.page_size, backend=self.backend,
                          split_pages=self.split_pages, config=config, qo_indptr=step.qo_indptr,
                          window_left=step.window_left, logits_soft_cap=step.logits_soft_cap,
                          kv_data_type=step.pools[0].dtype)

    def run(self, layer: int) -> torch.Tensor:
        s = self.step
        return self.wrapper.run(s.queries[layer], s.pools[layer], out=self.outs[layer],
                                sinks=None if s.sinks is None else s.sinks[layer],
                                **(s.scales[layer] if s.scales else {}))

    def last_choice(self) -> str:
        """pkv-auto: the planner's choice for the last step, e.g. 'split@16' (a device read)."""
        if self.backend != "auto":
            return ""
        return str(self.wrapper.current_plan.info()["choice"])


def flashinfer_version() -> str | None:
    """FlashInfer's version, or None where it does not import (flashinfer_import_error says why)."""
    return None if flashinfer_import_error() else getattr(sys.modules["flashinfer"], "__version__",
                                                          "unknown")


def flashinfer_import_error() -> str | None:
    """Why FlashInfer does not import ('No module named ...', or the error of an installed one
    that fails, e.g. a library it cannot load), or None when it does."""
    try:
        import flashinfer  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure means "not available"
        return f"{type(error).__name__}: {error}"
    return None


# FlashInfer refuses what it does not serve (a page size, a head dim, a group) with these,
# raised by its argument checks before any kernel runs
FLASHINFER_REFUSALS = (ValueError, NotImplementedError)
XQA_PAGE_SIZES = (16, 32, 64, 128)   # trtllm_batch_decode_with_kv_cache's (its ValueError)


class FlashInferWrapper(Backend):
    """BatchDecodeWithPagedKVCacheWrapper, CUDA-core (tc=False) or tensor-core (tc=True) path.
    Its plan() takes the page table's indptr and last-page lengths from the host, as a server
    keeps them (given device tensors it copies them back, a synchronization in every plan)."""

    refusals = FLASHINFER_REFUSALS

    def __init__(self, *, use_tensor_cores: bool, layout: str, workspace: torch.Tensor):
        import flashinfer

        self.name = "fi-tensor-core" if use_tensor_cores else "fi-cuda-core"
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, layout, use_tensor_cores=use_tensor_cores)
        self.use_tensor_cores = use_tensor_cores

    def plan(self, step: StepInputs) -> None:
        step.one_query_per_row(self.name)
        step.refuse_variants(self.name, window=False, soft_cap=False)
        group = step.num_qo_heads // step.num_kv_heads
        if not self.use_tensor_cores and group not in (1, 2, 3, 4, 6, 8):
            raise Unsupported(f"FlashInfer's CUDA-core decode does not serve group size {group}")
        self.step = step
        self.k_scale, self.v_scale = step.per_tensor_scales(self.name)
        dtype = step.queries[0].dtype
        indptr, last_page_len = step.host_page_table()
        self.wrapper.plan(indptr, step.kv_indices, last_page_len, step.num_qo_heads,
                          step.num_kv_heads, step.head_dim, step.page_size, q_data_type=dtype,
                          kv_data_type=step.pools[0].dtype, **_fi_variants(step))
        self.allocate_outputs(step)

    def run(self, layer: int) -> torch.Tensor:
        fp8 = {} if self.step.kv_fp8 is None else dict(k_scale=self.k_scale, v_scale=self.v_scale)
        return self.wrapper.run(self.step.queries[layer], self.step.pools[layer],
                                out=self.outs[layer], **fp8)


def _fi_variants(step: StepInputs) -> dict:
    """The plan() arguments of FlashInfer's wrappers for the step's window and soft-cap."""
    return dict(window_left=step.window_left,
                logits_soft_cap=step.logits_soft_cap if step.logits_soft_cap > 0 else None)


class FlashInferXQA(Backend):
    """trtllm_batch_decode_with_kv_cache (XQA on Hopper); wants its own zero-filled workspace.
    Several query tokens per row: its speculative-decoding path (q_len_per_req, the same count
    for every row) with a causal draft mask (bit k of query j's 32-bit words: draft token k
    visible, k <= j)."""

    name = "fi-xqa"
    refusals = FLASHINFER_REFUSALS
    # with an fp8 cache XQA's products run in e4m3: on the H200 its output is 3.4-3.8e-2 from
    # the reference on the fp8 values, the size of e4m3's rounding (BENCHMARKS.md v11)
    fp8_error_bound = 0.1

    def __init__(self, *, layout: str, workspace: torch.Tensor):
        import flashinfer.decode

        self.fn = flashinfer.decode.trtllm_batch_decode_with_kv_cache
        self.layout, self.workspace = layout, workspace

    def plan(self, step: StepInputs) -> None:
        step.refuse_variants(self.name, window=False, sinks=False)
        if step.page_size not in XQA_PAGE_SIZES:   # its run() would refuse it
            raise Unsupported(f"XQA takes pages of {', '.join(map(str, XQA_PAGE_SIZES))} tokens, "
                              f"not {step.page_size}")
        self.q_len, self.mask = 1, None
        if step.qo_indptr is not None:
            counts = set(torch.diff(step.qo_indptr).tolist())
            if len(counts) != 1:
                raise Unsupported("XQA's speculative path takes one query count for every row")
            self.q_len = counts.pop()
            self.mask = _causal_draft_mask(step.batch_size, self.q_len, step.kv_indptr.device)
        self.step = step
        self.k_scale, self.v_scale = step.per_tensor_scales(self.name)
        self.max_seq_len = max(step.seq_lens_host, default=0)
        self.allocate_outputs(step)

    def run(self, layer: int) -> torch.Tensor:
        s = self.step
        extra = {} if self.mask is None else {"q_len_per_req": self.q_len, "mask": self.mask}
        if s.sinks is not None:
            extra["sinks"] = s.sinks[layer]
        return self.fn(s.queries[layer], s.pools[layer], self.workspace, s.block_table, s.seq_lens,
                       self.max_seq_len, bmm1_scale=s.sm_scale * self.k_scale,
                       bmm2_scale=self.v_scale,
                       window_left=s.window_left, out=self.outs[layer], kv_layout=self.layout,
                       **extra)


def _causal_draft_mask(rows: int, q_len: int, device: torch.device) -> torch.Tensor:
    """XQA's draft mask, uint16 [rows, q_len, 2 * ceil(q_len / 32)]: query j sees draft tokens
    k <= j (bit k of its 32-bit words, little-endian halves)."""
    words = -(-q_len // 32)
    k = torch.arange(words * 32)
    visible = k[None, :] <= torch.arange(q_len)[:, None]                       # [q_len, bits]
    bits = (visible.view(q_len, words, 32).long() << torch.arange(32)).sum(-1)  # [q_len, words]
    words32 = bits.to(torch.int32)            # the low 32 bits (int64 -> int32 wraps)
    return (words32.view(torch.uint16).reshape(1, q_len, 2 * words)
            .expand(rows, -1, -1).contiguous().to(device))


class FlashInferPrefill(Backend):
    """BatchPrefillWithPagedKVCacheWrapper (backend "fa2") with causal=True: FlashInfer's path
    for several query tokens per row (the row's last ones, the causal mask aligned to the end).
    Its plan() takes qo_indptr and the page table's indptr and last-page lengths from the host."""

    name = "fi-prefill"
    refusals = FLASHINFER_REFUSALS

    def __init__(self, *, layout: str, workspace: torch.Tensor):
        import flashinfer

        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, layout,
                                                                       backend="fa2")

    def plan(self, step: StepInputs) -> None:
        step.refuse_variants(self.name, window=False, soft_cap=False)
        if step.kv_fp8 is not None:
            raise Unsupported(f"{self.name}: measured on fp16/bf16 caches only")
        self.step = step
        dtype = step.queries[0].dtype
        rows = step.batch_size
        qo_indptr = (torch.arange(rows + 1, dtype=torch.int32) if step.qo_indptr is None
                     else step.qo_indptr)
        indptr, last_page_len = step.host_page_table()
        self.wrapper.plan(qo_indptr, indptr, step.kv_indices, last_page_len,
                          step.num_qo_heads, step.num_kv_heads,
                          step.head_dim, step.page_size, causal=True, q_data_type=dtype,
                          kv_data_type=dtype, **_fi_variants(step))
        self.allocate_outputs(step)

    def run(self, layer: int) -> torch.Tensor:
        return self.wrapper.run(self.step.queries[layer], self.step.pools[layer], out=self.outs[layer])


def _half_cache_only(step: StepInputs, backend: str) -> None:
    if step.kv_fp8 is not None:
        raise Unsupported(f"{backend} reads fp16/bf16 caches only")


def _token_index(step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat token positions (page * page_size + slot) [B, Lmax] and a validity mask [B, Lmax]."""
    max_len = max(step.seq_lens_host)
    pos = torch.arange(max_len, device=step.block_table.device)
    valid = pos[None, :] < step.seq_lens.long()[:, None]
    pages = step.block_table.long().gather(1, (pos // step.page_size).clamp_max(
        step.block_table.shape[1] - 1).expand(step.batch_size, -1))
    return torch.where(valid, pages * step.page_size + pos % step.page_size, 0), valid


def _token_major(pool: torch.Tensor, layout: str, kv: int) -> torch.Tensor:
    """K or V of a pool as [P * page_size, H, D] (a copy for HND)."""
    t = pool[:, kv]
    if layout == "HND":
        t = t.transpose(1, 2)
    return t.reshape(-1, t.shape[-2], t.shape[-1])


class PaddedSDPA(Backend):
    """Gather every row's K/V into one padded dense tensor, then scaled_dot_product_attention."""

    name = "padded-sdpa"

    def plan(self, step: StepInputs) -> None:
        step.one_query_per_row(self.name)
        step.refuse_variants(self.name)
        _half_cache_only(step, self.name)
        self.step = step
        index, valid = _token_index(step)
        self.index = index.reshape(-1)
        self.mask = valid[:, None, None, :]                       # [B, 1, 1, Lmax]
        self.max_len = index.shape[1]

    def run(self, layer: int) -> torch.Tensor:
        s = self.step
        b, hq, d = s.queries[layer].shape
        out = []
        for kv in (0, 1):
            dense = _token_major(s.pools[layer], s.layout, kv).index_select(0, self.index)
            out.append(dense.view(b, self.max_len, s.num_kv_heads, d).transpose(1, 2))
        o = torch.nn.functional.scaled_dot_product_attention(
            s.queries[layer][:, :, None], out[0], out[1], attn_mask=self.mask, enable_gqa=True)
        return o[:, :, 0]


class PerSequence(Backend):
    """One exact-length gather + attention per row (no padding, B launches per layer)."""

    name = "per-sequence"

    def plan(self, step: StepInputs) -> None:
        step.one_query_per_row(self.name)
        step.refuse_variants(self.name)
        _half_cache_only(step, self.name)
        self.step = step
        index, _ = _token_index(step)
        self.rows = [index[r, :n] for r, n in enumerate(step.seq_lens_host)]

    def run(self, layer: int) -> torch.Tensor:
        s = self.step
        q = s.queries[layer]
        k_all = _token_major(s.pools[layer], s.layout, 0)
        v_all = _token_major(s.pools[layer], s.layout, 1)
        outs = []
        for r, idx in enumerate(self.rows):
            k = k_all.index_select(0, idx).transpose(0, 1)[None]         # [1, Hkv, L, D]
            v = v_all.index_select(0, idx).transpose(0, 1)[None]
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                q[r:r + 1, :, None], k, v, enable_gqa=True)[:, :, 0])
        return torch.cat(outs)


_FLAG = {"0": False, "1": True}.__getitem__   # a suffix's 0 or 1, as a bool
# ':<key><value>' suffixes of our backends' names: a KernelConfig field and how its value is read
CONFIG_SUFFIXES = {"warps": ("num_warps", int), "stages": ("num_stages", int),
                   "pps": ("programs_per_sm", int), "waves": ("waves", float),
                   "oneround": ("one_round", _FLAG),
                   "minsplit": ("min_split_tokens", int), "blockn": ("block_n", int),
                   "fp8blockn": ("fp8_block_n", int), "balfrom": ("balanced_from_tokens", int),
                   "pdl": ("pdl", _FLAG),
                   "maxreg": ("max_registers", lambda text: int(text) or None),
                   "maxregrows": ("max_registers_rows", lambda text: int(text) or None),
                   "longblockn": ("long_block_n", lambda text: int(text) or None),
                   "longfrom": ("long_from_tokens", int),
                   "tilerows": ("max_tile_rows", lambda text: int(text) or None),
                   "padrows": ("min_tile_rows", int),
                   "smallstep": ("small_step_kv_bytes_per_sm", int),
                   "largerows": ("large_step_tile_rows", lambda text: int(text) or None),
                   "valueblocks": ("value_blocks", int),
                   "valuestages": ("value_block_stages", lambda text: int(text) or None),
                   "valuerows": ("value_block_rows", int),
                   "firstpages": ("first_pages", _FLAG),
                   "pagefetch": ("page_prefetch_tiles", int),
                   "taskfetch": ("page_prefetch_task", _FLAG),
                   "keeptable": ("keep_page_table", _FLAG)}


def _override_suffix(overrides: dict) -> str:
    """The name's `:<key><value>` suffixes, each value as parsed back (ints whole, floats short
    where that is exact)."""
    short = {field: key for key, (field, _) in CONFIG_SUFFIXES.items()}
    return "".join(f":{short[field]}{_exact(0 if value is None else value)}"
                   for field, value in overrides.items())


def _exact(value: int | float) -> str:
    if isinstance(value, int):
        return str(int(value))   # a flag as 0 or 1
    return f"{value:g}" if float(f"{value:g}") == value else str(value)


def _with_overrides(config: KernelConfig | None, overrides: dict, *, head_dim: int,
                    num_kv_heads: int) -> KernelConfig | None:
    if not overrides:
        return config
    return dataclasses.replace(config or default_config(head_dim=head_dim,
                                                        num_kv_heads=num_kv_heads), **overrides)


def _pkv_variant(name: str) -> tuple[str, int | None, dict] | None:
    """One of our backends: 'pkv-split@16:warps8' -> ('split', 16, {'num_warps': 8});
    'pkv-auto:pps3' -> ('auto', None, {'programs_per_sm': 3}); 'pkv-grouped' -> ('grouped',
    None, {}). None for any other name (FlashInfer's, the baselines', a malformed one)."""
    base, *options = name.split(":")
    head, at, pages = base.partition("@")
    backend = head.removeprefix("pkv-")
    if backend == head or backend not in PKV_BACKENDS:
        return None
    if at and not (backend == "split" and pages.isdigit() and int(pages) > 0):
        return None
    overrides = {}
    for option in options:
        key = option.rstrip("0123456789.")
        if key not in CONFIG_SUFFIXES:
            return None
        field, parse = CONFIG_SUFFIXES[key]
        try:
            overrides[field] = parse(option[len(key):])
        except (KeyError, ValueError):
            return None
    return backend, int(pages) if at else None, overrides


def pkv_backend_config(name: str, *, head_dim: int, num_kv_heads: int
                       ) -> tuple[str, int | None, KernelConfig]:
    """One of our backends' names -> (plan()'s backend, split_pages, the KernelConfig it runs):
    'pkv-auto:minsplit32' -> ('auto', None, the shape's default with min_split_tokens 32)."""
    parsed = _pkv_variant(name)
    if parsed is None:
        raise ValueError(f"backend must be pkv-NAME[@PAGES][:<key><value>...] with NAME one of "
                         f"{list(PKV_BACKENDS)} and key one of {list(CONFIG_SUFFIXES)} (e.g. "
                         f"'pkv-auto', 'pkv-split@16:warps8'); got {name!r}")
    backend, pages, overrides = parsed
    base = default_config(head_dim=head_dim, num_kv_heads=num_kv_heads)
    return backend, pages, _with_overrides(base, overrides, head_dim=head_dim,
                                           num_kv_heads=num_kv_heads)


def make_backends(names: list[str], *, layout: str, device: torch.device,
                  policy: Policy | None = None) -> tuple[list[Backend], dict[str, str]]:
    """Build the named backends; returns (backends, {name: why it was skipped}).

    Besides ALL_BACKENDS, 'pkv-split@N' fixes the split at N pages, and suffixes change the
    launch configuration of ours: ':warpsW', ':stagesS', ':ppsP' (persistent programs per SM),
    ':wavesX' (target tasks per SM), ':oneround0|1', ':minsplitT' (smallest split, tokens),
    ':blocknN' (tokens per K/V tile), ':fp8blocknN' (an fp8 cache's), ':balfromT' (the default
    rule's balanced_from_tokens, 0 off), ':pdl0|1' (programmatic dependent launch), ':maxregR'
    (registers a thread; 0: the compiler's choice), ':maxregrowsR' (the cap on programs of at
    most R rows only; 0: on every program), ':longblocknN' and ':longfromT' (the tile of tasks
    of at least T tokens; ':longblockn0' none of their own), ':tilerowsR' (a program's query
    rows: a task of more runs as M-blocks of R), ':padrowsR' (a program's tile of more than 16
    rows padded to at least R), ':smallstepB' (steps of at most B bytes of K/V an SM cut their
    tile in half; 0: never), ':largerowsR' (steps known to hold more run tiles of R rows or
    more as M-blocks of R; 0: never), ':valueblocksV' (programs of 64 rows or more share a
    task's output columns V ways), ':valuestagesS' (their stages; 0: the config's),
    ':valuerowsR' (value blocks from tiles of R rows, not 64), ':firstpages0|1' (the planner
    writes each task's first tile's pages beside its record), e.g.
    'pkv-split@16:warps8', 'pkv-auto:pps3'.
    policy: what pkv-auto decides with (default: the policy shipped for the GPU).
    """
    unknown = [n for n in names if n not in ALL_BACKENDS and _pkv_variant(n) is None]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; choose from {list(ALL_BACKENDS)} or "
                         f"pkv-split@N (N pages per split), ours with optional suffixes "
                         f"{[':' + k + 'N' for k in CONFIG_SUFFIXES]}")
    backends: list[Backend] = []
    skipped: dict[str, str] = {}
    fi = flashinfer_version() if device.type == "cuda" else None
    factories: dict[str, Callable[[], Backend]] = {"padded-sdpa": PaddedSDPA,
                                                   "per-sequence": PerSequence}
    if fi is not None:
        def workspace() -> torch.Tensor:
            return torch.empty(128 << 20, dtype=torch.uint8, device=device)

        factories["fi-cuda-core"] = lambda: FlashInferWrapper(use_tensor_cores=False, layout=layout,
                                                              workspace=workspace())
        factories["fi-tensor-core"] = lambda: FlashInferWrapper(use_tensor_cores=True, layout=layout,
                                                                workspace=workspace())
        xqa_ws = torch.zeros(128 << 20, dtype=torch.uint8, device=device)
        factories["fi-xqa"] = lambda: FlashInferXQA(layout=layout, workspace=xqa_ws)
        factories["fi-prefill"] = lambda: FlashInferPrefill(layout=layout, workspace=workspace())
    for name in names:
        variant = _pkv_variant(name)
        if variant is not None:
            backend, pages, overrides = variant
            backends.append(PersistentKV(backend, layout=layout, split_pages=pages,
                                         overrides=overrides, policy=policy))
        elif layout == "HND_VT":
            skipped[name] = "reads HND and NHD caches only, not PersistentKV's HND_VT"
        elif name in factories:
            backends.append(factories[name]())
        else:
            skipped[name] = (f"FlashInfer does not import ({flashinfer_import_error()}; pip "
                             f"install 'persistentkv[flashinfer]')"
                             if device.type == "cuda" else "FlashInfer needs a GPU")
    return backends, skipped
