"""Context parallelism: each row's pages spread over the ranks of a torch.distributed group, each
rank attending to its share with the usual kernels, one collective merging the partials exactly.

    share = shard_table(table, rank=r, world_size=w,      # this rank's pages of every row
                        min_pages_per_rank=1)             # shorter rows whole on one rank
    indptr, indices, last = share.csr(device)
    cp = ContextParallelDecode("HND", group=group)        # one per rank
    cp.plan(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last, num_qo_heads=...)
    out = cp.run(q, kv_cache)                             # the whole rows' attention, every rank

A rank's share of a row is any subset of its pages (contiguous or interleaved): for one query
per row, the softmax over a set of tokens does not depend on their order, and the shares' (o, lse)
merge exactly: out = sum_r e^(lse_r - M) o_r / sum_r e^(lse_r - M), lse = M + log(sum_r
e^(lse_r - M)), the math of the in-launch merge. A rank with no tokens of a row contributes
nothing: its lse is -inf and its o row, whatever it holds, counts as 0. The merge is an
all-gather of (o, lse) ("all_gather") or three all-reduces of rescaled sums ("all_reduce"); NCCL
on GPUs, gloo on CPUs. Soft-capping (a per-score function) and an fp8 cache (each rank's scales)
apply in each rank's kernel; attention sinks join once, in the merge. One query per row, no
sliding window: positions would cross the shares. Tensor parallelism composes by heads: each
tensor-parallel rank runs its own heads' context-parallel group.

Short rows stay whole on one rank: a row is spread only when every rank would get at least
min_pages_per_rank of its pages; the others go whole, longest first, to the rank holding the fewest
tokens so far (the spread rows' shares included; ties to the lowest rank), so every rank computes
the same assignment from the same table, without communication (short_row_ranks). The default, 1
page, spreads every row of at least world_size pages; the threshold where spreading starts to pay
(a task and the merge per rank against the KV read) is still to be calibrated on GPUs.
"""
from __future__ import annotations

import numpy as np
import torch

from .checks import check_count, check_positive_int, check_sinks, check_tensor
from .page_table import PageTable
from .wrapper import DecodeWrapper

PLACEMENTS = ("contiguous", "interleaved")
MERGES = ("all_gather", "all_reduce")


def _check_sharding(world_size, placement, min_pages_per_rank) -> tuple[int, int]:
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    return (check_positive_int("world_size", world_size),
            check_positive_int("min_pages_per_rank", min_pages_per_rank))


def _spread_tokens(counts: np.ndarray, lens: np.ndarray, size: int, world: int,
                   placement: str) -> np.ndarray:
    """Tokens [R, W] of each rank's share of R rows of counts [R] pages and lens [R] tokens, each
    spread over all W ranks (counts >= W)."""
    ranks = np.arange(world)
    n = counts[:, None]
    if placement == "contiguous":
        pages = (ranks + 1) * n // world - ranks * n // world
        holder = np.full(len(counts), world - 1)
    else:
        pages = (n - ranks + world - 1) // world
        holder = (counts - 1) % world
    tokens = pages * size
    tokens[np.arange(len(counts)), holder] -= counts * size - lens    # the partial last page
    return tokens


def _check_table(table: object) -> None:
    if not isinstance(table, PageTable):
        raise TypeError(f"table must be a PageTable, got {type(table).__name__} {table!r:.80}")


def short_row_ranks(table: PageTable, *, world_size: int, placement: str = "contiguous",
                    min_pages_per_rank: int = 1) -> np.ndarray:
    """The rank that holds each row of `table` whole, int64 [B]; -1 for a row spread over every
    rank (at least min_pages_per_rank pages per rank, i.e. >= min_pages_per_rank x world_size
    pages). Short rows go, longest first (ties: the lower row), to the rank with the fewest tokens
    so far, spread rows' shares included (ties: the lower rank): the same answer on every rank.
    The default threshold of 1 page is not yet calibrated on GPUs."""
    _check_table(table)
    world, least = _check_sharding(world_size, placement, min_pages_per_rank)
    counts = np.array([len(p) for p in table.row_pages], dtype=np.int64)
    lens = np.asarray(table.seq_lens, dtype=np.int64)
    owner = np.full(len(counts), -1, dtype=np.int64)
    spread = counts >= least * world
    load = _spread_tokens(counts[spread], lens[spread], table.page_size, world,
                          placement).sum(axis=0)
    short = np.flatnonzero(~spread)
    for row in short[np.argsort(-lens[short], kind="stable")]:
        owner[row] = int(np.argmin(load))                                # the first of the least
        load[owner[row]] += lens[row]
    return owner


def shard_table(table: PageTable, *, rank: int, world_size: int,
                placement: str = "contiguous", min_pages_per_rank: int = 1) -> PageTable:
    """Rank `rank`'s share of every row of `table` (B rows, in order). A row of n pages with
    n >= min_pages_per_rank x world_size is spread: contiguous (pages [r n / W, (r + 1) n / W)) or
    interleaved (pages r, r + W, ...). A shorter row goes whole to one rank (short_row_ranks) and
    is empty elsewhere. A share's length counts its tokens: full pages, and the row's last (partial)
    page for the rank that holds it. The default threshold (1 page) is to be calibrated on GPUs."""
    _check_table(table)
    world, _ = _check_sharding(world_size, placement, min_pages_per_rank)
    rank = check_count("rank", rank)
    if rank >= world:
        raise ValueError(f"rank must be in [0, world_size={world}), got {rank}")
    owner = short_row_ranks(table, world_size=world, placement=placement,
                            min_pages_per_rank=min_pages_per_rank)
    pages, lens = [], []
    size = table.page_size
    for row_pages, n, held_by in zip(table.row_pages, table.seq_lens.tolist(), owner.tolist()):
        row_pages = np.asarray(row_pages, dtype=np.int64)
        if held_by >= 0:
            whole = held_by == rank
            pages.append(row_pages if whole else row_pages[:0])
            lens.append(int(n) if whole else 0)
            continue
        count = len(row_pages)
        mine = (np.arange(rank * count // world, (rank + 1) * count // world)
                if placement == "contiguous" else np.arange(rank, count, world))
        holds_last = mine[-1] == count - 1            # a spread row gives every rank >= 1 page
        pages.append(row_pages[mine])
        lens.append(len(mine) * size - ((count * size - n) if holds_last else 0))
    return PageTable(row_pages=tuple(pages), seq_lens=np.asarray(lens, dtype=np.int64),
                     page_size=size)


def merge_across_ranks(o: torch.Tensor, lse: torch.Tensor, *, group=None,
                       method: str = "all_gather",
                       sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact merge of every rank's (o [B, Hq, D], lse [B, Hq] natural log; -inf: no tokens,
    and o's row is not read) over `group`; returns (out [B, Hq, D] in o's dtype, lse [B, Hq]
    fp32) on every rank. sinks: float32 [Hq], one logit per head that joins the merged
    softmax's denominator once (each rank's (o, lse) is taken without it): out *= e^lse /
    (e^lse + e^sink)."""
    import torch.distributed as dist

    if method not in MERGES:
        raise ValueError(f"method must be one of {MERGES}, got {method!r}")
    check_tensor("o", o, dim=3)
    check_tensor("lse", lse, dim=2)
    if tuple(lse.shape) != tuple(o.shape[:2]) or lse.device != o.device:
        raise ValueError(f"lse must be [B, Hq] = {list(o.shape[:2])} on o's device {o.device}, "
                         f"got {list(lse.shape)} on {lse.device}")
    if sinks is not None:
        check_sinks(sinks, num_qo_heads=o.shape[1], device=o.device)
    # contiguous, as collectives take them (NCCL's refuse strided views; o or lse may be one)
    lse = lse.float().contiguous()   # a rank without tokens of a row (lse -inf) adds 0
    o32 = torch.where(torch.isneginf(lse)[..., None], 0.0, o.float()).contiguous()
    if method == "all_gather":
        world = dist.get_world_size(group)
        os_, lses = [torch.empty_like(o32) for _ in range(world)], [torch.empty_like(lse)
                                                                     for _ in range(world)]
        dist.all_gather(os_, o32, group=group)
        dist.all_gather(lses, lse, group=group)
        o_all, lse_all = torch.stack(os_), torch.stack(lses)             # [W, B, Hq, (D)]
        top = lse_all.amax(dim=0)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        w = torch.exp(lse_all - top)                                     # 0 where no tokens
        total = w.sum(dim=0)
        out = (w[..., None] * o_all).sum(dim=0) / total.clamp_min(1e-30)[..., None]
    else:
        top = lse.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        w = torch.exp(lse - top)
        weighted = w[..., None] * o32
        total = w.clone()
        dist.all_reduce(weighted, group=group)
        dist.all_reduce(total, group=group)
        out = weighted / total.clamp_min(1e-30)[..., None]
    merged_lse = top + torch.log(total)
    if sinks is not None:
        with_sink = torch.logaddexp(merged_lse, sinks[None, :])
        kept = torch.exp(merged_lse - with_sink)   # an empty row under a -inf sink keeps 0
        out = out * torch.where(torch.isneginf(with_sink), 0.0, kept)[..., None]
        merged_lse = with_sink
    return out.to(o.dtype), merged_lse


class ContextParallelDecode:
    """One rank's side of context-parallel decode over `group` (default: the world). plan() takes
    this rank's share of the page table (shard_table: a row may have none, some or all of its
    pages here) and DecodeWrapper.plan's other options; run() returns every row's full attention
    on every rank. method: the merge's collective (merge_across_ranks)."""

    def __init__(self, kv_layout: str = "NHD", *, group=None, method: str = "all_gather",
                 **wrapper_kwargs):
        if method not in MERGES:
            raise ValueError(f"method must be one of {MERGES}, got {method!r}")
        self.group, self.method = group, method
        self.wrapper = DecodeWrapper(kv_layout, **wrapper_kwargs)
        self._active = None

    def plan(self, **plan_kwargs):
        if plan_kwargs.get("qo_indptr") is not None:
            raise ValueError("context-parallel decode takes one query per row; got qo_indptr="
                             f"{plan_kwargs['qo_indptr']!r}")
        if plan_kwargs.get("window_left", -1) != -1:
            raise ValueError("context-parallel decode takes no window; got window_left="
                             f"{plan_kwargs['window_left']!r}")
        plan = self.wrapper.plan(**plan_kwargs)
        if plan_kwargs.get("seq_lens") is not None:
            lengths = plan_kwargs["seq_lens"]
        else:
            lengths = torch.diff(plan_kwargs["kv_indptr"])
        self._active = lengths.to(plan.indices.device) > 0                # [B]: tokens here
        return plan

    def run(self, q: torch.Tensor, kv_cache, *, return_lse: bool = False,
            sinks: torch.Tensor | None = None, k_scale: float | None = None,
            v_scale: float | None = None, kv_scales: torch.Tensor | None = None):
        """q [B, Hq, D] (the same on every rank) -> out [B, Hq, D] (and lse [B, Hq] fp32).
        sinks, k_scale, v_scale and kv_scales as DecodeWrapper.run's (kv_scales: this rank's
        pool's); the sinks join the merged softmax once, not once a rank (merge_across_ranks
        checks them before its collective)."""
        if self._active is None:
            raise RuntimeError("run() called before plan()")
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
        out, lse = self.wrapper.run(q, kv_cache, return_lse=True, k_scale=k_scale,
                                    v_scale=v_scale, kv_scales=kv_scales)
        lse = torch.where(self._active[:, None], lse, torch.full_like(lse, float("-inf")))
        merged, merged_lse = merge_across_ranks(out, lse, group=self.group, method=self.method,
                                                sinks=sinks)
        return (merged, merged_lse) if return_lse else merged
