"""Markdown tables for BENCHMARKS.md from a grid and an evaluation results file.

Grid: per cell the floor (KV bytes / the run's ceiling), the bar 1.1 x floor + 3 us, FlashInfer's
best entry, an earlier version's best PersistentKV backend (optional), our backends, the best
against FlashInfer's best (and the bar it needs: 1.3x where FlashInfer is under 70% of the
ceiling), pkv-auto's eager tokens/s against FlashInfer's best eager, and whether both bars hold.
Evaluation: per trace pkv-auto (the policy on the device) against FlashInfer's best and the best
fixed backend.
Shapes: per grid cell and model preset, pkv-auto against FlashInfer's best (--shapes, the grids
that `persistentkv bench --grid --preset NAME` wrote), with the geometric mean.
Run: python scripts/benchmark_tables.py results/h200/grid.json results/h200/evaluate.json
         [--previous results/h200/v3/grid.json]
     python scripts/benchmark_tables.py --shapes results/h200/shapes/*.json
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
                   ("fi-cuda-core", "fi-tensor-core", "fi-xqa") if (case, b) in by}
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
           "pkv-auto tokens/s graph | x FI best, graph | x best fixed, graph (best fixed) | picks |",
           "|---|---|---|---|---|---|---|---|"]
    for r in data["environment"]["evaluation"]:
        picks = ", ".join(f"{k} {v}" for k, v in r["picks"].items())
        out.append(f"| {r['trace']} | {r['auto_eager']:.0f} | {r['vs_fi_best_eager']:.2f} | "
                   f"{r['vs_best_fixed_eager']:.3f} ({r['best_fixed_eager']}) | "
                   f"{r['auto_graph']:.0f} | {r['vs_fi_best_graph']:.2f} | "
                   f"{r['vs_best_fixed_graph']:.3f} ({r['best_fixed_graph']}) | {picks} |")
    return "\n".join(out)


def shapes_table(paths) -> str:
    """Case x preset: pkv-auto / FI best in graph replay (us per layer beside it)."""
    grids = [(path.rsplit("/", 1)[-1].removesuffix(".json"), *_rows(path)[1:]) for path in paths]
    cases = list(dict.fromkeys(c for _, _, cs in grids for c in cs))
    out = ["| case | " + " | ".join(f"{name} (auto / FI us)" for name, _, _ in grids) + " |",
           "|---|" + "---|" * len(grids)]
    logs, below = [], 0
    for case in cases:
        cells = []
        for _, by, _ in grids:
            ours, fi = by.get((case, "pkv-auto")), by.get((case, "fi-best"))
            if not ours or not fi or not ours.get("graph_us_per_layer") or not fi.get("graph_us_per_layer"):
                cells.append("-")
                continue
            ratio = fi["graph_us_per_layer"] / ours["graph_us_per_layer"]
            logs.append(math.log(ratio))
            below += ratio < 0.995
            cells.append(f"{ratio:.2f}x ({ours['graph_us_per_layer']:.1f} / {fi['graph_us_per_layer']:.1f})")
        out.append(f"| {case} | " + " | ".join(cells) + " |")
    out.append(f"\nGeometric mean {math.exp(sum(logs) / len(logs)):.3f}x over {len(logs)} (case, "
               f"preset) pairs; {below} under 0.995x.")
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid", nargs="?")
    parser.add_argument("--shapes", nargs="+", help="per-preset grid JSON files")
    parser.add_argument("evaluate", nargs="?")
    parser.add_argument("--previous", help="an earlier grid.json, for the 'previous best' column")
    args = parser.parse_args()
    if args.shapes:
        print(shapes_table(args.shapes))
    if args.grid:
        print(grid_table(args.grid, args.previous))
    if args.evaluate:
        print()
        print(evaluation_table(args.evaluate))


if __name__ == "__main__":
    main()
