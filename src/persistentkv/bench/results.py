"""Summaries, the environment, and the JSON / CSV / terminal outputs of a benchmark run."""
from __future__ import annotations

import csv
import datetime as dt
import json
import math
import numbers
import platform
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from .backends import flashinfer_version
from .runner import Measured

FI_BEST = "fi-best"


_cli_command: list[str] | None = None   # the arguments cli.main parsed (record_command)


def record_command(argv: list[str] | None) -> None:
    """The command line the results files record while cli.main runs: `persistentkv` and the
    arguments it was given (None when it returns: sys.argv's again)."""
    global _cli_command
    _cli_command = None if argv is None else ["persistentkv", *argv]


def run_command() -> list[str]:
    """The command line a results file records (record_command's, else sys.argv's)."""
    return _cli_command or ["persistentkv", *sys.argv[1:]]


def environment(device: torch.device, *, command: list[str] | None = None,
                functional: bool) -> dict:
    import triton   # here, not at the top: the CLI's parser imports this module before it chooses
                    # Triton's interpreter

    env = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(command or run_command()),   # quoted: it runs again as written
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "flashinfer": flashinfer_version() if device.type == "cuda" else None,
        "device": "cpu (Triton interpreter)" if device.type != "cuda" else torch.cuda.get_device_name(device),
        "functional_only": functional,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["sm_count"] = props.multi_processor_count
        env["cuda"] = torch.version.cuda
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
        except Exception:  # noqa: BLE001 - the driver version is informative only
            env["driver"] = "unknown"
    return env


def _fi_best_steps(steps: list[dict]) -> list[dict]:
    """Per step, the best (lowest graph time) of FlashInfer's entries that ran correctly."""
    by_step: dict[int, list[dict]] = {}
    for s in steps:
        if s["backend"].startswith("fi-") and s["status"] == "ok":
            by_step.setdefault(s["step"], []).append(s)
    best = []
    for group in by_step.values():
        pick = min(group, key=lambda s: s["graph_us"] if not math.isnan(s["graph_us"]) else s["eager_us"])
        best.append({**pick, "backend": FI_BEST, "eager_us": min(s["eager_us"] for s in group),
                     "note": pick["backend"]})
    return best


def summarize(measured: Measured, *, ceiling_tbps: float | None) -> list[dict]:
    """One row per backend (plus FlashInfer's best): throughput, device time, bandwidth, host costs."""
    rows = []
    step_layers = measured.step_layers or measured.layers
    names = list(dict.fromkeys(s["backend"] for s in measured.steps))
    steps = measured.steps + _fi_best_steps(measured.steps)
    if any(s["backend"] == FI_BEST for s in steps):
        names.append(FI_BEST)
    for name in names:
        mine = [s for s in steps if s["backend"] == name]
        ok = [s for s in mine if s["status"] == "ok"]
        bad = [s for s in mine if s["status"] != "ok"]
        row = {"case": measured.name, "batch": measured.batch_slots, "layers": measured.layers,
               "step_layers": step_layers, "backend": name,
               "status": bad[0]["status"] if bad else "ok",
               "note": bad[0]["note"] if bad else (ok[0]["note"] if name == FI_BEST and ok else ""),
               "steps": len(ok)}
        if ok and not bad:
            rows_total = sum(s["rows"] for s in ok)
            eager = sum(s["eager_us"] for s in ok)
            graph_us = sum(s["graph_us"] for s in ok)          # a layer each, summed over steps
            row.update(
                tokens_per_s_eager=rows_total / eager * 1e6,
                tokens_per_s_graph=rows_total / (graph_us * step_layers) * 1e6
                if graph_us == graph_us else math.nan,
                graph_us_per_layer=statistics.median(s["graph_us"] for s in ok),
                eager_us_per_step=statistics.median(s["eager_us"] for s in ok),
                plan_us=statistics.median(s["plan_us"] for s in ok),
                run_us=statistics.median(s["run_us"] for s in ok),
                tbps=sum(s["kv_bytes"] for s in ok) / graph_us / 1e6
                if graph_us == graph_us else math.nan,
                max_error=max((s["error"] for s in ok if s["error"] == s["error"]), default=math.nan),
            )
            row["fraction_of_ceiling"] = row["tbps"] / ceiling_tbps if ceiling_tbps else math.nan
        rows.append(row)
    fi_steps = {s["step"]: s for s in steps if s["backend"] == FI_BEST}   # all ok (_fi_best_steps)
    for r in rows:
        if fi_steps and r["status"] == "ok":
            r.update(_speedups([s for s in steps if s["backend"] == r["backend"]], fi_steps))
    return rows


def _speedups(mine: list[dict], fi_steps: dict[int, dict]) -> dict:
    """Tokens/s over FlashInfer's best, graph and eager, over the steps both measured (a
    FlashInfer entry that failed partway leaves steps without a best)."""
    common = [s for s in mine if s["step"] in fi_steps]
    if not common:
        return {}
    def ratio(key):
        return sum(fi_steps[s["step"]][key] for s in common) / sum(s[key] for s in common)
    out = {"speedup_graph_vs_fi_best": ratio("graph_us"),
           "speedup_eager_vs_fi_best": ratio("eager_us")}
    if len(common) < len(mine):
        out["speedup_steps"] = len(common)
    return out


def run_ceiling(measured_all: list[Measured], measured_read_tbps: float | None) -> float | None:
    """The run's ceiling: the best of the plain read and of any kernel's step bandwidth."""
    best = [s["kv_bytes"] / s["graph_us"] / 1e6 for m in measured_all for s in m.steps
            if s["status"] == "ok" and s["graph_us"] == s["graph_us"] and s["graph_us"] > 0]
    candidates = [x for x in [measured_read_tbps, max(best, default=None)] if x]
    return max(candidates) if candidates else None


def check_out_dir(out_dir: Path) -> None:
    """Before a run: the results folder must be a folder (or not exist yet), not a file."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {str(out_dir)!r} is a file; it names the folder for the results")


SIGNIFICANT_DIGITS = 6   # a result's floats: 0.01 us of a 1000 us step, far under its noise


def results_json(payload) -> str:
    """A results file's text: its floats to SIGNIFICANT_DIGITS digits, each row of a list of rows
    (dicts or lists) on one line, the rest indented: about a quarter fewer bytes than indent=1
    (the committed results: 28.7 -> 21.0 MB), and a diff shows which rows changed."""
    return _layout(_rounded(payload), 0) + "\n"


def _rounded(value):
    if isinstance(value, dict):
        return {key: _rounded(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):   # int, numpy's ints
        return int(value)
    return float(f"{float(value):.{SIGNIFICANT_DIGITS}g}")   # float, numpy's floats


def _layout(value, depth: int) -> str:
    pad = " " * (depth + 1)
    if isinstance(value, dict) and any(isinstance(v, (dict, list)) for v in value.values()):
        fields = [f"{pad}{json.dumps(key)}: {_layout(v, depth + 1)}" for key, v in value.items()]
        return "{\n" + ",\n".join(fields) + "\n" + " " * depth + "}"
    if isinstance(value, list) and value and all(isinstance(v, (dict, list)) for v in value):
        return "[\n" + ",\n".join(pad + json.dumps(v) for v in value) + "\n" + " " * depth + "]"
    return json.dumps(value)


def write_results(out_dir: Path, *, env: dict, summary: list[dict], steps: list[dict], tag: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{tag}.json", out_dir / f"{tag}.csv", out_dir / f"{tag}-steps.csv"]
    paths[0].write_text(results_json({"environment": env, "summary": summary, "steps": steps}))
    for path, rows in ((paths[1], summary), (paths[2], steps)):
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
    return paths


def print_table(summary: list[dict], *, title: str, functional: bool) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is in the [bench] extra; fall back to plain lines
        for r in summary:
            print(r)
        return
    table = Table(title=title + ("  [functional run: timings mean nothing]" if functional else ""))
    cols = [("case", "case"), ("backend", "backend"), ("status", "status"),
            ("graph_us_per_layer", "us/layer (graph)"), ("tbps", "TB/s"),
            ("fraction_of_ceiling", "% ceiling"), ("eager_us_per_step", "us/step (eager)"),
            ("plan_us", "plan us"), ("run_us", "run us"), ("speedup_graph_vs_fi_best", "x FI best (graph)"),
            ("speedup_eager_vs_fi_best", "x FI best (eager)"), ("max_error", "max rel err")]
    if functional:   # no device times, no bandwidth: what the run checked, and its host times
        cols = [c for c in cols if c[0] in ("case", "backend", "status", "eager_us_per_step",
                                            "plan_us", "run_us", "max_error")]
    for _, head in cols:
        table.add_column(head, justify="right" if head not in ("case", "backend", "status") else "left")
    for r in summary:
        cells = []
        for key, _ in cols:
            v = r.get(key, "")
            if isinstance(v, float) and math.isnan(v):
                v = "-"
            elif key == "fraction_of_ceiling" and isinstance(v, float):
                v = f"{100 * v:.0f}%"
            elif key == "max_error" and isinstance(v, float):
                v = f"{v:.1e}"
            elif isinstance(v, float):
                v = "-" if math.isnan(v) else f"{v:.2f}" if v < 100 else f"{v:.0f}"
            cells.append(str(v) if r["status"] == "ok" or key in ("case", "backend", "status")
                         else (r.get("note", "")[:40] if key == "graph_us_per_layer" else ""))
        table.add_row(*cells)
    Console(file=sys.stdout, width=200).print(table)
