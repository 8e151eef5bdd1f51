"""The real _attend_range_warps against _attend_range on the GPU, identity pages, pieces apart."""
import sys, torch, triton, triton.language as tl
sys.path.insert(0, "src")   # from the repository root, warp-subtiles.patch applied
from persistentkv.kernels.decode import _attend_range, _attend_range_warps

@triton.jit(do_not_specialize=['zero'])
def wrap(q_ptr, k_ptr, v_ptr, idx_ptr, out_ptr, zero, ntok, stride_page, stride_tok,
         WARPS: tl.constexpr, BLOCK_N: tl.constexpr, PS: tl.constexpr, V_T: tl.constexpr, FP8: tl.constexpr):
    G_PAD: tl.constexpr = 16
    D: tl.constexpr = 128
    om = tl.arange(0, G_PAD); od = tl.arange(0, D)
    q = tl.load(q_ptr + om[:, None] * D + od[None, :])
    d_mask = od < D
    limit = om
    lower = om
    if WARPS > 1:
        acc, m, l = _attend_range_warps(q, k_ptr, v_ptr, k_ptr, idx_ptr, zero.to(tl.int64), zero, ntok, limit, lower,
                                        stride_page, stride_tok, od, d_mask, 1.0, 1.0, G_PAD, D, PS, BLOCK_N,
                                        False, False, False, False, FP8, False, 1, V_T, WARPS)
    else:
        acc, m, l = _attend_range(q, k_ptr, v_ptr, k_ptr, idx_ptr, zero.to(tl.int64), zero, ntok, limit, lower,
                                  stride_page, stride_tok, od, d_mask, 1.0, 1.0, G_PAD, D, PS, BLOCK_N,
                                  False, False, False, False, FP8, False, 1, V_T)
    o = acc / l[:, None]
    tl.store(out_ptr + om[:, None] * D + od[None, :], o)

DEV = "cuda" if torch.cuda.is_available() else "cpu"

def main():
    torch.manual_seed(0)
    PS, D = 16, 128
    for fp8, vt, block_n in ((False, False, 64), (False, False, 128), (True, False, 128), (True, True, 128)):
        for ntok in (64 * 8, 64 * 8 + 16, 40):
            pages = (ntok + PS - 1) // PS
            q = torch.randn(16, D, device=DEV, dtype=torch.float16)
            k = torch.randn(pages, PS, D, device=DEV, dtype=torch.float16)   # HND one head: [page, tok, d]
            v = torch.randn(pages, PS, D, device=DEV, dtype=torch.float16)
            kk, vv = k, v
            if fp8:
                kk, vv = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
                k, v = kk.half(), vv.half()
            if vt:
                vv = vv.transpose(1, 2).contiguous()
            idx = torch.arange(pages, device=DEV, dtype=torch.int32)
            kf = k.reshape(-1, D)[:ntok].float(); vf = v.reshape(-1, D)[:ntok].float()
            ref = torch.softmax(q.float() @ kf.T * 0.6931471805599453, -1) @ vf
            for warps in (1, 4):
                out = torch.full((16, D), float("nan"), device=DEV)
                wrap[(1,)](q, kk, vv, idx, out, 0, ntok, PS * D, D, warps, block_n, PS, vt, fp8, num_warps=4, num_stages=3)
                torch.cuda.synchronize() if DEV == "cuda" else None
                err = ((out - ref).norm() / ref.norm()).item()
                print(f"fp8 {fp8} vt {vt} block_n {block_n} ntok {ntok} warps {warps}: {err:.2e}", flush=True)

if __name__ == "__main__":
    main()
