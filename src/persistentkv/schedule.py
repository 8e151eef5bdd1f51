"""How a decode step is cut into tasks: the schedules, the split rule's parameters, and the bounds
that size the planner's buffers. Pure Python; the rule itself runs once, on the device
(kernels/plan.py), in every mode.

A task is one (row, KV head, split) of a row's tokens. Schedules:
    grouped  - one split per row (no partials, no merge);
    split    - splits of `split_pages` pages, or the default rule below;
    balanced - every program the same share of the step's pages (the balanced rule below).
The planner lists the non-empty tasks (split and grouped: longest first) and a persistent grid of
programs_per_sm x SMs programs runs them: one item each, then the rest of its chunk (balanced),
or, past one round, the items it claims (kernels/decode.py).

The split rule: the step's tokens shared out as about config.waves x SMs tasks, each at least
min_split_tokens (config.min_split_tokens, more for tiles of many query rows). When rows x KV
heads already fill the SMs and no row is longer than WHOLE_ROW_SLACK x that balanced split, whole
rows (splitting would only add partial writes and merges); a long row in a large batch is still
cut. Short of the SMs the rows are cut too: whole rows from 95% of them (where no row is longer
than WHOLE_ROW_SLACK x the mean) ran 17-46% slower on the H200 (docs/perf-notes.md, v47). With
config.one_round the split grows (by at most ONE_ROUND_SLACK, in at most ONE_ROUND_STEPS steps)
until the tasks fit in the target: each row's last, partial split would otherwise overflow it (B4
x 128K: 8 splits of 16K per row, 32 tasks per KV head, rather than 9 of 15.9K, 36 tasks, and a
second round for 3 of them). Last, the
split shrinks to the fewest pages that keep every row's split count, so each row's splits are
even (1024 tokens at a 144-token split: 8 splits of 128, not 7 of 144 and one of 16).

The balanced rule: per KV head, the step's rows laid end to end, in pages, are cut into chunks of
C = max(min_split_tokens, total pages / (programs / KV heads)) pages, one chunk per program.
Where a chunk boundary falls inside a row, the row splits there; where a row ends inside a chunk,
the next row continues the chunk. So a chunk is one task or several (one per row it touches), a
program runs exactly one chunk, and no program reads more than C pages: one round, however mixed
the lengths.

The default rule (Choice("split"), and what "auto" runs where no policy applies): the split
rule's tasks when they fit in one round (config.waves x SMs) and their split is under
config.balanced_from_tokens, else balanced chunks. Where the
split rule needs more rounds, balanced chunks measured 4-14% faster (B32 of 0.4K-32K rows at one
KV head: 264 chunks of 142 pages, 83 us, against 3.8 rounds of 38-page splits, 96 us); where it
fits one round, it measured up to 10% faster than chunks, whose tasks that span two rows run one
after the other in one program (docs/perf-notes.md, v7). Where the split rule's tasks are long
(16K tokens and up: B4 x 128K, B8 x 128K, B32 x 32K at 8 KV heads), they are one round of fewer
tasks than programs (B32 x 32K: 256 whole rows on 264 programs), and chunks, one per program,
measured 0.8-2.0% faster at 32/8 and 64/8 (docs/perf-notes.md, v17). At head dims 129-256
chunks start from splits of 2560 tokens (tuning.WIDE_HEAD_BALANCED_FROM_TOKENS; v42).
"""
from __future__ import annotations

from dataclasses import dataclass

from .tuning import KernelConfig

SCHEDULES = ("grouped", "split", "balanced")
WHOLE_ROW_SLACK = 1.25   # a row up to this many times the balanced split is not cut
ONE_ROUND_SLACK = 1.25   # one_round takes a split up to this many times the balanced one
ONE_ROUND_STEPS = 8      # ... found in at most this many steps
MIN_SPLIT_TILE_ROWS = 32  # tile rows up to which a split's floor is config.min_split_tokens
DETERMINISTIC_SPLIT_TOKENS = 512  # split size of deterministic (batch-invariant) plans
MAX_SPLIT_TOKENS = 2**30  # a split's size plus a row's length stays in the kernels' int32
GROUPED_CODE, BALANCED_CODE = -1, -2   # Choice.code of the schedules without a split size


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
            if self.schedule != "split":
                raise ValueError(f"the {self.schedule} schedule takes no split_pages, "
                                 f"got {self.split_pages}")
            if isinstance(self.split_pages, bool) or not isinstance(self.split_pages, int) \
                    or self.split_pages < 1:
                raise ValueError(f"split_pages must be a positive int, got {self.split_pages!r}")

    def code(self) -> int:
        """The planner's int32: -2 balanced chunks, -1 whole rows, 0 the default split rule,
        n > 0 splits of n pages."""
        if self.schedule != "split":
            return BALANCED_CODE if self.schedule == "balanced" else GROUPED_CODE
        return self.split_pages or 0

    @classmethod
    def from_code(cls, code: int) -> "Choice":
        code = int(code)
        if code < 0:
            return cls("balanced" if code == BALANCED_CODE else "grouped")
        return cls("split", code or None)

    def __str__(self) -> str:
        return self.schedule if self.split_pages is None else f"{self.schedule}@{self.split_pages}"


def min_split_tokens(config: KernelConfig, *, tile_rows: int) -> int:
    """The smallest split of a task whose tile holds tile_rows rows (query tokens x group):
    config.min_split_tokens up to MIN_SPLIT_TILE_ROWS rows, times tile_rows // MIN_SPLIT_TILE_ROWS
    past them. A task's partial is tile_rows x head_dim values to write, read and merge (fp32
    then; the output's dtype since v26, not re-measured for this rule); at 16
    queries a row x group 4 (64 rows), splits of at least 256 tokens measured 8-14% faster on
    B1 L1K, B4 L1K and B4 zipf than 128, and the same (within 0.3%) on the other cells; at 16
    and 32 rows 256 lost 3-11% on B1 L1K and B4 L1K (docs/perf-notes.md, v22)."""
    return config.min_split_tokens * max(1, tile_rows // MIN_SPLIT_TILE_ROWS)


def split_task_target(*, num_kv_heads: int, sm_count: int, config: KernelConfig) -> int:
    """Tasks per KV head that fill the GPU config.waves times over."""
    return max(1, int(config.waves * sm_count / num_kv_heads))


def whole_row_min_rows(*, num_kv_heads: int, sm_count: int) -> int:
    """Rows from which one task per (row, KV head) alone fills the SMs."""
    return -(-sm_count // num_kv_heads)


def chunks_per_head(*, programs: int, num_kv_heads: int) -> int:
    """Chunks of a balanced plan per KV head: one per program."""
    return max(1, programs // num_kv_heads)


def task_bound(code: int, *, rows: int, pages: int, target_tasks: int, chunks: int,
               max_row_pages: int | None = None) -> int:
    """Most tasks a step of at most `rows` rows and `pages` pages can have under a choice code
    (rows of at most max_row_pages pages, when known). A balanced plan has at most `chunks`
    chunks, and each row but the first that starts inside one adds a task; the default rule is
    the split rule's at most target_tasks tasks, or a balanced plan."""
    if code == BALANCED_CODE:
        return rows + chunks
    if code < 0:
        return rows
    if code == 0:
        return rows + max(target_tasks, chunks)
    bound = rows + -(-pages // code)
    if max_row_pages is not None:
        bound = min(bound, rows * -(-max_row_pages // code))
    return bound


def partial_bound(code: int, *, rows: int, pages: int, target_tasks: int, chunks: int,
                  max_row_pages: int | None = None) -> int:
    """Most tasks with a partial (the tasks of rows cut in two or more) a step of at most `rows`
    rows and `pages` pages can have under a choice code, rows of at most max_row_pages pages
    when known: the slots of partial outputs the planner must reserve. A row cut in s >= 2 tasks
    has s <= 2 (s - 1) of them, so a plan with at most E tasks beyond one per row has at most 2E:
    a balanced plan's rows add at most `chunks` tasks, splits of n pages at most pages / n, and
    the default rule's split tasks are at most target_tasks in all (else it plans balanced)."""
    if code == BALANCED_CODE:
        return 2 * chunks
    if code < 0:
        return 0
    if code == 0:
        return max(target_tasks, 2 * chunks)
    bound = 2 * -(-pages // code)
    if max_row_pages is not None:
        per_row = -(-max_row_pages // code)
        bound = 0 if per_row < 2 else min(bound, rows * per_row)
    return bound
