"""Which SM runs which program of a grid: the order in which the GPU hands out programs.

The decode kernel runs a persistent grid of plan.programs programs (programs_per_sm x SMs, at
most the items): program p runs item p first, then claims the next unclaimed item from a
counter. A step with fewer items than programs spreads over the SMs only if consecutive programs
start on different SMs. This records each program's SM (%smid) for the grid of a real plan (a B8
32K step, 2 and 3 programs per SM) whose programs all fit at once (each holds its SM for a while,
so none finishes before the last one starts), and reports how many distinct SMs the first k
programs landed on, beside the plan's item count (tasks x KV heads).
Run: PYTHONPATH=src python scripts/probe_dispatch.py > dispatch.json
"""
import json

import torch
import triton
import triton.language as tl

from persistentkv import DecodeWrapper
from persistentkv.tuning import KernelConfig


@triton.jit
def record_sm_kernel(sm_ptr, spin):
    pid = tl.program_id(0)
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [pid], dtype=tl.int32,
                                   is_pure=False, pack=1)
    acc = pid * 0
    for i in range(spin):   # hold the SM so that later programs go elsewhere
        acc = (acc * 1103515245 + i) % 65536
    tl.store(sm_ptr + pid, sm + acc * 0)


def step_plan(*, programs_per_sm: int):
    """The plan of a B8 32K step (Hq 32, Hkv 8, d 128, page 16) with the split rule."""
    lens, page = [32768] * 8, 16
    pages = [n // page for n in lens]
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32,
                          device="cuda")
    indices = torch.randperm(sum(pages), device="cuda").int()
    last = torch.full((len(lens),), page, dtype=torch.int32, device="cuda")
    return DecodeWrapper("HND").plan(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last,
                                     num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=page,
                                     backend="split",
                                     config=KernelConfig(programs_per_sm=programs_per_sm))


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    report = {"gpu": torch.cuda.get_device_name(), "sms": sms, "grids": {}}
    for per_sm in (2, 3):
        plan = step_plan(programs_per_sm=per_sm)
        programs = plan.programs
        sm = torch.full((programs,), -1, dtype=torch.int32, device="cuda")
        record_sm_kernel[(programs,)](sm, 20000, num_warps=plan.config.num_warps)
        torch.cuda.synchronize()
        sm = sm.tolist()
        prefix = {k: len(set(sm[:k])) for k in (sms // 2, sms, 2 * sms, programs) if k <= programs}
        per_sm_count = [sm.count(s) for s in range(sms)]
        report["grids"][str(programs)] = {
            "programs per SM (config)": per_sm,
            "items of the plan (tasks x KV heads)": plan.info()["num_tasks"] * plan.num_kv_heads,
            "distinct SMs among the first k programs": prefix,
            "programs per SM (min, max)": [min(per_sm_count), max(per_sm_count)],
            "first 24 programs' SMs": sm[:24]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
