"""Several query tokens per row (qo_indptr): causal attention of a row's last n tokens, against the
float64 reference, in every schedule and table form; and the errors for a bad qo_indptr."""
import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_case import DEVICE, ON_GPU, block_kwargs, csr_kwargs, make_case, queries
from persistentkv import BACKENDS, TOLERANCE, DecodeWrapper, reference_decode, relative_error
from persistentkv.tuning import KernelConfig

HEADS = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)


def schedule(backend) -> dict:
    """plan()'s schedule options: splits of 2 pages where the backend takes a split."""
    return dict(backend=backend, split_pages=2 if backend == "split" else None)


def _check(case, q_lens, *, backend, table_form="csr", split_pages=None, seed=0, heads=HEADS,
           config=None):
    kwargs = csr_kwargs(case.table) if table_form == "csr" else block_kwargs(case.table)
    q, qo_indptr = queries(case, q_lens, seed)
    wrapper = DecodeWrapper(case.layout)
    wrapper.plan(**kwargs, **heads, backend=backend, split_pages=split_pages, qo_indptr=qo_indptr,
                 config=config)
    out = torch.full_like(q, float("nan"))
    lse = wrapper.run(q, case.kv_cache, out=out, return_lse=True)[1]
    ref, ref_lse = reference_decode(q, case.kv_cache, layout=case.layout,
                                    qo_indptr=qo_indptr, **csr_kwargs(case.table))
    assert relative_error(out, ref) <= TOLERANCE[q.dtype], (q_lens, backend)
    assert relative_error(lse, ref_lse) <= 1e-4, (q_lens, backend)
    return wrapper.current_plan


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_query_counts_every_schedule(backend):
    """Rows of 1 to 7 queries, split into several tasks (2 pages a split) or whole."""
    case = make_case(seq_lens=[70, 9, 130, 33], **HEADS, seed=1)
    _check(case, [3, 1, 7, 4], backend=backend, split_pages=2 if backend == "split" else None)


@pytest.mark.parametrize("tile_rows", [16, 32, "default"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_m_blocks_every_schedule(backend, tile_rows):
    """A row's 16 queries x group 8 (128 tile rows) run as M-blocks of 16 or 32 rows, or the
    default's 64, each block a program of its own that merges its own rows; rows of 1-7 queries
    beside it."""
    heads = dict(num_qo_heads=16, num_kv_heads=2, head_dim=32, page_size=16)
    case = make_case(seq_lens=[70, 9, 130, 33], **heads, seed=11)
    config = None if tile_rows == "default" else KernelConfig(block_n=32, max_tile_rows=tile_rows)
    _check(case, [16, 1, 7, 4], backend=backend, heads=heads,
           split_pages=2 if backend == "split" else None, config=config)


@pytest.mark.parametrize("min_tile_rows", [16, 64])
@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_tile_rows_every_schedule(backend, min_tile_rows):
    """A row's 8 queries x group 4 (32 tile rows) in a tile padded to 64 rows (the default
    min_tile_rows, the size Triton gives the warp-group MMA) or not padded (16); rows of 1-7
    queries beside it. The padded rows must neither read past q nor write."""
    heads = dict(num_qo_heads=8, num_kv_heads=2, head_dim=32, page_size=16)
    case = make_case(seq_lens=[70, 9, 130, 33], **heads, seed=12)
    config = KernelConfig(block_n=32, min_tile_rows=min_tile_rows)
    assert config.program_rows(tile_rows=32) == max(32, min_tile_rows)
    _check(case, [8, 1, 7, 4], backend=backend, heads=heads,
           split_pages=2 if backend == "split" else None, config=config)


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_steps_cut_the_tile_in_half(backend):
    """The default configuration at head dim 128 runs a small step's tile of 8 queries x group 4
    (32 rows, one padded 64-row program otherwise) as two M-blocks of 16
    (KernelConfig.for_step), correct in every schedule. The threshold counts the K/V the page
    table can hold, at 16 bits: one byte more than the threshold keeps the whole tile, and so
    do a deterministic plan and head dim 64's default (measured slower there)."""
    from persistentkv.tuning import default_config

    heads = dict(HEADS, head_dim=128)
    case = make_case(seq_lens=[70, 9, 130, 33], **heads, seed=13)
    split = 2 if backend == "split" else None
    plan = _check(case, [8, 1, 7, 4], backend=backend, split_pages=split, heads=heads)
    assert (plan.config.row_blocks(tile_rows=32), plan.config.program_rows(tile_rows=32)) == (2, 16)
    base = default_config(head_dim=128, num_kv_heads=2)
    assert (base.row_blocks(tile_rows=32), base.program_rows(tile_rows=32)) == (1, 64)
    assert default_config(head_dim=64, num_kv_heads=2).small_step_kv_bytes_per_sm == 0

    kwargs = csr_kwargs(case.table)
    kv_bytes = kwargs["kv_indices"].numel() * 16 * 2 * 128 * 2 * 2   # pages x tokens x Hkv x D x K,V x 2
    q, qo_indptr = queries(case, [8, 1, 7, 4], 0)
    for per_sm, rows in ((kv_bytes // 4, 16), (kv_bytes // 4 - 1, 64)):
        wrapper = DecodeWrapper(case.layout, num_sms=4)
        config = dataclasses.replace(base, small_step_kv_bytes_per_sm=per_sm)
        plan = wrapper.plan(**kwargs, **heads, backend=backend, split_pages=split,
                            qo_indptr=qo_indptr, config=config)
        assert plan.config.program_rows(tile_rows=32) == rows, per_sm
    if backend == "split":
        plan = DecodeWrapper(case.layout, max_queries_per_row=8).plan(
            **kwargs, **heads, qo_indptr=qo_indptr, deterministic=True)
        assert plan.config is base


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_steps_widen_head_dim_512_blocks(backend):
    """Head dim 512 runs tiles of more than 16 rows as M-blocks of 16, and a step known to be
    large (a CSR page list past the threshold, outside graph mode) those of 64 rows or more in
    64-row programs, two to a task's columns (16 queries x group 4: 64 rows), correct in every
    schedule. A block table's rows x width, a window and graph mode's buffers only bound the
    step, so they keep blocks of 16."""
    from persistentkv.tuning import default_config

    heads = dict(num_qo_heads=8, num_kv_heads=2, head_dim=512, page_size=16)
    case = make_case(seq_lens=[40, 23], **heads, seed=14)
    config = dataclasses.replace(default_config(head_dim=512, num_kv_heads=2),
                                 small_step_kv_bytes_per_sm=1)
    split = 1 if backend == "split" else None
    plan = _check(case, [16, 5], backend=backend, split_pages=split, heads=heads, config=config)
    assert (plan.config.block_rows(tile_rows=64), plan.config.column_blocks(tile_rows=64),
            plan.config.stages(tile_rows=64)) == (64, 2, 2)
    q, qo_indptr = queries(case, [16, 5], 0)
    csr = csr_kwargs(case.table)
    graph = dict(use_cuda_graph=True, max_batch_size=2, max_queries_per_row=16,
                 max_num_pages=csr["kv_indices"].numel())
    for kwargs, extra, mode in ((block_kwargs(case.table), {}, {}),
                                (csr, dict(window_left=100), {}),
                                (csr, {}, graph)):
        wrapper = DecodeWrapper(case.layout, num_sms=4, **mode)
        plan = wrapper.plan(**kwargs, **heads, **extra, backend=backend, split_pages=split,
                            qo_indptr=qo_indptr.to(DEVICE) if mode else qo_indptr,
                            config=config)
        assert plan.config is config


def test_queries_past_a_short_last_split():
    """Splits of one page (16 tokens) and 16 queries: the early queries see nothing of the last
    split and of part of the one before (their partials are empty and must not count)."""
    case = make_case(seq_lens=[50, 37], **HEADS, seed=2)
    _check(case, [16, 16], backend="split", split_pages=1, table_form="block")


def test_one_query_per_row_is_plain_decode():
    case = make_case(seq_lens=[40, 3, 90], **HEADS, seed=3)
    q, qo_indptr = queries(case, [1, 1, 1], 3)
    wrapper = DecodeWrapper(case.layout)
    wrapper.plan(**csr_kwargs(case.table), **HEADS, qo_indptr=qo_indptr)
    with_indptr = wrapper.run(q, case.kv_cache)
    wrapper.plan(**csr_kwargs(case.table), **HEADS)
    assert torch.equal(with_indptr, wrapper.run(q, case.kv_cache))


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("backend", ["split", "auto"])
def test_eager_replan_of_a_refilled_qo_indptr(monkeypatch, backend, where):
    """An eager plan() of the same page-table and qo_indptr tensors, refilled in place, reruns
    only the planner when the new counts keep the tile (a new total of query tokens included),
    and plans afresh when they need a larger one; bad new values are refused before anything is
    copied. Each step against the float64 reference, NaN-poisoned."""
    from persistentkv import planner as planner_module

    whole = []
    plan_into = planner_module.Planner._plan_into
    monkeypatch.setattr(planner_module.Planner, "_plan_into",
                        lambda self, *a, **k: whole.append(1) or plan_into(self, *a, **k))
    case = make_case(seq_lens=[70, 9, 130, 33], **HEADS, layout="HND", seed=31)
    table = csr_kwargs(case.table)
    indptr = torch.zeros(5, dtype=torch.int32, device=DEVICE if where == "device" else "cpu")
    wrapper = DecodeWrapper(case.layout)
    for step, (q_lens, plans) in enumerate((([3, 1, 4, 2], 1), ([4, 2, 1, 4], 1),
                                            ([8, 1, 1, 1], 2), ([1, 5, 2, 6], 2))):
        q, values = queries(case, q_lens, seed=step)
        indptr.copy_(values)
        wrapper.plan(**table, **HEADS, **schedule(backend), qo_indptr=indptr)
        assert len(whole) == plans, (step, q_lens)
        assert wrapper.current_plan.total_queries == sum(q_lens)
        out = torch.full_like(q, float("nan"))
        wrapper.run(q, case.kv_cache, out=out)
        ref, _ = reference_decode(q, case.kv_cache, layout=case.layout, qo_indptr=values,
                                  **csr_kwargs(case.table))
        assert relative_error(out, ref) <= TOLERANCE[q.dtype], (step, q_lens)
    last = wrapper.current_plan
    indptr.copy_(torch.tensor([0, 3, 2, 5, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"qo_indptr must be non-decreasing, got qo_indptr\[1\]=3"):
        wrapper.plan(**table, **HEADS, **schedule(backend), qo_indptr=indptr)
    assert wrapper.current_plan is last and len(whole) == 2


@pytest.mark.skipif(not ON_GPU, reason="CUDA graph capture needs a GPU")
def test_eager_replan_of_a_host_qo_indptr_captured_in_a_graph():
    """An eager plan() of the same tensors captured in a CUDA graph (the replan path, a host
    qo_indptr: its pinned copy is what the graph copies from): replays compute the values of
    the capture, whatever the host tensor holds later, and an eager plan() after it takes the
    new ones. Against the float64 reference, NaN-poisoned."""
    case = make_case(seq_lens=[70, 9, 130, 33], **HEADS, layout="HND", seed=41)
    table = csr_kwargs(case.table)
    wrapper = DecodeWrapper(case.layout)
    q, values = queries(case, [3, 1, 4, 2], seed=41)
    indptr = values.clone()
    out = torch.full_like(q, float("nan"))
    wrapper.plan(**table, **HEADS, qo_indptr=indptr)
    wrapper.run(q, case.kv_cache, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.plan(**table, **HEADS, qo_indptr=indptr)
        wrapper.run(q, case.kv_cache, out=out)
    indptr.copy_(torch.tensor([0, 1, 2, 6, 10], dtype=torch.int32))   # after the capture
    ref, _ = reference_decode(q, case.kv_cache, layout=case.layout, qo_indptr=values, **table)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(out, ref) <= TOLERANCE[q.dtype]
    ref, _ = reference_decode(q, case.kv_cache, layout=case.layout, qo_indptr=indptr, **table)
    wrapper.plan(**table, **HEADS, qo_indptr=indptr)
    out.fill_(float("nan"))
    wrapper.run(q, case.kv_cache, out=out)
    assert relative_error(out, ref) <= TOLERANCE[q.dtype]


# every example compiles new kernel variants on a GPU (seconds each); the interpreter has none
@settings(max_examples=12 if ON_GPU else 25, deadline=None, derandomize=True)
@given(st.data())
def test_random_query_counts(data):
    q_lens = data.draw(st.lists(st.integers(0, 16), min_size=1, max_size=3), label="q_lens")
    seq_lens = [data.draw(st.integers(max(n, 1), 150), label="seq_len") for n in q_lens]
    group = data.draw(st.sampled_from([1, 2, 4]), label="group")
    heads = dict(num_qo_heads=2 * group, num_kv_heads=2, head_dim=32,
                 page_size=data.draw(st.sampled_from([1, 8, 16]), label="page_size"))
    backend = data.draw(st.sampled_from(BACKENDS), label="backend")
    case = make_case(seq_lens=seq_lens, **heads,
                     layout=data.draw(st.sampled_from(["HND", "NHD", "HND_VT"]), label="layout"),
                     seed=data.draw(st.integers(0, 2**16), label="seed"))
    split = data.draw(st.integers(1, 4), label="split_pages") if backend == "split" else None
    tile_rows = data.draw(st.sampled_from([None, 16, 32]), label="max_tile_rows")
    value_blocks = data.draw(st.sampled_from([1, 2]), label="value_blocks")   # on 16-row tiles too
    _check(case, q_lens, backend=backend, split_pages=split, heads=heads,
           table_form=data.draw(st.sampled_from(["csr", "block"]), label="table_form"),
           config=KernelConfig(block_n=32, max_tile_rows=tile_rows, value_blocks=value_blocks,
                               value_block_rows=16,
                               first_pages=data.draw(st.booleans(), label="first_pages")))


@pytest.mark.parametrize("indptr, match", [
    ([1, 2, 3], r"qo_indptr must start at 0, got qo_indptr\[0\]=1"),
    ([0, 3, 2], r"qo_indptr must be non-decreasing, got qo_indptr\[1\]=3 > qo_indptr\[2\]=2"),
    ([0, 5, 6], r"row 0 has 5 query tokens \(qo_indptr\) but only 4 tokens in the cache"),
    ([0, 1], r"qo_indptr must have batch_size \+ 1 = 3 entries, got 2"),
    ([0, 17, 18], r"a row has 17 query tokens: at most 16"),
])
def test_bad_qo_indptr(indptr, match):
    case = make_case(seq_lens=[4, 30], **HEADS)
    table = case.table
    indptr_host, indices, last = table.csr(torch.device("cpu"))
    with pytest.raises(ValueError, match=match):
        DecodeWrapper("NHD").plan(kv_indptr=indptr_host, kv_indices=indices.to(DEVICE),
                                  kv_last_page_len=last, **HEADS,
                                  qo_indptr=torch.tensor(indptr, dtype=torch.int32))


def test_a_tile_over_128_rows_is_refused_as_the_tile_is_sized():
    """Query tokens a row (the tile's: the wrapper's max_queries_per_row, else the batch's most)
    x group at most 128 rows, whatever the batch holds: at group 64 a tile of 4 was let through
    where every row had one query, and in graph mode."""
    heads = dict(num_qo_heads=64, num_kv_heads=1, head_dim=16, page_size=16)
    case = make_case(seq_lens=[4, 30], **heads)
    one_each = torch.tensor([0, 1, 2], dtype=torch.int32)
    match = (r"max_queries_per_row=4 takes a tile of 4 query tokens x group 64 = 256 rows: at "
             r"most 128 are supported")
    with pytest.raises(ValueError, match=match):
        DecodeWrapper("NHD", max_queries_per_row=4).plan(**csr_kwargs(case.table), **heads,
                                                         qo_indptr=one_each)
    with pytest.raises(ValueError, match=r"the batch's most query tokens a row, 3, takes a tile "
                                         r"of 4 query tokens x group 64"):
        DecodeWrapper("NHD").plan(**csr_kwargs(case.table), **heads,
                                  qo_indptr=torch.tensor([0, 3, 4], dtype=torch.int32))
    graph = DecodeWrapper("NHD", use_cuda_graph=True, max_batch_size=2, max_num_pages=8,
                          max_queries_per_row=4)
    with pytest.raises(ValueError, match=match):
        graph.plan(**csr_kwargs(case.table), **heads, qo_indptr=one_each.to(DEVICE))
    DecodeWrapper("NHD", max_queries_per_row=2).plan(**csr_kwargs(case.table), **heads,
                                                     qo_indptr=one_each)   # 128 rows: planned


def test_qo_indptr_dtype_and_q_total():
    case = make_case(seq_lens=[20, 30], **HEADS)
    wrapper = DecodeWrapper("NHD")
    with pytest.raises(TypeError, match="qo_indptr must have dtype torch.int32, got torch.int64"):
        wrapper.plan(**csr_kwargs(case.table), **HEADS, qo_indptr=torch.tensor([0, 1, 3]))
    wrapper.plan(**csr_kwargs(case.table), **HEADS,
                 qo_indptr=torch.tensor([0, 1, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"q must be \[qo_indptr\[-1\], num_qo_heads, head_dim\] = "
                                         r"\[3, 8, 64\] as planned, got \[2, 8, 64\]"):
        wrapper.run(case.q, case.kv_cache)


def test_qo_indptr_must_be_contiguous():
    """The kernels read qo_indptr as contiguous: a strided view is refused, in both modes."""
    case = make_case(seq_lens=[20, 30], **HEADS)
    strided = torch.tensor([[0, 0], [1, 1], [3, 3]], dtype=torch.int32, device=DEVICE)[:, 0]
    with pytest.raises(ValueError, match="qo_indptr must be contiguous, got stride 2"):
        DecodeWrapper("NHD").plan(**csr_kwargs(case.table), **HEADS, qo_indptr=strided)
    graph = DecodeWrapper("NHD", use_cuda_graph=True, max_batch_size=2, max_num_pages=8,
                          max_queries_per_row=2)
    with pytest.raises(ValueError, match="qo_indptr must be contiguous, got stride 2"):
        graph.plan(**csr_kwargs(case.table), **HEADS, qo_indptr=strided)


def test_torch_compile_withqueries():
    """run() under torch.compile(fullgraph=True) takes the same query layout."""
    case = make_case(seq_lens=[40, 70], **HEADS, seed=5)
    q, qo_indptr = queries(case, [3, 2], 5)
    wrapper = DecodeWrapper(case.layout)
    wrapper.plan(**csr_kwargs(case.table), **HEADS, backend="split", split_pages=1,
                 qo_indptr=qo_indptr)
    backend = "inductor" if DEVICE.type == "cuda" else "aot_eager"

    @torch.compile(fullgraph=True, backend=backend)
    def attend(q, kv):
        return wrapper.run(q * 1.0, kv) + 0.0

    torch._dynamo.reset()
    ref, _ = reference_decode(q, case.kv_cache, layout=case.layout, qo_indptr=qo_indptr,
                              **csr_kwargs(case.table))
    assert relative_error(attend(q, case.kv_cache), ref) <= TOLERANCE[q.dtype]


def _fill_step(case, lens, counts, tensors, gen):
    """Refill graph mode's static tensors in place for one step: the first pages of the case's
    rows; returns the step's PageTable and its total of query tokens."""
    from persistentkv import PageTable

    indptr, indices, last, qo, q = tensors
    pages = [case.table.row_pages[r][: -(-n // 16)] for r, n in enumerate(lens)]
    table = PageTable(row_pages=tuple(pages), seq_lens=np.asarray(lens), page_size=16)
    step_indptr, step_indices, step_last = table.csr(DEVICE)
    indptr.copy_(step_indptr)
    indices[: len(step_indices)].copy_(step_indices)
    last.copy_(step_last)
    qo.copy_(torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32))
    total = int(sum(counts))
    q.normal_(generator=gen)
    return table, total


@pytest.mark.parametrize("max_queries, config", [
    (4, None), (8, KernelConfig(max_tile_rows=16)), (4, KernelConfig(first_pages=True))],
    ids=["q4", "q8-m-blocks", "q4-first-reads"])
def test_graph_mode_queries_refilled_in_place(max_queries, config):
    """Graph mode: qo_indptr is a static device tensor refilled in place like the page table (and,
    on a GPU, plan + run captured once and replayed for a later step); rows of q past the step's
    queries are left untouched. Also with 8 queries' tiles (32 rows) in two M-blocks, and with
    each task's row's queries copied by the planner beside its record (first pages)."""

    case = make_case(seq_lens=[60, 45, 20], **HEADS, seed=7)
    wrapper = DecodeWrapper("NHD", use_cuda_graph=True, max_batch_size=3, max_num_pages=16,
                            max_queries_per_row=max_queries)
    tensors = (torch.zeros(4, dtype=torch.int32, device=DEVICE),
               torch.zeros(16, dtype=torch.int32, device=DEVICE),
               torch.ones(3, dtype=torch.int32, device=DEVICE),
               torch.zeros(4, dtype=torch.int32, device=DEVICE),
               torch.zeros(12, 8, 64, dtype=torch.float16, device=DEVICE))
    indptr, indices, last, qo, q = tensors
    out = torch.empty_like(q)
    gen = torch.Generator(device=DEVICE).manual_seed(7)

    def step():
        wrapper.plan(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last, **HEADS,
                     qo_indptr=qo, config=config)
        wrapper.run(q, case.kv_cache, out=out)

    graph = None
    for lens, counts in (([60, 45, 20], [4, 1, 3]), ([30, 0, 20], [2, 0, 4]),
                         ([17, 45, 3], [1, 4, 3])):
        table, total = _fill_step(case, lens, counts, tensors, gen)
        out.fill_(float("nan"))
        if graph is not None:
            graph.replay()
        else:
            step()
            if ON_GPU:                       # capture once, replay for the later steps
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
        ref, _ = reference_decode(q[:total], case.kv_cache, layout="NHD", qo_indptr=qo.cpu(),
                                  **csr_kwargs(table))
        assert relative_error(out[:total], ref) <= TOLERANCE[torch.float16], (lens, counts)
        assert torch.isnan(out[total:].float()).all()


def test_graph_mode_queries_need_max_queries_per_row():
    case = make_case(seq_lens=[20], **HEADS)
    wrapper = DecodeWrapper("NHD", use_cuda_graph=True, max_batch_size=1, max_num_pages=8)
    with pytest.raises(ValueError, match="graph mode takes qo_indptr when the wrapper is built "
                                         "with max_queries_per_row > 1"):
        wrapper.plan(**csr_kwargs(case.table), **HEADS,
                     qo_indptr=torch.tensor([0, 2], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="a row has 5 query tokens, over the wrapper's "
                                         "max_queries_per_row=4"):
        DecodeWrapper("NHD", max_queries_per_row=4).plan(
            **csr_kwargs(case.table), **HEADS,
            qo_indptr=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="max_queries_per_row must be at most 16, got 17"):
        DecodeWrapper("NHD", use_cuda_graph=True, max_batch_size=1, max_num_pages=8,
                      max_queries_per_row=17)


@pytest.mark.parametrize("first_pages", [False, True], ids=["", "first-reads"])
def test_graph_mode_wrong_qo_indptr_stays_inside_q(first_pages):
    """A trusted qo_indptr that points past q reads and writes only q's own rows: counts are
    clamped to max_queries_per_row, rows past q are skipped (also where the planner copies
    them beside each task's record, clamped alike)."""
    case = make_case(seq_lens=[40, 30, 20], **HEADS, seed=8)
    wrapper = DecodeWrapper("NHD", use_cuda_graph=True, max_batch_size=3, max_num_pages=16,
                            max_queries_per_row=4)
    kwargs = csr_kwargs(case.table)
    indices = torch.zeros(16, dtype=torch.int32, device=DEVICE)
    indices[: len(kwargs["kv_indices"])] = kwargs["kv_indices"]
    kwargs["kv_indices"] = indices
    q = torch.randn(12, 8, 64, dtype=torch.float16, device=DEVICE)
    qo = torch.tensor([0, 4, 100, 10**6], dtype=torch.int32, device=DEVICE)
    wrapper.plan(**kwargs, **HEADS, qo_indptr=qo, config=KernelConfig(first_pages=first_pages))
    out = torch.full_like(q, float("nan"))
    wrapper.run(q, case.kv_cache, out=out)
    assert torch.isfinite(out[:8].float()).all() and torch.isnan(out[8:].float()).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_first_reads_carry_the_rows_queries(backend):
    """KernelConfig(first_pages=True) with several queries a row: the planner also copies each
    task's row's first query, query count and length beside its record, and the kernel reads
    them there, not in qo_indptr and row_lens. Rows of 1 to 7 queries, split or whole: against
    the float64 reference, NaN-poisoned, bitwise equal to the default's output, and the copy
    against qo_indptr and the rows' lengths."""
    from persistentkv.kernels.plan import QUERY_FIELDS_AT

    case = make_case(seq_lens=[70, 9, 130, 33], **HEADS, seed=12)
    q, qo_indptr = queries(case, [3, 1, 7, 4], 12)
    ref, _ = reference_decode(q, case.kv_cache, layout=case.layout, qo_indptr=qo_indptr,
                              **csr_kwargs(case.table))
    outs = []
    for first_pages in (False, True):
        wrapper = DecodeWrapper(case.layout)
        plan = wrapper.plan(**csr_kwargs(case.table), **HEADS, **schedule(backend),
                            qo_indptr=qo_indptr,
                            config=KernelConfig(block_n=32, first_pages=first_pages))
        out = wrapper.run(q, case.kv_cache, out=torch.full_like(q, float("nan")))
        assert relative_error(out, ref) <= TOLERANCE[q.dtype]
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    records = plan.task_records()
    qo = plan.queries.indptr.cpu().numpy()
    got = plan.workspace.first_pages[:len(records)].cpu().numpy()
    at = int(QUERY_FIELDS_AT)
    assert len(records) >= 4                   # every row (cut into several, split)
    for (row, *_), fields in zip(records, got):
        assert list(fields[at:at + 3]) == [qo[row], qo[row + 1] - qo[row], [70, 9, 130, 33][row]]


@pytest.mark.parametrize("config", [None, KernelConfig(max_tile_rows=16)])
def test_deterministic_queries_are_batch_invariant(config):
    """deterministic=True with several queries per row: a row's outputs are bitwise the same
    alone and in a batch (also with the tile's 32 rows in two M-blocks)."""
    from persistentkv import PageTable

    case = make_case(seq_lens=[300, 40, 700], **HEADS, seed=9)
    counts = [3, 2, 5]
    q, qo_indptr = queries(case, counts, 9)
    with pytest.raises(ValueError, match="deterministic=True with qo_indptr needs a tile"):
        DecodeWrapper(case.layout).plan(**csr_kwargs(case.table), **HEADS, deterministic=True,
                                        qo_indptr=qo_indptr)
    wrapper = DecodeWrapper(case.layout, max_queries_per_row=5)
    wrapper.plan(**csr_kwargs(case.table), **HEADS, backend="split", deterministic=True,
                 split_pages=4, qo_indptr=qo_indptr, config=config)
    full = wrapper.run(q, case.kv_cache)
    for row in range(3):
        alone = PageTable(row_pages=(case.table.row_pages[row],),
                          seq_lens=case.table.seq_lens[[row]], page_size=16)
        first, last = int(qo_indptr[row]), int(qo_indptr[row + 1])
        wrapper.plan(**csr_kwargs(alone), **HEADS, backend="split", deterministic=True,
                     split_pages=4, qo_indptr=torch.tensor([0, counts[row]], dtype=torch.int32),
                     config=config)
        assert torch.equal(wrapper.run(q[first:last], case.kv_cache), full[first:last]), row


@pytest.mark.parametrize("backend", BACKENDS)
def test_value_blocks_every_schedule(backend):
    """Programs of 64 rows or more share a task's output columns (value blocks): 16 queries x
    group 8 (128 rows: two M-blocks of 64, each in two value blocks of 16 of the 32 columns),
    then 8 queries (one 64-row block), with a sink logit and soft-cap on the second; rows of
    1-7 queries beside them, in every schedule against the float64 reference. Split into pages,
    the 300-token row merges 19 partials in two levels, whose groups overwrite their first
    partial: each value block keeps its own lse there (on a GPU, a shared one raced)."""
    heads = dict(num_qo_heads=16, num_kv_heads=2, head_dim=32, page_size=16)
    config = KernelConfig(block_n=32, value_blocks=2)
    assert config.head_items(tile_rows=128) == 4 and config.head_items(tile_rows=16) == 1
    case = make_case(seq_lens=[70, 9, 300, 33], **heads, seed=21)
    _check(case, [16, 1, 7, 4], backend=backend, heads=heads,
           split_pages=1 if backend == "split" else None, config=config)
    q, qo_indptr = queries(case, [8, 3, 1, 5], 22)
    sinks = torch.randn(16, dtype=torch.float32, device=DEVICE)
    wrapper = DecodeWrapper(case.layout)
    wrapper.plan(**csr_kwargs(case.table), **heads, backend=backend, qo_indptr=qo_indptr,
                 split_pages=1 if backend == "split" else None, logits_soft_cap=5.0,
                 config=config)
    out = torch.full_like(q, float("nan"))
    lse = wrapper.run(q, case.kv_cache, out=out, return_lse=True, sinks=sinks)[1]
    ref, ref_lse = reference_decode(q, case.kv_cache, layout=case.layout, qo_indptr=qo_indptr,
                                    logits_soft_cap=5.0, sinks=sinks, **csr_kwargs(case.table))
    assert relative_error(out, ref) <= TOLERANCE[q.dtype]
    assert relative_error(lse, ref_lse) <= 1e-4


@pytest.mark.parametrize("value_blocks", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_value_blocks_of_16_row_tiles(backend, value_blocks):
    """value_block_rows=16 (an experiment for small steps): tiles of 16 rows, one query a row
    (group 4 padded) and four, share each task's 64 output columns 2 or 4 ways; split into
    pages, the 300-token row merges 19 partials in two levels, each value block its own."""
    heads = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    config = KernelConfig(block_n=32, value_blocks=value_blocks, value_block_rows=16)
    assert config.head_items(tile_rows=4) == value_blocks
    assert KernelConfig(value_blocks=value_blocks).head_items(tile_rows=16) == 1
    case = make_case(seq_lens=[70, 9, 300, 33], **heads, seed=23)
    for q_lens in ([1, 1, 1, 1], [4, 1, 3, 4]):
        _check(case, q_lens, backend=backend, heads=heads, config=config,
               split_pages=1 if backend == "split" else None, seed=24)


def test_value_blocks_past_a_head_dim_that_is_not_a_power_of_two():
    """Head dim 48 pads to 64: two value blocks of 32 columns, the second's last 16 masked (8
    queries x group 8: one 64-row program a value block); the 100-token row in splits of a
    page merges in one level, the 300-token row in two."""
    heads = dict(num_qo_heads=16, num_kv_heads=2, head_dim=48, page_size=16)
    case = make_case(seq_lens=[100, 300], **heads, seed=24)
    _check(case, [8, 2], backend="split", split_pages=1, heads=heads,
           config=KernelConfig(block_n=32, value_blocks=2))


def test_value_blocks_must_cut_head_dim_into_blocks_of_16():
    case = make_case(seq_lens=[40], num_qo_heads=8, num_kv_heads=2, head_dim=48, page_size=16,
                     seed=23)
    wrapper = DecodeWrapper(case.layout)
    with pytest.raises(ValueError, match="value_blocks=8 must cut head_dim 48"):
        wrapper.plan(**csr_kwargs(case.table), num_qo_heads=8, num_kv_heads=2, head_dim=48,
                     page_size=16, config=KernelConfig(value_blocks=8))
    with pytest.raises(ValueError, match="value_blocks must be a power of two"):
        KernelConfig(value_blocks=3)
    for rows in (8, 24):
        with pytest.raises(ValueError, match=f"KernelConfig.value_block_rows must be a power of "
                                             f"two >= 16, got {rows}"):
            KernelConfig(value_block_rows=rows)
