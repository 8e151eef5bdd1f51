"""Where a multi-token step's extra time goes: q_len 4 against q_len 1 on the same cells, with
parts of the q_len 4 kernel taken out one at a time (timing only: those outputs are wrong).

At group 4 a row's 4 queries fill the 16 rows the one-query tile pads to, so the products and
the bytes read are the same; what differs is the causal mask, the queries' loads (qo_indptr
before q), and partials and merges of 16 rows instead of 4. Each ablation is decode.py with one
textual change, imported from a scratch copy and launched through a fresh DecodeWrapper:
- nocausal: no causal mask in the token loop;
- nomerge: split tasks store their partials and never merge (no arrivals either);
- nochain: q_start = row * Q_PAD and n_q = Q_PAD (uniform q_len only), no qo_indptr loads.
Graph replay (plan + one run per layer, each layer its own pool), us per layer, two rounds.
Further ablations (--ablations, --q1-ablations): relaxedarrive, the arrivals' atomic without
release and acquire (no fence; a race, timing only); unroll8, 8 partials' loads in flight in the
merge (4 today); twolevel, merges in two levels from 5 splits on (17 today); fp32part, partial
outputs stored in fp32, as before v26 (today: the output's dtype). v26 measured the partials in
fp16 with an ablation of the kernel before (the cast in _store_partial and merge_partials).
Run: PYTHONPATH=src python scripts/probe_query_cost.py [--q-len 4] [--ablations a,b]
     [--q1-ablations a,b] [--json out.json] [CELL ...]
"""
import argparse
import importlib.util
import json
import pathlib
import sys
import tempfile

import torch

import persistentkv.kernels.decode as decode
from persistentkv import DecodeWrapper, reference_decode, relative_error
from persistentkv.bench.measure import capture_graph, replay_medians
from persistentkv.bench.results import environment
import probe_cells   # this script's folder is on sys.path when it runs

CELLS = ("B1 L1K", "B1 L8K", "B4 L1K", "B8 L1K", "B4 zipf", "B8 L32K")
# name -> substitutions, each (file, old, new); every old text must occur exactly once
ABLATIONS = {
    "nocausal": [("decode", "if CAUSAL:", "if False:")],
    "nomerge": [("decode", "ready = num_splits > 0", "ready = num_splits < 0")],
    "nochain": [("decode", "q_start = tl.load(qo_indptr_ptr + row)", "q_start = row * Q_PAD"),
                ("decode", "n_q = tl.minimum(tl.maximum(tl.load(qo_indptr_ptr + row + 1) - q_start, 0), Q_PAD)",
                 "n_q = row * 0 + Q_PAD")],
    # the arrivals without their release and acquire (no fence before the counter's atomic)
    "relaxedarrive": [("decode", 'done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")',
                       'done = tl.atomic_add(counter_ptr, 1, sem="relaxed", scope="gpu")')],
    # the merge's loads: 8 partials in flight (twice the bytes' cap)
    "unroll8": [("merge", "MERGE_UNROLL = tl.constexpr(4)", "MERGE_UNROLL = tl.constexpr(8)"),
                ("merge", "MERGE_IN_FLIGHT_BYTES = tl.constexpr(32768)",
                 "MERGE_IN_FLIGHT_BYTES = tl.constexpr(65536)")],
    # two levels from 5 splits on, not 17
    "twolevel": [("decode", "ONE_LEVEL_SPLITS = tl.constexpr(16)", "ONE_LEVEL_SPLITS = tl.constexpr(4)")],
    # partial outputs stored and merged in fp32, as before v26 (today: the output's dtype)
    "fp32part": [("decode", "    part_o_ptr = part_o_ptr.to(tl.pointer_type(out_ptr.dtype.element_ty))\n", "")],
}
IMPORTS = {"decode": [("from ..runtime import", "from persistentkv.runtime import"),
                      ("from .merge import", "from {merge} import"),
                      ("from .softmax import", "from persistentkv.kernels.softmax import")],
           "merge": []}


def _load(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def ablated_kernel(name: str, scratch: pathlib.Path):
    """decode.py and merge.py with the ablation's substitutions, as modules; the kernel."""
    texts = {"decode": pathlib.Path(decode.__file__).read_text(),
             "merge": pathlib.Path(decode.__file__).with_name("merge.py").read_text()}
    merge_module = f"pkv_probe_{name}_merge"
    for file, old, new in ([(f, o, n.format(merge=merge_module)) for f in IMPORTS
                            for o, n in IMPORTS[f]] + ABLATIONS[name]):
        if texts[file].count(old) != 1:
            raise RuntimeError(f"{name}: {old!r} found {texts[file].count(old)} times in {file}.py")
        texts[file] = texts[file].replace(old, new)
    (scratch / f"{merge_module}.py").write_text(texts["merge"])
    _load(scratch / f"{merge_module}.py")
    (scratch / f"pkv_probe_{name}.py").write_text(texts["decode"])
    return _load(scratch / f"pkv_probe_{name}.py").paged_decode_kernel


def graph_of(qo, cache, table, qs):
    """A fresh wrapper's auto plan + runs (q [total_q, 32, 128] a layer, qo_indptr qo or None
    for one query a row) as one CUDA graph; returns (graph, layer 0's output, the plan's choice,
    what the graph reads and writes: the caller keeps it alive while the graph replays)."""
    w = DecodeWrapper("HND")
    kw = dict(**table, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
              backend="auto", qo_indptr=qo)
    outs = [torch.full_like(q, float("nan")) for q in qs]

    def body():
        w.plan(**kw)
        for i, q in enumerate(qs):
            w.run(q, cache.pools[i], out=outs[i])
    body()
    torch.cuda.synchronize()
    info = w.current_plan.info()
    choice = f"{info['choice']} {info['num_tasks']}x{info['split_tokens']}"
    return capture_graph(body), outs[0].clone(), choice, (w, outs, qs, qo)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("cells", nargs="*", default=list(CELLS))
    parser.add_argument("--q-len", type=int, default=4)
    parser.add_argument("--ablations", default="nocausal,nomerge,nochain",
                        help=f"comma-separated, of {list(ABLATIONS)}")
    parser.add_argument("--q1-ablations", default="",
                        help="ablations also run at q_len 1")
    parser.add_argument("--json")
    args = parser.parse_args()
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="pkv-probe-"))
    kernels = {"q_len 1": (1, decode.paged_decode_kernel)}
    kernels.update({f"q_len 1 {n}": (1, ablated_kernel(n, scratch))
                    for n in filter(None, args.q1_ablations.split(","))})
    kernels[f"q_len {args.q_len}"] = (args.q_len, decode.paged_decode_kernel)
    kernels.update({f"q_len {args.q_len} {n}": (args.q_len, ablated_kernel(n, scratch))
                    for n in filter(None, args.ablations.split(","))})
    result = {"environment": environment(torch.device("cuda"), command=sys.argv,
                                         functional=False),
              "q_len": args.q_len, "cells": {}}
    base = decode.paged_decode_kernel
    # the first cell twice, its first pass thrown away (Triton's compiles and the allocator's
    # first blocks out of the timed graphs)
    for n, cell in enumerate([args.cells[0], *args.cells]):
        lens = probe_cells.CELLS[cell]
        cache, (indptr, indices, last), _ = probe_cells.cell(lens)
        table = dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last)
        graphs, rows, alive = [], {}, []
        for label, (q_len, kernel) in kernels.items():
            qs = [torch.randn(len(lens) * q_len, 32, 128, dtype=torch.float16, device="cuda")
                  for _ in cache.pools]
            qo = None if q_len == 1 else torch.arange(0, len(lens) * q_len + 1, q_len,
                                                     dtype=torch.int32)
            ref, _ = reference_decode(qs[0], cache.pools[0], layout="HND", **table, qo_indptr=qo)
            decode.paged_decode_kernel = kernel
            try:
                graph, out, choice, state = graph_of(qo, cache, table, qs)
            finally:
                decode.paged_decode_kernel = base
            graphs.append(graph)
            alive.append(state)
            rows[label] = dict(error=relative_error(out, ref), choice=choice)
        layers = len(cache.pools)
        for r in range(2):
            for label, us in zip(rows, replay_medians(graphs, reps=15)):
                rows[label].setdefault("us", []).append(us / layers)
        if n == 0:
            del graphs, alive, cache
            continue
        result["cells"][cell] = rows
        print(cell, flush=True)
        for label, row in rows.items():
            print(f"  {label:22s} {row['us'][0]:8.2f} {row['us'][1]:8.2f} us  {row['choice']:16s}"
                  f" err {row['error']:.1e}", flush=True)
        del graphs, alive, cache
        torch.cuda.empty_cache()
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
