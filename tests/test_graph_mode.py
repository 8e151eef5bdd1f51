"""Graph mode (buffers sized once, one graph for every batch composition) and the planner's
per-step choice for backend="auto": the device's policy lookup against Policy.decide."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_case import DEVICE, ON_GPU, csr_kwargs, make_case
from persistentkv import (TOLERANCE, DecodeWrapper, PagedKVCache, PageTable, reference_decode,
                          relative_error)
from persistentkv.bench.traces import make_trace, replay
from persistentkv.checks import MAX_GROUP
from persistentkv.policy import MAX_LEN_EDGES, ROW_EDGES, SPREAD_EDGES, Policy, StepFeatures
from persistentkv.schedule import Choice
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


def _graph_wrapper(form: str = "csr", **kw) -> DecodeWrapper:
    """Graph mode sized for StaticTable: max_num_pages bounds the table's page entries, which are
    kv_indices (CSR) or every entry of block_table (MAX_B x its width)."""
    return DecodeWrapper("HND", use_cuda_graph=True, max_batch_size=MAX_B,
                         max_num_pages=MAX_PAGES if form == "csr" else MAX_B * MAX_PAGES, **kw)


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


LONG_TILES = KernelConfig(block_n=16, long_block_n=32, long_from_tokens=64, num_stages=2)


@pytest.mark.parametrize("form", ["csr", "block"])
@pytest.mark.parametrize("config, split_pages", [
    (None, 2), (LONG_TILES, 6), (KernelConfig(block_n=16, long_block_n=32, long_from_tokens=64,
                                             num_stages=2, first_pages=True), 6)],
    ids=["default", "long-tiles", "long-tiles-first-pages"])
def test_graph_mode_plan_matches_reference_as_the_batch_changes(form, config, split_pages):
    """One graph-mode wrapper over three batches; with long tiles, the 96-token splits take the
    long loop and the rows' shorter last splits the short one, in the same plan (and with
    first_pages, each task's first tile from the planner's copy of an unchecked table)."""
    cache, static = _cache(), StaticTable()
    wrapper = _graph_wrapper(form)
    q = torch.randn(MAX_B, 8, 64, dtype=torch.float16, device=DEVICE)
    for step, lens in enumerate([[40], [300, 7, 64], [1, 2, 3, 500]]):
        table = _hold_only(cache, lens)
        static.fill(table)
        plan = wrapper.plan(**static.kwargs(form), **HEADS, backend="split",
                            split_pages=split_pages, config=config)
        assert plan.info()["num_tasks"] == sum(-(-n // (16 * split_pages)) for n in lens)
        out = torch.full_like(q, float("nan"))
        wrapper.run(q, cache.pools[0], out=out)
        _check_rows(q, out, cache, table, step)
        assert torch.isnan(out[len(lens):].float()).all()  # inactive rows are left untouched
        assert int(plan.workspace.counters.abs().sum()) == 0


# a step per bin edge: rows 1 | 4 | 8 | 32 (and one more), longest 2048 | 8192 | 32768 (and one
# more), spread (longest / mean) exactly 2.0 and just over; zeros are inactive rows
EDGE_STEPS = [[2048], [2049], [8192], [8193], [32768], [32769], [5] * 4, [5] * 5, [5] * 8, [5] * 9,
              [8, 2, 2, 4], [9, 2, 2, 4], [8, 0, 2, 2, 0, 4], [4096, 1024, 1024, 2048],
              [8192, 0, 2048, 4096, 2048], [32768] + [16384] * 3, [0], [0, 0, 0],
              [32] * 31 + [64], [2048] * 32, [8193] + [1] * 32, [100] * 16 + [0] * 17 + [200] * 17]


def _every_bin_policy() -> Policy:
    """A distinct choice in every bin: the device's bin is read off the choice it ran."""
    bins = [f"r{r}-l{ln}-s{s}" for r in range(len(ROW_EDGES) + 1)
            for ln in range(len(MAX_LEN_EDGES) + 1) for s in range(len(SPREAD_EDGES) + 1)]
    choices = [Choice("grouped"), Choice("split")] + [Choice("split", 64 + i)
                                                      for i in range(len(bins) - 2)]
    return Policy(gpu="test", table=dict(zip(bins, choices)))


SPARSE_POLICY = Policy(gpu="test", table={"r0-l0-s0": Choice("split", 3),
                                          "r1-l3-s1": Choice("grouped"),
                                          "r4-l1-s0": Choice("split", 70)})


def _check_auto_choice(lens, policy):
    """plan(backend="auto") on the device runs the choice Policy.decide makes on the host."""
    lens = [int(n) for n in lens]
    pages = np.cumsum([0] + [-(-n // 16) for n in lens])
    perm = np.random.default_rng(len(lens)).permutation(int(pages[-1]))
    table = PageTable(row_pages=tuple(perm[a:b] for a, b in zip(pages, pages[1:])),
                      seq_lens=np.asarray(lens, dtype=np.int64), page_size=16)
    indptr, indices, last = table.csr(DEVICE)
    wrapper = DecodeWrapper("HND", policy=policy)
    plan = wrapper.plan(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last,
                        num_qo_heads=2, num_kv_heads=2, head_dim=16, page_size=16, backend="auto",
                        config=KernelConfig(one_round=False))
    features = StepFeatures.of(lens, num_kv_heads=2, head_dim=16, elem_size=2)
    want = policy.decide(features)
    info = plan.info()
    ran = info["choice"]
    if want == Choice("split") and ran == Choice("balanced"):   # the default rule's chunks
        ran = want
    assert ran == want, (lens, features.bin())
    if want.split_pages is not None:
        assert info["split_tokens"] == want.split_pages * 16
    elif want.schedule == "grouped" and features.rows:
        assert info["split_tokens"] == -(-features.max_len // 16) * 16
        assert info["num_tasks"] == features.rows
    return ran


@pytest.mark.parametrize("lens", EDGE_STEPS, ids=lambda lens: f"B{len(lens)}-max{max(lens)}")
def test_auto_runs_the_policys_choice_at_bin_edges(lens):
    _check_auto_choice(lens, _every_bin_policy())


def test_auto_with_a_sparse_policy_takes_the_default_rule_in_unfitted_bins():
    for lens, want in (([100], Choice("split", 3)), ([0, 20], Choice("split", 3)),
                       ([3000] * 40, Choice("split", 70)), ([40000] + [100] * 3, Choice("grouped")),
                       ([9000] * 3 + [100], Choice("split")), ([40000, 30000], Choice("split"))):
        assert _check_auto_choice(lens, SPARSE_POLICY) == want, lens


LENGTHS = (st.sampled_from([0, 1, 2047, 2048, 2049, 8191, 8192, 8193, 32767, 32768, 32769])
           | st.integers(0, 40000))


@settings(max_examples=20, deadline=None)
@given(lens=st.lists(LENGTHS, min_size=1, max_size=10))
def test_auto_runs_the_policys_choice_on_random_steps(lens):
    """The device's bin (rows, longest, spread of the active rows, against the policy's edges)
    is policy.bin_of's, on random steps: Policy.decide on the host = the plan's choice."""
    _check_auto_choice(lens, _every_bin_policy())


@pytest.mark.parametrize("form", ["csr", "block"])
@pytest.mark.parametrize("fitted", [False, True], ids=["default-policy", "given-policy"])
def test_graph_mode_auto_matches_reference(form, fitted):
    """DecodeWrapper(use_cuda_graph=True, ...).plan(backend="auto") + run() on steps whose bins
    the given policy sends to split@1, whole rows and split@3 (or the default policy's choice)."""
    policy = Policy(gpu="test", table={"r0-l0-s0": Choice("split", 1), "r1-l0-s1": Choice("grouped"),
                                       "r1-l0-s0": Choice("split", 3)}) if fitted else None
    cache, static = _cache(4), StaticTable()
    wrapper = _graph_wrapper(form, policy=policy)
    q = torch.randn(MAX_B, 8, 64, dtype=torch.float16, device=DEVICE)
    for step, lens in enumerate([[40], [300, 7, 64], [200, 180, 190, 150]]):
        table = _hold_only(cache, lens)
        static.fill(table)
        plan = wrapper.plan(**static.kwargs(form), **HEADS, backend="auto")
        want = wrapper.policy.decide(StepFeatures.of(lens, num_kv_heads=2, head_dim=64, elem_size=2))
        assert plan.info()["choice"] == want
        out = torch.full_like(q, float("nan"))
        wrapper.run(q, cache.pools[0], out=out)
        _check_rows(q, out, cache, table, step)
        assert torch.isnan(out[len(lens):].float()).all()


def test_replan_with_the_same_tables_reruns_only_the_planner():
    """A plan() with the same page-table tensors and options as the last one relaunches the
    planner on their new contents; other tensors or options take the full, checked path."""
    cache, static = _cache(2), StaticTable()
    wrapper = _graph_wrapper()
    q = torch.randn(MAX_B, 8, 64, dtype=torch.float16, device=DEVICE)
    other = StaticTable()
    steps = [([40, 9], static, "auto", None), ([300, 1], static, "auto", None),
             ([64], other, "auto", None), ([200, 30, 5], other, "split", 3),
             ([500, 16], other, "split", 3)]
    plans = []
    for step, (lens, table_set, backend, split) in enumerate(steps):
        table = _hold_only(cache, lens)
        table_set.fill(table)
        plan = wrapper.plan(**table_set.kwargs("csr"), **HEADS, backend=backend, split_pages=split)
        plans.append(plan)
        assert plan.guard.leading[0] is table_set.indices   # read through the page guard
        assert plan.info()["num_tasks"] == len(plan.task_records()) > 0
        out = torch.full_like(q, float("nan"))
        wrapper.run(q, cache.pools[0], out=out)
        _check_rows(q, out, cache, table, step)
    # the same tensors and options: the same plan, replanned on the new contents
    assert plans[1] is plans[0] and plans[4] is plans[3]
    assert plans[2] is not plans[1] and plans[3] is not plans[2]
    assert plans[4].info()["num_tasks"] == 11 + 1
    with pytest.raises(ValueError, match="num_qo_heads=7 must be a multiple"):
        wrapper.plan(**other.kwargs("csr"), **{**HEADS, "num_qo_heads": 7}, split_pages=3)


def test_graph_mode_argument_checks():
    with pytest.raises(TypeError, match="max_batch_size must be an int"):
        DecodeWrapper("HND", use_cuda_graph=True, max_num_pages=8)
    with pytest.raises(ValueError, match="leave them out"):
        DecodeWrapper("HND", max_batch_size=4)
    static = StaticTable()
    w = _graph_wrapper()
    with pytest.raises(ValueError, match="max_batch_size=4 rows"):     # consistent, but 2 rows
        w.plan(kv_indptr=static.indptr[:3], kv_indices=static.indices,
               kv_last_page_len=static.last[:2], **HEADS)
    with pytest.raises(ValueError, match="kv_indptr must have batch_size \\+ 1 = 5 entries"):
        w.plan(kv_indptr=static.indptr[:3], kv_indices=static.indices, kv_last_page_len=static.last,
               **HEADS)
    longer = torch.zeros(MAX_PAGES + 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="65 page entries, over max_num_pages=64"):
        w.plan(kv_indptr=static.indptr, kv_indices=longer, kv_last_page_len=static.last, **HEADS)
    wide = StaticTable(width=MAX_PAGES // MAX_B + 1)                  # 4 x 17 > 64 entries
    with pytest.raises(ValueError, match="68 page entries, over max_num_pages=64"):
        w.plan(**wide.kwargs("block"), **HEADS)
    # the buffers are sized at the first plan() (partials of at least 256 tasks of 8 heads; more
    # on a GPU of many SMs): a later plan within them is taken, one needing more is refused. Up
    # to 2 x 64 = 128 tasks of one-page splits have a partial here.
    ws = w.plan(**static.kwargs("csr"), **HEADS).workspace
    assert ws.partial_capacity(partial_heads=16, head_dim=64, kv_heads=2) >= 128
    w.plan(**static.kwargs("csr"), **{**HEADS, "num_qo_heads": 16}, backend="split",
           split_pages=1)
    widest = dict(num_qo_heads=2 * MAX_GROUP, head_dim=256)
    assert ws.partial_capacity(partial_heads=widest["num_qo_heads"], head_dim=widest["head_dim"],
                               kv_heads=2) < 128
    with pytest.raises(ValueError, match="sized its buffers at the first plan"):
        w.plan(**static.kwargs("csr"), **{**HEADS, **widest}, backend="split", split_pages=1)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA graphs")
@pytest.mark.parametrize("first_pages", [False, True], ids=["", "first-pages"])
@pytest.mark.parametrize("form", ["csr", "block"])
def test_one_captured_graph_replays_a_whole_trace(form, first_pages):
    """Capture plan + run once; replay over a trace whose batch grows, shrinks and turns over,
    changing only the page-table tensors' contents; check every step against the reference
    (with first_pages, each task's first pages come from the planner's copy)."""
    import dataclasses

    from persistentkv.tuning import default_config

    max_b, max_pages, width = 8, 16384, 4096      # rows of up to 64K tokens in the block form
    heads = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    cache = PagedKVCache(num_layers=1, num_pages=max_pages, page_size=16, num_kv_heads=8,
                         head_dim=128, layout="HND", device="cuda", shuffle_seed=3, init="randn")
    static_shape = dict(indptr=torch.zeros(max_b + 1, dtype=torch.int32, device="cuda"),
                        indices=torch.zeros(max_pages, dtype=torch.int32, device="cuda"),
                        last=torch.zeros(max_b, dtype=torch.int32, device="cuda"),
                        block=torch.zeros(max_b, width, dtype=torch.int32, device="cuda"),
                        lens=torch.zeros(max_b, dtype=torch.int32, device="cuda"))
    s = static_shape
    kwargs = (dict(kv_indptr=s["indptr"], kv_indices=s["indices"], kv_last_page_len=s["last"])
              if form == "csr" else dict(block_table=s["block"], seq_lens=s["lens"]))
    trace = make_trace("uniform", batch_slots=6, num_requests=10, seed=5, out_min=3, out_max=8)
    # max_num_pages bounds the page entries of the table: kv_indices, or block_table's rows x width
    wrapper = DecodeWrapper("HND", use_cuda_graph=True, max_batch_size=max_b,
                            max_num_pages=max_pages if form == "csr" else max_b * width)
    q = torch.randn(max_b, 32, 128, dtype=torch.float16, device="cuda")
    out = torch.zeros_like(q)
    config = dataclasses.replace(default_config(head_dim=128, num_kv_heads=8),
                                 first_pages=first_pages)
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
            block, lens = table.block_table("cuda", pad_to=width)
            s["block"].zero_(); s["block"][:b] = block
            s["lens"].zero_(); s["lens"][:b] = lens
            q.normal_()
            if graph is None:          # warm-up outside the capture, then capture once
                wrapper.plan(**kwargs, **heads, config=config)
                wrapper.run(q, cache.pools[0], out=out)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    wrapper.plan(**kwargs, **heads, config=config)
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


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA graphs")
def test_host_metadata_is_refused_while_a_graph_is_captured():
    """A host tensor's copy captured in a graph replays from a temporary pinned buffer, not from
    the tensor refilled in place: plan() refuses host lengths or offsets while capturing (and
    takes them outside a capture). An eager plan() reads qo_indptr's values on the host: a
    capture takes it there (its pinned copy kept with the plan), not on the device."""
    heads = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    case = make_case(seq_lens=[40, 9], **heads)
    indptr, indices, last = case.table.csr(DEVICE)
    block, lens = case.table.block_table(DEVICE)
    queries = torch.tensor([0, 1, 3], dtype=torch.int32)
    for kwargs, match in (
            (dict(kv_indptr=indptr.cpu(), kv_indices=indices, kv_last_page_len=last),
             "kv_indptr is on the host while a CUDA graph is captured: give it on cuda"),
            (dict(block_table=block, seq_lens=lens.cpu()),
             "seq_lens is on the host while a CUDA graph is captured: give it on cuda"),
            (dict(block_table=block, seq_lens=lens, qo_indptr=queries.to(DEVICE)),
             "qo_indptr is on cuda:0 while a CUDA graph is captured: plan\\(\\) reads it on the "
             "host")):
        wrapper = DecodeWrapper("NHD")
        wrapper.plan(**kwargs, **heads)
        torch.cuda.synchronize()
        with pytest.raises(ValueError, match=match):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                wrapper.plan(**kwargs, **heads)
    q = torch.randn(3, 8, 64, dtype=torch.float16, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    wrapper = DecodeWrapper("NHD")
    wrapper.plan(block_table=block, seq_lens=lens, qo_indptr=queries, **heads)
    wrapper.run(q, case.kv_cache, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.plan(block_table=block, seq_lens=lens, qo_indptr=queries, **heads)
        wrapper.run(q, case.kv_cache, out=out)
    out.fill_(float("nan"))
    for _ in range(2):
        torch.empty(3, dtype=torch.int32).pin_memory().fill_(7)   # pinned memory reused
        graph.replay()
    torch.cuda.synchronize()
    ref, _ = reference_decode(q, case.kv_cache, layout="NHD", block_table=block, seq_lens=lens,
                              qo_indptr=queries)
    assert relative_error(out, ref) <= TOLERANCE[torch.float16]


def test_a_checked_plan_first_leaves_room_for_trusted_plans():
    """Graph mode sizes the page guard's copy at the first plan() even when that plan checks its
    table on the host (needing no copy): a trusted plan after it fits and matches the reference."""
    case = make_case(seq_lens=[20, 9], **HEADS, layout="HND")
    w = DecodeWrapper("HND", use_cuda_graph=True, max_batch_size=2, max_num_pages=8)
    w.plan(**csr_kwargs(case.table), **HEADS, check_page_table=True)
    checked = w.run(case.q, case.kv_cache)
    w.plan(**csr_kwargs(case.table), **HEADS)
    ref, _ = reference_decode(case.q, case.kv_cache, layout="HND", **csr_kwargs(case.table))
    assert relative_error(w.run(case.q, case.kv_cache), ref) <= TOLERANCE[torch.float16]
    assert relative_error(checked, ref) <= TOLERANCE[torch.float16]


def test_block_table_rows_further_apart_than_max_num_pages_are_named():
    case = make_case(seq_lens=[20, 9], **HEADS, layout="HND")
    table, seq_lens = case.table.block_table(DEVICE, pad_to=3)
    wide = torch.zeros(2, 10, dtype=torch.int32, device=DEVICE)
    wide[:, :3] = table
    w = DecodeWrapper("HND", use_cuda_graph=True, max_batch_size=2, max_num_pages=6)
    with pytest.raises(ValueError, match=r"block_table's rows are 10 entries apart: its 2 rows of "
                                         r"3 span 13 entries, over max_num_pages=6"):
        w.plan(block_table=wide[:, :3], seq_lens=seq_lens, **HEADS)
