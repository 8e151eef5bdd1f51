"""`persistentkv calibrate` and `persistentkv evaluate`: fit the policy that `pkv-auto` decides
with (policy.py) on calibration traces, then judge pkv-auto on held-out seeds against every fixed
backend and FlashInfer's best."""
from __future__ import annotations

import json
import math
import shlex
from collections import Counter
from pathlib import Path

import torch

from ..policy import Policy, bin_of, fallback_choice, fit_policy, policy_file_name
from ..schedule import Choice
from .backends import _pkv_variant, make_backends
from .measure import bandwidth_ceiling, bare_launch_us
from .results import (FI_BEST, check_out_dir, environment, print_table, run_ceiling,
                      run_command, summarize, write_results)
from .runner import Measured, ModelShape, RunOptions, functional_setup, run_trace
from .suite import FUNCTIONAL_PARAMS, FUNCTIONAL_TRACE, TRACE_SUITE, TraceSpec
from .traces import make_trace

# The choices calibrate measures (ours, fixed; each one a schedule.Choice), and the trace seeds
# the policy is fitted on and judged on (never seen in the fit).
CANDIDATES = ("pkv-grouped", "pkv-split", "pkv-balanced", "pkv-split@8", "pkv-split@16",
              "pkv-split@32", "pkv-split@64", "pkv-split@128")
CALIBRATION_SEEDS = (1, 2)
HELD_OUT_SEEDS = (100,)
AUTO = "pkv-auto"   # the policy on the device: what evaluate judges
DEFAULT_RULE = f"pkv-{fallback_choice()}"   # what a GPU or shape without a policy plans with

# Calibration and evaluation replay the same trace families, at different seeds: the benchmark's
# suite (1-8 rows) and two large batches, so that the policy has seen steps of 9+ rows.
POLICY_TRACES = TRACE_SUITE + (TraceSpec("uniform", 32, 64), TraceSpec("zipf", 128, 256))


def candidate_choice(name: str) -> Choice | None:
    """The Choice a candidate backend runs: 'pkv-grouped' -> Choice('grouped'), 'pkv-split@16'
    -> Choice('split', 16); None for any other backend (pkv-auto, a launch-configuration
    variant, FlashInfer's, the baselines, a label of an older version)."""
    variant = _pkv_variant(name)
    if variant is None or variant[0] == "auto" or variant[2]:
        return None
    return Choice(variant[0], variant[1])


def calibration_steps(measured: list[Measured]) -> list[dict]:
    """Measured (step, candidate) timings, keyed for fit_policy (bin, step_key, choice); the
    steps of backends that are not candidates are left out."""
    rows = []
    for m in measured:
        for s in m.steps:
            choice = candidate_choice(s["backend"])
            if choice is not None:
                rows.append({**s, "bin": bin_of(rows=s["rows"], max_len=s["max_seq_len"],
                                                total_tokens=s["tokens"]),
                             "step_key": f"{m.name}:{s['step']}", "choice": choice})
    return rows


def read_measurements(paths: list[Path]) -> list[dict]:
    """The results files at `paths` (`persistentkv bench`, calibrate's measurements, evaluate),
    each checked to be one, all of one GPU and shape, no file twice; their parsed JSON."""
    if len(set(map(str, paths))) < len(paths):
        raise ValueError(f"from_results names a file twice: {[str(p) for p in paths]}")
    files = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"from_results file {str(path)!r} is no results JSON: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("steps"), list) \
                or not isinstance(data.get("environment"), dict):
            raise ValueError(f"from_results file {str(path)!r} holds no 'environment' and "
                             f"'steps' (is it a results file of persistentkv bench?)")
        files.append(data)
    where = {(f["environment"].get("device"), json.dumps(f["environment"].get("shape"),
                                                         sort_keys=True)) for f in files}
    if len(where) > 1:
        raise ValueError(f"from_results files were measured on different GPUs or shapes: "
                         f"{sorted(where, key=str)}")
    return files


def measured_seeds(files: list[dict]) -> list[int]:
    """The trace seeds results files measured: calibrate's (its environment's seeds), a bench
    run's (its options' seed, where it replayed the suite's traces) and any a case names
    ('<trace>/seed<N>')."""
    traces = {spec.name for spec in (*TRACE_SUITE, FUNCTIONAL_TRACE)}
    seeds = set()
    for data in files:
        env = data["environment"]
        seeds.update(env.get("seeds") or [])
        seed = (env.get("options") or {}).get("seed")
        for step in data["steps"]:
            name = str(step.get("case", ""))
            if name in traces and isinstance(seed, int):
                seeds.add(seed)
            trace, _, tail = name.rpartition("/seed")
            if trace and tail.isdigit():
                seeds.add(int(tail))
    return sorted(seeds)


def measured_from_results(paths: list[Path], files: list[dict]) -> list[Measured]:
    """Measured steps of results files (read_measurements(paths)), to refit without a GPU."""
    out = []
    for path, data in zip(paths, files):
        cases: dict[str, Measured] = {}
        for s in data["steps"]:
            m = cases.setdefault(s["case"], Measured(name=f"{path}:{s['case']}",
                                                     batch_slots=s["rows"], layers=0))
            m.steps.append({k: v for k, v in s.items() if k != "case"})
        out.extend(cases.values())
    return out


def _traces(specs, seeds, functional: bool):
    for spec in ([FUNCTIONAL_TRACE] if functional else specs):
        for seed in seeds:
            trace = make_trace(spec.generator, batch_slots=spec.batch_slots,
                               num_requests=spec.num_requests, seed=seed,
                               **(FUNCTIONAL_PARAMS if functional else {}))
            yield f"{spec.name}/seed{seed}", trace


def run_calibrate(*, device: torch.device, seeds, candidates, shape: ModelShape, opts: RunOptions,
                  objective: str, out_path: Path, from_results: list[Path] | None) -> Policy:
    """Measure the candidates on the calibration traces (or read measurements back), fit the
    policy on `objective` (eager_us on the CPU) and save it at out_path, its measurements
    beside it."""
    functional = device.type != "cuda" and not from_results
    if out_path.is_dir():
        raise ValueError(f"--out {str(out_path)!r} is a folder; it names the policy file to write")
    check_out_dir(out_path.parent)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if from_results is not None and not from_results:
        raise ValueError("from_results names no file")
    if from_results:
        files = read_measurements(from_results)
        measured = measured_from_results(from_results, files)
        env = files[0]["environment"]
        gpu = env["device"]
        info = {"from_results": [str(p) for p in from_results]}
        seeds = measured_seeds(files)
        if seeds:   # the trace seeds measured, which evaluate then refuses as held out
            info["seeds"] = seeds
        fitted = env.get("shape")   # files without it were measured at the default shape
        fitted = shape if fitted is None else ModelShape(**{k: fitted[k] for k in (
            "num_qo_heads", "num_kv_heads", "head_dim")}, kv_fp8=fitted.get("kv_fp8"),
            page_size=fitted.get("page_size", ModelShape.page_size))
    else:
        wrong = [c for c in candidates if candidate_choice(c) is None]
        if wrong or not candidates:
            raise ValueError(f"candidates must be pkv-grouped, pkv-split, pkv-balanced or "
                             f"pkv-split@N, got {wrong or list(candidates)}")
        if functional:
            print("No GPU: a functional calibration through Triton's interpreter; the fitted "
                  "policy means nothing.")
            shape, opts = functional_setup(shape, opts)
        built, _ = make_backends(list(candidates), layout=shape.layout, device=device)
        measured = []
        for name, trace in _traces(POLICY_TRACES, seeds, functional):
            print(f"calibrating on {name}", flush=True)
            measured.append(run_trace(name, trace, built, shape=shape, opts=opts, device=device))
        info = {"traces": [s.name for s in POLICY_TRACES], "seeds": list(seeds),
                "candidates": [b.name for b in built], "functional_only": functional}
        # the measurements themselves, beside the policy: `--from-results` refits from them
        env = environment(device, functional=functional)
        env["shape"] = shape.record()   # dtype and layout too: a refit compares them
        env["seeds"] = list(seeds)
        fitted = shape
        summary = [r for m in measured for r in summarize(m, ceiling_tbps=None)]
        steps = [{"case": m.name, **s} for m in measured for s in m.steps]
        write_results(out_path.parent, env=env, summary=summary, steps=steps,
                      tag=f"{out_path.stem}-measurements")
    steps = calibration_steps(measured)
    objective = "eager_us" if functional else objective
    timed = [s for s in steps if s["status"] == "ok" and math.isfinite(s.get(objective, math.nan))]
    if steps and not timed:   # e.g. a functional run's files (no graph times) fitted on graph_us
        raise ValueError(f"from_results holds no {objective} timing of a candidate (a CPU "
                         f"run has eager times only: --objective eager_us)")
    if not steps:   # measurements read back, of other backends only
        raise ValueError(f"from_results={[str(p) for p in from_results]} holds no step of a "
                         f"candidate (pkv-grouped, pkv-split, pkv-balanced, pkv-split@N)")
    policy = fit_policy(steps, gpu=gpu, objective=objective,
                        shape=(fitted.num_qo_heads, fitted.num_kv_heads, fitted.head_dim),
                        page_size=fitted.page_size,
                        info={**info, "command": shlex.join(run_command())})
    out_path.parent.mkdir(parents=True, exist_ok=True)
    policy.save(out_path)
    for key, choice in sorted(policy.table.items()):
        print(f"  {key}: {choice}")
    kind = ("shape and fp8 caches (plan(kv_data_type=torch.float8_e4m3fn))" if fitted.kv_fp8
            else "shape")
    print(f"wrote {out_path} (plan() loads it for this GPU and {kind} when shipped as "
          f"src/persistentkv/policies/"
          f"{policy_file_name(gpu, policy.shape, kv_fp8=fitted.kv_fp8 is not None)})")
    return policy


def evaluation_table(summary: list[dict], measured: list[Measured]) -> list[dict]:
    """Per trace, like the paper's table: pkv-auto's tokens/s in eager and graph mode, its ratio
    to FlashInfer's best, to the best other backend measured (FlashInfer's entries included) and
    to the default rule (pkv-split, what a GPU or shape without a policy plans with; NaN when it
    was not measured), and how often it picked each choice (the step notes)."""
    rows = []
    for m in measured:
        mine = {r["backend"]: r for r in summary if r["case"] == m.name and r["status"] == "ok"}
        auto, fi, rule = mine.get(AUTO), mine.get(FI_BEST), mine.get(DEFAULT_RULE)
        fixed = [r for name, r in mine.items() if not name.startswith(AUTO) and name != FI_BEST]
        if auto is None or not fixed:
            continue
        row = {"trace": m.name, "picks": dict(Counter(
            s["note"] for s in m.steps if s["backend"] == AUTO and s["status"] == "ok"))}
        for mode in ("eager", "graph"):
            key = f"tokens_per_s_{mode}"
            best = max(fixed, key=lambda r: r[key] if r[key] == r[key] else -1)
            row[f"auto_{mode}"] = auto[key]
            row[f"best_fixed_{mode}"] = f"{best['backend']} {best[key]:.0f}"
            row[f"vs_best_fixed_{mode}"] = auto[key] / best[key] if best[key] else math.nan
            row[f"vs_fi_best_{mode}"] = auto[key] / fi[key] if fi else math.nan
            row[f"vs_rule_{mode}"] = auto[key] / rule[key] if rule else math.nan
        rows.append(row)
    return rows


def run_evaluate(*, device: torch.device, policy: Policy, seeds, backends, shape: ModelShape,
                 opts: RunOptions, out_dir: Path, tag: str) -> list[dict]:
    """Measure `backends` and pkv-auto deciding with `policy` on the held-out seeds; write the
    results with the evaluation table (evaluation_table) in their environment."""
    functional = device.type != "cuda"
    fit_seeds = sorted(set(seeds) & set(policy.fit.get("seeds", [])))
    if fit_seeds:
        raise ValueError(f"seeds {fit_seeds} were the policy's calibration seeds "
                         f"({policy.fit['seeds']}); evaluate judges it on held-out ones")
    if functional:
        shape, opts = functional_setup(shape, opts)
    if not policy.applies_to(num_qo_heads=shape.num_qo_heads, num_kv_heads=shape.num_kv_heads,
                             head_dim=shape.head_dim):
        raise ValueError(f"the policy was fitted at (Hq, Hkv, head_dim) = {tuple(policy.shape)} "
                         f"and plans nothing at the evaluated "
                         f"{(shape.num_qo_heads, shape.num_kv_heads, shape.head_dim)}")
    check_out_dir(out_dir)
    if functional:
        print("No GPU: a functional evaluation through Triton's interpreter; its timings mean nothing.")
    names = list(backends) + ([AUTO] if AUTO not in backends else [])
    built, skipped = make_backends(names, layout=shape.layout, device=device, policy=policy)
    for name, why in skipped.items():
        print(f"skipping {name}: {why}")
    env = environment(device, functional=functional)
    env.update(bandwidth_ceiling(device), bare_launch_us=bare_launch_us(device),
               policy={"gpu": policy.gpu, "shape": policy.shape, "fit": policy.fit},
               seeds=list(seeds), shape=shape.record())
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
        print(f"{row['trace']:<22} pkv-auto x FI best: eager {row['vs_fi_best_eager']:.2f} graph "
              f"{row['vs_fi_best_graph']:.2f}; x best fixed: eager {row['vs_best_fixed_eager']:.2f} "
              f"graph {row['vs_best_fixed_graph']:.2f}; x default rule: eager "
              f"{row['vs_rule_eager']:.3f} graph {row['vs_rule_graph']:.3f}; picks {row['picks']}")
    return table
