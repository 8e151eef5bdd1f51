"""The decode kernel's token loop alone, with no planner, claims or merge: each program reads its
own 8K-token range of one KV head's scattered pages through kernels/decode.py's _attend_range
(group 4, padded to 16 rows, head dim 128, page 16); us per launch (triton.testing.do_bench,
median of 300 ms) and TB/s of K/V read (pools of 0.5-1 GB, far past the L2).
Modes: 0 the real loop; 1 the same K/V loads summed, no product (Triton does not pipeline these
through cp.async); 2 the loads and both products, no softmax.
Run (CUDA only): PYTHONPATH=src python scripts/probe_token_loop.py
"""
import torch
import triton
import triton.language as tl

from persistentkv.kernels.decode import Features, Strides, Tile, _attend_range

PAGE, HEAD_DIM, TOKENS = 16, 128, 8192
# (fp8, V transposed (HND_VT), mode, block_n, warps, stages, programs an SM)
CASES = [(False, False, 0, 64, 4, 3, 2), (False, False, 1, 64, 4, 3, 2),
         (True, True, 0, 128, 4, 3, 2), (False, False, 2, 64, 4, 3, 2),
         (True, False, 0, 128, 4, 3, 2), (True, False, 1, 128, 4, 3, 2),
         (True, False, 2, 128, 4, 3, 2), (True, False, 1, 128, 4, 4, 2),
         (True, False, 1, 256, 4, 3, 2), (True, False, 1, 128, 8, 3, 2),
         (True, False, 1, 128, 4, 3, 3), (True, False, 1, 64, 4, 3, 4),
         (True, True, 0, 128, 4, 4, 2), (True, True, 0, 128, 4, 2, 2),
         (True, True, 0, 128, 8, 3, 2), (True, True, 0, 256, 8, 3, 2),
         (True, True, 0, 64, 4, 4, 3), (True, True, 0, 128, 4, 3, 1)]


@triton.jit(do_not_specialize=["zero"])
def token_loop(q_ptr, k_ptr, v_ptr, idx_ptr, out_ptr, zero, ntok, stride_page, stride_tok,
               BLOCK_N: tl.constexpr, PS: tl.constexpr, V_T: tl.constexpr, FP8: tl.constexpr,
               MODE: tl.constexpr):
    G_PAD: tl.constexpr = 16
    D: tl.constexpr = 128
    pid = tl.program_id(0)
    om = tl.arange(0, G_PAD)
    od = tl.arange(0, D)
    rows = (om < 4)[:, None]
    q = tl.load(q_ptr + pid * G_PAD * D + om[:, None] * D + od[None, :], mask=rows, other=0.0)
    page_start = (pid * (ntok // PS) + zero).to(tl.int64)
    if MODE == 0:
        strides = Strides(0, 0, 0, 0, stride_page, 0, stride_tok, 0)   # the pool's only
        tile: tl.constexpr = Tile(NUM_KV_HEADS=1, GROUP=4, Q_PAD=1, G_PAD=G_PAD, HEAD_DIM=D,
                                  D_PAD=D, PAGE_SIZE=PS, BLOCK_N=BLOCK_N, BLOCK_N_LONG=0,
                                  LONG_FROM=0, G_MERGE=4, M_BLOCKS=1, D_BLOCKS=1)
        feat: tl.constexpr = Features(RETURN_LSE=False, UPCAST=False, WINDOW=False,
                                      SOFT_CAP=False, SINKS=False, KV_FP8=FP8,
                                      TOKEN_SCALES=False, V_T=V_T)
        acc, m, l = _attend_range(q, k_ptr, v_ptr, k_ptr, idx_ptr, page_start, zero, ntok, om, om,
                                  od, od < D, od, od < D, 0.127, 1.0, strides, tile, feat,
                                  BLOCK_N)
        o = acc / tl.where(om < 4, l, 1.0)[:, None]
    else:
        o = tl.zeros([G_PAD, D], tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        for start in tl.range(zero, ntok, BLOCK_N):
            tok = start + offs_n
            page = tl.load(idx_ptr + page_start + tok // PS)
            offs = page.to(tl.int64) * stride_page + (tok % PS) * stride_tok
            k = tl.load(k_ptr + offs[:, None] + od[None, :])
            v = tl.load(v_ptr + offs[:, None] + od[None, :])
            if MODE == 1:
                o += (tl.sum(k.to(tl.float32), axis=0) + tl.sum(v.to(tl.float32), axis=0))[None, :]
            else:
                s = tl.dot(q, tl.trans(k.to(tl.float16)))
                o += tl.dot(s.to(tl.float16), v.to(tl.float16))
    tl.store(out_ptr + pid * G_PAD * D + om[:, None] * D + od[None, :], o, mask=rows)


def main():
    torch.manual_seed(0)
    print("kv, layout, mode, block_n, warps, stages, programs an SM: us, TB/s")
    for fp8, v_t, mode, block_n, warps, stages, per_sm in CASES:
        name = (f"{'fp8' if fp8 else 'fp16'} {'HND_VT' if v_t else 'HND'} mode {mode} block_n "
                f"{block_n} warps {warps} stages {stages} per_sm {per_sm}")
        programs = 132 * per_sm
        pages = programs * TOKENS // PAGE
        dtype = torch.float8_e4m3fn if fp8 else torch.float16
        k = torch.randn(pages, PAGE, HEAD_DIM, device="cuda", dtype=torch.float16).to(dtype)
        v = torch.randn(pages, PAGE, HEAD_DIM, device="cuda", dtype=torch.float16).to(dtype)
        idx = torch.randperm(pages, device="cuda").to(torch.int32)
        q = torch.randn(programs, 16, HEAD_DIM, device="cuda", dtype=torch.float16)
        out = torch.full((programs, 16, HEAD_DIM), float("nan"), device="cuda")

        def launch():
            token_loop[(programs,)](q, k, v, idx, out, 0, TOKENS, PAGE * HEAD_DIM, HEAD_DIM,
                                    block_n, PAGE, v_t, fp8, mode, num_warps=warps,
                                    num_stages=stages)
        try:
            launch()
            torch.cuda.synchronize()
        except Exception as e:   # a launch shape that does not fit (shared memory)
            print(f"{name}: {type(e).__name__}", flush=True)
            continue
        us = triton.testing.do_bench(launch, warmup=50, rep=300, return_mode="median") * 1e3
        gigabytes = 2 * pages * PAGE * HEAD_DIM * k.element_size() / 1e9
        print(f"{name}: {us:.1f} us, {gigabytes / (us * 1e-6) / 1e3:.2f} TB/s", flush=True)
        del k, v


if __name__ == "__main__":
    main()
