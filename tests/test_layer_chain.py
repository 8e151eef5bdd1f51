"""Programmatic dependent launch (KernelConfig.pdl) and `persistentkv layer-chain`."""
import json

import pytest
import torch

from paged_case import ON_GPU
from persistentkv.bench.backends import _pkv_variant, make_backends
from persistentkv.cli import main
from persistentkv.tuning import KernelConfig


def test_pdl_must_be_a_bool():
    assert KernelConfig().pdl is False and KernelConfig(pdl=True).pdl is True
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match=f"KernelConfig.pdl must be a bool, got {bad!r}"):
            KernelConfig(pdl=bad)
    for bad in ("yes", 0):                      # the other bool field, checked alike
        with pytest.raises(ValueError, match=f"KernelConfig.one_round must be a bool, got {bad!r}"):
            KernelConfig(one_round=bad)


def test_pdl_suffix_parses():
    assert _pkv_variant("pkv-auto:pdl1") == ("auto", None, {"pdl": True})
    assert _pkv_variant("pkv-split@16:warps8:pdl0") == ("split", 16, {"num_warps": 8, "pdl": False})
    assert _pkv_variant("pkv-auto:pdl2") is None and _pkv_variant("pkv-auto:pdl") is None
    backends, _ = make_backends(["pkv-auto:pdl1"], layout="HND", device=torch.device("cpu"))
    assert backends[0].name == "pkv-auto:pdl1"


def test_layer_chain_writes_checked_results(tmp_path, capsys):
    """The whole command: on the CPU its tiny functional run; on a GPU a short chain (2 layers,
    2 rows of 256 tokens) with both graphs captured, replayed and checked."""
    small = ["--layers", "2", "--batch", "2", "--context", "256", "--replays", "2"]
    assert main(["layer-chain", "--out", str(tmp_path), *(small if ON_GPU else [])]) == 0
    printed = capsys.readouterr().out
    assert ("timings mean nothing" in printed) is not ON_GPU
    data = json.loads((tmp_path / ("pdl.json" if ON_GPU else "pdl-functional.json")).read_text())
    assert data["environment"]["functional_only"] is not ON_GPU
    rows = {r["setting"]: r for r in data["summary"]}
    assert set(rows) == {"pdl0", "pdl1"}
    for r in rows.values():
        assert r["status"] == "ok" and r["layer0_error"] <= 2e-3 and r["max_layer_error"] <= 2e-3
        assert r["chain_bitwise_equal_pdl0"] and r["layers"] == 2 and r["us_per_step"] > 0
    assert rows["pdl0"]["pdl_effective"] is False
    assert rows["pdl1"]["pdl_effective"] is (ON_GPU and torch.cuda.get_device_capability() >= (9, 0))
    assert rows["pdl1"]["backend"] == "pkv-auto:pdl1"
    stem = "pdl" if ON_GPU else "pdl-functional"
    assert (tmp_path / f"{stem}.csv").read_text().startswith("case,")


def test_layer_chain_refuses_bad_options(tmp_path, capsys):
    assert main(["layer-chain", "--out", str(tmp_path), "--layers", "0"]) == 2
    assert "layers must be a positive int, got 0" in capsys.readouterr().err
