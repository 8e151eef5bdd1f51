"""What a variant costs against the plain step, and soft-cap's accuracy at large logits.

Cost: on the same cache and queries, the plain step and each variant (soft-cap 50, sinks) are
captured as CUDA graphs (plan + one run per layer, each layer its own pool) and replayed in turn,
each round starting one graph later, so a drift of the clocks falls on all alike; us per layer,
median of the replays, the whole A/B twice to show the noise (--reverse captures plain last:
in the first cell of a process the first graph captured, plain's, ran 2.1x slow, v18; v19: so
did sinks' when captured first). --first-twice captures the first variant twice, the first copy
reported as "<name>, first capture", to tell a slow first capture from a slow first variant;
--last-again captures the first variant once more after the others ("<name>, last capture");
--compile-first runs every variant once before any graph is captured (its kernels compiled and
loaded first); --throwaway-first captures and replays two plain graphs of another cell (B1 L1K,
its own pools) before the first measured one, to tell the process's first captures from the
first cell's; --throwaway-torch captures two graphs of a plain torch copy (128 MB, no kernel of
ours) first, each timed, to tell whether any first graph of a process is slow and whether one
of torch's takes the slowness away from ours;
--dump-graphs DIR writes each graph of the first cell as a DOT file (its nodes and their launch
parameters) to compare them (v25: the slow first graphs and the fast last one are the same
nodes, kernels and launch shapes); --one-wrapper plans every graph of a cell through one
DecodeWrapper, so that all graphs read and write one workspace, to tell whether the slowness
follows the first wrappers' buffers. Issue 17's bar: each variant <= 1.03x the plain step on
B8 L8K and B1 L32K.
Accuracy: soft-cap 50 (Gemma-2's) with q scaled so that the scores' spread is sigma, relative
error against the float64 reference; fp16's bound is 2e-3.
Run: PYTHONPATH=src python scripts/probe_variant_cost.py [--reverse] [--first-twice]
     [--last-again] [--compile-first] [--throwaway-first] [--throwaway-torch]
     [--one-wrapper] [--dump-graphs DIR] [--json out.json]
"""
import argparse
import json
import os
import re
import sys

import torch

from persistentkv import DecodeWrapper, reference_decode, relative_error
from persistentkv.bench.measure import capture_graph, replay_medians
from persistentkv.bench.results import environment
import probe_cells   # this script's folder is on sys.path when it runs

CELLS = {"B8 L8K": [8192] * 8, "B1 L32K": [32768]}
SHAPES = {"32/8/128": (32, 8, 128), "64/8/64": (64, 8, 64)}
VARIANTS = {"plain": {}, "soft-cap 50": dict(logits_soft_cap=50.0), "sinks": dict(sinks=True)}


def build(lens, hq, hkv, d):
    """probe_cells' cell (scattered pages, as many layers as 40 GB hold, at most 32), with its
    page table as plan()'s CSR keywords."""
    cache, (indptr, indices, last), qs = probe_cells.cell(lens, hq, hkv, d)
    return cache, dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last), qs


FIRST = ", first capture"   # the label of a variant's extra, first capture (--first-twice)
LAST = ", last capture"     # and of its extra, last one (--last-again)


def variant_costs(cache, table, qs, hq, hkv, d, *, order: list[str],
                  dump_dir: str | None = None, compile_first: bool = False,
                  one_wrapper: bool = False) -> dict:
    """order: labels, each a VARIANTS name, or one with FIRST or LAST after it (the same
    variant). compile_first: every variant's plan() and run() once before any capture;
    one_wrapper: every graph plans and runs through one DecodeWrapper (one workspace), not one
    each."""
    graphs, errors, plans = [], {}, {}
    # what each graph reads and writes (its wrapper's workspace, its outputs): a CUDA graph holds
    # none of it, and until v26 each graph's wrapper and outputs were freed after its capture,
    # so that the graphs captured before the last replayed over memory reused by later ones
    alive, refs = [], {}
    sinks = 2.0 * torch.randn(hq, device="cuda")

    def keywords(variant: dict) -> tuple[dict, dict]:
        """plan()'s and run()'s keywords for a VARIANTS entry."""
        plan_kw = dict(table, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=16,
                       logits_soft_cap=variant.get("logits_soft_cap", 0.0))
        return plan_kw, (dict(sinks=sinks) if variant.get("sinks") else {})

    if compile_first:
        for variant in VARIANTS.values():
            plan_kw, run_kw = keywords(variant)
            w = DecodeWrapper("HND")
            w.plan(**plan_kw)
            w.run(qs[0], cache.pools[0], **run_kw)
        torch.cuda.synchronize()
    shared = DecodeWrapper("HND") if one_wrapper else None
    for n, name in enumerate(order):
        plan_kw, run_kw = keywords(VARIANTS[name.removesuffix(FIRST).removesuffix(LAST)])
        w = shared or DecodeWrapper("HND")
        outs = [torch.full_like(q, float("nan")) for q in qs]
        w.plan(**plan_kw)
        w.run(qs[0], cache.pools[0], out=outs[0], **run_kw)
        ref, _ = reference_decode(qs[0], cache.pools[0], layout="HND", **table,
                                  logits_soft_cap=plan_kw["logits_soft_cap"], **run_kw)
        errors[name] = relative_error(outs[0], ref)
        refs[name] = ref
        plans[name] = {k: str(v) for k, v in w.current_plan.info().items()}

        def body(w=w, plan_kw=plan_kw, run_kw=run_kw, outs=outs):
            w.plan(**plan_kw)
            for i, q in enumerate(qs):
                w.run(q, cache.pools[i], out=outs[i], **run_kw)
        slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")     # 'plain, last capture'
        dump = dump_dir and os.path.join(dump_dir, f"graph{n}-{slug}.dot")
        graphs.append(capture_graph(body, dump_to=dump))
        alive.append((w, outs, body))
    runs = [[us / len(qs) for us in replay_medians(graphs, reps=30)] for _ in range(2)]
    replayed = {}   # layer 0's output after one more replay of each graph
    for name, graph, (_, outs, _) in zip(order, graphs, alive):
        outs[0].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed[name] = relative_error(outs[0], refs[name])
    row = {}
    plain = order.index("plain")
    for i, name in enumerate(order):
        us = [run[i] for run in runs]
        row[name] = dict(us=us, x_plain=[u / run[plain] for u, run in zip(us, runs)],
                         error=errors[name], replay_error=replayed[name], plan=plans[name])
    return row


def torch_throwaway(*, reps: int = 10) -> dict:
    """Two graphs of one 128 MB device copy, captured and replayed in turn: us per replay and
    TB/s (read and write) of the first and of the second."""
    src = torch.randn(64 << 20, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    graphs = [capture_graph(lambda: dst.copy_(src)) for _ in range(2)]
    us = replay_medians(graphs, reps=reps)
    row = {name: {"us": t, "tbps": 2 * src.numel() * src.element_size() / t / 1e6}
           for name, t in zip(("copy, first capture", "copy, second capture"), us)}
    del src, dst, graphs
    torch.cuda.empty_cache()
    return row


def softcap_accuracy(cache, table, qs, hq, hkv, d) -> dict:
    """Relative error of soft-cap 50 with scores of spread sigma (q scaled by sigma)."""
    out = {}
    for sigma in (1.0, 4.0, 16.0, 40.0):
        q = (qs[0].float() * sigma).half()
        w = DecodeWrapper("HND")
        w.plan(**table, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=16,
               logits_soft_cap=50.0)
        got = w.run(q, cache.pools[0], out=torch.full_like(q, float("nan")))
        ref, _ = reference_decode(q, cache.pools[0], layout="HND", **table, logits_soft_cap=50.0)
        out[f"sigma {sigma:g}"] = relative_error(got, ref)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--reverse", action="store_true",
                        help="capture the variants in the reverse order (plain last)")
    parser.add_argument("--first-twice", action="store_true",
                        help="capture the first variant twice, before the others")
    parser.add_argument("--last-again", action="store_true",
                        help="capture the first variant once more, after the others")
    parser.add_argument("--compile-first", action="store_true",
                        help="run every variant once before the first capture")
    parser.add_argument("--throwaway-first", action="store_true",
                        help="capture two plain graphs of another cell before the first one")
    parser.add_argument("--throwaway-torch", action="store_true",
                        help="capture two graphs of a torch copy (no kernel of ours) first")
    parser.add_argument("--one-wrapper", action="store_true",
                        help="one DecodeWrapper (one workspace) for every graph of a cell")
    parser.add_argument("--dump-graphs", metavar="DIR",
                        help="write the first cell's graphs here as DOT files")
    args = parser.parse_args()
    order = list(VARIANTS)[::-1] if args.reverse else list(VARIANTS)
    if args.first_twice:
        order = [order[0] + FIRST] + order
    if args.last_again:
        order = order + [order[0].removesuffix(FIRST) + LAST]
    dump_dir = args.dump_graphs
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
    results = {"environment": environment(torch.device("cuda"), command=sys.argv,
                                          functional=False)}
    if args.throwaway_torch:   # a torch op's graphs, before any of ours
        results["throwaway torch copy"] = row = torch_throwaway()
        print("throwaway torch copy", json.dumps(row), flush=True)
    if args.throwaway_first:   # B1 L1K's two plain graphs, timed and dropped before the cells
        cache, table, qs = build([1024], 32, 8, 128)
        row = variant_costs(cache, table, qs, 32, 8, 128, order=["plain" + FIRST, "plain"])
        results["throwaway 32/8/128 B1 L1K"] = row
        print("throwaway 32/8/128 B1 L1K", json.dumps(row), flush=True)
        del cache, qs
        torch.cuda.empty_cache()
    for shape, (hq, hkv, d) in SHAPES.items():
        for cell, lens in CELLS.items():
            cache, table, qs = build(lens, hq, hkv, d)
            row = variant_costs(cache, table, qs, hq, hkv, d, order=order, dump_dir=dump_dir,
                                compile_first=args.compile_first, one_wrapper=args.one_wrapper)
            dump_dir = None                                   # the first cell's graphs only
            if shape == "32/8/128" and cell == "B8 L8K":
                row["soft-cap 50 error by score spread"] = softcap_accuracy(cache, table, qs,
                                                                          hq, hkv, d)
            results[f"{shape} {cell}"] = row
            print(shape, cell, json.dumps(row), flush=True)
            del cache, qs
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
