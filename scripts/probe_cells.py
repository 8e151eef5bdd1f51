"""Quick A/B of our schedules on a few static cells: graph replay (plan + 32 layers, each layer
its own pool), us per layer, median of replays; each cell twice to show the noise.
Run: PYTHONPATH=src python scripts/probe_cells.py [--json out.json]
"""
import json
import os
import sys

import numpy as np
import torch

from persistentkv import DecodeWrapper, PagedKVCache, reference_decode, relative_error
from persistentkv.bench.measure import graph_replay_us
from persistentkv.tuning import KernelConfig


CELLS = {"B1 L1K": [1024], "B1 L8K": [8192], "B1 L32K": [32768], "B1 L128K": [131072],
         "B4 L1K": [1024] * 4, "B8 L1K": [1024] * 8, "B8 L32K": [32768] * 8,
         "B32 L8K": [8192] * 32, "B128 L8K": [8192] * 128,
         "B4 zipf": [430, 647, 1891, 1622], "B8 zipf": [259, 2040, 917, 24851, 2345, 270, 264, 372],
         "B8 uniform": [19590, 16921, 28850, 3860, 9982, 23141, 9362, 30932],
         "B8 bimodal": [767, 17289, 459, 24197, 591, 21440, 912, 20609],
         "B16 mix": [int(x) for x in np.random.default_rng(16).integers(400, 30000, 16)],
         "B32 mix": [int(x) for x in np.random.default_rng(32).integers(400, 32000, 32)],
         "B64 skew": [int(x) for x in np.minimum(131072, 32 * np.random.default_rng(64).zipf(1.3, 64))]}
# PKV_AB=1: split only; PKV_PPS=n: split with n programs per SM; PKV_NOPLAN=1: the graph holds
# the runs alone; PKV_TAG: a suffix for the row labels
BACKENDS = ([dict(backend="split")] if os.environ.get("PKV_AB") else
            [dict(backend="split"), dict(backend="auto"), dict(backend="grouped")])
if os.environ.get("PKV_PPS"):
    BACKENDS = [dict(backend="split", config=KernelConfig(programs_per_sm=int(os.environ["PKV_PPS"])))]


def cell(lens, hq=32, hkv=8, d=128, page=16, budget=40e9):
    pages = sum(-(-n // page) for n in lens) + 1
    layers = max(1, min(32, int(budget // (pages * page * hkv * d * 4))))
    cache = PagedKVCache(num_layers=layers, num_pages=pages, page_size=page, num_kv_heads=hkv,
                         head_dim=d, dtype=torch.float16, layout="HND", device="cuda",
                         shuffle_seed=0, init="randn")
    for i, n in enumerate(lens):
        cache.add_sequence(i)
        cache.append_tokens(i, n)
    table = cache.page_table(list(range(len(lens))))
    indptr, indices, last = table.csr("cuda")
    qs = [torch.randn(len(lens), hq, d, dtype=torch.float16, device="cuda") for _ in range(layers)]
    return cache, (indptr, indices, last), qs


def main():
    out = {}
    for name, lens in CELLS.items():
        if len(sys.argv) > 1 and sys.argv[1] != "--json" and name not in sys.argv[1:]:
            continue
        cache, (indptr, indices, last), qs = cell(lens)
        ref, _ = reference_decode(qs[0], cache.pools[0], layout="HND", kv_indptr=indptr,
                                  kv_indices=indices, kv_last_page_len=last)
        row = {}
        for opts in BACKENDS:
            w = DecodeWrapper("HND")
            kw = dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last, num_qo_heads=32,
                      num_kv_heads=8, head_dim=128, page_size=16, **opts)
            outs = [torch.full_like(q, float("nan")) for q in qs]
            w.plan(**kw)
            w.run(qs[0], cache.pools[0], out=outs[0])
            err = relative_error(outs[0], ref)
            info = w.current_plan.info()

            def body():
                if not os.environ.get("PKV_NOPLAN"):
                    w.plan(**kw)
                for i, q in enumerate(qs):
                    w.run(q, cache.pools[i], out=outs[i])

            t = [graph_replay_us(body, reps=15) / len(qs) for _ in range(2)]
            row[opts["backend"] + os.environ.get("PKV_TAG", "")] = dict(us=t, err=err, tasks=info["num_tasks"],
                                        split=info["split_tokens"], choice=str(info["choice"]))
        out[name] = row
        print(name, {k: (round(v["us"][0], 1), round(v["us"][1], 1), v["tasks"], v["split"],
                         v["choice"], f"{v['err']:.1e}") for k, v in row.items()}, flush=True)
        del cache, qs
        torch.cuda.empty_cache()
    if "--json" in sys.argv:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
