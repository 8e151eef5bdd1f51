"""Reading the page-table and cache arguments: shapes, dtypes, devices and values, checked.

Every error names the argument and the value it got.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .checks import check_offsets, check_tensor


def host_values(*tensors: torch.Tensor) -> list[np.ndarray]:
    """The int32 `tensors` as int64 numpy arrays, with at most one device-to-host copy (each copy
    is a synchronization) and none when they are on the host."""
    on_device = [t for t in tensors if t.device.type != "cpu"]
    host = (torch.cat([t.detach().reshape(-1) for t in on_device]).cpu().numpy().astype(np.int64)
            if on_device else np.zeros(0, dtype=np.int64))
    out, at = [], 0
    for t in tensors:
        if t.device.type == "cpu":
            out.append(t.detach().numpy().astype(np.int64))
        else:
            out.append(host[at: at + t.numel()])
            at += t.numel()
    return out


def check_metadata_device(device: torch.device, **tensors: torch.Tensor) -> None:
    """Lengths and offsets may sit on the host (no device-to-host copy in plan()) or beside the
    page indices; beside them while a CUDA graph is captured."""
    for name, t in tensors.items():
        if t.device != device and t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}; it must be on the CPU or on {device} with "
                             f"the page indices")
        check_not_copied_in_capture(name, t, device)


def check_not_copied_in_capture(name: str, t: torch.Tensor, device: torch.device) -> None:
    """A host tensor's copy to `device` captured in a CUDA graph would replay from a temporary
    buffer, not from `t` refilled in place: refused while capturing."""
    if (device.type == "cuda" and t.device.type == "cpu"
            and torch.cuda.is_current_stream_capturing()):
        raise ValueError(f"{name} is on the host while a CUDA graph is captured: give it on "
                         f"{device} (its copy would replay from a temporary buffer)")


def check_csr_shapes(kv_indptr, kv_indices, kv_last_page_len) -> int:
    """Dtypes and shapes of a CSR page table; returns its batch size."""
    check_tensor("kv_indptr", kv_indptr, dtype=torch.int32, dim=1)
    check_tensor("kv_indices", kv_indices, dtype=torch.int32, dim=1)
    check_tensor("kv_last_page_len", kv_last_page_len, dtype=torch.int32, dim=1)
    batch = kv_last_page_len.shape[0]
    for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                    ("kv_last_page_len", kv_last_page_len)):
        if t.shape[0] > 1 and t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")
    if kv_indptr.shape[0] != batch + 1:
        raise ValueError(f"kv_indptr must have batch_size + 1 = {batch + 1} entries (kv_last_page_len "
                         f"has {batch}), got {kv_indptr.shape[0]}")
    return batch


def check_block_shapes(block_table, seq_lens) -> int:
    """Dtypes, shapes and strides of a block table + seq_lens; returns its batch size."""
    check_tensor("block_table", block_table, dtype=torch.int32, dim=2)
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, dim=1)
    if block_table.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_table has {block_table.shape[0]} rows but seq_lens has "
                         f"{seq_lens.shape[0]} entries")
    if seq_lens.shape[0] > 1 and seq_lens.stride(0) != 1:
        raise ValueError(f"seq_lens must be contiguous, got stride {seq_lens.stride(0)}")
    if block_table.shape[0] and block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError(f"block_table must be contiguous along its last dim, got strides "
                         f"{block_table.stride()}")
    return block_table.shape[0]


@dataclass(frozen=True)
class PageTableArgs:
    """A step's page table as the planner takes it. leading: (indptr, last, lens) on the device
    (the block form passes seq_lens for all three); pages: page entries the table holds (kv_indices' length, or rows x width);
    max_page: the largest used page index when the values were checked, else -1; max_page_at:
    where it is, e.g. 'kv_indices[7] (row 1)' or 'block_table[1, 2]'."""

    csr: bool
    indices: torch.Tensor
    leading: tuple
    rows: int
    pages: int
    max_row_pages: int | None
    num_indices: int
    row_stride: int
    width: int
    max_page: int
    max_page_at: str = ""

    @property
    def device(self) -> torch.device:
        return self.indices.device


MAX_ROW_TOKENS = 2**30   # a row's positions, plus a split (schedule.MAX_SPLIT_TOKENS), in int32


def page_table_args(*, kv_indptr=None, kv_indices=None, kv_last_page_len=None, block_table=None,
                    seq_lens=None, page_size: int, check_values: bool) -> PageTableArgs:
    """The CSR triple or block_table + seq_lens, checked: dtypes, shapes, strides and devices
    always (no device read); lengths and page indices too with check_values (one or two
    device-to-host copies: a synchronization). Lengths and offsets on the host are copied to the
    device without waiting for it."""
    csr, block = (kv_indptr, kv_indices, kv_last_page_len), (block_table, seq_lens)
    if all(t is not None for t in csr) and all(t is None for t in block):
        rows = check_csr_shapes(*csr)
        indices = _kernel_side("kv_indices", kv_indices)
        check_metadata_device(indices.device, kv_indptr=kv_indptr, kv_last_page_len=kv_last_page_len)
        max_page, max_page_at = _checked_csr(*csr, page_size) if check_values else (-1, "")
        indptr, last = (_on_device(t, indices.device) for t in (kv_indptr, kv_last_page_len))
        leading, pages, max_row_pages = (indptr, last, last), indices.shape[0], None
        row_stride = width = 0
    elif all(t is not None for t in block) and all(t is None for t in csr):
        rows = check_block_shapes(*block)
        indices = _kernel_side("block_table", block_table)
        check_metadata_device(indices.device, seq_lens=seq_lens)
        max_page, max_page_at = (_checked_block(*block, page_size) if check_values
                                 else (-1, ""))
        lens = _on_device(seq_lens, indices.device)
        leading, width = (lens, lens, lens), block_table.shape[1]
        pages, max_row_pages, row_stride = rows * width, width, block_table.stride(0)
    else:
        raise ValueError("give either kv_indptr, kv_indices and kv_last_page_len (CSR) or "
                         "block_table and seq_lens, not a mix")
    entries, name = (pages, "kv_indices' entries") if max_row_pages is None else (
        width, "block_table's columns")
    if page_size > MAX_ROW_TOKENS:
        raise ValueError(f"page_size must be at most 2^30 tokens, got {page_size}")
    if entries * page_size > MAX_ROW_TOKENS:
        raise ValueError(f"page_size={page_size} x {entries} {name} can address more than "
                         f"2^30 tokens a row, past the kernels' int32 positions")
    return PageTableArgs(csr=indices is kv_indices, indices=indices, leading=leading, rows=rows,
                         pages=pages, max_row_pages=max_row_pages, num_indices=indices.numel(),
                         row_stride=row_stride, width=width, max_page=max_page,
                         max_page_at=max_page_at)


def _kernel_side(name: str, indices: torch.Tensor) -> torch.Tensor:
    """The page indices, on a device the kernels run on: a GPU, or the CPU (Triton's interpreter)."""
    if indices.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{name} is on {indices.device}: the page table must be on the GPU the "
                         f"kernels run on (or on the CPU, for Triton's interpreter)")
    return indices


def _on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on `device`; from the host through pinned memory, so the copy does not wait for the device."""
    if t.device == device:
        return t
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def _used_max(values: torch.Tensor, where, used: torch.Tensor | None = None) -> tuple[int, str]:
    """(the largest used page index, where it is) of `values` (all of them, or those where the
    mask `used` is set); (-1, "") for none; a negative one is a ValueError naming where it is.
    where(flat index) -> its name, e.g. 'kv_indices[7] (row 1)'. One read back to the host."""
    if not values.numel() or (used is not None and not bool(used.any())):
        return -1, ""
    wide = values.reshape(-1).to(torch.int64)
    low, high = wide, wide
    if used is not None:   # entries not used can be neither extreme
        low = torch.where(used.reshape(-1), wide, 2**62)
        high = torch.where(used.reshape(-1), wide, -2**62)
    at = torch.stack([low.argmin(), high.argmax()])
    (lo_at, hi_at), (lo, hi) = torch.stack([at, wide[at]]).tolist()
    if lo < 0:
        raise ValueError(f"{where(lo_at)}={lo} is a negative page index")
    return hi, where(hi_at)


def _checked_csr(kv_indptr, kv_indices, kv_last_page_len, page_size: int) -> tuple[int, str]:
    """The CSR table's values checked; returns the largest used page index and where it is."""
    indptr, last = host_values(kv_indptr, kv_last_page_len)
    pages = check_offsets("kv_indptr", indptr)
    if indptr[-1] > kv_indices.shape[0]:
        raise ValueError(f"kv_indptr[-1]={indptr[-1]} is past the end of kv_indices "
                         f"({kv_indices.shape[0]} entries)")
    bad = np.flatnonzero((pages > 0) & ((last < 1) | (last > page_size)))
    if len(bad):
        r = int(bad[0])
        raise ValueError(f"kv_last_page_len[{r}]={last[r]} must be in [1, page_size={page_size}]")
    return _used_max(kv_indices[: int(indptr[-1])], lambda j: f"kv_indices[{j}] (row "
                     f"{int(np.searchsorted(indptr, j, 'right')) - 1})")


def _checked_block(block_table, seq_lens, page_size: int) -> tuple[int, str]:
    """The block table's values checked; returns the largest used page index and where it is
    (entries past a row's pages are padding, not read)."""
    (lens,) = host_values(seq_lens)
    if (lens < 0).any():
        r = int(np.flatnonzero(lens < 0)[0])
        raise ValueError(f"seq_lens[{r}]={lens[r]} is negative")
    pages = -(-lens // page_size)
    over = np.flatnonzero(pages > block_table.shape[1])
    if len(over):
        r = int(over[0])
        raise ValueError(f"seq_lens[{r}]={lens[r]} needs {pages[r]} pages of {page_size} tokens, "
                         f"but block_table has only {block_table.shape[1]} per row")
    cols = torch.arange(block_table.shape[1], device=block_table.device)[None, :]
    used = cols < torch.from_numpy(pages).to(block_table.device)[:, None]
    width = block_table.shape[1]
    return _used_max(block_table, lambda j: f"block_table[{j // width}, {j % width}]", used)


def cache_views(kv_cache, layout: str):
    """(k, v, shape (P, H, S, D)) from a [P, 2, ...] pool or a (k, v) pair of [P, ...] tensors."""
    if isinstance(kv_cache, (tuple, list)):
        if len(kv_cache) != 2:
            raise ValueError(f"kv_cache as a sequence must be (k, v), got {len(kv_cache)} items")
        k = check_tensor("kv_cache[0] (k)", kv_cache[0])
        v = check_tensor("kv_cache[1] (v)", kv_cache[1])
        if k.dim() != 4 or v.shape != k.shape:
            raise ValueError(f"kv_cache (k, v) must be two 4-D tensors of one shape, got "
                             f"{list(k.shape)} and {list(v.shape)}")
        if v.dtype != k.dtype or v.device != k.device:
            raise TypeError(f"kv_cache k and v differ: {k.dtype} on {k.device}, {v.dtype} on {v.device}")
    else:
        check_tensor("kv_cache", kv_cache)
        if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
            want = "[P, 2, S, H, D] (NHD)" if layout == "NHD" else f"[P, 2, H, S, D] ({layout})"
            raise ValueError(f"kv_cache fits neither layout: expected {want} or a (k, v) pair, got "
                             f"shape {list(kv_cache.shape)}")
        k, v = kv_cache[:, 0], kv_cache[:, 1]
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k.stride() != v.stride():
        raise ValueError(f"kv_cache must be contiguous along head_dim with equal K and V strides, got "
                         f"{k.stride()} and {v.stride()}")
    p, a, b, d = k.shape
    heads, page = (b, a) if layout == "NHD" else (a, b)
    return k, v, (p, heads, page, d)
