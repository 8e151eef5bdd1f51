"""The benchmark on the CPU: the functional run end to end, failure reporting, summaries."""
import collections
import json
import math
import re
import shlex
import sys

import numpy as np
import pytest
import torch

from paged_case import ON_GPU
from persistentkv.bench.adaptive import calibration_steps, evaluation_table
from persistentkv.bench.backends import (Backend, PersistentKV, PaddedSDPA, PerSequence,
                                         _override_suffix, _pkv_variant, make_backends)
from persistentkv.bench.results import SIGNIFICANT_DIGITS, results_json, summarize
from persistentkv.bench.runner import Measured, ModelShape, RunOptions, run_static, run_trace
from persistentkv.bench.traces import make_trace
from persistentkv.cli import main
from persistentkv.policy import Policy, StepFeatures, fit_policy
from persistentkv.runtime import sm_count
from persistentkv.schedule import Choice
from persistentkv.tuning import KernelConfig

SHAPE = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
OPTS = RunOptions(layers=2, samples=2, eager_reps=1, graph_reps=2, check_every=1, rotate_l2=False)


class WrongBackend(Backend):
    """Returns the query itself: must be caught by the reference check."""

    name = "wrong"

    def plan(self, step):
        self.step = step

    def run(self, layer):
        return self.step.queries[layer].clone()


@pytest.mark.skipif(ON_GPU, reason="on a GPU the same command runs the full suite: too long for a test")
def test_functional_bench_writes_results(tmp_path):
    backends = "pkv-grouped,pkv-split,pkv-split@2,pkv-auto,per-sequence"
    assert main(["bench", "--out", str(tmp_path), "--backends", backends, "--page-size", "8"]) == 0
    data = json.loads((tmp_path / "traces-functional.json").read_text())
    env = data["environment"]
    assert env["functional_only"] and env["torch"] == torch.__version__ and "date" in env
    assert env["shape"]["page_size"] == 8 and env["shape"]["head_dim"] == 64   # the page given
    rows = {r["backend"]: r for r in data["summary"]}
    assert set(rows) == set(backends.split(","))
    assert all(r["status"] == "ok" and r["max_error"] < 2e-3 and r["steps"] == 2 for r in rows.values())
    assert (tmp_path / "traces-functional.csv").read_text().startswith("case,")
    # pkv-auto's steps note the planner's choice: on the CPU no policy is fitted, so the fallback
    notes = {(s["backend"], s["note"]) for s in data["steps"]}
    assert {n for b, n in notes if b == "pkv-auto"} == {"split"}
    assert {n for b, n in notes if b != "pkv-auto"} == {""}


def test_wrong_backend_is_reported_failed_not_timed():
    device = torch.device("cuda" if ON_GPU else "cpu")
    measured = run_static("B2", [40, 90], [WrongBackend(), PerSequence()], shape=SHAPE, opts=OPTS,
                          device=device)
    by = {s["backend"]: s for s in measured.steps}
    assert by["wrong"]["status"] == "failed" and "relative error" in by["wrong"]["note"]
    assert math.isnan(by["wrong"]["eager_us"]) and by["per-sequence"]["status"] == "ok"


def test_trace_replay_measures_every_backend_on_the_same_steps():
    device = torch.device("cuda" if ON_GPU else "cpu")
    trace = make_trace("bucketed", batch_slots=2, num_requests=3, seed=1, buckets=(20, 70),
                       out_min=2, out_max=4)
    backends = [PersistentKV("split", layout="HND"), PaddedSDPA()]
    measured = run_trace("t", trace, backends, shape=SHAPE, opts=OPTS, device=device)
    steps = {(s["step"], s["backend"]) for s in measured.steps}
    assert len(steps) == 2 * 2 and all(s["status"] == "ok" for s in measured.steps)
    rows = summarize(measured, ceiling_tbps=None)
    assert {r["backend"] for r in rows} == {"pkv-split", "padded-sdpa"}
    assert all(r["tokens_per_s_eager"] > 0 for r in rows)
    # the trace's pools are let go: no backend keeps the last step (and its cache) alive
    assert all(getattr(b, "step", None) is None and getattr(b, "outs", None) is None
               for b in backends)


def test_summary_picks_flashinfer_best_per_step():
    base = dict(status="ok", rows=1, tokens=100, kv_bytes=1000, eager_us=10.0, plan_us=1.0,
                run_us=1.0, error=0.0, note="")
    steps = [
        {"step": 0, "backend": "fi-xqa", **base, "graph_us": 5.0},
        {"step": 0, "backend": "fi-tensor-core", **base, "graph_us": 4.0},
        {"step": 1, "backend": "fi-xqa", **base, "graph_us": 3.0},
        {"step": 1, "backend": "fi-tensor-core", **base, "graph_us": 6.0},
        {"step": 0, "backend": "pkv-split", **base, "graph_us": 3.5},
        {"step": 1, "backend": "pkv-split", **base, "graph_us": 3.5},
    ]
    rows = {r["backend"]: r for r in summarize(Measured("m", 1, 1, steps), ceiling_tbps=1.0)}
    best = rows["fi-best"]
    assert best["graph_us_per_layer"] == 3.5                   # median of the per-step best: 4 and 3
    assert abs(rows["pkv-split"]["speedup_graph_vs_fi_best"] - 1.0) < 1e-12


def test_results_json_rounds_floats_and_writes_a_row_a_line():
    rng = np.random.default_rng()
    steps = [{"case": f"B{i}", "graph_us": float(rng.uniform(1, 5000)), "error": float(rng.uniform(0, 1e-3)),
              "rows": i, "ok": True, "note": None} for i in range(1, 5)]
    payload = {"environment": {"device": "cpu", "sm_count": np.int64(132), "shape": {"head_dim": 128}},
               "summary": [], "steps": steps, "ceiling": np.float32(3.0625), "nan": math.nan}
    text = results_json(payload)
    back = json.loads(text)
    for got, want in zip(back["steps"], steps):
        for key in ("graph_us", "error"):
            assert got[key] == float(f"{want[key]:.{SIGNIFICANT_DIGITS}g}")
            assert abs(got[key] - want[key]) <= 1e-5 * abs(want[key])
        assert {k: got[k] for k in ("case", "rows", "ok", "note")} == \
            {k: want[k] for k in ("case", "rows", "ok", "note")}
    assert back["environment"] == {"device": "cpu", "sm_count": 132, "shape": {"head_dim": 128}}
    assert '"sm_count": 132,' in text                   # numpy's ints stay ints
    assert back["ceiling"] == 3.0625 and math.isnan(back["nan"]) and back["summary"] == []
    lines = text.splitlines()
    for step in steps:   # each row on one line of its own
        assert sum(f'"case": "{step["case"]}"' in line for line in lines) == 1
    assert len(lines) == len(steps) + 12


class RefusingBackend(PerSequence):
    """A library's own refusal, raised by its argument checks in plan()."""

    def __init__(self, name, refusals):
        super().__init__()
        self.name, self.refusals = name, refusals

    def plan(self, step):
        raise ValueError(f"Invalid page_size: {step.page_size}")


class RefusingRun(RefusingBackend):
    """Plans, then raises the refusal's type in run(): a failure, not a refusal."""

    def plan(self, step):
        PerSequence.plan(self, step)

    def run(self, layer):
        raise ValueError("bad argument from the bench")


def test_a_librarys_refusal_is_reported_unsupported_and_other_errors_failed():
    device = torch.device("cuda" if ON_GPU else "cpu")
    backends = [RefusingBackend("refuses", (ValueError,)), RefusingBackend("breaks", ()),
                RefusingRun("run-breaks", (ValueError,)), PerSequence()]
    measured = run_static("B2", [40, 90], backends, shape=SHAPE, opts=OPTS, device=device)
    by = {s["backend"]: s for s in measured.steps}
    assert by["run-breaks"]["status"] == "failed" and "from the bench" in by["run-breaks"]["note"]
    assert by["refuses"]["status"] == "unsupported"
    assert "Invalid page_size: 16" in by["refuses"]["note"]
    assert by["breaks"]["status"] == "failed" and "Invalid page_size" in by["breaks"]["note"]
    assert by["per-sequence"]["status"] == "ok"


class LayerLog(PerSequence):
    """Right answers; keeps the layers its run() was called with, per plan()."""

    name = "layer-log"

    def plan(self, step):
        super().plan(step)
        self.log = getattr(self, "log", []) + [[]]

    def run(self, layer):
        self.log[-1].append(layer)
        return super().run(layer)


def test_an_eager_step_runs_the_models_layers_rotating_over_the_pools():
    from persistentkv.bench.measure import measure_step
    from persistentkv.bench.runner import make_cache, step_inputs

    cache = make_cache(SHAPE, num_pages=20, layers=5, device=torch.device("cpu"), seed=0)
    for i, n in enumerate([40, 90]):
        cache.add_sequence(i)
        cache.append_tokens(i, n)
    step = step_inputs(cache, [0, 1], SHAPE, torch.Generator().manual_seed(0))
    backend = LayerLog()
    timing = measure_step(backend, step, reference=None, eager_reps=3, graph_reps=0,
                          step_layers=2)
    assert timing.status == "ok"
    # the check's plan runs layer 0; then each eager step runs the next 2 of the 5 layers
    assert backend.log == [[0], [0, 1], [2, 3], [4, 0]]


def test_speedups_compare_the_steps_both_sides_measured():
    base = dict(rows=1, tokens=100, kv_bytes=1000, eager_us=10.0, plan_us=1.0, run_us=1.0,
                error=0.0, note="")
    steps = [{"step": i, "backend": "pkv-split", "status": "ok", **base, "graph_us": t}
             for i, t in enumerate([10.0, 10.0, 40.0, 40.0])]
    # FlashInfer's one entry as fast, then failing at step 2 and left out of the later steps
    steps += [{"step": 0, "backend": "fi-xqa", "status": "ok", **base, "graph_us": 10.0},
              {"step": 1, "backend": "fi-xqa", "status": "ok", **base, "graph_us": 10.0},
              {"step": 2, "backend": "fi-xqa", "status": "failed", **base, "graph_us": math.nan}]
    rows = {r["backend"]: r for r in summarize(Measured("t", 1, 4, steps, step_layers=32),
                                               ceiling_tbps=None)}
    ours = rows["pkv-split"]
    assert ours["speedup_graph_vs_fi_best"] == 1.0 and ours["speedup_steps"] == 2
    assert ours["step_layers"] == 32 and ours["layers"] == 4
    # tokens/s of a model step of 32 layers, however many layers the pools had
    assert ours["tokens_per_s_graph"] == pytest.approx(4 / (100.0 * 32) * 1e6)


class UncapturableBackend(PerSequence):
    """Right answers, but its run() syncs with the host, which a CUDA graph capture refuses."""

    name = "uncapturable"

    def run(self, layer):
        out = super().run(layer)
        out.sum().item()
        return out


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA graphs")
def test_backend_that_cannot_be_captured_is_reported_failed():
    measured = run_static("B2", [40, 90], [UncapturableBackend(), PerSequence()], shape=SHAPE,
                          opts=OPTS, device=torch.device("cuda"))
    by = {s["backend"]: s for s in measured.steps}
    assert by["uncapturable"]["status"] == "failed" and "graph capture" in by["uncapturable"]["note"]
    assert by["per-sequence"]["status"] == "ok"


@pytest.mark.skipif(ON_GPU, reason="on a GPU the same commands run the full calibration")
def test_functional_calibrate_then_evaluate(tmp_path, capsys):
    policy_path = tmp_path / "policy.json"
    assert main(["calibrate", "--out", str(policy_path),
                 "--candidates", "pkv-grouped,pkv-split@4"]) == 0
    policy = json.loads(policy_path.read_text())
    assert policy["table"] and policy["fit"]["functional_only"]
    assert set(policy["table"].values()) <= {"grouped", "split@4"}
    # the measurements are kept beside the policy, and a refit from them gives the same table
    refit_path = tmp_path / "refit.json"
    assert main(["calibrate", "--from-results", str(tmp_path / "policy-measurements.json"),
                 "--objective", "eager_us", "--out", str(refit_path)]) == 0
    refit = json.loads(refit_path.read_text())
    assert refit["table"] == policy["table"] and refit["fit"]["seeds"] == policy["fit"]["seeds"]
    measurements = str(tmp_path / "policy-measurements.json")
    for argv, message in (
            (["--from-results", measurements, measurements], "from_results names a file twice"),
            (["--from-results", measurements], "holds no graph_us timing of a candidate")):
        assert main(["calibrate", *argv, "--out", str(tmp_path / "bad.json")]) == 2
        assert message in capsys.readouterr().err and not (tmp_path / "bad.json").exists()
    # evaluate refuses the calibration's seeds, and a policy of another shape
    moved = tmp_path / "moved.json"
    moved.write_text(json.dumps({**policy, "shape": [32, 8, 128]}))
    for argv, message in (
            (["--policy", str(policy_path), "--seeds", str(policy["fit"]["seeds"][0])],
             f"seeds [{policy['fit']['seeds'][0]}] were the policy's calibration seeds"),
            (["--policy", str(moved)], "the policy was fitted at (Hq, Hkv, head_dim) = (32, 8, "
                                      "128) and plans nothing at the evaluated (8, 2, 64)")):
        assert main(["evaluate", *argv, "--out", str(tmp_path / "refused")]) == 2
        assert message in capsys.readouterr().err and not (tmp_path / "refused").exists()
    assert main(["evaluate", "--policy", str(policy_path), "--out", str(tmp_path),
                 "--backends", "pkv-split"]) == 0
    data = json.loads((tmp_path / "evaluate.json").read_text())
    (row,) = data["environment"]["evaluation"]
    assert row["trace"] == "b2-bucketed/seed100"
    assert {s["backend"] for s in data["steps"]} == {"pkv-split", "pkv-auto"}
    # pkv-auto decided on the device with the policy under evaluation, as decide() does on the
    # host (the fallback, 'split', is not in this policy's table)
    fitted = Policy.from_json(policy_path.read_text())
    auto = [s for s in data["steps"] if s["backend"] == "pkv-auto"]
    assert [s["note"] for s in auto] == [str(fitted.decide(StepFeatures(
        rows=s["rows"], total_tokens=s["tokens"], max_len=s["max_seq_len"],
        mean_len=s["tokens"] / s["rows"], spread=s["max_seq_len"] * s["rows"] / s["tokens"],
        kv_bytes=s["kv_bytes"]))) for s in auto]
    assert row["picks"] == dict(collections.Counter(s["note"] for s in auto))
    assert sum(row["picks"].values()) == 2


STEP = dict(status="ok", rows=2, tokens=3000, kv_bytes=1000, eager_us=10.0, plan_us=1.0,
            run_us=1.0, graph_us=5.0, error=0.0, note="", max_seq_len=2000)


def test_calibration_steps_take_our_fixed_choices_only():
    """Labels become Choices; pkv-auto, config variants, FlashInfer and old labels are left out."""
    names = ["pkv-grouped", "pkv-split", "pkv-split@16", "pkv-auto", "pkv-split:warps8",
             "fi-xqa", "pkv-workqueue", "pkv-graph", "adaptive"]
    measured = Measured("t", 2, 1, [{**STEP, "step": 3, "backend": n} for n in names])
    steps = calibration_steps([measured])
    assert [s["choice"] for s in steps] == [Choice("grouped"), Choice("split"), Choice("split", 16)]
    assert {s["bin"] for s in steps} == {"r1-l0-s0"} and {s["step_key"] for s in steps} == {"t:3"}
    policy = fit_policy(steps, gpu="test")
    assert policy.table == {"r1-l0-s0": Choice("split")}   # a three-way tie: the default rule


def test_evaluation_table_compares_pkv_auto_with_the_best_fixed_and_flashinfer():
    def row(backend, eager, graph):
        return {"case": "t", "backend": backend, "status": "ok", "tokens_per_s_eager": eager,
                "tokens_per_s_graph": graph}

    summary = [row("pkv-auto", 120.0, 300.0), row("pkv-split", 100.0, 310.0),
               row("fi-xqa", 90.0, 200.0), row("fi-best", 80.0, 250.0)]
    steps = [{**STEP, "step": i, "backend": "pkv-auto", "note": n}
             for i, n in enumerate(["split@4", "grouped", "split@4"])]
    steps.append({**STEP, "step": 0, "backend": "pkv-split"})
    (r,) = evaluation_table(summary, [Measured("t", 2, 1, steps)])
    assert r["picks"] == {"split@4": 2, "grouped": 1}
    assert (r["auto_eager"], r["auto_graph"]) == (120.0, 300.0)
    assert r["best_fixed_eager"] == "pkv-split 100" and r["best_fixed_graph"] == "pkv-split 310"
    assert r["vs_best_fixed_eager"] == pytest.approx(1.2)
    assert r["vs_best_fixed_graph"] == pytest.approx(300 / 310)
    assert r["vs_fi_best_eager"] == pytest.approx(1.5)
    assert r["vs_fi_best_graph"] == pytest.approx(1.2)
    # the default rule (pkv-split) beside the best fixed: here the same backend, then a faster one
    assert (r["vs_rule_eager"], r["vs_rule_graph"]) == (pytest.approx(1.2), pytest.approx(300 / 310))
    (r,) = evaluation_table(summary + [row("pkv-split@16", 110.0, 320.0)],
                            [Measured("t", 2, 1, steps)])
    assert r["vs_best_fixed_graph"] == pytest.approx(300 / 320)
    assert r["vs_rule_graph"] == pytest.approx(300 / 310)
    (r,) = evaluation_table([s for s in summary if s["backend"] != "pkv-split"]
                            + [row("pkv-grouped", 50.0, 100.0)], [Measured("t", 2, 1, steps)])
    assert math.isnan(r["vs_rule_eager"]) and math.isnan(r["vs_rule_graph"])
    assert evaluation_table([row("pkv-split", 1.0, 1.0)], [Measured("t", 2, 1, steps)]) == []


def test_report_draws_the_speedup_over_flashinfer(tmp_path, capsys):
    """A results file with FlashInfer's best in it gets the paper-style speedup plot too, with no
    bar where FlashInfer failed a case (no fi-best row there); an --out that is a file is refused
    before anything is drawn."""
    rows, steps = [], []
    for case in ("B1 L1K", "B8 zipf", "B4 zipf"):
        for backend, us in (("pkv-split", 8.0), ("fi-best", 10.0)):
            if case == "B4 zipf" and backend == "fi-best":
                continue
            speedups = ({"speedup_graph_vs_fi_best": 10.0 / us, "speedup_eager_vs_fi_best": 1.0}
                        if case != "B4 zipf" else {})
            rows.append({"case": case, "backend": backend, "status": "ok",
                         "tokens_per_s_graph": 1e6 / us, "tokens_per_s_eager": 1e5 / us,
                         **speedups})
            steps.append({"case": case, "backend": backend, "status": "ok", "graph_us": us,
                          "tokens": 1024, "rows": 1, "kv_bytes": 4e6})
    path = tmp_path / "grid.json"
    path.write_text(json.dumps({"environment": {"device": "test", "ceiling_tbps": 4.4},
                                "summary": rows, "steps": steps}))
    (tmp_path / "afile").write_text("")
    assert main(["report", str(path), "--out", str(tmp_path / "afile")]) == 2
    assert "is a file; it names the folder" in capsys.readouterr().err
    assert main(["report", str(path), "--out", str(tmp_path / "plots")]) == 0
    written = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert written == ["grid-bandwidth.png", "grid-throughput.png", "grid-vs-flashinfer.png"]
    assert all((tmp_path / "plots" / name).stat().st_size > 10_000 for name in written)


def test_report_matrix_draws_shape_by_case(tmp_path):
    """--matrix: one heatmap over the files (a shape each); its numbers are each file's pkv-auto
    x FlashInfer's best, and a file without such a row is refused by name."""
    from persistentkv.bench.report import speedup_matrix

    paths = []
    for shape, ratios in (("tp8", {"B1 L1K": 1.2, "B8 zipf": 0.9}), ("gqa", {"B8 zipf": 1.05})):
        rows = [{"case": c, "backend": b, "status": "ok", "speedup_graph_vs_fi_best": x}
                for c, r in ratios.items() for b, x in (("pkv-auto", r), ("fi-best", 1.0))]
        paths.append(tmp_path / f"{shape}.json")
        paths[-1].write_text(json.dumps({"environment": {}, "summary": rows, "steps": []}))
    shapes, cases, ratio = speedup_matrix(paths)
    assert shapes == ["tp8", "gqa"] and cases == ["B1 L1K", "B8 zipf"]
    assert ratio == {("tp8", "B1 L1K"): 1.2, ("tp8", "B8 zipf"): 0.9, ("gqa", "B8 zipf"): 1.05}
    out = tmp_path / "plots"
    assert main(["report", *map(str, paths), "--matrix", "--out", str(out)]) == 0
    assert [p.name for p in out.iterdir()] == ["shape-matrix.png"]
    assert (out / "shape-matrix.png").stat().st_size > 10_000
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"environment": {}, "summary": [], "steps": []}))
    with pytest.raises(ValueError, match="bare.json.*no pkv-auto row"):
        speedup_matrix([bare])


def test_config_variants_are_checked_like_the_defaults():
    device = torch.device("cuda" if ON_GPU else "cpu")
    names = ["pkv-grouped:warps8", "pkv-split@2:warps2:stages2", "pkv-auto:pps3:waves3"]
    backends, _ = make_backends(names, layout="HND", device=device)
    assert [b.name for b in backends] == names
    assert all(b.capture_plan for b in backends)
    measured = run_static("B2", [40, 90], backends, shape=SHAPE, opts=OPTS, device=device)
    assert all(s["status"] == "ok" and s["error"] < 2e-3 for s in measured.steps)
    plans = [b.wrapper.current_plan for b in backends]
    assert [p.choice for p in plans] == [Choice("grouped"), Choice("split", 2), None]
    assert (plans[1].config.num_warps, plans[1].config.num_stages) == (2, 2)
    assert (plans[2].config.programs_per_sm, plans[2].config.waves) == (3, 3.0)
    assert plans[2].programs == 3 * sm_count(plans[2].indices.device)
    assert backends[2].overrides == {"programs_per_sm": 3, "waves": 3.0}   # released after the run
    for bad in ("pkv-split:warps", "pkv-split:colour3", "pkv-grouped@2:warps4", "pkv-auto@4",
                "pkv-split:warps8.5", "pkv-split:oneround2", "pkv-split@0", "pkv-workqueue",
                "pkv-graph", "adaptive"):
        with pytest.raises(ValueError, match=re.escape(f"['{bad}']")):
            make_backends([bad], layout="HND", device=device)
    with pytest.raises(ValueError, match="KernelConfig.num_warps must be a positive int, got 0"):
        make_backends(["pkv-split:warps0"], layout="HND", device=device)
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match=re.escape(
                f"KernelConfig.balanced_from_tokens must be an int >= 0, got {bad!r}")):
            KernelConfig(balanced_from_tokens=bad)
    for bad in (3, 64):
        with pytest.raises(ValueError, match=re.escape(
                f"KernelConfig.num_warps must be a power of two up to 32, got {bad}")):
            make_backends([f"pkv-split:warps{bad}"], layout="HND", device=device)
    for bad in (0, -1.0, float("inf"), float("nan"), 1e12, True, "2"):
        with pytest.raises(ValueError, match=re.escape(
                f"KernelConfig.waves must be in (0, 1024], got {bad!r}")):
            KernelConfig(waves=bad)
    assert _pkv_variant("pkv-auto:pps3:maxreg168") == (
        "auto", None, {"programs_per_sm": 3, "max_registers": 168})
    assert _pkv_variant("pkv-auto:blockn64:longblockn128:longfrom1024") == (
        "auto", None, {"block_n": 64, "long_block_n": 128, "long_from_tokens": 1024})
    assert _pkv_variant("pkv-auto:longblockn0") == ("auto", None, {"long_block_n": None})
    assert _pkv_variant("pkv-auto:maxreg0:maxregrows32") == (
        "auto", None, {"max_registers": None, "max_registers_rows": 32})
    assert _override_suffix({"long_block_n": None, "block_n": 128}) == ":longblockn0:blockn128"
    for name in ("pkv-auto:smallstep1572865:waves2.5", "pkv-auto:waves0.123456789",
                 "pkv-auto:smallstep1572864", "pkv-auto:pdl1:waves3"):   # parse back
        _, _, overrides = _pkv_variant(name)
        assert "pkv-auto" + _override_suffix(overrides) == name
    for bad in (0, 100, 256, True, 168.0):
        with pytest.raises(ValueError, match=re.escape(
                f"KernelConfig.max_registers must be None or a multiple of 8 in [24, 255], "
                f"got {bad!r}")):
            KernelConfig(max_registers=bad)


def test_static_batch_with_several_query_tokens_per_row():
    """run_static with q_len 'mix': ours are checked against the causal reference; backends of
    one query per row are reported unsupported, not timed."""
    from persistentkv.bench.runner import query_counts

    assert query_counts("1", [5, 9], seed=0) is None
    assert query_counts("4", [3, 9], seed=0) == [3, 4]
    assert all(2 <= n <= 8 for n in query_counts("mix", [100] * 20, seed=1))
    opts = RunOptions(layers=2, samples=2, eager_reps=1, graph_reps=2, check_every=1, q_len="mix",
                      rotate_l2=False)
    backends, _ = make_backends(["pkv-split", "pkv-balanced", "padded-sdpa"], layout="NHD",
                                device=torch.device("cuda" if ON_GPU else "cpu"))
    shape = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, layout="NHD")
    measured = run_static("mix", [70, 20, 33], backends, shape=shape, opts=opts,
                          device=torch.device("cuda" if ON_GPU else "cpu"))
    status = {s["backend"]: s["status"] for s in measured.steps}
    assert status == {"pkv-split": "ok", "pkv-balanced": "ok", "padded-sdpa": "unsupported"}
    assert all(s["error"] < 2e-3 for s in measured.steps if s["status"] == "ok")
    with pytest.raises(ValueError, match=r"q_len must be 1 to 16 or 'mix', got '17'"):
        RunOptions(q_len="17")


def test_static_batch_with_attention_variants():
    """run_static with a window, soft-cap and sinks: ours are checked against the reference with
    the same formula; a backend without them is reported unsupported, not timed."""
    opts = RunOptions(layers=2, samples=2, eager_reps=1, graph_reps=2, check_every=1,
                      window_left=30, logits_soft_cap=4.0, sinks=True, rotate_l2=False)
    device = torch.device("cuda" if ON_GPU else "cpu")
    backends, _ = make_backends(["pkv-split", "pkv-auto", "padded-sdpa"], layout="HND",
                                device=device)
    measured = run_static("variants", [170, 20, 33], backends, shape=SHAPE, opts=opts,
                          device=device)
    status = {s["backend"]: s["status"] for s in measured.steps}
    assert status == {"pkv-split": "ok", "pkv-auto": "ok", "padded-sdpa": "unsupported"}
    assert all(s["error"] < 2e-3 for s in measured.steps if s["status"] == "ok")
    with pytest.raises(ValueError, match=r"window_left must be -1 \(none\) or an int >= 0, got -3"):
        RunOptions(window_left=-3)
    with pytest.raises(ValueError, match=r"logits_soft_cap must be 0 or a .*got inf"):
        RunOptions(logits_soft_cap=float("inf"))


@pytest.mark.parametrize("granularity", ["tensor", "token"])
def test_static_batch_on_an_fp8_cache(granularity):
    """run_static on an e4m3 cache: ours are checked against the reference on the values it
    stands for; the step's bytes count one byte per element (and the per-token scales); dense
    baselines are reported unsupported."""
    device = torch.device("cuda" if ON_GPU else "cpu")
    shape = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                       kv_fp8=granularity)
    backends, _ = make_backends(["pkv-split", "pkv-auto", "padded-sdpa"], layout="HND",
                                device=device)
    measured = run_static("fp8", [170, 20, 33], backends, shape=shape, opts=OPTS, device=device)
    status = {s["backend"]: s["status"] for s in measured.steps}
    assert status == {"pkv-split": "ok", "pkv-auto": "ok", "padded-sdpa": "unsupported"}
    assert all(s["error"] < 2e-3 for s in measured.steps if s["status"] == "ok")
    per_token = 2 * 2 * (64 + (4 if granularity == "token" else 0))
    assert shape.bytes_per_token() == per_token
    assert {s["kv_bytes"] for s in measured.steps} == {223 * per_token}
    with pytest.raises(ValueError, match=r"kv_fp8 must be None or one of \('tensor', 'token'\)"):
        ModelShape(kv_fp8="row")


def test_xqa_causal_draft_mask_bits():
    """XQA's speculative-decoding mask: query j's 32-bit words have bits 0..j set."""
    from persistentkv.bench.backends import _causal_draft_mask

    mask = _causal_draft_mask(3, 40, torch.device("cpu"))
    assert mask.shape == (3, 40, 4) and mask.dtype == torch.uint16
    words = mask[1].view(torch.int32).long() & 0xFFFFFFFF                    # [40, 2]
    for j in (0, 5, 31, 32, 39):
        seen = [k for k in range(64) if (int(words[j, k // 32]) >> (k % 32)) & 1]
        assert seen == list(range(j + 1)), j


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs and their dumps need a GPU")
def test_gpu_capture_graph_dumps_its_nodes_and_replays(tmp_path):
    """capture_graph(dump_to=) writes the captured graph's kernel nodes as a DOT file (torch
    frees the cudaGraph_t at instantiation unless the graph keeps it), and the kept graph still
    replays the captured work."""
    from persistentkv.bench.measure import capture_graph

    x = torch.zeros(1024, device="cuda")
    path = tmp_path / "graph.dot"
    graph = capture_graph(lambda: x.add_(1.0), dump_to=str(path))
    text = path.read_text()
    assert "digraph" in text and "KERNEL" in text
    torch.cuda.synchronize()
    before = x[0].item()
    graph.replay()
    torch.cuda.synchronize()
    assert x[0].item() == before + 1.0


def test_sweep_checks_its_spec_and_cells_before_it_runs(tmp_path):
    from persistentkv.bench.sweep import config_grid, run_sweep

    assert [(b, c.block_n) for b, c in config_grid({"block_n": [32, 64],
                                                     "backend": ["split", "auto"]})] == \
        [("split", 32), ("auto", 32), ("split", 64), ("auto", 64)]
    for spec, match in (([1, 2], "spec must be a JSON object of lists"),
                        ({"block_n": 32}, r"spec\['block_n'\] must be a non-empty list, got 32"),
                        ({"blockn": [32]}, "spec key 'blockn' is no KernelConfig field"),
                        ({"backend": "split"}, r"spec\['backend'\] must be a non-empty list"),
                        ({"backend": ["workqueue"]}, r"must list backends of .*\['workqueue'\]"),
                        ({"num_warps": [0]}, "spec gives a KernelConfig it refuses")):
        with pytest.raises(ValueError, match=match):
            config_grid(spec)
    with pytest.raises(ValueError, match=r"cells must be one or more of .*got \['nope'\]"):
        run_sweep(device=torch.device("cpu"), cells=["nope"], spec={}, shape=SHAPE,
                  out_path=tmp_path / "s.json")


def test_layers_grow_until_a_step_leaves_the_l2():
    """A step's K/V across its layers is at least L2_ROTATION_BYTES where the memory allows (at
    most MAX_ROTATION_LAYERS layers), so that small steps are not timed out of the L2:
    gpt-oss-tp8's B1 L1K reads 256 KB a layer (32 layers: 8 MB). Windowed steps count the tokens
    they read."""
    from persistentkv.bench.runner import L2_ROTATION_BYTES, MAX_ROTATION_LAYERS, layers_that_fit

    opts = RunOptions()
    tp8 = ModelShape.of("gpt-oss-tp8")
    assert layers_that_fit(tp8, 1024 // 16, opts) == 977                # 256e6 / 256 KB
    assert layers_that_fit(tp8, 256 // 16, opts) == MAX_ROTATION_LAYERS
    llama = ModelShape.of("llama3-8b")
    pages = 32 * 8192 // 16 + 1                                     # 1 GB a layer
    assert layers_that_fit(llama, pages, opts) == 32
    assert layers_that_fit(llama, pages, RunOptions(memory_budget_gb=8)) == 7
    small = 4 * 1024 // 16 + 1                                      # B4 L1K: 17 MB a layer
    per_token = llama.bytes_per_token()
    assert layers_that_fit(llama, small, opts) == 32                # 537 MB across 32
    assert layers_that_fit(llama, small, opts, read_tokens=4 * 128) == \
        math.ceil(L2_ROTATION_BYTES / (4 * 128 * per_token))       # a window of 127
    assert layers_that_fit(llama, small, RunOptions(rotate_l2=False)) == 32


def test_a_traces_layers_let_its_smallest_measured_step_leave_the_l2():
    """A trace's pools are sized for its peak, but its small steps read far less: the layers are
    counted from the smallest step it measures, not from the pool."""
    from persistentkv.bench.runner import L2_ROTATION_BYTES

    trace = make_trace("bucketed", batch_slots=2, num_requests=3, seed=1, buckets=(600, 900),
                       out_min=2, out_max=4)
    opts = RunOptions(layers=2, samples=2, eager_reps=1, graph_reps=0, check_every=1)
    measured = run_trace("t", trace, [PaddedSDPA()], shape=SHAPE, opts=opts,
                         device=torch.device("cpu"))
    smallest = min(s["tokens"] for s in measured.steps)
    assert measured.layers == math.ceil(L2_ROTATION_BYTES / (smallest * SHAPE.bytes_per_token()))
    assert measured.step_layers == 2
    assert all(s["status"] == "ok" for s in measured.steps)
    # a memory budget of fewer layers than a model step: the eager step and tokens/s count those
    from persistentkv.bench.traces import peak_tokens

    pool = (peak_tokens(trace) // 16 + 2 * trace.batch_slots + 1) * 16 * SHAPE.bytes_per_token()
    few = RunOptions(layers=4, samples=1, eager_reps=1, graph_reps=0, check_every=1,
                     rotate_l2=False, memory_budget_gb=2.5 * pool / 1e9)
    measured = run_trace("t", trace, [PaddedSDPA()], shape=SHAPE, opts=few,
                         device=torch.device("cpu"))
    assert measured.layers == measured.step_layers == 2


def test_kv_bytes_count_the_window():
    """Bandwidth counts the tokens read: under a sliding window, the last window_left + q of a
    row (the ceiling and fraction_of_ceiling were 28x too high at window 4K on 128K rows)."""
    from persistentkv.bench.measure import kv_bytes_per_layer, read_tokens
    from persistentkv.bench.runner import make_cache, step_inputs

    shape = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=64)
    cache = make_cache(shape, num_pages=40, layers=1, device=torch.device("cpu"), seed=0)
    lens = [300, 20, 90]
    for i, n in enumerate(lens):
        cache.add_sequence(i)
        cache.append_tokens(i, n)
    generator = torch.Generator().manual_seed(0)
    for window, counts, want in ((-1, None, 410), (50, None, 51 + 20 + 51),
                                 (50, [4, 1, 2], 54 + 20 + 52)):
        step = step_inputs(cache, [0, 1, 2], shape, generator, counts, window_left=window)
        assert read_tokens(step) == want
        assert kv_bytes_per_layer(step) == want * 2 * 64 * 2 * 2


@pytest.mark.parametrize("kv_fp8", [None, "token"])
def test_trace_pages_given_back_in_hnd_vt_hold_random_v_again(kv_fp8):
    """HND_VT zeroes V of the pages a sequence gives back; a trace's next request on them read
    all-zero V (the reference check then passed on zeros). The bench puts the pages' random K
    there, scales and all."""
    from persistentkv.bench.runner import _random_v_again, make_cache

    shape = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=64, layout="HND_VT",
                       kv_fp8=kv_fp8)
    cache = make_cache(shape, num_pages=8, layers=2, device=torch.device("cpu"), seed=0)
    cache.add_sequence("a")
    cache.append_tokens("a", 40)
    pages = list(cache.allocator.sequence("a").pages)
    cache.free_sequence("a")
    assert all(bool((pool[pages, 1].float() == 0).all()) for pool in cache.pools)
    _random_v_again(cache, pages)
    for layer, pool in enumerate(cache.pools):
        v = pool[pages, 1].float()
        assert torch.isfinite(v).all() and v.std() > 0.1
        assert torch.equal(pool[pages, 1].view(torch.uint8), pool[pages, 0].view(torch.uint8))
        if kv_fp8 == "token":
            assert torch.equal(cache.kv_scales[layer][pages, 1], cache.kv_scales[layer][pages, 0])


def test_a_results_file_records_its_command_runnable():
    """The command is recorded shell-quoted: `--cells "B1 L1K"` ran again as two arguments."""
    from persistentkv.bench.results import environment

    env = environment(torch.device("cpu"), command=["persistentkv", "bench", "--cells",
                                                    "B1 L1K,B8 zipf"], functional=True)
    assert env["command"] == "persistentkv bench --cells 'B1 L1K,B8 zipf'"


def test_a_flashinfer_that_does_not_import_is_skipped_with_its_error(monkeypatch):
    """FlashInfer's entries on a CUDA device where it does not import are skipped with the import's
    own error (they said "not installed", which hid a kit left behind and a library that fails
    to load alike)."""
    import builtins

    from persistentkv.bench import backends as backends_module

    real_import = builtins.__import__

    def failing_import(name, *args, **kwargs):
        if name == "flashinfer" or name.startswith("flashinfer."):
            raise ImportError("libcuda.so.1: cannot open shared object file")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    monkeypatch.setattr(builtins, "__import__", failing_import)
    assert backends_module.flashinfer_version() is None
    built, skipped = make_backends(["per-sequence", "fi-xqa"], layout="HND",
                                   device=torch.device("cuda"))
    assert [b.name for b in built] == ["per-sequence"]
    assert skipped == {"fi-xqa": "FlashInfer does not import (ImportError: libcuda.so.1: cannot "
                                 "open shared object file; pip install 'persistentkv[flashinfer]')"}


def test_a_results_file_records_the_arguments_the_cli_was_given(tmp_path):
    """cli.main(argv) records argv, not the calling process's own command line. One small cell
    on a GPU (the suite's traces at their own size there took 75 GB beside the other tests)."""
    argv = ["bench", "--out", str(tmp_path), "--backends", "per-sequence", "--page-size", "8",
            "--grid", "--cells", "B1 L1K", "--layers", "1", "--memory-gb", "1", "--tag", "argv"]
    assert main(argv) == 0
    data = json.loads((tmp_path / "argv.json").read_text())
    assert data["environment"]["command"] == shlex.join(["persistentkv", *argv])
    from persistentkv.bench.results import run_command
    assert run_command()[1:] != argv                  # main() returned: sys.argv's again


def test_a_refit_records_every_trace_seed_it_read():
    """Seeds a refit's files measured, which evaluate then refuses: calibrate's, a bench run's
    traces' (its options' seed) and any a case names; a grid's seed is no trace's (a refit from
    a bench run of the suite's traces recorded none, so evaluate judged it on its own steps)."""
    from persistentkv.bench.adaptive import measured_seeds

    files = [{"environment": {"seeds": [1, 2]}, "steps": [{"case": "b8-zipf/seed1"}]},
             {"environment": {"options": {"seed": 100}}, "steps": [{"case": "b2-bucketed"}]},
             {"environment": {"options": {"seed": 0}}, "steps": [{"case": "B1 L1K"}]},
             {"environment": {}, "steps": [{"case": "b8-zipf/seed7"}]}]
    assert measured_seeds(files) == [1, 2, 7, 100]


def test_calibrate_records_the_dtype_a_refit_compares(tmp_path):
    """Calibrate's measurements record the shape as bench does (dtype and layout too): bf16 and
    fp16 measurements are not fitted into one policy, and a bench file of the same shape joins
    calibrate's."""
    from persistentkv.bench.adaptive import read_measurements

    paths = {}
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16),
                        ("bench", torch.float16)):
        shape = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype)
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps({"environment": {"device": "cpu",
                                                           "shape": shape.record()},
                                           "steps": []}))
    assert len(read_measurements([paths["fp16"], paths["bench"]])) == 2
    with pytest.raises(ValueError, match="measured on different GPUs or shapes"):
        read_measurements([paths["fp16"], paths["bf16"]])
    assert ModelShape().record() == {"num_qo_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                                     "page_size": 16, "dtype": "float16", "layout": "HND",
                                     "kv_fp8": None}
