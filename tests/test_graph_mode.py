"""Graph mode: planning on the GPU into static buffers, one graph for every batch composition."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_case import DEVICE, ON_GPU
from persistentkv import TOLERANCE, DecodeWrapper, PagedKVCache, reference_decode, relative_error
from persistentkv.bench.traces import make_trace, replay
from persistentkv.runtime import sm_count
from persistentkv.tuning import KernelConfig

HEADS = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
MAX_B, MAX_PAGES = 4, 64


class StaticTable:
    """Page-table tensors of fixed shape and address, refilled in place every step."""

    def __init__(self, width: int = MAX_PAGES):
        self.indptr = torch.zeros(MAX_B + 1, dtype=torch.int32, device=DEVICE)
        self.indices = torch.zeros(MAX_PAGES, dtype=torch.int32, device=DEVICE)
        self.last = torch.zeros(MAX_B, dtype=torch.int32, device=DEVICE)
        self.block_table = torch.zeros(MAX_B, width, dtype=torch.int32, device=DEVICE)
        self.seq_lens = torch.zeros(MAX_B, dtype=torch.int32, device=DEVICE)

    def fill(self, table):
        """Rows of `table` first, the remaining rows inactive (no pages, length 0)."""
        b = table.batch_size
        indptr, indices, last = table.csr(DEVICE)
        self.indptr.zero_()
        self.indptr[: b + 1] = indptr
        self.indptr[b + 1:] = indptr[-1]
        self.indices[: indices.numel()] = indices
        self.last.zero_()
        self.last[:b] = last
        block, lens = table.block_table(DEVICE, pad_to=self.block_table.shape[1])
        self.block_table.zero_()
        self.block_table[:b] = block
        self.seq_lens.zero_()
        self.seq_lens[:b] = lens

    def kwargs(self, form: str) -> dict:
        if form == "csr":
            return dict(kv_indptr=self.indptr, kv_indices=self.indices, kv_last_page_len=self.last)
        return dict(block_table=self.block_table, seq_lens=self.seq_lens)


def _cache(seed=0):
    return PagedKVCache(num_layers=1, num_pages=MAX_PAGES, device=DEVICE, shuffle_seed=seed,
                        init="randn", layout="HND", page_size=16, num_kv_heads=2, head_dim=64)


def _hold_only(cache, lens):
    """The cache holds rows 0.. of lengths `lens` and nothing else; returns its page table."""
    for sid in list(cache.allocator.sequence_ids):
        cache.free_sequence(sid)
    for i, n in enumerate(lens):
        cache.add_sequence(i)
        cache.append_tokens(i, n)
    return cache.page_table()


def _check_rows(q, out, cache, table, step):
    """The table's rows of out against the float64 reference."""
    b = table.batch_size
    ref, _ = reference_decode(q[:b], cache.pools[0], layout="HND", **dict(zip(
        ("kv_indptr", "kv_indices", "kv_last_page_len"), table.csr(DEVICE))))
    assert relative_error(out[:b], ref) <= TOLERANCE[torch.float16], step


@pytest.mark.parametrize("form", ["csr", "block"])
def test_device_plan_matches_reference_as_the_batch_changes(form):
    cache, static = _cache(), StaticTable()
    wrapper = DecodeWrapper("HND", use_cuda_graph=True, max_batch_size=MAX_B, max_num_pages=MAX_PAGES)
    q = torch.randn(MAX_B, 8, 64, dtype=torch.float16, device=DEVICE)
    for step, lens in enumerate([[40], [300, 7, 64], [1, 2, 3, 500]]):
        table = _hold_only(cache, lens)
        static.fill(table)
        wrapper.plan(**static.kwargs(form), **HEADS, split_pages=2)
        out = torch.full_like(q, float("nan"))
        wrapper.run(q, cache.pools[0], out=out)
        _check_rows(q, out, cache, table, step)
        assert torch.isnan(out[len(lens):].float()).all()  # inactive rows are left untouched
        assert int(wrapper._counters.abs().sum()) == 0


def _host_and_device_plans(lens, split_pages, seed=1, config=None):
    cache, static = _cache(seed), StaticTable()
    static.fill(_hold_only(cache, lens))
    device = DecodeWrapper("HND", use_cuda_graph=True, max_batch_size=MAX_B, max_num_pages=MAX_PAGES)
    plan = device.plan(**static.kwargs("csr"), **HEADS, split_pages=split_pages, config=config)
    host = DecodeWrapper("HND").plan(**dict(zip(("kv_indptr", "kv_indices", "kv_last_page_len"),
                                                cache.page_table().csr(DEVICE))),
                                     **HEADS, backend="workqueue", split_pages=split_pages,
                                     config=config)
    return plan, host


def _assert_same_work(plan, host, batch):
    n, split_tokens = plan.plan_info.tolist()
    assert split_tokens == host.schedule.split_tokens
    assert n == host.tasks.shape[1]
    got = sorted(map(tuple, plan.tasks[:, :n].T.tolist()))
    assert got == sorted(map(tuple, host.tasks.T.tolist()))
    assert plan.meta[:, :batch].tolist() == host.meta.tolist()


def test_device_plan_tasks_agree_with_host_plan():
    plan, host = _host_and_device_plans([300, 7, 64], split_pages=2)
    assert host.tasks.shape[1] == 10 + 1 + 2
    _assert_same_work(plan, host, 3)


@pytest.mark.parametrize("one_round", [False, True])
@pytest.mark.parametrize("lens", [[300, 7, 64], [100, 90], [1], [700, 1, 1, 40], [16, 16, 16, 16],
                                  [300, 300, 300]])
def test_device_plan_picks_the_host_split_size(lens, one_round):
    """Without split_pages the GPU planner applies the host's split rule to the step's lengths:
    same split size, same tasks, same partial slots (a balanced split, whole rows, one page)."""
    # 8 tasks per KV head on any GPU (one_round leaves room for the rows' rounding)
    config = KernelConfig(min_split_tokens=16, waves=16 / sm_count(torch.device(DEVICE)),
                          one_round=one_round)
    plan, host = _host_and_device_plans(lens, split_pages=None, config=config)
    _assert_same_work(plan, host, len(lens))


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(1, 256), min_size=1, max_size=MAX_B), tasks=st.integers(1, 12),
       one_round=st.booleans())
def test_device_split_rule_matches_the_host_on_random_steps(lens, tasks, one_round):
    """The GPU planner's split rule (balanced share, whole rows, one_round's growth and fallback,
    even splits) gives the host's split size and tasks on random lengths and targets."""
    config = KernelConfig(min_split_tokens=16, waves=2 * tasks / sm_count(torch.device(DEVICE)),
                          one_round=one_round)
    plan, host = _host_and_device_plans(lens, split_pages=None, config=config)
    _assert_same_work(plan, host, len(lens))


def test_replan_with_the_same_tables_reruns_only_the_planner():
    """A plan() with the same page-table tensors and options as the last one relaunches the GPU
    planner on their new contents; other tensors or options take the full, checked path."""
    cache, static = _cache(2), StaticTable()
    wrapper = DecodeWrapper("HND", use_cuda_graph=True, max_batch_size=MAX_B, max_num_pages=MAX_PAGES)
    q = torch.randn(MAX_B, 8, 64, dtype=torch.float16, device=DEVICE)
    other = StaticTable()
    for step, (lens, table_set, split) in enumerate([([40, 9], static, None), ([300, 1], static, None),
                                                     ([64], other, None), ([200, 30, 5], other, 3)]):
        table = _hold_only(cache, lens)
        table_set.fill(table)
        plan = wrapper.plan(**table_set.kwargs("csr"), **HEADS, split_pages=split)
        assert plan.indices is table_set.indices
        out = torch.full_like(q, float("nan"))
        wrapper.run(q, cache.pools[0], out=out)
        _check_rows(q, out, cache, table, step)
    with pytest.raises(ValueError, match="num_qo_heads=7 must be a multiple"):
        wrapper.plan(**other.kwargs("csr"), **{**HEADS, "num_qo_heads": 7}, split_pages=3)


def test_graph_mode_argument_checks():
    with pytest.raises(TypeError, match="max_batch_size must be an int"):
        DecodeWrapper("HND", use_cuda_graph=True, max_num_pages=8)
    with pytest.raises(ValueError, match="leave them out"):
        DecodeWrapper("HND", max_batch_size=4)
    static = StaticTable()
    w = DecodeWrapper("HND", use_cuda_graph=True, max_batch_size=MAX_B, max_num_pages=MAX_PAGES)
    with pytest.raises(ValueError, match="work-queue"):
        w.plan(**static.kwargs("csr"), **HEADS, backend="split")
    with pytest.raises(ValueError, match="max_batch_size=4 rows"):     # consistent, but 2 rows
        w.plan(kv_indptr=static.indptr[:3], kv_indices=static.indices,
               kv_last_page_len=static.last[:2], **HEADS)
    with pytest.raises(ValueError, match="kv_indptr must have batch_size \\+ 1 = 5 entries"):
        w.plan(kv_indptr=static.indptr[:3], kv_indices=static.indices, kv_last_page_len=static.last,
               **HEADS)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA graphs")
@pytest.mark.parametrize("form", ["csr", "block"])
def test_one_captured_graph_replays_a_whole_trace(form):
    """Capture plan + run once; replay over a trace whose batch grows, shrinks and turns over,
    changing only the page-table tensors' contents; check every step against the reference."""
    max_b, max_pages = 8, 16384
    heads = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    cache = PagedKVCache(num_layers=1, num_pages=max_pages, page_size=16, num_kv_heads=8,
                         head_dim=128, layout="HND", device="cuda", shuffle_seed=3, init="randn")
    static_shape = dict(indptr=torch.zeros(max_b + 1, dtype=torch.int32, device="cuda"),
                        indices=torch.zeros(max_pages, dtype=torch.int32, device="cuda"),
                        last=torch.zeros(max_b, dtype=torch.int32, device="cuda"),
                        block=torch.zeros(max_b, max_pages, dtype=torch.int32, device="cuda"),
                        lens=torch.zeros(max_b, dtype=torch.int32, device="cuda"))
    s = static_shape
    kwargs = (dict(kv_indptr=s["indptr"], kv_indices=s["indices"], kv_last_page_len=s["last"])
              if form == "csr" else dict(block_table=s["block"], seq_lens=s["lens"]))
    trace = make_trace("uniform", batch_slots=6, num_requests=10, seed=5, out_min=3, out_max=8)
    wrapper = DecodeWrapper("HND", use_cuda_graph=True, max_batch_size=max_b, max_num_pages=max_pages)
    q = torch.randn(max_b, 32, 128, dtype=torch.float16, device="cuda")
    out = torch.zeros_like(q)
    graph = None
    checked = 0
    for step in replay(trace):
        for req, n in step.rows:
            if req not in cache.allocator:
                cache.add_sequence(req)
            cache.append_tokens(req, n - cache.seq_len(req))
        ids = [req for req, _ in step.rows]
        if ids:
            table = cache.page_table(ids)
            indptr, indices, last = table.csr("cuda")
            b = len(ids)
            s["indptr"].zero_(); s["indptr"][: b + 1] = indptr; s["indptr"][b + 1:] = indptr[-1]
            s["indices"][: indices.numel()] = indices
            s["last"].zero_(); s["last"][:b] = last
            block, lens = table.block_table("cuda", pad_to=max_pages)
            s["block"].zero_(); s["block"][:b] = block
            s["lens"].zero_(); s["lens"][:b] = lens
            q.normal_()
            if graph is None:          # warm-up outside the capture, then capture once
                wrapper.plan(**kwargs, **heads)
                wrapper.run(q, cache.pools[0], out=out)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    wrapper.plan(**kwargs, **heads)
                    wrapper.run(q, cache.pools[0], out=out)
            graph.replay()
            torch.cuda.synchronize()
            ref, _ = reference_decode(q[:b], cache.pools[0], layout="HND", kv_indptr=indptr,
                                      kv_indices=indices, kv_last_page_len=last)
            assert relative_error(out[:b], ref) <= TOLERANCE[torch.float16], step.index
            checked += 1
        for req in step.finished:
            cache.free_sequence(req)
    assert checked > 10
