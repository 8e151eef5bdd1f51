"""The kernels compile for the H200 (sm_90) even where there is no GPU: the interpreter accepts some
programs the compiler refuses (a variable that changes shape across an if, for one)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _compile_check(*args: str) -> list[str]:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_check.py"), "--quick",
                             *args], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout
    return lines


def test_planner_kernel_compiles_for_sm90_in_every_form():
    """CSR and block tables, with the policy's table and without, with graph mode's qo_indptr
    counted and without, copying the tasks' first pages and not: the interpreter runs all of
    them, the compiler must take them too."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_check.py"),
                             "--planner"], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 16 and all("stack 0 B" in line for line in lines), result.stdout


def test_decode_kernel_compiles_for_sm90_without_spills_and_pipelined():
    for line in _compile_check():
        assert "stack 0 B" in line and "cp.async" in line and " 0 cp.async" not in line, line
        # the K/V loads stay pipelined: a later tile is in flight while one is computed
        # (with the page-index load inside the tile's own iteration this fell to 0)
        assert int(re.search(r"deepest wait_group (\d+)", line).group(1)) >= 1, line


def test_decode_kernel_reading_the_first_pages_compiles_pipelined():
    """KernelConfig.first_pages: the first tile's pages from the planner's copy; no spills, and
    the K/V loads still pipelined."""
    line = _compile_check("--config", "first_pages=1")[0]
    assert "stack 0 B" in line and int(re.search(r"deepest wait_group (\d+)", line).group(1)) >= 1


@pytest.mark.parametrize("fetch", ["page_prefetch_tiles=3", "page_prefetch_task=1"])
def test_decode_kernel_prefetching_page_indices_compiles_pipelined(fetch):
    """KernelConfig.page_prefetch_tiles and page_prefetch_task (fp8 HND_VT, the step they are
    for): the prefetch is PTX, which the interpreter compiles out, so only here is it seen to
    reach the kernel (more instructions than without it), with no spill and the K/V loads
    still pipelined."""
    fp8 = ("--variants", "kv_fp8,v_transposed")
    off, on = (_compile_check(*fp8, *config)[0] for config in ((), ("--config", fetch)))
    count = [int(re.search(r"(\d+) instructions", line).group(1)) for line in (off, on)]
    assert count[1] > count[0], (off, on)
    assert "stack 0 B" in on and int(re.search(r"deepest wait_group (\d+)", on).group(1)) >= 1


def test_token_loop_pass_is_found():
    """--loops finds the token loop's copies in the SASS, larger than the merge's loops: one pass
    of it is one K/V tile (64 tokens at head dim 128: each of the 4 warps runs 16 HMMA for its 16
    tokens of QK^T and 16 for its 32 columns of PV)."""
    line = _compile_check("--loops")[0]
    sizes = [int(n) for n in re.search(r"loops ([\d, ]+);", line).group(1).split(", ")]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 2 * sizes[-1], line
    assert re.search(r"the token loop's pass: \d+ instructions, \d+ moves, \d+ LDS/LDSM, 32 HMMA",
                     line), line


def test_decode_kernel_with_pdl_compiles_with_the_same_resources():
    """PDL adds one griddepcontrol.wait at the kernel's start: same registers and shared memory,
    no spills."""
    plain, pdl = _compile_check()[0], _compile_check("--variants", "pdl")[0]
    assert "stack 0 B" in pdl and " pdl:" in pdl, pdl
    assert "before the wait 0 LDG, 0 CCTL, 0 STG/ATOM/RED/LDGSTS" in pdl, pdl   # SASS order
    resources = re.compile(r"(\d+) registers, stack \d+ B, (\d+) B shared")
    assert resources.search(pdl).groups() == resources.search(plain).groups(), (plain, pdl)


def test_fp8_kernels_compile_for_sm90():
    """The e4m3 kernel with per-token scales and every variant on compiles, pipelined and without
    spills (a scale that is a float before the token loop and a tile inside it runs in the
    interpreter and does not compile)."""
    piped = _compile_check("--variants", "kv_fp8,token_scales,window,soft_cap,sinks")[0]
    assert "stack 0 B" in piped and " 0 cp.async" not in piped, piped


def test_v_transposed_reads_v_like_k():
    """An e4m3 cache in HND_VT: V's tiles come in by 16-byte cp.async and leave shared memory by
    8-byte loads and ldmatrix, as K's do, with no byte-wide shared loads: at least 35% fewer
    shared loads and 25% fewer instructions than the HND kernel, no spill, still pipelined."""
    counts = re.compile(r"(\d+) instructions, (\d+) LDS, (\d+) LDSM")
    hnd = _compile_check("--variants", "kv_fp8")[0]
    vt = _compile_check("--variants", "kv_fp8,v_transposed")[0]
    assert "stack 0 B" in vt and int(re.search(r"deepest wait_group (\d+)", vt).group(1)) >= 1, vt
    (n_hnd, lds_hnd, _), (n_vt, lds_vt, ldsm_vt) = (
        map(int, counts.search(line).groups()) for line in (hnd, vt))
    assert lds_vt <= 0.65 * lds_hnd and n_vt <= 0.75 * n_hnd and ldsm_vt > 0, (hnd, vt)


def test_max_registers_reaches_the_compiler():
    """KernelConfig.max_registers caps the kernel's registers: the e4m3 HND_VT kernel takes more
    than 168 by itself and 168 or fewer under the cap (three 128-thread programs an SM)."""
    regs = re.compile(r"(\d+) registers")
    free = _compile_check("--variants", "kv_fp8,v_transposed")[0]
    capped = _compile_check("--variants", "kv_fp8,v_transposed", "--max-registers", "168")[0]
    assert int(regs.search(free).group(1)) > 168, free
    assert int(regs.search(capped).group(1)) <= 168, capped


def test_padded_tiles_take_the_warp_group_mma():
    """A 32-row tile (8 queries a row at group 4) runs mma.sync; padded to 64 rows (the default
    min_tile_rows) it runs the warp-group MMA, which Triton picks on sm_90 only for 64-row tiles.
    Both without spills. If a Triton release changes that choice, the padding's reason is gone."""
    mma = re.compile(r"(\d+) HMMA, (\d+) wgmma")
    padded = _compile_check("--shape", "4,128,8")[0]
    plain = _compile_check("--shape", "4,128,8", "--config", "min_tile_rows=16")[0]
    assert "stack 0 B" in padded and "stack 0 B" in plain, (padded, plain)
    hmma, wgmma = map(int, mma.search(padded).groups())
    assert hmma == 0 and wgmma > 0, padded
    hmma, wgmma = map(int, mma.search(plain).groups())
    assert hmma > 0 and wgmma == 0, plain


def test_tiles_past_head_dim_128_are_not_padded():
    """At head dim 256 a 32-row tile (4 queries a row at group 8) padded to 64 rows spills and
    needs more shared memory than two programs an SM can have; the default leaves it at 32 rows,
    without spills. If a Triton release compiles the padded tile without spills, the rule's
    reason is gone (tuning.default_config)."""
    resources = re.compile(r"stack (\d+) B, (\d+) B shared")
    default = _compile_check("--shape", "8,256,4")[0]
    padded = _compile_check("--shape", "8,256,4", "--config", "min_tile_rows=64")[0]
    (stack, shared), (padded_stack, padded_shared) = (
        map(int, resources.search(line).groups()) for line in (default, padded))
    assert stack == 0 and shared <= 228 * 1024 // 2, default
    assert padded_stack > 0 and padded_shared > 228 * 1024 // 2, padded


def test_head_dim_256_caps_small_tiles_and_not_wide_ones():
    """At head dim 256 the compiler alone holds a one-query tile to 168 registers (three programs
    an SM, where the persistent grid runs two) and spills; the default's cap of 224 removes the
    spill. A 32-row tile (16 queries at group 2) is left to the compiler: under the cap it spills
    more (tuning.default_config). If a Triton release compiles the one-query tile without spills
    uncapped, the cap's reason is gone."""
    spill = re.compile(r"(\d+) registers, stack (\d+) B")
    capped = _compile_check("--shape", "2,256")[0]
    free = _compile_check("--shape", "2,256", "--config", "max_registers=none")[0]
    wide = _compile_check("--shape", "2,256,16")[0]
    (regs, stack), (_, free_stack), (wide_regs, _) = (
        map(int, spill.search(line).groups()) for line in (capped, free, wide))
    assert stack == 0 and 168 < regs <= 224, capped
    assert free_stack > 0, free
    assert wide_regs > 224, wide


def test_head_dim_512_runs_wide_tiles_as_blocks_of_16_rows():
    """At head dim 512 a 64-row tile (8 queries at group 8) spills over a kilobyte a thread and
    takes 160 KB of shared memory (one program an SM); the default runs it as four M-blocks of
    16 rows, which spill at most a few bytes, and a large step's 64-row programs two to its
    columns (value blocks of 256 at two stages), which spill under half of it in 112 KB."""
    stack = re.compile(r"stack (\d+) B")
    shared = re.compile(r"(\d+) B shared")
    blocks = _compile_check("--shape", "8,512,8")[0]
    whole = _compile_check("--shape", "8,512,8", "--config", "max_tile_rows=64,value_blocks=1")[0]
    halves = _compile_check("--shape", "8,512,8", "--config", "max_tile_rows=64")[0]
    assert int(stack.search(blocks).group(1)) <= 16, blocks
    assert int(stack.search(whole).group(1)) > 1024, whole
    assert int(stack.search(halves).group(1)) < int(stack.search(whole).group(1)) // 2, halves
    assert int(shared.search(halves).group(1)) <= 114688 < int(shared.search(whole).group(1))
