"""An fp8 (e4m3) KV cache: per-tensor and per-token scales, in every schedule and table form, with
several queries and the variants, against the float64 reference on the values the cache stands
for; quantization on append (saturating, per-token scales that never rescale earlier tokens);
and the errors for missing or bad scales."""
import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_case import DEVICE, ON_GPU, block_kwargs, csr_kwargs, draw_case, make_case, queries
from persistentkv import (BACKENDS, TOLERANCE, DecodeWrapper, PagedKVCache, reference_decode,
                          relative_error)
from persistentkv.quant import FP8, FP8_MAX, quantize, row_scales
from persistentkv.tuning import KernelConfig, default_config

HEADS = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)


def fp8_pool(pool: torch.Tensor, layout: str, granularity: str) -> tuple[torch.Tensor, dict]:
    """An fp16 [P, 2, ...] pool in e4m3 and run()'s scale arguments for it."""
    x = pool.float()
    if granularity == "tensor":
        k_scale = float(x[:, 0].abs().max()) / FP8_MAX
        v_scale = float(x[:, 1].abs().max()) / FP8_MAX
        q8 = torch.stack([quantize(x[:, 0], k_scale), quantize(x[:, 1], v_scale)], dim=1)
        return q8, dict(k_scale=k_scale, v_scale=v_scale)
    if layout == "HND_VT":      # V's blocks hold [D, S]: its token rows, as HND's, to scale
        x = _swap_v_blocks(x, to_rows=True)
    rows = x if layout != "NHD" else x.transpose(2, 3)           # [P, 2, H, S, D]
    scales = row_scales(rows)                                    # [P, 2, H, S]
    q8 = quantize(rows, scales[..., None])
    q8 = q8 if layout != "NHD" else q8.transpose(2, 3).contiguous()
    if layout == "HND_VT":
        q8 = _swap_v_blocks(q8.float(), to_rows=False).to(FP8)
    return q8, dict(kv_scales=scales.contiguous())


def _swap_v_blocks(x: torch.Tensor, *, to_rows: bool) -> torch.Tensor:
    """An HND_VT pool [P, 2, H, S, D] with its V blocks read as [D, S] and given as token rows
    [S, D] (to_rows), or the reverse."""
    p, _, h, page, d = x.shape
    v = x[:, 1].reshape(p, h, d, page).transpose(2, 3) if to_rows else \
        x[:, 1].transpose(2, 3).reshape(p, h, page, d)
    return torch.stack([x[:, 0], v.reshape(p, h, page, d)], dim=1)


def _check(case, granularity, *, backend, table_form="csr", split_pages=None, q_lens=None,
           seed=0, heads=HEADS, variants=None, deterministic=False, wrapper_kwargs=None,
           sinks=None):
    """Run on the fp8 cache (out poisoned with NaN); returns (error against the reference on the
    fp8 values, error against the fp16 original)."""
    pool8, scales = fp8_pool(case.kv_cache, case.layout, granularity)
    kwargs = csr_kwargs(case.table) if table_form == "csr" else block_kwargs(case.table)
    q, qo_indptr = (case.q, None) if q_lens is None else queries(case, q_lens, seed)
    wrapper = DecodeWrapper(case.layout, **(wrapper_kwargs or {}))
    wrapper.plan(**kwargs, **heads, backend=backend, split_pages=split_pages, qo_indptr=qo_indptr,
                 deterministic=deterministic, **(variants or {}))
    out = torch.full_like(q, float("nan"))
    lse = wrapper.run(q, pool8, out=out, return_lse=True, sinks=sinks, **scales)[1]
    common = dict(layout=case.layout, qo_indptr=qo_indptr, sinks=sinks, **(variants or {}),
                  **csr_kwargs(case.table))
    ref, ref_lse = reference_decode(q, pool8, **scales, **common)
    original, _ = reference_decode(q, case.kv_cache, **common)
    err = relative_error(out, ref)
    assert err <= TOLERANCE[q.dtype], (granularity, backend, err)
    assert relative_error(lse, ref_lse) <= 1e-4
    return err, relative_error(out, original)


@pytest.mark.parametrize("granularity", ["tensor", "token"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_every_schedule(granularity, backend):
    case = make_case(seq_lens=[300, 9, 130, 33], **HEADS, layout="HND", seed=1)
    _, vs_fp16 = _check(case, granularity, backend=backend,
                        split_pages=2 if backend == "split" else None)
    assert vs_fp16 < 0.1     # e4m3 keeps 3 mantissa bits: a few 1e-2 against the fp16 original


@pytest.mark.parametrize("magnitude", [1.0, 1e-3])
def test_per_token_fp8_small_values_of_v(magnitude, monkeypatch):
    """A per-token V of amax about 1e-3 has scales near 2e-6: the weights times them fell under
    fp16's normal range where the kernel casts them for the product (1.3e-2 relative error).
    On the interpreter the kernel computes in fp32 (upcast), so the GPU's fp16 branch is run by
    turning the upcast off."""
    if not ON_GPU:
        from persistentkv.kernels import decode
        compiled = decode.decode_constexprs
        monkeypatch.setattr(decode, "decode_constexprs",
                            lambda **kw: compiled(**{**kw, "upcast": False}))
    case = make_case(seq_lens=[200, 64], **HEADS, layout="HND", seed=4)
    case.kv_cache[:, 1] *= magnitude
    err, _ = _check(case, "token", backend="split", split_pages=4)
    assert err <= TOLERANCE[torch.float16]


@pytest.mark.parametrize("config", [None, KernelConfig(block_n=32, fp8_block_n=16, num_stages=2)])
def test_fp8_tiles(config):
    """An fp8 cache reads config.fp8_block_n tokens per tile (the default at head dim 128: 128, the
    fp16 tile's bytes); a tile smaller than a page and one that spans pages both match."""
    assert default_config(head_dim=128, num_kv_heads=2).tile_tokens(kv_fp8=True) == 128
    assert default_config(head_dim=128, num_kv_heads=2).tile_tokens(kv_fp8=False) == 64
    heads = dict(num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16)
    case = make_case(seq_lens=[300, 37, 129], **heads, layout="NHD", seed=3)
    for granularity in ("tensor", "token"):
        _check(case, granularity, backend="split", split_pages=3, heads=dict(heads, config=config))
    with pytest.raises(ValueError, match="KernelConfig.fp8_block_n must be a power of two >= 16, got 24"):
        KernelConfig(fp8_block_n=24)


@pytest.mark.skipif(not ON_GPU, reason="the page prefetch is PTX, which the interpreter "
                                        "compiles out (tests/test_decode.py checks its way there)")
@pytest.mark.parametrize("granularity", ["tensor", "token"])
def test_fp8_page_prefetch(granularity):
    """An fp8 HND_VT cache (the layout issue 18's steps read) with each tile prefetching the page
    indices of the tile 3 ahead, with each task prefetching all of its own, and with the index
    loads marked evict_last: rows of 20K and 9K tokens and ones shorter than the distance,
    split and balanced."""
    heads = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    case = make_case(seq_lens=[20000, 9000, 70, 1], **heads, layout="HND_VT", seed=6)
    for fetch in (dict(page_prefetch_tiles=3), dict(page_prefetch_task=True),
                  dict(keep_page_table=True)):
        config = dataclasses.replace(default_config(head_dim=128, num_kv_heads=8), **fetch)
        for backend in ("split", "balanced"):
            _check(case, granularity, backend=backend, heads=dict(heads, config=config))


@pytest.mark.parametrize("layout", ["HND", "NHD", "HND_VT"])
def test_fp8_with_queries_variants_and_bf16(layout):
    """Several queries per row, a window, soft-cap and sinks on an fp8 cache, q in bf16."""
    case = make_case(seq_lens=[200, 7, 90], **HEADS, layout=layout, seed=2, dtype=torch.bfloat16)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    for granularity in ("tensor", "token"):
        _check(case, granularity, backend="split", split_pages=1, q_lens=[5, 3, 8],
               table_form="block", variants=dict(window_left=25, logits_soft_cap=5.0),
               sinks=sinks)


def test_fp8_graph_mode_and_deterministic():
    case = make_case(seq_lens=[300, 70], **HEADS, layout="HND", seed=4)
    pages = sum(len(p) for p in case.table.row_pages)
    _check(case, "token", backend="auto",
           wrapper_kwargs=dict(use_cuda_graph=True, max_batch_size=2, max_num_pages=pages))
    _check(case, "tensor", backend="split", deterministic=True)


def test_fp8_torch_compile():
    case = make_case(seq_lens=[120, 40], **HEADS, layout="HND", seed=5)
    pool8, scales = fp8_pool(case.kv_cache, "HND", "token")
    wrapper = DecodeWrapper("HND")
    wrapper.plan(**csr_kwargs(case.table), **HEADS, backend="split", split_pages=1)
    backend = "inductor" if ON_GPU else "aot_eager"

    @torch.compile(fullgraph=True, backend=backend)
    def attend(q, kv, s):
        return wrapper.run(q * 1.0, kv, kv_scales=s) + 0.0

    torch._dynamo.reset()
    ref, _ = reference_decode(case.q, pool8, layout="HND", **scales, **csr_kwargs(case.table))
    assert relative_error(attend(case.q, pool8, scales["kv_scales"]), ref) <= 2e-3


@settings(max_examples=10 if ON_GPU else 15, deadline=None, derandomize=True)
@given(st.data())
def test_random_fp8(data):
    draw = data.draw
    rows = draw(st.integers(1, 3), label="rows")
    seq_lens = [draw(st.integers(1, 260), label="seq_len") for _ in range(rows)]
    case, heads, backend = draw_case(draw, seq_lens, groups=[1, 4, 5])
    # splits of 16-64 tokens at every page size (at page size 1, splits of 1-4 tokens made one
    # example thousands of interpreted tasks: two minutes)
    split = draw(st.integers(1, 4)) * (16 // heads["page_size"]) if backend == "split" else None
    _check(case, draw(st.sampled_from(["tensor", "token"]), label="granularity"), backend=backend,
           heads=heads, split_pages=split,
           table_form=draw(st.sampled_from(["csr", "block"]), label="table_form"))


# -- the cache -------------------------------------------------------------------------------------
def _cache(**kwargs):
    return PagedKVCache(num_layers=2, num_pages=8, page_size=4, num_kv_heads=2, head_dim=16,
                        dtype=FP8, layout="NHD", device=DEVICE, **kwargs)


def test_per_token_scales_never_rescale_earlier_tokens():
    """Tokens appended one at a time, each with its own magnitude (up to 1e4): each is stored
    with its own scale, within e4m3's rounding, and never saturated."""
    cache = _cache(kv_scale="token")
    cache.add_sequence(0)
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randn(2, 1, 2, 16, generator=gen) * 10.0 ** e for e in (-3, 0, 2, 4, 1)]
    for t in tokens:
        cache.append(0, t, -t)
    pages = cache.allocator.sequence(0).pages
    for layer in range(2):
        pool, scales = cache.pools[layer], cache.kv_scales[layer]
        for i, t in enumerate(tokens):
            page, slot = pages[i // 4], i % 4
            k = pool[page, 0, slot].float().cpu() * scales[page, 0, :, slot, None].cpu()
            v = pool[page, 1, slot].float().cpu() * scales[page, 1, :, slot, None].cpu()
            assert torch.isfinite(k).all() and relative_error(k, t[layer, 0]) < 0.07
            assert relative_error(v, -t[layer, 0]) < 0.07


@pytest.mark.parametrize("layout", ["HND", "NHD", "HND_VT"])
def test_random_fp8_pool_is_filled_in_chunks(monkeypatch, layout):
    """init="randn" quantizes a few pages at a time (an fp32 copy of a whole pool would not fit
    beside a large one): with chunks of 3 pages, every token row still has its own scale (its
    largest stored magnitude is 448) and per tensor no value is left unwritten (NaN)."""
    import persistentkv.cache as cache_module

    monkeypatch.setattr(cache_module, "QUANTIZE_CHUNK_ELEMENTS", 3 * 2 * 2 * 4 * 16)
    per_token = PagedKVCache(num_layers=2, num_pages=10, page_size=4, num_kv_heads=2, head_dim=16,
                             dtype=FP8, kv_scale="token", layout=layout, init="randn", device=DEVICE)
    per_tensor = PagedKVCache(num_layers=1, num_pages=10, page_size=4, num_kv_heads=2, head_dim=16,
                              dtype=FP8, k_scale=0.01, v_scale=0.02, layout=layout, init="randn",
                              device=DEVICE)
    for layer in range(2):
        pool = per_token.pools[layer].float()
        rows = {"HND": pool, "NHD": pool.transpose(2, 3),                    # [P, 2, H, S, D]
                "HND_VT": _swap_v_blocks(pool, to_rows=True)}[layout]
        assert torch.equal(rows.abs().amax(dim=-1), torch.full_like(rows[..., 0], FP8_MAX))
        assert (per_token.kv_scales[layer] > 0.0).all()
        assert not torch.equal(per_token.kv_scales[layer][:3], per_token.kv_scales[layer][3:6])
    assert torch.isfinite(per_tensor.pools[0].float()).all()


def test_per_tensor_quantization_saturates():
    """A value past 448 x scale is stored as 448 (x scale), never inf or NaN."""
    cache = _cache(k_scale=0.5, v_scale=2.0)
    cache.add_sequence(0)
    k = torch.full((2, 1, 2, 16), 1e6)
    cache.append(0, k, -k)
    page = cache.allocator.sequence(0).pages[0]
    stored = cache.pools[0][page, :, 0].float()
    assert torch.equal(stored[0], torch.full_like(stored[0], FP8_MAX))
    assert torch.equal(stored[1], torch.full_like(stored[1], -FP8_MAX))
    assert cache.scales(0) == dict(k_scale=0.5, v_scale=2.0)


def test_per_token_quantization_saturates_an_inf():
    """An inf in a token's row saturates to +-448 x the scale of its finite values (as a
    per-tensor cache stores it); the row's other values keep their own."""
    cache = _cache(kv_scale="token")
    cache.add_sequence(0)
    k = torch.randn(2, 1, 2, 16)
    k[:, 0, 0, 3] = math.inf
    cache.append(0, k, k.clone())
    page = cache.allocator.sequence(0).pages[0]
    stored = cache.pools[0][page, 0, 0, 0].float().cpu()     # layer 0, K, slot 0, head 0: [D]
    scale = cache.kv_scales[0][page, 0, 0, 0].cpu()
    assert torch.isfinite(stored).all() and float(stored[3]) == FP8_MAX
    finite = torch.cat([k[0, 0, 0, :3], k[0, 0, 0, 4:]])
    assert torch.isclose(scale, finite.abs().max() / FP8_MAX)
    dequantized = torch.cat([stored[:3], stored[4:]]) * scale
    assert relative_error(dequantized, finite) <= 0.1


def test_fp8_cache_end_to_end():
    """PagedKVCache(fp8) appends, its page table plans, run() takes cache.scales(layer)."""
    for granularity in ("tensor", "token"):
        scales = dict(k_scale=0.01, v_scale=0.01) if granularity == "tensor" else {}
        cache = PagedKVCache(num_layers=2, num_pages=40, page_size=16, num_kv_heads=2,
                             head_dim=64, dtype=FP8, layout="HND", device=DEVICE,
                             kv_scale=granularity, **scales)
        gen = torch.Generator().manual_seed(1)
        for seq, n in enumerate([130, 40]):
            cache.add_sequence(seq)
            cache.append(seq, torch.randn(2, n, 2, 64, generator=gen, dtype=torch.float16),
                         torch.randn(2, n, 2, 64, generator=gen, dtype=torch.float16))
        table = cache.page_table()
        wrapper = DecodeWrapper("HND")
        wrapper.plan(**csr_kwargs(table), **HEADS)
        q = torch.randn(2, 8, 64, generator=gen, dtype=torch.float16).to(DEVICE)
        for layer in range(2):
            out = wrapper.run(q, cache.pools[layer], **cache.scales(layer))
            ref, _ = reference_decode(q, cache.pools[layer], layout="HND", **cache.scales(layer),
                                      **csr_kwargs(table))
            assert relative_error(out, ref) <= 2e-3, granularity


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(kv_scale="row"), ValueError, r"kv_scale must be one of \('tensor', 'token'\), got 'row'"),
    (dict(k_scale=0.0), ValueError, r"k_scale must be a positive finite float in .*got 0.0"),
    (dict(v_scale=float("nan")), ValueError, r"v_scale must be a positive finite .*got nan"),
    (dict(k_scale="1"), TypeError, r"k_scale must be a float, got '1'"),
    (dict(k_scale=1e39), ValueError, r"k_scale must be a positive finite float in .*got 1e\+39"),
])
def test_bad_cache_scales(kwargs, error, match):
    with pytest.raises(error, match=match):
        _cache(**kwargs)


def test_scales_on_a_half_cache_and_fp8_values_to_append():
    with pytest.raises(ValueError, match=r"kv_scale, k_scale and v_scale apply to an fp8 cache"):
        PagedKVCache(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=16,
                     kv_scale="token")
    with pytest.raises(ValueError, match=r"k_scale and v_scale are a per-tensor cache's .*"
                                         r"k_scale=0.5, v_scale=1.0"):
        _cache(kv_scale="token", k_scale=0.5)
    cache = _cache()
    cache.add_sequence(0)
    with pytest.raises(TypeError, match=r"k.dtype must be float16, bfloat16 or float32"):
        cache.append(0, torch.zeros(2, 1, 2, 16, dtype=FP8), torch.zeros(2, 1, 2, 16))
    assert cache.seq_len(0) == 0                     # nothing counted


def _planned():
    case = make_case(seq_lens=[20, 30], **HEADS, layout="HND")
    wrapper = DecodeWrapper("HND")
    wrapper.plan(**csr_kwargs(case.table), **HEADS)
    pool8, scales = fp8_pool(case.kv_cache, "HND", "token")
    return case, wrapper, pool8, scales


@pytest.mark.parametrize("scales, error, match", [
    (dict(), ValueError, r"an fp8 kv_cache needs its scales: k_scale= and v_scale= \(per tensor\) "
                         r"or kv_scales= \(per token\)"),
    (dict(k_scale=1.0), TypeError, r"v_scale must be a float, got None"),
    (dict(k_scale=-1.0, v_scale=1.0), ValueError, r"k_scale must be a positive .*got -1.0"),
    (dict(k_scale=1.0, v_scale=math.inf), ValueError, r"v_scale must be a positive .*got inf"),
    (dict(k_scale=3e38, v_scale=1.0), ValueError, r"k_scale must be at most 2\^64 .*got 3e\+38"),
    ("both", ValueError, r"give k_scale/v_scale \(per tensor\) or kv_scales \(per token\), not both"),
    ("shape", ValueError, r"kv_scales must be a contiguous \[num_pages, 2, num_kv_heads, "
                          r"page_size\] = \[\d+, 2, 2, 16\] tensor, got shape"),
    ("dtype", TypeError, r"kv_scales must have dtype torch.float32, got torch.float16"),
])
def test_bad_run_scales(scales, error, match):
    case, wrapper, pool8, good = _planned()
    if scales == "both":
        scales = dict(good, k_scale=1.0, v_scale=1.0)
    elif scales == "shape":
        scales = dict(kv_scales=good["kv_scales"][:, :, :1].contiguous())
    elif scales == "dtype":
        scales = dict(kv_scales=good["kv_scales"].half())
    out = torch.full_like(case.q, float("nan"))
    with pytest.raises(error, match=match):
        wrapper.run(case.q, pool8, out=out, **scales)
    assert torch.isnan(out).all()                   # nothing written


def test_scales_on_a_half_cache_at_run():
    case, wrapper, _, _ = _planned()
    with pytest.raises(ValueError, match=r"k_scale, v_scale and kv_scales dequantize an fp8 "
                                         r"kv_cache; this one is torch.float16"):
        wrapper.run(case.q, case.kv_cache, k_scale=1.0, v_scale=1.0)


def test_plan_kv_data_type():
    """plan(kv_data_type=) (FlashInfer's name): run() refuses a cache of another dtype, leaving
    out untouched; a matching cache runs as without it; bad values are refused at plan()."""
    case = make_case(seq_lens=[40, 17], **HEADS, layout="NHD", seed=2)
    pool8, scales = fp8_pool(case.kv_cache, "NHD", "tensor")
    wrapper = DecodeWrapper("NHD")
    wrapper.plan(**csr_kwargs(case.table), **HEADS, kv_data_type=FP8)
    out = torch.full_like(case.q, float("nan"))
    with pytest.raises(ValueError, match="the kv_cache is torch.float16, but the plan was made "
                                         "for kv_data_type=torch.float8_e4m3fn"):
        wrapper.run(case.q, case.kv_cache, out=out)
    assert out.isnan().all()
    wrapper.run(case.q, pool8, out=out, **scales)
    ref, _ = reference_decode(case.q, pool8, layout="NHD", **scales, **csr_kwargs(case.table))
    assert relative_error(out, ref) <= TOLERANCE[case.q.dtype]
    wrapper.plan(**csr_kwargs(case.table), **HEADS, kv_data_type=torch.float16)
    with pytest.raises(ValueError, match="the kv_cache is torch.float8_e4m3fn"):
        wrapper.run(case.q, pool8, **scales)
    with pytest.raises(TypeError, match="kv_data_type must be a torch.dtype or None, got 'fp8'"):
        wrapper.plan(**csr_kwargs(case.table), **HEADS, kv_data_type="fp8")
    with pytest.raises(ValueError, match="kv_data_type must be one of .* got torch.float32"):
        wrapper.plan(**csr_kwargs(case.table), **HEADS, kv_data_type=torch.float32)
