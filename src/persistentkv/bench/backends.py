"""The decode backends the benchmark compares, behind one small interface.

A backend is planned once per step from a `StepInputs` (the page table and shapes), then run once
per layer. Every backend reads the same pools and queries and writes its own output buffers.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch

PKV_BACKENDS = ("grouped", "split", "workqueue")
PKV_GRAPH = "pkv-graph"
FLASHINFER_BACKENDS = ("fi-cuda-core", "fi-tensor-core", "fi-xqa")
BASELINES = ("padded-sdpa", "per-sequence")
ALL_BACKENDS = (tuple(f"pkv-{b}" for b in PKV_BACKENDS) + (PKV_GRAPH,) + FLASHINFER_BACKENDS
                + BASELINES)


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
    queries: list[torch.Tensor]    # per layer [B, Hq, D]
    pools: list[torch.Tensor]      # per layer [P, 2, ...] in `layout`
    layout: str
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_host)

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


class Backend:
    """plan(step) once per step on the host; run(layer) launches the layer's attention.

    capture_plan: plan() is capturable and belongs in the CUDA graph with the runs.
    """

    name = "backend"
    capture_plan = False

    def plan(self, step: StepInputs) -> None:
        raise NotImplementedError

    def run(self, layer: int) -> torch.Tensor:
        raise NotImplementedError

    def release(self) -> None:
        """Drop what plan() kept of the last step (which holds every layer's pool): called
        between traces, so that one trace's cache is freed before the next is allocated."""
        for attr in ("step", "outs", "static", "index", "mask", "rows"):
            if attr in self.__dict__:
                setattr(self, attr, None)


class PersistentKV(Backend):
    """One of our schedules, with the default split and launch configuration unless split_pages,
    config or overrides (KernelConfig fields over the head dim's default) fix them."""

    def __init__(self, schedule: str, *, layout: str, split_pages: int | None = None, config=None,
                 overrides: dict | None = None):
        from ..wrapper import DecodeWrapper  # imported late: the CLI picks the interpreter first

        self.overrides = dict(overrides or {})
        self.name = (f"pkv-{schedule}" + (f"@{split_pages}" if split_pages else "")
                     + _override_suffix(self.overrides))
        self.schedule, self.split_pages, self.config = schedule, split_pages, config
        self.wrapper = DecodeWrapper(layout)

    def plan(self, step: StepInputs) -> None:
        config = _with_overrides(self.config, self.overrides, head_dim=step.head_dim)
        self.step = step
        self.wrapper.plan(kv_indptr=step.kv_indptr, kv_indices=step.kv_indices,
                          kv_last_page_len=step.kv_last_page_len, num_qo_heads=step.num_qo_heads,
                          num_kv_heads=step.num_kv_heads, head_dim=step.head_dim,
                          page_size=step.page_size, backend=self.schedule,
                          split_pages=self.split_pages, config=config)
        self.outs = [torch.empty_like(q) for q in step.queries]

    def run(self, layer: int) -> torch.Tensor:
        return self.wrapper.run(self.step.queries[layer], self.step.pools[layer], out=self.outs[layer])


class PersistentKVGraph(Backend):
    """Graph mode: the page table copied into static buffers and planned on the GPU; plan() and
    the L runs are captured together (one graph for the step, no host planning)."""

    capture_plan = True

    def __init__(self, *, layout: str, overrides: dict | None = None):
        self.layout = layout
        self.overrides = dict(overrides or {})
        self.name = PKV_GRAPH + _override_suffix(self.overrides)
        self.wrapper = None
        self.sizes: tuple = ()

    def plan(self, step: StepInputs) -> None:
        from ..wrapper import DecodeWrapper

        sizes = (step.batch_size, step.kv_indices.numel(), step.num_qo_heads, step.head_dim)
        if sizes != self.sizes:                      # new buffers outside any capture
            self.sizes = sizes
            self.wrapper = DecodeWrapper(self.layout, use_cuda_graph=True,
                                         max_batch_size=max(1, step.batch_size),
                                         max_num_pages=max(1, step.kv_indices.numel()))
            self.static = [t.clone() for t in (step.kv_indptr, step.kv_indices,
                                               step.kv_last_page_len)]
            self.outs = [torch.empty_like(q) for q in step.queries]
        for dst, src in zip(self.static, (step.kv_indptr, step.kv_indices, step.kv_last_page_len)):
            dst.copy_(src)
        self.step = step
        self.wrapper.plan(kv_indptr=self.static[0], kv_indices=self.static[1],
                          kv_last_page_len=self.static[2], num_qo_heads=step.num_qo_heads,
                          num_kv_heads=step.num_kv_heads, head_dim=step.head_dim,
                          page_size=step.page_size,
                          config=_with_overrides(None, self.overrides, head_dim=step.head_dim))

    def run(self, layer: int) -> torch.Tensor:
        return self.wrapper.run(self.step.queries[layer], self.step.pools[layer], out=self.outs[layer])

    def release(self) -> None:
        super().release()
        self.wrapper, self.sizes = None, ()


class Adaptive(Backend):
    """The adaptive policy: per step, the backend the policy picks among `backends` (by name, as
    Choice.label gives it); PersistentKV's own pick when the policy's is not available here.
    mode: which of the policy's tables decides ("graph": `adaptive`, "eager": `adaptive-eager`)."""

    def __init__(self, policy, backends: list[Backend], *, sm_count: int, mode: str = "graph"):
        self.policy, self.sm_count, self.mode = policy, sm_count, mode
        self.name = "adaptive" if mode == "graph" else f"adaptive-{mode}"
        self.by_name = {b.name: b for b in backends}
        self.last_choice = ""

    def plan(self, step: StepInputs) -> None:
        from ..policy import StepFeatures

        features = StepFeatures.of(step.seq_lens_host, num_kv_heads=step.num_kv_heads,
                                   head_dim=step.head_dim, elem_size=step.pools[0].element_size(),
                                   sm_count=self.sm_count, page_size=step.page_size,
                                   group=step.num_qo_heads // step.num_kv_heads)
        choice = self.policy.decide(features, mode=self.mode)
        if choice.label() not in self.by_name:
            choice = self.policy.decide(features, pkv_only=True)
        if choice.label() not in self.by_name:
            raise Unsupported(f"the policy chose {choice.label()}, which is not built here")
        self.current = self.by_name[choice.label()]
        self.last_choice = choice.label()
        self.capture_plan = self.current.capture_plan
        self.current.plan(step)

    def run(self, layer: int) -> torch.Tensor:
        return self.current.run(layer)

    def release(self) -> None:
        self.current = None
        for backend in self.by_name.values():
            backend.release()


def flashinfer_version() -> str | None:
    try:
        import flashinfer
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return getattr(flashinfer, "__version__", "unknown")


class FlashInferWrapper(Backend):
    """BatchDecodeWithPagedKVCacheWrapper, CUDA-core (tc=False) or tensor-core (tc=True) path."""

    def __init__(self, *, use_tensor_cores: bool, layout: str, workspace: torch.Tensor):
        import flashinfer

        self.name = "fi-tensor-core" if use_tensor_cores else "fi-cuda-core"
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, layout, use_tensor_cores=use_tensor_cores)
        self.use_tensor_cores = use_tensor_cores

    def plan(self, step: StepInputs) -> None:
        group = step.num_qo_heads // step.num_kv_heads
        if not self.use_tensor_cores and group not in (1, 2, 3, 4, 6, 8):
            raise Unsupported(f"FlashInfer's CUDA-core decode does not serve group size {group}")
        self.step = step
        dtype = step.queries[0].dtype
        self.wrapper.plan(step.kv_indptr, step.kv_indices, step.kv_last_page_len, step.num_qo_heads,
                          step.num_kv_heads, step.head_dim, step.page_size, q_data_type=dtype,
                          kv_data_type=dtype)
        self.outs = [torch.empty_like(q) for q in step.queries]

    def run(self, layer: int) -> torch.Tensor:
        return self.wrapper.run(self.step.queries[layer], self.step.pools[layer], out=self.outs[layer])


class FlashInferXQA(Backend):
    """trtllm_batch_decode_with_kv_cache (XQA on Hopper); wants its own zero-filled workspace."""

    name = "fi-xqa"

    def __init__(self, *, layout: str, workspace: torch.Tensor):
        import flashinfer.decode

        self.fn = flashinfer.decode.trtllm_batch_decode_with_kv_cache
        self.layout, self.workspace = layout, workspace

    def plan(self, step: StepInputs) -> None:
        self.step = step
        self.max_seq_len = max(step.seq_lens_host, default=0)
        self.outs = [torch.empty_like(q) for q in step.queries]

    def run(self, layer: int) -> torch.Tensor:
        s = self.step
        return self.fn(s.queries[layer], s.pools[layer], self.workspace, s.block_table, s.seq_lens,
                       self.max_seq_len, bmm1_scale=s.sm_scale, bmm2_scale=1.0,
                       out=self.outs[layer], kv_layout=self.layout)


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


def _split_variant(name: str) -> tuple[str, int] | None:
    """'pkv-split@32' -> ('split', 32); None for any other name."""
    head, _, pages = name.partition("@")
    if head in ("pkv-split", "pkv-workqueue") and pages.isdigit() and int(pages) > 0:
        return head[4:], int(pages)
    return None


# ':<key><value>' suffixes of a backend name: a KernelConfig field and how its value is read
CONFIG_SUFFIXES = {"warps": ("num_warps", int), "stages": ("num_stages", int),
                   "pps": ("programs_per_sm", int), "waves": ("waves", float),
                   "oneround": ("one_round", lambda value: bool(int(value)))}


def _override_suffix(overrides: dict) -> str:
    short = {field: key for key, (field, _) in CONFIG_SUFFIXES.items()}
    return "".join(f":{short[field]}{value:g}" for field, value in overrides.items())


def _with_overrides(config, overrides: dict, *, head_dim: int):
    if not overrides:
        return config
    from ..tuning import default_config

    return dataclasses.replace(config or default_config(head_dim=head_dim), **overrides)


def _pkv_variant(name: str) -> tuple[str, int | None, dict] | None:
    """A variant of our schedules: 'pkv-split@32' -> ('split', 32, {}); 'pkv-workqueue:warps8' ->
    ('workqueue', None, {'num_warps': 8}); 'pkv-split@32:waves3:pps2' -> ('split', 32,
    {'waves': 3.0, 'programs_per_sm': 2}); 'pkv-graph:pps2' -> ('graph', None, {...}). None for
    any other name, the plain ones included."""
    base, *options = name.split(":")
    overrides = {}
    for option in options:
        key = option.rstrip("0123456789.")
        value = option[len(key):]
        if key not in CONFIG_SUFFIXES or not value or value.count(".") > 1:
            return None
        field, parse = CONFIG_SUFFIXES[key]
        overrides[field] = parse(float(value))
    split = _split_variant(base)
    if split is not None:
        return split[0], split[1], overrides
    if options and base in ("pkv-split", "pkv-workqueue", PKV_GRAPH):
        return base[4:], None, overrides
    return None


def make_backends(names: list[str], *, layout: str, device: torch.device,
                  split_pages: int | None = None) -> tuple[list[Backend], dict[str, str]]:
    """Build the named backends; returns (backends, {name: why it was skipped}).

    Besides ALL_BACKENDS, 'pkv-split@N' and 'pkv-workqueue@N' fix the split at N pages, and
    suffixes change the launch configuration of our backends: ':warpsW', ':stagesS', ':ppsP'
    (persistent programs per SM), ':wavesX' (target tasks per SM), ':oneround0|1', e.g.
    'pkv-graph:pps2'.
    """
    unknown = [n for n in names if n not in ALL_BACKENDS and _pkv_variant(n) is None]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; choose from {list(ALL_BACKENDS)} "
                         f"or pkv-split@N / pkv-workqueue@N (N pages per split), with optional "
                         f"suffixes {[':' + k + 'N' for k in CONFIG_SUFFIXES]}")
    backends: list[Backend] = []
    skipped: dict[str, str] = {}
    fi = flashinfer_version() if device.type == "cuda" else None
    factories: dict[str, Callable[[], Backend]] = {
        f"pkv-{b}": (lambda b=b: PersistentKV(b, layout=layout, split_pages=split_pages))
        for b in PKV_BACKENDS
    }
    factories[PKV_GRAPH] = lambda: PersistentKVGraph(layout=layout)
    factories["padded-sdpa"] = PaddedSDPA
    factories["per-sequence"] = PerSequence
    if fi is not None:
        def workspace() -> torch.Tensor:
            return torch.empty(128 << 20, dtype=torch.uint8, device=device)

        factories["fi-cuda-core"] = lambda: FlashInferWrapper(use_tensor_cores=False, layout=layout,
                                                              workspace=workspace())
        factories["fi-tensor-core"] = lambda: FlashInferWrapper(use_tensor_cores=True, layout=layout,
                                                                workspace=workspace())
        xqa_ws = torch.zeros(128 << 20, dtype=torch.uint8, device=device)
        factories["fi-xqa"] = lambda: FlashInferXQA(layout=layout, workspace=xqa_ws)
    for name in names:
        variant = _pkv_variant(name)
        if variant is not None:
            schedule, pages, overrides = variant
            backends.append(PersistentKVGraph(layout=layout, overrides=overrides)
                            if schedule == "graph" else
                            PersistentKV(schedule, layout=layout, split_pages=pages,
                                         overrides=overrides))
        elif name in factories:
            backends.append(factories[name]())
        else:
            skipped[name] = ("FlashInfer is not installed (pip install 'persistentkv[flashinfer]')"
                             if device.type == "cuda" else "FlashInfer needs a GPU")
    return backends, skipped
