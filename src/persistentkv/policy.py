"""Adaptive policy: which schedule and split size serve a decode step, from the step's features.

A policy is a small decision table fitted by `persistentkv calibrate`: the steps' features are
binned by active rows, longest context and spread (longest / mean), and each bin holds the choice
that was fastest in total over the calibration steps that fell in it (the default split rule
when it is within the tie tolerance); a bin no calibration step reached takes the default rule,
which is measured to hold on every shape of the grid. The planner reads the table on the device, as
`dense_codes()` lays it out (every bin filled), so the same decision is taken inside a CUDA
graph; `decide()` is the same lookup on the host, for reports and tests. Saved as JSON per GPU
model and shape, with the page size its split sizes count in. A GPU with no fitted policy gets the
default split rule on every step (`fallback_choice`).
"""
from __future__ import annotations

import bisect
import itertools
import json
import statistics
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from .schedule import MAX_SPLIT_TOKENS, Choice

ROW_EDGES = (1, 4, 8, 32)                 # bins: 1 | 2-4 | 5-8 | 9-32 | >32 active rows
MAX_LEN_EDGES = (2048, 8192, 32768)       # bins: <=2K | <=8K | <=32K | >32K tokens
SPREAD_EDGES = (2.0,)                     # bins: even (max/mean <= 2) | skewed
EDGES = (ROW_EDGES, MAX_LEN_EDGES, SPREAD_EDGES)
# A bin moves off the default rule only on at least this many calibration steps: qwen2.5-7b's
# bin of 2-4 rows up to 8K, fitted on one step of about 11 us to splits of 16 pages, ran B4 L8K
# at 33.5 us against the rule's 24.6 (FlashInfer's best 25.6; docs/perf-notes.md, v21).
MIN_BIN_STEPS = 2


@dataclass(frozen=True)
class StepFeatures:
    """What the policy sees of a step: its active rows (length > 0), lengths in tokens."""

    rows: int
    total_tokens: int
    max_len: int
    mean_len: float
    spread: float                          # max_len / mean_len, >= 1
    kv_bytes: int

    @classmethod
    def of(cls, seq_lens, *, num_kv_heads: int, head_dim: int, elem_size: int) -> "StepFeatures":
        lens = np.asarray(seq_lens, dtype=np.int64)
        lens = lens[lens > 0]
        rows = len(lens)
        total = int(lens.sum()) if rows else 0
        longest = int(lens.max()) if rows else 0
        mean = total / rows if rows else 0.0
        return cls(rows=rows, total_tokens=total, max_len=longest, mean_len=mean,
                   spread=longest / mean if mean else 1.0,
                   kv_bytes=total * num_kv_heads * head_dim * 2 * elem_size)

    def bin(self) -> str:
        return bin_of(rows=self.rows, max_len=self.max_len, total_tokens=self.total_tokens)


def bin_of(*, rows: int, max_len: int, total_tokens: int) -> str:
    """The decision-table key, e.g. 'r2-l1-s0' (row bin, longest-context bin, spread bin); the
    planner computes the same on the device (kernels/plan.py)."""
    spread = max_len * rows / total_tokens if total_tokens else 1.0
    return (f"r{bisect.bisect_left(ROW_EDGES, rows)}"
            f"-l{bisect.bisect_left(MAX_LEN_EDGES, max_len)}"
            f"-s{bisect.bisect_left(SPREAD_EDGES, spread)}")


def _bin_key(indices: tuple[int, ...]) -> str:
    return "-".join(f"{p}{i}" for p, i in zip("rls", indices))


# every bin's (row, longest-context, spread) indices, rows-major: the device table's order
BIN_INDICES = tuple(itertools.product(*(range(len(edges) + 1) for edges in EDGES)))
BINS = frozenset(map(_bin_key, BIN_INDICES))


def fallback_choice() -> Choice:
    """For a GPU without a fitted policy: the default split rule, which already keeps rows whole
    when rows x KV heads fill the SMs (schedule.py)."""
    return Choice("split")


@dataclass
class Policy:
    """table: bin -> the fastest Choice on the calibration steps of that bin. shape: the
    (num_qo_heads, num_kv_heads, head_dim) it was fitted on, None for any; a plan of another
    shape takes the default rule (a split size fitted at 8 KV heads does not hold at 1).
    page_size: the page size the table's split sizes count in (the calibration's), None for
    the plan's own; a plan of another page size takes the same split in tokens (in_pages)."""

    gpu: str
    table: dict[str, Choice] = field(default_factory=dict)
    fit: dict = field(default_factory=dict)     # how it was fitted: traces, seeds, objective, counts
    shape: tuple[int, int, int] | None = None
    page_size: int | None = None

    def __post_init__(self):
        if self.page_size is not None and (isinstance(self.page_size, bool)
                                           or not isinstance(self.page_size, int)
                                           or self.page_size < 1):
            raise ValueError(f"Policy.page_size must be a positive int or None, "
                             f"got {self.page_size!r}")
        if not isinstance(self.gpu, str):
            raise TypeError(f"Policy.gpu must be a GPU name (str), got {self.gpu!r}")
        if self.shape is not None:
            if (not isinstance(self.shape, (tuple, list)) or len(self.shape) != 3
                    or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                           for n in self.shape)):
                raise ValueError(f"Policy.shape must be None or (num_qo_heads, num_kv_heads, "
                                 f"head_dim), three positive ints, got {self.shape!r}")
            self.shape = tuple(self.shape)
        most_pages = MAX_SPLIT_TOKENS // (self.page_size or 1)
        for key, choice in self.table.items():
            if key not in BINS:
                raise ValueError(f"Policy.table key {key!r} is not a bin: keys are 'r<R>-l<L>-s<S>' "
                                 f"with R in 0-{len(ROW_EDGES)}, L in 0-{len(MAX_LEN_EDGES)} and "
                                 f"S in 0-{len(SPREAD_EDGES)} (bin_of)")
            if not isinstance(choice, Choice):
                raise TypeError(f"Policy.table[{key!r}] must be a schedule.Choice, got "
                                f"{choice!r}")
            if choice.split_pages is not None and choice.split_pages > most_pages:
                raise ValueError(f"Policy.table[{key!r}] splits at {choice.split_pages} pages: "
                                 f"at most {most_pages} (schedule.MAX_SPLIT_TOKENS)")

    def applies_to(self, *, num_qo_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        return self.shape is None or tuple(self.shape) == (num_qo_heads, num_kv_heads, head_dim)

    def in_pages(self, choice: Choice, *, page_size: int | None) -> Choice:
        """`choice` for a plan of `page_size`: a split of N pages of the policy's page size is
        the split of the same tokens, ceil(N * self.page_size / page_size) pages (v15: the 32/8
        policy's 16-page split of a B1 8K step, 256 tokens, ran 81.8 us as 16 one-token pages
        against 17.4 us at 512 tokens). A split past schedule.MAX_SPLIT_TOKENS is cut to it: it
        keeps every row whole either way."""
        if choice.split_pages is None or page_size is None:
            return choice
        pages = (choice.split_pages if self.page_size is None or page_size == self.page_size
                 else -(-choice.split_pages * self.page_size // page_size))
        pages = min(pages, MAX_SPLIT_TOKENS // page_size)
        return choice if pages == choice.split_pages else Choice(choice.schedule, pages)

    def decide(self, features: StepFeatures, *, page_size: int | None = None) -> Choice:
        """The choice for a step (of a plan of `page_size`): its bin's, else the fallback (the
        default split rule)."""
        return self.in_pages(self.table.get(features.bin()) or fallback_choice(),
                             page_size=page_size)

    def dense_codes(self, *, page_size: int | None = None) -> list[int]:
        """Choice codes (schedule.Choice.code) of every bin for a plan of `page_size`,
        rows-major then longest context then spread: what the planner looks up on the device."""
        return [self.in_pages(self.table.get(k) or fallback_choice(), page_size=page_size).code()
                for k in map(_bin_key, BIN_INDICES)]

    def code_bins(self, *, page_size: int | None = None) -> dict[int, set]:
        """Each choice code of dense_codes and the bins it decides, as (most active rows, longest
        row in tokens) pairs, None where the bin is open above: a plan under that code has at
        most those rows and that longest row."""
        out: dict[int, set] = {}
        for (r, l, _), code in zip(BIN_INDICES, self.dense_codes(page_size=page_size)):
            out.setdefault(code, set()).add((ROW_EDGES[r] if r < len(ROW_EDGES) else None,
                                             MAX_LEN_EDGES[l] if l < len(MAX_LEN_EDGES) else None))
        return out

    # -- JSON ------------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"gpu": self.gpu, "shape": None if self.shape is None else list(self.shape),
                           "page_size": self.page_size, "table": {k: str(v) for k, v in sorted(self.table.items())},
                           "fit": self.fit}, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Policy":
        try:
            data = json.loads(text)
            return cls(gpu=data["gpu"], table={k: parse_choice(v) for k, v in data["table"].items()},
                       fit=data.get("fit", {}), shape=data.get("shape"),
                       page_size=data.get("page_size"))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a policy file: {exc}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())


def parse_choice(text: str) -> Choice:
    """'split@16' -> Choice('split', 16); 'grouped' -> Choice('grouped')."""
    schedule, _, pages = text.partition("@")
    if pages and not (pages.isascii() and pages.isdigit()):
        raise ValueError(f"split pages must be an int, got {text!r}")
    return Choice(schedule, int(pages) if pages else None)


def policy_file_name(gpu_name: str, shape: tuple[int, int, int] | None = None, *,
                     kv_fp8: bool = False) -> str:
    """'NVIDIA H200' -> 'nvidia-h200.json'; at shape (Hq, Hkv, head_dim) = (8, 1, 128):
    'nvidia-h200-8-1-128.json'; fitted on fp8 caches: 'nvidia-h200-8-1-128-fp8.json'."""
    stem = "-".join(gpu_name.lower().split())
    return stem + "".join(f"-{n}" for n in shape or ()) + ("-fp8" if kv_fp8 else "") + ".json"


def load_policy(gpu_name: str, path: str | Path | None = None, *,
                shape: tuple[int, int, int] | None = None, kv_fp8: bool = False) -> Policy:
    """The fitted policy at `path`, or the one shipped for `gpu_name`: for an fp8 cache the file
    fitted on fp8 steps at `shape` (Hq, Hkv, head_dim) when there is one, else the file fitted
    at `shape`, else the GPU's general file (which applies at the shape it names,
    Policy.shape); the fallback-only policy when there is none."""
    if path is not None:
        try:
            return Policy.from_json(Path(path).read_text())
        except ValueError as exc:
            raise ValueError(f"{str(path)!r}: {exc}") from None
    shipped = resources.files("persistentkv") / "policies"
    names = [policy_file_name(gpu_name, shape, kv_fp8=True)] if shape and kv_fp8 else []
    for name in names + ([policy_file_name(gpu_name, shape)] if shape else []) + [policy_file_name(gpu_name)]:
        if (shipped / name).is_file():
            return Policy.from_json((shipped / name).read_text())
    return Policy(gpu=gpu_name, fit={"note": "no fitted policy for this GPU: fallback rule"})


def fit_policy(steps: list[dict], *, gpu: str, objective: str = "graph_us",
               tie_tolerance: float = 0.02, min_bin_steps: int = MIN_BIN_STEPS,
               info: dict | None = None, shape: tuple[int, int, int] | None = None,
               page_size: int | None = None) -> Policy:
    """Decision table from measured steps (of plans of `page_size`).

    steps: one dict per (step, candidate) with 'bin' (StepFeatures.bin of the step), 'step_key'
    (unique per step), 'choice' (a Choice), 'status', 'graph_us' and 'eager_us' (us, lower is
    better). In each bin the candidate with the lowest total objective over the bin's steps wins,
    among candidates measured (status ok) on every one of those steps; when the default rule
    (fallback_choice) is within tie_tolerance of that total it wins instead, so that a bin moves
    off the rule only for a clear gain (host costs are the same for every choice: one planner).
    """
    modes = ("graph_us", "eager_us")
    if isinstance(min_bin_steps, bool) or not isinstance(min_bin_steps, int) or min_bin_steps < 1:
        raise ValueError(f"min_bin_steps must be an int >= 1, got {min_bin_steps!r}")
    if objective not in modes:
        raise ValueError(f"objective must be 'graph_us' or 'eager_us', got {objective!r}")
    by_bin: dict[str, dict[Choice, list]] = {}
    seen = set()
    for s in steps:
        if (s["step_key"], s["choice"]) in seen:   # a repeat would count one step twice
            raise ValueError(f"steps hold step_key={s['step_key']!r} twice for {s['choice']}")
        seen.add((s["step_key"], s["choice"]))
        ok = s["status"] == "ok"
        by_bin.setdefault(s["bin"], {}).setdefault(s["choice"], []).append(
            {m: s.get(m, float("inf")) if ok else float("inf") for m in modes})
    table, counts = {}, {}
    for bin_key, per_choice in sorted(by_bin.items()):
        n = max(len(v) for v in per_choice.values())
        totals = {c: {m: sum(x[m] for x in v) for m in modes}
                  for c, v in per_choice.items() if len(v) == n}
        finite = [c for c in totals if totals[c][objective] < float("inf")]
        if not finite:
            continue
        winner = min(finite, key=lambda c: (totals[c][objective], str(c)))
        default = fallback_choice()
        if default in finite and (n < min_bin_steps or totals[default][objective]
                                  <= totals[winner][objective] * (1 + tie_tolerance)):
            winner = default
        table[bin_key] = winner
        counts[bin_key] = {"steps": n, "best": str(winner),
                           "median_us": statistics.median(x[objective] for x in per_choice[winner])}
    return Policy(gpu=gpu, table=table, shape=shape, page_size=page_size,
                  fit={**(info or {}), "objective": objective, "tie_tolerance": tie_tolerance,
                       "min_bin_steps": min_bin_steps, "bins": counts})
