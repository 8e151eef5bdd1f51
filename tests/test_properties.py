"""Property tests (hypothesis): decode on random problems against the float64 reference, the page
allocator as a state machine, and the page table's two export forms agreeing with each other."""
import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from paged_case import ON_GPU, block_kwargs, csr_kwargs, make_case
from persistentkv import (BACKENDS, TOLERANCE, DecodeWrapper, OutOfPagesError, PageAllocator,
                          PagedKVCache, reference_decode, relative_error)
from persistentkv.tuning import default_config

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# -- decode against the reference -----------------------------------------------------------------
@st.composite
def decode_problems(draw):
    num_kv_heads = draw(st.integers(1, 2), label="num_kv_heads")
    group = draw(st.sampled_from([1, 2, 3, 4, 5, 7, 8]), label="group")
    backend = draw(st.sampled_from(BACKENDS), label="backend")
    return dict(
        # a length 0 is an inactive row
        seq_lens=draw(st.lists(st.integers(1, 200) | st.just(0), min_size=1, max_size=4),
                      label="seq_lens"),
        num_kv_heads=num_kv_heads,
        num_qo_heads=group * num_kv_heads,
        head_dim=draw(st.sampled_from([16, 32, 64]), label="head_dim"),
        page_size=draw(st.sampled_from([1, 4, 8, 16, 32]), label="page_size"),
        layout=draw(st.sampled_from(["HND", "NHD", "HND_VT"]), label="layout"),
        backend=backend,
        dtype=draw(st.sampled_from(sorted(DTYPES)), label="dtype"),
        split_pages=(draw(st.none() | st.integers(1, 8), label="split_pages")
                     if backend == "split" else None),
        table_form=draw(st.sampled_from(["csr", "block_table"]), label="table_form"),
        first_pages=draw(st.booleans(), label="first_pages"),
        seed=draw(st.integers(0, 2**32 - 1), label="seed"),
    )


# every example compiles a new kernel variant on a GPU (seconds each); the interpreter has none
@settings(max_examples=12, deadline=None)
@given(p=decode_problems())
def test_decode_matches_reference_on_random_problems(p):
    dtype = DTYPES[p["dtype"]]
    case = make_case(seq_lens=p["seq_lens"], num_qo_heads=p["num_qo_heads"],
                     num_kv_heads=p["num_kv_heads"], head_dim=p["head_dim"],
                     page_size=p["page_size"], dtype=dtype, layout=p["layout"], seed=p["seed"])
    table = csr_kwargs(case.table) if p["table_form"] == "csr" else block_kwargs(case.table)
    wrapper = DecodeWrapper(p["layout"])
    wrapper.plan(**table, num_qo_heads=p["num_qo_heads"], num_kv_heads=p["num_kv_heads"],
                 head_dim=p["head_dim"], page_size=p["page_size"], backend=p["backend"],
                 split_pages=p["split_pages"],
                 config=dataclasses.replace(default_config(head_dim=p["head_dim"],
                                                           num_kv_heads=p["num_kv_heads"]),
                                            first_pages=p["first_pages"]))
    out = torch.full_like(case.q, float("nan"))
    result = wrapper.run(case.q, case.kv_cache, out=out)
    assert result is out
    active = [r for r, n in enumerate(p["seq_lens"]) if n > 0]
    inactive = [r for r, n in enumerate(p["seq_lens"]) if n == 0]
    assert torch.isnan(out[inactive].float()).all()            # inactive rows are left untouched
    if not active:
        return
    ref, _ = reference_decode(case.q, case.kv_cache, layout=p["layout"],
                              sm_scale=wrapper.current_plan.sm_scale, **csr_kwargs(case.table))
    err = relative_error(out[active], ref[active])
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e} over {TOLERANCE[dtype]} for {p}"


# -- allocator state machine ----------------------------------------------------------------------
class AllocatorMachine(RuleBasedStateMachine):
    """Random add / append / free against a model that only tracks each sequence's length."""

    @initialize(num_pages=st.integers(1, 24), page_size=st.integers(1, 8),
                shuffle_seed=st.none() | st.integers(0, 2**16))
    def make_allocator(self, num_pages, page_size, shuffle_seed):
        self.alloc = PageAllocator(num_pages, page_size, shuffle_seed=shuffle_seed)
        self.lengths: dict[int, int] = {}   # the model: live ids and their lengths
        self.next_id = 0

    def pick(self, index: int) -> int:
        """A live id (adding one first when none is live, so that no rule needs a precondition)."""
        if not self.lengths:
            self.add()
        ids = sorted(self.lengths)
        return ids[index % len(ids)]

    @rule()
    def add(self):
        self.alloc.add(self.next_id)
        self.lengths[self.next_id] = 0
        self.next_id += 1

    @rule(index=st.integers(0, 1 << 16), num_tokens=st.integers(0, 80))
    def append(self, index, num_tokens):
        sid = self.pick(index)
        size = self.alloc.page_size
        seq = self.alloc.sequence(sid)
        before_pages, before_free = list(seq.pages), self.alloc.num_free_pages
        need = ceil_div(seq.length + num_tokens, size) - len(before_pages)
        if need > before_free:
            event("append: out of pages")
            with pytest.raises(OutOfPagesError):
                self.alloc.append(sid, num_tokens)
            seq = self.alloc.sequence(sid)
            assert seq.length == self.lengths[sid]
            assert seq.pages == before_pages
            assert self.alloc.num_free_pages == before_free
            return
        event("append: " + ("no new page", "1 new page", "2+ new pages")[min(max(need, 0), 2)])
        start = seq.length
        pages, slots = self.alloc.append(sid, num_tokens)
        self.lengths[sid] += num_tokens
        seq = self.alloc.sequence(sid)
        assert seq.pages[: len(before_pages)] == before_pages          # old pages stay in place
        assert self.alloc.num_free_pages == before_free - max(need, 0)
        positions = np.arange(start, start + num_tokens)
        assert len(pages) == len(slots) == num_tokens
        assert slots.tolist() == (positions % size).tolist()
        assert pages.tolist() == [seq.pages[i] for i in positions // size]

    @rule(index=st.integers(0, 1 << 16))
    def free(self, index):
        sid = self.pick(index)
        owned, before_free = len(self.alloc.sequence(sid).pages), self.alloc.num_free_pages
        self.alloc.free(sid)
        del self.lengths[sid]
        assert sid not in self.alloc
        assert self.alloc.num_free_pages == before_free + owned

    @invariant()
    def pages_are_conserved(self):
        alloc = self.alloc
        assert sorted(alloc.sequence_ids) == sorted(self.lengths)
        owned = [p for sid in alloc.sequence_ids for p in alloc.sequence(sid).pages]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        free = list(alloc.free_pages)   # the free list itself: no page may be lost or duplicated
        assert len(free) == alloc.num_free_pages
        assert sorted(owned + free) == list(range(alloc.num_pages))

    @invariant()
    def each_sequence_owns_ceil_length_pages(self):
        for sid, length in self.lengths.items():
            seq = self.alloc.sequence(sid)
            assert seq.length == length
            assert len(seq.pages) == ceil_div(length, self.alloc.page_size)


AllocatorMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40,
                                              deadline=None)
test_allocator_state_machine = AllocatorMachine.TestCase


# -- page table exports ---------------------------------------------------------------------------
@st.composite
def cache_histories(draw):
    """A small cache and a history of (op, seq, tokens) steps; returns (cache, live ids)."""
    page_size = draw(st.sampled_from([1, 2, 4, 8, 16]), label="page_size")
    num_pages = draw(st.integers(1, 40), label="num_pages")
    shuffle_seed = draw(st.none() | st.integers(0, 2**16), label="shuffle_seed")
    cache = PagedKVCache(num_layers=1, num_pages=num_pages, page_size=page_size, num_kv_heads=1,
                         head_dim=16, device="cpu", shuffle_seed=shuffle_seed, init="zeros")
    live, next_id = [], 0
    ops = draw(st.lists(st.tuples(st.sampled_from(["add", "append", "append", "free"]),
                                  st.integers(0, 1 << 16), st.integers(0, 3 * page_size + 5)),
                        max_size=30), label="ops")
    for op, index, tokens in ops:
        if op == "add" or not live:
            cache.add_sequence(next_id)
            live.append(next_id)
            next_id += 1
        elif op == "append":
            try:
                cache.append_tokens(live[index % len(live)], tokens)
            except OutOfPagesError:
                pass
        else:
            cache.free_sequence(live.pop(index % len(live)))
    order = draw(st.permutations(live), label="row_order")
    return cache, order


@settings(max_examples=100, deadline=None)
@given(history=cache_histories())
def test_page_table_csr_and_block_table_agree(history):
    cache, ids = history
    size = cache.page_size
    table = cache.page_table(ids)
    indptr, indices, last = (t.numpy().astype(np.int64) for t in table.csr())
    block, lens = (t.numpy().astype(np.int64) for t in table.block_table())
    batch = len(ids)
    for t in (table.csr() + table.block_table()):
        assert t.dtype == torch.int32

    # CSR is well formed
    assert indptr.shape == (batch + 1,) and indptr[0] == 0
    assert (np.diff(indptr) >= 0).all()
    assert indptr[-1] == len(indices)
    assert last.shape == (batch,) and lens.shape == (batch,)
    assert block.shape[0] == batch and block.shape[1] >= 1

    for row, sid in enumerate(ids):
        seq = cache.allocator.sequence(sid)
        n_pages = ceil_div(seq.length, size)
        csr_pages = indices[indptr[row]: indptr[row + 1]]
        # CSR and block table describe the same pages, and both the allocator's
        assert csr_pages.tolist() == seq.pages and len(csr_pages) == n_pages
        assert block[row, :n_pages].tolist() == seq.pages
        assert (block[row, n_pages:] == 0).all()
        # ... and the same length
        assert lens[row] == seq.length
        if n_pages:
            assert 1 <= last[row] <= size
            assert (n_pages - 1) * size + last[row] == seq.length
        else:
            assert seq.length == 0 and last[row] == 0

    # every page appears at most once across the batch
    assert len(set(indices.tolist())) == len(indices)
    # the default table is every live sequence, in insertion order
    default = cache.page_table()
    assert [p.tolist() for p in default.row_pages] == [
        cache.allocator.sequence(i).pages for i in cache.allocator.sequence_ids]
