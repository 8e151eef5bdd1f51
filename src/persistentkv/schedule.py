"""Work assignment for one decode step: pure numpy, on the host, once per step.

Every schedule cuts each row into splits of `split_pages` pages and runs one program per
(row, KV head, split); they differ in how programs are laid out:
    grouped   - one split per row; grid (B, Hkv, 1); no merge.
    split     - grid (B, Hkv, max splits); empty splits of short rows exit at once.
    workqueue - a compact list of the non-empty (row, split) tasks, longest first, walked by a
                persistent grid of about programs_per_sm x SMs programs.
Rows of several splits are merged inside the same launch by their last task to finish.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .tuning import KernelConfig

BACKENDS = ("grouped", "split", "workqueue")
MAX_GRID_SPLITS = 65535  # CUDA's limit on the grid's third dimension


@dataclass(frozen=True)
class Schedule:
    """What the launcher needs. meta: int32 [3, B] = (seq_len, page start, slot start or -1);
    tasks: int32 [2, T] = (row, split) for the work-queue, else empty."""

    backend: str
    split_pages: int
    split_tokens: int
    meta: np.ndarray
    tasks: np.ndarray
    num_slots: int
    grid: tuple[int, ...]


WHOLE_ROW_SLACK = 1.25  # a row up to this many times the balanced split is not cut
ONE_ROUND_SLACK = 1.25  # one_round takes a split up to this many times the balanced one
ONE_ROUND_STEPS = 8     # ... found in at most this many steps


def balanced_task_count(*, num_kv_heads: int, sm_count: int, config: KernelConfig) -> int:
    """Tasks per KV head that fill the GPU config.waves times over."""
    return max(1, int(config.waves * sm_count / num_kv_heads))


def whole_row_min_rows(*, num_kv_heads: int, sm_count: int) -> int:
    """Rows from which one task per (row, KV head) alone fills the SMs."""
    return -(-sm_count // num_kv_heads)


def default_split_pages(seq_lens: np.ndarray, *, page_size: int, num_kv_heads: int,
                        sm_count: int, config: KernelConfig) -> int:
    """Pages per split: the step's tokens shared out as about config.waves x SMs tasks (each at
    least config.min_split_tokens). When rows x KV heads already fill the SMs and no row is much
    longer than that balanced split, whole rows (splitting would only add partial writes and
    merges); a long row in a large batch is still cut, or its task would run long after the rest.
    With config.one_round, the split grows (by at most ONE_ROUND_SLACK) until the tasks fit in the
    target: each row's last, partial split would otherwise overflow it (B4 x 128K: 8 splits of
    16K per row, 32 tasks per KV head, rather than 9 splits of 15.9K, 36 tasks, and a second round
    for 3 of them). Then the split shrinks to the fewest pages that keep every row's split count,
    so each row's splits are even (1024 tokens at a 144-token split: 8 splits of 128, not 7 of 144
    and one of 16). The GPU planner of graph mode applies the same rule on the device
    (kernels/plan.py)."""
    if not len(seq_lens):
        return 1
    max_len = int(seq_lens.max())
    target_tasks = balanced_task_count(num_kv_heads=num_kv_heads, sm_count=sm_count, config=config)
    split_tokens = max(config.min_split_tokens, -(-int(seq_lens.sum()) // target_tasks))
    if (len(seq_lens) >= whole_row_min_rows(num_kv_heads=num_kv_heads, sm_count=sm_count)
            and max_len <= WHOLE_ROW_SLACK * split_tokens):
        split_tokens = max_len
    split_tokens = max(1, -(-split_tokens // page_size)) * page_size
    if config.one_round:
        split_tokens = _one_round_split(seq_lens, split_tokens, target_tasks, page_size)
    splits = -(-seq_lens // split_tokens)
    even_tokens = int((-(-seq_lens // splits)).max())
    return max(1, -(-even_tokens // page_size))


def _one_round_split(seq_lens: np.ndarray, split_tokens: int, target_tasks: int,
                     page_size: int) -> int:
    """The smallest split (whole pages) whose tasks fit in target_tasks, if it is found within
    ONE_ROUND_STEPS steps and is at most ONE_ROUND_SLACK x split_tokens; else split_tokens.
    Each step takes the smallest split that removes a split from some row."""
    split = split_tokens
    for _ in range(ONE_ROUND_STEPS):
        splits = -(-seq_lens // split)
        if int(splits.sum()) <= target_tasks:
            break
        cut = splits > 1
        if not cut.any():
            return split_tokens
        fewer = int((-(-seq_lens[cut] // (splits[cut] - 1))).min())
        split = -(-fewer // page_size) * page_size
    fits = int((-(-seq_lens // split)).sum()) <= target_tasks
    return split if fits and split <= ONE_ROUND_SLACK * split_tokens else split_tokens


def build_schedule(seq_lens: np.ndarray, page_starts: np.ndarray, *, backend: str, page_size: int,
                   num_kv_heads: int, sm_count: int, split_pages: int | None,
                   config: KernelConfig) -> Schedule:
    """Plan one step. seq_lens, page_starts: int64 [B] (all seq_lens >= 1)."""
    batch = len(seq_lens)
    max_len = int(seq_lens.max()) if batch else 0
    if backend == "grouped":
        split_pages = max(1, -(-max_len // page_size))
    elif split_pages is None:
        split_pages = default_split_pages(seq_lens, page_size=page_size, num_kv_heads=num_kv_heads,
                                          sm_count=sm_count, config=config)
    split_tokens = split_pages * page_size
    num_splits = -(-seq_lens // split_tokens)                                         # [B]
    multi = num_splits > 1
    slot_start = np.full(batch, -1, dtype=np.int64)
    slot_start[multi] = np.cumsum(num_splits[multi]) - num_splits[multi]
    num_slots = int(num_splits[multi].sum())
    meta = np.stack([seq_lens, page_starts, slot_start]).astype(np.int32)

    tasks = np.zeros((2, 0), dtype=np.int32)
    max_splits = int(num_splits.max()) if batch else 0
    if backend == "workqueue":
        rows = np.repeat(np.arange(batch, dtype=np.int64), num_splits)
        first = np.cumsum(num_splits) - num_splits
        splits = np.arange(len(rows), dtype=np.int64) - np.repeat(first, num_splits)
        tokens = np.minimum(seq_lens[rows] - splits * split_tokens, split_tokens)
        order = np.argsort(-tokens, kind="stable")                    # longest tasks first
        tasks = np.stack([rows[order], splits[order]]).astype(np.int32)
        programs = min(tasks.shape[1] * num_kv_heads, config.programs_per_sm * sm_count)
        grid: tuple[int, ...] = (max(programs, 1),)
    else:
        if max_splits > MAX_GRID_SPLITS:
            raise ValueError(f"split_pages={split_pages} cuts the longest row ({max_len} tokens) into "
                             f"{max_splits} splits, over the grid's {MAX_GRID_SPLITS}; use larger "
                             f"splits or backend='workqueue'")
        grid = (batch, num_kv_heads, max(max_splits, 1))
    return Schedule(backend=backend, split_pages=split_pages, split_tokens=split_tokens, meta=meta,
                    tasks=tasks, num_slots=num_slots, grid=grid)
