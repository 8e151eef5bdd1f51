"""Which SM runs which program of a grid: the order in which the GPU hands out programs.

The persistent work-queue gives item i to program i mod programs; that spreads a step's busy
programs over the SMs only if consecutive programs start on different SMs. This records each
program's SM (%smid) for a grid of programs_per_sm x SMs programs that all fit at once (each holds
its SM for a while, so none finishes before the last one starts), and reports how many distinct
SMs the first k programs landed on.
Run: PYTHONPATH=src python scripts/probe_dispatch.py > dispatch.json
"""
import json

import torch
import triton
import triton.language as tl


@triton.jit
def record_sm_kernel(sm_ptr, spin):
    pid = tl.program_id(0)
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [pid], dtype=tl.int32,
                                   is_pure=False, pack=1)
    acc = pid * 0
    for i in range(spin):   # hold the SM so that later programs go elsewhere
        acc = (acc * 1103515245 + i) % 65536
    tl.store(sm_ptr + pid, sm + acc * 0)


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    report = {"gpu": torch.cuda.get_device_name(), "sms": sms, "grids": {}}
    for per_sm in (2, 3):
        programs = per_sm * sms
        sm = torch.full((programs,), -1, dtype=torch.int32, device="cuda")
        record_sm_kernel[(programs,)](sm, 20000, num_warps=4)
        torch.cuda.synchronize()
        sm = sm.tolist()
        prefix = {k: len(set(sm[:k])) for k in (sms // 2, sms, 2 * sms, programs)}
        per_sm_count = [sm.count(s) for s in range(sms)]
        report["grids"][str(programs)] = {
            "distinct SMs among the first k programs": prefix,
            "programs per SM (min, max)": [min(per_sm_count), max(per_sm_count)],
            "first 24 programs' SMs": sm[:24]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
