"""How a decode step is cut into tasks: the schedules, the split rule's parameters, and the bounds
that size the planner's buffers. Pure Python; the rule itself runs once, on the device
(kernels/plan.py), in every mode.

A task is one (row, KV head, split) of a row's tokens. Schedules:
    grouped - one split per row (no partials, no merge);
    split   - splits of `split_pages` pages, or of the size the default rule picks.
Every schedule runs the same way: the planner lists the non-empty tasks, longest first, and a
persistent grid of about programs_per_sm x SMs programs claims them (kernels/decode.py).

The default split rule: the step's tokens shared out as about config.waves x SMs tasks, each at
least config.min_split_tokens. When rows x KV heads already fill the SMs and no row is longer than
WHOLE_ROW_SLACK x that balanced split, whole rows (splitting would only add partial writes and
merges); a long row in a large batch is still cut. With config.one_round the split grows (by at
most ONE_ROUND_SLACK, in at most ONE_ROUND_STEPS steps) until the tasks fit in the target: each
row's last, partial split would otherwise overflow it (B4 x 128K: 8 splits of 16K per row, 32
tasks per KV head, rather than 9 of 15.9K, 36 tasks, and a second round for 3 of them). A step
that still needs more than one round, its last one under 90% full, takes at least MIN_ROUNDS
rounds: 1.45 rounds of 18K-token tasks (B32 of 0.8K-31K rows) leave half the programs idle while
the last ones run; 4.5 rounds of 4K-token tasks do not. Last, the
split shrinks to the fewest pages that keep every row's split count, so each row's splits are
even (1024 tokens at a 144-token split: 8 splits of 128, not 7 of 144 and one of 16).
"""
from __future__ import annotations

from dataclasses import dataclass

from .tuning import KernelConfig

SCHEDULES = ("grouped", "split")
WHOLE_ROW_SLACK = 1.25   # a row up to this many times the balanced split is not cut
ONE_ROUND_SLACK = 1.25   # one_round takes a split up to this many times the balanced one
ONE_ROUND_STEPS = 8      # ... found in at most this many steps
MIN_ROUNDS = 4           # a step that needs more than one round of tasks takes at least this many
DETERMINISTIC_SPLIT_TOKENS = 512  # split size of deterministic (batch-invariant) plans


@dataclass(frozen=True)
class Choice:
    """A schedule and its split size: what plan() runs and what the policy decides per step.
    split_pages None: the default split rule (for "split"); "grouped" takes none."""

    schedule: str = "split"
    split_pages: int | None = None

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.split_pages is not None:
            if self.schedule == "grouped":
                raise ValueError(f"the grouped schedule takes no split_pages, got {self.split_pages}")
            if isinstance(self.split_pages, bool) or not isinstance(self.split_pages, int) \
                    or self.split_pages < 1:
                raise ValueError(f"split_pages must be a positive int, got {self.split_pages!r}")

    def code(self) -> int:
        """The planner's int32: -1 whole rows, 0 the default rule, n > 0 splits of n pages."""
        if self.schedule == "grouped":
            return -1
        return self.split_pages or 0

    @classmethod
    def from_code(cls, code: int) -> "Choice":
        code = int(code)
        return cls("grouped") if code < 0 else cls("split", code or None)

    def __str__(self) -> str:
        return self.schedule if self.split_pages is None else f"{self.schedule}@{self.split_pages}"


def balanced_task_count(*, num_kv_heads: int, sm_count: int, config: KernelConfig) -> int:
    """Tasks per KV head that fill the GPU config.waves times over."""
    return max(1, int(config.waves * sm_count / num_kv_heads))


def whole_row_min_rows(*, num_kv_heads: int, sm_count: int) -> int:
    """Rows from which one task per (row, KV head) alone fills the SMs."""
    return -(-sm_count // num_kv_heads)


def task_bound(code: int, *, rows: int, pages: int, target_tasks: int,
               max_row_pages: int | None = None) -> int:
    """Most tasks a step of at most `rows` rows and `pages` pages can have under a choice code
    (rows of at most max_row_pages pages, when known). The default rule's split is at least
    total / target_tasks, or, when that takes more than one round, split * count /
    (MIN_ROUNDS * target_tasks) > total / (MIN_ROUNDS * target_tasks); each row adds at most one
    task past that."""
    if code < 0:
        return rows
    if code == 0:
        return rows + MIN_ROUNDS * target_tasks
    bound = rows + -(-pages // code)
    if max_row_pages is not None:
        bound = min(bound, rows * -(-max_row_pages // code))
    return bound
