"""`persistentkv report`: PNG plots from benchmark results (JSON written by `persistentkv bench`)."""
from __future__ import annotations

import json
import math
from pathlib import Path

from .results import FI_BEST, check_out_dir


RESULTS_KEYS = ("summary", "steps", "environment")
STEP_KEYS = ("backend", "case", "status", "graph_us", "kv_bytes", "tokens", "rows")


def load_results(path: Path) -> dict:
    """A results file of `persistentkv bench` (JSON with summary, steps and environment)."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{str(path)!r} is not JSON: {err}") from None
    missing = [k for k in RESULTS_KEYS if not isinstance(data, dict) or k not in data]
    if missing:
        raise ValueError(f"{str(path)!r} is not a results file of `persistentkv bench`: it has "
                         f"no {', '.join(repr(k) for k in missing)}")
    steps = data["steps"] if isinstance(data["steps"], list) else [None]
    bad = next((s for s in steps if not isinstance(s, dict)
                or any(k not in s for k in STEP_KEYS)), None)
    if steps and bad is not None:   # (layer-chain and sweep files have other steps)
        keys = sorted(bad) if isinstance(bad, dict) else bad
        raise ValueError(f"{str(path)!r} is not a results file of `persistentkv bench`: its steps "
                         f"need {', '.join(STEP_KEYS)}; one has {keys}")
    return data


def make_report(paths: list[Path], out_dir: Path) -> list[Path]:
    """Throughput per backend per case, TB/s against context length with the ceiling drawn in,
    and (when FlashInfer was measured) each backend's speedup over FlashInfer's best, per case,
    in graph and in eager mode: the layout of the paper's results table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loaded = [(path, load_results(path)) for path in paths]   # every file, before any output
    check_out_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path, data in loaded:
        summary, steps, env = data["summary"], data["steps"], data["environment"]
        ok = [r for r in summary if r["status"] == "ok" and "tokens_per_s_graph" in r]
        cases = list(dict.fromkeys(r["case"] for r in ok))
        backends = list(dict.fromkeys(r["backend"] for r in ok))
        by = {(r["case"], r["backend"]): r for r in ok}

        def throughput(row):   # graph mode where it was timed, else eager
            v = row["tokens_per_s_graph"]
            return v if v == v else row["tokens_per_s_eager"]

        fig, ax = plt.subplots(figsize=(max(8, len(cases) * 1.2), 5))
        _grouped_bars(ax, cases, backends, by, throughput)
        ax.set_yscale("log")
        ax.set_ylabel("decode tokens / s (every layer of a step; graph replay, else eager)")
        ax.set_title(f"Throughput per backend ({env['device']})")
        ax.legend(fontsize=7, ncol=2)
        written.append(_save(fig, out_dir / f"{Path(path).stem}-throughput.png"))

        fig, ax = plt.subplots(figsize=(8, 5))
        timed = [s for s in steps if s["status"] == "ok" and s["graph_us"] == s["graph_us"]]
        for b in dict.fromkeys(s["backend"] for s in timed):
            pts = sorted((s["tokens"] / s["rows"], s["kv_bytes"] / s["graph_us"] / 1e6)
                         for s in timed if s["backend"] == b)
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, label=b)
        if env.get("ceiling_tbps"):
            ax.axhline(env["ceiling_tbps"], color="k", ls="--", lw=1,
                       label=f"ceiling {env['ceiling_tbps']:.2f} TB/s")
        ax.set_xscale("log")
        ax.set_xlabel("mean context length of the step (tokens)")
        ax.set_ylabel("KV read bandwidth (TB/s)")
        ax.set_title("Achieved bandwidth against context length")
        ax.legend(fontsize=7)
        written.append(_save(fig, out_dir / f"{Path(path).stem}-bandwidth.png"))

        mine = [b for b in backends if b != FI_BEST]
        if FI_BEST in backends and mine:
            fig, axes = plt.subplots(2, 1, figsize=(max(9, len(cases) * 0.75), 9), sharey=True)
            for ax, mode in zip(axes, ("graph", "eager")):
                _grouped_bars(ax, cases, mine, by,   # NaN (no bar) where FlashInfer failed a case
                              lambda row: row.get(f"speedup_{mode}_vs_fi_best", math.nan))
                ax.axhline(1.0, color="k", lw=1)
                ax.set_title(f"{mode} mode")
                ax.set_ylabel("speedup over FlashInfer's best (x)")
            handles, labels = axes[0].get_legend_handles_labels()
            fig.legend(handles, labels, loc="lower center", ncol=min(len(mine), 8), fontsize=8)
            fig.suptitle(f"Against FlashInfer's best entry per step ({env['device']})")
            written.append(_save(fig, out_dir / f"{Path(path).stem}-vs-flashinfer.png",
                                 rect=(0, 0.04, 1, 1)))
    return written


def speedup_matrix(paths: list[Path], *, backend: str = "pkv-auto") -> tuple[list, list, dict]:
    """(shapes, cases, {(shape, case): x FlashInfer's best in graph replay}) of one results file
    per shape (the file's stem names it), for `backend`; cases in the first file's order."""
    shapes, cases, ratio = [], [], {}
    for path in paths:
        shape = Path(path).stem
        rows = [r for r in load_results(path)["summary"]
                if r["backend"] == backend and r["status"] == "ok"
                and r.get("speedup_graph_vs_fi_best") is not None]
        if not rows:
            raise ValueError(f"{str(path)!r} holds no {backend} row timed against FlashInfer's "
                             f"best (run the grid with its fi-* backends)")
        shapes.append(shape)
        for r in rows:
            if r["case"] not in cases:
                cases.append(r["case"])
            ratio[(shape, r["case"])] = r["speedup_graph_vs_fi_best"]
    return shapes, cases, ratio


def matrix_heatmap(paths: list[Path], out_path: Path, *, backend: str = "pkv-auto") -> Path:
    """One heatmap of shape x case: `backend` x FlashInfer's best in graph replay, the value in
    each cell, under 1.00 in red; blank where a shape lacks the case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    shapes, cases, ratio = speedup_matrix(paths, backend=backend)
    check_out_dir(out_path.parent)
    grid = [[ratio.get((s, c), math.nan) for c in cases] for s in shapes]
    fig, ax = plt.subplots(figsize=(max(8, len(cases) * 0.62), max(3, len(shapes) * 0.5 + 1.5)))
    image = ax.imshow(grid, cmap="RdYlGn", norm=TwoSlopeNorm(vmin=0.8, vcenter=1.0, vmax=1.3),
                      aspect="auto")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v == v:
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6.5)
    ax.set_xticks(range(len(cases)), cases, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(shapes)), shapes, fontsize=8)
    fig.colorbar(image, ax=ax, label=f"{backend} x FlashInfer's best (graph)")
    finite = [v for row in grid for v in row if v == v]
    geo = math.exp(sum(math.log(v) for v in finite) / len(finite))
    ax.set_title(f"{backend} against FlashInfer's best per step: geometric mean {geo:.3f}x "
                 f"over {len(finite)} cells, {sum(v < 1.0 for v in finite)} under 1.00")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, out_path)


def _grouped_bars(ax, cases: list[str], series: list[str], by: dict, value) -> None:
    """One group of bars per case, one bar per series (backend): value(row) of by[(case, series)],
    NaN where missing; the case names under the groups."""
    width = 0.8 / max(len(series), 1)
    for i, name in enumerate(series):
        vals = [value(by[(c, name)]) if (c, name) in by else math.nan for c in cases]
        ax.bar([x + i * width for x in range(len(cases))], vals, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cases))], cases, rotation=30, ha="right")


def _save(fig, path: Path, *, rect=(0, 0, 1, 1)) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
