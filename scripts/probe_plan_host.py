"""Where plan()'s and run()'s host time goes in eager mode, one query a row against several.

The grids' eager columns put plan() at 20-70 us a step with one query a row and 218-790 us
with four (llama3-8b on an H100, v48), and run() at 10-15 against 14-41 us a layer (median 21).
This times both as the bench does (the device idle before each plan) and profiles the plans
with cProfile, the functions by their own time.
Run: PYTHONPATH=src python scripts/probe_plan_host.py [--reps 200] [--top 25] [CELL ...]
--host-only (no GPU; TRITON_INTERPRET=1): plan()'s host Python alone, the kernels' launches
stubbed out, tables on the CPU: a whole plan of new tensors against a plan of the last call's
tensors (the replan path), at one and four queries a row.
"""
import argparse
import cProfile
import io
import itertools
import pstats
import statistics
import time

import torch

from persistentkv import DecodeWrapper

import probe_cells   # this script's folder is on sys.path when it runs

HEADS = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)


def _step(cell: str, q_len: int):
    """(plan kwargs, q, pool) of a grid cell at q_len queries a row, qo_indptr on the host."""
    cache, (indptr, indices, last), _ = probe_cells.cell(probe_cells.CELLS[cell], budget=2e9)
    rows = indptr.numel() - 1
    kwargs = dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last, **HEADS)
    if q_len > 1:
        kwargs["qo_indptr"] = torch.arange(0, (rows + 1) * q_len, q_len, dtype=torch.int32)
    q = torch.randn(rows * q_len, HEADS["num_qo_heads"], HEADS["head_dim"], dtype=torch.float16,
                    device="cuda")
    return kwargs, q, cache.pools[0]


def _fresh(kwargs):
    """The same step in new tensors: plan() cannot reuse its last plan (replan) for them."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def _times(wrapper, kwargs, q, cache, reps: int, fresh: bool, layers: int = 8):
    out = torch.empty_like(q)
    plans, runs = [], []
    for _ in range(reps):
        if fresh:
            kwargs = _fresh(kwargs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        wrapper.plan(**kwargs)
        t1 = time.perf_counter()
        for _ in range(layers):
            wrapper.run(q, cache, out=out)
        t2 = time.perf_counter()
        plans.append((t1 - t0) * 1e6)
        runs.append((t2 - t1) * 1e6 / layers)
    return statistics.median(plans), statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cells", nargs="*", default=["B1 L1K", "B8 L1K"],
                        help=f"of {', '.join(probe_cells.CELLS)}")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--host-only", action="store_true",
                        help="no GPU: plan()'s host Python, launches stubbed (see the docstring)")
    args = parser.parse_args()
    if args.host_only:
        host_only(args.cells, args.reps)
        return
    unknown = [c for c in args.cells if c not in probe_cells.CELLS]
    if unknown:
        parser.error(f"unknown cells {unknown}; choose from {list(probe_cells.CELLS)}")
    for cell in args.cells:
        for q_len, fresh in ((1, False), (1, True), (4, False), (4, True)):
            kwargs, q, cache = _step(cell, q_len)
            wrapper = DecodeWrapper("HND")
            _times(wrapper, kwargs, q, cache, 20, fresh)                   # compile, warm up
            plan_us, run_us = _times(wrapper, kwargs, q, cache, args.reps, fresh)
            label = f"{cell} q_len {q_len}{' (new tensors each step)' if fresh else ''}"
            print(f"{label}: plan {plan_us:.1f} us, run {run_us:.1f} us a layer")
            profile = cProfile.Profile()
            for _ in range(args.reps):
                if fresh:
                    kwargs = _fresh(kwargs)
                torch.cuda.synchronize()
                profile.enable()
                wrapper.plan(**kwargs)
                profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
            print(text.getvalue())


def host_only(cells: list[str], reps: int) -> None:
    """plan()'s host time on the CPU with every kernel launch stubbed out: whole plans of new
    tensors against plans of the same tensors, at one and four queries a row (median of reps)."""
    from persistentkv import launch
    launch.BoundLaunch.with_pointers = lambda self, leading, pointers: None
    for cell in cells:
        lens = probe_cells.CELLS[cell]
        pages = [-(-n // HEADS["page_size"]) for n in lens]
        indptr = torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32)
        kwargs = dict(kv_indptr=indptr, kv_indices=torch.randperm(sum(pages), dtype=torch.int32),
                      kv_last_page_len=torch.tensor([n - (p - 1) * HEADS["page_size"]
                                                     for n, p in zip(lens, pages)],
                                                    dtype=torch.int32), **HEADS)
        for q_len in (1, 4):
            if q_len > 1:
                kwargs["qo_indptr"] = torch.arange(0, (len(lens) + 1) * q_len, q_len,
                                                   dtype=torch.int32)
            wrapper = DecodeWrapper("HND")
            times = {}
            for fresh in (True, False):
                samples = []
                for _ in range(reps + 20):
                    step = _fresh(kwargs) if fresh else kwargs
                    t0 = time.perf_counter()
                    wrapper.plan(**step)
                    samples.append((time.perf_counter() - t0) * 1e6)
                times[fresh] = statistics.median(samples[20:])
            print(f"{cell} q_len {q_len}: plan of new tensors {times[True]:.1f} us, of the same "
                  f"tensors {times[False]:.1f} us (host only, launches stubbed)")


if __name__ == "__main__":
    main()
