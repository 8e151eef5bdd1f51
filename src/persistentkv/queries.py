"""Several query tokens per row (speculative-decoding verification, short chunks): qo_indptr.

Row b's queries are q[qo_indptr[b]:qo_indptr[b+1]] of q [total_q, Hq, D]: the row's last n_b
tokens, whose K/V are already in the cache. Query j (0-based, of n_b) attends the KV positions
< seq_len - n_b + j + 1 (causal). The kernel packs a row's n_b tokens x the G query heads of a KV
head into the rows of one tile, so each K/V tile is still loaded once for all of them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .checks import check_offsets, check_tensor
from .page_inputs import host_values
from .runtime import next_power_of_2

MAX_QUERIES_PER_ROW = 16
MAX_TILE_ROWS = 128          # query tokens x group in one tile


@dataclass(frozen=True)
class QueryLayout:
    """A step's query tokens: indptr int32 [B+1] on the kernels' device, total = indptr[B]
    (q.shape[0] at run(); None in graph mode, where the values stay on the device), max_per_row
    = the tile's query tokens per row (a power of two >= the most of any row); host_source: the
    pinned copy indptr came from, kept while the plan lives (a captured copy replays from it)."""

    indptr: torch.Tensor
    total: int | None
    max_per_row: int
    host_source: torch.Tensor | None = None


def _check_indptr_tensor(qo_indptr: object) -> None:
    """int32, one dimension, contiguous (the kernel reads it so)."""
    check_tensor("qo_indptr", qo_indptr, dtype=torch.int32, dim=1)
    if qo_indptr.shape[0] > 1 and qo_indptr.stride(0) != 1:
        raise ValueError(f"qo_indptr must be contiguous, got stride {qo_indptr.stride(0)}")


def query_layout(qo_indptr: object, *, rows: int, group: int, device: torch.device,
                 seq_lens: np.ndarray | None, tile_queries: int | None = None) -> QueryLayout:
    """qo_indptr checked (its values are read on the host: a synchronization if it is on the
    device); seq_lens, where known on the host, bound each row's queries. tile_queries: the
    tile's query tokens per row, fixed (whatever the batch holds, as batch invariance needs),
    else the batch's most."""
    total, tile = _host_layout(qo_indptr, rows=rows, group=group, device=device,
                               seq_lens=seq_lens, tile_queries=tile_queries)
    pinned = _pinned(qo_indptr, device)
    on_device = qo_indptr if qo_indptr.device == device else (
        pinned.to(device, non_blocking=True) if pinned is not None else qo_indptr.to(device))
    return QueryLayout(indptr=on_device, total=total, max_per_row=tile, host_source=pinned)


def refilled_query_layout(layout: QueryLayout, qo_indptr: object, *, group: int,
                          tile_queries: int | None = None) -> QueryLayout | None:
    """An eager plan's layout for the same qo_indptr tensor refilled in place: its new values
    checked as query_layout checks them (the rows' lengths are not known on the host: the page
    table that replans is on the device), then copied into the layout's device buffer (stream
    ordered: after the kernels already queued that read the old ones; nothing to copy when
    qo_indptr is that buffer). None, with nothing copied, when the new values need another tile
    (the plan is then made afresh)."""
    rows = layout.indptr.shape[0] - 1
    total, tile = _host_layout(qo_indptr, rows=rows, group=group, device=layout.indptr.device,
                               seq_lens=None, tile_queries=tile_queries)
    if tile != layout.max_per_row:
        return None
    pinned = _pinned(qo_indptr, layout.indptr.device)
    if qo_indptr is not layout.indptr:
        layout.indptr.copy_(pinned if pinned is not None else qo_indptr,
                            non_blocking=pinned is not None)
    return QueryLayout(indptr=layout.indptr, total=total, max_per_row=tile, host_source=pinned)


def _host_layout(qo_indptr: object, *, rows: int, group: int, device: torch.device,
                 seq_lens: np.ndarray | None, tile_queries: int | None) -> tuple[int, int]:
    """qo_indptr's values checked on the host: (total query tokens, the tile's query tokens a
    row)."""
    _check_indptr_tensor(qo_indptr)
    if qo_indptr.shape[0] != rows + 1:
        raise ValueError(f"qo_indptr must have batch_size + 1 = {rows + 1} entries, got "
                         f"{qo_indptr.shape[0]}")
    if qo_indptr.device.type != "cpu" and qo_indptr.device != device:
        raise ValueError(f"qo_indptr is on {qo_indptr.device}: it must be on the host or on the "
                         f"page table's device {device}")
    if qo_indptr.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise ValueError(f"qo_indptr is on {qo_indptr.device} while a CUDA graph is captured: "
                         f"plan() reads it on the host, which a capture cannot; give it on the "
                         f"host, or build the DecodeWrapper with use_cuda_graph=True")
    (indptr,) = host_values(qo_indptr)
    counts = check_offsets("qo_indptr", indptr)
    most = int(counts.max()) if rows else 0
    if most > MAX_QUERIES_PER_ROW:
        raise ValueError(f"a row has {most} query tokens: at most {MAX_QUERIES_PER_ROW} per row "
                         f"are supported")
    if tile_queries is not None and most > tile_queries:
        raise ValueError(f"a row has {most} query tokens, over the wrapper's "
                         f"max_queries_per_row={tile_queries}")
    if seq_lens is not None:
        over = np.flatnonzero(counts > seq_lens)
        if len(over):
            r = int(over[0])
            raise ValueError(f"row {r} has {counts[r]} query tokens (qo_indptr) but only "
                             f"{seq_lens[r]} tokens in the cache: its queries must be among them")
    if tile_queries is not None:
        tile = max(2, next_power_of_2(tile_queries))
    elif (counts == 1).all():                 # plain decode: the one-token kernel
        tile = 1
    else:
        tile = max(2, next_power_of_2(max(most, 1)))
    _check_tile(tile, group=group, queries_per_row=(
        f"max_queries_per_row={tile_queries}" if tile_queries is not None
        else f"the batch's most query tokens a row, {most},"))
    return int(indptr[-1]), tile


def _pinned(qo_indptr: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A pinned copy of a host qo_indptr bound for a CUDA device (the copy then waits for
    nothing), else None."""
    return (qo_indptr.pin_memory() if device.type == "cuda" and qo_indptr.device.type == "cpu"
            else None)


def _check_tile(tile: int, *, group: int, queries_per_row: str) -> None:
    """A tile of `tile` query tokens a row x the group's heads holds at most MAX_TILE_ROWS rows."""
    if tile * group > MAX_TILE_ROWS:
        raise ValueError(f"{queries_per_row} takes a tile of {tile} query tokens x group "
                         f"{group} = {tile * group} rows: at most {MAX_TILE_ROWS} are supported")


def graph_query_layout(qo_indptr: object, *, rows: int, group: int, max_queries_per_row: int,
                       device: torch.device) -> QueryLayout:
    """Graph mode's qo_indptr: a device tensor refilled in place before each replay, its values
    not read on the host (the kernel clamps each row's count to the tile's, max_queries_per_row
    rounded up to a power of two, and never reads or writes past q's rows; the planner counts
    the rows it clamps for DecodeWrapper.check())."""
    _check_indptr_tensor(qo_indptr)
    if qo_indptr.shape[0] != rows + 1:
        raise ValueError(f"qo_indptr must have max_batch_size + 1 = {rows + 1} entries, got "
                         f"{qo_indptr.shape[0]}")
    if qo_indptr.device != device:
        raise ValueError(f"in graph mode qo_indptr must be on the page table's device {device}, "
                         f"got {qo_indptr.device}")
    tile = max(2, next_power_of_2(max_queries_per_row))
    _check_tile(tile, group=group, queries_per_row=f"max_queries_per_row={max_queries_per_row}")
    return QueryLayout(indptr=qo_indptr, total=None, max_per_row=tile)


def host_seq_lens(*, kv_indptr=None, kv_last_page_len=None, seq_lens=None,
                  page_size: int) -> np.ndarray | None:
    """The rows' lengths when the tensors that give them are on the host (no device read), else
    None."""
    if seq_lens is not None:
        return seq_lens.numpy().astype(np.int64) if seq_lens.device.type == "cpu" else None
    if kv_indptr is None or kv_indptr.device.type != "cpu" or kv_last_page_len.device.type != "cpu":
        return None
    pages = np.diff(kv_indptr.numpy().astype(np.int64))
    return np.where(pages > 0, (pages - 1) * page_size + kv_last_page_len.numpy(), 0)
