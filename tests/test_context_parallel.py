"""Context parallelism on the CPU: 2 and 3 gloo processes, each attending to its share of every
row's pages through the interpreter, merge to the float64 reference of the whole rows; uneven
shares, short rows whole on one rank (shorter than a page, and of no tokens), both placements,
both merges; the short rows' assignment (covered once, balanced, deterministic)."""
import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from paged_case import DEVICE, ON_GPU, csr_kwargs, make_case
from persistentkv import PageTable, reference_decode, relative_error
from persistentkv.context_parallel import (ContextParallelDecode, merge_across_ranks, shard_table,
                                          short_row_ranks)

HEADS = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
LENS = [300, 9, 130, 0, 33, 16]    # 19 pages, 1 page (shorter than one), 9, none, 3 and exactly 1
ROWS = [row for row, n in enumerate(LENS) if n]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _variants(case) -> tuple[torch.Tensor, dict, dict]:
    """An e4m3 copy of the case's pool with per-tensor scales, plan()'s soft-cap, and run()'s
    scales and sinks (the same on every rank: drawn from the seeded generator)."""
    from persistentkv.quant import FP8_MAX, quantize

    x = case.kv_cache.float()
    k_scale, v_scale = (float(x[:, i].abs().max()) / FP8_MAX for i in (0, 1))
    pool = torch.stack([quantize(x[:, 0], k_scale), quantize(x[:, 1], v_scale)], dim=1)
    sinks = torch.randn(HEADS["num_qo_heads"], dtype=torch.float32, device=case.q.device)
    return pool, dict(logits_soft_cap=30.0), dict(k_scale=k_scale, v_scale=v_scale, sinks=sinks)


def _rank(rank, world, port, placement, method, min_pages, variants, result_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)                  # the same q and K/V on every rank
        case = make_case(seq_lens=LENS, **HEADS, layout="HND", seed=7)
        pool, plan_extra, run_extra = _variants(case) if variants else (case.kv_cache, {}, {})
        share = shard_table(case.table, rank=rank, world_size=world, placement=placement,
                            min_pages_per_rank=min_pages)
        cp = ContextParallelDecode("HND", method=method)
        cp.plan(**csr_kwargs(share), **HEADS, backend="split", split_pages=2, **plan_extra)
        out, lse = cp.run(case.q, pool, return_lse=True, **run_extra)
        ref, ref_lse = reference_decode(case.q, pool, layout="HND", **csr_kwargs(case.table),
                                        **plan_extra, **run_extra)
        empty = [row for row, n in enumerate(LENS) if not n]     # (0, -inf), as the reference
        empty_lse = run_extra["sinks"].expand(len(empty), -1) if variants else float("-inf")
        errors = (relative_error(out[ROWS], ref[ROWS]), relative_error(lse[ROWS], ref_lse[ROWS]),
                  float((out[empty] == 0).all() and (lse[empty] == empty_lse).all()))
        gathered = [None] * world
        dist.all_gather_object(gathered, errors)
        if rank == 0:
            np.save(result_path, np.array(gathered))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(ON_GPU, reason="the CPU test of the gloo path (a GPU run takes NCCL and 2 GPUs)")
@pytest.mark.parametrize("world, placement, method, min_pages, variants", [
    (2, "contiguous", "all_gather", 1, False), (3, "interleaved", "all_reduce", 1, False),
    (3, "contiguous", "all_gather", 1, False),
    (2, "interleaved", "all_reduce", 5, False),   # only the 19-page row spread; 130, 33 whole too
    (2, "interleaved", "all_gather", 1, True),    # e4m3 cache, soft-cap and sinks
    (3, "contiguous", "all_reduce", 1, True),
])
def test_ranks_merge_to_the_whole_rows(tmp_path, world, placement, method, min_pages, variants):
    path = str(tmp_path / "errors.npy")
    mp.spawn(_rank, args=(world, _free_port(), placement, method, min_pages, variants, path),
             nprocs=world)
    errors = np.load(path)
    assert errors.shape == (world, 3)
    assert (errors[:, 0] <= 2e-3).all() and (errors[:, 1] <= 1e-4).all(), errors
    assert (errors[:, 2] == 1).all(), errors


def _merge_rank(rank, world, port, method, with_sinks, result_path):
    """Rank r's (o, lse) for 4 rows of 2 heads (every rank draws all ranks' from one seed): row 0
    held by rank 0 alone, row 1 by rank 1 alone, row 2 by both, row 3 by none; a rank without a
    row's tokens gives lse -inf and an o row of NaN and inf, as an unwritten output can hold.
    with_sinks: a sink of -inf on head 0 (none) and 0.7 on head 1."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        gen = torch.Generator().manual_seed(3)
        o = torch.randn(world, 4, 2, 16, generator=gen, dtype=torch.float64)
        lse = torch.randn(world, 4, 2, generator=gen, dtype=torch.float64)
        lse[1, 0] = lse[0, 1] = lse[:, 3] = float("-inf")
        o[1, 0], o[0, 1], o[:, 3] = float("nan"), float("inf"), float("nan")
        sinks = torch.tensor([float("-inf"), 0.7], dtype=torch.float64)
        out, merged_lse = merge_across_ranks(o[rank].float(), lse[rank].float(), method=method,
                                             sinks=sinks.float() if with_sinks else None)
        ref_lse = torch.logsumexp(lse, dim=0)                                 # [4, 2]
        w = torch.exp(lse - torch.where(torch.isneginf(ref_lse), 0.0, ref_lse))
        ref = (w[..., None] * torch.where(torch.isneginf(lse)[..., None], 0.0, o)).sum(0)
        if with_sinks:
            with_sink = torch.logaddexp(ref_lse, sinks)
            ref = ref * torch.where(torch.isneginf(with_sink), 0.0,
                                    torch.exp(ref_lse - with_sink))[..., None]
            ref_lse = with_sink
        finite = torch.isfinite(ref_lse)
        errors = (relative_error(out, ref), relative_error(merged_lse[finite], ref_lse[finite]),
                  float(not torch.equal(torch.isneginf(merged_lse), torch.isneginf(ref_lse))),
                  float(not out.isfinite().all()))
        if rank == 0:
            np.save(result_path, np.array(errors))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(ON_GPU, reason="the CPU test of the gloo path (a GPU run takes NCCL and 2 GPUs)")
@pytest.mark.parametrize("method", ["all_gather", "all_reduce"])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_merge_ignores_the_output_of_ranks_without_tokens(tmp_path, method, with_sinks):
    """Against a float64 merge; a row no rank holds merges to (0, -inf), under a sink of -inf
    too, and to (0, sink) under a finite one."""
    path = str(tmp_path / "errors.npy")
    mp.spawn(_merge_rank, args=(2, _free_port(), method, with_sinks, path), nprocs=2)
    errors = np.load(path)
    assert (errors <= 1e-6).all(), errors


def test_shards_cover_every_token_once():
    table = PageTable(row_pages=tuple(np.arange(a, a + n) for a, n in ((0, 19), (40, 1), (50, 3))),
                      seq_lens=np.array([300, 9, 33]), page_size=16)
    for placement in ("contiguous", "interleaved"):
        for world in (1, 2, 3, 5):
            shares = [shard_table(table, rank=r, world_size=world, placement=placement)
                      for r in range(world)]
            for row in range(3):
                pages = np.concatenate([s.row_pages[row] for s in shares])
                assert sorted(pages.tolist()) == table.row_pages[row].tolist()
                assert sum(int(s.seq_lens[row]) for s in shares) == table.seq_lens[row]
    with pytest.raises(ValueError, match="placement must be one of"):
        shard_table(table, rank=0, world_size=2, placement="random")
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got 2"):
        shard_table(table, rank=2, world_size=2)


def _tokens_per_rank(shares) -> np.ndarray:
    return np.array([int(s.seq_lens.sum()) for s in shares])


@pytest.mark.parametrize("placement", ["contiguous", "interleaved"])
@pytest.mark.parametrize("world, min_pages", [(1, 1), (2, 1), (3, 1), (3, 4), (5, 2), (8, 3)])
def test_short_rows_stay_whole_on_one_rank(placement, world, min_pages):
    """Every token once across the ranks; rows of fewer than min_pages x world pages on exactly one
    rank (whole), the others on every rank; tokens per rank within the largest short row of each
    other (or of the spread rows' own imbalance); the same answer on every call."""
    gen = np.random.default_rng(world * 10 + min_pages)
    lens = np.concatenate([[0, 1, 15, 16, 17, 500], gen.integers(0, 400, 30)])
    at = np.cumsum([0] + [-(-int(n) // 16) for n in lens])
    table = PageTable(row_pages=tuple(np.arange(a, b) for a, b in zip(at[:-1], at[1:])),
                      seq_lens=lens.astype(np.int64), page_size=16)
    opts = dict(world_size=world, placement=placement, min_pages_per_rank=min_pages)
    owner = short_row_ranks(table, **opts)
    assert np.array_equal(owner, short_row_ranks(table, **opts))
    shares = [shard_table(table, rank=r, **opts) for r in range(world)]
    counts = np.array([len(p) for p in table.row_pages])
    short = counts < min_pages * world
    assert np.array_equal(owner >= 0, short) and (owner < world).all()
    for row in range(len(lens)):
        pages = np.concatenate([s.row_pages[row] for s in shares])
        assert sorted(pages.tolist()) == table.row_pages[row].tolist()
        held = [r for r in range(world) if len(shares[r].row_pages[row])]
        assert sum(int(s.seq_lens[row]) for s in shares) == lens[row]
        if short[row] and lens[row]:
            assert held == [owner[row]] and shares[owner[row]].seq_lens[row] == lens[row]
        elif not short[row]:
            assert held == list(range(world))
    spread_only = PageTable(row_pages=tuple(p if not s else p[:0]
                                            for p, s in zip(table.row_pages, short)),
                            seq_lens=np.where(short, 0, lens), page_size=16)
    spread_gap = np.ptp(_tokens_per_rank([shard_table(spread_only, rank=r, **opts)
                                          for r in range(world)]))
    gap = np.ptp(_tokens_per_rank(shares))
    assert gap <= max(spread_gap, lens[short].max(initial=0)), (gap, spread_gap)


def test_balanced_short_rows_and_bad_options():
    """Short rows balance against the spread rows' shares, longest first, ties to the lower rank."""
    table = PageTable(row_pages=(np.arange(0, 8), np.arange(8, 10), np.arange(10, 11),
                                 np.arange(11, 13), np.zeros(0, np.int64)),
                      seq_lens=np.array([128, 20, 16, 32, 0]), page_size=16)
    # row 0 spread (64 tokens per rank); 32 -> rank 0, 20 -> rank 1, 16 -> rank 1, 0 -> rank 0
    assert short_row_ranks(table, world_size=2, min_pages_per_rank=2).tolist() == [-1, 1, 1, 0, 0]
    assert short_row_ranks(table, world_size=2, min_pages_per_rank=5).tolist() == [0, 1, 1, 1, 1]
    for name, bad, error in (("min_pages_per_rank", 0, ValueError),
                             ("min_pages_per_rank", 1.0, TypeError),
                             ("min_pages_per_rank", True, TypeError),
                             ("world_size", 0, ValueError)):
        opts = {**dict(world_size=2, min_pages_per_rank=1), name: bad}
        with pytest.raises(error, match=name):
            short_row_ranks(table, **opts)
        with pytest.raises(error, match=name):
            shard_table(table, rank=0, **opts)
    with pytest.raises(ValueError, match="rank must be >= 0, got -1"):
        shard_table(table, rank=-1, world_size=2)
    for call in (lambda t: short_row_ranks(t, world_size=2),
                 lambda t: shard_table(t, rank=0, world_size=2)):
        with pytest.raises(TypeError, match="table must be a PageTable, got dict"):
            call({"row_pages": [], "seq_lens": [], "page_size": 16})


@pytest.mark.skipif(not ON_GPU, reason="NCCL and CUDA graphs need a GPU (one is enough: a group of one rank)")
@pytest.mark.parametrize("method, with_sinks", [("all_gather", False), ("all_reduce", False),
                                               ("all_gather", True)])
def test_nccl_merge_is_captured_with_the_step(method, with_sinks):
    """On one GPU, a one-rank NCCL group: plan (graph mode), run and the merge's collective (and
    the sinks it adds) in one CUDA graph; replays with fresh queries match the float64
    reference."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        case = make_case(seq_lens=[300, 9, 130], **HEADS, layout="HND", seed=11)
        indptr, indices, last = shard_table(case.table, rank=0, world_size=1).csr("cuda")
        cp = ContextParallelDecode("HND", method=method, use_cuda_graph=True, max_batch_size=3,
                                   max_num_pages=indices.numel())
        q = case.q.clone()
        kwargs = dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last, **HEADS)
        sinks = dict(sinks=torch.randn(HEADS["num_qo_heads"], device="cuda")) if with_sinks else {}
        cp.plan(**kwargs)
        cp.run(q, case.kv_cache, **sinks)            # warm-up: NCCL's communicator, compiles
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cp.plan(**kwargs)
            out, lse = cp.run(q, case.kv_cache, return_lse=True, **sinks)
        for _ in range(3):
            q.normal_()
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            ref, ref_lse = reference_decode(q, case.kv_cache, layout="HND", **csr_kwargs(case.table),
                                            **sinks)
            assert relative_error(out, ref) <= 2e-3 and relative_error(lse, ref_lse) <= 1e-4
    finally:
        dist.destroy_process_group()


def test_context_parallel_bad_arguments():
    """Each is refused before any collective, naming the argument."""
    case = make_case(seq_lens=[40, 20], **HEADS, layout="HND")
    cp = ContextParallelDecode("HND")
    with pytest.raises(ValueError, match="takes one query per row; got qo_indptr=tensor"):
        cp.plan(**csr_kwargs(case.table), **HEADS,
                qo_indptr=torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="takes no window; got window_left=4"):
        cp.plan(**csr_kwargs(case.table), **HEADS, window_left=4)
    cp.plan(**csr_kwargs(case.table), **HEADS)
    for bad in (1, "no"):
        with pytest.raises(TypeError, match=f"return_lse must be a bool, got {bad!r}"):
            cp.run(case.q, case.kv_cache, return_lse=bad)
    with pytest.raises(ValueError, match=r"sinks must be a contiguous \[num_qo_heads\] = \[8\]"):
        cp.run(case.q, case.kv_cache, sinks=torch.zeros(4, device=case.q.device))
    with pytest.raises(TypeError, match="sinks must have dtype torch.float32, got torch.float16"):
        cp.run(case.q, case.kv_cache, sinks=torch.zeros(8, dtype=torch.float16,
                                                         device=case.q.device))
    o = torch.zeros(2, 8, 64)
    with pytest.raises(ValueError, match=r"sinks must be a contiguous \[num_qo_heads\] = \[8\]"):
        merge_across_ranks(o, torch.zeros(2, 8), sinks=torch.zeros(4))
    with pytest.raises(ValueError, match=r"lse must be \[B, Hq\] = \[2, 8\] on o's device"):
        merge_across_ranks(o, torch.zeros(2, 4))
    with pytest.raises(TypeError, match="lse must be a torch.Tensor, got ndarray"):
        merge_across_ranks(o, np.zeros((2, 8)))
