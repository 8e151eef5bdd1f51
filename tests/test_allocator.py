"""Page allocator and cache writes: page boundaries, free and reuse, running out of pages."""
import types

import numpy as np
import pytest
import torch

from paged_case import csr_kwargs
from persistentkv import OutOfPagesError, PageAllocator, PagedKVCache
from persistentkv import allocator as allocator_module


def test_append_across_page_boundaries():
    alloc = PageAllocator(10, 4)
    alloc.add("a")
    pages, slots = alloc.append("a", 3)
    assert len(alloc.sequence("a").pages) == 1 and slots.tolist() == [0, 1, 2]
    pages2, slots2 = alloc.append("a", 6)                    # 9 tokens: 3 pages
    seq = alloc.sequence("a")
    assert seq.length == 9 and len(seq.pages) == 3
    assert slots2.tolist() == [3, 0, 1, 2, 3, 0]
    assert pages2.tolist() == [seq.pages[0]] + [seq.pages[1]] * 4 + [seq.pages[2]]
    assert alloc.num_free_pages == 7


def test_free_returns_pages_for_reuse():
    alloc = PageAllocator(4, 16, shuffle_seed=0)
    alloc.add(1)
    alloc.append(1, 40)
    taken = set(alloc.sequence(1).pages)
    alloc.free(1)
    assert alloc.num_free_pages == 4 and 1 not in alloc
    alloc.add(2)
    alloc.append(2, 64)
    assert set(alloc.sequence(2).pages) == set(range(4)) and taken < set(range(4))


def test_free_pages_lists_the_pages_in_the_order_appends_take_them():
    alloc = PageAllocator(6, 2, shuffle_seed=3)
    order = alloc.free_pages
    assert sorted(order) == list(range(6))
    alloc.add("a")
    alloc.append("a", 5)                                      # 3 pages, the first three listed
    assert alloc.sequence("a").pages == list(order[:3]) and alloc.free_pages == order[3:]
    alloc.free("a")                                           # back on top, in their order
    assert alloc.free_pages == order


def test_out_of_pages_changes_nothing():
    alloc = PageAllocator(3, 8)
    alloc.add("x")
    alloc.append("x", 10)
    with pytest.raises(OutOfPagesError, match="needs 2 more pages"):
        alloc.append("x", 20)
    assert alloc.sequence("x").length == 10 and alloc.num_free_pages == 1


def test_bad_ids_and_counts():
    alloc = PageAllocator(3, 8)
    alloc.add("x")
    with pytest.raises(ValueError, match="already exists"):
        alloc.add("x")
    with pytest.raises(ValueError, match="^unknown sequence id 'y'$"):
        alloc.free("y")
    with pytest.raises(ValueError, match="num_tokens"):
        alloc.append("x", -1)
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(0, 8)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cache_append_writes_every_layer_where_the_page_table_points(layout, device):
    cache = PagedKVCache(num_layers=2, num_pages=8, page_size=4, num_kv_heads=2, head_dim=16,
                         layout=layout, device=device, shuffle_seed=5, init="zeros")
    k = torch.randn(2, 7, 2, 16, dtype=torch.float16)
    v = torch.randn(2, 7, 2, 16, dtype=torch.float16)
    cache.add_sequence("s")
    cache.append("s", k[:, :3], v[:, :3])
    cache.append("s", k[:, 3:], v[:, 3:])                  # crosses a page boundary
    table = cache.page_table()
    assert table.seq_lens.tolist() == [7]
    pages = table.row_pages[0]
    for layer, pool in enumerate(cache.pools):
        kp, vp = pool[:, 0], pool[:, 1]
        if layout == "HND":
            kp, vp = kp.transpose(1, 2), vp.transpose(1, 2)
        got_k = kp[torch.from_numpy(pages).to(device)].reshape(-1, 2, 16)[:7].cpu()
        got_v = vp[torch.from_numpy(pages).to(device)].reshape(-1, 2, 16)[:7].cpu()
        assert torch.equal(got_k, k[layer]) and torch.equal(got_v, v[layer])


def test_cache_out_of_pages_leaves_pools_unchanged(device):
    cache = PagedKVCache(num_layers=1, num_pages=2, page_size=4, num_kv_heads=1, head_dim=16,
                         device=device, init="zeros")
    cache.add_sequence(0)
    before = cache.pools[0].clone()
    kv = torch.ones(1, 9, 1, 16, dtype=torch.float16)
    with pytest.raises(OutOfPagesError):
        cache.append(0, kv, kv)
    assert torch.equal(cache.pools[0], before) and cache.seq_len(0) == 0


def test_page_table_exports_agree(device):
    cache = PagedKVCache(num_layers=1, num_pages=32, page_size=8, num_kv_heads=1, head_dim=16,
                         device=device, shuffle_seed=1)
    for i, n in enumerate([8, 1, 17]):
        cache.add_sequence(i)
        cache.append_tokens(i, n)
    table = cache.page_table()
    csr = csr_kwargs(table, device)
    assert csr["kv_indptr"].tolist() == [0, 1, 2, 5]
    assert csr["kv_last_page_len"].tolist() == [8, 1, 1]
    block_table, seq_lens = table.block_table(device)
    assert seq_lens.tolist() == [8, 1, 17] and block_table.shape == (3, 3)
    for row in range(3):
        lo, hi = csr["kv_indptr"][row], csr["kv_indptr"][row + 1]
        assert block_table[row, : hi - lo].tolist() == csr["kv_indices"][lo:hi].tolist()
    assert all(d == torch.int32 for d in (block_table.dtype, seq_lens.dtype))
    assert np.unique(np.concatenate(table.row_pages)).size == 5


def test_bad_ids_counts_and_seeds_name_the_argument():
    alloc = PageAllocator(4, 2)
    for call in (lambda: alloc.add([1]), lambda: alloc.sequence([1]), lambda: [1] in alloc):
        with pytest.raises(TypeError, match=r"seq_id must be hashable .*got list \[1\]"):
            call()
    alloc.add("s")
    for bad, error in ((-100, ValueError), (1.5, TypeError)):
        with pytest.raises(error, match="num_tokens"):
            alloc.pages_needed("s", bad)
    for seed, error in ((True, TypeError), (1.5, TypeError), (-1, ValueError)):
        with pytest.raises(error, match="shuffle_seed"):
            PageAllocator(4, 2, shuffle_seed=seed)
    assert PageAllocator(4, 2, shuffle_seed=np.int64(3)).free_pages == \
        PageAllocator(4, 2, shuffle_seed=3).free_pages


def test_undo_append_checks_before_it_changes_anything():
    alloc = PageAllocator(4, 2)
    alloc.add("s")
    alloc.append("s", 3)
    before = (alloc.free_pages, alloc.sequence("s").pages[:], 3)
    for kwargs, error in ((dict(num_tokens=1, pages_before=-1), ValueError),
                          (dict(num_tokens="a", pages_before=0), TypeError),
                          (dict(num_tokens=10, pages_before=0), ValueError),
                          (dict(num_tokens=1, pages_before=3), ValueError),
                          (dict(num_tokens=1, pages_before=0), ValueError),    # 2 tokens left
                          (dict(num_tokens=3, pages_before=2), ValueError)):   # 0 tokens, 2 pages
        with pytest.raises(error):
            alloc.undo_append("s", **kwargs)
        assert (alloc.free_pages, alloc.sequence("s").pages, alloc.sequence("s").length) == before
    alloc.undo_append("s", 3, pages_before=0)
    assert alloc.num_free_pages == 4 and alloc.sequence("s").length == 0


def test_append_that_fails_midway_changes_nothing(monkeypatch):
    """append() takes its pages off the free list only once the slots are computed: a failure
    there (here a MemoryError from numpy) leaves the free list and the sequence as they were."""
    alloc = PageAllocator(4, 2)
    alloc.add("s")
    alloc.append("s", 1)
    before = (alloc.free_pages, alloc.sequence("s").pages[:], alloc.sequence("s").length)

    def no_memory(*args, **kwargs):
        raise MemoryError("no room for the positions")
    monkeypatch.setattr(allocator_module, "np", types.SimpleNamespace(arange=no_memory,
                                                                      int64=np.int64))
    with pytest.raises(MemoryError):
        alloc.append("s", 5)
    monkeypatch.undo()
    assert (alloc.free_pages, alloc.sequence("s").pages, alloc.sequence("s").length) == before
    pages, slots = alloc.append("s", 5)
    assert alloc.sequence("s").length == 6 and alloc.num_free_pages == 1
    assert list(slots) == [1, 0, 1, 0, 1] and len(set(pages.tolist())) == 3


def test_an_unknown_sequence_is_a_value_error_and_a_key_error():
    """The cache's calls with an id it does not hold raise one error, both a ValueError (bad
    input, as the rest of the API) and a KeyError (a lookup), its message unquoted."""
    cache = PagedKVCache(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=16,
                         device="cpu")
    for call in (lambda: cache.seq_len("z"), lambda: cache.page_table(["z"]),
                 lambda: cache.free_sequence("z"), lambda: cache.append_tokens("z", 1)):
        with pytest.raises(ValueError, match="^unknown sequence id 'z'$") as info:
            call()
        assert isinstance(info.value, KeyError)
