"""`persistentkv bench`: the trace suite and the static grid, on the GPU or (tiny) on the CPU."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .backends import make_backends
from .measure import bandwidth_ceiling, bare_launch_us
from .results import check_out_dir, environment, print_table, run_ceiling, summarize, write_results
from .runner import Measured, ModelShape, RunOptions, functional_setup, run_static, run_trace
from .traces import Trace, make_trace, read_trace


@dataclass(frozen=True)
class TraceSpec:
    generator: str
    batch_slots: int
    num_requests: int

    @property
    def name(self) -> str:
        return f"b{self.batch_slots}-{self.generator}"


TRACE_SUITE = (TraceSpec("bimodal", 8, 24), TraceSpec("uniform", 8, 24), TraceSpec("zipf", 8, 24),
               TraceSpec("bimodal", 4, 12), TraceSpec("bucketed", 1, 8))
GRID_BATCHES = (1, 4, 8, 32, 128)
GRID_LENGTHS = (1024, 8192, 32768, 131072)
GRID_MAX_TOKENS = 4 << 20
# The mixed batches measured for FlashInfer in the project's anchors (context length per row).
GRID_MIXES = {
    "B4 bimodal": [293, 16619, 652, 21576],
    "B8 bimodal": [767, 17289, 459, 24197, 591, 21440, 912, 20609],
    "B4 uniform": [24012, 19271, 31981, 5884],
    "B8 uniform": [19590, 16921, 28850, 3860, 9982, 23141, 9362, 30932],
    "B4 zipf": [430, 647, 1891, 1622],
    "B8 zipf": [259, 2040, 917, 24851, 2345, 270, 264, 372],
    # mid-size serving batches: lengths drawn once (uniform 400-30K, seeds 16 and 32)
    "B16 mix": [int(n) for n in np.random.default_rng(16).integers(400, 30000, 16)],
    "B32 mix": [int(n) for n in np.random.default_rng(32).integers(400, 32000, 32)],
}
# a uniform batch off the B x L grid: what a 4K sliding window makes of B8 L128K (the window bar)
GRID_EXTRA = {"B8 L4K": [4096] * 8}
FUNCTIONAL_TRACE = TraceSpec("bucketed", 2, 3)
FUNCTIONAL_PARAMS = {"buckets": (24, 90), "out_min": 2, "out_max": 3}  # small enough to interpret


def grid_cases(names: list[str] | None = None) -> list[tuple[str, list[int]]]:
    """The grid's cells (name, row lengths), or the named ones in the grid's order, then any
    uniform batch off the grid named 'B<rows> L<K>K' (e.g. 'B16 L2K': 16 rows of 2048 tokens;
    at most GRID_MAX_TOKENS tokens, as the grid's own cells)."""
    cells = [(f"B{b} L{n // 1024}K", [n] * b) for b in GRID_BATCHES for n in GRID_LENGTHS
             if b * n <= GRID_MAX_TOKENS] + list(GRID_MIXES.items()) + list(GRID_EXTRA.items())
    if names is None:
        return cells
    known = dict(cells)
    extra = {n: _uniform_cell(n) for n in names if n not in known}
    unknown = [n for n, lens in extra.items() if lens is None]
    if unknown:
        raise ValueError(f"unknown grid cell(s) {unknown}; choose from {[n for n, _ in cells]} "
                         f"or name a uniform batch 'B<rows> L<K>K' of at most "
                         f"{GRID_MAX_TOKENS} tokens")
    return [(n, lens) for n, lens in cells if n in names] + list(extra.items())


def _uniform_cell(name: str) -> list[int] | None:
    """Row lengths of a cell named 'B<rows> L<K>K' of at most GRID_MAX_TOKENS tokens, else
    None."""
    match = re.fullmatch(r"B([1-9][0-9]{0,6}) L([1-9][0-9]{0,6})K", name)
    if match is None or int(match[1]) * int(match[2]) * 1024 > GRID_MAX_TOKENS:
        return None
    return [int(match[2]) * 1024] * int(match[1])


def run_bench(*, device: torch.device, grid: bool, cells: list[str] | None = None,
              traces: list[str] | None, trace_file: str | None, batch_slots: int,
              backends: list[str], shape: ModelShape, opts: RunOptions, out_dir: Path,
              tag: str | None) -> int:
    functional = device.type != "cuda"
    check_out_dir(out_dir)
    if cells is not None:
        if not grid:
            raise ValueError(f"cells={cells} pick grid cells: add --grid")
        grid_cases(cells)   # names checked before anything runs
    if traces:
        unknown = sorted(set(traces) - {s.name for s in TRACE_SUITE})
        if unknown:
            raise ValueError(f"unknown trace(s) {unknown}; choose from "
                             f"{[s.name for s in TRACE_SUITE]} or pass --trace-file")
    if functional:
        print(f"No GPU: a functional run through Triton's interpreter, at its own small shape "
              f"(8/2/64, page size {shape.page_size}); its timings mean nothing.")
        shape, opts = functional_setup(shape, opts)
    built, skipped = make_backends(backends, layout=shape.layout, device=device)
    for name, why in skipped.items():
        print(f"skipping {name}: {why}")
    env = environment(device, functional=functional)
    env["shape"] = shape.record()
    env["options"] = {k: getattr(opts, k) for k in opts.__dataclass_fields__}
    env.update(bandwidth_ceiling(device))
    env["bare_launch_us"] = bare_launch_us(device)

    cases: list[tuple[str, object]] = []
    if functional and (cells or traces):
        print(f"No GPU: the functional cases run, not {'--cells' if cells else '--traces'} "
              f"{','.join(cells or traces)} (their sizes are for a GPU)")
    if grid and not functional:
        cases = list(grid_cases(cells))
    elif grid:
        cases = [("B2 L100", [100, 100]), ("B3 mix", [5, 70, 33])]
    elif trace_file:
        cases = [(Path(trace_file).stem, read_trace(trace_file, batch_slots=batch_slots))]
    else:
        specs = [FUNCTIONAL_TRACE] if functional else [s for s in TRACE_SUITE
                                                       if traces is None or s.name in traces]
        for spec in specs:
            trace = make_trace(spec.generator, batch_slots=spec.batch_slots,
                               num_requests=spec.num_requests, seed=opts.seed,
                               **(FUNCTIONAL_PARAMS if functional else {}))
            cases.append((spec.name, trace))

    tag = tag or ("grid" if grid else "traces") + ("-functional" if functional else "")
    measured: list[Measured] = []
    with _progress() as progress:
        total = sum(opts.samples if isinstance(c, Trace) else 1 for _, c in cases)
        bar = progress.add_task("measuring", total=total)
        for name, case in cases:
            progress.update(bar, description=name)
            if isinstance(case, Trace):
                measured.append(run_trace(name, case, built, shape=shape, opts=opts, device=device,
                                          progress=lambda: progress.advance(bar)))
            else:
                measured.append(run_static(name, case, built, shape=shape, opts=opts,
                                           device=device))
                progress.advance(bar)
            # after every case: a cut run keeps its results
            summary, paths = _write(measured, env, out_dir, tag)
    if not measured:
        raise ValueError("nothing to measure")
    print_table(summary, title=f"PersistentKV bench ({env['device']})", functional=functional)
    ceiling = "" if functional else "ceiling %.2f TB/s; " % env["ceiling_tbps"]
    print(f"{ceiling}wrote {', '.join(str(p) for p in paths)}")
    failed = [r for r in summary if r["status"] == "failed" and r["backend"].startswith("pkv-")]
    for r in failed:
        print(f"FAILED: {r['case']} {r['backend']}: {r['note']}")
    return 1 if failed else 0




def _progress():
    """A progress bar on the terminal (rich, from the [bench] extra), or nothing without rich."""
    try:
        from rich.progress import Progress
    except ImportError:
        import contextlib

        class _Silent:
            def add_task(self, *a, **k):
                return 0

            def update(self, *a, **k):
                pass

            def advance(self, *a, **k):
                pass

        return contextlib.nullcontext(_Silent())
    return Progress(transient=False)


def _write(measured: list[Measured], env: dict, out_dir: Path, tag: str):
    ceiling = run_ceiling(measured, env.get("read_tbps"))
    env["ceiling_tbps"] = ceiling
    summary = [row for m in measured for row in summarize(m, ceiling_tbps=ceiling)]
    steps = [{"case": m.name, **s} for m in measured for s in m.steps]
    return summary, write_results(out_dir, env=env, summary=summary, steps=steps, tag=tag)
