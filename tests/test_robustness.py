"""Batch invariance, shared pages, NaN/Inf behaviour, malformed page tables, two streams."""
import re

import numpy as np
import pytest
import torch

from paged_case import DEVICE, ON_GPU, csr_kwargs, make_case
from persistentkv import TOLERANCE, DecodeWrapper, PageTable, reference_decode, relative_error

HEADS = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)


def _run(case, table, q, backend, **kw):
    wrapper = DecodeWrapper(case.layout)
    wrapper.plan(**csr_kwargs(table), **HEADS, backend=backend, **kw)
    return wrapper.run(q, case.kv_cache)


def _subtable(table: PageTable, rows) -> PageTable:
    return PageTable(row_pages=tuple(table.row_pages[r] for r in rows),
                     seq_lens=table.seq_lens[list(rows)], page_size=table.page_size)


@pytest.mark.parametrize("split_pages", [None, 8], ids=["default-512", "split@8"])
def test_deterministic_mode_is_batch_invariant(split_pages):
    """A row's output is bitwise the same alone, in a small batch and in a larger one, and
    matches the reference."""
    case = make_case(seq_lens=[1200, 5, 700, 64, 2100], **HEADS)
    full = _run(case, case.table, case.q, "split", deterministic=True, split_pages=split_pages)
    ref, _ = reference_decode(case.q, case.kv_cache, layout="NHD", **csr_kwargs(case.table))
    assert relative_error(full, ref) <= TOLERANCE[torch.float16]
    for rows in ([0], [2, 0], [4, 3, 0, 1]):
        part = _run(case, _subtable(case.table, rows), case.q[rows], "split", deterministic=True,
                    split_pages=split_pages)
        assert torch.equal(part, full[rows]), rows


def test_deterministic_grouped_is_refused():
    case = make_case(seq_lens=[20], **HEADS)
    with pytest.raises(ValueError, match="backend='grouped' cuts them by the batch"):
        DecodeWrapper("NHD").plan(**csr_kwargs(case.table), **HEADS, backend="grouped",
                                  deterministic=True)


def test_default_mode_split_size_depends_on_the_batch():
    """Why deterministic mode exists: the default split size follows the batch's total length
    (rows long enough that the minimum split does not decide, on the interpreter and on a GPU)."""
    case = make_case(seq_lens=[40000, 60000, 30000], num_qo_heads=2, num_kv_heads=2, head_dim=16,
                     page_size=16)
    heads = dict(num_qo_heads=2, num_kv_heads=2, head_dim=16, page_size=16)
    sizes = set()
    for rows in ([0], [0, 1, 2]):
        wrapper = DecodeWrapper("NHD")
        sub = csr_kwargs(_subtable(case.table, rows))
        sizes.add(wrapper.plan(**sub, **heads, backend="split").info()["split_tokens"])
        det = wrapper.plan(**sub, **heads, backend="split", deterministic=True)
        assert det.info()["split_tokens"] == 512
    assert len(sizes) == 2


def test_same_page_in_two_rows_is_allowed():
    """Pages are only read: two rows may share pages (a shared prefix), and each is exact."""
    case = make_case(seq_lens=[40, 40], **HEADS)
    shared = PageTable(row_pages=(case.table.row_pages[0], case.table.row_pages[0]),
                       seq_lens=np.array([40, 33]), page_size=16)
    wrapper = DecodeWrapper("NHD")
    wrapper.plan(**csr_kwargs(shared), **HEADS, backend="split", split_pages=1)
    out = wrapper.run(case.q, case.kv_cache)
    ref, _ = reference_decode(case.q, case.kv_cache, layout="NHD", **csr_kwargs(shared))
    assert relative_error(out, ref) <= TOLERANCE[torch.float16]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_nan_in_q_stays_in_its_rows_and_heads():
    """Documented behaviour: NaN/Inf are not checked (that would cost a device sync); a NaN in q
    poisons the output of that query head only, a NaN in a K/V row poisons the rows reading it."""
    case = make_case(seq_lens=[30, 50], **HEADS)
    q = case.q.clone()
    q[1, 5, 3] = float("nan")
    out = _run(case, case.table, q, "split", split_pages=1)
    bad = ~torch.isfinite(out.float()).all(dim=-1)
    assert bad[1, 5] and bad.sum() == 1


def test_kv_indptr_must_not_decrease():
    case = make_case(seq_lens=[20, 40], **HEADS)
    kw = csr_kwargs(case.table)
    kw["kv_indptr"] = torch.tensor([0, 5, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"non-decreasing.*kv_indptr\[1\]=5 > kv_indptr\[2\]=4"):
        DecodeWrapper("NHD").plan(**kw, **HEADS, check_page_table=True)


def test_q_not_contiguous_along_head_dim():
    case = make_case(seq_lens=[20, 40], **HEADS)
    wrapper = DecodeWrapper("NHD")
    wrapper.plan(**csr_kwargs(case.table), **HEADS)
    q = torch.randn(2, 8, 128, dtype=torch.float16, device=DEVICE)[..., ::2]
    with pytest.raises(ValueError, match="q must be contiguous along head_dim"):
        wrapper.run(q, case.kv_cache)


def test_deterministic_must_be_bool():
    case = make_case(seq_lens=[20], **HEADS)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        DecodeWrapper("NHD").plan(**csr_kwargs(case.table), **HEADS, deterministic=1)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA streams")
def test_two_wrappers_on_two_streams():
    cases = [make_case(seq_lens=[3000, 17, 900], **HEADS, seed=s) for s in (1, 2)]
    wrappers = [DecodeWrapper("NHD") for _ in cases]
    for w, c in zip(wrappers, cases):
        w.plan(**csr_kwargs(c.table), **HEADS, backend="split", split_pages=4)
    streams = [torch.cuda.Stream() for _ in cases]
    outs = []
    torch.cuda.synchronize()
    for w, c, s in zip(wrappers, cases, streams):
        with torch.cuda.stream(s):
            outs.append([w.run(c.q, c.kv_cache) for _ in range(20)][-1])
    torch.cuda.synchronize()
    for c, out in zip(cases, outs):
        ref, _ = reference_decode(c.q, c.kv_cache, layout="NHD", **csr_kwargs(c.table))
        assert relative_error(out, ref) <= TOLERANCE[torch.float16]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA: batch invariance of the compiled kernel")
def test_gpu_deterministic_batch_invariance():
    lens = [30000, 17, 5000, 1, 12000, 800, 64, 7000]
    case = make_case(seq_lens=lens, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    heads = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    for backend in ("split", "auto"):
        w = DecodeWrapper("NHD")
        w.plan(**csr_kwargs(case.table), **heads, backend=backend, deterministic=True)
        full = w.run(case.q, case.kv_cache).clone()
        for rows in ([0], [4, 0, 2], [7, 6, 5, 4, 3, 2, 1, 0]):
            w.plan(**csr_kwargs(_subtable(case.table, rows)), **heads, backend=backend,
                   deterministic=True)
            assert torch.equal(w.run(case.q[rows].contiguous(), case.kv_cache), full[rows])


def test_deterministic_auto_stays_batch_invariant():
    """backend='auto' could pick another schedule for another batch: deterministic plans 'split'."""
    case = make_case(seq_lens=[1200, 5, 700, 64, 2100], **HEADS)
    full = _run(case, case.table, case.q, "auto", deterministic=True)
    part = _run(case, _subtable(case.table, [2, 0]), case.q[[2, 0]], "auto", deterministic=True)
    assert torch.equal(part, full[[2, 0]])
    assert torch.equal(full, _run(case, case.table, case.q, "split", deterministic=True))


def _small_cache(**kw):
    from persistentkv import PagedKVCache
    return PagedKVCache(num_layers=2, num_pages=4, page_size=4, num_kv_heads=1, head_dim=16,
                        init="zeros", **kw)


def test_counts_take_numpy_integers():
    cache = _small_cache()
    cache.add_sequence(0)
    cache.append_tokens(0, np.int64(3))
    assert cache.seq_len(0) == 3
    for bad, error in ((2.0, TypeError), (True, TypeError), (-1, ValueError)):
        with pytest.raises(error, match="num_tokens"):
            cache.append_tokens(0, bad)
    assert cache.seq_len(0) == 3


def test_a_failed_append_changes_nothing(monkeypatch):
    """Bad k or v (numpy, the meta device, a wrong shape) or a write that fails: the sequence
    keeps its length and pages, the free list its order, the pools their values."""
    cache = _small_cache()
    cache.add_sequence(0)
    k = torch.ones(2, 3, 1, 16, dtype=torch.float16)
    free_before = cache.allocator.free_pages
    for bad, error, match in ((k.numpy(), TypeError, "k must be a torch.Tensor, got ndarray"),
                              (k.to("meta"), ValueError, "k is on the meta device"),
                              (k[:, :, :, :8], ValueError, r"k must be \[num_layers")):
        with pytest.raises(error, match=match):
            cache.append(0, bad, k)
    def broken_write(*args):
        raise RuntimeError("device lost")
    monkeypatch.setattr(cache, "_write", broken_write)
    with pytest.raises(RuntimeError, match="device lost"):
        cache.append(0, k, k)
    assert cache.seq_len(0) == 0 and cache.allocator.sequence(0).pages == []
    assert cache.allocator.free_pages == free_before
    assert all((pool == 0).all() for pool in cache.pools)


def test_write_slots_checks_every_index_first():
    cache = _small_cache()
    k = torch.ones(2, 3, 1, 16, dtype=torch.float16)
    for pages, slots, match in (([0, 9, 1], [0, 1, 2], r"pages\[1\]=9 is outside \[0, 4\)"),
                                ([0, 1, 2], [0, 4, 1], r"slots\[1\]=4 is outside \[0, 4\)"),
                                ([0, 1], [0, 1, 2], "pages must be 3 integers"),
                                ([0.0, 1.0, 2.0], [0, 1, 2], "pages must be 3 integers")):
        with pytest.raises(ValueError, match=match):
            cache.write_slots(np.asarray(pages), np.asarray(slots), k, k)
    for pages, match in (([[0, 1], 2, 3], "pages must be 3 integers"),
                         (torch.zeros(3, dtype=torch.int64, device="meta"),
                          "pages is on the meta device")):
        with pytest.raises(ValueError, match=re.escape(match)):
            cache.write_slots(pages, [0, 1, 2], k, k)
    assert all((pool == 0).all() for pool in cache.pools)
    cache.write_slots(torch.tensor([0, 1, 3]), [0, 1, 3], k, k)
    assert cache.pools[1][3, 1].float().sum() == 16


@pytest.mark.parametrize("form", ["csr", "block"])
def test_a_page_table_on_the_meta_device_is_refused(form):
    case = make_case(seq_lens=[20, 40], **HEADS)
    if form == "csr":
        kwargs = {**csr_kwargs(case.table)}
        kwargs["kv_indices"] = kwargs["kv_indices"].to("meta")
        name = "kv_indices"
    else:
        from paged_case import block_kwargs
        kwargs = {**block_kwargs(case.table)}
        kwargs["block_table"] = kwargs["block_table"].to("meta")
        name = "block_table"
    with pytest.raises(ValueError, match=f"{name} is on meta"):
        DecodeWrapper("NHD").plan(**kwargs, **HEADS, check_page_table=True)


@pytest.mark.parametrize("first_pages", [False, True], ids=["", "first-pages"])
@pytest.mark.parametrize("form", ["csr", "block"])
@pytest.mark.parametrize("bad_page", [10**6, -5])
def test_out_of_pool_page_indices_read_page_0_and_are_counted(form, bad_page, first_pages):
    """A trusted page table with an entry outside the pool: run() reads page 0 in its place (no
    read outside the pool; the row is what the table with page 0 there gives), the other rows
    are right, and check() names the count once per step however many layers ran. With
    first_pages, the bad entry is a task's first page, which the planner copies unchecked and
    the decode kernel clamps."""
    from paged_case import block_kwargs
    from persistentkv.tuning import KernelConfig

    case = make_case(seq_lens=[40, 70, 33], **HEADS)
    pages = [p.copy() for p in case.table.row_pages]
    pages[1][2] = bad_page                                   # row 1's third page
    table = PageTable(row_pages=tuple(pages), seq_lens=case.table.seq_lens, page_size=16)
    kwargs = csr_kwargs(table) if form == "csr" else block_kwargs(table)
    pages[1][2] = 0
    as_read = PageTable(row_pages=tuple(pages), seq_lens=case.table.seq_lens, page_size=16)
    wrapper = DecodeWrapper("NHD")
    wrapper.check()                                          # nothing planned yet: nothing to say
    config = KernelConfig(first_pages=True) if first_pages else None
    wrapper.plan(**kwargs, **HEADS, backend="split", split_pages=1, config=config)
    for _ in range(2):                                       # two layers: one copy, one count
        out = torch.full_like(case.q, float("nan"))
        wrapper.run(case.q, case.kv_cache, out=out)
    ref, _ = reference_decode(case.q, case.kv_cache, layout="NHD", **csr_kwargs(as_read))
    assert relative_error(out, ref) <= TOLERANCE[torch.float16]
    with pytest.raises(ValueError,
                       match=r"^since the last check\(\), 1 used page-table entries were outside"):
        wrapper.check()
    wrapper.check()                                          # reset: quiet until the next one
    wrapper.plan(**kwargs, **HEADS, backend="split", split_pages=1, config=config)
    wrapper.run(case.q, case.kv_cache)                       # a new step copies and counts again
    with pytest.raises(ValueError, match=r"^since the last check\(\), 1 used page-table entries"):
        wrapper.check()
    with pytest.raises(ValueError, match=r"outside the pool of \d+ pages|negative page index"):
        wrapper.plan(**kwargs, **HEADS, check_page_table=True)
        wrapper.run(case.q, case.kv_cache)


@pytest.mark.parametrize("stride, counted", [(0, 1), (2, 2)], ids=["expanded", "overlapping"])
def test_the_guard_checks_rows_that_share_entries(stride, counted):
    """A trusted block table whose rows overlap in memory (an expanded table's row stride 0, or
    a stride under the width): every row's used entries are copied and checked, so an entry
    outside the pool reads page 0 and check() counts it for each row that uses it."""
    case = make_case(seq_lens=[60, 40], **HEADS)             # a pool of 10 pages
    flat = torch.tensor(np.random.default_rng().permutation(10)[:6], dtype=torch.int32,
                        device=DEVICE)
    flat[3] = 10**6                                          # row 0's fourth entry
    table = flat.as_strided((2, 4), (stride, 1))
    lens = torch.tensor([60, 40], dtype=torch.int32, device=DEVICE)   # 4 and 3 pages used
    wrapper = DecodeWrapper("NHD")
    wrapper.plan(block_table=table, seq_lens=lens, **HEADS, backend="split", split_pages=1)
    out = torch.full_like(case.q, float("nan"))
    wrapper.run(case.q, case.kv_cache, out=out)
    read = flat.clone()
    read[3] = 0
    rows = (read[0:4].cpu().numpy(), read[stride:stride + 3].cpu().numpy())
    as_read = PageTable(row_pages=rows, seq_lens=np.asarray([60, 40]), page_size=16)
    ref, _ = reference_decode(case.q, case.kv_cache, layout="NHD", **csr_kwargs(as_read))
    assert relative_error(out, ref) <= TOLERANCE[torch.float16]
    with pytest.raises(ValueError, match=rf"^since the last check\(\), {counted} used page-table "
                                         rf"entries were outside the pool"):
        wrapper.check()


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph-mode"])
@pytest.mark.parametrize("form", ["csr", "block"])
def test_rows_longer_than_their_table_are_cut_and_counted(form, graph):
    """A trusted table whose lengths it cannot hold: row 1 runs past its pages (seq_lens past
    block_table's width, or kv_last_page_len past page_size), and row 2's length is negative
    (block) or kv_indptr[-1] is past kv_indices (CSR). Each row is cut to what its table holds
    (no read past it), the other rows are right, and check() counts the rows once per plan."""
    from paged_case import block_kwargs

    case = make_case(seq_lens=[40, 70, 33], **HEADS)
    if form == "csr":
        kwargs = csr_kwargs(case.table)
        kwargs["kv_last_page_len"][1] = 17
        kwargs["kv_indptr"][3] += 5
    else:
        kwargs = block_kwargs(case.table)
        assert kwargs["block_table"].shape[1] == 5                 # row 1's five pages
        kwargs["seq_lens"][1] = 90
        kwargs["seq_lens"][2] = -3
    as_read = PageTable(row_pages=case.table.row_pages, seq_lens=np.asarray([40, 80, 33]),
                        page_size=16)
    kw = dict(use_cuda_graph=True, max_batch_size=3, max_num_pages=32) if graph else {}
    wrapper = DecodeWrapper("NHD", **kw)
    for _ in range(2):
        wrapper.plan(**kwargs, **HEADS, backend="split", split_pages=1)
        out = torch.full_like(case.q, float("nan"))
        wrapper.run(case.q, case.kv_cache, out=out)
    ref, _ = reference_decode(case.q, case.kv_cache, layout="NHD", **csr_kwargs(as_read))
    kept = [0, 1, 2] if form == "csr" else [0, 1]             # block row 2 is empty: not written
    assert relative_error(out[kept], ref[kept]) <= TOLERANCE[torch.float16]
    with pytest.raises(ValueError, match=r"^since the last check\(\), 4 rows had lengths their "
                                         r"page table cannot hold"):
        wrapper.check()
    wrapper.check()                                          # reset
    with pytest.raises(ValueError,
                       match=r"kv_indptr\[-1\]=16 is past|seq_lens\[2\]=-3 is negative"):
        wrapper.plan(**kwargs, **HEADS, check_page_table=True)


def test_graph_mode_counts_rows_of_more_queries_than_the_tile_holds():
    """Graph mode reads qo_indptr on the device only: a row of more query tokens than the tile
    (max_queries_per_row=2: a tile of 2), or of a negative count, is clamped by the kernel (its
    outputs are wrong) and counted once per plan for check(); a qo_indptr within the tile
    matches the reference and check() passes."""
    from paged_case import queries

    case = make_case(seq_lens=[40, 70], **HEADS)
    wrapper = DecodeWrapper("NHD", use_cuda_graph=True, max_batch_size=2, max_num_pages=32,
                            max_queries_per_row=2)
    q, good = queries(case, [1, 2], seed=0)
    indptr = good.to(case.q.device)                 # refilled in place, as before a replay
    wrapper.plan(**csr_kwargs(case.table), **HEADS, qo_indptr=indptr)
    out = torch.full_like(q, float("nan"))
    wrapper.run(q, case.kv_cache, out=out)
    ref, _ = reference_decode(q, case.kv_cache, layout="NHD", qo_indptr=good,
                              **csr_kwargs(case.table))
    assert relative_error(out, ref) <= TOLERANCE[torch.float16]
    wrapper.check()
    for wrong in ([0, 1, 5], [0, 2, 1]):            # 4 queries in row 1; then a count of -1
        indptr.copy_(torch.tensor(wrong, dtype=torch.int32))
        for _ in range(2):
            wrapper.plan(**csr_kwargs(case.table), **HEADS, qo_indptr=indptr)
        with pytest.raises(ValueError, match=r"^since the last check\(\), 2 rows had query "
                                             r"counts \(qo_indptr\) negative or over the tile"):
            wrapper.check()
        wrapper.check()                             # reset


def test_page_guard_copies_refilled_tables_and_ignores_padding():
    """A plan() of the same tensors refilled in place (the planner's replan path) copies the new
    values; block-table padding past a row's pages may hold anything and is not counted."""
    from paged_case import block_kwargs

    case = make_case(seq_lens=[40, 70], **HEADS)
    kwargs = block_kwargs(case.table)
    table = kwargs["block_table"]
    wrapper = DecodeWrapper("NHD")
    wrapper.plan(**kwargs, **HEADS)
    wrapper.run(case.q, case.kv_cache)
    wrapper.check()
    good = table.clone()
    pad = torch.arange(table.shape[1], device=table.device)[None, :] >= torch.tensor(
        [3, 5], device=table.device)[:, None]
    table[pad] = -7                                          # padding: anything goes
    table[0, 1] = 10**7                                      # a used entry: counted
    wrapper.plan(**kwargs, **HEADS)
    wrapper.run(case.q, case.kv_cache)
    with pytest.raises(ValueError, match=r"^since the last check\(\), 1 used page-table entries"):
        wrapper.check()
    table.copy_(good)
    wrapper.plan(**kwargs, **HEADS)
    out = torch.full_like(case.q, float("nan"))
    wrapper.run(case.q, case.kv_cache, out=out)
    wrapper.check()
    ref, _ = reference_decode(case.q, case.kv_cache, layout="NHD", **csr_kwargs(case.table))
    assert relative_error(out, ref) <= TOLERANCE[torch.float16]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph-mode"])
def test_a_block_table_of_no_columns_runs_its_empty_rows(graph):
    """A trusted block table with no columns (every row empty, as a [B, 0] slice) addresses no
    page: its guard copies nothing, and run() leaves the empty rows' output untouched."""
    case = make_case(seq_lens=[5, 9], **HEADS)
    table = torch.zeros(2, 3, dtype=torch.int32, device=DEVICE)[:, :0]
    kw = dict(use_cuda_graph=True, max_batch_size=2, max_num_pages=4) if graph else {}
    wrapper = DecodeWrapper("NHD", **kw)
    wrapper.plan(block_table=table, seq_lens=torch.zeros(2, dtype=torch.int32, device=DEVICE),
                 **HEADS)
    assert wrapper.current_plan.guard.extent == 0
    out = torch.full_like(case.q, 7.0)
    wrapper.run(case.q, case.kv_cache, out=out)
    assert bool((out == 7.0).all())


def test_a_replaced_workspace_gets_its_own_launches(monkeypatch):
    """A planner's workspace is replaced when it plans on another device; launches bound to the
    old one are keyed by a serial, not id(), which a new workspace can reuse once the old is freed
    (the stale launch filled the old one's tasks: the new one's info read none). Here every
    workspace gets the same id(), the worst case."""
    from persistentkv import planner as planner_module

    case = make_case(seq_lens=[70, 9, 33], num_qo_heads=8, num_kv_heads=2, head_dim=64,
                     page_size=16)
    monkeypatch.setattr(planner_module, "id", lambda obj: 1, raising=False)
    wrapper = DecodeWrapper("NHD")
    ref, _ = reference_decode(case.q, case.kv_cache, layout="NHD", **csr_kwargs(case.table))
    serials = set()
    for _ in range(3):
        plan = wrapper.plan(**csr_kwargs(case.table), num_qo_heads=8, num_kv_heads=2,
                            head_dim=64, page_size=16)
        serials.add(plan.workspace.serial)
        assert plan.info()["num_tasks"] == 3
        out = torch.full_like(case.q, float("nan"))
        wrapper.run(case.q, case.kv_cache, out=out)
        assert relative_error(out, ref) <= TOLERANCE[torch.float16]
        plan.workspace.device = torch.device("meta")   # as if its last plan ran on another GPU
    assert len(serials) == 3


@pytest.mark.parametrize("fails_in", ["bind", "reserve", "launch"])
def test_a_plan_that_fails_after_growing_the_workspace_leaves_the_last_plan_whole(
        monkeypatch, fails_in):
    """A plan that needs larger buffers and fails once it has them (here the planner's bind, its
    launch, or the reserve's last allocation, as an out-of-memory would) puts the buffers back: the last
    plan still runs right, with a run signature it had not launched before too, and a later
    plan of that larger batch runs right."""
    from persistentkv import planner as planner_module

    small = make_case(seq_lens=[70, 9], **HEADS)
    large = make_case(seq_lens=[900, 400, 1300, 64, 250, 700], **HEADS)
    wrapper = DecodeWrapper("NHD")
    wrapper.plan(**csr_kwargs(small.table), **HEADS, backend="split", split_pages=1)
    before = wrapper.current_plan
    snapshot = before.workspace.snapshot()

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory (injected)")
    if fails_in == "bind":
        monkeypatch.setattr(planner_module.Planner, "_bind", fail)
    elif fails_in == "launch":                      # bound to the grown buffers, then fails
        monkeypatch.setattr(planner_module.BoundLaunch, "with_pointers", fail)
    else:
        real_zeros = torch.zeros
        def zeros(*args, **kwargs):     # the counters, allocated last
            if kwargs.get("dtype") is torch.int32 and args and args[0] >= 1024:
                fail()
            return real_zeros(*args, **kwargs)
        monkeypatch.setattr(planner_module.torch, "zeros", zeros)
    with pytest.raises(RuntimeError, match="injected"):
        wrapper.plan(**csr_kwargs(large.table), **HEADS, backend="split", split_pages=1)
    monkeypatch.undo()
    assert wrapper.current_plan is before
    assert all(a is b for a, b in zip(before.workspace.snapshot(), snapshot))
    # no planner launch bound to the discarded buffers is kept (nor their memory)
    assert all(key[1] <= before.workspace.generation for key in wrapper._planner._bound)
    ref, _ = reference_decode(small.q, small.kv_cache, layout="NHD", **csr_kwargs(small.table))
    out = torch.full_like(small.q, float("nan"))
    wrapper.run(small.q, small.kv_cache, out=out, return_lse=True)
    assert relative_error(out, ref) <= TOLERANCE[torch.float16]
    wrapper.plan(**csr_kwargs(large.table), **HEADS, backend="split", split_pages=1)
    ref, _ = reference_decode(large.q, large.kv_cache, layout="NHD", **csr_kwargs(large.table))
    out = torch.full_like(large.q, float("nan"))
    wrapper.run(large.q, large.kv_cache, out=out, return_lse=True)
    assert relative_error(out, ref) <= TOLERANCE[torch.float16]


def test_plan_caches_stay_bounded():
    """Plans of ever new options (here 100 softmax scales) keep a bounded number of setups and
    bound launches (the setups grew by one a plan)."""
    case = make_case(seq_lens=[20, 9], num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    wrapper = DecodeWrapper("NHD")
    for i in range(100):
        wrapper.plan(**csr_kwargs(case.table), num_qo_heads=8, num_kv_heads=2, head_dim=64,
                     page_size=16, sm_scale=0.1 + i / 1000)
    planner = wrapper._planner
    assert len(planner._setups) <= 65 and len(planner._bound) <= 65
