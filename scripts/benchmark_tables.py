"""Markdown tables for BENCHMARKS.md from a grid and an evaluation results file.

Grid: per cell the floor (KV bytes / the run's ceiling), the bar 1.1 x floor + 3 us, FlashInfer's
best entry, an earlier version's best PersistentKV backend (optional), our backends, the best
against FlashInfer's best (and the bar it needs: 1.3x where FlashInfer is under 70% of the
ceiling), pkv-auto's eager tokens/s against FlashInfer's best eager, and whether both bars hold.
Evaluation: per trace pkv-auto (the policy on the device) against FlashInfer's best and the best
fixed backend.
Shapes: per grid cell and model preset, pkv-auto against FlashInfer's best (--shapes, the grids
that `persistentkv bench --grid --preset NAME` wrote), with the geometric mean.
Queries: per grid cell and query count (--queries, the grids that `persistentkv bench --grid
--q-len N` wrote), pkv-auto against FlashInfer's fastest path for the same work and against
pkv-auto at one query, the issue's bars counted; --json writes the same as a summary file.
Variants: per grid cell and run (--variants, the grids that `persistentkv bench --grid
--window-left N --soft-cap C --sinks` wrote, with a plain run of each shape), pkv-auto against
FlashInfer's best with the same features and against the plain step; the issue's bars counted.
fp8: per grid cell (--fp8 FP16_GRID FP8_GRID..., grids of `persistentkv bench --grid --kv-fp8
tensor|token`), each of our fp8 backends against pkv-auto on the fp16 cache and against
FlashInfer's best fp8 entry (from each grid, or --fp8-fi FI_GRID...: FlashInfer's fp8 entries
run apart, in HND, where ours ran HND_VT); the issue's bars counted on the cells of >= 128 MB of
fp16 KV.
End to end: per run of `persistentkv e2e` (--e2e FILES), each implementation's decode tokens/s
against the run's reference and its agreement with it, and issue 19's bars (>= 1.3x at 32 and 128
requests of about 4K-token prompts; 95% of the first 32 greedy tokens); a control implementation
(paged|eager) is reported beside ours. PDL: per step of `persistentkv layer-chain` (--pdl FILES),
us per layer of each setting and its ratio to PDL off.
Runs: per grid cell and backend (--runs FILES, grids of the same command run more than once),
each run's us per layer in graph replay side by side, and with --vs BACKEND the best of each
backend over that one's (the repeated A/B tables of BENCHMARKS.md and docs/perf-notes.md).
A/B: per grid cell (--ab-a FILES --ab-b FILES, runs of two trees alternated in one machine run),
each tree's fastest run of a backend (--ab-backend, default pkv-auto), B's time over A's, and each
tree's spread over its own runs (the noise the ratio is read against); the geometric mean.
Run: python scripts/benchmark_tables.py results/h200/grid.json results/h200/evaluate.json
         [--previous results/h200/v3/grid.json]
     python scripts/benchmark_tables.py --shapes results/h200/shapes/*.json
     python scripts/benchmark_tables.py --queries results/h200/multi-token/qlen-*.json
         [--json results/h200/multi-token.json]
     python scripts/benchmark_tables.py --variants results/h200/variants/*.json
         [--json results/h200/variants.json]
     python scripts/benchmark_tables.py --ab-a results/h200/experiments/v10/decode-{1,3}-main.json
         --ab-b results/h200/experiments/v10/decode-{2,4}-qb.json
     python scripts/benchmark_tables.py --fp8 results/h200/variants/plain.json
         results/h200/fp8/fp8-{tensor,token}.json [--json results/h200/fp8.json]
     python scripts/benchmark_tables.py --e2e results/h200/e2e/e2e-*.json
         [--json results/h200/e2e.json]
     python scripts/benchmark_tables.py --pdl results/h200/experiments/v16/pdl{,-b1,-b64}.json
         [--json results/h200/pdl.json]
     python scripts/benchmark_tables.py --runs results/h100/v32/padrows/llama3-8b-q8-{1,2}.json
         [--vs fi-prefill]
"""
import argparse
import json
import math

OURS = ("pkv-grouped", "pkv-split", "pkv-balanced", "pkv-auto")


def _rows(path):
    data = json.load(open(path))
    by = {(r["case"], r["backend"]): r for r in data["summary"]}
    cases = list(dict.fromkeys(r["case"] for r in data["summary"]))
    return data, by, cases


def _kv_bytes(steps, case):
    return next(s["kv_bytes"] for s in steps if s["case"] == case)


def grid_table(path, previous=None) -> str:
    data, by, cases = _rows(path)
    ceiling = data["environment"]["ceiling_tbps"]
    prev = _rows(previous)[1] if previous else {}
    out = ["| step | floor us | bar: 1.1 x floor + 3 | FI best (entry) | previous best PKV | "
           + " | ".join(b.removeprefix("pkv-") for b in OURS)
           + " | best PKV / FI best | eager: auto / FI best | bars met |",
           "|---|---|---|---|---|" + "---|" * len(OURS) + "---|---|---|"]
    met = at_parity = 0
    for case in cases:
        floor = _kv_bytes(data["steps"], case) / (ceiling * 1e6)
        bar = 1.1 * floor + 3
        fi = by[(case, "fi-best")]
        entries = {b: by[(case, b)]["graph_us_per_layer"] for b in
                   ("fi-cuda-core", "fi-tensor-core", "fi-xqa")
                   if (case, b) in by and by[(case, b)]["status"] == "ok"}
        entry = min(entries, key=entries.get)
        ours = {b: by[(case, b)]["graph_us_per_layer"] for b in OURS if (case, b) in by
                and by[(case, b)]["status"] == "ok"}
        best = min(ours.values())
        speedup = fi["graph_us_per_layer"] / best
        need = 1.3 if fi["fraction_of_ceiling"] < 0.70 else 1.0
        ok = best <= bar and speedup >= need - 0.005
        met += ok
        at_parity += speedup >= 0.995
        # any of our backends of the earlier version, whatever they were called then
        prev_best = min((r["graph_us_per_layer"] for (c, b), r in prev.items()
                         if c == case and b.startswith("pkv-") and r["status"] == "ok"),
                        default=float("nan"))
        eager = by.get((case, "pkv-auto"), {}).get("speedup_eager_vs_fi_best", float("nan"))
        cells = " | ".join(f"{ours[b]:.1f}" if b in ours else "-" for b in OURS)
        out.append(f"| {case} | {floor:.1f} | {bar:.1f} | {fi['graph_us_per_layer']:.1f} ({entry}) | "
                   f"{prev_best:.1f} | {cells} | {speedup:.2f}x (need {need:.1f}x) | {eager:.2f}x | "
                   f"{'yes' if ok else 'no'} |")
    out.append("")
    out.append(f"{at_parity} of {len(cases)} cells at 1.00x FI best or better (within 0.5%); both "
               f"bars on {met} of {len(cases)}; ceiling {ceiling:.2f} TB/s.")
    return "\n".join(out)


def evaluation_table(path) -> str:
    data = json.load(open(path))
    out = ["| trace | pkv-auto tokens/s eager | x FI best, eager | x best fixed, eager (best fixed) | "
           "pkv-auto tokens/s graph | x FI best, graph | x best fixed, graph (best fixed) | "
           "x default rule, eager / graph | picks |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in data["environment"]["evaluation"]:
        picks = ", ".join(f"{k} {v}" for k, v in r["picks"].items())
        # files written before the default rule's column have no vs_rule_*
        rule = (f"{r['vs_rule_eager']:.3f} / {r['vs_rule_graph']:.3f}" if "vs_rule_graph" in r
                else "-")
        out.append(f"| {r['trace']} | {r['auto_eager']:.0f} | {r['vs_fi_best_eager']:.2f} | "
                   f"{r['vs_best_fixed_eager']:.3f} ({r['best_fixed_eager']}) | "
                   f"{r['auto_graph']:.0f} | {r['vs_fi_best_graph']:.2f} | "
                   f"{r['vs_best_fixed_graph']:.3f} ({r['best_fixed_graph']}) | {rule} | {picks} |")
    return "\n".join(out)


def shapes_table(paths) -> str:
    """Case x preset: pkv-auto / FI best in graph replay (us per layer beside it)."""
    grids = [(path.rsplit("/", 1)[-1].removesuffix(".json"), *_rows(path)[1:]) for path in paths]
    cases = list(dict.fromkeys(c for _, _, cs in grids for c in cs))
    out = ["| case | " + " | ".join(f"{name} (auto / FI us)" for name, _, _ in grids) + " |",
           "|---|" + "---|" * len(grids)]
    logs, below, pairs, missing = [], 0, [], []
    for case in cases:
        cells = []
        for name, by, _ in grids:
            ours, fi = by.get((case, "pkv-auto")), by.get((case, "fi-best"))
            if not ours or not fi or not ours.get("graph_us_per_layer") or not fi.get("graph_us_per_layer"):
                cells.append("-")
                if ours and ours.get("status") != "ok":   # ours failed: no pair, said below
                    missing.append(f"{name} {case} ({ours.get('status')})")
                continue
            ratio = fi["graph_us_per_layer"] / ours["graph_us_per_layer"]
            logs.append(math.log(ratio))
            pairs.append((ratio, fi["fraction_of_ceiling"]))
            below += ratio < 0.995
            cells.append(f"{ratio:.2f}x ({ours['graph_us_per_layer']:.1f} / {fi['graph_us_per_layer']:.1f})")
        out.append(f"| {case} | " + " | ".join(cells) + " |")
    out.append(f"\nGeometric mean {math.exp(sum(logs) / len(logs)):.3f}x over {len(logs)} (case, "
               f"preset) pairs; {below} under 0.995x.")
    if missing:
        out.append(f"Not in the mean, pkv-auto not ok: {', '.join(missing)}.")
    out.append(ceiling_headroom(pairs))
    return "\n".join(out)


# FlashInfer's best at this fraction of the ceiling or more: the pair is bandwidth-bound
BANDWIDTH_BOUND = 0.85


def ceiling_headroom(pairs, *, bar: float = 1.10) -> str:
    """What the ceiling leaves of a geometric-mean bar. pairs: (ours / FI best speedup, FI best's
    fraction of the ceiling) per (case, preset). A bandwidth-bound pair can gain at most
    1 / fraction (our step at the ceiling exactly); the sentence gives the geometric means of
    both kinds of pair, the most the bandwidth-bound ones allow, and what the others then need
    for `bar` over the whole matrix."""
    bound = [(r, f) for r, f in pairs if f >= BANDWIDTH_BOUND]
    other = [r for r, f in pairs if f < BANDWIDTH_BOUND]

    def gmean(xs):
        return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")
    at_ceiling = gmean([1 / f for _, f in bound])
    text = (f"{len(bound)} pairs bandwidth-bound (FlashInfer at >= {BANDWIDTH_BOUND:.0%} of the "
            f"ceiling): {gmean([r for r, _ in bound]):.3f}x, at most {at_ceiling:.3f}x were our "
            f"step at the ceiling; the other {len(other)}: {gmean(other):.3f}x")
    if bound and other:
        n = len(bound) + len(other)
        need = math.exp((n * math.log(bar) - len(bound) * math.log(at_ceiling)) / len(other))
        text += f", and they would need {need:.3f}x for {bar:.2f}x over the matrix"
    return text + "."


# issue bars for several queries per row: q_len 4 within 1.10x of one query, q_len 8 within 1.5x
QUERY_COST_BARS = {"4": 1.10, "8": 1.5}


def queries_summary(paths) -> dict:
    """Per cell and q_len (the runs' options.q_len; a repeated q_len keeps its first run): pkv-auto
    and FlashInfer's best (fi-best: the faster of fi-prefill and fi-xqa) in us per layer, their
    ratio, pkv-auto against its one-query time, FlashInfer's fraction of the ceiling, and the
    bars over the cells of at most 32 rows."""
    runs = {}
    for path in paths:
        data, by, cases = _rows(path)
        runs.setdefault(data["environment"]["options"]["q_len"], (path, data, by, cases))
    if "1" not in runs:
        raise SystemExit("--queries needs the q_len 1 grid (the one-query times)")
    cells = []
    for case in runs["1"][3]:
        one = runs["1"][2][(case, "pkv-auto")]["graph_us_per_layer"]
        per_q = {}
        for q, (_, _, by, _) in runs.items():
            ours, fi = by.get((case, "pkv-auto")), by.get((case, "fi-best"))
            if not ours or not fi or ours["status"] != "ok" or fi["status"] != "ok":
                continue
            per_q[q] = {"pkv_us": ours["graph_us_per_layer"], "fi_best_us": fi["graph_us_per_layer"],
                        "fi_best": fi["note"], "vs_fi": fi["graph_us_per_layer"] / ours["graph_us_per_layer"],
                        "vs_one_query": ours["graph_us_per_layer"] / one,
                        "fi_fraction_of_ceiling": fi["fraction_of_ceiling"]}
        cells.append({"case": case, "batch": runs["1"][2][(case, "pkv-auto")]["batch"], "q_len": per_q})
    small = [c for c in cells if c["batch"] <= 32]
    bars = {}
    for q, bar in QUERY_COST_BARS.items():
        have = [c for c in small if q in c["q_len"]]
        bars[f"q_len {q} <= {bar}x one query"] = f"{sum(c['q_len'][q]['vs_one_query'] <= bar for c in have)} of {len(have)}"
    pairs = [(c, q) for c in small for q in c["q_len"] if q != "1"]
    bars[">= 1.0x FI (q_len > 1)"] = f"{sum(c['q_len'][q]['vs_fi'] >= 0.995 for c, q in pairs)} of {len(pairs)}"
    slow = [(c, q) for c, q in pairs if c["q_len"][q]["fi_fraction_of_ceiling"] < 0.7]
    bars[">= 1.3x FI where FI < 70% of ceiling"] = f"{sum(c['q_len'][q]['vs_fi'] >= 1.3 for c, q in slow)} of {len(slow)}"
    return {"runs": {q: {"file": path, "environment": data["environment"]} for q, (path, data, _, _) in runs.items()},
            "bars (cells of <= 32 rows)": bars, "cells": cells}


def queries_table(summary) -> str:
    """Case x q_len: pkv-auto / FI best (x), and pkv-auto against its one-query time."""
    qs = list(summary["runs"])
    out = ["| case | " + " | ".join(f"q_len {q}: ours / FI us (x FI; x one query)" for q in qs) + " |",
           "|---|" + "---|" * len(qs)]
    for cell in summary["cells"]:
        items = []
        for q in qs:
            r = cell["q_len"].get(q)
            items.append("-" if r is None else f"{r['pkv_us']:.1f} / {r['fi_best_us']:.1f} "
                         f"({r['vs_fi']:.2f}x; {r['vs_one_query']:.2f})")
        out.append(f"| {cell['case']} | " + " | ".join(items) + " |")
    out.append("")
    out += [f"- {name}: {count}" for name, count in summary["bars (cells of <= 32 rows)"].items()]
    return "\n".join(out)


# issue bars for the variants: a 4096-token window makes B8 L128K cost <= 1.15x a plain B8 L4K
# step; soft-cap and sinks each cost <= 1.03x the plain step on these cells
WINDOW_BAR = ("B8 L128K", "B8 L4K", 1.15)
FEATURE_BAR_CELLS, FEATURE_BAR = ("B8 L8K", "B1 L32K"), 1.03


def _variant_name(options) -> str:
    parts = []
    if options.get("window_left", -1) >= 0:
        parts.append(f"window {options['window_left'] + 1}")
    if options.get("logits_soft_cap", 0.0) > 0:
        parts.append(f"soft-cap {options['logits_soft_cap']:g}")
    if options.get("sinks"):
        parts.append("sinks")
    return " + ".join(parts) or "plain"


def variants_summary(paths) -> dict:
    """Per run (shape and variant, from each file's environment) and cell: pkv-auto and FlashInfer's
    best with the same features in us per layer, their ratio, and pkv-auto against the plain run of
    the same shape; the bars."""
    runs = []
    for path in paths:
        data, by, cases = _rows(path)
        env = data["environment"]
        shape = env["shape"]
        runs.append({"file": path, "shape": f"{shape['num_qo_heads']}/{shape['num_kv_heads']}/"
                     f"{shape['head_dim']}", "variant": _variant_name(env["options"]),
                     "environment": env, "by": by, "cases": cases})
    plain = {r["shape"]: r for r in runs if r["variant"] == "plain"}
    bars, summary_runs = {}, []
    for r in runs:
        base = plain.get(r["shape"])
        cells = []
        for case in r["cases"]:
            ours, fi = r["by"].get((case, "pkv-auto")), r["by"].get((case, "fi-best"))
            if not ours or ours["status"] != "ok":
                continue
            cell = {"case": case, "pkv_us": ours["graph_us_per_layer"]}
            if fi and fi["status"] == "ok":
                cell.update(fi_best_us=fi["graph_us_per_layer"], fi_best=fi["note"],
                            vs_fi=fi["graph_us_per_layer"] / ours["graph_us_per_layer"])
            plain_row = base["by"].get((case, "pkv-auto")) if base else None
            if plain_row and plain_row["status"] == "ok":
                cell["vs_plain"] = ours["graph_us_per_layer"] / plain_row["graph_us_per_layer"]
            cells.append(cell)
        with_fi = [c for c in cells if "vs_fi" in c]
        name = f"{r['shape']} {r['variant']}"
        bars[f"{name}: >= 1.0x FI"] = f"{sum(c['vs_fi'] >= 0.995 for c in with_fi)} of {len(with_fi)}"
        by_case = {c["case"]: c for c in cells}
        if r["variant"] == "window 4096" and base and WINDOW_BAR[0] in by_case:
            long_, short, bar = WINDOW_BAR
            ref = base["by"][(short, "pkv-auto")]["graph_us_per_layer"]
            ratio = by_case[long_]["pkv_us"] / ref
            bars[f"{name}: {long_} / plain {short} <= {bar}x"] = f"{ratio:.3f}x"
        if r["variant"] in ("soft-cap 50", "sinks") and base:
            for case in FEATURE_BAR_CELLS:
                if case in by_case and "vs_plain" in by_case[case]:
                    bars[f"{name}: {case} / plain <= {FEATURE_BAR}x"] = f"{by_case[case]['vs_plain']:.3f}x"
        summary_runs.append({"file": r["file"], "shape": r["shape"], "variant": r["variant"],
                             "environment": r["environment"], "cells": cells})
    return {"bars": bars, "runs": summary_runs}


def variants_table(summary) -> str:
    """Case x run: pkv-auto / FI best (x FI; x the plain step)."""
    runs = summary["runs"]
    cases = list(dict.fromkeys(c["case"] for r in runs for c in r["cells"]))
    out = ["| case | " + " | ".join(f"{r['shape']} {r['variant']}: ours / FI us (x FI; x plain)"
                                     for r in runs) + " |", "|---|" + "---|" * len(runs)]
    for case in cases:
        items = []
        for r in runs:
            c = next((c for c in r["cells"] if c["case"] == case), None)
            if c is None:
                items.append("-")
                continue
            fi = f" / {c['fi_best_us']:.1f} ({c['vs_fi']:.2f}x" if "vs_fi" in c else " (-"
            plain = f"; {c['vs_plain']:.2f})" if "vs_plain" in c and r["variant"] != "plain" else ")"
            items.append(f"{c['pkv_us']:.1f}{fi}{plain}")
        out.append(f"| {case} | " + " | ".join(items) + " |")
    out.append("")
    out += [f"- {name}: {value}" for name, value in summary["bars"].items()]
    return "\n".join(out)


# issue bars for an fp8 cache: on cells of >= 128 MB of fp16 KV, fp8 per tensor >= 1.8x our fp16
# step, per token >= 1.7x; and >= 1.0x FlashInfer's fp8 decode on every cell
FP8_BAR_BYTES = 128e6
FP8_SPEEDUP_BARS = {"tensor": 1.8, "token": 1.7}


def _kv_fp8(env) -> str:
    """The run's scale granularity: its shape's kv_fp8 (the command's --kv-fp8 in earlier files)."""
    if env["shape"].get("kv_fp8"):
        return env["shape"]["kv_fp8"]
    words = env["command"].split()
    if "--kv-fp8" not in words:
        raise SystemExit(f"not an fp8 run: {env['command']}")
    return words[words.index("--kv-fp8") + 1]


def fp8_summary(fp16_path, fp8_paths, fi_paths=()) -> dict:
    """Per fp8 run (granularity from its environment) and cell: each of our backends' us per layer,
    its speedup over pkv-auto on the fp16 cache, and FlashInfer's best fp8 entry (from the run's
    own file, or from fi_paths: FlashInfer's fp8 grids run apart, in HND, where ours ran HND_VT;
    matched by granularity); the bars."""
    fi_runs = {}
    for path in fi_paths:
        data, by, _ = _rows(path)
        fi_runs[_kv_fp8(data["environment"])] = (path, by)
    _, fp16, _ = _rows(fp16_path)
    fp16_data = json.load(open(fp16_path))
    fp16_bytes = {s["case"]: s["kv_bytes"] for s in fp16_data["steps"]}
    runs, bars = [], {}
    for path in fp8_paths:
        data, by, cases = _rows(path)
        granularity = _kv_fp8(data["environment"])
        fi_file, fi_by = fi_runs.get(granularity, (None, by))
        ours = list(dict.fromkeys(b for (_, b) in by if b.startswith("pkv-")))
        cells = []
        for case in cases:
            half = fp16.get((case, "pkv-auto"))
            fi = fi_by.get((case, "fi-best"))
            cell = {"case": case, "fp16_kv_mb": fp16_bytes.get(case, float("nan")) / 1e6,
                    "fp16_pkv_us": half["graph_us_per_layer"] if half else None}
            if fi and fi["status"] == "ok":
                cell.update(fi_best_us=fi["graph_us_per_layer"], fi_best=fi["note"])
            for b in ours:
                r = by.get((case, b))
                if not r or r["status"] != "ok":
                    continue
                cell[b] = {"us": r["graph_us_per_layer"], "tbps": r["tbps"]}
                if half:
                    cell[b]["vs_fp16"] = half["graph_us_per_layer"] / r["graph_us_per_layer"]
                if "fi_best_us" in cell:
                    cell[b]["vs_fi"] = cell["fi_best_us"] / r["graph_us_per_layer"]
            cells.append(cell)
        for b in ours:
            big = [c for c in cells if b in c and "vs_fp16" in c[b] and c["fp16_kv_mb"] * 1e6 >= FP8_BAR_BYTES]
            bar = FP8_SPEEDUP_BARS[granularity]
            bars[f"{granularity} {b}: >= {bar}x fp16 on >= 128 MB cells"] = (
                f"{sum(c[b]['vs_fp16'] >= bar for c in big)} of {len(big)}")
            with_fi = [c for c in cells if b in c and "vs_fi" in c[b]]
            if with_fi:
                bars[f"{granularity} {b}: >= 1.0x FI fp8"] = (
                    f"{sum(c[b]['vs_fi'] >= 0.995 for c in with_fi)} of {len(with_fi)}")
        runs.append({"file": path, "fi_file": fi_file, "granularity": granularity, "backends": ours,
                     "environment": data["environment"], "cells": cells})
    return {"fp16_file": fp16_path, "bars": bars, "runs": runs}


def fp8_table(summary) -> str:
    """Per run: case x backend, us per layer (x fp16; x FI fp8)."""
    out = []
    for run in summary["runs"]:
        bs = run["backends"]
        out += [f"fp8 per {run['granularity']}:", "",
                "| case | fp16 KV MB | fp16 pkv-auto us | " + " | ".join(f"{b} us (x fp16; x FI)" for b in bs)
                + " | FI fp8 best us |", "|---|---|---|" + "---|" * len(bs) + "---|"]
        for c in run["cells"]:
            items = []
            for b in bs:
                r = c.get(b)
                items.append("-" if r is None else f"{r['us']:.1f} ({r.get('vs_fp16', float('nan')):.2f}x"
                             + (f"; {r['vs_fi']:.2f}x)" if "vs_fi" in r else ")"))
            fi = f"{c['fi_best_us']:.1f}" if "fi_best_us" in c else "-"
            half = f"{c['fp16_pkv_us']:.1f}" if c["fp16_pkv_us"] else "-"
            out.append(f"| {c['case']} | {c['fp16_kv_mb']:.0f} | {half} | " + " | ".join(items) + f" | {fi} |")
        out.append("")
    out += [f"- {name}: {value}" for name, value in summary["bars"].items()]
    return "\n".join(out)


E2E_KEYS = ("wall_s", "decode_tokens_per_s", "speedup", "token_agreement", "first_token_agreement",
            "matching_prefix", "tf_top1_agreement", "tf_logits_rel_diff", "tf_logits_max_abs_diff",
            "tf_ref_margin_median", "attention_share", "decode_attention_share",
            "attention_ms_per_decode_step", "pkv_kernel_ms", "error")
E2E_SPEEDUP_BAR, E2E_AGREEMENT_BAR, E2E_BAR_PROMPT = 1.3, 0.95, 4096


def e2e_summary(paths) -> dict:
    """Per file and row (model, requests, implementation): E2E_KEYS; the bars on ours."""
    runs, bars, environments = [], {}, {}
    for path in paths:
        data = json.load(open(path))
        environments[path] = data["environment"]
        for row in data["rows"]:
            entry = {"file": path, "model": row["model"], "requests": row["requests"],
                     "mean_prompt": row.get("mean_prompt"), "impl": row["impl"],
                     "reference": row["reference"]}
            entry.update({k: row[k] for k in E2E_KEYS if row.get(k) is not None})
            runs.append(entry)
            if row["impl"] != "paged|persistentkv" or row.get("speedup") is None:
                continue
            name = f"{row['model']} x {row['requests']} x {row.get('mean_prompt')}"
            if row.get("mean_prompt") == E2E_BAR_PROMPT and row["requests"] in (32, 128):
                bars[f"{name}: >= {E2E_SPEEDUP_BAR}x {row['reference']}"] = f"{row['speedup']:.2f}x"
                bars[f"{name}: greedy tokens >= {E2E_AGREEMENT_BAR:.0%} of the first 32"] = (
                    f"{row['token_agreement']:.1%}")
            if row.get("tf_top1_agreement") is not None:
                bars[f"{name}: teacher-forced top-1 / logits rel. diff"] = (
                    f"{row['tf_top1_agreement']:.3f} / {row['tf_logits_rel_diff']:.2e}")
    return {"bars": bars, "runs": runs, "environments": environments}


def e2e_table(summary) -> str:
    out = ["| model | requests x mean prompt | impl | decode tokens/s | speedup | token agreement "
           "| first token | teacher-forced top-1 | tf logits rel. diff |",
           "|---|---|---|---|---|---|---|---|---|"]
    columns = (("decode_tokens_per_s", ".1f"), ("speedup", ".2f"), ("token_agreement", ".3f"),
               ("first_token_agreement", ".3f"), ("tf_top1_agreement", ".3f"),
               ("tf_logits_rel_diff", ".2e"))
    for r in summary["runs"]:
        impl = r["impl"].replace("|", "\\|")   # a pipe inside a markdown cell
        cells = [format(r[k], f) if k in r else "-" for k, f in columns]
        out.append(f"| {r['model']} | {r['requests']} x {r['mean_prompt']} | {impl} | "
                   + " | ".join(cells) + " |")
    out.append("")
    out += [f"- {name}: {value}" for name, value in summary["bars"].items()]
    return "\n".join(out)


def pdl_summary(paths) -> dict:
    """Per layer-chain file and setting: us per layer, the ratio to PDL off, and whether the
    chain's output is bitwise PDL off's."""
    runs, environments = [], {}
    for path in paths:
        data = json.load(open(path))
        environments[path] = data["environment"]
        for r in data["summary"]:
            runs.append({"file": path, "case": r["case"], "setting": r["setting"],
                         "status": r["status"], "us_per_layer": r.get("us_per_layer"),
                         "ratio_vs_pdl0": r.get("ratio_vs_pdl0"),
                         "pdl_effective": r.get("pdl_effective"),
                         "chain_bitwise_equal_pdl0": r.get("chain_bitwise_equal_pdl0"),
                         "max_layer_error": r.get("max_layer_error")})
    paying = [r for r in runs if r["setting"] != "pdl0" and r["ratio_vs_pdl0"] is not None]
    verdict = ("pays" if paying and all(r["ratio_vs_pdl0"] < 0.995 for r in paying)
               else "does not pay: stays off")
    return {"verdict": verdict, "runs": runs, "environments": environments}


def pdl_table(summary) -> str:
    out = ["| step | setting | us per layer | / PDL off | bitwise equal to PDL off |",
           "|---|---|---|---|---|"]
    for r in summary["runs"]:
        out.append(f"| {r['case']} | {r['setting']} | {r['us_per_layer']:.2f} | "
                   f"{r['ratio_vs_pdl0']:.3f} | {r['chain_bitwise_equal_pdl0']} |")
    out += ["", f"PDL {summary['verdict']}."]
    return "\n".join(out)


def ab_table(a_paths, b_paths, backend="pkv-auto") -> str:
    """Per cell: A's and B's fastest run (us per layer), B / A, and each tree's slowest over
    fastest run; the geometric mean of B / A and its largest value."""
    def runs(paths):
        out = {}
        for path in paths:
            _, by, cases = _rows(path)
            for case in cases:
                r = by.get((case, backend))
                if r and r["status"] == "ok":
                    out.setdefault(case, []).append(r["graph_us_per_layer"])
        return out
    a, b = runs(a_paths), runs(b_paths)
    cases = [c for c in a if c in b]
    if not cases:
        raise SystemExit(f"no cell has {backend} in both trees' files")
    out = [f"| case | A us (spread) | B us (spread) | B / A |", "|---|---|---|---|"]
    ratios = []
    for case in cases:
        ratio = min(b[case]) / min(a[case])
        ratios.append(ratio)
        out.append(f"| {case} | {min(a[case]):.1f} ({max(a[case]) / min(a[case]):.3f}) | "
                   f"{min(b[case]):.1f} ({max(b[case]) / min(b[case]):.3f}) | {ratio:.3f} |")
    out.append("")
    out.append(f"{backend}, fastest of {len(a_paths)} A and {len(b_paths)} B runs: geometric mean "
               f"B / A {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}, largest "
               f"{max(ratios):.3f} ({cases[ratios.index(max(ratios))]}), smallest {min(ratios):.3f}.")
    return "\n".join(out)


def runs_table(paths, vs=None) -> str:
    """Cells x backends of grid runs of one command: each run's graph us per layer, joined by
    ', ' (a run where the backend failed or was skipped: its status); with `vs`, the fastest run
    of each backend over the fastest of `vs` (above 1: slower)."""
    runs = [_rows(path) for path in paths]
    cases = list(dict.fromkeys(c for _, _, cs in runs for c in cs))
    backends = list(dict.fromkeys(r["backend"] for data, _, _ in runs for r in data["summary"]
                                  if r["backend"] != "fi-best"))
    if vs is not None and vs not in backends:
        raise SystemExit(f"--vs {vs!r} is none of the runs' backends {backends}")

    def times(case, backend):
        cells = [by.get((case, backend)) for _, by, _ in runs]
        return [r["graph_us_per_layer"] if r and r["status"] == "ok" else (r["status"] if r else "-")
                for r in cells]

    head = ["cell", *backends, *([f"best / best {vs}"] if vs else [])]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case in cases:
        cols = [", ".join(f"{t:.2f}" if isinstance(t, float) else t for t in times(case, b))
                for b in backends]
        if vs:
            base = min((t for t in times(case, vs) if isinstance(t, float)), default=None)
            ratios = []
            for b in backends:
                best = min((t for t in times(case, b) if isinstance(t, float)), default=None)
                ratios.append(f"{b} {best / base:.3f}" if best and base and b != vs else None)
            cols.append("; ".join(r for r in ratios if r))
        out.append(f"| {case} | " + " | ".join(cols) + " |")
    devices = sorted({data["environment"].get("device", "?") for data, _, _ in runs})
    out.append("")
    out.append(f"{len(paths)} runs on {', '.join(devices)}; us per layer, graph replay.")
    return "\n".join(out)


def _write_json(path, summary) -> None:
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid", nargs="?")
    parser.add_argument("--shapes", nargs="+", help="per-preset grid JSON files")
    parser.add_argument("evaluate", nargs="?")
    parser.add_argument("--previous", help="an earlier grid.json, for the 'previous best' column")
    parser.add_argument("--queries", nargs="+", help="grid JSON files of `bench --grid --q-len N`")
    parser.add_argument("--variants", nargs="+", help="grid JSON files of `bench --grid` with "
                        "--window-left / --soft-cap / --sinks, and a plain run of each shape")
    parser.add_argument("--fp8", nargs="+", metavar="GRID", help="the fp16 grid, then grid JSON "
                        "files of `bench --grid --kv-fp8 tensor|token`")
    parser.add_argument("--fp8-fi", nargs="+", metavar="GRID",
                        help="with --fp8: FlashInfer's fp8 grids, run apart (HND) from ours")
    parser.add_argument("--ab-a", nargs="+", metavar="GRID", help="tree A's grid runs")
    parser.add_argument("--ab-b", nargs="+", metavar="GRID", help="tree B's grid runs")
    parser.add_argument("--ab-backend", default="pkv-auto")
    parser.add_argument("--runs", nargs="+", metavar="GRID",
                        help="grid runs of one command, side by side")
    parser.add_argument("--vs", metavar="BACKEND", help="with --runs: each backend's best over "
                        "this one's")
    parser.add_argument("--e2e", nargs="+", help="JSON files of `persistentkv e2e`")
    parser.add_argument("--pdl", nargs="+", help="JSON files of `persistentkv layer-chain`")
    parser.add_argument("--json", help="with --queries, --variants, --fp8, --e2e or --pdl: write "
                        "the summary here")
    args = parser.parse_args()
    for paths, summarize, table in ((args.e2e, e2e_summary, e2e_table),
                                    (args.pdl, pdl_summary, pdl_table)):
        if paths:
            summary = summarize(paths)
            print(table(summary))
            if args.json:
                _write_json(args.json, summary)
    if args.queries:
        summary = queries_summary(args.queries)
        print(queries_table(summary))
        if args.json:
            _write_json(args.json, summary)
    if args.variants:
        summary = variants_summary(args.variants)
        print(variants_table(summary))
        if args.json:
            _write_json(args.json, summary)
    if args.runs:
        print(runs_table(args.runs, args.vs))
    elif args.vs:
        raise SystemExit("--vs goes with --runs")
    if args.ab_a or args.ab_b:
        if not (args.ab_a and args.ab_b):
            raise SystemExit("--ab-a and --ab-b go together")
        print(ab_table(args.ab_a, args.ab_b, args.ab_backend))
    if args.fp8:
        if len(args.fp8) < 2:
            raise SystemExit("--fp8 takes the fp16 grid and at least one fp8 grid")
        summary = fp8_summary(args.fp8[0], args.fp8[1:], args.fp8_fi or ())
        print(fp8_table(summary))
        if args.json:
            _write_json(args.json, summary)
    if args.shapes:
        print(shapes_table(args.shapes))
    if args.grid:
        print(grid_table(args.grid, args.previous))
    if args.evaluate:
        print()
        print(evaluation_table(args.evaluate))


if __name__ == "__main__":
    main()
