"""Where plan()'s and run()'s host time goes in eager mode, one query a row against several.

The grids' eager columns put plan() at 20-70 us a step with one query a row and 218-790 us
with four (llama3-8b on an H100, v48), and run() at 10-15 against 14-41 us a layer (median 21).
This times both as the bench does (the device idle before each plan) and profiles the plans
with cProfile, the functions by their own time.
Run: PYTHONPATH=src python scripts/probe_plan_host.py [--reps 200] [--top 25] [CELL ...]
"""
import argparse
import cProfile
import io
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
    args = parser.parse_args()
    unknown = [c for c in args.cells if c not in probe_cells.CELLS]
    if unknown:
        parser.error(f"unknown cells {unknown}; choose from {list(probe_cells.CELLS)}")
    for cell in args.cells:
        for q_len, fresh in ((1, False), (1, True), (4, False)):
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


if __name__ == "__main__":
    main()
