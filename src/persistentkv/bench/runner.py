"""Drive a real PagedKVCache through a trace (or a static grid cell) and measure every backend.

The cache holds one page pool per layer (so the L2 never holds a step's KV across layers), filled
with unit-variance random data once; the allocator hands out pages from a shuffled free list and
takes them back as requests finish, so page tables scatter as in a running server.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..cache import PagedKVCache, check_v_transposed_page
from ..checks import check_attention_shape, check_fp32_scale
from ..quant import FP8, FP8_MAX, SCALE_GRANULARITIES
from ..queries import MAX_QUERIES_PER_ROW
from .backends import Backend, StepInputs
from .measure import StepTiming, measure_step, reference_output, time_graphs, tokens_seen
from .traces import Trace, peak_tokens, replay


FP8_SCALE = 4.0 / FP8_MAX   # the benchmark's per-tensor fp8 scale: unit-variance K/V to 4 sigma

# Hq / Hkv / head_dim of deployed GQA models (a tensor-parallel shard where named)
MODEL_PRESETS = {"llama3-8b": (32, 8, 128), "llama3-70b": (64, 8, 128),
                 "llama3-70b-tp4": (16, 2, 128), "llama3-70b-tp8": (8, 1, 128),
                 "qwen2.5-7b": (28, 4, 128), "qwen3-14b": (40, 8, 128), "gpt-oss": (64, 8, 64),
                 "gpt-oss-tp8": (8, 1, 64), "gemma2-9b": (16, 8, 256)}


@dataclass(frozen=True)
class ModelShape:
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: torch.dtype = torch.float16
    layout: str = "HND"
    kv_fp8: str | None = None        # an e4m3 cache with scales per "tensor" or per "token"

    def __post_init__(self):
        check_attention_shape(num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
                              head_dim=self.head_dim, page_size=self.page_size)
        check_v_transposed_page(self.layout, self.page_size)
        if self.kv_fp8 not in (None, *SCALE_GRANULARITIES):
            raise ValueError(f"kv_fp8 must be None or one of {SCALE_GRANULARITIES}, got "
                             f"{self.kv_fp8!r}")

    @classmethod
    def of(cls, preset: str | None = None, **fields) -> "ModelShape":
        """A shape from a MODEL_PRESETS name (its heads and head dim), then `fields`; fields left
        None keep the preset's value or the default."""
        if preset is not None:
            if preset not in MODEL_PRESETS:
                raise ValueError(f"preset must be one of {list(MODEL_PRESETS)}, got {preset!r}")
            heads = dict(zip(("num_qo_heads", "num_kv_heads", "head_dim"), MODEL_PRESETS[preset]))
            fields = {**heads, **{k: v for k, v in fields.items() if v is not None}}
        return cls(**{k: v for k, v in fields.items() if v is not None})

    def record(self) -> dict:
        """The shape as results files record it (environment["shape"])."""
        return {"num_qo_heads": self.num_qo_heads, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "page_size": self.page_size,
                "dtype": str(self.dtype).replace("torch.", ""), "layout": self.layout,
                "kv_fp8": self.kv_fp8}

    def bytes_per_token(self) -> int:
        """K and V bytes of one token (an fp8 cache's per-token scales included)."""
        if self.kv_fp8 is None:
            return self.num_kv_heads * self.head_dim * 2 * torch.tensor([], dtype=self.dtype).element_size()
        return self.num_kv_heads * 2 * (self.head_dim + (4 if self.kv_fp8 == "token" else 0))


L2_ROTATION_BYTES = 256e6   # K/V a step reads across its layers: several L2s (50-60 MB)
MAX_ROTATION_LAYERS = 1024  # ... in at most this many layers


@dataclass
class RunOptions:
    layers: int = 32
    samples: int = 16               # measured steps per trace
    eager_reps: int = 3
    graph_reps: int = 10
    check_every: int = 4            # check every n-th measured step against the reference
    memory_budget_gb: float = 60.0  # for all layers' pools together
    seed: int = 0
    q_len: str = "1"                # query tokens per row of a static batch: "N", or "mix" (2-8)
    window_left: int = -1           # attention variants of every step: a sliding window,
    logits_soft_cap: float = 0.0    # soft-capped scores,
    sinks: bool = False             # a sink logit per head (drawn per layer)
    rotate_l2: bool = True          # more layers where `layers` of a step fit in the L2

    def __post_init__(self):
        for name in ("layers", "samples", "eager_reps", "check_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(self.graph_reps, bool) or not isinstance(self.graph_reps, int) or self.graph_reps < 0:
            raise ValueError(f"graph_reps must be a non-negative int, got {self.graph_reps!r}")
        if not (math.isfinite(self.memory_budget_gb) and self.memory_budget_gb > 0):
            raise ValueError(f"memory budget must be > 0 GB, got {self.memory_budget_gb!r}")
        if self.q_len != "mix" and not (isinstance(self.q_len, str) and self.q_len.isdecimal()
                                        and self.q_len.isascii() and self.q_len[0] != "0"
                                        and 1 <= int(self.q_len) <= MAX_QUERIES_PER_ROW):
            raise ValueError(f"q_len must be 1 to {MAX_QUERIES_PER_ROW} or 'mix', got "
                             f"{self.q_len!r}")
        if isinstance(self.window_left, bool) or not isinstance(self.window_left, int) or \
                self.window_left < -1:
            raise ValueError(f"window_left must be -1 (none) or an int >= 0, got "
                             f"{self.window_left!r}")
        check_fp32_scale("logits_soft_cap", self.logits_soft_cap, zero=True,
                         factor=math.log2(math.e))   # as plan() takes it

    def variants(self) -> dict:
        """The step's attention variants, as StepInputs takes them (sinks: whether to draw)."""
        return dict(window_left=self.window_left, logits_soft_cap=self.logits_soft_cap,
                    sinks=self.sinks)


def query_counts(q_len: str, seq_lens: list[int], *, seed: int) -> list[int] | None:
    """Query tokens per row: None for plain decode ("1"), N for every row (at most its length),
    or "mix": 2 to 8 per row, drawn with `seed`."""
    if q_len == "1":
        return None
    if q_len == "mix":
        counts = np.random.default_rng(seed).integers(2, 9, len(seq_lens)).tolist()
    else:
        counts = [int(q_len)] * len(seq_lens)
    return [min(c, n) for c, n in zip(counts, seq_lens)]


@dataclass
class Measured:
    """Per-step timings of every backend for one trace or grid cell."""

    name: str
    batch_slots: int
    layers: int                                       # layers the pools have (L2 rotation)
    steps: list[dict] = field(default_factory=list)   # one dict per (step, backend)
    step_layers: int = 0           # layers of a model step as timed eagerly: the options',
                                   # or `layers` where the memory allowed fewer (0: `layers`)


def functional_setup(shape: ModelShape, opts: RunOptions) -> tuple[ModelShape, RunOptions]:
    """The tiny shape (8/2/64, the given page size, dtype and layout) and options of a run through
    the CPU interpreter (timings mean nothing)."""
    return (dataclasses.replace(shape, num_qo_heads=8, num_kv_heads=2, head_dim=64),
            dataclasses.replace(opts, layers=2, samples=2, eager_reps=1, graph_reps=0,
                                check_every=1, rotate_l2=False))


def layers_that_fit(shape: ModelShape, num_pages: int, opts: RunOptions, *,
                    read_tokens: int | None = None) -> int:
    """Layers whose pools of num_pages pages fit the memory budget: opts.layers, or with
    opts.rotate_l2 more where a step's K/V (read_tokens a layer; default the pool's) across them
    is under L2_ROTATION_BYTES, so that every layer's reads come from HBM, not the L2 (at most
    MAX_ROTATION_LAYERS). A ValueError when not even one layer fits."""
    per_token = shape.bytes_per_token()
    per_layer = num_pages * shape.page_size * per_token
    if per_layer > opts.memory_budget_gb * 1e9:
        raise ValueError(f"one layer's pool of {num_pages} pages needs {per_layer / 1e9:.1f} GB, "
                         f"over the memory budget of {opts.memory_budget_gb:g} GB (--memory-gb)")
    layers = opts.layers
    if opts.rotate_l2:
        read = max(1, (num_pages * shape.page_size if read_tokens is None else read_tokens)
                   * per_token)
        layers = max(layers, min(MAX_ROTATION_LAYERS, math.ceil(L2_ROTATION_BYTES / read)))
    return min(layers, int(opts.memory_budget_gb * 1e9 // per_layer))


def make_cache(shape: ModelShape, *, num_pages: int, layers: int, device: torch.device,
               seed: int) -> PagedKVCache:
    torch.manual_seed(seed)
    if shape.kv_fp8 is None:
        kv = dict(dtype=shape.dtype)
    elif shape.kv_fp8 == "tensor":      # unit-variance values: a scale of 4 sigma / 448
        kv = dict(dtype=FP8, kv_scale="tensor", k_scale=FP8_SCALE, v_scale=FP8_SCALE)
    else:
        kv = dict(dtype=FP8, kv_scale="token")
    return PagedKVCache(num_layers=layers, num_pages=num_pages, page_size=shape.page_size,
                        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                        layout=shape.layout, device=device, shuffle_seed=seed, init="randn", **kv)


def step_inputs(cache: PagedKVCache, seq_ids: list, shape: ModelShape,
                generator: torch.Generator, q_counts: list[int] | None = None, *,
                window_left: int = -1, logits_soft_cap: float = 0.0,
                sinks: bool = False) -> StepInputs:
    """A step's inputs; q_counts: query tokens per row (qo_indptr), default one; the attention
    variants (sinks: a float32 [Hq] logit vector drawn per layer, about the scores' scale)."""
    table = cache.page_table(seq_ids)
    indptr, indices, last = table.csr(cache.device)
    block_table, seq_lens = table.block_table(cache.device)
    total = len(seq_ids) if q_counts is None else sum(q_counts)
    qo_indptr = None if q_counts is None else torch.tensor(
        np.concatenate([[0], np.cumsum(q_counts)]), dtype=torch.int32)
    queries = [torch.randn(total, shape.num_qo_heads, shape.head_dim, generator=generator,
                           dtype=torch.float32).to(cache.device, shape.dtype)
               for _ in range(cache.num_layers)]
    sink_logits = [(2.0 * torch.randn(shape.num_qo_heads, generator=generator)).to(cache.device)
                   for _ in range(cache.num_layers)] if sinks else None
    return StepInputs(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last,
                      block_table=block_table, seq_lens=seq_lens,
                      seq_lens_host=[int(x) for x in table.seq_lens], queries=queries,
                      pools=cache.pools, layout=shape.layout, num_qo_heads=shape.num_qo_heads,
                      num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                      page_size=shape.page_size, qo_indptr=qo_indptr, window_left=window_left,
                      logits_soft_cap=logits_soft_cap, sinks=sink_logits,
                      scales=[cache.scales(layer) for layer in range(cache.num_layers)])


def measure_all(backends: list[Backend], step: StepInputs, *, check: bool, opts: RunOptions,
                dead: set[str]) -> list[StepTiming]:
    """Every live backend on one step: each checked and timed eagerly, then their graphs replayed
    in turn (measure.time_graphs). A backend that fails once is left out of later steps."""
    reference = reference_output(step) if check else None
    results, graphed = [], []
    for backend in backends:
        if backend.name in dead:
            continue
        timing = measure_step(backend, step, reference=reference, eager_reps=opts.eager_reps,
                              graph_reps=0, step_layers=opts.layers)
        results.append(timing)
        if timing.status == "ok" and step.queries[0].is_cuda and opts.graph_reps > 0:
            graphed.append((backend, timing))
    if graphed:
        time_graphs(graphed, step, reps=opts.graph_reps)
    dead.update(t.backend for t in results if t.status == "failed")
    return results


def _random_v_again(cache: PagedKVCache, pages: list[int]) -> None:
    """HND_VT gives pages back with V zeroed (its contract): the next request on them would read
    zeros, and its reference check pass on zeros. V takes the pages' own random K (and K's
    per-token scales); the other layouts keep their random V."""
    if cache.layout != "HND_VT" or not pages:
        return
    p = torch.tensor(pages, dtype=torch.int64, device=cache.device)
    for layer, pool in enumerate(cache.pools):
        pool[p, 1] = pool[p, 0]
        if cache.kv_scales is not None:
            cache.kv_scales[layer][p, 1] = cache.kv_scales[layer][p, 0]


def run_trace(name: str, trace: Trace, backends: list[Backend], *, shape: ModelShape,
              opts: RunOptions, device: torch.device, progress=None) -> Measured:
    """Replay `trace`; measure `opts.samples` steps spread evenly over it."""
    steps = list(replay(trace))
    num_pages = peak_tokens(trace) // shape.page_size + 2 * trace.batch_slots + 1
    busy = [i for i, s in enumerate(steps) if s.rows]
    chosen = set(np.asarray(busy)[np.linspace(0, len(busy) - 1, min(opts.samples, len(busy)))
                                  .round().astype(int)].tolist()) if busy else set()
    read = min((tokens_seen([n for _, n in steps[i].rows], opts.window_left) for i in chosen),
               default=None)           # the smallest measured step leaves the L2 too
    layers = layers_that_fit(shape, num_pages, opts, read_tokens=read)
    cache = make_cache(shape, num_pages=num_pages, layers=layers, device=device, seed=opts.seed)
    measured = Measured(name=name, batch_slots=trace.batch_slots, layers=layers,
                        step_layers=min(opts.layers, layers))
    generator = torch.Generator().manual_seed(opts.seed)
    dead: set[str] = set()
    done = 0
    for step in steps:
        for req, seq_len in step.rows:                   # grow the cache to this step's lengths
            if req not in cache.allocator:
                cache.add_sequence(req)
            cache.append_tokens(req, seq_len - cache.seq_len(req))
        if step.index in chosen:
            inputs = step_inputs(cache, [req for req, _ in step.rows], shape, generator,
                                 **opts.variants())
            check = done % opts.check_every == 0
            for timing in measure_all(backends, inputs, check=check, opts=opts, dead=dead):
                measured.steps.append({"step": step.index, **timing.as_dict(),
                                       "max_seq_len": max(inputs.seq_lens_host)})
            done += 1
            if progress is not None:
                progress()
        for req in step.finished:
            freed = list(cache.allocator.sequence(req).pages)
            cache.free_sequence(req)
            _random_v_again(cache, freed)
    release(backends, device)
    del cache
    return measured


def release(backends: list[Backend], device: torch.device) -> None:
    """Let go of the last step's pools before the next trace or batch allocates its own."""
    for backend in backends:
        backend.release()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_static(name: str, seq_lens: list[int], backends: list[Backend], *, shape: ModelShape,
               opts: RunOptions, device: torch.device) -> Measured:
    """One static batch (a grid cell or a fixed mix), measured like a trace step."""
    num_pages = sum(-(-n // shape.page_size) for n in seq_lens) + 1
    layers = layers_that_fit(shape, num_pages, opts,
                             read_tokens=tokens_seen(seq_lens, opts.window_left))
    cache = make_cache(shape, num_pages=num_pages, layers=layers, device=device, seed=opts.seed)
    for i, n in enumerate(seq_lens):
        cache.add_sequence(i)
        cache.append_tokens(i, n)
    inputs = step_inputs(cache, list(range(len(seq_lens))), shape,
                         torch.Generator().manual_seed(opts.seed),
                         query_counts(opts.q_len, seq_lens, seed=opts.seed), **opts.variants())
    measured = Measured(name=name, batch_slots=len(seq_lens), layers=layers,
                        step_layers=min(opts.layers, layers))
    for timing in measure_all(backends, inputs, check=True, opts=opts, dead=set()):
        measured.steps.append({"step": 0, **timing.as_dict(), "max_seq_len": max(seq_lens)})
    del inputs
    release(backends, device)
    del cache
    return measured
