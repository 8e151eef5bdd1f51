"""Timing one decode step of one backend: eager wall, host costs, CUDA-graph device time, accuracy.

Units: microseconds (us); bandwidth in TB/s = 1e12 bytes per second.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ..reference import TOLERANCE, reference_decode, relative_error
from .backends import Backend, StepInputs, Unsupported


@dataclass
class StepTiming:
    backend: str
    status: str                   # "ok", "failed" (wrong result or error) or "unsupported"
    rows: int
    tokens: int                   # KV tokens read per layer (sum of seq_lens)
    kv_bytes: int                 # KV bytes read per layer
    eager_us: float = float("nan")        # host wall: plan + M runs + synchronize, per step
    plan_us: float = float("nan")         # host time of plan()
    run_us: float = float("nan")          # host time of one run() (launch only)
    graph_us: float = float("nan")        # device time per layer, CUDA-graph replay of L runs
    error: float = float("nan")           # relative error vs the float64 reference (layer 0)
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def kv_bytes_per_layer(step: StepInputs) -> int:
    """Bytes of K/V (and per-token scales) a layer must read: each row's tokens its queries see
    (under a sliding window, the last window_left + queries of them)."""
    elem = step.pools[0].element_size()
    scales = 4 if step.kv_fp8 == "token" else 0              # an fp8 cache's per-token scales
    return read_tokens(step) * step.num_kv_heads * (step.head_dim * elem + scales) * 2


def read_tokens(step: StepInputs) -> int:
    """Tokens a layer's queries see, summed over the rows."""
    counts = None if step.qo_indptr is None else torch.diff(step.qo_indptr).tolist()
    return tokens_seen(step.seq_lens_host, step.window_left, counts)


def tokens_seen(seq_lens: list[int], window_left: int, counts: list[int] | None = None) -> int:
    """Tokens rows of these lengths read a layer, with query counts per row (default one): all
    of each row, or under a sliding window its last window_left + count."""
    if window_left < 0:
        return sum(seq_lens)
    counts = counts or [1] * len(seq_lens)
    return sum(min(n, window_left + c) for n, c in zip(seq_lens, counts))


def reference_output(step: StepInputs) -> torch.Tensor:
    out, _ = reference_decode(step.queries[0], step.pools[0], layout=step.layout,
                              kv_indptr=step.kv_indptr, kv_indices=step.kv_indices,
                              kv_last_page_len=step.kv_last_page_len, qo_indptr=step.qo_indptr,
                              window_left=step.window_left, logits_soft_cap=step.logits_soft_cap,
                              sinks=None if step.sinks is None else step.sinks[0],
                              **(step.scales[0] if step.scales else {}))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_step(backend: Backend, step: StepInputs, *, reference: torch.Tensor | None,
                 eager_reps: int = 3, graph_reps: int = 10,
                 step_layers: int | None = None) -> StepTiming:
    """Plan and run `backend` on `step`; check layer 0 against `reference`; time it. The note
    holds what the backend chose for the step (Backend.last_choice), or why it failed.

    An eager step is the model's: plan + M = step_layers runs (default all L layers of the step),
    each repetition over the next M layers of the L, so that the plan's host cost counts once per
    M layers however many layers the L2 rotation added, and no repetition rereads the last one's
    K/V from the L2. On the CPU only the eager host times are taken (the interpreter's timings
    mean nothing).
    """
    device = step.queries[0].device
    layers = len(step.queries)
    model_layers = min(step_layers or layers, layers)
    result = StepTiming(backend=backend.name, status="ok", rows=step.batch_size,
                        tokens=sum(step.seq_lens_host), kv_bytes=kv_bytes_per_layer(step))
    try:
        try:
            backend.plan(step)
        except backend.refusals as exc:   # its library's own refusal of the configuration
            raise Unsupported(f"{type(exc).__name__}: {exc}") from exc
        out = backend.run(0)
    except Unsupported as exc:
        result.status, result.note = "unsupported", str(exc)[:300]
        return result
    except Exception as exc:  # noqa: BLE001 - a backend that breaks is reported, not fatal
        result.status, result.note = "failed", f"{type(exc).__name__}: {exc}"[:300]
        return result
    if reference is not None:
        result.error = relative_error(out, reference)
        loose = step.kv_fp8 is not None and backend.fp8_error_bound is not None
        bound = backend.fp8_error_bound if loose else TOLERANCE[out.dtype]
        if not result.error <= bound:
            result.status = "failed"
            result.note = f"relative error {result.error:.2e} over {bound}"
            return result
    result.note = backend.last_choice()   # pkv-auto's pick: a device read, before the timing
    if reference is not None and loose:
        result.note = f"e4m3 products: relative error {result.error:.1e}"

    walls, plans, runs = [], [], []
    for rep in range(eager_reps):
        order = [(rep * model_layers + i) % layers for i in range(model_layers)]
        _sync(device)
        t0 = time.perf_counter()
        backend.plan(step)
        t1 = time.perf_counter()
        for layer in order:
            backend.run(layer)
        t2 = time.perf_counter()
        _sync(device)
        t3 = time.perf_counter()
        plans.append((t1 - t0) * 1e6)
        runs.append((t2 - t1) * 1e6 / model_layers)
        walls.append((t3 - t0) * 1e6)
    result.eager_us = statistics.median(walls)
    result.plan_us = statistics.median(plans)
    result.run_us = statistics.median(runs)
    if device.type == "cuda" and graph_reps > 0:
        time_graphs([(backend, result)], step, reps=graph_reps)
    return result


def time_graphs(timed: list[tuple[Backend, StepTiming]], step: StepInputs, *, reps: int) -> None:
    """Set each timing's graph_us: the device time of one layer, from CUDA-graph replays of the
    step's L runs (with the plan, for a backend that plans on the GPU). The backends' graphs are
    captured first, then replayed in turn, each round starting one backend later, so that a drift
    of the GPU's clocks over the cell falls on every backend alike and none is always first. A
    backend whose step cannot be captured is marked failed."""
    layers = len(step.queries)
    graphs, owners = [], []
    for backend, timing in timed:
        try:
            graphs.append(capture_graph(_step_body(backend, step, layers)))
            owners.append(timing)
        except Exception as exc:  # noqa: BLE001 - a backend that cannot be captured is reported
            torch.cuda.synchronize()
            timing.status, timing.note = "failed", f"graph capture: {type(exc).__name__}: {exc}"[:300]
    for timing, us in zip(owners, replay_medians(graphs, reps=reps)):
        timing.graph_us = us / layers


def graph_time_per_layer(backend: Backend, step: StepInputs, layers: int, *, reps: int) -> float:
    """Median device time of one layer: the L runs of the planned step captured in one CUDA graph
    (with the plan too, divided over the layers, for a backend that plans on the GPU)."""
    return graph_replay_us(_step_body(backend, step, layers), reps=reps) / layers


def _step_body(backend: Backend, step: StepInputs, layers: int):
    """What a step's graph holds: the plan (for a backend that plans on the GPU) and L runs."""
    def body():
        if backend.capture_plan:
            backend.plan(step)
        for layer in range(layers):
            backend.run(layer)
    return body


def capture_graph(body, *, dump_to: str | None = None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of body(), warmed up once on the capture stream and replayed once;
    dump_to: a path for the graph's nodes as a DOT file (CUDA's debug dump)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):          # warm-up on the capture stream
        body()
    torch.cuda.current_stream().wait_stream(stream)
    # a dump needs the captured cudaGraph_t, which torch frees at instantiation unless kept
    graph = torch.cuda.CUDAGraph(keep_graph=True) if dump_to else torch.cuda.CUDAGraph()
    if dump_to:
        graph.enable_debug_mode()
    with torch.cuda.graph(graph):
        body()
    if dump_to:
        graph.debug_dump(dump_to)
    graph.replay()
    return graph


def replay_medians(graphs: list[torch.cuda.CUDAGraph], *, reps: int, warmup: int = 2,
                   busy: bool = True) -> list[float]:
    """Median device time (us) of one replay of each graph (replay_times)."""
    return [statistics.median(t) for t in replay_times(graphs, reps=reps, warmup=warmup,
                                                       busy=busy)]


def replay_times(graphs: list[torch.cuda.CUDAGraph], *, reps: int, warmup: int = 2,
                 busy: bool = True) -> list[list[float]]:
    """Device time (us) of each of `reps` replays of each graph after `warmup` rounds, timed with
    CUDA events around each replay; the graphs take turns, round r starting at graph r mod
    len(graphs), so that a drift of the clocks falls on all alike. busy: an untimed replay of the
    same graph runs just before each timed one, so that the GPU is busy while the host submits
    the timed replay, and for a graph that runs longer than the host takes to launch it (the
    bench's steps: 250 us and more; an empty graph's replay is about 10 us) the time holds no
    launch. busy=False: the GPU is idle at each start event, and the host's launch is timed
    (the probes of a graph's floor)."""
    times = [[] for _ in graphs]
    for r in range(warmup + reps):
        for i in range(len(graphs)):
            at = (r + i) % len(graphs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if busy:
                graphs[at].replay()
            start.record()
            graphs[at].replay()
            end.record()
            end.synchronize()
            if r >= warmup:
                times[at].append(start.elapsed_time(end) * 1e3)
    return times


def graph_replay_us(body, *, reps: int, busy: bool = True) -> float:
    """Median device time (us) of one replay of a CUDA graph that captures body() (replay_times)."""
    return replay_medians([capture_graph(body)], reps=reps, busy=busy)[0]


def bandwidth_ceiling(device: torch.device, *, gib: float = 4.0, reps: int = 10) -> dict:
    """Read and copy bandwidth (TB/s) of plain device ops over `gib` GiB: the run's own ceiling."""
    if device.type != "cuda":
        return {}
    n = int(gib * (1 << 30)) // 2
    src = torch.randn(n, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    out = {}
    for name, fn, nbytes in (("read_tbps", lambda: src.sum(dtype=torch.float32), n * 2),
                             ("copy_tbps", lambda: dst.copy_(src), n * 4)):
        fn()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out[name] = nbytes / statistics.median(times) / 1e12
    del src, dst
    torch.cuda.empty_cache()
    return out


def bare_launch_us(device: torch.device, *, reps: int = 200) -> float:
    """Host time of one bare launch from Python: a torch add_ on 1K floats (median)."""
    x = torch.zeros(1024, device=device)
    for _ in range(10):
        x.add_(1.0)
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.add_(1.0)
        times.append((time.perf_counter() - t0) * 1e6)
    _sync(device)
    return statistics.median(times)
