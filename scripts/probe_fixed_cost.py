"""Fixed costs on the GPU, apart from reading the KV cache: what bounds the small decode steps.

Device time per launch inside a CUDA graph of 32 launches (median of 20 replays) for
  - an empty Triton kernel (grid 1 and grid 2 x SMs): the launch floor in a graph;
  - the decode kernel on 1 token per row (every task one page, no merge): the kernel's fixed cost;
  - the same with rows cut in 2 splits (1 token and 17 tokens, 16-token splits): plus the merge;
  - a few static steps with the split rule, for A/B runs of two versions in one machine run;
  - B1 128K and B8 32K with 2 and 4 persistent programs per SM (KernelConfig.programs_per_sm).
Graph mode on a few steps: plan() (one planner launch) and 32 layers in one graph, per layer.
Host time per call (median of 300) for a torch add_ on 1K floats, an empty Triton kernel through
`kernel[grid]` (the bare launch), the pieces of run(), DecodeWrapper.run() on the B1, B8 and B128
steps, and plan() for B1, B8, B128 and B1024 (1K tokens per row): (a) with the last call's
page-table tensors, refilled in place (the planner's launch alone), (b) with new page-table
tensors each call (the whole host path); "host_x_bare_launch": every host time over the bare
launch of the same run. All with backend="split" (the split rule): the same on every GPU,
whatever policy it ships.
Run: PYTHONPATH=src python scripts/probe_fixed_cost.py > probe.json
"""
import itertools
import json
import statistics
import sys
import time

import torch
import triton

from persistentkv import DecodeWrapper
from persistentkv.bench.measure import graph_replay_us
from persistentkv.bench.results import environment
from persistentkv.tuning import KernelConfig

HEADS = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)


@triton.jit
def empty_kernel(x_ptr, n):
    pass


def graph_us(fn, launches=32, reps=20):
    """Device time per launch of a CUDA graph of `launches` calls fn(0), fn(1), ..."""
    def body():
        for i in range(launches):
            fn(i)

    return graph_replay_us(body, reps=reps, busy=False) / launches


def host_us(fn, *, reps=300, setup=None):
    """Median host time of fn() (us); setup(), when given, runs untimed before each call."""
    for _ in range(20):
        if setup is not None:
            setup()
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def page_table(seq_lens):
    """CSR page table (indptr, indices, last page lengths) on the GPU, pages shuffled."""
    page = HEADS["page_size"]
    pages = [-(-n // page) for n in seq_lens]
    indices = torch.randperm(sum(pages) + 1, device="cuda")[:sum(pages)].int()
    indptr = torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32, device="cuda")
    last = torch.tensor([(n - 1) % page + 1 for n in seq_lens], dtype=torch.int32, device="cuda")
    return dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last)


def step_buffers(seq_lens):
    """q [B, 32, 128], pools for a step of `seq_lens` tokens per row, and out like q."""
    hkv, page, d = HEADS["num_kv_heads"], HEADS["page_size"], HEADS["head_dim"]
    num_pages = sum(-(-n // page) for n in seq_lens) + 1
    # enough pools that the 32 launches of a graph read several L2s (60 MB) of distinct KV
    pools = max(1, min(32, -(-256 * 2**20 // (num_pages * 2 * hkv * page * d * 2))))
    caches = [torch.randn(num_pages, 2, hkv, page, d, dtype=torch.float16, device="cuda")
              for _ in range(pools)]
    q = torch.randn(len(seq_lens), HEADS["num_qo_heads"], d, dtype=torch.float16, device="cuda")
    return q, caches, torch.empty_like(q)


def decode_step(seq_lens, *, split_pages=None, config=None):
    """A planned wrapper and step_buffers for a step of `seq_lens` tokens per row."""
    w = DecodeWrapper("HND")
    w.plan(**page_table(seq_lens), **HEADS, backend="split", split_pages=split_pages, config=config)
    return (w, *step_buffers(seq_lens))


def device_probes(device_us: dict, x: torch.Tensor) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    device_us["empty triton kernel, grid 1"] = graph_us(lambda i: empty_kernel[(1,)](x, 1))
    device_us[f"empty triton kernel, grid {2 * sms}"] = graph_us(
        lambda i: empty_kernel[(2 * sms,)](x, 1))
    for name, lens, split in (("decode B1 1 token (8 tasks)", [1], None),
                              ("decode B8 1 token (64 tasks)", [1] * 8, None),
                              ("decode B1 17 tokens, 2 splits (merge)", [17], 1),
                              ("decode B8 17 tokens, 2 splits (merge)", [17] * 8, 1),
                              ("decode B1 256 tokens, 16 splits (merge)", [256], 1),
                              ("decode B1 1K, 4 splits", [1024], 16),
                              ("decode B1 1K, 1 split", [1024], 64),
                              ("decode B1 1K, split rule", [1024], None),
                              ("decode B8 1K, split rule", [1024] * 8, None),
                              ("decode B1 8K, split rule", [8192], None),
                              ("decode B1 32K, split rule", [32768], None),
                              ("decode B32 8K, split rule", [8192] * 32, None)):
        w, q, caches, out = decode_step(lens, split_pages=split)
        device_us[name] = graph_us(lambda i: w.run(q, caches[i % len(caches)], out=out))
    for name, lens in (("B1 128K", [131072]), ("B8 32K", [32768] * 8)):
        for per_sm in (2, 4):
            w, q, caches, out = decode_step(lens, config=KernelConfig(programs_per_sm=per_sm))
            device_us[f"decode {name}, {w.current_plan.programs} programs ({per_sm} per SM)"] = \
                graph_us(lambda i: w.run(q, caches[i % len(caches)], out=out))
    for name, lens in (("B1 1K", [1024]), ("B8 1K", [1024] * 8), ("B1 8K", [8192]),
                       ("B1 32K", [32768]), ("B32 8K", [8192] * 32), ("B1 128K", [131072]),
                       ("B8 32K", [32768] * 8)):
        table, (q, caches, out) = page_table(lens), step_buffers(lens)
        w = DecodeWrapper("HND", use_cuda_graph=True, max_batch_size=len(lens),
                          max_num_pages=table["kv_indices"].numel())
        w.plan(**table, **HEADS, backend="split")   # sizes the buffers before the capture
        device_us[f"graph mode {name} (plan + 32 layers, per layer)"] = graph_us(
            lambda i: (i == 0 and w.plan(**table, **HEADS, backend="split"),
                       w.run(q, caches[i % len(caches)], out=out)))


def run_pieces(host: dict) -> None:
    """Where run()'s host time goes: its argument signature (with the data pointers), the output
    allocation, the bound launch, and the compiled launcher called with every argument an int.
    The bound launch is the wrapper's own, from its launcher's private cache: no public object
    holds it."""
    w, q, caches, out = decode_step([1024])
    w.run(q, caches[0], out=out)
    (launch,) = w._launcher._prepared.values()
    plan, kv = w.current_plan, caches[0]

    def signature():
        qp, kp, op = q.data_ptr(), kv.data_ptr(), out.data_ptr()
        return ((plan.launch_key, q.shape, q.dtype, q.device, q.stride(), qp % 16,
                 kv.shape, kv.dtype, kv.device, kv.stride(), kp % 16, None,
                 (out.shape, out.dtype, out.device, out.stride(), op % 16), False),
                [qp, kp, kp, op, op, plan.indices_ptr])

    host["run() piece: argument signature"] = host_us(signature)
    host["run() piece: torch.empty_like(q)"] = host_us(
        lambda: torch.empty_like(q, memory_format=torch.contiguous_format))
    leading = (q, kv, kv, out, out, plan.indices)
    host["run() piece: bound launch"] = host_us(lambda: launch(*leading))
    pointers = [t.data_ptr() for t in leading]
    host["run() piece: bound launch, pointers given"] = host_us(
        lambda: launch.with_pointers(leading, pointers))
    run, g0, g1, g2, function, metadata = launch.direct
    args = (*pointers, *launch.trailing)
    stream = torch.cuda.current_stream().cuda_stream
    host["run() piece: compiled launcher, int arguments"] = host_us(
        lambda: run(g0, g1, g2, stream, function, metadata, None, None, None, *args))
    c_launch = getattr(run, "launch", None)
    if c_launch is not None:
        host["run() piece: Triton's C launch alone"] = host_us(
            lambda: c_launch(g0, g1, g2, stream, function, 0, 0, None, None, metadata, None, None,
                             None, *args))


def plan_probes(host: dict) -> None:
    """plan() as a serving loop calls it: (a) the last call's page-table tensors, refilled in
    place before each call (untimed), (b) one of four sets of page-table tensors in turn, so
    that no call sees the last one's."""
    for rows in (1, 8, 128, 1024):
        tables = [page_table([1024] * rows) for _ in range(4)]
        w = DecodeWrapper("HND")
        same, source = tables[0], tables[1]

        def refill():
            for key, t in same.items():
                t.copy_(source[key])

        host[f"plan() B{rows} 1K, same page-table tensors, refilled in place"] = host_us(
            lambda: w.plan(**same, **HEADS, backend="split"), reps=100, setup=refill)
        turn = itertools.cycle(tables)
        host[f"plan() B{rows} 1K, new page-table tensors"] = host_us(
            lambda: w.plan(**next(turn), **HEADS, backend="split"), reps=100)


def main():
    x = torch.zeros(1024, device="cuda")
    env = environment(torch.device("cuda"), command=["python", *sys.argv], functional=False)
    r = {"environment": env, "device_us": {}, "host_us": {}}
    device_probes(r["device_us"], x)
    host = r["host_us"]
    host["torch add_ 1K"] = host_us(lambda: x.add_(1.0))
    host["empty triton kernel[grid] (bare launch)"] = host_us(lambda: empty_kernel[(1,)](x, 1))
    run_pieces(host)
    for name, lens in (("run() B1", [1024]), ("run() B8", [1024] * 8), ("run() B128", [1024] * 128)):
        w, q, caches, out = decode_step(lens)
        host[name + " out=given"] = host_us(lambda: w.run(q, caches[0], out=out))
        host[name + " out=None"] = host_us(lambda: w.run(q, caches[0]))
    plan_probes(host)
    bare = host["empty triton kernel[grid] (bare launch)"]
    r["host_x_bare_launch"] = {name: us / bare for name, us in host.items()}
    print(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
