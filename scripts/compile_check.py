"""Compile the decode kernel for a GPU target without a GPU (Triton's compiler and ptxas only):
catches compile errors the interpreter does not, and reports registers, spills, shared memory,
cp.async use and the deepest `cp.async.wait_group` (0 means no tile is kept in flight across
iterations: the K/V loads are not really pipelined), and counts the SASS instructions (all,
shared-memory loads LDS and ldmatrix LDSM, shared stores STS, global loads LDG, byte permutes
PRMT, 16-byte cp.async LDGSTS.128), with a digest of the SASS instructions (equal digests before and
after a change: the change left the compiled kernel as it was).
Run: PYTHONPATH=src python scripts/compile_check.py [--arch 90] (without --shape: the presets'
groups and head dims, one query a row, each with its default config). Each kernel is compiled
afresh, never taken from Triton's cache: a cache may hold binaries alone, without the PTX read here.
"""
import argparse
import dataclasses
import hashlib
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from persistentkv.kernels.decode import decode_constexprs, paged_decode_kernel
from persistentkv.kernels.plan import FIRST_PAGE_SLOTS, POLICY_EDGES, plan_kernel, query_fields
from persistentkv.schedule import ONE_ROUND_STEPS
from persistentkv.tuning import KernelConfig, default_config

triton.knobs.compilation.always_compile = True   # the docstring says why

POINTERS = {"q_ptr": "*fp16", "k_ptr": "*fp16", "v_ptr": "*fp16", "indices_ptr": "*i32",
            "tasks_ptr": "*i32", "first_pages_ptr": "*i32", "info_ptr": "*i32", "out_ptr": "*fp16",
            "lse_ptr": "*fp32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "counters_ptr": "*i32",
            "qo_indptr_ptr": "*i32", "row_lens_ptr": "*i32", "sinks_ptr": "*fp32",
            "kv_scales_ptr": "*fp32"}


def compile_decode(*, arch: int, group: int, head_dim: int, config=None, max_queries: int = 1,
                   variants: tuple[str, ...] = ()):
    cfg = config or default_config(head_dim=head_dim, num_kv_heads=8)
    tile = cfg.tile_shape(tile_rows=max_queries * group, kv_fp8="kv_fp8" in variants)
    constexprs = decode_constexprs(num_kv_heads=8, group=group, head_dim=head_dim, page_size=16,
                                   return_lse=False, upcast=False, max_queries=max_queries,
                                   first_pages=cfg.first_pages,
                                   page_prefetch_tiles=cfg.page_prefetch_tiles,
                                   page_prefetch_task=cfg.page_prefetch_task,
                                   keep_page_table=cfg.keep_page_table, **tile,
                                   **{name: True for name in variants})
    names = paged_decode_kernel.arg_names
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("k_ptr", "v_ptr") and "kv_fp8" in variants:
            signature[name] = "*fp8e4nv"
        elif name in POINTERS:
            signature[name] = POINTERS[name]
        elif name in ("scale_log2", "soft_cap", "k_scale", "v_scale"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    # what Triton's launcher would specialize on: 16-byte aligned pointers, strides of the
    # reference pool (HND, Hkv 8, page 16) and of contiguous q and out, all multiples of 16
    aligned = [n for n in names if n in POINTERS or n.startswith("stride_")]
    src = ASTSource(paged_decode_kernel, signature,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    options = {"num_warps": cfg.num_warps,
               "num_stages": cfg.stages(tile_rows=max_queries * group)}
    if "pdl" in variants:   # as launch.py launches it: the option lands in the kernel's metadata
        options["launch_pdl"] = True
    max_registers = cfg.registers(tile_rows=max_queries * group)
    if max_registers is not None:   # as launch.py launches it
        options["maxnreg"] = max_registers
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def compile_planner(*, arch: int, csr: bool, policy: bool, q_pad: int, first_pages: bool):
    """The planner kernel (kernels/plan.py) as the planner binds it: page 16, 128 rows a block;
    csr: the CSR table (else a block table); policy: the decision table's code; q_pad > 0:
    graph mode's qo_indptr, counted against a tile of q_pad query tokens; first_pages: it copies
    the tasks' first pages (KernelConfig.first_pages), and with q_pad its rows' queries."""
    constexprs = dict(PAGE_SIZE=16, BLOCK_ROWS=128, BLOCK_SPLITS=32, CSR=csr, POLICY=policy,
                      ONE_ROUND_STEPS=ONE_ROUND_STEPS, EDGES=POLICY_EDGES, Q_PAD=q_pad,
                      FIRST_PAGES=FIRST_PAGE_SLOTS if first_pages else 0,
                      QUERY_FIELDS=query_fields(first_pages=first_pages, max_queries=q_pad))
    names = plan_kernel.arg_names
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "edges_ptr":
            signature[name] = "*fp64"
        elif name.endswith("_ptr"):
            signature[name] = "*i32"
        elif name.endswith("_slack"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    src = ASTSource(plan_kernel, signature,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": 4, "num_stages": 2})


def resource_usage(cubin: bytes) -> str:
    """Registers and spill bytes from cuobjdump's resource usage of a cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                              text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    return f"{regs.group(1) if regs else '?'} registers, stack {stack.group(1) if stack else '?'} B"


def _sass(cubin: bytes) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


def _sass_ops(cubin: bytes) -> list[str]:
    return re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", _sass(cubin))


def sass_digest(cubin: bytes) -> str:
    """The first 10 hex digits of a SHA-256 of the SASS instructions with their operands (no
    addresses, no encodings)."""
    text = "\n".join(re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*;)", _sass(cubin)))
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def before_wait(cubin: bytes) -> str:
    """What the SASS does before the PDL wait (ACQBULK, griddepcontrol.wait): global loads (LDG),
    L2 prefetches (CCTL), and what must never come first: stores, atomics and reductions,
    asynchronous copies (STG, ATOM, RED, LDGSTS)."""
    ops = _sass_ops(cubin)
    at = next((i for i, op in enumerate(ops) if op.startswith("ACQBULK")), None)
    if at is None:
        return "no PDL wait"
    first = ops[:at]

    def n(prefix):
        return sum(1 for op in first if op == prefix or op.startswith(prefix + "."))
    return (f"before the wait {n('LDG')} LDG, {n('CCTL')} CCTL, "
            f"{n('STG') + n('ATOM') + n('ATOMG') + n('RED') + n('LDGSTS')} STG/ATOM/RED/LDGSTS")


def sass_counts(cubin: bytes) -> str:
    """Instruction counts from the cubin's SASS: all, shared-memory loads (LDS, and LDSM =
    ldmatrix) and stores (STS), global loads into registers (LDG), byte permutes (PRMT) and
    16-byte asynchronous copies (LDGSTS.128), the MMAs (HMMA: mma.sync; HGMMA, and fp8's QGMMA:
    wgmma), the fp8 conversions (F2FP) and the barriers (BAR: bar.sync, of cross-warp exchanges
    among others)."""
    ops = _sass_ops(cubin)

    def count(prefix):
        return sum(1 for op in ops if op == prefix or op.startswith(prefix + "."))
    ldgsts = sum(1 for op in ops if op.startswith("LDGSTS") and op.endswith(".128"))
    return (f"{len(ops)} instructions, {count('LDS')} LDS, {count('LDSM')} LDSM, "
            f"{count('STS')} STS, {count('LDG')} LDG, {count('PRMT')} PRMT, "
            f"{ldgsts} LDGSTS.128, {count('HMMA')} HMMA, {count('HGMMA') + count('QGMMA')} wgmma, "
            f"{count('F2FP')} F2FP, {count('BAR')} BAR")


def token_loops(cubin: bytes) -> str:
    """The innermost loops of the SASS (a backward branch with no other one inside it), largest
    first: the token loop's copies (one a path to _attend_range) and the merge's. For the
    largest with an MMA in it (the token loop), what one pass (one K/V tile) issues a thread:
    all, register moves (MOV and its IMAD.MOV form), shared-memory loads (LDS, LDSM), MMAs, fp8
    conversions (F2FP) and barriers."""
    ins = [(int(at, 16), op, rest) for at, op, rest in re.findall(
        r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", _sass(cubin))]
    index = {at: i for i, (at, _, _) in enumerate(ins)}
    back = []
    for i, (at, op, rest) in enumerate(ins):
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < at and int(target.group(1), 16) in index:
            back.append((index[int(target.group(1), 16)], i))
    inner = [(j, i) for j, i in back
             if not any(j <= j2 and i2 < i for j2, i2 in back if (j2, i2) != (j, i))]
    bodies = sorted(([op for _, op, _ in ins[j:i + 1]] for j, i in inner), key=len, reverse=True)
    if not bodies:
        return "no loop"

    def count(body, *prefixes):
        return sum(1 for op in body if op.split(".")[0] in prefixes)
    body = next((b for b in bodies if any(op.startswith("HMMA") for op in b)), bodies[0])
    moves = sum(1 for op in body if op == "MOV" or op.startswith("IMAD.MOV"))
    return (f"loops {', '.join(str(len(b)) for b in bodies)}; the token loop's pass: {len(body)} "
            f"instructions, {moves} moves, {count(body, 'LDS', 'LDSM')} LDS/LDSM, "
            f"{count(body, 'HMMA')} HMMA, {count(body, 'F2FP')} F2FP, {count(body, 'BAR')} BAR")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--quick", action="store_true", help="the reference shape (group 4, d 128) only")
    parser.add_argument("--queries", action="store_true",
                        help="group 4, d 128 with 2, 4, 8 and 16 query tokens per row")
    parser.add_argument("--variants", default="",
                        help="comma-separated kernel variants to compile in: window, soft_cap, "
                             "sinks, kv_fp8 (an e4m3 cache), token_scales (with kv_fp8), pdl "
                             "(programmatic dependent launch: griddepcontrol.wait first)")
    parser.add_argument("--max-registers", type=int, default=None,
                        help="KernelConfig.max_registers (Triton's maxnreg) of the default config")
    parser.add_argument("--shape", help="one shape, 'group,head_dim[,queries]' (e.g. 8,64 or "
                                        "8,64,16: 16 query tokens a row)")
    parser.add_argument("--config", default="",
                        help="KernelConfig fields over the shape's default, e.g. "
                             "'block_n=64,long_block_n=128' (long_block_n=0 or =none: none; "
                             "max_registers=none: the compiler's choice)")
    parser.add_argument("--planner", action="store_true",
                        help="the planner kernel instead: CSR and block tables, with the policy's "
                             "table and without, with graph mode's qo_indptr and without, "
                             "with the tasks' first pages and without")
    parser.add_argument("--loops", action="store_true",
                        help="also the innermost loops' sizes, and what one pass of the token "
                             "loop (the largest with an MMA: one K/V tile) issues")
    args = parser.parse_args()
    if args.planner:
        for csr in (True, False):
            for policy in (False, True):
                for q_pad in (0, 4):
                    for first in (False, True):
                        k = compile_planner(arch=args.arch, csr=csr, policy=policy, q_pad=q_pad,
                                            first_pages=first)
                        print(f"planner csr {int(csr)} policy {int(policy)} q_pad {q_pad} "
                              f"first pages {int(first)}: {resource_usage(k.asm['cubin'])}; "
                              f"{sass_counts(k.asm['cubin'])}")
        return
    variants = tuple(v for v in args.variants.split(",") if v)
    shapes = ((4, 128, 1),) if args.quick else ((4, 128, 1), (1, 64, 1), (8, 64, 1), (8, 128, 1),
                                                    (7, 128, 1), (2, 256, 1), (8, 512, 1))
    if args.queries:
        shapes = tuple((4, 128, n) for n in (2, 4, 8, 16))
    if args.shape:
        group, head_dim, *queries = (int(x) for x in args.shape.split(","))
        shapes = ((group, head_dim, queries[0] if queries else 1),)
    flags = {f.name for f in dataclasses.fields(KernelConfig) if f.type in (bool, "bool")}
    fields = {k: None if v == "none" else bool(int(v)) if k in flags else int(v)
              for k, v in (f.split("=") for f in args.config.split(",") if f)}
    if fields.get("long_block_n") == 0:   # off, as the bench's ':longblockn0'
        fields["long_block_n"] = None
    if args.max_registers is not None:
        fields["max_registers"] = args.max_registers
    for group, head_dim, queries in shapes:
        config = None
        if fields:
            config = dataclasses.replace(default_config(head_dim=head_dim, num_kv_heads=8),
                                         **fields)
        k = compile_decode(arch=args.arch, group=group, head_dim=head_dim, config=config,
                           max_queries=queries, variants=variants)
        ptx = k.asm["ptx"]
        waits = [int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+);", ptx)]
        print(f"group {group:2d} d {head_dim:3d} queries {queries:2d} {'+'.join(variants)}: "
              f"{resource_usage(k.asm['cubin'])}, {k.metadata.shared} B shared, "
              f"{ptx.count('cp.async.cg') + ptx.count('cp.async.ca')} cp.async, "
              f"deepest wait_group {max(waits, default=-1)}; {sass_counts(k.asm['cubin'])}; "
              f"SASS {sass_digest(k.asm['cubin'])}"
              + (f"; {before_wait(k.asm['cubin'])}" if "pdl" in variants else "")
              + (f"; {token_loops(k.asm['cubin'])}" if args.loops else ""))


if __name__ == "__main__":
    main()
