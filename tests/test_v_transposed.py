"""The HND_VT layout (V's (page, head) blocks stored transposed): PagedKVCache writes it, the
reference reads it, and the decode kernel reads it in every schedule, with an fp16 cache and an
fp8 one (per-tensor and per-token scales), page sizes below, at and above the tile; the same
tokens in an HND cache give the same output; bad caches are refused."""
import pytest
import torch

from paged_case import DEVICE, csr_kwargs, block_kwargs, make_case
from persistentkv import (BACKENDS, TOLERANCE, DecodeWrapper, PagedKVCache, reference_decode,
                          relative_error)
from persistentkv.cache import v_transposed
from persistentkv.quant import FP8

HEADS = dict(num_qo_heads=8, num_kv_heads=2, head_dim=32)


def _caches(seq_lens, *, page_size, dtype, kv_scale="tensor", seed=0):
    """The same random tokens appended to an HND and an HND_VT cache (one layer, pages shuffled
    by one seed): ({layout: cache}, q)."""
    gen = torch.Generator().manual_seed(seed)
    h, d = HEADS["num_kv_heads"], HEADS["head_dim"]
    pages = sum(-(-n // page_size) for n in seq_lens) + 3
    extra = dict(kv_scale=kv_scale) if dtype == FP8 else {}
    if dtype == FP8 and kv_scale == "tensor":
        extra.update(k_scale=0.02, v_scale=0.02)
    caches = {layout: PagedKVCache(num_layers=1, num_pages=pages, page_size=page_size,
                                   num_kv_heads=h, head_dim=d, dtype=dtype, layout=layout,
                                   device=DEVICE, shuffle_seed=seed, init="zeros", **extra)
              for layout in ("HND", "HND_VT")}
    src = torch.float16
    for i, n in enumerate(seq_lens):
        k = torch.randn(1, n, h, d, generator=gen).to(src)
        v = torch.randn(1, n, h, d, generator=gen).to(src)
        for cache in caches.values():
            cache.add_sequence(i)
            cache.append(i, k, v)
    q = torch.randn(len(seq_lens), HEADS["num_qo_heads"], d, generator=gen).to(torch.float16)
    return caches, q.to(DEVICE)


def _run(cache, q, *, backend, table_form="csr", split_pages=None):
    table = cache.page_table()
    kwargs = csr_kwargs(table) if table_form == "csr" else block_kwargs(table)
    wrapper = DecodeWrapper(cache.layout)
    wrapper.plan(**kwargs, **HEADS, page_size=cache.page_size, backend=backend,
                 split_pages=split_pages, kv_data_type=cache.dtype)
    out = torch.full_like(q, float("nan"))
    wrapper.run(q, cache.pools[0], out=out, **cache.scales(0))
    ref, _ = reference_decode(q, cache.pools[0], layout=cache.layout, **cache.scales(0),
                              **csr_kwargs(table))
    return out, ref


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, kv_scale", [(torch.float16, "tensor"), (FP8, "tensor"),
                                             (FP8, "token")])
def test_every_schedule_matches_the_reference_and_hnd(backend, dtype, kv_scale):
    caches, q = _caches([300, 9, 130, 33], page_size=16, dtype=dtype, kv_scale=kv_scale, seed=1)
    outs = {}
    for layout, cache in caches.items():
        out, ref = _run(cache, q, backend=backend, split_pages=2 if backend == "split" else None)
        assert relative_error(out, ref) <= TOLERANCE[torch.float16], (layout, backend)
        outs[layout] = out
    assert relative_error(outs["HND_VT"], outs["HND"]) <= 1e-3


@pytest.mark.parametrize("page_size", [4, 64, 128])
def test_pages_smaller_and_larger_than_the_tile(page_size):
    """Tiles of whole pages (page 4) and tiles inside one page (64 and 128: the tile is 64 tokens
    at head dim 32, 128 on an fp8 cache... whichever the default is), block-table form too."""
    caches, q = _caches([700, 5, 257], page_size=page_size, dtype=FP8, kv_scale="token", seed=2)
    cache = caches["HND_VT"]
    for form in ("csr", "block"):
        out, ref = _run(cache, q, backend="split", table_form=form)
        assert relative_error(out, ref) <= TOLERANCE[torch.float16], (page_size, form)


def test_the_cache_writes_v_transposed():
    """append() puts V[token, head, :] in column `slot` of the page's [D, S] block; K as HND."""
    caches, _ = _caches([20], page_size=8, dtype=torch.float16, seed=3)
    hnd, vt = caches["HND"], caches["HND_VT"]
    assert torch.equal(hnd.pools[0][:, 0], vt.pools[0][:, 0])
    assert torch.equal(v_transposed(vt.pools[0]), hnd.pools[0][:, 1].transpose(2, 3))


def test_a_last_page_tail_takes_no_weight():
    """The kernel reads a row's last page whole: large finite values in the slots past the row's
    length change nothing; an HND_VT cache made with init="empty" is zero-filled (finite)."""
    caches, q = _caches([37, 5], page_size=16, dtype=FP8, kv_scale="token", seed=5)
    cache = caches["HND_VT"]
    before, _ = _run(cache, q, backend="split")
    table = cache.page_table()
    vt = v_transposed(cache.pools[0])                                    # [P, H, D, S]
    for pages, n in zip(table.row_pages, table.seq_lens):
        vt[int(pages[-1]), :, :, int(n) % 16 or 16:] = 400.0
        cache.kv_scales[0][int(pages[-1]), :, :, int(n) % 16 or 16:] = 1e3
    after, ref = _run(cache, q, backend="split")
    assert torch.equal(before, after) and relative_error(after, ref) <= TOLERANCE[torch.float16]
    empty = PagedKVCache(num_layers=1, num_pages=3, page_size=16, num_kv_heads=2, head_dim=32,
                         layout="HND_VT", device=DEVICE)
    assert (empty.pools[0] == 0).all()


@pytest.mark.parametrize("dtype, kv_scale", [(torch.float16, "tensor"), (FP8, "token")])
def test_a_page_given_back_keeps_no_non_finite_v(dtype, kv_scale, monkeypatch):
    """A NaN and an inf in one sequence's V stay with it: free_sequence zeroes V (per-token
    scales 1) in its pages, so the next sequence on the page, shorter than it, reads finite
    tails; an append that fails after writing gives its new pages back the same way."""
    extra = dict(kv_scale=kv_scale) if dtype == FP8 else {}
    cache = PagedKVCache(num_layers=1, num_pages=1, page_size=16, num_kv_heads=2, head_dim=32,
                         dtype=dtype, layout="HND_VT", device=DEVICE, **extra)
    k = torch.randn(1, 16, 2, 32, dtype=torch.float16)
    v = torch.randn(1, 16, 2, 32, dtype=torch.float16)
    v[0, 7, 0, 3], v[0, 12, 1, 5] = float("nan"), float("inf")
    cache.add_sequence("a")
    cache.append("a", k, v)
    cache.free_sequence("a")
    cache.add_sequence("b")
    cache.append("b", k[:, :5], v[:, :5])
    q = torch.randn(1, HEADS["num_qo_heads"], 32, dtype=torch.float16).to(DEVICE)
    out, ref = _run(cache, q, backend="split")
    assert out.isfinite().all() and relative_error(out, ref) <= TOLERANCE[torch.float16]
    cache.free_sequence("b")
    write = cache._write

    def write_then_fail(*args):
        write(*args)
        raise RuntimeError("a write that fails after its tokens are in")
    monkeypatch.setattr(cache, "_write", write_then_fail)
    cache.add_sequence("c")
    with pytest.raises(RuntimeError, match="fails after"):
        cache.append("c", k, v)
    assert (cache.pools[0][:, 1].float() == 0).all() and cache.seq_len("c") == 0
    assert cache.kv_scales is None or (cache.kv_scales[0][:, 1] == 1).all()


def test_bad_caches_are_refused():
    with pytest.raises(ValueError, match="HND_VT layout takes a page_size that is a power of two, got 12"):
        PagedKVCache(num_layers=1, num_pages=4, page_size=12, num_kv_heads=2, head_dim=32,
                     layout="HND_VT", device=DEVICE)
    case = make_case(seq_lens=[40], **HEADS, page_size=16, layout="HND_VT", seed=4)
    wrapper = DecodeWrapper("HND_VT")
    with pytest.raises(ValueError, match="HND_VT layout takes a page_size that is a power of two, "
                                         "got 3"):   # at plan(), not first at run()
        wrapper.plan(**csr_kwargs(make_case(seq_lens=[40], **HEADS, page_size=3).table),
                     **HEADS, page_size=3)
    wrapper.plan(**csr_kwargs(case.table), **HEADS, page_size=16)
    pool = torch.randn(case.kv_cache.shape[0], 2, 2, 16, 64, dtype=torch.float16,
                       device=DEVICE)[..., :32]                   # blocks of 16 x 32, not dense
    with pytest.raises(ValueError, match=r"HND_VT cache's \(page, head\) blocks must be dense"):
        wrapper.run(case.q, pool)


@pytest.mark.parametrize("dtype, kv_scale", [(torch.float16, "tensor"), (FP8, "token")])
def test_a_failed_give_back_or_append_changes_nothing(dtype, kv_scale, monkeypatch):
    """free_sequence makes V's zeros before it gives the pages back (a failure there gave them
    back with their non-finite V); an append whose conversion fails on a later layer writes no
    layer (the first layer's rows and scales were written)."""
    extra = dict(kv_scale=kv_scale) if dtype == FP8 else {}
    cache = PagedKVCache(num_layers=2, num_pages=2, page_size=4, num_kv_heads=2, head_dim=32,
                         dtype=dtype, layout="HND_VT", device=DEVICE, **extra)
    k = torch.randn(2, 3, 2, 32, dtype=torch.float16)
    v = torch.full_like(k, float("inf")) if dtype == torch.float16 else torch.randn_like(k)
    cache.add_sequence("a")
    cache.append("a", k, v)
    before = ([p.clone() for p in cache.pools], cache.allocator.free_pages,
              None if cache.kv_scales is None else [s.clone() for s in cache.kv_scales])

    def unchanged():
        return (all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                    for a, b in zip(before[0], cache.pools))
                and cache.allocator.free_pages == before[1] and cache.seq_len("a") == 3
                and (before[2] is None or all(torch.equal(a, b)
                                              for a, b in zip(before[2], cache.kv_scales))))
    zeros = cache._v_zeros
    monkeypatch.setattr(cache, "_v_zeros", lambda pages: (_ for _ in ()).throw(MemoryError()))
    with pytest.raises(MemoryError):
        cache.free_sequence("a")
    assert unchanged()
    monkeypatch.setattr(cache, "_v_zeros", zeros)
    import persistentkv.cache as cache_module
    calls = []
    real = cache_module.quantize if dtype == FP8 else None

    def fail_on_layer_1(rows, scale):
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("conversion fails on layer 1")
        return real(rows, scale)
    if dtype == FP8:
        monkeypatch.setattr(cache_module, "quantize", fail_on_layer_1)
        with pytest.raises(RuntimeError, match="layer 1"):
            cache.append("a", k[:, :1], v[:, :1])
        assert unchanged()
