"""Paged KV cache: one page pool per layer, all sharing one page allocator and page table.

Layouts, as FlashInfer names them (P pages, H KV heads, S tokens per page, D head dim):
    "HND": [P, 2, H, S, D]      "NHD": [P, 2, S, H, D]      (index 0 of dim 1 is K, 1 is V)
"""
from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from .allocator import OutOfPagesError, PageAllocator
from .page_table import PageTable

LAYOUTS = ("NHD", "HND")
CACHE_DTYPES = (torch.float16, torch.bfloat16)

__all__ = ["PagedKVCache", "OutOfPagesError", "LAYOUTS", "CACHE_DTYPES", "check_layout"]


def check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"kv_layout must be one of {LAYOUTS}, got {layout!r}")
    return layout  # type: ignore[return-value]


class PagedKVCache:
    """Page pools for `num_layers` layers and the allocator that hands out their pages.

    Each pool is [num_pages, 2, ...] in `layout`; `pools[layer]` is what `DecodeWrapper.run` takes.
    """

    def __init__(self, *, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float16, layout: str = "NHD",
                 device: torch.device | str = "cpu", shuffle_seed: int | None = None,
                 init: str = "empty"):
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if dtype not in CACHE_DTYPES:
            raise TypeError(f"dtype must be one of {CACHE_DTYPES}, got {dtype}")
        if init not in ("empty", "zeros", "randn"):
            raise ValueError(f"init must be 'empty', 'zeros' or 'randn', got {init!r}")
        self.layout = check_layout(layout)
        self.allocator = PageAllocator(num_pages, page_size, shuffle_seed=shuffle_seed)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_size, self.num_pages, self.dtype = page_size, num_pages, dtype
        self.device = torch.device(device)
        inner = (num_kv_heads, page_size) if layout == "HND" else (page_size, num_kv_heads)
        shape = (num_pages, 2, *inner, head_dim)
        make = {"empty": torch.empty, "zeros": torch.zeros, "randn": torch.randn}[init]
        self.pools = [make(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    # -- sequences -------------------------------------------------------------------------------
    def add_sequence(self, seq_id: object) -> None:
        self.allocator.add(seq_id)

    def free_sequence(self, seq_id: object) -> None:
        self.allocator.free(seq_id)

    def seq_len(self, seq_id: object) -> int:
        return self.allocator.sequence(seq_id).length

    def append(self, seq_id: object, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens of every layer. k, v: [num_layers, n, Hkv, D] in the cache's dtype.

        Pages are allocated as needed; when the pool runs out, OutOfPagesError is raised and the
        cache is left as it was.
        """
        expect = (self.num_layers, k.shape[1] if k.dim() == 4 else -1, self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != expect:
                raise ValueError(f"{name} must be [num_layers, n, num_kv_heads, head_dim] = "
                                 f"{list(expect)}, got {list(t.shape)}")
            if t.dtype != self.dtype:
                raise TypeError(f"{name}.dtype must be the cache's {self.dtype}, got {t.dtype}")
        pages, slots = self.allocator.append(seq_id, int(k.shape[1]))
        self.write_slots(pages, slots, k, v)

    def append_tokens(self, seq_id: object, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Reserve slots for `num_tokens` tokens without writing them; returns (pages, slots)."""
        return self.allocator.append(seq_id, num_tokens)

    def write_slots(self, pages: np.ndarray, slots: np.ndarray, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [num_layers, n, Hkv, D] into the given (page, slot) of each layer's pool."""
        if len(pages) == 0:
            return
        p = torch.from_numpy(np.asarray(pages, dtype=np.int64)).to(self.device)
        s = torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(self.device)
        for layer, pool in enumerate(self.pools):
            for kv, src in ((0, k), (1, v)):
                if self.layout == "NHD":
                    pool[p, kv, s] = src[layer].to(self.device)
                else:
                    pool[p, kv, :, s] = src[layer].to(self.device)

    # -- page tables -----------------------------------------------------------------------------
    def page_table(self, seq_ids: Iterable[object] | None = None) -> PageTable:
        """The page table of `seq_ids` (default: every live sequence, in insertion order)."""
        ids = self.allocator.sequence_ids if seq_ids is None else list(seq_ids)
        seqs = [self.allocator.sequence(i) for i in ids]
        return PageTable(
            row_pages=tuple(np.asarray(s.pages, dtype=np.int64) for s in seqs),
            seq_lens=np.asarray([s.length for s in seqs], dtype=np.int64),
            page_size=self.page_size,
        )
