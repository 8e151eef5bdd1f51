"""Loop throughput of _attend_range (W=1) against _attend_range_warps (W=4): 264 programs, each
its own 8K-token range of scattered pages, one KV head each; us per launch (do_bench, median)."""
import sys, torch, triton, triton.language as tl
sys.path.insert(0, "src")   # from the repository root, warp-subtiles.patch applied
from persistentkv.kernels.decode import _attend_range, _attend_range_warps

@triton.jit(do_not_specialize=["zero"])
def wrap(q_ptr, k_ptr, v_ptr, idx_ptr, out_ptr, zero, ntok, stride_page, stride_tok,
         WARPS: tl.constexpr, BLOCK_N: tl.constexpr, PS: tl.constexpr, V_T: tl.constexpr, FP8: tl.constexpr):
    G_PAD: tl.constexpr = 16
    D: tl.constexpr = 128
    pid = tl.program_id(0)
    om = tl.arange(0, G_PAD); od = tl.arange(0, D)
    q = tl.load(q_ptr + pid * G_PAD * D + om[:, None] * D + od[None, :], mask=(om < 4)[:, None], other=0.0)
    d_mask = od < D
    page_start = (pid * (ntok // PS) + zero).to(tl.int64)
    if WARPS > 1:
        acc, m, l = _attend_range_warps(q, k_ptr, v_ptr, k_ptr, idx_ptr, page_start, zero, ntok, om, om,
                                        stride_page, stride_tok, od, d_mask, 0.127, 1.0, G_PAD, D, PS, BLOCK_N,
                                        False, False, False, False, FP8, False, 1, V_T, WARPS)
    else:
        acc, m, l = _attend_range(q, k_ptr, v_ptr, k_ptr, idx_ptr, page_start, zero, ntok, om, om,
                                  stride_page, stride_tok, od, d_mask, 0.127, 1.0, G_PAD, D, PS, BLOCK_N,
                                  False, False, False, False, FP8, False, 1, V_T)
    o = acc / tl.where(om < 4, l, 1.0)[:, None]
    tl.store(out_ptr + pid * G_PAD * D + om[:, None] * D + od[None, :], o, mask=(om < 4)[:, None])

def main():
    torch.manual_seed(0)
    PS, D, ntok, progs = 16, 128, 8192, 264
    pages = progs * ntok // PS
    for fp8, vt, block_n in ((False, False, 64), (True, True, 128), (True, False, 128)):
        dt = torch.float8_e4m3fn if fp8 else torch.float16
        k = torch.randn(pages, PS, D, device="cuda", dtype=torch.float16).to(dt)
        v = torch.randn(pages, PS, D, device="cuda", dtype=torch.float16).to(dt)
        idx = torch.randperm(pages, device="cuda").to(torch.int32)
        q = torch.randn(progs, 16, D, device="cuda", dtype=torch.float16)
        res = {}
        for warps in (1, 4, 1, 4):
            out = torch.full((progs, 16, D), float("nan"), device="cuda")
            f = lambda: wrap[(progs,)](q, k, v, idx, out, 0, ntok, PS * D, D, warps, block_n, PS, vt, fp8, num_warps=4, num_stages=3)
            f(); torch.cuda.synchronize()
            us = triton.testing.do_bench(f, warmup=50, rep=300, return_mode="median") * 1e3
            gb = 2 * pages * PS * D * k.element_size() / 1e9
            print(f"fp8 {fp8} vt {vt} block_n {block_n} W {warps}: {us:.1f} us, {gb / (us * 1e-6) / 1e3:.2f} TB/s, "
                  f"out finite {bool(torch.isfinite(out[:, :4]).all())}", flush=True)

main()
