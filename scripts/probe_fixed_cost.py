"""Fixed costs on the GPU, apart from reading the KV cache: what bounds the small decode steps.

Device time per launch inside a CUDA graph of 32 launches (median of 20 replays) for
  - an empty Triton kernel (grid 1 and grid 2 x SMs): the launch floor in a graph;
  - the decode kernel on 1 token per row (every task one page, no merge): the kernel's fixed cost;
  - the same with rows cut in 2 splits (1 token and 17 tokens, 16-token splits): plus the merge;
  - a few static steps with the default split, for A/B runs of two versions in one session.
Graph mode on a few steps: one GPU plan and 32 layers in the graph, per layer.
Host time per call (median of 300) for a torch add_ on 1K floats, an empty Triton kernel through
`kernel[grid]`, DecodeWrapper.run() on the B1, B8 and B128 steps, and plan() for B1 and B128
with the host planner (page table on the device; lengths on the host) and the GPU planner.
Run: PYTHONPATH=src python scripts/probe_fixed_cost.py > probe.json
"""
import dataclasses
import json
import statistics
import sys
import time

import torch
import triton

from persistentkv import DecodeWrapper
from persistentkv.bench.measure import graph_replay_us


@triton.jit
def empty_kernel(x_ptr, n):
    pass


def graph_us(fn, launches=32, reps=20):
    """Device time per launch of a CUDA graph of `launches` calls fn(0), fn(1), ..."""
    def body():
        for i in range(launches):
            fn(i)

    return graph_replay_us(body, reps=reps) / launches


def host_us(fn, reps=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def decode_step(seq_lens, *, split_pages=None, backend="split", hq=32, hkv=8, d=128, page=16):
    pages = [-(-n // page) for n in seq_lens]
    num_pages = sum(pages) + 1
    # enough pools that the 32 launches of a graph read several L2s (60 MB) of distinct KV
    pools = max(1, min(32, -(-256 * 2**20 // (num_pages * 2 * hkv * page * d * 2))))
    caches = [torch.randn(num_pages, 2, hkv, page, d, dtype=torch.float16, device="cuda")
              for _ in range(pools)]
    indptr, indices, last = page_table(seq_lens, page)
    q = torch.randn(len(seq_lens), hq, d, dtype=torch.float16, device="cuda")
    w = DecodeWrapper("HND")
    w.plan(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last, num_qo_heads=hq,
           num_kv_heads=hkv, head_dim=d, page_size=page, backend=backend, split_pages=split_pages)
    out = torch.empty_like(q)
    return w, q, caches, out


def page_table(seq_lens, page=16):
    pages = [-(-n // page) for n in seq_lens]
    indices = torch.randperm(sum(pages) + 1, device="cuda")[:sum(pages)].int()
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    last = torch.tensor([(n - 1) % page + 1 for n in seq_lens], dtype=torch.int32, device="cuda")
    return indptr, indices, last


def plan_variants(seq_lens, hq=32, hkv=8, d=128, page=16):
    """plan() as a serving loop would call it: host planner with the page table on the device
    (checked), host planner with the lengths on the host (unchecked), GPU planner (graph mode)."""
    indptr, indices, last = page_table(seq_lens, page)
    heads = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page)
    yield "host planner, table on device", dict(
        wrapper=DecodeWrapper("HND"), kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last,
        backend="split", **heads)
    yield "host planner, lengths on host, check_indices=False", dict(
        wrapper=DecodeWrapper("HND"), kv_indptr=indptr.cpu(), kv_indices=indices,
        kv_last_page_len=last.cpu(), backend="split", check_indices=False, **heads)
    yield "GPU planner (use_cuda_graph=True)", dict(
        wrapper=DecodeWrapper("HND", use_cuda_graph=True, max_batch_size=len(seq_lens),
                              max_num_pages=indices.numel()),
        kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last, **heads)


def graph_mode_step(seq_lens, hq=32, hkv=8, d=128, page=16):
    """A graph-mode wrapper planned on the GPU (split size chosen there), and its plan() call."""
    _, q, caches, out = decode_step(seq_lens)
    indptr, indices, last = page_table(seq_lens, page)
    w = DecodeWrapper("HND", use_cuda_graph=True, max_batch_size=len(seq_lens),
                      max_num_pages=indices.numel())
    kwargs = dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last, num_qo_heads=hq,
                  num_kv_heads=hkv, head_dim=d, page_size=page)
    w.plan(**kwargs)
    return w, q, caches, out, lambda: w.plan(**kwargs)


def run_pieces(host: dict) -> None:
    """Where run()'s host time goes: its argument signature (with the data pointers), the output
    allocation, the bound launch, and the compiled launcher called with every argument an int."""
    w, q, caches, out = decode_step([1024])
    w.run(q, caches[0], out=out)
    (launch,) = w._prepared.values()
    kv = caches[0]
    def signature():
        qp, kp, op = q.data_ptr(), kv.data_ptr(), out.data_ptr()
        return ((q.shape, q.dtype, q.device, q.stride(), qp % 16,
                 kv.shape, kv.dtype, kv.device, kv.stride(), kp % 16, None,
                 (out.shape, out.dtype, out.device, out.stride(), op % 16), False),
                [qp, kp, kp, op, op])

    host["run() piece: argument signature"] = host_us(signature)
    host["run() piece: torch.empty_like(q)"] = host_us(
        lambda: torch.empty_like(q, memory_format=torch.contiguous_format))
    host["run() piece: bound launch"] = host_us(lambda: launch(q, kv, kv, out, out))
    pointers = [q.data_ptr(), kv.data_ptr(), kv.data_ptr(), out.data_ptr(), out.data_ptr()]
    leading = (q, kv, kv, out, out)
    host["run() piece: bound launch, pointers given"] = host_us(
        lambda: launch.with_pointers(leading, pointers))
    run, g0, g1, g2, function, metadata = launch.direct
    args = (q.data_ptr(), kv.data_ptr(), kv.data_ptr(), out.data_ptr(), out.data_ptr(), *launch.trailing)
    stream = torch.cuda.current_stream().cuda_stream
    host["run() piece: compiled launcher, int arguments"] = host_us(
        lambda: run(g0, g1, g2, stream, function, metadata, None, None, None, *args))
    c_launch = getattr(run, "launch", None)
    if c_launch is not None:
        host["run() piece: Triton's C launch alone"] = host_us(
            lambda: c_launch(g0, g1, g2, stream, function, 0, 0, None, None, metadata, None, None,
                             None, *args))


def main():
    x = torch.zeros(1024, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    from persistentkv.bench.results import environment

    env = environment(torch.device("cuda"), command=["python", *sys.argv], functional=False)
    r = {"environment": env, "device_us": {}, "host_us": {}}
    r["device_us"]["empty triton kernel, grid 1"] = graph_us(lambda i: empty_kernel[(1,)](x, 1))
    r["device_us"][f"empty triton kernel, grid {2 * sms}"] = graph_us(
        lambda i: empty_kernel[(2 * sms,)](x, 1))
    for name, lens, split in (("decode B1 1 token (8 tasks)", [1], None),
                              ("decode B8 1 token (64 tasks)", [1] * 8, None),
                              ("decode B1 17 tokens, 2 splits (merge)", [17], 1),
                              ("decode B8 17 tokens, 2 splits (merge)", [17] * 8, 1),
                              ("decode B1 256 tokens, 16 splits (merge)", [256], 1),
                              ("decode B1 1K, 4 splits", [1024], 16),
                              ("decode B1 1K, 1 split", [1024], 64),
                              ("decode B1 1K, default split", [1024], None),
                              ("decode B8 1K, default split", [1024] * 8, None),
                              ("decode B1 8K, default split", [8192], None),
                              ("decode B1 32K, default split", [32768], None),
                              ("decode B32 8K, default split", [8192] * 32, None)):
        w, q, caches, out = decode_step(lens, split_pages=split)
        r["device_us"][name] = graph_us(lambda i: w.run(q, caches[i % len(caches)], out=out))
    r["host_us"]["torch add_ 1K"] = host_us(lambda: x.add_(1.0))
    r["host_us"]["empty triton kernel[grid]"] = host_us(lambda: empty_kernel[(1,)](x, 1))
    for name, lens, grid in (("B1 128K", [131072], 528), ("B8 32K", [32768] * 8, 528)):
        w, q, caches, out = decode_step(lens, backend="workqueue")
        natural = w.plan_info.schedule.grid[0]
        r["device_us"][f"host work-queue {name}, grid {natural}"] = graph_us(
            lambda i: w.run(q, caches[i % len(caches)], out=out))
        plan = w.plan_info
        w._plan = dataclasses.replace(plan, schedule=dataclasses.replace(plan.schedule, grid=(grid,)))
        w._prepared = {}
        r["device_us"][f"host work-queue {name}, grid {grid}"] = graph_us(
            lambda i: w.run(q, caches[i % len(caches)], out=out))
    run_pieces(r["host_us"])
    for name, lens in (("run() B1", [1024]), ("run() B8", [1024] * 8), ("run() B128", [1024] * 128)):
        w, q, caches, out = decode_step(lens)
        r["host_us"][name + " out=given"] = host_us(lambda: w.run(q, caches[0], out=out))
        r["host_us"][name + " out=None"] = host_us(lambda: w.run(q, caches[0]))
    for name, lens in (("B1 1K", [1024]), ("B128 1K", [1024] * 128)):
        for label, kwargs in plan_variants(lens):
            r["host_us"][f"plan() {name}, {label}"] = host_us(lambda: kwargs["wrapper"].plan(
                **{k: v for k, v in kwargs.items() if k != "wrapper"}), reps=100)
    for name, lens in (("B1 1K", [1024]), ("B8 1K", [1024] * 8), ("B1 8K", [8192]),
                       ("B1 32K", [32768]), ("B32 8K", [8192] * 32), ("B1 128K", [131072]),
                       ("B8 32K", [32768] * 8)):
        w, q, caches, out, plan = graph_mode_step(lens)
        r["device_us"][f"graph mode {name} (1 GPU plan + 32 layers, per layer)"] = graph_us(
            lambda i: (i == 0 and plan(), w.run(q, caches[i % len(caches)], out=out)))
    print(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
