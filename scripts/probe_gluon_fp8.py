"""Probe: the e4m3 token loop written in Gluon, with the operand layouts chosen by hand
(docs/perf-notes.md v55: Triton 3.6 builds the fp16 A operands of an e4m3 tile's products, q and
P, from LDS.64 pairs, and a quarter of its pass is register moves).

An experiment, not the engine: one program a (row, KV head) over the whole row (the grouped
schedule, no splits), an HND_VT cache in e4m3 with per-tensor or per-token scales, page size 16,
head dim 128, at most 16 query heads a KV head, 128-token tiles at 4 warps. What it changes
against the Triton kernel's loop:
- q's A fragments are built once, before the loop, and stay in registers (Q_IN_REGISTERS);
- P reaches the PV product through a shared-memory tile of its own, whose layout is chosen here
  (P_VEC: the swizzle's vector, in elements);
- each tile's page indices are loaded one tile ahead of the copies that need them, as the
  Triton kernel's are, and with PREFETCH_PAGES the row's page indices are first asked of the L2
  (KernelConfig.page_prefetch_task's prefetch).

    python scripts/probe_gluon_fp8.py --compile        # no GPU: the SASS's pass, as compile_check
    python scripts/probe_gluon_fp8.py [--rows 32 --tokens 8192 --reps 50]   # GPU: check and time

On a GPU it checks the output against the float64 reference on the e4m3 values (NaN-poisoned,
relative-norm error within the fp16 bound), then times it, the engine's grouped and auto
schedules on the same cache, and the engine's fp16 step of the same shape (issue 18's bar is
fp8 against it): CUDA events around steps launched back to back, each on the next of pools
that together pass the L2, median over the samples.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from persistentkv import TOLERANCE, DecodeWrapper, reference_decode, relative_error
from persistentkv.launch import LOG2_E
from persistentkv.quant import FP8_MAX, quantize, row_scales


@gluon.jit
def _page_indices(indices_ptr, first_page, num_pages, tile, tok, PAGE_SIZE: gl.constexpr,
                  BLOCK_N: gl.constexpr):
    """The page of each token of tile `tile` (tok: 0..BLOCK_N-1 in some layout), 0 past the row."""
    page = tile * (BLOCK_N // PAGE_SIZE) + tok // PAGE_SIZE
    return gl.load(indices_ptr + first_page + page, mask=page < num_pages, other=0)


@gluon.jit
def _issue_tile(pool_ptr, k_buf, v_buf, pages_k, pages_v, tile, num_tokens, k_head, v_head,
                stride_page, tok_k, d_k, tok_v, d_v, PAGE_SIZE: gl.constexpr,
                HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr):
    """cp.async of tile `tile`'s K [BLOCK_N, D] and V [BLOCK_N, D] (read from V's transposed
    [D, PAGE_SIZE] blocks, a page's tokens contiguous) into k_buf and v_buf; K's tokens past the
    row are zero-filled."""
    valid_k = tile * BLOCK_N + tok_k < num_tokens
    k_ptrs = (pool_ptr + k_head + pages_k.to(gl.int64)[:, None] * stride_page
              + ((tok_k % PAGE_SIZE) * HEAD_DIM)[:, None] + d_k[None, :])
    async_copy.async_copy_global_to_shared(k_buf, k_ptrs, mask=valid_k[:, None])
    # whole pages (constant over a page, so that a page's 16 bytes are one copy): the slots of
    # the row's last page past its length are read too, finite by the layout's contract
    valid_v = (tile * (BLOCK_N // PAGE_SIZE) + tok_v // PAGE_SIZE) * PAGE_SIZE < num_tokens
    v_ptrs = (pool_ptr + v_head + pages_v.to(gl.int64)[:, None] * stride_page
              + (tok_v % PAGE_SIZE)[:, None] + (d_v * PAGE_SIZE)[None, :])
    async_copy.async_copy_global_to_shared(v_buf, v_ptrs, mask=valid_v[:, None])


@gluon.jit
def fp8_rows_kernel(q_ptr, pool_ptr, out_ptr, indices_ptr, indptr_ptr, lens_ptr, kv_scales_ptr,
                    scale_log2, v_scale, stride_qb, stride_qh, stride_ob, stride_oh, stride_page,
                    NUM_KV_HEADS: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
                    PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    Q_IN_REGISTERS: gl.constexpr, P_VEC: gl.constexpr,
                    PREFETCH_PAGES: gl.constexpr, TOKEN_SCALES: gl.constexpr):
    """out[b, h] = softmax(q[b, h] . K^T * sm_scale) V * v_scale over row b's pages of an e4m3
    HND_VT pool (uint8 view of [P, 2, Hkv, S, D]; scale_log2 = sm_scale * k_scale * log2(e)).
    TOKEN_SCALES: each token's K and V rows have their own scale instead (kv_scales fp32
    [P, 2, Hkv, S]; k_scale = v_scale = 1), V's applied to the weights as the engine does
    (kernels/softmax.py: relative to the largest scale seen, r_i).
    Grid: (rows x NUM_KV_HEADS,); program (b, kv head) runs the whole row."""
    G_PAD: gl.constexpr = 16
    pid = gl.program_id(0)
    row = pid // NUM_KV_HEADS
    head = pid % NUM_KV_HEADS
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4],
                                                  instr_shape=[16, 8])
    a_dot: gl.constexpr = gl.DotOperandLayout(0, mma, 4)
    b_dot: gl.constexpr = gl.DotOperandLayout(1, mma, 4)
    k_load: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])   # [N, D], D fastest
    v_load: gl.constexpr = gl.BlockedLayout([16, 1], [8, 4], [1, 4], [0, 1])   # [N, D], N fastest
    q_load: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    k_shared: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 8, [1, 0])
    v_shared: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 8, [0, 1])
    p_shared: gl.constexpr = gl.SwizzledSharedLayout(P_VEC, 1, 8, [1, 0])
    q_shared: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])

    first_page = gl.load(indptr_ptr + row)
    num_pages = gl.load(indptr_ptr + row + 1) - first_page
    num_tokens = gl.load(lens_ptr + row)
    num_tiles = gl.cdiv(num_tokens, BLOCK_N)
    block = NUM_KV_HEADS * PAGE_SIZE * HEAD_DIM          # one (page, head) block, in bytes
    k_head = head * PAGE_SIZE * HEAD_DIM
    v_head = block + k_head

    # q [G_PAD, D]: rows past GROUP are zero (their outputs are not stored)
    rq = gl.arange(0, G_PAD, layout=gl.SliceLayout(1, q_load))
    dq = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_load))
    q = gl.load(q_ptr + row * stride_qb + (head * GROUP + rq)[:, None] * stride_qh + dq[None, :],
                mask=(rq < GROUP)[:, None], other=0.0)
    q_buf = gl.allocate_shared_memory(gl.float16, [G_PAD, HEAD_DIM], q_shared, q)
    if Q_IN_REGISTERS:
        q_op = q_buf.load(a_dot)

    k_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, HEAD_DIM], k_shared)
    v_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, HEAD_DIM], v_shared)
    p_buf = gl.allocate_shared_memory(gl.float16, [G_PAD, BLOCK_N], p_shared)
    tok_k = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, k_load))
    d_k = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, k_load))
    tok_v = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, v_load))
    d_v = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, v_load))

    if PREFETCH_PAGES:   # the row's page indices into the L2 first, one a 32-byte sector
        sectors = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0])) * 8
        for at in range(0, num_pages, 1024):
            gl.inline_asm_elementwise(
                "prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                [indices_ptr + first_page + gl.minimum(at + sectors, num_pages - 1)],
                dtype=gl.int32, is_pure=False, pack=1)
    pool = pool_ptr.to(gl.pointer_type(gl.float8e4nv))
    pages_k = _page_indices(indices_ptr, first_page, num_pages, 0, tok_k, PAGE_SIZE, BLOCK_N)
    pages_v = _page_indices(indices_ptr, first_page, num_pages, 0, tok_v, PAGE_SIZE, BLOCK_N)
    for j in gl.static_range(STAGES - 1):      # the first tiles in flight
        _issue_tile(pool, k_bufs.index(j), v_bufs.index(j), pages_k, pages_v, j, num_tokens,
                    k_head, v_head, stride_page, tok_k, d_k, tok_v, d_v, PAGE_SIZE, HEAD_DIM,
                    BLOCK_N)
        async_copy.commit_group()
        pages_k = _page_indices(indices_ptr, first_page, num_pages, j + 1, tok_k, PAGE_SIZE,
                                BLOCK_N)
        pages_v = _page_indices(indices_ptr, first_page, num_pages, j + 1, tok_v, PAGE_SIZE,
                                BLOCK_N)

    acc = gl.zeros([G_PAD, HEAD_DIM], gl.float32, mma)
    m_i = gl.full([G_PAD], float("-inf"), gl.float32, gl.SliceLayout(1, mma))
    l_i = gl.zeros([G_PAD], gl.float32, gl.SliceLayout(1, mma))
    r_i = gl.zeros([G_PAD], gl.float32, gl.SliceLayout(1, mma))   # TOKEN_SCALES: acc's unit
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    if TOKEN_SCALES:   # tile i's pages for its scales, loaded a tile ahead as the copies' are
        pages_s = _page_indices(indices_ptr, first_page, num_pages, 0, cols, PAGE_SIZE, BLOCK_N)
        k_scales = kv_scales_ptr + head * PAGE_SIZE + cols % PAGE_SIZE
        v_scales = k_scales + NUM_KV_HEADS * PAGE_SIZE
    for i in range(num_tiles):
        async_copy.wait_group(STAGES - 2)      # tile i has landed (this thread's copies) ...
        gl.thread_barrier()                    # ... everyone's; tile i - 1's buffers are free
        ahead = i + STAGES - 1
        slot = ahead % STAGES
        _issue_tile(pool, k_bufs.index(slot), v_bufs.index(slot), pages_k, pages_v, ahead,
                    num_tokens, k_head, v_head, stride_page, tok_k, d_k, tok_v, d_v, PAGE_SIZE,
                    HEAD_DIM, BLOCK_N)
        async_copy.commit_group()
        pages_k = _page_indices(indices_ptr, first_page, num_pages, ahead + 1, tok_k, PAGE_SIZE,
                                BLOCK_N)
        pages_v = _page_indices(indices_ptr, first_page, num_pages, ahead + 1, tok_v, PAGE_SIZE,
                                BLOCK_N)

        if TOKEN_SCALES:
            s_off = pages_s.to(gl.int64) * (2 * NUM_KV_HEADS * PAGE_SIZE)
            in_row = i * BLOCK_N + cols < num_tokens
            k_sc = gl.load(k_scales + s_off, mask=in_row, other=0.0)
            v_sc = gl.load(v_scales + s_off, mask=in_row, other=0.0)
            pages_s = _page_indices(indices_ptr, first_page, num_pages, i + 1, cols, PAGE_SIZE,
                                    BLOCK_N)
        cur = i % STAGES
        k_t = k_bufs.index(cur).permute((1, 0)).load(b_dot).to(gl.float16)    # [D, N]
        if Q_IN_REGISTERS:
            s = mma_v2(q_op, k_t, gl.zeros([G_PAD, BLOCK_N], gl.float32, mma))
        else:
            s = mma_v2(q_buf.load(a_dot), k_t, gl.zeros([G_PAD, BLOCK_N], gl.float32, mma))
        if TOKEN_SCALES:
            s = s * k_sc[None, :]
        s = gl.where((i * BLOCK_N + cols < num_tokens)[None, :], s * scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        if TOKEN_SCALES:   # weights p * v_sc in units of r_i >= the tile's largest V scale
            r_new = gl.maximum(r_i * alpha, gl.max(v_sc, axis=0))
            inv = gl.where(r_new > 0, 1.0 / r_new, 0.0)
            alpha = r_i * alpha * inv
            p = p * (v_sc[None, :] * inv[:, None])
            r_i = r_new
        p_buf.store(p.to(gl.float16))
        gl.thread_barrier()
        v = v_bufs.index(cur).load(b_dot).to(gl.float16)                       # [N, D]
        acc = mma_v2(p_buf.load(a_dot), v, acc * alpha[:, None])
        gl.thread_barrier()                    # p_buf is written again by the next tile
    async_copy.wait_group(0)

    if TOKEN_SCALES:
        acc = acc * r_i[:, None]
    o = acc * (v_scale / l_i)[:, None]
    ro = gl.arange(0, G_PAD, layout=gl.SliceLayout(1, mma))
    do = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma))
    gl.store(out_ptr + row * stride_ob + (head * GROUP + ro)[:, None] * stride_oh + do[None, :],
             o.to(gl.float16), mask=(ro < GROUP)[:, None])


def _constexprs(*, num_kv_heads, group, stages, q_in_registers, p_vec, prefetch_pages,
                token_scales):
    return dict(NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=128,
                STAGES=stages, Q_IN_REGISTERS=q_in_registers, P_VEC=p_vec,
                PREFETCH_PAGES=prefetch_pages, TOKEN_SCALES=token_scales)


def compile_for(arch: int, **options):
    """The kernel compiled for sm_<arch> without a GPU (as scripts/compile_check.py does)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    constexprs = _constexprs(**options)
    names = fp8_rows_kernel.arg_names
    pointers = {"q_ptr": "*fp16", "pool_ptr": "*u8", "out_ptr": "*fp16", "indices_ptr": "*i32",
                "indptr_ptr": "*i32", "lens_ptr": "*i32", "kv_scales_ptr": "*fp32"}
    signature = {n: "constexpr" if n in constexprs else pointers.get(n) or
                 ("fp32" if n in ("scale_log2", "v_scale") else "i32") for n in names}
    aligned = [n for n in names if n in pointers or n.startswith("stride_")]
    src = GluonASTSource(fp8_rows_kernel, signature,
                         constexprs={(names.index(k),): v for k, v in constexprs.items()},
                         attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})


def run(q, pool8, out, indices, indptr, lens, *, sm_scale, num_kv_heads, k_scale=1.0,
        v_scale=1.0, kv_scales=None, stages=3, q_in_registers=True, p_vec=8,
        prefetch_pages=False):
    """out [B, Hq, 128] = the probe's attention of q [B, Hq, 128] over the e4m3 pool, with
    per-tensor scales (k_scale, v_scale) or per-token ones (kv_scales fp32 [P, 2, Hkv, 16])."""
    batch, num_qo_heads, _ = q.shape
    fp8_rows_kernel[(batch * num_kv_heads,)](
        q, pool8.view(torch.uint8), out, indices, indptr, lens,
        indices if kv_scales is None else kv_scales, sm_scale * k_scale * LOG2_E, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), pool8.stride(0),
        **_constexprs(num_kv_heads=num_kv_heads, group=num_qo_heads // num_kv_heads,
                      stages=stages, q_in_registers=q_in_registers, p_vec=p_vec,
                      prefetch_pages=prefetch_pages, token_scales=kv_scales is not None),
        num_warps=4)
    return out


VARIANTS = {"q-registers": dict(q_in_registers=True, p_vec=8),
            "q-shared": dict(q_in_registers=False, p_vec=8),
            "q-registers-pvec2": dict(q_in_registers=True, p_vec=2),
            "q-registers-pvec2-stages2": dict(q_in_registers=True, p_vec=2, stages=2),
            "q-registers-pvec2-prefetch": dict(q_in_registers=True, p_vec=2, prefetch_pages=True)}


def _compile_report(arch: int, names: list[str]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compile_check import resource_usage, token_loops

    for name in names:
        options = VARIANTS[name]
        for token_scales in (False, True):
            kernel = compile_for(arch, num_kv_heads=8, group=4, token_scales=token_scales,
                                 **{"stages": 3, "prefetch_pages": False, **options})
            cubin = kernel.asm["cubin"]
            print(f"gluon fp8 {name} {'token' if token_scales else 'tensor'}: "
                  f"{resource_usage(cubin)}, {kernel.metadata.shared} B shared; "
                  f"{token_loops(cubin)}")


def quantize_pool(rows: torch.Tensor, granularity: str) -> tuple[torch.Tensor, dict]:
    """K and V token rows [P, 2, Hkv, S, D] as an e4m3 HND_VT pool (V's blocks stored [D, S])
    and run()'s scale arguments: per tensor (k_scale, v_scale) or per token (kv_scales)."""
    x = rows.float()
    if granularity == "tensor":
        scales = dict(k_scale=float(x[:, 0].abs().max()) / FP8_MAX,
                      v_scale=float(x[:, 1].abs().max()) / FP8_MAX)
        q8 = torch.stack([quantize(x[:, 0], scales["k_scale"]),
                          quantize(x[:, 1], scales["v_scale"])], dim=1)
    else:
        kv_scales = row_scales(x)                                    # [P, 2, Hkv, S]
        q8 = quantize(x, kv_scales[..., None])
        scales = dict(kv_scales=kv_scales.contiguous())
    p, _, h, page, d = q8.shape
    v_blocks = q8[:, 1].transpose(2, 3).contiguous().reshape(p, h, page, d)
    return torch.stack([q8[:, 0], v_blocks], dim=1), scales


def _case(rows: int, tokens: int, granularity: str, *, seed: int = 0):
    """q fp16 [rows, 32, 128], an e4m3 HND_VT pool [P, 2, 8, 16, 128] of unit-variance values
    (quantize_pool) with its scales, and a CSR table of each row's pages scattered over it."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages_a_row = -(-tokens // 16)
    num_pages = rows * pages_a_row + 7
    pool8, scales = quantize_pool(torch.randn(num_pages, 2, 8, 16, 128, generator=gen,
                                              device="cuda"), granularity)
    order = torch.randperm(num_pages, generator=gen, device="cuda")[:rows * pages_a_row]
    table = dict(kv_indptr=torch.arange(0, rows * pages_a_row + 1, pages_a_row,
                                        dtype=torch.int32, device="cuda"),
                 kv_indices=order.to(torch.int32),
                 kv_last_page_len=torch.full((rows,), tokens - (pages_a_row - 1) * 16,
                                             dtype=torch.int32, device="cuda"))
    q = torch.randn(rows, 32, 128, generator=gen, device="cuda").half()
    return q, pool8, scales, table


def _gpu_report(args, names: list[str]) -> None:
    heads = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    timings = {}
    for granularity in ("tensor", "token"):
        q, pool8, scales, table = _case(args.rows, args.tokens, granularity)
        lens = torch.full((args.rows,), args.tokens, dtype=torch.int32, device="cuda")
        indptr, indices = table["kv_indptr"], table["kv_indices"]
        ref, _ = reference_decode(q, pool8, **scales, layout="HND_VT", **table)
        for name in names:
            out = torch.full_like(q, float("nan"))
            run(q, pool8, out, indices, indptr, lens, sm_scale=128 ** -0.5, num_kv_heads=8,
                **scales, **VARIANTS[name])
            err = relative_error(out, ref)
            print(f"{name} {granularity}: relative error {err:.2e} (bound "
                  f"{TOLERANCE[torch.float16]:.0e})",
                  "ok" if err <= TOLERANCE[torch.float16] else "FAILED")
        layers = max(2, -(-2 * 60 * 2**20 // pool8.numel()))    # pools past the L2, rotated
        pools = [pool8] + [pool8.clone() for _ in range(layers - 1)]
        out = torch.empty_like(q)
        for name in names:
            timings[f"gluon {name} {granularity}"] = _time(
                lambda p: run(q, p, out, indices, indptr, lens, sm_scale=128 ** -0.5,
                              num_kv_heads=8, **scales, **VARIANTS[name]), pools, args.reps)
        for backend in ("grouped", "auto"):
            wrapper = DecodeWrapper("HND_VT")
            wrapper.plan(**table, **heads, backend=backend)
            timings[f"pkv-{backend} {granularity}"] = _time(
                lambda p: wrapper.run(q, p, out=out, **scales), pools, args.reps)
        del pools, pool8
    wrapper = DecodeWrapper("HND")          # the bar's denominator: our own fp16 step
    wrapper.plan(**table, **heads)
    shape = (table["kv_indices"].numel() + 7, 2, 8, 16, 128)
    pools16 = [torch.randn(shape, dtype=torch.float16, device="cuda") for _ in range(2)]
    timings["pkv-auto fp16 HND"] = _time(lambda p: wrapper.run(q, p, out=out), pools16, args.reps)
    for name, us in timings.items():
        print(f"B{args.rows} L{args.tokens} {name}: {us:.1f} us a layer (median of {args.reps})")


def _time(step, pools, reps: int) -> float:
    """Median us of one step: each of `reps` samples times 4 x len(pools) steps back to back
    between two CUDA events, each step on the next pool, with one step queued ahead so that the
    host's launch latency is not in the sample."""
    for p in pools:
        step(p)
    torch.cuda.synchronize()
    steps = 4 * len(pools)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        step(pools[-1])
        start.record()
        for j in range(steps):
            step(pools[j % len(pools)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / steps)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile", action="store_true", help="compile only (no GPU needed)")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = parser.parse_args()
    names = [name for name in args.variants.split(",") if name]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; known: {list(VARIANTS)}")
    if args.compile or not torch.cuda.is_available():
        _compile_report(args.arch, names)
    else:
        _gpu_report(args, names)


if __name__ == "__main__":
    main()
