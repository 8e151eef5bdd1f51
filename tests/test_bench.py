"""The benchmark on the CPU: the functional run end to end, failure reporting, summaries."""
import json
import math

import pytest
import torch

from paged_case import ON_GPU
from persistentkv.bench.backends import Backend, PersistentKV, PaddedSDPA, PerSequence, make_backends
from persistentkv.bench.results import summarize
from persistentkv.bench.runner import Measured, ModelShape, RunOptions, run_static, run_trace
from persistentkv.bench.traces import make_trace
from persistentkv.cli import main

SHAPE = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
OPTS = RunOptions(layers=2, samples=2, eager_reps=1, graph_reps=2, check_every=1)


class WrongBackend(Backend):
    """Returns the query itself: must be caught by the reference check."""

    name = "wrong"

    def plan(self, step):
        self.step = step

    def run(self, layer):
        return self.step.queries[layer].clone()


@pytest.mark.skipif(ON_GPU, reason="on a GPU the same command runs the full suite: too long for a test")
def test_functional_bench_writes_results(tmp_path):
    assert main(["bench", "--out", str(tmp_path), "--backends", "pkv-split,pkv-workqueue,pkv-graph,per-sequence"]) == 0
    data = json.loads((tmp_path / "traces-functional.json").read_text())
    env = data["environment"]
    assert env["functional_only"] and env["torch"] == torch.__version__ and "date" in env
    rows = {r["backend"]: r for r in data["summary"]}
    assert set(rows) == {"pkv-split", "pkv-workqueue", "pkv-graph", "per-sequence"}
    assert all(r["status"] == "ok" and r["max_error"] < 2e-3 and r["steps"] == 2 for r in rows.values())
    assert (tmp_path / "traces-functional.csv").read_text().startswith("case,")


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
    backends = [PersistentKV("workqueue", layout="HND"), PaddedSDPA()]
    measured = run_trace("t", trace, backends, shape=SHAPE, opts=OPTS, device=device)
    steps = {(s["step"], s["backend"]) for s in measured.steps}
    assert len(steps) == 2 * 2 and all(s["status"] == "ok" for s in measured.steps)
    rows = summarize(measured, ceiling_tbps=None)
    assert {r["backend"] for r in rows} == {"pkv-workqueue", "padded-sdpa"}
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
def test_functional_calibrate_then_evaluate(tmp_path):
    policy_path = tmp_path / "policy.json"
    assert main(["calibrate", "--out", str(policy_path),
                 "--candidates", "pkv-split,pkv-workqueue@4"]) == 0
    policy = json.loads(policy_path.read_text())
    assert policy["table"] and policy["fit"]["functional_only"]
    # the measurements are kept beside the policy, and a refit from them gives the same table
    refit_path = tmp_path / "refit.json"
    assert main(["calibrate", "--from-results", str(tmp_path / "policy-measurements.json"),
                 "--objective", "eager_us", "--out", str(refit_path)]) == 0
    assert json.loads(refit_path.read_text())["table"] == policy["table"]
    assert main(["evaluate", "--policy", str(policy_path), "--out", str(tmp_path),
                 "--backends", "pkv-split"]) == 0
    data = json.loads((tmp_path / "evaluate.json").read_text())
    (row,) = data["environment"]["evaluation"]
    assert row["trace"] == "b2-bucketed/seed100"
    assert sum(row["picks_graph"].values()) == sum(row["picks_eager"].values()) == 2
    assert {s["backend"] for s in data["steps"]} == {"pkv-split", "adaptive", "adaptive-eager"}


def test_report_draws_the_speedup_over_flashinfer(tmp_path):
    """A results file with FlashInfer's best in it gets the paper-style speedup plot too."""
    rows, steps = [], []
    for case in ("B1 L1K", "B8 zipf"):
        for backend, us in (("pkv-split", 8.0), ("fi-best", 10.0)):
            rows.append({"case": case, "backend": backend, "status": "ok",
                         "tokens_per_s_graph": 1e6 / us, "tokens_per_s_eager": 1e5 / us,
                         "speedup_graph_vs_fi_best": 10.0 / us, "speedup_eager_vs_fi_best": 1.0})
            steps.append({"case": case, "backend": backend, "status": "ok", "graph_us": us,
                          "tokens": 1024, "rows": 1, "kv_bytes": 4e6})
    path = tmp_path / "grid.json"
    path.write_text(json.dumps({"environment": {"device": "test", "ceiling_tbps": 4.4},
                                "summary": rows, "steps": steps}))
    assert main(["report", str(path), "--out", str(tmp_path / "plots")]) == 0
    written = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert written == ["grid-bandwidth.png", "grid-throughput.png", "grid-vs-flashinfer.png"]
    assert all((tmp_path / "plots" / name).stat().st_size > 10_000 for name in written)


def test_config_variants_are_checked_like_the_defaults():
    device = torch.device("cuda" if ON_GPU else "cpu")
    names = ["pkv-workqueue:warps8", "pkv-split@2:warps2:stages2", "pkv-graph:pps2:waves3"]
    backends, _ = make_backends(names, layout="HND", device=device)
    assert [b.name for b in backends] == names
    measured = run_static("B2", [40, 90], backends, shape=SHAPE, opts=OPTS, device=device)
    assert all(s["status"] == "ok" and s["error"] < 2e-3 for s in measured.steps)
    config = backends[1].wrapper.plan_info.config
    assert (config.num_warps, config.num_stages) == (2, 2)
    assert backends[2].overrides == {"programs_per_sm": 2, "waves": 3.0}   # released after the run
    for bad in ("pkv-split:warps", "pkv-split:colour3", "pkv-grouped@2:warps4"):
        with pytest.raises(ValueError, match=bad):
            make_backends([bad], layout="HND", device=device)
