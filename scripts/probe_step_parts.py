"""Where a small step's time goes: the planner, the decode launches and what a graph costs.

For each named grid cell of a preset (fp16), on probe_cells' cache (each layer its own pool, as
the benchmark lays it out) and one default-rule plan (the shape's default tile), CUDA graphs of:
the plan and the L runs (what the benchmark times), the L runs alone (planned before the
capture), the plan alone, and one empty kernel launch (a graph's floor). All are replayed in
turn, twice; us per replay and per layer, with the plan's tasks and split. The issue-14
question: on the small steps FlashInfer's XQA takes (v21: 23 of the matrix's 57 losses, all
under 30 us), is it the planner, the kernel or the launches that we would have to cut?
With --policy, also the plan and the plan + runs of a second wrapper that plans the same step
with that policy on the device (backend "auto"): what the policy's path costs beside the rule's
(v35: a table whose every bin is the rule's ran 0.1-0.2 us a layer slower on small steps).
Run: PYTHONPATH=src python scripts/probe_step_parts.py --preset llama3-70b-tp8
                                --cells "B128 L1K,B32 L1K" [--policy fit.json] [--json out.json]
"""
import argparse
import json
import sys

import torch

from persistentkv import DecodeWrapper, reference_decode, relative_error
from persistentkv.bench.measure import capture_graph, replay_medians
from persistentkv.bench.results import environment
from persistentkv.bench.runner import ModelShape
from persistentkv.bench.suite import grid_cases
from persistentkv.policy import Policy, load_policy
import probe_cells   # this script's folder is on sys.path when it runs


def step_parts(lens, shape: ModelShape, *, reps: int, policy: Policy | None = None) -> dict:
    cache, (indptr, indices, last), qs = probe_cells.cell(lens, shape.num_qo_heads,
                                                          shape.num_kv_heads, shape.head_dim,
                                                          shape.page_size)
    plan_kw = dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last,
                   num_qo_heads=shape.num_qo_heads, num_kv_heads=shape.num_kv_heads,
                   head_dim=shape.head_dim, page_size=shape.page_size, backend="split")
    wrapper = DecodeWrapper("HND")
    outs = [torch.full_like(q, float("nan")) for q in qs]
    wrapper.plan(**plan_kw)
    wrapper.run(qs[0], cache.pools[0], out=outs[0])
    ref, _ = reference_decode(qs[0], cache.pools[0], layout="HND", kv_indptr=indptr,
                              kv_indices=indices, kv_last_page_len=last)
    error = relative_error(outs[0], ref)
    info = wrapper.current_plan.info()

    def runs():
        for i, q in enumerate(qs):
            wrapper.run(q, cache.pools[i], out=outs[i])

    def plan_and_runs():
        wrapper.plan(**plan_kw)
        runs()

    flag = torch.zeros(1, device="cuda")
    bodies = {"plan + runs": plan_and_runs, "runs": runs,
              "plan": lambda: wrapper.plan(**plan_kw), "one empty launch": lambda: flag.add_(0)}
    if policy is not None:
        auto, auto_kw = DecodeWrapper("HND", policy=policy), {**plan_kw, "backend": "auto"}
        auto_outs = [torch.full_like(q, float("nan")) for q in qs]
        auto.plan(**auto_kw)
        auto.run(qs[0], cache.pools[0], out=auto_outs[0])
        error = max(error, relative_error(auto_outs[0], ref))
        auto_choice = str(auto.current_plan.info()["choice"])

        def auto_plan_and_runs():
            auto.plan(**auto_kw)
            for i, q in enumerate(qs):
                auto.run(q, cache.pools[i], out=auto_outs[i])

        bodies.update({"plan + runs, policy": auto_plan_and_runs,
                       "plan, policy": lambda: auto.plan(**auto_kw)})
    graphs = [capture_graph(body) for body in bodies.values()]
    rounds = [replay_medians(graphs, reps=reps, busy=False) for _ in range(2)]
    layers = len(qs)
    row = {name: {"us": [r[i] for r in rounds],
                  "us_per_layer": [r[i] / layers for r in rounds] if "runs" in name else None}
           for i, name in enumerate(bodies)}
    row.update(layers=layers, error=error, tasks=int(info["num_tasks"]),
               split_tokens=int(info["split_tokens"]), choice=str(info["choice"]))
    if policy is not None:
        row["policy_choice"] = auto_choice
    del cache, qs, outs, graphs
    torch.cuda.empty_cache()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", required=True, help="a model shape preset (bench --preset)")
    parser.add_argument("--cells", required=True, help="grid cells, comma-separated")
    parser.add_argument("--reps", type=int, default=20, help="replays per graph and round")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--policy", help="a fitted policy JSON: also time plans that decide with "
                                         "it on the device")
    args = parser.parse_args()
    shape = ModelShape.of(args.preset)
    policy = None if args.policy is None else load_policy("", args.policy)
    cells = grid_cases([c.strip() for c in args.cells.split(",")])   # names checked first
    results = {"environment": environment(torch.device("cuda"), command=sys.argv,
                                          functional=False)}
    for name, lens in cells:
        row = step_parts(lens, shape, reps=args.reps, policy=policy)
        results[f"{args.preset} {name}"] = row
        print(args.preset, name, json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
