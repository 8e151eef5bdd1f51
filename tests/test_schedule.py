"""The host-side work assignment: split sizes, task lists, partial slots (pure numpy)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persistentkv.schedule import (ONE_ROUND_SLACK, WHOLE_ROW_SLACK, build_schedule,
                                  default_split_pages)
from persistentkv.tuning import KernelConfig

CFG = KernelConfig()


def schedule(lens, backend="workqueue", split_pages=None, sm_count=132, kv_heads=8, page=16):
    lens = np.asarray(lens, dtype=np.int64)
    starts = np.cumsum(-(-lens // page)) - -(-lens // page)
    return build_schedule(lens, starts, backend=backend, page_size=page, num_kv_heads=kv_heads,
                          sm_count=sm_count, split_pages=split_pages, config=CFG)


def test_whole_rows_when_rows_fill_the_sms():
    lens = np.full(32, 8192)
    assert default_split_pages(lens, page_size=16, num_kv_heads=8, sm_count=132, config=CFG) == 512


def test_a_long_row_in_a_large_batch_is_still_cut():
    """B128 with one 32K row among 1K rows: whole rows would leave that row's task running alone."""
    lens = np.array([32768] + [1024] * 127)
    pages = default_split_pages(lens, page_size=16, num_kv_heads=8, sm_count=132, config=CFG)
    balanced = lens.sum() / int(CFG.waves * 132 / 8)
    assert pages * 16 < 32768 and -(-32768 // (pages * 16)) <= -(-32768 // balanced)
    assert pages * 16 >= 1024          # the short rows stay whole


def test_small_batches_split_to_about_waves_per_sm():
    pages = default_split_pages(np.array([32768]), page_size=16, num_kv_heads=8, sm_count=132,
                                config=CFG)
    tasks = -(-32768 // (pages * 16)) * 8
    assert 0.75 * CFG.waves * 132 <= tasks <= CFG.waves * 132
    # never more splits than the minimum split gives, and even ones: 300 tokens in 3 x 112
    assert default_split_pages(np.array([300]), page_size=16, num_kv_heads=8, sm_count=132,
                               config=CFG) == 7


def test_even_splits_keep_the_task_count():
    """B4 x 1K: the balanced share (4096 / 33 tasks, at least 128 tokens) gives 8 splits per row;
    B4 x 128K with one_round: 8 splits of 16K per row, not 7 of 18K and a short one."""
    assert default_split_pages(np.full(4, 1024), page_size=16, num_kv_heads=8, sm_count=132,
                               config=KernelConfig(one_round=False)) == 8
    assert default_split_pages(np.full(4, 131072), page_size=16, num_kv_heads=8, sm_count=132,
                               config=KernelConfig(one_round=True)) == 1024


def test_workqueue_lists_only_nonempty_tasks_longest_first():
    s = schedule([1000, 10, 300], split_pages=8)                    # 128-token splits
    rows, splits = s.tasks
    assert len(rows) == 8 + 1 + 3
    tokens = np.minimum(np.array([1000, 10, 300])[rows] - splits * 128, 128)
    assert (tokens > 0).all() and (np.diff(tokens) <= 0).all()
    assert s.grid == (min(12 * 8, CFG.programs_per_sm * 132),)


def test_partial_slots_only_for_split_rows():
    s = schedule([1000, 10, 300], backend="split", split_pages=8)
    seq_len, _, slot_start = s.meta
    assert slot_start.tolist() == [0, -1, 8] and s.num_slots == 8 + 3
    assert s.grid == (3, 8, 8) and seq_len.tolist() == [1000, 10, 300]


def test_grouped_is_one_split_per_row():
    s = schedule([1000, 10, 300], backend="grouped")
    assert s.meta[2].tolist() == [-1, -1, -1] and s.num_slots == 0 and s.grid == (3, 8, 1)


def test_too_many_splits_for_the_grid():
    with pytest.raises(ValueError, match="65535"):
        schedule([1 << 20], backend="split", split_pages=1, page=1)


@settings(max_examples=300, deadline=None)
@given(lens=st.lists(st.integers(1, 200_000), min_size=1, max_size=300),
       kv_heads=st.sampled_from([1, 2, 8, 32]), page=st.sampled_from([1, 16, 64]),
       sms=st.sampled_from([4, 132]))
def test_split_rule_properties(lens, kv_heads, page, sms):
    """The default split is whole pages, never cuts a row into more splits than the balanced share
    of the step does (tokens / (waves x SMs / KV heads), at least min_split_tokens), and no task is
    much longer than that share: no row runs on alone."""
    lens = np.asarray(lens, dtype=np.int64)
    pages = default_split_pages(lens, page_size=page, num_kv_heads=kv_heads, sm_count=sms, config=CFG)
    split = pages * page
    longest = int(lens.max())
    balanced = max(CFG.min_split_tokens,
                   -(-int(lens.sum()) // max(1, int(CFG.waves * sms / kv_heads))))
    assert pages >= 1
    balanced_pages = -(-balanced // page)
    assert (-(-lens // split)).sum() <= (-(-lens // (balanced_pages * page))).sum()
    assert min(split, longest) <= WHOLE_ROW_SLACK * balanced + page


@pytest.mark.parametrize("lens", [[131072] * 4, [131072] * 8, [40000, 9000, 120000], [5000] * 12,
                                  [100000] + [1000] * 29])
def test_one_round_fits_the_target_when_the_split_grows_little(lens):
    """The balanced split overflows waves x SMs by up to one task per row (each row's last split
    rounds up); one_round grows the split to fit, by at most ONE_ROUND_SLACK: uniform long rows
    fit, a long row among many short ones keeps the balanced split (fitting would cut it in 4)."""
    lens = np.array(lens)
    target = int(CFG.waves * 132 / 8)
    pages = default_split_pages(lens, page_size=16, num_kv_heads=8, sm_count=132,
                                config=KernelConfig(one_round=True))
    balanced = default_split_pages(lens, page_size=16, num_kv_heads=8, sm_count=132,
                                   config=KernelConfig(one_round=False))
    tasks = int((-(-lens // (pages * 16))).sum())
    assert balanced <= pages <= ONE_ROUND_SLACK * balanced + 1
    if len(lens) <= 12:
        assert tasks <= target < int((-(-lens // (balanced * 16))).sum()) or pages == balanced
    if lens.tolist() in ([131072] * 4, [131072] * 8):
        assert tasks <= target and pages > balanced
    if len(lens) == 30:
        assert pages == balanced and tasks > target
