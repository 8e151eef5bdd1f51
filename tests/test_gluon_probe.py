"""scripts/probe_gluon_fp8.py, the e4m3 token loop written in Gluon (an experiment, not the
engine): it compiles for sm_90 without a GPU with its operands built as intended, and on a GPU
it matches the float64 reference on odd lengths, for every variant."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paged_case import ON_GPU, csr_kwargs, make_case
from persistentkv import TOLERANCE, DecodeWrapper, reference_decode, relative_error

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "scripts" / "probe_gluon_fp8.py"


def test_probe_compiles_with_few_moves():
    """q's fragments built once and P through a tile of 2-element vectors: the pass has almost
    no register moves (Triton's e4m3 pass: about 220, docs/perf-notes.md v55), and no spills."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run([sys.executable, str(PROBE), "--compile", "--variants",
                             "q-registers-pvec2"], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line = result.stdout.strip().splitlines()[-1]
    assert "stack 0 B" in line, line
    moves = int(re.search(r"instructions, (\d+) moves, \d+ LDS/LDSM, 64 HMMA", line).group(1))
    assert moves < 20, line


def _probe():
    spec = importlib.util.spec_from_file_location("probe_gluon_fp8", PROBE)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe


@pytest.mark.parametrize("granularity", ["tensor", "token"])
def test_probe_pool_is_the_engines_hnd_vt(granularity):
    """quantize_pool's e4m3 HND_VT pool (V's blocks stored [D, S]) and scales stand for the K/V
    rows they were made from: the engine's output on it is the float64 reference's on it, and
    that is the rows' own attention within e4m3's error."""
    heads = dict(num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16)
    case = make_case(seq_lens=[300, 17], **heads, layout="HND", seed=1)
    table = csr_kwargs(case.table)
    exact, _ = reference_decode(case.q, case.kv_cache, layout="HND", **table)
    pool8, scales = _probe().quantize_pool(case.kv_cache, granularity)
    ref, _ = reference_decode(case.q, pool8, **scales, layout="HND_VT", **table)
    wrapper = DecodeWrapper("HND_VT")
    wrapper.plan(**table, **heads)
    out = wrapper.run(case.q, pool8, out=torch.full_like(case.q, float("nan")), **scales)
    assert relative_error(out, ref) <= TOLERANCE[torch.float16]
    assert relative_error(ref, exact) < 0.1     # e4m3 keeps 3 mantissa bits


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels have no interpreter: the probe runs on a "
                                        "GPU only (its compile is checked above)")
@pytest.mark.parametrize("granularity", ["tensor", "token"])
def test_probe_matches_the_reference(granularity):
    probe = _probe()
    lens = [300, 129, 17, 1, 4000, 128]
    case = make_case(seq_lens=lens, num_qo_heads=28, num_kv_heads=4, head_dim=128,
                     page_size=16, layout="HND_VT", seed=5)
    pool8, scales = probe.quantize_pool(case.kv_cache, granularity)
    table = csr_kwargs(case.table)
    ref, _ = reference_decode(case.q, pool8, **scales, layout="HND_VT", **table)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=case.q.device)
    for name, options in probe.VARIANTS.items():
        out = torch.full_like(case.q, float("nan"))
        probe.run(case.q, pool8, out, table["kv_indices"], table["kv_indptr"], seq_lens,
                  sm_scale=128 ** -0.5, num_kv_heads=4, **scales, **options)
        assert relative_error(out, ref) <= TOLERANCE[torch.float16], name
