"""Random paged decode problems with scattered page tables, for the tests."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from persistentkv import PageTable

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"


@dataclass
class Case:
    q: torch.Tensor
    kv_cache: object
    table: PageTable
    layout: str


def make_case(*, seq_lens, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
              dtype=torch.float16, layout: str = "NHD", as_pair: bool = False, spare_pages: int = 3,
              seed: int | None = None, device=DEVICE) -> Case:
    """Unit-variance q and K/V; each row's pages drawn at random, without repeats, from the pool."""
    gen = np.random.default_rng(seed)
    pages_per_row = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_row) + spare_pages
    perm = gen.permutation(num_pages)
    row_pages, at = [], 0
    for n in pages_per_row:
        row_pages.append(perm[at: at + n].astype(np.int64))
        at += n
    table = PageTable(row_pages=tuple(row_pages), seq_lens=np.asarray(seq_lens, dtype=np.int64),
                      page_size=page_size)
    inner = (page_size, num_kv_heads) if layout == "NHD" else (num_kv_heads, page_size)
    cache = torch.randn(num_pages, 2, *inner, head_dim, dtype=dtype, device=device)
    kv_cache = (cache[:, 0].contiguous(), cache[:, 1].contiguous()) if as_pair else cache
    q = torch.randn(len(seq_lens), num_qo_heads, head_dim, dtype=dtype, device=device)
    return Case(q=q, kv_cache=kv_cache, table=table, layout=layout)


def draw_case(draw, seq_lens, *, groups):
    """A hypothesis-drawn case over seq_lens: (case, heads, backend) with 2 KV heads of a group
    from `groups`, head dim 32, page size 1, 8 or 16, any layout, any plan() backend."""
    from hypothesis import strategies as st

    from persistentkv import BACKENDS

    group = draw(st.sampled_from(groups), label="group")
    heads = dict(num_qo_heads=2 * group, num_kv_heads=2, head_dim=32,
                 page_size=draw(st.sampled_from([1, 8, 16]), label="page_size"))
    backend = draw(st.sampled_from(BACKENDS), label="backend")
    case = make_case(seq_lens=seq_lens, **heads,
                     layout=draw(st.sampled_from(["HND", "NHD", "HND_VT"]), label="layout"),
                     seed=draw(st.integers(0, 2**16), label="seed"))
    return case, heads, backend


def queries(case: Case, q_lens, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Several query tokens per row: q [sum(q_lens), Hq, D] of unit variance (drawn from `seed`)
    and qo_indptr int32 [B+1] on the host."""
    gen = torch.Generator().manual_seed(seed)
    total, (_, heads, dim) = sum(q_lens), case.q.shape
    q = torch.randn(total, heads, dim, generator=gen).to(case.q.dtype).to(DEVICE)
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    return q, indptr


def csr_kwargs(table: PageTable, device=DEVICE) -> dict:
    indptr, indices, last = table.csr(device)
    return dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last)


def block_kwargs(table: PageTable, device=DEVICE) -> dict:
    block_table, seq_lens = table.block_table(device)
    return dict(block_table=block_table, seq_lens=seq_lens)
