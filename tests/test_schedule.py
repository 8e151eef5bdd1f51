"""The planner's output (kernels/plan.py, on the device in every mode), read through the public
plan objects: plan.info() and plan.task_records().

Split sizes are checked against the rule schedule.py documents, written again here as a small
numpy oracle (`documented_split`) that shares no code with the kernel; the task list against what
a schedule means: every token of every active row in exactly one task, whole-page split
boundaries, the run order, and partial slots.
"""
import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_case import DEVICE
from persistentkv import DecodeWrapper, PageTable
from persistentkv.runtime import sm_count
from persistentkv.schedule import (ONE_ROUND_SLACK, ONE_ROUND_STEPS, WHOLE_ROW_SLACK, Choice,
                                   chunks_per_head, min_split_tokens)
from persistentkv.tuning import SMALL_STEP_KV_BYTES_PER_SM, KernelConfig, default_config

SMS = sm_count(DEVICE)   # 4 on the interpreter (runtime.CPU_SM_COUNT), the GPU's SMs on a GPU
CFG = KernelConfig()


def cdiv(a, b):
    return -(-a // b)


def documented_split(lens, *, page_size: int, num_kv_heads: int, config: KernelConfig,
                     sms: int = SMS) -> int:
    """schedule.py's split rule, in tokens, for the active rows of `lens`."""
    lens = np.asarray(lens, dtype=np.int64)
    lens = lens[lens > 0]
    target = max(1, int(config.waves * sms / num_kv_heads))     # tasks per KV head
    split = max(config.min_split_tokens, cdiv(int(lens.sum()), target))
    # rows x KV heads fill the SMs and no row is much longer than the balanced split: whole rows
    if len(lens) * num_kv_heads >= sms and lens.max() <= WHOLE_ROW_SLACK * split:
        split = int(lens.max())
    split = max(1, cdiv(split, page_size)) * page_size
    if config.one_round:
        # the smallest whole-page split, up to ONE_ROUND_SLACK x the balanced one, whose tasks fit
        # in the target; each growth step removes a split from some row, at most ONE_ROUND_STEPS
        balanced = split
        candidates = np.arange(balanced, math.floor(ONE_ROUND_SLACK * balanced) + 1, page_size)
        counts = cdiv(lens[None, :], candidates[:, None]).sum(axis=1)
        fit = np.flatnonzero(counts <= target)
        if len(fit) and len(np.unique(counts[: fit[0] + 1])) - 1 <= ONE_ROUND_STEPS:
            split = int(candidates[fit[0]])
    # even splits: the fewest pages that keep every row's split count
    even = int(cdiv(lens, cdiv(lens, split)).max())
    return max(1, cdiv(even, page_size)) * page_size


def documented_plan(lens, *, page_size: int, num_kv_heads: int, config: KernelConfig,
                    sms: int = SMS) -> tuple[Choice, int]:
    """schedule.py's default rule: (Choice("split"), split tokens) when the split rule's tasks
    fit in one round and their split is under balanced_from_tokens (0: any split), else
    (Choice("balanced"), chunk tokens)."""
    split = documented_split(lens, page_size=page_size, num_kv_heads=num_kv_heads, config=config,
                             sms=sms)
    target = max(1, int(config.waves * sms / num_kv_heads))
    short = not config.balanced_from_tokens or split < config.balanced_from_tokens
    if sum(cdiv(int(n), split) for n in lens if n > 0) <= target and short:
        return Choice("split"), split
    return Choice("balanced"), page_size * documented_chunk_pages(
        lens, page_size=page_size, num_kv_heads=num_kv_heads, config=config, sms=sms)


def table_for(lens, page_size: int, seed: int = 0) -> PageTable:
    """Each row's pages drawn at random, without repeats, from a pool with a few spare pages."""
    rng = np.random.default_rng(seed)
    pages = [cdiv(int(n), page_size) for n in lens]
    perm = rng.permutation(sum(pages) + 3)
    starts = np.cumsum([0] + pages)
    return PageTable(row_pages=tuple(perm[a:b].astype(np.int64) for a, b in zip(starts, starts[1:])),
                     seq_lens=np.asarray(lens, dtype=np.int64), page_size=page_size)


def plan_for(lens, *, form="csr", num_kv_heads=2, page_size=16, seed=0, **options):
    """(plan, page start of each row) for a step of these lengths; plan() only, nothing runs."""
    table = table_for(lens, page_size, seed)
    if form == "csr":
        indptr, indices, last = table.csr(DEVICE)
        kwargs = dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last)
        starts = indptr[:-1].cpu().numpy()
    else:
        block, seq_lens = table.block_table(DEVICE, pad_to=max([len(p) for p in table.row_pages],
                                                                 default=0) + 2)
        kwargs = dict(block_table=block, seq_lens=seq_lens)
        starts = np.arange(len(lens)) * block.stride(0)
    plan = DecodeWrapper("NHD").plan(**kwargs, num_qo_heads=num_kv_heads, num_kv_heads=num_kv_heads,
                                     head_dim=16, page_size=page_size, **options)
    return plan, starts


def check_tasks(plan, lens, starts, page_size):
    """What every plan must hold: each active row's tokens in exactly one task each, cut at whole
    pages into splits of split_tokens; the run order; partial slots (check_slots)."""
    info, rec = plan.info(), plan.task_records()
    if info["choice"] == Choice("balanced"):
        return check_balanced(plan, lens, starts, page_size)
    lens = np.asarray(lens, dtype=np.int64)
    split = info["split_tokens"]
    assert info["tasks_over_capacity"] == 0 and info["num_chunks"] == 0
    assert rec.shape == (info["num_tasks"], 8)
    assert split >= page_size and split % page_size == 0
    row, part, lo, hi, page_start, slot_start, num_splits, nxt = rec.T
    assert (nxt == -1).all()
    # coverage: row r is tasks j = 0 .. cdiv(len, split) - 1 of [j * split, min((j+1) * split, len))
    for r, n in enumerate(lens):
        mine = np.flatnonzero(row == r)
        want = cdiv(int(n), split)
        assert len(mine) == want, (r, n, split)
        if not want:
            continue
        by_split = mine[np.argsort(part[mine])]
        assert part[by_split].tolist() == list(range(want))
        assert lo[by_split].tolist() == [j * split for j in range(want)]
        assert hi[by_split].tolist() == [min((j + 1) * split, int(n)) for j in range(want)]
        assert (num_splits[mine] == want).all() and (page_start[mine] == starts[r]).all()
    assert (lo % page_size == 0).all() and (hi > lo).all()
    # order: every non-last split in row order, then the rows' last splits, longest first
    is_last = part == num_splits - 1
    k = int((~is_last).sum())
    assert not is_last[:k].any() and is_last[k:].all()
    assert sorted(zip(row[:k], part[:k])) == list(zip(row[:k], part[:k]))
    tail = list(zip(-(hi[k:] - lo[k:]), row[k:]))
    assert tail == sorted(tail)
    check_slots(plan, part, slot_start, num_splits)
    return info, rec


def check_slots(plan, part, slot_start, num_splits):
    """Partial slots: none for a one-task row; for the others 0, 1, ... in row order, each once,
    and no more than the workspace holds for the plan's shape."""
    assert ((slot_start == -1) == (num_splits == 1)).all()
    multi = num_splits > 1
    slots = (slot_start + part)[multi]
    assert sorted(slots.tolist()) == list(range(len(slots)))
    q_pad = 1 if plan.queries is None else plan.queries.max_per_row
    assert len(slots) <= plan.workspace.partial_capacity(
        partial_heads=plan.num_qo_heads * q_pad, head_dim=plan.head_dim,
        kv_heads=plan.num_kv_heads)


def documented_chunk_pages(lens, *, page_size: int, num_kv_heads: int, config: KernelConfig,
                           sms: int = SMS) -> int:
    """schedule.py's balanced rule: the chunk size in pages."""
    pages = sum(cdiv(int(n), page_size) for n in lens)
    chunks = max(1, config.programs_per_sm * sms // num_kv_heads)
    return max(cdiv(max(config.min_split_tokens, 1), page_size), cdiv(pages, chunks))


def check_balanced(plan, lens, starts, page_size):
    """A balanced plan: the rows' pages end to end, cut into chunks of split_tokens; record c
    starts chunk c and the `next` links walk each chunk's tasks in stream order; every token of
    every row in exactly one task; partial slots as in check_tasks."""
    info, rec = plan.info(), plan.task_records()
    assert info["tasks_over_capacity"] == 0
    lens = np.asarray(lens, dtype=np.int64)
    pages = cdiv(lens, page_size)
    total = int(pages.sum())
    chunk = info["split_tokens"] // page_size
    assert info["split_tokens"] % page_size == 0 and chunk >= 1
    assert info["num_chunks"] == cdiv(total, chunk)
    assert rec.shape == (info["num_tasks"], 8)
    row, part, lo, hi, page_start, slot_start, num_splits, nxt = rec.T
    offset = np.concatenate([[0], np.cumsum(pages)])[:-1]
    seen = []
    for c in range(info["num_chunks"]):           # chunk c covers stream pages [c*C, (c+1)*C)
        at, stream = c, c * chunk
        while at >= 0:
            seen.append(at)
            r = row[at]
            assert offset[r] + lo[at] // page_size == stream, (c, at)
            stream = offset[r] + cdiv(hi[at], page_size)
            at = nxt[at]
        assert stream == min((c + 1) * chunk, total), c
    assert sorted(seen) == list(range(len(rec)))  # every task in exactly one chunk
    for r, n in enumerate(lens):
        mine = np.flatnonzero(row == r)
        if not n:
            assert len(mine) == 0
            continue
        mine = mine[np.argsort(part[mine])]
        assert part[mine].tolist() == list(range(len(mine)))
        assert lo[mine][0] == 0 and hi[mine][-1] == n and (lo[mine][1:] == hi[mine][:-1]).all()
        assert (num_splits[mine] == len(mine)).all() and (page_start[mine] == starts[r]).all()
    assert (lo % page_size == 0).all() and (hi > lo).all()
    check_slots(plan, part, slot_start, num_splits)
    return info, rec


def test_whole_rows_when_rows_fill_the_sms():
    """SMS rows x 2 KV heads fill the SMs twice: one task per row, no partials. A row alone is
    cut into about waves x SMs tasks."""
    lens = [1000, 900, 1100, 800] * cdiv(SMS, 4)
    plan, starts = plan_for(lens)
    info, rec = check_tasks(plan, lens, starts, 16)
    assert info["num_tasks"] == len(lens) and (rec[:, 5] == -1).all()
    assert info["split_tokens"] == 1104 == documented_split(lens, page_size=16, num_kv_heads=2,
                                                            config=CFG)
    alone, starts = plan_for([1000])
    info, _ = check_tasks(alone, [1000], starts, 16)
    assert info["num_tasks"] > 1


def test_a_long_row_in_a_large_batch_is_balanced():
    """One 32K row among 1K rows: the split rule's tasks take more than one round, so the default
    rule plans balanced chunks, and the long row is cut among them."""
    lens = [32768] + [1024] * (2 * SMS - 1)
    plan, starts = plan_for(lens)
    info, rec = check_tasks(plan, lens, starts, 16)
    assert (info["choice"], info["split_tokens"]) == documented_plan(lens, page_size=16,
                                                                     num_kv_heads=2, config=CFG)
    assert info["choice"] == Choice("balanced") and rec[rec[:, 0] == 0, 6][0] > 1


def test_small_batches_split_to_about_waves_per_sm():
    plan, starts = plan_for([32768])
    info, _ = check_tasks(plan, [32768], starts, 16)
    items = info["num_tasks"] * 2                                       # x KV heads
    assert 0.75 * CFG.waves * SMS <= items <= CFG.waves * SMS
    # never a split under min_split_tokens, and even ones: 300 tokens in 3 x 112 (7 pages)
    plan, starts = plan_for([300])
    info, rec = check_tasks(plan, [300], starts, 16)
    assert info["split_tokens"] == 112 and rec[:, 3].tolist() == [112, 224, 300]


@pytest.mark.parametrize("q_len, split", [(1, 112), (8, 112), (16, 160)])
def test_tiles_of_many_query_rows_split_less(q_len, split):
    """A task's smallest split grows with its program's rows (query tokens x group) past
    MIN_SPLIT_TILE_ROWS: at group 4, 16 queries a row in one tile (64 rows) split at least 256
    tokens, so a 300-token row is 2 even splits of 160; 8 queries (32 rows) keep 128: 3 splits
    of 112. (Whole tiles: small steps may cut theirs, and then the floor is a block's.)"""
    table = table_for([300], 16)
    indptr, indices, last = table.csr(DEVICE)
    qo_indptr = torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE)
    heads = dict(num_qo_heads=8, num_kv_heads=2, head_dim=16, page_size=16)
    whole = dataclasses.replace(default_config(head_dim=16, num_kv_heads=2),
                                small_step_kv_bytes_per_sm=0)
    plan = DecodeWrapper("NHD").plan(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last,
                                     **heads, qo_indptr=None if q_len == 1 else qo_indptr,
                                     config=whole)
    info, rec = check_tasks(plan, [300], indptr[:-1].cpu().numpy(), 16)
    assert info["split_tokens"] == split and len(rec) == cdiv(300, split)
    assert min_split_tokens(CFG, tile_rows=q_len * 4) == (256 if q_len == 16 else 128)
    small = dataclasses.replace(whole, small_step_kv_bytes_per_sm=SMALL_STEP_KV_BYTES_PER_SM)
    cut = DecodeWrapper("NHD").plan(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last,
                                    **heads, qo_indptr=None if q_len == 1 else qo_indptr,
                                    config=small).config
    rows = cut.block_rows(tile_rows=q_len * 4)
    assert rows == {1: 4, 8: 16, 16: 32}[q_len] and min_split_tokens(cut, tile_rows=rows) == 128


PPS_33 = 33 * 8 // SMS   # programs per SM that give 33 chunks per KV head at 8 KV heads


def test_even_splits_keep_the_task_count():
    """33 tasks per KV head (as 8 KV heads on 132 SMs): B4 x 1K is 8 splits of 128 per row;
    B4 x 128K with one_round is 8 splits of 16K per row (32 tasks), not 9 of 15.9K (36, a second
    round of 3); without one_round those 36 tasks would take two rounds, so the default rule
    plans 33 balanced chunks of 993 pages instead (and 3 rows that start inside a chunk: 36
    tasks, one round). The split rule's 16K split is long: with balanced_from_tokens at 16K
    (the default) the default rule plans those chunks too; at 0 it keeps the splits."""
    waves = 33 * 8 / SMS
    for lens, one_round, long_from, choice, split, tasks in (
            ([1024] * 4, False, 16384, Choice("split"), 128, 32),
            ([131072] * 4, True, 0, Choice("split"), 16384, 32),
            ([131072] * 4, True, 16384, Choice("balanced"), 993 * 16, 36),
            ([131072] * 4, True, 16400, Choice("split"), 16384, 32),
            ([131072] * 4, False, 0, Choice("balanced"), 993 * 16, 36)):
        config = KernelConfig(waves=waves, one_round=one_round, programs_per_sm=PPS_33,
                              balanced_from_tokens=long_from)
        plan, starts = plan_for(lens, num_kv_heads=8, config=config)
        info, _ = check_tasks(plan, lens, starts, 16)
        assert (info["choice"], info["split_tokens"], info["num_tasks"]) == (choice, split, tasks)
        assert (choice, split) == documented_plan(lens, page_size=16, num_kv_heads=8,
                                                  config=config)


@pytest.mark.parametrize("lens", [[131072] * 4, [40000, 9000, 120000], [5000] * 12,
                                  [100000] + [1000] * 29])
def test_one_round_fits_the_target_when_the_split_grows_little(lens):
    """one_round grows the balanced split to fit the target, by at most ONE_ROUND_SLACK: uniform
    long rows fit; a long row among many short ones does not, and is planned in balanced
    chunks (balanced_from_tokens off: the split rule alone)."""
    waves = 33 * 8 / SMS
    plans = {}
    for one_round in (False, True):
        config = KernelConfig(waves=waves, one_round=one_round, programs_per_sm=PPS_33,
                              balanced_from_tokens=0)
        plan, starts = plan_for(lens, num_kv_heads=8, config=config)
        info, _ = check_tasks(plan, lens, starts, 16)
        plans[one_round] = info["choice"], info["split_tokens"], info["num_tasks"]
        assert plans[one_round][:2] == documented_plan(lens, page_size=16, num_kv_heads=8,
                                                       config=config)
    if lens == [131072] * 4:
        assert plans[True][0] == Choice("split") and plans[True][2] <= 33
        assert plans[False][0] == Choice("balanced")
    if len(lens) == 30:
        assert plans[True] == plans[False] and plans[True][0] == Choice("balanced")


@pytest.mark.parametrize("backend, split_pages, code", [("grouped", None, -1), ("split", None, 0),
                                                         ("split", 3, 3), ("auto", None, 0),
                                                         ("balanced", None, -2)])
def test_choice_codes(backend, split_pages, code):
    """The plan reports the choice it ran (auto on a GPU without a fitted policy, or on the
    interpreter: the default split rule); a grouped plan is one task per row."""
    assert Choice.from_code(code).code() == code
    lens = [300, 0, 70]
    plan, starts = plan_for(lens, backend=backend, split_pages=split_pages)
    info, rec = check_tasks(plan, lens, starts, 16)
    if backend != "auto" or not torch.cuda.is_available():
        assert info["choice"] == Choice.from_code(code)
    if code == -1:
        assert info["split_tokens"] == 304 and info["num_tasks"] == 2
    elif code == 3:
        assert info["split_tokens"] == 48 and info["num_tasks"] == 7 + 2
    elif backend == "split":
        assert info["split_tokens"] == documented_split(lens, page_size=16, num_kv_heads=2,
                                                        config=CFG)
    elif code == -2:
        assert info["split_tokens"] == 16 * documented_chunk_pages(lens, page_size=16,
                                                                   num_kv_heads=2, config=CFG)


def test_choice_values():
    assert [Choice("grouped").code(), Choice("split").code(), Choice("split", 8).code(),
            Choice("balanced").code()] == [-1, 0, 8, -2]
    assert [str(Choice.from_code(c)) for c in (-1, 0, 8, -2)] == ["grouped", "split", "split@8",
                                                                  "balanced"]
    for bad in (dict(schedule="workqueue"), dict(schedule="grouped", split_pages=2),
                dict(schedule="balanced", split_pages=2),
                dict(split_pages=0), dict(split_pages=True), dict(split_pages=2.0)):
        with pytest.raises(ValueError):
            Choice(**bad)


def test_deterministic_plans_fixed_splits():
    plan, starts = plan_for([1200, 5, 700], deterministic=True)
    info, _ = check_tasks(plan, [1200, 5, 700], starts, 16)
    assert info["choice"] == Choice("split", 32) and info["split_tokens"] == 512


def test_a_table_whose_tasks_overflow_the_buffer_plans_none():
    """An unchecked, overlapping kv_indptr (every even row reads all 64 pages) has 512 one-page
    tasks where the buffer, sized from 16 rows and 64 page entries, holds 256: the planner plans
    no task (and says how many did not fit), so run() reads and writes nothing."""
    indptr = torch.tensor([0, 64] * 8 + [0], dtype=torch.int32, device=DEVICE)
    indices = torch.randperm(64, dtype=torch.int32, device=DEVICE)
    last = torch.full((16,), 16, dtype=torch.int32, device=DEVICE)
    kwargs = dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last, num_qo_heads=2,
                  num_kv_heads=1, head_dim=16, page_size=16, backend="split", split_pages=1)
    wrapper = DecodeWrapper("NHD")
    plan = wrapper.plan(**kwargs)
    assert plan.workspace.capacity < 512
    assert plan.info()["num_tasks"] == 0 and plan.info()["tasks_over_capacity"] == 8 * 64
    assert plan.task_records().shape == (0, 8)
    q = torch.randn(16, 2, 16, dtype=torch.float16, device=DEVICE)
    cache = torch.randn(64, 2, 16, 1, 16, dtype=torch.float16, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    wrapper.run(q, cache, out=out)
    assert torch.isnan(out.float()).all()
    with pytest.raises(ValueError, match="non-decreasing"):
        wrapper.plan(**kwargs, check_page_table=True)


@st.composite
def steps(draw):
    page = draw(st.sampled_from([1, 4, 16]), label="page_size")
    lens = draw(st.lists(st.integers(0, 400) | st.just(0), min_size=1, max_size=6), label="lens")
    choice = draw(st.sampled_from(["grouped", "split", "split@n", "auto", "balanced"]),
                  label="choice")
    split_pages = draw(st.integers(1, 8), label="split_pages") if choice == "split@n" else None
    config = KernelConfig(min_split_tokens=draw(st.sampled_from([16, 128]), label="min_split"),
                          waves=draw(st.sampled_from([0.5, 2.0, 8.0]), label="waves"),
                          one_round=draw(st.booleans(), label="one_round"),
                          programs_per_sm=draw(st.sampled_from([1, 2, 3]), label="programs_per_sm"),
                          balanced_from_tokens=draw(st.sampled_from([0, 64, 16384]),
                                                    label="balanced_from_tokens"))
    return dict(lens=lens, page_size=page, backend="split" if choice == "split@n" else choice,
                split_pages=split_pages, config=config,
                num_kv_heads=draw(st.sampled_from([1, 2, 8]), label="num_kv_heads"),
                form=draw(st.sampled_from(["csr", "block"]), label="form"),
                seed=draw(st.integers(0, 2**16), label="seed"))


@settings(max_examples=30, deadline=None)
@given(s=steps())
def test_tasks_cover_every_token_once_in_order(s):
    """Random lengths (zeros among them), schedules, split sizes, configs and both table forms:
    the plan's tasks satisfy check_tasks, and its split is the one asked for or the rule's."""
    lens, page = s["lens"], s["page_size"]
    plan, starts = plan_for(lens, form=s["form"], num_kv_heads=s["num_kv_heads"], page_size=page,
                            seed=s["seed"], backend=s["backend"], split_pages=s["split_pages"],
                            config=s["config"])
    info, _ = check_tasks(plan, lens, starts, page)
    if not any(lens):
        assert info["num_tasks"] == 0
    elif s["split_pages"] is not None:
        assert info["split_tokens"] == s["split_pages"] * page
        assert info["choice"] == Choice("split", s["split_pages"])
    elif s["backend"] == "grouped":
        assert info["split_tokens"] == cdiv(max(lens), page) * page
        assert info["num_tasks"] == sum(n > 0 for n in lens)
    elif s["backend"] == "balanced":
        assert info["split_tokens"] == page * documented_chunk_pages(
            lens, page_size=page, num_kv_heads=s["num_kv_heads"], config=s["config"])
        assert info["num_chunks"] <= chunks_per_head(programs=s["config"].programs_per_sm * SMS,
                                                     num_kv_heads=s["num_kv_heads"])
    elif s["backend"] == "split" or not torch.cuda.is_available():   # auto: no policy on the CPU
        assert (info["choice"], info["split_tokens"]) == documented_plan(
            lens, page_size=page, num_kv_heads=s["num_kv_heads"], config=s["config"])
        # the even split is the fewest pages that keep every row's split count
        active = np.asarray([n for n in lens if n], dtype=np.int64)
        split = info["split_tokens"]
        assert (info["choice"] == Choice("balanced") or split == page
                or (cdiv(active, split - page) > cdiv(active, split)).any())
