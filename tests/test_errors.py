"""Bad input gets a ValueError or TypeError that names the argument and the value."""
import re

import numpy as np
import pytest
import torch

from paged_case import DEVICE, block_kwargs, csr_kwargs, make_case
from persistentkv import (TOLERANCE, DecodeWrapper, PagedKVCache, PageTable, reference_decode,
                          relative_error)

HEADS = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)


@pytest.fixture
def case():
    return make_case(seq_lens=[20, 40], **HEADS)


def planned(case, **kw):
    wrapper = DecodeWrapper(case.layout)
    wrapper.plan(**csr_kwargs(case.table), **{**HEADS, **kw})
    return wrapper


def test_q_and_cache_dtypes_differ(case):
    with pytest.raises(TypeError, match="q.dtype=torch.bfloat16 differs"):
        planned(case).run(case.q.bfloat16(), case.kv_cache)


def test_q_not_fp16_or_bf16(case):
    with pytest.raises(TypeError, match="q must have dtype"):
        planned(case).run(case.q.float(), case.kv_cache)


def test_head_counts_do_not_match_cache(case):
    wrapper = planned(case, num_qo_heads=12, num_kv_heads=3)
    q = torch.randn(2, 12, 64, dtype=torch.float16, device=case.q.device)
    with pytest.raises(ValueError, match="num_kv_heads=2.*plan has 3"):
        wrapper.run(q, case.kv_cache)


def test_head_dim_does_not_match(case):
    with pytest.raises(ValueError, match=r"q must be \[batch_size, num_qo_heads, head_dim\]"):
        planned(case).run(case.q[..., :32], case.kv_cache)


def test_group_not_integral(case):
    with pytest.raises(ValueError, match="num_qo_heads=9 must be a multiple of num_kv_heads=2"):
        planned(case, num_qo_heads=9)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device: CUDA and the CPU")
def test_tensors_on_different_devices(case):
    with pytest.raises(ValueError, match="q is on cpu"):
        planned(case).run(case.q.cpu(), case.kv_cache)


def test_page_index_outside_pool(case):
    """check_page_table=True: run() checks the used page indices against the pool, plan() their
    signs; a table refilled in place and planned again is checked again (no replan shortcut)."""
    indptr, indices, last = case.table.csr(case.q.device)
    indices = indices.clone()
    wrapper = DecodeWrapper("NHD")
    wrapper.plan(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last, **HEADS,
                 check_page_table=True)
    wrapper.run(case.q, case.kv_cache)
    indices[1] = 10_000                                  # the same tensors, refilled in place
    wrapper.plan(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last, **HEADS,
                 check_page_table=True)
    with pytest.raises(ValueError, match=re.escape("kv_indices[1] (row 0)=10000 is a page index "
                                                   "outside the pool")):
        wrapper.run(case.q, case.kv_cache)
    indices[1] = -3
    with pytest.raises(ValueError, match=re.escape("kv_indices[1] (row 0)=-3 is a negative page "
                                                   "index")):
        wrapper.plan(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last, **HEADS,
                     check_page_table=True)


def test_check_page_table_false_trusts_the_page_table(case):
    """The default, check_page_table=False: plan() reads no value of the page table (a negative
    index or a bad indptr passes) and run() has no page range to check."""
    indptr, indices, last = case.table.csr(case.q.device)
    bad = indices.clone()
    bad[1] = -3
    wrapper = DecodeWrapper("NHD")
    plan = wrapper.plan(kv_indptr=indptr.cpu(), kv_indices=bad, kv_last_page_len=last.cpu(), **HEADS)
    assert plan.max_page_index == -1
    assert DecodeWrapper("NHD").plan(kv_indptr=indptr + 1, kv_indices=indices, kv_last_page_len=last,
                                     **HEADS).max_page_index == -1
    wrapper.plan(kv_indptr=indptr.cpu(), kv_indices=indices, kv_last_page_len=last.cpu(), **HEADS)
    out = wrapper.run(case.q, case.kv_cache)
    checked = DecodeWrapper("NHD")
    plan = checked.plan(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last, **HEADS,
                        check_page_table=True)
    assert plan.max_page_index == int(indices.max())
    assert torch.equal(out, checked.run(case.q, case.kv_cache))
    with pytest.raises(TypeError, match="check_page_table must be a bool, got 1"):
        wrapper.plan(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last,
                     check_page_table=1, **HEADS)
    with pytest.raises(TypeError, match="check_indices"):       # the old name is gone
        wrapper.plan(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last,
                     check_indices=True, **HEADS)


def test_length_larger_than_pages_hold(case):
    block_table, seq_lens = case.table.block_table(case.q.device)
    seq_lens = seq_lens.clone()
    seq_lens[0] = 1000
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=1000 needs 63 pages"):
        DecodeWrapper("NHD").plan(block_table=block_table, seq_lens=seq_lens, **HEADS,
                                  check_page_table=True)
    seq_lens[0] = -1
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=-1 is negative"):
        DecodeWrapper("NHD").plan(block_table=block_table, seq_lens=seq_lens, **HEADS,
                                  check_page_table=True)
    indptr, indices, last = case.table.csr(case.q.device)
    last = last.clone()
    last[1] = 17
    with pytest.raises(ValueError, match=r"kv_last_page_len\[1\]=17 must be in \[1, page_size=16\]"):
        DecodeWrapper("NHD").plan(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last,
                                  **HEADS, check_page_table=True)
    with pytest.raises(ValueError, match=r"kv_indptr\[-1\]=5 is past the end of kv_indices"):
        DecodeWrapper("NHD").plan(kv_indptr=indptr, kv_indices=indices[:2], kv_last_page_len=last,
                                  **HEADS, check_page_table=True)


def test_index_tensors_not_int32(case):
    kw = csr_kwargs(case.table)
    kw["kv_indices"] = kw["kv_indices"].long()
    with pytest.raises(TypeError, match="kv_indices must have dtype torch.int32, got torch.int64"):
        DecodeWrapper("NHD").plan(**kw, **HEADS)
    kw = block_kwargs(case.table)
    kw["seq_lens"] = kw["seq_lens"].long()
    with pytest.raises(TypeError, match="seq_lens must have dtype torch.int32"):
        DecodeWrapper("NHD").plan(**kw, **HEADS)


def test_cache_fits_neither_layout(case):
    bad = case.kv_cache[:, 0]                                    # 4-D, not a pair
    with pytest.raises(ValueError, match="kv_cache fits neither layout"):
        planned(case).run(case.q, bad)


@pytest.mark.parametrize("form", ["csr", "block"])
@pytest.mark.parametrize("backend", ["auto", "grouped", "split"])
def test_zero_length_rows_are_inactive(form, backend):
    """A row of length 0 (no pages, or seq_lens 0) is no error: it is inactive, its output row is
    left untouched (the NaN poison stays) and the other rows match the reference."""
    lens = [20, 0, 40, 0]
    case = make_case(seq_lens=lens, **HEADS)
    table = csr_kwargs(case.table) if form == "csr" else block_kwargs(case.table)
    wrapper = DecodeWrapper("NHD")
    plan = wrapper.plan(**table, **HEADS, backend=backend, check_page_table=True)
    assert set(plan.task_records()[:, 0].tolist()) == {0, 2}
    out = torch.full_like(case.q, float("nan"))
    out, lse = wrapper.run(case.q, case.kv_cache, out=out, return_lse=True)
    assert torch.isnan(out[[1, 3]].float()).all()
    ref, ref_lse = reference_decode(case.q, case.kv_cache, layout="NHD", **csr_kwargs(case.table))
    assert relative_error(out[[0, 2]], ref[[0, 2]]) <= TOLERANCE[torch.float16]
    assert relative_error(lse[[0, 2]], ref_lse[[0, 2]]) <= 1e-5


def test_mixed_page_table_forms_and_bad_options(case):
    kw = {**csr_kwargs(case.table), **block_kwargs(case.table)}
    with pytest.raises(ValueError, match="not a mix"):
        DecodeWrapper("NHD").plan(**kw, **HEADS)
    with pytest.raises(ValueError, match="backend must be one of"):
        planned(case, backend="fast")
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        DecodeWrapper("NDH")
    with pytest.raises(ValueError, match=r"^layout must be one of .*, got 'XYZ'"):
        PagedKVCache(num_layers=1, num_pages=2, page_size=16, num_kv_heads=2, head_dim=64,
                     layout="XYZ", device="cpu")
    with pytest.raises(TypeError, match="page_size must be an int"):
        planned(case, page_size=16.0)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 16"):
        planned(case, head_dim=72)


def test_kv_indptr_malformed(case):
    indptr, indices, last = case.table.csr(case.q.device)
    with pytest.raises(ValueError, match="kv_indptr must start at 0"):
        DecodeWrapper("NHD").plan(kv_indptr=indptr + 1, kv_indices=indices, kv_last_page_len=last,
                                  **HEADS, check_page_table=True)
    with pytest.raises(ValueError, match="batch_size \\+ 1 = 3"):
        DecodeWrapper("NHD").plan(kv_indptr=indptr[:2], kv_indices=indices, kv_last_page_len=last,
                                  **HEADS)


def test_run_before_plan(case):
    with pytest.raises(RuntimeError, match="before plan"):
        DecodeWrapper("NHD").run(case.q, case.kv_cache)


def test_cache_constructor_and_append_checks():
    with pytest.raises(TypeError, match="dtype must be one of"):
        PagedKVCache(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=16,
                     dtype=torch.float32)
    cache = PagedKVCache(num_layers=2, num_pages=4, page_size=4, num_kv_heads=1, head_dim=16)
    cache.add_sequence(0)
    kv = torch.zeros(1, 3, 1, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"k must be \[num_layers, n, num_kv_heads, head_dim\]"):
        cache.append(0, kv, kv)
    for layer, error, match in ((2, ValueError, "layer must be < num_layers=2, got 2"),
                                (-1, ValueError, "layer must be >= 0, got -1"),
                                (True, TypeError, "layer must be an int, got bool True")):
        with pytest.raises(error, match=match):
            cache.scales(layer)
    shape = dict(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 16 up to 512, got 3"):
        PagedKVCache(**shape, head_dim=3)
    with pytest.raises(ValueError, match="device must be a torch.device or a device string"):
        PagedKVCache(**shape, head_dim=16, device="gpu")
    with pytest.raises(ValueError, match="device must be a torch.device or a device string"):
        DecodeWrapper("NHD", device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device is 'cuda', but this torch has no CUDA"):
            PagedKVCache(**shape, head_dim=16, device="cuda")


def test_append_keeps_no_autograd_graph():
    """K/V that require grad are written as values: the pool stays a leaf without a graph."""
    cache = PagedKVCache(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=16,
                         init="zeros")
    cache.add_sequence(0)
    k = torch.randn(1, 3, 1, 16, dtype=torch.float16, requires_grad=True)
    cache.append(0, k, k * 2)
    assert not cache.pools[0].requires_grad and cache.pools[0].grad_fn is None
    page = cache.allocator.sequence(0).pages[0]
    assert torch.equal(cache.pools[0][page, 0, :3].float(), k[0].detach().float())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: host metadata beside device indices")
def test_host_metadata_with_device_indices(case):
    kw = csr_kwargs(case.table)
    wrapper = DecodeWrapper("NHD")
    wrapper.plan(kv_indptr=kw["kv_indptr"].cpu(), kv_indices=kw["kv_indices"],
                 kv_last_page_len=kw["kv_last_page_len"].cpu(), **HEADS)
    ref = DecodeWrapper("NHD")
    ref.plan(**kw, **HEADS)
    assert torch.equal(wrapper.run(case.q, case.kv_cache), ref.run(case.q, case.kv_cache))
    with pytest.raises(ValueError, match="page indices"):
        DecodeWrapper("NHD").plan(kv_indptr=kw["kv_indptr"], kv_indices=kw["kv_indices"].cpu(),
                                  kv_last_page_len=kw["kv_last_page_len"], **HEADS)


def test_block_table_padding_is_ignored_but_used_entries_are_checked(case):
    """vLLM pads block tables (0, -1 or stale pages): only each row's used entries are checked."""
    block_table, seq_lens = case.table.block_table(case.q.device, pad_to=6)   # rows use 2 and 3
    wrapper = DecodeWrapper("NHD")
    for pad in (-1, 10_000):
        padded = block_table.clone()
        padded[0, 2:] = pad
        padded[1, 3:] = pad
        plan = wrapper.plan(block_table=padded, seq_lens=seq_lens, **HEADS, check_page_table=True)
        assert plan.max_page_index == int(block_table.max())
        wrapper.run(case.q, case.kv_cache)                         # no false alarm
    padded = block_table.clone()
    padded[1, 2] = 10_000                                          # a used entry
    wrapper.plan(block_table=padded, seq_lens=seq_lens, **HEADS, check_page_table=True)
    with pytest.raises(ValueError, match=r"block_table\[1, 2\]=10000 is a page index outside "
                                         r"the pool"):
        wrapper.run(case.q, case.kv_cache)
    padded[1, 2] = -1
    with pytest.raises(ValueError, match=r"block_table\[1, 2\]=-1 is a negative page index"):
        wrapper.plan(block_table=padded, seq_lens=seq_lens, **HEADS, check_page_table=True)
    kw = csr_kwargs(case.table)    # the CSR form names the entry and its row
    indices, start = kw["kv_indices"].clone(), int(kw["kv_indptr"][1])
    for value, match in ((10_000, "is a page index outside the pool"),
                         (-5, "is a negative page index")):
        indices[start + 1] = value
        with pytest.raises(ValueError, match=re.escape(f"kv_indices[{start + 1}] (row 1)="
                                                       f"{value} {match}")):
            wrapper.plan(**{**kw, "kv_indices": indices}, **HEADS, check_page_table=True)
            wrapper.run(case.q, case.kv_cache)


def test_non_contiguous_page_table_tensors(case):
    kw = csr_kwargs(case.table)
    spread = torch.zeros(2 * kw["kv_indices"].numel(), dtype=torch.int32, device=case.q.device)
    spread[::2] = kw["kv_indices"]
    with pytest.raises(ValueError, match="kv_indices must be contiguous, got stride 2"):
        DecodeWrapper("NHD").plan(**{**kw, "kv_indices": spread[::2]}, **HEADS)
    block_table, seq_lens = case.table.block_table(case.q.device)
    lens = torch.stack([seq_lens, seq_lens], dim=1)[:, 0]
    with pytest.raises(ValueError, match="seq_lens must be contiguous"):
        DecodeWrapper("NHD").plan(block_table=block_table, seq_lens=lens, **HEADS)


def test_out_as_an_expanded_view(case):
    """An output whose rows (or heads) share memory cannot take every row's result."""
    wrapper = planned(case)
    for out in (torch.empty(1, 8, 64, dtype=torch.float16, device=case.q.device).expand(2, 8, 64),
                torch.empty(2, 1, 64, dtype=torch.float16, device=case.q.device).expand(2, 8, 64)):
        with pytest.raises(ValueError, match="out must not overlap itself"):
            wrapper.run(case.q, case.kv_cache, out=out)
    with pytest.raises(ValueError, match=r"out must be like q"):
        wrapper.run(case.q, case.kv_cache, out=torch.empty_like(case.q)[:1])


def test_sm_scale_values(case):
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e39, 1e-50):
        with pytest.raises(ValueError, match="sm_scale must be a positive finite float in"):
            planned(case, sm_scale=bad)
    for bad in (True, "x"):
        with pytest.raises(TypeError, match=f"sm_scale must be a float, got {bad!r}"):
            planned(case, sm_scale=bad)
    wrapper = planned(case, sm_scale=np.float32(0.125))
    assert type(wrapper.current_plan.sm_scale) is float and wrapper.current_plan.sm_scale == 0.125
    out = wrapper.run(case.q, case.kv_cache)
    assert torch.equal(out, planned(case, sm_scale=0.125).run(case.q, case.kv_cache))
    ref, _ = reference_decode(case.q, case.kv_cache, layout="NHD", sm_scale=0.125,
                              **csr_kwargs(case.table))
    assert relative_error(out, ref) <= TOLERANCE[torch.float16]


def test_removed_backends_are_refused(case):
    for old in ("workqueue", "pkv-split", "graph"):
        with pytest.raises(ValueError, match=r"backend must be one of \('grouped', 'split', "
                                             r"'balanced', 'auto'\)"):
            planned(case, backend=old)
    with pytest.raises(ValueError, match="split_pages=2 needs backend='split'"):
        planned(case, backend="grouped", split_pages=2)
    with pytest.raises(ValueError, match="backend='auto' chooses the split itself"):
        planned(case, split_pages=2)
    for backend in ("grouped", "balanced"):
        with pytest.raises(ValueError, match=f"backend='{backend}' cuts them by the batch"):
            planned(case, backend=backend, deterministic=True)
    with pytest.raises(ValueError, match="backend='balanced' sizes its own splits"):
        planned(case, backend="balanced", split_pages=2)


@pytest.mark.parametrize("scale", [[0.1], "0.1"])
def test_sm_scale_must_be_a_real_number(scale):
    case = make_case(seq_lens=[5], **HEADS)
    with pytest.raises(TypeError, match="sm_scale must be a float, got"):
        DecodeWrapper("NHD").plan(**csr_kwargs(case.table), **HEADS, sm_scale=scale)


@pytest.mark.parametrize("num_sms, error, match", [(0, ValueError, "num_sms must be >= 1, got 0"),
                                                   (True, TypeError, "num_sms"),
                                                   ("8", TypeError, "num_sms")])
def test_num_sms_is_a_positive_int(num_sms, error, match):
    with pytest.raises(error, match=match):
        DecodeWrapper("NHD", num_sms=num_sms)


def test_num_sms_sizes_the_grid_and_the_split_rule():
    """Plans for 3 and 5 SMs: 2 programs an SM, and the split rule's waves x SMs / KV heads = 3
    and 5 tasks a KV head for a row of 2000 tokens, each checked against the reference."""
    case = make_case(seq_lens=[2000], **HEADS)
    ref, _ = reference_decode(case.q, case.kv_cache, layout=case.layout, **csr_kwargs(case.table))
    for sms in (3, 5):
        wrapper = DecodeWrapper(case.layout, num_sms=sms)
        plan = wrapper.plan(**csr_kwargs(case.table), **HEADS, backend="split")
        assert plan.programs == 2 * sms and plan.info()["num_tasks"] == sms
        out = torch.full_like(case.q, float("nan"))
        wrapper.run(case.q, case.kv_cache, out=out)
        assert relative_error(out, ref) <= TOLERANCE[torch.float16]


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(row_pages=([0, 1],), seq_lens=[100]), ValueError,
     r"row 0 has 2 pages for seq_lens\[0\]=100 tokens; pages of 4 need 25"),
    (dict(row_pages=([0], [1]), seq_lens=[3]), ValueError,
     r"seq_lens must hold one length per row \(2\), got shape \[1\]"),
    (dict(row_pages=([0],), seq_lens=[3], page_size=0), ValueError,
     "page_size must be >= 1, got 0"),
    (dict(row_pages=([0.5],), seq_lens=[3]), TypeError, r"row_pages\[0\] must be a 1-D integer"),
    (dict(row_pages=([],), seq_lens=[-1]), ValueError, "seq_lens must be >= 0, got -1"),
    (dict(row_pages=([7, 2**32 + 3],), seq_lens=[5]), ValueError,
     r"row_pages\[0\] must fit in int32 \(the exported tables' type\), got 4294967299"),
    (dict(row_pages=([0] * 8,), seq_lens=[2**31], page_size=2**28), ValueError,
     r"seq_lens must fit in int32 .*, got 2147483648"),
])
def test_page_table_checks_its_rows(kwargs, error, match):
    """A PageTable's rows hold exactly the pages their tokens fill (its CSR form says no other)."""
    with pytest.raises(error, match=match):
        PageTable(**{"page_size": 4, **kwargs})


def test_page_table_takes_lists_and_checks_pad_to():
    table = PageTable(row_pages=([], [2, 5]), seq_lens=[0, 7], page_size=4)
    twin = PageTable(row_pages=([], [2, 5]), seq_lens=[0, 7], page_size=4)
    assert table == table and table != twin and len({table, twin}) == 2   # by identity
    assert table.seq_lens.dtype == np.int64 and table.row_pages[1].dtype == np.int64
    assert table.block_table(pad_to=3)[0].tolist() == [[0, 0, 0], [2, 5, 0]]
    with pytest.raises(TypeError, match="pad_to must be an int, got float 2.5"):
        table.block_table(pad_to=2.5)


def test_split_pages_must_fit_int32_tokens(case):
    """At most schedule.MAX_SPLIT_TOKENS (a split near 2^31 overflowed the plan kernel into no
    tasks)."""
    for bad in (2**40, 2**30 // HEADS["page_size"] + 1):
        with pytest.raises(ValueError, match=r"split_pages x page_size must be at most 2\^30 "
                                             rf"tokens, got split_pages={bad} at page_size="):
            planned(case, backend="split", split_pages=bad)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_a_table_that_can_address_rows_past_int32_is_refused(graph):
    """A row of 2^31 tokens wrapped to a negative length in the kernels' int32: it was dropped
    (no tasks, the output untouched) and check() passed. A table able to address more than 2^30
    tokens a row, or a page of more, is refused before anything changes."""
    def i32(*values):
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)
    heads = dict(num_qo_heads=4, num_kv_heads=2, head_dim=16)
    wrapper = (DecodeWrapper("NHD", use_cuda_graph=True, max_batch_size=1, max_num_pages=4096)
               if graph else DecodeWrapper("NHD"))
    csr = dict(kv_indptr=i32(0, 2048), kv_indices=torch.zeros(2048, dtype=torch.int32,
                                                             device=DEVICE),
               kv_last_page_len=i32(2**20))
    with pytest.raises(ValueError, match=r"page_size=1048576 x 2048 kv_indices' entries can "
                                         r"address more than 2\^30 tokens a row"):
        wrapper.plan(**csr, **heads, page_size=2**20, check_page_table=not graph)
    block = dict(block_table=torch.zeros(1, 4, dtype=torch.int32, device=DEVICE),
                 seq_lens=i32(3))
    with pytest.raises(ValueError, match=r"page_size must be at most 2\^30 tokens, got 2147483648"):
        wrapper.plan(**block, **heads, page_size=2**31)
    with pytest.raises(RuntimeError, match="run\\(\\) called before plan\\(\\)"):
        wrapper.current_plan
    wrapper.plan(**block, **heads, page_size=2**28)          # 2^30 tokens a row: the limit


def test_a_host_page_table_is_refused_where_the_kernels_compile_for_a_gpu(monkeypatch):
    """Outside the interpreter the planner's kernel runs on CUDA tensors only: a page table on the
    CPU failed inside Triton's launcher ("Pointer argument (at 0) cannot be accessed from
    Triton"). Now a ValueError that names the device, and no plan is taken."""
    monkeypatch.setattr("persistentkv.wrapper.interpreting", lambda: False)
    case = make_case(seq_lens=[5, 9], **HEADS)
    block_table, seq_lens = case.table.block_table(torch.device("cpu"))
    wrapper = DecodeWrapper(case.layout)
    with pytest.raises(ValueError, match=r"page table is on cpu: the kernels run on a CUDA "
                                         r"device, or on the CPU under Triton's interpreter"):
        wrapper.plan(block_table=block_table, seq_lens=seq_lens, **HEADS)
    with pytest.raises(RuntimeError, match="run\\(\\) called before plan\\(\\)"):
        wrapper.current_plan


def test_q_rows_are_checked_against_each_plan():
    """Launches are shared by plans of any batch size: a run after a plan of another batch still
    checks q's rows (it reused the earlier check, then read past q and wrote past out)."""
    heads = dict(num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4)
    case = make_case(seq_lens=[5, 9, 7], **heads)
    block_table, seq_lens = case.table.block_table(DEVICE)
    wrapper = DecodeWrapper(case.layout)
    wrapper.plan(block_table=block_table, seq_lens=seq_lens, **heads)
    wrapper.run(case.q, case.kv_cache)
    wrapper.plan(block_table=block_table[:2].contiguous(), seq_lens=seq_lens[:2].contiguous(),
                 **heads)
    wrapper.run(case.q[:2], case.kv_cache)
    wrapper.plan(block_table=block_table, seq_lens=seq_lens, **heads)
    with pytest.raises(ValueError, match=r"q must be \[batch_size, num_qo_heads, head_dim\] = "
                                         r"\[3, 4, 16\] as planned, got \[2, 4, 16\]"):
        wrapper.run(case.q[:2], case.kv_cache)
    out = torch.full_like(case.q, float("nan"))
    wrapper.run(case.q, case.kv_cache, out=out)
    ref, _ = reference_decode(case.q, case.kv_cache, layout=case.layout,
                              **csr_kwargs(case.table))
    assert relative_error(out, ref) <= TOLERANCE[torch.float16]


def test_a_pool_of_no_pages_is_refused_for_a_trusted_table(case):
    """A trusted table's entries outside the pool read page 0: with no page 0 it read address 0."""
    wrapper = planned(case)
    empty = case.kv_cache[:0]
    with pytest.raises(ValueError, match=r"kv_cache has no pages \(shape \[0, "):
        wrapper.run(case.q, empty)
