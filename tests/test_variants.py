"""Attention variants: a sliding window (window_left), logit soft-capping (logits_soft_cap) and a
sink logit per head (sinks), alone and together, in every schedule and table form, with several
query tokens per row, against the float64 reference with the same formula; the window reads only
its pages; and the errors for bad variant arguments."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_case import DEVICE, ON_GPU, block_kwargs, csr_kwargs, draw_case, make_case, queries
from persistentkv import BACKENDS, TOLERANCE, DecodeWrapper, reference_decode, relative_error

HEADS = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
VARIANTS = {"window": dict(window_left=40), "soft_cap": dict(logits_soft_cap=3.0),
            "sinks": dict(sinks=True),
            "all": dict(window_left=25, logits_soft_cap=5.0, sinks=True)}


def _sinks(num_qo_heads, seed):
    """Sink logits on the scale of the scores (unit-variance q.k times sm_scale is about 1)."""
    gen = torch.Generator().manual_seed(seed + 7)
    return (2.0 * torch.randn(num_qo_heads, generator=gen)).float().to(DEVICE)


def _check(case, *, backend, window_left=-1, logits_soft_cap=0.0, sinks=False, q_lens=None,
           table_form="csr", split_pages=None, seed=0, heads=HEADS, deterministic=False,
           config=None, **wrapper_kwargs):
    """Plan and run with the variants (out poisoned with NaN first); compare out and lse with the
    reference. Returns the wrapper."""
    kwargs = csr_kwargs(case.table) if table_form == "csr" else block_kwargs(case.table)
    q, qo_indptr = (case.q, None) if q_lens is None else queries(case, q_lens, seed)
    sink_logits = _sinks(heads["num_qo_heads"], seed) if sinks else None
    wrapper = DecodeWrapper(case.layout, **wrapper_kwargs)
    wrapper.plan(**kwargs, **heads, backend=backend, split_pages=split_pages, qo_indptr=qo_indptr,
                 window_left=window_left, logits_soft_cap=logits_soft_cap,
                 deterministic=deterministic, config=config)
    out = torch.full_like(q, float("nan"))
    lse = wrapper.run(q, case.kv_cache, out=out, return_lse=True, sinks=sink_logits)[1]
    ref, ref_lse = reference_decode(q, case.kv_cache, layout=case.layout, qo_indptr=qo_indptr,
                                    window_left=window_left, logits_soft_cap=logits_soft_cap,
                                    sinks=sink_logits, **csr_kwargs(case.table))
    where = dict(backend=backend, window_left=window_left, cap=logits_soft_cap, sinks=sinks,
                 q_lens=q_lens)
    assert relative_error(out, ref) <= TOLERANCE[q.dtype], where
    assert relative_error(lse, ref_lse) <= 1e-4, where
    return wrapper


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_variant_every_schedule(variant, backend):
    """Rows longer and shorter than the window, split into several tasks (2 pages a split) or
    whole."""
    case = make_case(seq_lens=[300, 9, 130, 33], **HEADS, seed=1)
    _check(case, backend=backend, split_pages=2 if backend == "split" else None,
           **VARIANTS[variant])


@pytest.mark.parametrize("cap", [1e8, 1e30])
def test_a_huge_soft_cap_is_no_cap(cap):
    """cap * tanh(s / cap) is s when s / cap is tiny (where 1 - e^(-2x) loses every digit)."""
    case = make_case(seq_lens=[40, 9], **HEADS, seed=4)
    _check(case, backend="split", split_pages=1, logits_soft_cap=cap)


@pytest.mark.parametrize("table_form, max_tile_rows", [("csr", None), ("block", None),
                                                        ("csr", 16)])
def test_variants_with_several_queries(table_form, max_tile_rows):
    """Each of a row's queries has its own window, causal; the sink counts once per query. Also
    with the tile's 32 rows (8 queries x group 4) in two M-blocks."""
    from persistentkv.tuning import KernelConfig

    case = make_case(seq_lens=[200, 7, 90], **HEADS, seed=2)
    _check(case, backend="split", split_pages=1, q_lens=[5, 3, 8], table_form=table_form,
           config=KernelConfig(max_tile_rows=max_tile_rows), **VARIANTS["all"])


@pytest.mark.parametrize("backend, split_pages, q_lens", [
    ("grouped", None, [4, 2, 3, 1]), ("split", 6, [4, 2, 3, 1]), ("split", 6, [4, 2, 5, 1])])
def test_variants_with_long_tiles(backend, split_pages, q_lens):
    """Every variant and several queries a row with KernelConfig.long_block_n (as gpt-oss's
    default): at 4 queries x group 4 = 16 tile rows the windowed tasks of the long rows (about
    100 tokens) take the long loop, the short rows' the short one; at 5 (20 rows) every task
    takes the long tile (KernelConfig.tile_tokens)."""
    from persistentkv.tuning import KernelConfig

    case = make_case(seq_lens=[300, 9, 130, 33], **HEADS, seed=3)
    _check(case, backend=backend, split_pages=split_pages, q_lens=q_lens,
           window_left=100, logits_soft_cap=5.0, sinks=True,
           config=KernelConfig(block_n=16, long_block_n=32, long_from_tokens=64, num_stages=2))


def test_window_reads_only_its_pages():
    """Pages wholly before each row's window are neither planned nor read: NaN there changes
    nothing, and the tasks cover the kept pages' tokens only."""
    window = 40
    lens = [300, 9, 130]
    case = make_case(seq_lens=lens, **HEADS, layout="HND", seed=3)
    kept = []
    for row, n in enumerate(lens):
        first = max(0, n - (window + 1)) // 16       # the row's first page the window touches
        case.kv_cache[torch.as_tensor(case.table.row_pages[row][:first]).to(DEVICE)] = float("nan")
        kept.append(n - first * 16)
    wrapper = _check(case, backend="split", split_pages=1, window_left=window)
    tasks = wrapper.current_plan.task_records()
    assert sorted((tasks[:, 3] - tasks[:, 2]).tolist()) == sorted(
        [min(16, n - s) for n in kept for s in range(0, n, 16)])


def test_window_of_zero_sees_only_the_query_position():
    case = make_case(seq_lens=[50, 17], **HEADS, seed=4)
    _check(case, backend="split", split_pages=1, window_left=0)


def test_window_graph_mode_and_deterministic():
    """A plan-time window in graph mode (the captured plan keeps it) and deterministic mode, with
    sinks given at run()."""
    case = make_case(seq_lens=[300, 70], **HEADS, seed=5)
    _check(case, backend="auto", window_left=33, sinks=True, use_cuda_graph=True,
           max_batch_size=2, max_num_pages=sum(len(p) for p in case.table.row_pages))
    _check(case, backend="split", window_left=33, sinks=True, deterministic=True)


def test_sinks_per_layer_and_none_again():
    """Sinks change per run() (per layer) on one plan; a run without them is plain attention."""
    case = make_case(seq_lens=[90, 30], **HEADS, seed=6)
    wrapper = DecodeWrapper(case.layout)
    wrapper.plan(**csr_kwargs(case.table), **HEADS, backend="split", split_pages=2)
    for seed in (1, 2):
        sinks = _sinks(8, seed)
        ref, _ = reference_decode(case.q, case.kv_cache, layout=case.layout, sinks=sinks,
                                  **csr_kwargs(case.table))
        assert relative_error(wrapper.run(case.q, case.kv_cache, sinks=sinks), ref) <= 2e-3
    ref, _ = reference_decode(case.q, case.kv_cache, layout=case.layout, **csr_kwargs(case.table))
    assert relative_error(wrapper.run(case.q, case.kv_cache), ref) <= 2e-3


def test_torch_compile_with_variants():
    case = make_case(seq_lens=[120, 40], **HEADS, seed=8)
    sinks = _sinks(8, 8)
    wrapper = DecodeWrapper(case.layout)
    wrapper.plan(**csr_kwargs(case.table), **HEADS, backend="split", split_pages=1,
                 window_left=20, logits_soft_cap=4.0)
    backend = "inductor" if ON_GPU else "aot_eager"

    @torch.compile(fullgraph=True, backend=backend)
    def attend(q, kv, s):
        return wrapper.run(q * 1.0, kv, sinks=s) + 0.0

    torch._dynamo.reset()
    ref, _ = reference_decode(case.q, case.kv_cache, layout=case.layout, window_left=20,
                              logits_soft_cap=4.0, sinks=sinks, **csr_kwargs(case.table))
    assert relative_error(attend(case.q, case.kv_cache, sinks), ref) <= TOLERANCE[case.q.dtype]


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_dim_512(backend):
    """Gemma-4's global layers: head_dim 512, with soft-cap."""
    heads = dict(num_qo_heads=4, num_kv_heads=1, head_dim=512, page_size=16)
    case = make_case(seq_lens=[70, 20], **heads, seed=9)
    _check(case, backend=backend, heads=heads, logits_soft_cap=30.0,
           split_pages=1 if backend == "split" else None)


# every example compiles new kernel variants on a GPU (seconds each); the interpreter has none
@settings(max_examples=12 if ON_GPU else 20, deadline=None, derandomize=True)
@given(st.data())
def test_random_variants(data):
    draw = data.draw
    q_lens = draw(st.none() | st.lists(st.integers(1, 8), min_size=1, max_size=3), label="q_lens")
    rows = len(q_lens) if q_lens else draw(st.integers(1, 3), label="rows")
    seq_lens = [draw(st.integers(q_lens[r] if q_lens else 1, 260), label="seq_len")
                for r in range(rows)]
    case, heads, backend = draw_case(draw, seq_lens, groups=[1, 3, 4])
    _check(case, backend=backend, heads=heads, q_lens=q_lens,
           window_left=draw(st.sampled_from([-1, 0, 5, 40, 100]), label="window_left"),
           logits_soft_cap=draw(st.sampled_from([0.0, 1.0, 30.0]), label="logits_soft_cap"),
           sinks=draw(st.booleans(), label="sinks"),
           split_pages=draw(st.integers(1, 4), label="split") if backend == "split" else None,
           table_form=draw(st.sampled_from(["csr", "block"]), label="table_form"))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(window_left=-2), ValueError,
     r"window_left must be -1 \(no window\) or in \[0, 2\^30\), got -2"),
    (dict(window_left=2**63 - 1), ValueError, r"window_left must be .*, got 9223372036854775807"),
    (dict(window_left=1.5), TypeError, r"window_left must be an int \(-1: no window\), got 1.5"),
    (dict(window_left=True), TypeError, r"window_left must be an int \(-1: no window\), got True"),
    (dict(logits_soft_cap=-1.0), ValueError, r"logits_soft_cap must be 0 or a positive finite "
                                             r"float in \[.*\] \(fp32's normal range\), got -1.0"),
    (dict(logits_soft_cap=1e39), ValueError, r"logits_soft_cap must be .*got 1e\+39"),
    (dict(logits_soft_cap=float("nan")), ValueError, r"logits_soft_cap must be .*got nan"),
    (dict(logits_soft_cap=float("inf")), ValueError, r"logits_soft_cap must be .*got inf"),
    (dict(logits_soft_cap="50"), TypeError, r"logits_soft_cap must be a float, got '50'"),
])
def test_bad_plan_variants(kwargs, error, match):
    case = make_case(seq_lens=[20, 30], **HEADS)
    wrapper = DecodeWrapper(case.layout)
    with pytest.raises(error, match=match):
        wrapper.plan(**csr_kwargs(case.table), **HEADS, **kwargs)
    with pytest.raises(RuntimeError, match="run\\(\\) called before plan\\(\\)"):
        wrapper.run(case.q, case.kv_cache)          # a refused plan() leaves no plan behind


@pytest.mark.parametrize("sinks, error, match", [
    (lambda: torch.zeros(9, device=DEVICE), ValueError,
     r"sinks must be a contiguous \[num_qo_heads\] = \[8\] tensor, got shape \[9\]"),
    (lambda: torch.zeros(8, dtype=torch.float16, device=DEVICE), TypeError,
     r"sinks must have dtype torch.float32, got torch.float16"),
    (lambda: torch.zeros(2, 4, device=DEVICE), ValueError, r"sinks must be 1-D, got shape \[2, 4\]"),
    (lambda: [0.0] * 8, TypeError, r"sinks must be a torch.Tensor, got list"),
    (lambda: torch.zeros(16, device=DEVICE)[::2], ValueError, r"sinks must be a contiguous"),
])
def test_bad_sinks(sinks, error, match):
    case = make_case(seq_lens=[20, 30], **HEADS)
    wrapper = DecodeWrapper(case.layout)
    wrapper.plan(**csr_kwargs(case.table), **HEADS)
    out = torch.full_like(case.q, float("nan"))
    with pytest.raises(error, match=match):
        wrapper.run(case.q, case.kv_cache, out=out, sinks=sinks())
    assert torch.isnan(out).all()                   # nothing written


@pytest.mark.skipif(not ON_GPU, reason="needs a second device: the GPU (sinks on the CPU)")
def test_sinks_on_another_device():
    case = make_case(seq_lens=[20, 30], **HEADS)
    wrapper = DecodeWrapper(case.layout)
    wrapper.plan(**csr_kwargs(case.table), **HEADS)
    with pytest.raises(ValueError, match=r"sinks is on cpu, but the page table was planned on"):
        wrapper.run(case.q, case.kv_cache, sinks=torch.zeros(8))
