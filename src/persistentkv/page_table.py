"""A batch's page table, exported in FlashInfer's CSR form or as vLLM's block_table + seq_lens."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .checks import check_count, check_positive_int


INT32_MIN, INT32_MAX = -2**31, 2**31 - 1


@dataclass(frozen=True, eq=False)   # numpy rows: compared and hashed by identity
class PageTable:
    """Pages of each row of a decode batch, in token order.

    row_pages: one int64 array of page indices per row; seq_lens: int64 [B] tokens per row.
    """

    row_pages: tuple[np.ndarray, ...]
    seq_lens: np.ndarray
    page_size: int

    def __post_init__(self):
        """Checked, each row's pages as int64 arrays: as many pages as its tokens fill (the CSR
        form could not say otherwise). The page values are not checked here: a table may name
        pages outside a pool, as an engine's may, which plan(check_page_table=True) refuses and
        the page guard reads as page 0."""
        page_size = check_positive_int("page_size", self.page_size)
        try:
            rows = tuple(np.asarray(p) for p in self.row_pages)
            lens = np.asarray(self.seq_lens)
        except (TypeError, ValueError) as err:
            raise TypeError(f"row_pages and seq_lens must be integer sequences: {err}") from None
        if lens.ndim != 1 or len(lens) != len(rows):
            raise ValueError(f"seq_lens must hold one length per row ({len(rows)}), got shape "
                             f"{list(lens.shape)}")
        for name, a in [("seq_lens", lens)] + [(f"row_pages[{r}]", p) for r, p in enumerate(rows)]:
            if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
                raise TypeError(f"{name} must be a 1-D integer array, got {a.dtype} of shape "
                                f"{list(a.shape)}")
            if a.size and (a.min() < INT32_MIN or a.max() > INT32_MAX):   # exported as int32
                bad = a[(a < INT32_MIN) | (a > INT32_MAX)][0]
                raise ValueError(f"{name} must fit in int32 (the exported tables' type), got "
                                 f"{int(bad)}")
        if lens.size and lens.min() < 0:
            raise ValueError(f"seq_lens must be >= 0, got {int(lens.min())}")
        for r, (pages, n) in enumerate(zip(rows, lens)):
            if len(pages) != -(-int(n) // page_size):
                raise ValueError(f"row {r} has {len(pages)} pages for seq_lens[{r}]={int(n)} "
                                 f"tokens; pages of {page_size} need {-(-int(n) // page_size)}")
        object.__setattr__(self, "row_pages", tuple(p.astype(np.int64) for p in rows))
        object.__setattr__(self, "seq_lens", lens.astype(np.int64))
        object.__setattr__(self, "page_size", page_size)

    @property
    def batch_size(self) -> int:
        return len(self.row_pages)

    def csr(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kv_indptr [B+1], kv_indices [nnz], kv_last_page_len [B]), int32, as FlashInfer takes them."""
        counts = np.array([len(p) for p in self.row_pages], dtype=np.int64)
        indptr = np.zeros(self.batch_size + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        indices = np.concatenate(self.row_pages) if self.batch_size else np.zeros(0, np.int64)
        last = np.where(self.seq_lens > 0, (self.seq_lens - 1) % self.page_size + 1, 0)
        return tuple(
            torch.from_numpy(a.astype(np.int32)).to(device) for a in (indptr, indices, last)
        )  # type: ignore[return-value]

    def block_table(self, device: torch.device | str = "cpu", *, pad_to: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_table [B, max_pages], seq_lens [B]), int32; unused entries are 0."""
        width = max([len(p) for p in self.row_pages], default=0)
        if pad_to is not None:
            pad_to = check_count("pad_to", pad_to)
            if pad_to < width:
                raise ValueError(f"pad_to={pad_to} is smaller than the longest row's {width} pages")
            width = pad_to
        table = np.zeros((self.batch_size, max(width, 1)), dtype=np.int32)
        for row, pages in enumerate(self.row_pages):
            table[row, : len(pages)] = pages
        return (torch.from_numpy(table).to(device),
                torch.from_numpy(self.seq_lens.astype(np.int32)).to(device))
