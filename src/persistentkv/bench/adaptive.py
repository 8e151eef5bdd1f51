"""`persistentkv calibrate` and `persistentkv evaluate`: fit the adaptive policy on calibration
traces, then judge it on held-out seeds against every fixed backend and FlashInfer's best."""
from __future__ import annotations

import json
import math
import sys
from collections import Counter
from pathlib import Path

import torch

from ..policy import Policy, bin_of, fit_policy
from .backends import Adaptive, _split_variant, make_backends
from .measure import bandwidth_ceiling, bare_launch_us
from .results import FI_BEST, environment, print_table, run_ceiling, summarize, write_results
from .runner import Measured, ModelShape, RunOptions, functional_setup, run_trace
from .suite import FUNCTIONAL_PARAMS, TRACE_SUITE, TraceSpec
from .traces import make_trace

ADAPTIVE_NAMES = ("adaptive", "adaptive-eager")   # the policy with its graph and eager tables

# Calibration and evaluation replay the same trace families, at different seeds: the benchmark's
# suite (1-8 rows) and two large batches, so that the policy has seen steps of 9+ rows.
POLICY_TRACES = TRACE_SUITE + (TraceSpec("uniform", 32, 64), TraceSpec("zipf", 128, 256))
FUNCTIONAL = TraceSpec("bucketed", 2, 3)


def calibration_steps(measured: list[Measured]) -> list[dict]:
    """Measured (step, backend) timings, keyed for fit_policy (bin, step, choice)."""
    rows = []
    for m in measured:
        for s in m.steps:
            variant = _split_variant(s["backend"])
            backend, pages = (f"pkv-{variant[0]}", variant[1]) if variant else (s["backend"], None)
            rows.append({**s, "bin": bin_of(rows=s["rows"], max_len=s["max_seq_len"],
                                            total_tokens=s["tokens"]),
                         "step_key": f"{m.name}:{s['step']}", "choice": s["backend"],
                         "backend": backend, "split_pages": pages})
    return rows


def measured_from_results(paths: list[Path]) -> list[Measured]:
    """Measured steps read back from `persistentkv bench` JSON files (to refit without a GPU)."""
    out = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        cases: dict[str, Measured] = {}
        for s in data["steps"]:
            m = cases.setdefault(s["case"], Measured(name=f"{Path(path).stem}:{s['case']}",
                                                     batch_slots=s["rows"], layers=0))
            m.steps.append({k: v for k, v in s.items() if k != "case"})
        out.extend(cases.values())
    return out


def _traces(specs, seeds, functional: bool):
    for spec in ([FUNCTIONAL] if functional else specs):
        for seed in seeds:
            trace = make_trace(spec.generator, batch_slots=spec.batch_slots,
                               num_requests=spec.num_requests, seed=seed,
                               **(FUNCTIONAL_PARAMS if functional else {}))
            yield f"{spec.name}/seed{seed}", trace


def run_calibrate(*, device: torch.device, seeds, candidates, shape: ModelShape, opts: RunOptions,
                  objective: str, out_path: Path, from_results: list[Path] | None) -> Policy:
    functional = device.type != "cuda" and not from_results
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if from_results:
        measured = measured_from_results(from_results)
        gpu = json.loads(Path(from_results[0]).read_text())["environment"]["device"]
        info = {"from_results": [str(p) for p in from_results]}
    else:
        if functional:
            print("No GPU: a functional calibration through Triton's interpreter; the fitted "
                  "policy means nothing.")
            shape, opts = functional_setup(shape, opts)
        built, skipped = make_backends(list(candidates), layout=shape.layout, device=device)
        for name, why in skipped.items():
            print(f"skipping {name}: {why}")
        measured = []
        for name, trace in _traces(POLICY_TRACES, seeds, functional):
            print(f"calibrating on {name}", flush=True)
            measured.append(run_trace(name, trace, built, shape=shape, opts=opts, device=device))
        info = {"traces": [s.name for s in POLICY_TRACES], "seeds": list(seeds),
                "candidates": [b.name for b in built], "functional_only": functional}
        # the measurements themselves, beside the policy: `--from-results` refits from them
        env = environment(device, command=["persistentkv", *sys.argv[1:]], functional=functional)
        summary = [r for m in measured for r in summarize(m, ceiling_tbps=None)]
        steps = [{"case": m.name, **s} for m in measured for s in m.steps]
        write_results(out_path.parent, env=env, summary=summary, steps=steps,
                      tag=f"{out_path.stem}-measurements")
    policy = fit_policy(calibration_steps(measured), gpu=gpu,
                        objective="eager_us" if functional else objective,
                        info={**info, "command": " ".join(["persistentkv", *sys.argv[1:]])})
    out_path.parent.mkdir(parents=True, exist_ok=True)
    policy.save(out_path)
    for key, choice in sorted(policy.table.items()):
        print(f"  {key}: {choice.label()}  (PersistentKV: {policy.pkv_table.get(key).label()})")
    print(f"wrote {out_path}")
    return policy


def evaluation_table(summary: list[dict], measured: list[Measured]) -> list[dict]:
    """Per trace, like the paper's table: FlashInfer's best, the best fixed backend, the adaptive
    policy, their ratios in eager and graph mode, and how often the policy picked each backend.
    In eager mode the policy is `adaptive-eager` (its eager table) when it was measured."""
    rows = []
    for m in measured:
        mine = {r["backend"]: r for r in summary if r["case"] == m.name and r["status"] == "ok"}
        fi = mine.get(FI_BEST)
        fixed = [r for name, r in mine.items() if name not in (*ADAPTIVE_NAMES, FI_BEST)]
        if "adaptive" not in mine or not fixed:
            continue
        row = {"trace": m.name}
        for mode in ("eager", "graph"):
            name = "adaptive-eager" if mode == "eager" and "adaptive-eager" in mine else "adaptive"
            adaptive = mine[name]
            row[f"picks_{mode}"] = dict(Counter(s["note"] for s in m.steps if s["backend"] == name))
            key = f"tokens_per_s_{mode}"
            best = max(fixed, key=lambda r: r[key] if r[key] == r[key] else -1)
            row[f"adaptive_{mode}"] = adaptive[key]
            row[f"best_fixed_{mode}"] = f"{best['backend']} {best[key]:.0f}"
            row[f"vs_best_fixed_{mode}"] = adaptive[key] / best[key] if best[key] else math.nan
            row[f"vs_fi_best_{mode}"] = adaptive[key] / fi[key] if fi else math.nan
        rows.append(row)
    return rows


def run_evaluate(*, device: torch.device, policy: Policy, seeds, backends, shape: ModelShape,
                 opts: RunOptions, out_dir: Path, tag: str) -> list[dict]:
    functional = device.type != "cuda"
    if functional:
        print("No GPU: a functional evaluation through Triton's interpreter; its timings mean nothing.")
        shape, opts = functional_setup(shape, opts)
    built, skipped = make_backends(list(backends), layout=shape.layout, device=device)
    for name, why in skipped.items():
        print(f"skipping {name}: {why}")
    sms = torch.cuda.get_device_properties(device).multi_processor_count if not functional else 4
    # what the policy may pick beyond the fixed backends (split-size variants): built for it alone
    picks = {c.label() for table in (policy.table, policy.pkv_table, policy.eager_table)
             for c in table.values()}
    extra, _ = make_backends(sorted(picks - {b.name for b in built}), layout=shape.layout,
                             device=device)
    built += [Adaptive(policy, built + extra, sm_count=sms, mode=mode) for mode in ("graph", "eager")]
    env = environment(device, command=["persistentkv", *sys.argv[1:]], functional=functional)
    env.update(bandwidth_ceiling(device), bare_launch_us=bare_launch_us(device),
               policy={"gpu": policy.gpu, "fit": policy.fit}, seeds=list(seeds))
    measured = []
    for name, trace in _traces(POLICY_TRACES, seeds, functional):
        print(f"evaluating on {name}", flush=True)
        measured.append(run_trace(name, trace, built, shape=shape, opts=opts, device=device))
    env["ceiling_tbps"] = run_ceiling(measured, env.get("read_tbps"))
    summary = [r for m in measured for r in summarize(m, ceiling_tbps=env["ceiling_tbps"])]
    table = evaluation_table(summary, measured)
    steps = [{"case": m.name, **s} for m in measured for s in m.steps]
    write_results(out_dir, env={**env, "evaluation": table}, summary=summary, steps=steps, tag=tag)
    print_table(summary, title=f"PersistentKV evaluate ({env['device']})", functional=functional)
    for row in table:
        print(f"{row['trace']:<22} adaptive x FI best: eager {row['vs_fi_best_eager']:.2f} graph "
              f"{row['vs_fi_best_graph']:.2f}; x best fixed: eager {row['vs_best_fixed_eager']:.2f} "
              f"graph {row['vs_best_fixed_graph']:.2f}; picks graph {row['picks_graph']}, "
              f"eager {row['picks_eager']}")
    return table
