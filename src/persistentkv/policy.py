"""Adaptive policy: which backend (and split size) serves a decode step, from the step's features.

A policy is a small decision table fitted by `persistentkv calibrate`: the steps' features are
binned by active rows, longest context and spread (longest / mean), and each bin holds the
candidate that was fastest in total over the calibration steps that fell in it; a step in a bin
no calibration step reached takes the nearest fitted bin's choice. Pure Python, deterministic, a
few microseconds per decision; saved as JSON per GPU model. A GPU with no fitted policy gets a
rule that needs no measurement (documented on `fallback_choice`).
"""
from __future__ import annotations

import bisect
import functools
import json
import statistics
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

CALIBRATION_SEEDS = (1, 2)                 # trace seeds the policy is fitted on
HELD_OUT_SEEDS = (100,)                   # trace seeds it is judged on (never seen in the fit)
CANDIDATES = ("pkv-grouped", "pkv-split", "pkv-workqueue", "pkv-graph", "pkv-split@16",
              "pkv-split@64", "pkv-workqueue@16", "pkv-workqueue@64", "fi-cuda-core",
              "fi-tensor-core", "fi-xqa")
ROW_EDGES = (1, 4, 8, 32)                 # bins: 1 | 2-4 | 5-8 | 9-32 | >32 rows
MAX_LEN_EDGES = (2048, 8192, 32768)       # bins: <=2K | <=8K | <=32K | >32K tokens
SPREAD_EDGES = (2.0,)                     # bins: even (max/mean <= 2) | skewed


@dataclass(frozen=True)
class StepFeatures:
    """What the policy sees of a step (lengths in tokens)."""

    rows: int
    total_tokens: int
    max_len: int
    mean_len: float
    spread: float                          # max_len / mean_len, >= 1
    kv_bytes: int
    sm_count: int
    page_size: int
    group: int

    @classmethod
    def of(cls, seq_lens, *, num_kv_heads: int, head_dim: int, elem_size: int, sm_count: int,
           page_size: int, group: int) -> "StepFeatures":
        lens = np.asarray(seq_lens, dtype=np.int64)
        rows = len(lens)
        total = int(lens.sum()) if rows else 0
        longest = int(lens.max()) if rows else 0
        mean = total / rows if rows else 0.0
        return cls(rows=rows, total_tokens=total, max_len=longest, mean_len=mean,
                   spread=longest / mean if mean else 1.0,
                   kv_bytes=total * num_kv_heads * head_dim * 2 * elem_size, sm_count=sm_count,
                   page_size=page_size, group=group)

    def bin(self) -> str:
        return bin_of(rows=self.rows, max_len=self.max_len, total_tokens=self.total_tokens)


def bin_of(*, rows: int, max_len: int, total_tokens: int) -> str:
    """The decision-table key, e.g. 'r2-l1-s0' (row bin, longest-context bin, spread bin)."""
    spread = max_len * rows / total_tokens if total_tokens else 1.0
    return (f"r{bisect.bisect_left(ROW_EDGES, rows)}"
            f"-l{bisect.bisect_left(MAX_LEN_EDGES, max_len)}"
            f"-s{bisect.bisect_left(SPREAD_EDGES, spread)}")


@functools.lru_cache(maxsize=4096)
def _bin_indices(key: str) -> tuple[int, ...]:
    """'r2-l1-s0' -> (2, 1, 0)."""
    return tuple(int(part[1:]) for part in key.split("-"))


def _nearest(table: dict, key: str):
    """The table's entry for the bin nearest to `key` (fewest bin steps over rows, longest context
    and spread; ties to the first key in sorted order); None for an empty table."""
    if not table:
        return None
    want = _bin_indices(key)

    def distance(k: str) -> int:
        return sum(abs(a - b) for a, b in zip(_bin_indices(k), want))

    return table[min(sorted(table), key=distance)]


@dataclass(frozen=True)
class Choice:
    """A backend name as the benchmark knows it ('pkv-split', 'fi-xqa', ...) and, for PersistentKV's
    split and work-queue, the pages per split (None: the kernel's default rule)."""

    backend: str
    split_pages: int | None = None

    def label(self) -> str:
        return self.backend if self.split_pages is None else f"{self.backend}@{self.split_pages}"


def fallback_choice(features: StepFeatures) -> Choice:
    """Rule for a GPU without a fitted policy: PersistentKV only (FlashInfer may be absent),
    whole rows ('grouped') when rows x KV heads fill the SMs, the work-queue for skewed batches
    (spread > 2), else split-K with the default split size."""
    if features.rows >= features.sm_count:
        return Choice("pkv-grouped")
    return Choice("pkv-workqueue" if features.spread > 2.0 else "pkv-split")


@dataclass
class Policy:
    """table: bin -> best Choice overall (fitted on the objective, graph-mode time by default);
    eager_table: bin -> best Choice by eager time (the host's plan() and run() included), for a
    serving loop without CUDA graphs; pkv_table: bin -> best PersistentKV Choice (what
    `plan(backend="auto")` can run without FlashInfer)."""

    gpu: str
    table: dict[str, Choice] = field(default_factory=dict)
    pkv_table: dict[str, Choice] = field(default_factory=dict)
    eager_table: dict[str, Choice] = field(default_factory=dict)
    fit: dict = field(default_factory=dict)     # how it was fitted: traces, seeds, objective, counts
    # (table, bin) -> the nearest fitted bin's choice; the tables are not edited after the first decide
    _nearest_memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def decide(self, features: StepFeatures, *, pkv_only: bool = False,
               mode: str = "graph") -> Choice:
        """mode: "graph" (steps replayed from CUDA graphs) or "eager". A bin the table does not
        hold takes the choice of the nearest bin it holds (calibration traces do not reach every
        bin); the eager table falls back to the graph table when it is empty, and a policy with
        no fitted bins to fallback_choice."""
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode must be 'graph' or 'eager', got {mode!r}")
        key = features.bin()
        if pkv_only:
            name, table = "pkv", self.pkv_table
        elif mode == "eager" and self.eager_table:
            name, table = "eager", self.eager_table
        else:
            name, table = "graph", self.table
        choice = table.get(key)
        if choice is None and table:
            memo = self._nearest_memo
            choice = memo.get((name, key))
            if choice is None:
                choice = memo[name, key] = _nearest(table, key)
        return choice if choice is not None else fallback_choice(features)

    # -- JSON ------------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"gpu": self.gpu,
                           "table": {k: asdict(v) for k, v in sorted(self.table.items())},
                           "pkv_table": {k: asdict(v) for k, v in sorted(self.pkv_table.items())},
                           "eager_table": {k: asdict(v) for k, v in sorted(self.eager_table.items())},
                           "fit": self.fit}, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Policy":
        data = json.loads(text)
        try:
            return cls(gpu=data["gpu"],
                       table={k: Choice(**v) for k, v in data["table"].items()},
                       pkv_table={k: Choice(**v) for k, v in data["pkv_table"].items()},
                       eager_table={k: Choice(**v)
                                    for k, v in data.get("eager_table", {}).items()},
                       fit=data.get("fit", {}))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a policy file: {exc}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())


def policy_file_name(gpu_name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200.json'."""
    return "-".join(gpu_name.lower().split()) + ".json"


def load_policy(gpu_name: str, path: str | Path | None = None) -> Policy:
    """The fitted policy shipped for `gpu_name` (or the file at `path`); the fallback-only policy
    when there is none."""
    if path is not None:
        return Policy.from_json(Path(path).read_text())
    shipped = resources.files("persistentkv") / "policies" / policy_file_name(gpu_name)
    if shipped.is_file():
        return Policy.from_json(shipped.read_text())
    return Policy(gpu=gpu_name, fit={"note": "no fitted policy for this GPU: fallback rule"})


def fit_policy(steps: list[dict], *, gpu: str, objective: str = "graph_us",
               tie_tolerance: float = 0.02, info: dict | None = None) -> Policy:
    """Decision table from measured steps.

    steps: one dict per (step, candidate) with 'bin' (StepFeatures.bin of the step), 'step_key'
    (unique per step), 'choice' (Choice.label), 'backend', 'split_pages', 'status', 'graph_us' and
    'eager_us' (us, lower is better). In each bin the candidate with the lowest total objective
    over the bin's steps wins, among candidates measured (status ok) on every one of those steps;
    candidates within tie_tolerance of that total count as tied, and the tie goes to the lowest
    total of the other mode's time (with the graph objective: the one whose plan() costs the host
    least in eager mode, e.g. the GPU-planned work-queue over an equal host-planned one). The
    eager table is fitted the same way on eager time.
    """
    if objective not in ("graph_us", "eager_us"):
        raise ValueError(f"objective must be 'graph_us' or 'eager_us', got {objective!r}")
    modes = ("graph_us", "eager_us")
    by_bin: dict[str, dict[str, list]] = {}
    choices: dict[str, Choice] = {}
    for s in steps:
        choices[s["choice"]] = Choice(s["backend"], s.get("split_pages"))
        entry = by_bin.setdefault(s["bin"], {}).setdefault(s["choice"], [])
        ok = s["status"] == "ok"
        entry.append({m: s.get(m, float("inf")) if ok else float("inf") for m in modes})
    table, pkv_table, eager_table, counts = {}, {}, {}, {}
    for bin_key, per_choice in sorted(by_bin.items()):
        n = max(len(v) for v in per_choice.values())
        totals = {c: {m: sum(x[m] for x in v) for m in modes}
                  for c, v in per_choice.items() if len(v) == n}

        def pick(names: list[str], by: str) -> str | None:
            """Lowest total of `by`; near ties go to the lowest total of the other mode."""
            names = [c for c in names if totals[c][by] < float("inf")]
            if not names:
                return None
            other = modes[1 - modes.index(by)]
            best = min(totals[c][by] for c in names)
            tied = [c for c in names if totals[c][by] <= best * (1 + tie_tolerance)]
            return min(tied, key=lambda c: (totals[c][other], totals[c][by], c))

        winner = pick(list(totals), objective)
        if winner is None:
            continue
        table[bin_key] = choices[winner]
        pkv = pick([c for c in totals if c.startswith("pkv-")], objective)
        if pkv is not None:
            pkv_table[bin_key] = choices[pkv]
        eager = pick(list(totals), "eager_us")
        if eager is not None:
            eager_table[bin_key] = choices[eager]
        counts[bin_key] = {"steps": n, "best": winner, "best_eager": eager,
                           "median_us": statistics.median(x[objective] for x in per_choice[winner])}
    return Policy(gpu=gpu, table=table, pkv_table=pkv_table, eager_table=eager_table,
                  fit={**(info or {}), "objective": objective, "tie_tolerance": tie_tolerance,
                       "bins": counts})
