"""Context parallelism on the CPU: 2 and 3 gloo processes, each attending to its share of every
row's pages through the interpreter, merge to the float64 reference of the whole rows; uneven
shares, rows shorter than a page (ranks with nothing of them), both placements, both merges."""
import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from paged_case import DEVICE, ON_GPU, csr_kwargs, make_case
from persistentkv import PageTable, reference_decode, relative_error
from persistentkv.context_parallel import ContextParallelDecode, shard_table

HEADS = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
LENS = [300, 9, 130, 33, 16]       # 19 pages, 1 page (shorter than one), 9, 3 and exactly 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, placement, method, result_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)                  # the same q and K/V on every rank
        case = make_case(seq_lens=LENS, **HEADS, layout="HND", seed=7)
        share = shard_table(case.table, rank=rank, world_size=world, placement=placement)
        cp = ContextParallelDecode("HND", method=method)
        cp.plan(**csr_kwargs(share), **HEADS, backend="split", split_pages=2)
        out, lse = cp.run(case.q, case.kv_cache, return_lse=True)
        ref, ref_lse = reference_decode(case.q, case.kv_cache, layout="HND",
                                        **csr_kwargs(case.table))
        errors = (relative_error(out, ref), relative_error(lse, ref_lse))
        gathered = [None] * world
        dist.all_gather_object(gathered, errors)
        if rank == 0:
            np.save(result_path, np.array(gathered))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(ON_GPU, reason="the CPU test of the gloo path (a GPU run takes NCCL and 2 GPUs)")
@pytest.mark.parametrize("world, placement, method", [
    (2, "contiguous", "all_gather"), (3, "interleaved", "all_reduce"), (3, "contiguous", "all_gather"),
])
def test_ranks_merge_to_the_whole_rows(tmp_path, world, placement, method):
    path = str(tmp_path / "errors.npy")
    mp.spawn(_rank, args=(world, _free_port(), placement, method, path), nprocs=world)
    errors = np.load(path)
    assert errors.shape == (world, 2)
    assert (errors[:, 0] <= 2e-3).all() and (errors[:, 1] <= 1e-4).all(), errors


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
