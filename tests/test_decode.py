"""Every schedule against the float64 reference: both layouts, fp16 and bf16, curated shapes."""
import re

import numpy as np
import pytest
import torch

from paged_case import ON_GPU, block_kwargs, csr_kwargs, make_case
from persistentkv import BACKENDS, TOLERANCE, DecodeWrapper, reference_decode, relative_error


def schedule(backend, split_pages=None) -> dict:
    """plan()'s schedule options: split_pages goes with backend="split" only ("grouped" keeps rows
    whole, "auto" picks the split itself)."""
    return dict(backend=backend, split_pages=split_pages if backend == "split" else None)

# (num_qo_heads, num_kv_heads, head_dim, page_size, seq_lens): odd lengths, last page full and
# holding 1 token, mixed lengths in one batch, group sizes 1, 4, 5, 8, 7, 16.
SHAPES = [
    pytest.param(8, 2, 128, 16, [1, 17, 300, 64], id="g4-d128-p16-mixed"),
    pytest.param(2, 2, 64, 16, [33, 161], id="g1-d64-p16"),
    pytest.param(10, 2, 64, 8, [77, 9, 40], id="g5-d64-p8"),
    pytest.param(8, 1, 64, 1, [50, 3], id="g8-d64-p1"),
    pytest.param(4, 1, 64, 32, [32, 65, 200], id="g4-d64-p32"),
    pytest.param(7, 1, 128, 64, [130, 64], id="g7-d128-p64"),
]
DTYPES = [torch.float16, torch.bfloat16]


def check(case, wrapper, out, lse=None):
    ref, ref_lse = reference_decode(case.q, case.kv_cache, layout=case.layout,
                                    sm_scale=wrapper.current_plan.sm_scale, **csr_kwargs(case.table))
    err = relative_error(out, ref)
    assert err <= TOLERANCE[case.q.dtype], f"relative error {err:.2e} over {TOLERANCE[case.q.dtype]}"
    if lse is not None:
        lse_err = relative_error(lse, ref_lse)
        assert lse_err <= 1e-5, f"lse relative error {lse_err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hq, hkv, dim, page, lens", SHAPES)
def test_matches_reference(backend, layout, dtype, hq, hkv, dim, page, lens):
    case = make_case(seq_lens=lens, num_qo_heads=hq, num_kv_heads=hkv, head_dim=dim, page_size=page,
                     dtype=dtype, layout=layout)
    wrapper = DecodeWrapper(layout)
    # small splits, so that "split" cuts rows into several tasks and merges them
    wrapper.plan(**csr_kwargs(case.table), num_qo_heads=hq, num_kv_heads=hkv, head_dim=dim,
                 page_size=page, **schedule(backend, max(1, 48 // page)))
    out = torch.full_like(case.q, float("nan"))
    wrapper.run(case.q, case.kv_cache, out=out)
    check(case, wrapper, out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_table_pair_cache_and_lse(backend):
    """block_table + seq_lens input, a (k, v) pair cache, lse returned, default split size."""
    case = make_case(seq_lens=[5, 250, 48, 1], num_qo_heads=16, num_kv_heads=4, head_dim=64,
                     page_size=16, layout="HND", as_pair=True)
    wrapper = DecodeWrapper("HND")
    wrapper.plan(**block_kwargs(case.table), num_qo_heads=16, num_kv_heads=4, head_dim=64,
                 page_size=16, backend=backend, sm_scale=0.3)
    out, lse = wrapper.run(case.q, case.kv_cache, return_lse=True)
    assert out.dtype == case.q.dtype and lse.dtype == torch.float32 and lse.shape == (4, 16)
    check(case, wrapper, out, lse)


@pytest.mark.parametrize("form", ["csr", "block"])
@pytest.mark.parametrize("hq, hkv, dim", [(8, 2, 128), (3, 3, 64), (16, 2, 64)],
                         ids=["g4-d128", "g1-d64", "g8-d64"])
def test_merge_of_many_splits(form, hq, hkv, dim):
    """Rows of 63, 1 and 19 splits of one page: long merges, group sizes 1, 4 and 8, lse."""
    case = make_case(seq_lens=[1000, 5, 300], num_qo_heads=hq, num_kv_heads=hkv, head_dim=dim,
                     page_size=16)
    wrapper = DecodeWrapper("NHD")
    table = csr_kwargs(case.table) if form == "csr" else block_kwargs(case.table)
    plan = wrapper.plan(**table, num_qo_heads=hq, num_kv_heads=hkv, head_dim=dim, page_size=16,
                        backend="split", split_pages=1)
    assert plan.info()["num_tasks"] == 63 + 1 + 19
    out = torch.full_like(case.q, float("nan"))
    out, lse = wrapper.run(case.q, case.kv_cache, out=out, return_lse=True)
    check(case, wrapper, out, lse)


def test_merge_of_many_splits_in_bf16():
    """Partials are kept in the output's dtype: bf16 partials of 63 splits (two levels, the
    groups' results rounded to bf16 again) stay within bf16's bound, and the lse within 1e-5."""
    case = make_case(seq_lens=[1000, 37], num_qo_heads=8, num_kv_heads=2, head_dim=128,
                     page_size=16, dtype=torch.bfloat16)
    wrapper = DecodeWrapper("NHD")
    wrapper.plan(**csr_kwargs(case.table), num_qo_heads=8, num_kv_heads=2, head_dim=128,
                 page_size=16, backend="split", split_pages=1)
    out = torch.full_like(case.q, float("nan"))
    out, lse = wrapper.run(case.q, case.kv_cache, out=out, return_lse=True)
    check(case, wrapper, out, lse)


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_dim_256_group_16(backend):
    case = make_case(seq_lens=[70, 20], num_qo_heads=16, num_kv_heads=1, head_dim=256, page_size=16)
    wrapper = DecodeWrapper("NHD")
    wrapper.plan(**csr_kwargs(case.table), num_qo_heads=16, num_kv_heads=1, head_dim=256,
                 page_size=16, **schedule(backend, 2))
    check(case, wrapper, wrapper.run(case.q, case.kv_cache))


def test_page_size_128_and_one_plan_many_layers():
    """One plan serves several layers' pools (each with its own data)."""
    cases = [make_case(seq_lens=[129, 300], num_qo_heads=4, num_kv_heads=2, head_dim=64,
                       page_size=128, seed=7) for _ in range(2)]
    # same page table (same seed), different data
    for c in cases[1:]:
        assert all((a == b).all() for a, b in zip(c.table.row_pages, cases[0].table.row_pages))
    wrapper = DecodeWrapper("NHD")
    wrapper.plan(**csr_kwargs(cases[0].table), num_qo_heads=4, num_kv_heads=2, head_dim=64,
                 page_size=128, backend="split", split_pages=1)
    for case in cases:
        check(case, wrapper, wrapper.run(case.q, case.kv_cache))


def test_empty_batch():
    case = make_case(seq_lens=[], num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    wrapper = DecodeWrapper("NHD")
    wrapper.plan(**csr_kwargs(case.table), num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    out = wrapper.run(case.q, case.kv_cache)
    assert out.shape == (0, 8, 64)


def test_results_do_not_depend_on_the_schedule():
    """The three schedules agree with each other far tighter than with the tolerance."""
    case = make_case(seq_lens=[400, 3, 129], num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    outs = []
    for backend in BACKENDS:
        wrapper = DecodeWrapper("NHD")
        wrapper.plan(**csr_kwargs(case.table), num_qo_heads=8, num_kv_heads=2, head_dim=64,
                     page_size=16, **schedule(backend, 4))
        outs.append(wrapper.run(case.q, case.kv_cache).float())
    for other in outs[1:]:
        assert (other - outs[0]).abs().max() < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA: long rows and big batches are too slow to interpret")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("lens", [[32768], [8192] * 8 + [1] * 8, list(range(1, 4000, 37))],
                         ids=["B1-32K", "B16-mixed", "B109-ramp"])
def test_gpu_large(backend, dtype, lens):
    case = make_case(seq_lens=lens, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                     dtype=dtype)
    wrapper = DecodeWrapper("NHD")
    wrapper.plan(**csr_kwargs(case.table), num_qo_heads=32, num_kv_heads=8, head_dim=128,
                 page_size=16, backend=backend)
    out = torch.full_like(case.q, float("nan"))
    wrapper.run(case.q, case.kv_cache, out=out)
    check(case, wrapper, out)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA and about 6 GB of device memory")
def test_gpu_pool_past_2_pow_31_elements():
    """Pages past element 2^31 of the pool: offsets must be int64."""
    page_size, heads, dim = 16, 8, 128
    num_pages = (2**31) // (2 * page_size * heads * dim) + 64          # > 2^31 elements in all
    cache = torch.empty(num_pages, 2, page_size, heads, dim, dtype=torch.float16, device="cuda")
    cache[-64:].normal_()
    pages = torch.arange(num_pages - 64, num_pages, dtype=torch.int32, device="cuda").flip(0)
    indptr = torch.tensor([0, 40, 64], dtype=torch.int32, device="cuda")
    last = torch.tensor([16, 7], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 32, dim, dtype=torch.float16, device="cuda")
    for backend in BACKENDS:
        wrapper = DecodeWrapper("NHD")
        wrapper.plan(kv_indptr=indptr, kv_indices=pages, kv_last_page_len=last, num_qo_heads=32,
                     num_kv_heads=heads, head_dim=dim, page_size=page_size, backend=backend)
        out = wrapper.run(q, cache)
        ref, _ = reference_decode(q, cache, layout="NHD", kv_indptr=indptr, kv_indices=pages,
                                  kv_last_page_len=last)
        assert relative_error(out, ref) <= TOLERANCE[torch.float16], backend


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA: a 1M-token row")
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_one_million_tokens(backend):
    case = make_case(seq_lens=[1 << 20], num_qo_heads=4, num_kv_heads=1, head_dim=64, page_size=16)
    wrapper = DecodeWrapper("NHD")
    wrapper.plan(**csr_kwargs(case.table), num_qo_heads=4, num_kv_heads=1, head_dim=64, page_size=16,
                 backend=backend)
    check(case, wrapper, wrapper.run(case.q, case.kv_cache))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA: 1024 rows")
def test_gpu_batch_1024():
    lens = torch.randint(1, 600, (1024,), generator=torch.Generator().manual_seed(3)).tolist()
    case = make_case(seq_lens=lens, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    for backend in BACKENDS:
        wrapper = DecodeWrapper("NHD")
        wrapper.plan(**csr_kwargs(case.table), num_qo_heads=32, num_kv_heads=8, head_dim=128,
                     page_size=16, backend=backend)
        check(case, wrapper, wrapper.run(case.q, case.kv_cache))


@pytest.mark.parametrize("split_pages", [2, None], ids=["split@2", "default-split"])
def test_merge_counters_reset_and_runs_repeat_bitwise(split_pages):
    """The last task of a row merges it and leaves the row's counter at zero, and the last claim
    resets the claim counter, so the next launch (another layer, or a graph replay) starts clean;
    the merge order is fixed, so reruns agree."""
    case = make_case(seq_lens=[300, 7, 129], num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    wrapper = DecodeWrapper("NHD")
    plan = wrapper.plan(**csr_kwargs(case.table), num_qo_heads=8, num_kv_heads=2, head_dim=64,
                        page_size=16, backend="split", split_pages=split_pages)
    assert (plan.task_records()[:, 6] > 1).any()              # some row merges
    first = wrapper.run(case.q, case.kv_cache).clone()
    assert int(plan.workspace.counters.abs().sum()) == 0
    assert int(plan.workspace.info[3]) == 0                    # the claim counter
    second = wrapper.run(case.q, case.kv_cache)
    assert torch.equal(first, second)
    check(case, wrapper, second)


@pytest.mark.parametrize("as_pair", [False, True], ids=["pool", "kv-pair"])
def test_every_call_reads_its_own_pointers(as_pair):
    """After the first launch of a specialization, run() calls the compiled launcher directly with
    the plan's buffers bound as addresses: each call must still read its own q, cache, out and lse,
    and a new plan (same specialization, new buffers) its own page table."""
    wrapper = DecodeWrapper("HND")
    for step, lens in enumerate([[300, 7, 129], [40, 500, 1]]):
        cases = [make_case(seq_lens=lens, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                           layout="HND", as_pair=as_pair, seed=10 + step) for _ in range(3)]
        for c in cases[1:]:       # one page table per step, fresh q and K/V per layer
            c.table = cases[0].table
        wrapper.plan(**csr_kwargs(cases[0].table), num_qo_heads=8, num_kv_heads=2, head_dim=64,
                     page_size=16, backend="split", split_pages=2)
        for layer, case in enumerate(cases):
            out = torch.full_like(case.q, float("nan"))
            got, lse = wrapper.run(case.q, case.kv_cache, out=out, return_lse=True)
            assert got is out
            check(case, wrapper, out, lse)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the direct launch exists only for compiled kernels; the "
                                       "interpreter always takes Triton's own path")
def test_gpu_later_launches_skip_tritons_binding_unless_hooked(monkeypatch):
    """The first launch of a specialization goes through kernel[grid]; later ones, and those of a
    new plan with the same specialization, call the compiled launcher directly (the planner's and
    the decode kernel's alike); a registered launch hook (a profiler) sends them back through
    Triton's path, which calls it. kernel[grid] is watched on Triton's JIT function class."""
    from triton import knobs

    from persistentkv.kernels.decode import paged_decode_kernel
    from persistentkv.kernels.plan import plan_kernel

    ours = {id(paged_decode_kernel): "decode", id(plan_kernel): "plan"}
    bound = []
    jit_class = type(paged_decode_kernel)
    assert type(plan_kernel) is jit_class
    binding = jit_class.__getitem__

    def watched(kernel, grid):
        if id(kernel) in ours:
            bound.append(ours[id(kernel)])
        return binding(kernel, grid)

    monkeypatch.setattr(jit_class, "__getitem__", watched)

    def case_for(seed):
        return make_case(seq_lens=[300, 7, 129], num_qo_heads=8, num_kv_heads=2, head_dim=64,
                         page_size=16, seed=seed)

    wrapper, heads = DecodeWrapper("NHD"), dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    first = case_for(1)
    wrapper.plan(**csr_kwargs(first.table), **heads)
    check(first, wrapper, wrapper.run(first.q, first.kv_cache))
    assert sorted(set(bound)) == ["decode", "plan"]        # the watch sees Triton's path
    bound.clear()
    for seed in (2, 3):
        case = case_for(seed)
        wrapper.plan(**csr_kwargs(case.table), **heads)
        check(case, wrapper, wrapper.run(case.q, case.kv_cache))
    assert bound == [], "a later launch went through kernel[grid]"
    seen = []
    hook = lambda metadata: seen.append(metadata)  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        wrapper.plan(**csr_kwargs(case.table), **heads)
        check(case, wrapper, wrapper.run(case.q, case.kv_cache))
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert sorted(set(bound)) == ["decode", "plan"] and len(seen) >= 2


def test_checks_still_run_after_a_cached_signature():
    case = make_case(seq_lens=[30, 50], num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    wrapper = DecodeWrapper("NHD")
    wrapper.plan(**csr_kwargs(case.table), num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                 check_page_table=True)      # run() then checks the page range against the pool
    wrapper.run(case.q, case.kv_cache)
    with pytest.raises(TypeError, match="q.dtype=torch.bfloat16 differs"):
        wrapper.run(case.q.bfloat16(), case.kv_cache)
    with pytest.raises(ValueError, match="kv_cache fits neither layout"):
        wrapper.run(case.q, case.kv_cache[:, 0])
    small = case.kv_cache[:2]                        # too few pages for this plan's page table
    with pytest.raises(ValueError, match="outside the pool of 2 pages"):
        wrapper.run(case.q, small)


@pytest.mark.parametrize("page, block_n", [(12, 32), (8, 128), (32, 16), (128, 64), (1, 16)],
                         ids=["p12-not-a-power-of-two", "p8-16-pages-per-tile", "p32-tile-in-page",
                              "p128-tile-in-page", "p1"])
@pytest.mark.parametrize("backend", ["split", "grouped"])
def test_page_size_and_tile_combinations(backend, page, block_n):
    """Tiles spanning many pages, tiles inside one page, and a page size that is not a power of two."""
    from persistentkv.tuning import KernelConfig

    case = make_case(seq_lens=[5, 200, 97], num_qo_heads=4, num_kv_heads=1, head_dim=64,
                     page_size=page, layout="HND")
    wrapper = DecodeWrapper("HND")
    wrapper.plan(**csr_kwargs(case.table), num_qo_heads=4, num_kv_heads=1, head_dim=64,
                 page_size=page, **schedule(backend, max(1, 64 // page)),
                 config=KernelConfig(block_n=block_n, num_stages=2))
    check(case, wrapper, wrapper.run(case.q, case.kv_cache))


@pytest.mark.parametrize("layout, page", [("NHD", 16), ("HND", 64), ("HND_VT", 16)])
@pytest.mark.parametrize("backend", ["grouped", "split"])
def test_long_tasks_take_their_own_tile(backend, layout, page):
    """KernelConfig(long_block_n=): tasks of at least long_from_tokens tokens read tiles of
    long_block_n tokens, the others block_n, in one launch (rows of 700 and 300 tokens are long
    tasks, 40 and 5 short, as whole rows; split@8 pages cuts them all short), NaN-poisoned."""
    from persistentkv.tuning import KernelConfig

    case = make_case(seq_lens=[700, 40, 300, 5], num_qo_heads=8, num_kv_heads=2, head_dim=64,
                     page_size=page, layout=layout)
    wrapper = DecodeWrapper(layout)
    wrapper.plan(**csr_kwargs(case.table), num_qo_heads=8, num_kv_heads=2, head_dim=64,
                 page_size=page, **schedule(backend, max(1, 128 // page)),
                 config=KernelConfig(block_n=32, long_block_n=64, long_from_tokens=256,
                                     num_stages=2))
    out = wrapper.run(case.q, case.kv_cache, out=torch.full_like(case.q, float("nan")))
    check(case, wrapper, out)


def _first_pages_expected(plan, indices: torch.Tensor) -> np.ndarray:
    """What the planner's copy of each task's first pages must hold: the table's entries from the
    task's first page on (indices: the flat table the planner read), 0 past its last page."""
    from persistentkv.kernels.plan import FIRST_PAGE_SLOTS

    flat, page = indices.reshape(-1).cpu().numpy(), plan.page_size
    records = plan.task_records()
    want = np.zeros((len(records), FIRST_PAGE_SLOTS), dtype=np.int64)
    for i, (_, _, tok_lo, tok_hi, page_start, *_) in enumerate(records):
        for j in range(FIRST_PAGE_SLOTS):
            if (tok_lo // page + j) * page < tok_hi:
                want[i, j] = flat[page_start + tok_lo // page + j]
    return want


@pytest.mark.parametrize("page, layout, form, slots", [
    (16, "NHD", "csr", 8), (8, "HND_VT", "block", 8), (64, "HND", "csr", 8),
    (4, "HND", "block", 0)], ids=["p16-4-pages", "p8-vt-8-pages-block", "p64-in-one-page",
                                  "p4-16-pages-reads-the-table-block"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_first_pages_from_the_planner(backend, page, layout, form, slots):
    """KernelConfig(first_pages=True): the planner copies each task's first pages beside its
    record, and each task's first K/V tile reads them there (its long tile's too: rows of 700
    and 300 tokens are long tasks as whole rows). Against the float64 reference, NaN-poisoned,
    and bitwise equal to the default's output (the same tiles read in the same order); the copy
    against the table. A first tile of more than FIRST_PAGE_SLOTS pages (page 4: 64 tokens are
    16 pages) reads the table as before. Split into 2 pages, the tasks outnumber the programs
    of the interpreter's 4 SMs (claimed; one round on a GPU); balanced, chunks link tasks of
    several rows."""
    import dataclasses

    from persistentkv.kernels.decode import decode_constexprs
    from persistentkv.kernels.plan import FIRST_PAGE_SLOTS
    from persistentkv.tuning import KernelConfig

    heads = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=page)
    config = KernelConfig(block_n=32, long_block_n=64, long_from_tokens=256, num_stages=2)
    on = dataclasses.replace(config, first_pages=True)
    assert decode_constexprs(num_kv_heads=2, group=4, head_dim=64, page_size=page, block_n=32,
                             long_block_n=64, return_lse=False, upcast=False,
                             first_pages=True)["FIRST_PAGES"] == slots
    case = make_case(seq_lens=[700, 40, 300, 5, 129], **heads, layout=layout)
    table = csr_kwargs(case.table) if form == "csr" else block_kwargs(case.table)
    outs = []
    for cfg in (config, on):
        wrapper = DecodeWrapper(layout)
        plan = wrapper.plan(**table, **heads, **schedule(backend, max(1, 32 // page)), config=cfg)
        out = wrapper.run(case.q, case.kv_cache, out=torch.full_like(case.q, float("nan")))
        check(case, wrapper, out)
        outs.append(out)
    indices = table["kv_indices"] if form == "csr" else table["block_table"]
    got = plan.workspace.first_pages[:plan.info()["num_tasks"], :FIRST_PAGE_SLOTS].cpu().numpy()
    assert np.array_equal(got, _first_pages_expected(plan, indices))
    assert torch.equal(outs[0], outs[1])


_PREFETCH_ON_GPU = pytest.mark.skipif(not ON_GPU, reason="the interpreter compiles the prefetch "
                                      "out: the HND case checks the option's way to the kernel")


@pytest.mark.parametrize("layout, form", [
    ("HND", "csr"), pytest.param("HND_VT", "block", marks=_PREFETCH_ON_GPU),
    pytest.param("NHD", "block", marks=_PREFETCH_ON_GPU)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_page_prefetch(backend, layout, form):
    """How the page indices are fetched: KernelConfig(page_prefetch_tiles=N), each K/V tile also
    asks the L2 for the page indices of the tile N ahead, clamped to its task's last page (rows
    of 5 and 40 tokens are shorter than the distance); page_prefetch_task, each task asks for
    all of its own at its start; keep_page_table, the index loads marked evict_last. Against
    the float64 reference, NaN-poisoned, and bitwise equal to the default's output (none
    changes a value). The prefetches are PTX: the interpreter compiles them out
    (decode.HW_PREFETCH), so on the CPU this checks the options' way from the config to the
    kernel; on a GPU, rows of 9K and 20K tokens run them hundreds of tiles deep (grouped and
    balanced tasks; split ones of 2 pages clamp the distance to their one tile), and a task's
    prefetch loop more than once (past 8 x block_n pages)."""
    import dataclasses

    from persistentkv.kernels.decode import decode_constexprs
    from persistentkv.tuning import KernelConfig

    heads = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    config = KernelConfig(block_n=32, long_block_n=64, long_from_tokens=256, num_stages=2)
    constexprs = decode_constexprs(num_kv_heads=2, group=4, head_dim=64, page_size=16,
                                   block_n=32, return_lse=False, upcast=False,
                                   page_prefetch_tiles=3, page_prefetch_task=True,
                                   keep_page_table=True)
    assert (constexprs["PAGE_PREFETCH"], constexprs["PAGE_PREFETCH_TASK"],
            constexprs["KEEP_PAGE_TABLE"]) == (3, True, True)
    case = make_case(seq_lens=[700, 40, 300, 5, 129] + ([9000, 20000] if ON_GPU else []),
                     **heads, layout=layout)
    table = csr_kwargs(case.table) if form == "csr" else block_kwargs(case.table)
    outs = []
    fetches = [{}, dict(page_prefetch_tiles=2), dict(page_prefetch_task=True),
               dict(keep_page_table=True)] + ([dict(page_prefetch_tiles=7)] if ON_GPU else [])
    for fetch in fetches:
        wrapper = DecodeWrapper(layout)
        wrapper.plan(**table, **heads, **schedule(backend, 2),
                     config=dataclasses.replace(config, **fetch))
        out = wrapper.run(case.q, case.kv_cache, out=torch.full_like(case.q, float("nan")))
        check(case, wrapper, out)
        outs.append(out)
    assert all(torch.equal(outs[0], out) for out in outs[1:])
    with pytest.raises(ValueError, match="KernelConfig.page_prefetch_tiles must be an int >= 0, "
                                         "got -1"):
        KernelConfig(page_prefetch_tiles=-1)
    for name in ("page_prefetch_task", "keep_page_table"):
        with pytest.raises(ValueError, match=f"KernelConfig.{name} must be a bool, got 1"):
            KernelConfig(**{name: 1})


def test_long_tile_config_is_checked():
    from persistentkv.tuning import KernelConfig

    assert KernelConfig(long_block_n=128).long_tile_tokens(kv_fp8=False) == 128
    assert KernelConfig(long_block_n=128).long_tile_tokens(kv_fp8=True) == 0   # fp8: its own tile
    assert KernelConfig().long_tile_tokens(kv_fp8=False) == 0
    # past 16 tile rows (query tokens x group) one loop: the long tile for every task
    cfg = KernelConfig(block_n=64, long_block_n=128)
    assert [(cfg.tile_tokens(kv_fp8=False, tile_rows=n), cfg.long_tile_tokens(kv_fp8=False,
                                                                              tile_rows=n))
            for n in (8, 16, 17, 128)] == [(64, 128), (64, 128), (128, 0), (128, 0)]
    assert cfg.tile_tokens(kv_fp8=True, tile_rows=32) == 64 and KernelConfig().tile_tokens(
        kv_fp8=False, tile_rows=32) == 64
    with pytest.raises(ValueError, match="KernelConfig.long_block_n must be a power of two >= 16, "
                                         "got 96"):
        KernelConfig(long_block_n=96)
    with pytest.raises(ValueError, match=re.escape(
            "KernelConfig.long_block_n must be None or above block_n (128), got 128")):
        KernelConfig(block_n=128, long_block_n=128)   # one tile twice: v27 measured it 1.2-1.5x
    with pytest.raises(ValueError, match="KernelConfig.long_from_tokens must be a positive int, "
                                         "got 0"):
        KernelConfig(long_from_tokens=0)


@pytest.mark.parametrize("name", ["num_warps", "num_stages", "programs_per_sm", "value_blocks",
                                  "min_split_tokens", "block_n", "max_tile_rows",
                                  "value_block_rows"])
def test_kernel_config_takes_numpy_integers_and_refuses_bools(name):
    """A numpy integer is an int (the same config, hashed alike); True is no count."""
    from persistentkv.tuning import KernelConfig

    value = getattr(KernelConfig(), name) or 64
    config = KernelConfig(**{name: np.int64(value)})
    assert type(getattr(config, name)) is int and config == KernelConfig(**{name: value})
    assert hash(config) == hash(KernelConfig(**{name: value}))
    with pytest.raises(ValueError, match=f"KernelConfig.{name} must be .*, got True"):
        KernelConfig(**{name: True})


def test_m_blocks_rule_and_checks():
    """max_tile_rows cuts a task's tile (query tokens x group, padded to a power of two >= 16)
    into M-blocks: the kernel's G_PAD and merge rows are a block's, M_BLOCKS their count."""
    from persistentkv.kernels.decode import decode_constexprs
    from persistentkv.tuning import KernelConfig

    cfg = KernelConfig(max_tile_rows=32)
    assert [(cfg.row_blocks(tile_rows=n), cfg.block_rows(tile_rows=n))
            for n in (1, 16, 32, 33, 112, 128)] == [(1, 1), (1, 16), (1, 32), (2, 17), (4, 28),
                                                    (4, 32)]
    assert KernelConfig(max_tile_rows=None).row_blocks(tile_rows=128) == 1
    assert [KernelConfig().row_blocks(tile_rows=n) for n in (64, 128)] == [1, 2]   # the default
    shape = dict(num_kv_heads=8, group=8, head_dim=64, page_size=16, block_n=64,
                 return_lse=False, upcast=False, max_queries=16)
    assert [decode_constexprs(**shape, m_blocks=m)[k] for m in (1, 4)
            for k in ("G_PAD", "G_MERGE", "M_BLOCKS")] == [128, 128, 1, 32, 32, 4]
    with pytest.raises(ValueError, match="m_blocks must cut the tile's 128 rows into blocks of "
                                         "at least 16, got 16"):
        decode_constexprs(**shape, m_blocks=16)
    with pytest.raises(ValueError, match="KernelConfig.max_tile_rows must be a power of two >= "
                                         "16, got 24"):
        KernelConfig(max_tile_rows=24)
    # min_tile_rows pads a whole tile of more than 16 rows, never one of 16 or fewer, nor an
    # M-block (whose rows place the next block's)
    assert [KernelConfig(min_tile_rows=64, max_tile_rows=m).program_rows(tile_rows=n)
            for m, n in ((None, 32), (None, 8), (64, 128), (32, 128), (32, 32), (16, 128))] == \
        [64, 16, 64, 32, 32, 16]
    assert decode_constexprs(**shape, m_blocks=1, g_pad=256)["G_PAD"] == 256
    for m, g in ((1, 64), (1, 192), (4, 64)):
        with pytest.raises(ValueError, match=f"g_pad must be a power of two of at least the "
                                             f"{128 // m} rows of a program .*, got {g}"):
            decode_constexprs(**shape, m_blocks=m, g_pad=g)
    with pytest.raises(ValueError, match="KernelConfig.min_tile_rows must be a power of two >= "
                                         "16, got 48"):
        KernelConfig(min_tile_rows=48)


def test_step_size_tile_rule():
    """KernelConfig.step_size / for_step: a step of at most small_step_kv_bytes_per_sm x SMs bytes
    of K/V is small and cuts a tile of more than 16 rows into M-blocks of half its rows, where
    the config cuts it less; one known (exact) to hold more is large and runs tiles of
    large_step_tile_rows rows or more in blocks of that many, where the config's are smaller;
    anything else keeps the config (the same object). Head dim 512's large steps run 64-row
    programs in two value blocks at two stages; its other programs one, at three."""
    from persistentkv.tuning import KernelConfig, default_config

    cfg = KernelConfig(small_step_kv_bytes_per_sm=1000)
    assert [cfg.step_size(kv_bytes=b, exact=e, sm_count=4)
            for b, e in ((4000, False), (4000, True), (4001, False), (4001, True))] == \
        ["small", "small", "either", "large"]
    assert KernelConfig().step_size(kv_bytes=1, exact=True, sm_count=4) == "either"
    assert [cfg.for_step(tile_rows=n, size="small").max_tile_rows for n in (20, 32, 64, 128)] == \
        [16, 16, 32, 64]
    assert [cfg.for_step(tile_rows=n, size="small") is cfg for n in (1, 16, 128)] == [True] * 3
    assert cfg.for_step(tile_rows=32, size="either") is cfg
    assert cfg.for_step(tile_rows=32, size="large") is cfg          # no large_step_tile_rows
    halves = cfg.for_step(tile_rows=64, size="small")
    assert (halves.row_blocks(tile_rows=64), halves.program_rows(tile_rows=64)) == (2, 32)
    d512 = default_config(head_dim=512, num_kv_heads=2)      # blocks of 16; 64 on large steps
    assert [d512.for_step(tile_rows=n, size="large").block_rows(tile_rows=n)
            for n in (8, 32, 64, 128)] == [8, 16, 64, 64]
    assert [d512.for_step(tile_rows=64, size=s) is d512 for s in ("small", "either")] == [True] * 2
    wide = d512.for_step(tile_rows=128, size="large")
    assert (wide.row_blocks(tile_rows=128), wide.program_rows(tile_rows=128),
            wide.column_blocks(tile_rows=128), wide.head_items(tile_rows=128),
            wide.stages(tile_rows=128)) == (2, 64, 2, 4, 2)
    assert (d512.column_blocks(tile_rows=128), d512.stages(tile_rows=128)) == (1, 3)
    assert (wide.column_blocks(tile_rows=32), wide.stages(tile_rows=32)) == (1, 3)
    assert default_config(head_dim=128, num_kv_heads=8).large_step_tile_rows is None
    with pytest.raises(ValueError, match="size must be 'small', 'large' or 'either', got 'big'"):
        cfg.for_step(tile_rows=32, size="big")
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=f"KernelConfig.small_step_kv_bytes_per_sm must be an "
                                             f"int >= 0, got {bad!r}"):
            KernelConfig(small_step_kv_bytes_per_sm=bad)
    with pytest.raises(ValueError, match="KernelConfig.large_step_tile_rows must be a power of "
                                         "two >= 16, got 24"):
        KernelConfig(large_step_tile_rows=24)
    with pytest.raises(ValueError, match="KernelConfig.value_block_stages must be None or a "
                                         "positive int, got 0"):
        KernelConfig(value_block_stages=0)


def test_register_cap_by_program_rows():
    """max_registers caps the programs of at most max_registers_rows rows (padded program rows,
    not a task's), every program where that is None; head dim 256's default caps one query a row
    and not 16 at group 2, head dim 512's runs tiles past 16 rows as blocks of 16."""
    from persistentkv.tuning import KernelConfig, default_config

    cfg = KernelConfig(max_registers=224, max_registers_rows=16, min_tile_rows=16)
    assert [cfg.registers(tile_rows=n) for n in (1, 16, 17, 32)] == [224, 224, None, None]
    assert KernelConfig(max_registers=224, max_tile_rows=16).registers(tile_rows=128) == 224
    assert KernelConfig(max_registers=200).registers(tile_rows=128) == 200
    assert KernelConfig().registers(tile_rows=1) is None
    d256 = default_config(head_dim=256, num_kv_heads=8)
    assert [d256.registers(tile_rows=2 * q) for q in (1, 8, 16)] == [224, 224, None]
    d512 = default_config(head_dim=512, num_kv_heads=2)
    assert [d512.row_blocks(tile_rows=8 * q) for q in (1, 2, 4, 8, 16)] == [1, 1, 2, 4, 8]
    with pytest.raises(ValueError, match="KernelConfig.max_registers_rows must be a power of two "
                                         ">= 16, got 8"):
        KernelConfig(max_registers_rows=8)


def test_compiled_kernels_one_per_specialization():
    """compiled_kernels lists what run() compiled: one kernel for two runs of one plan, a second
    for a plan of another tile (several queries a row); none under the interpreter."""
    case = make_case(seq_lens=[40, 3, 90], num_qo_heads=8, num_kv_heads=2, head_dim=32,
                     page_size=16, seed=5)
    heads = dict(num_qo_heads=8, num_kv_heads=2, head_dim=32, page_size=16)
    wrapper = DecodeWrapper(case.layout)
    assert wrapper.compiled_kernels == ()
    wrapper.plan(**csr_kwargs(case.table), **heads)
    for _ in range(2):
        check(case, wrapper, wrapper.run(case.q, case.kv_cache))
    counts = [len(wrapper.compiled_kernels)]
    q = torch.randn(6, 8, 32, dtype=case.q.dtype, device=case.q.device)
    qo_indptr = torch.tensor([0, 2, 3, 6], dtype=torch.int32, device=case.q.device)
    wrapper.plan(**csr_kwargs(case.table), **heads, qo_indptr=qo_indptr)
    wrapper.run(q, case.kv_cache)
    counts.append(len(wrapper.compiled_kernels))
    assert counts == ([1, 2] if ON_GPU else [0, 0])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="device='cuda' names a CUDA device")
def test_gpu_wrapper_on_cuda_takes_tables_on_the_current_device():
    """DecodeWrapper(device="cuda") is the current cuda:N, which the tables' tensors name."""
    case = make_case(seq_lens=[40, 300], num_qo_heads=8, num_kv_heads=2, head_dim=64,
                     page_size=16, layout="HND")
    wrapper = DecodeWrapper("HND", device="cuda")
    wrapper.plan(**csr_kwargs(case.table), num_qo_heads=8, num_kv_heads=2, head_dim=64,
                 page_size=16)
    check(case, wrapper, wrapper.run(case.q, case.kv_cache))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="programmatic dependent launch needs a GPU (compute "
                                       "capability 9.0+); the interpreter runs with it off")
def test_gpu_pdl_matches_the_default_eagerly_and_in_a_graph():
    """KernelConfig(pdl=True): the same output as pdl=False (NaN-poisoned out, against the
    reference), eagerly and replayed in a CUDA graph after other kernels; the compiled kernel
    carries launch_pdl, which the direct launch reads from its metadata."""
    from persistentkv.launch import use_pdl
    from persistentkv.tuning import KernelConfig

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    case = make_case(seq_lens=[300, 7, 129, 4000], num_qo_heads=32, num_kv_heads=8,
                     head_dim=128, page_size=16, layout="HND")
    outs = {}
    for pdl in (False, True):
        wrapper = DecodeWrapper("HND")
        config = KernelConfig(fp8_block_n=128, pdl=pdl)
        kwargs = dict(**csr_kwargs(case.table), num_qo_heads=32, num_kv_heads=8, head_dim=128,
                      page_size=16, backend="split", split_pages=4, config=config)
        assert use_pdl(config, case.q.device) is pdl
        plan = wrapper.plan(**kwargs)
        for _ in range(2):                  # Triton's path, then the direct launch
            out = torch.full_like(case.q, float("nan"))
            wrapper.run(case.q, case.kv_cache, out=out)
            check(case, wrapper, out)
        assert [c.metadata.launch_pdl for c in wrapper.compiled_kernels] == [pdl]
        outs[pdl] = out
        graph_out = torch.full_like(case.q, float("nan"))
        q = case.q.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            wrapper.plan(**kwargs)
            wrapper.run(q * 1.0, case.kv_cache, out=graph_out)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):       # the kernel right after the one writing its q
            wrapper.plan(**kwargs)
            wrapper.run(q * 1.0, case.kv_cache, out=graph_out)
        graph_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(case, wrapper, graph_out)
        assert torch.equal(graph_out, out)
        assert plan.config.pdl is pdl
    assert torch.equal(outs[False], outs[True])
