"""The adaptive policy: features, bins, the fit, JSON, the fallback, and plan(backend="auto")."""
import time

import pytest
import torch

from paged_case import csr_kwargs, make_case
from persistentkv import TOLERANCE, DecodeWrapper, reference_decode, relative_error
from persistentkv.policy import (Choice, Policy, StepFeatures, bin_of, fallback_choice, fit_policy,
                                 load_policy)

FEATS = dict(num_kv_heads=8, head_dim=128, elem_size=2, sm_count=132, page_size=16, group=4)


def test_features_and_bins():
    f = StepFeatures.of([1000, 3000], **FEATS)
    assert (f.rows, f.total_tokens, f.max_len, f.mean_len) == (2, 4000, 3000, 2000.0)
    assert f.spread == 1.5 and f.kv_bytes == 4000 * 8 * 128 * 2 * 2
    assert f.bin() == "r1-l1-s0" == bin_of(rows=2, max_len=3000, total_tokens=4000)
    assert StepFeatures.of([100, 100, 100, 9000], **FEATS).bin() == "r1-l2-s1"   # skewed
    assert StepFeatures.of([5] * 200, **FEATS).bin() == "r4-l0-s0"


def _step(key, bin_, choice, us, status="ok"):
    backend, _, pages = choice.partition("@")
    return {"step_key": key, "bin": bin_, "choice": choice, "backend": backend,
            "split_pages": int(pages) if pages else None, "status": status, "graph_us": us,
            "eager_us": us * 10}


def test_fit_picks_the_lowest_total_per_bin_and_the_best_persistentkv():
    steps = [_step("a", "b0", "fi-xqa", 5), _step("a", "b0", "pkv-split", 7),
             _step("a", "b0", "pkv-split@16", 6), _step("b", "b0", "fi-xqa", 9),
             _step("b", "b0", "pkv-split", 6), _step("b", "b0", "pkv-split@16", 6),
             _step("c", "b1", "fi-xqa", 1, status="failed"), _step("c", "b1", "pkv-grouped", 3)]
    policy = fit_policy(steps, gpu="X")
    assert policy.table["b0"] == Choice("pkv-split", 16)            # 12 against 13 and 14
    assert policy.pkv_table["b0"] == Choice("pkv-split", 16)
    assert policy.table["b1"] == Choice("pkv-grouped")              # a failed candidate never wins
    eager = fit_policy(steps, gpu="X", objective="eager_us")
    assert eager.table["b0"] == Choice("pkv-split", 16)
    with pytest.raises(ValueError, match="objective"):
        fit_policy(steps, gpu="X", objective="p50")


def test_fit_breaks_near_ties_by_the_other_mode():
    """Within tie_tolerance of the best graph time the cheaper eager step wins; a candidate past
    the tolerance does not, however cheap in eager mode."""
    def step(key, choice, graph, eager):
        return {**_step(key, "b0", choice, graph), "eager_us": eager}

    steps = [step("a", "pkv-split", 100, 900), step("a", "pkv-graph", 101, 300),
             step("a", "fi-xqa", 104, 100), step("b", "pkv-split", 100, 900),
             step("b", "pkv-graph", 101, 300), step("b", "fi-xqa", 104, 100)]
    policy = fit_policy(steps, gpu="X")
    assert policy.table["b0"] == Choice("pkv-graph")          # 1% slower in graphs, 3x cheaper eager
    assert fit_policy(steps, gpu="X", tie_tolerance=0.0).table["b0"] == Choice("pkv-split")
    assert fit_policy(steps, gpu="X", tie_tolerance=0.05).table["b0"] == Choice("fi-xqa")
    assert policy.eager_table["b0"] == Choice("fi-xqa")        # by eager time: 200 against 600


def test_decide_by_mode():
    """mode="eager" reads the eager table; an unfitted bin takes the nearest fitted one."""
    even = StepFeatures.of([1000] * 4, **FEATS)
    skewed = StepFeatures.of([100, 100, 100, 9000], **FEATS)
    policy = Policy(gpu="X", table={even.bin(): Choice("fi-xqa"), skewed.bin(): Choice("pkv-split")},
                    pkv_table={even.bin(): Choice("pkv-split")},
                    eager_table={even.bin(): Choice("pkv-graph")})
    assert policy.decide(even) == Choice("fi-xqa")
    assert policy.decide(even, mode="eager") == Choice("pkv-graph")
    assert policy.decide(skewed, mode="eager") == Choice("pkv-graph")   # nearest eager bin
    assert policy.decide(even, mode="eager", pkv_only=True) == Choice("pkv-split")
    assert Policy(gpu="X", table=policy.table).decide(skewed, mode="eager") == Choice("pkv-split")
    other = StepFeatures.of([5] * 200, **FEATS)
    assert Policy(gpu="X").decide(other, mode="eager") == fallback_choice(other)
    with pytest.raises(ValueError, match="mode must be"):
        policy.decide(even, mode="replay")


def test_json_round_trip_and_bad_files(tmp_path):
    policy = Policy(gpu="X", table={"r0-l0-s0": Choice("fi-xqa")},
                    pkv_table={"r0-l0-s0": Choice("pkv-split", 8)},
                    eager_table={"r0-l0-s0": Choice("pkv-graph")}, fit={"seeds": [1]})
    path = tmp_path / "p.json"
    policy.save(path)
    again = load_policy("X", path)
    assert (again.table, again.pkv_table, again.eager_table) == (
        policy.table, policy.pkv_table, policy.eager_table)
    path.write_text('{"gpu": "X", "table": {}, "pkv_table": {}}')    # a file from before eager_table
    assert load_policy("X", path).eager_table == {}
    path.write_text('{"gpu": "X"}')
    with pytest.raises(ValueError, match="not a policy file"):
        load_policy("X", path)


def test_an_unfitted_bin_takes_the_nearest_fitted_one():
    """Calibration reaches only some bins: B4 at 1-2K (r1-l0-s0, between a fitted B1 short bin and
    a fitted B4 long bin) takes the nearer one, not the fallback rule."""
    table = {"r0-l0-s0": Choice("pkv-graph"), "r1-l3-s1": Choice("pkv-split"),
             "r4-l3-s1": Choice("pkv-workqueue", 64)}
    policy = Policy(gpu="X", table=table)
    b4_short = StepFeatures.of([1400] * 4, **FEATS)
    assert b4_short.bin() == "r1-l0-s0" and policy.decide(b4_short) == Choice("pkv-graph")
    assert policy.decide(StepFeatures.of([9000] * 100, **FEATS)) == Choice("pkv-workqueue", 64)
    # equally near in rows and in length: the first bin in sorted order
    rows_or_length = Policy(gpu="X", table={"r2-l3-s0": Choice("pkv-graph"),
                                            "r3-l2-s0": Choice("pkv-split", 64)})
    b32_long = StepFeatures.of([32800] + [18000] * 31, **FEATS)
    assert b32_long.bin() == "r3-l3-s0"
    assert rows_or_length.decide(b32_long) == Choice("pkv-graph")
    assert policy.decide(StepFeatures.of([1400] * 4, **FEATS), pkv_only=True) == fallback_choice(
        b4_short)                                              # an empty table: the rule


def test_unknown_gpu_gets_the_fallback_rule():
    policy = load_policy("Some GPU 9000")
    assert policy.table == {}
    f = StepFeatures.of([100, 100, 100, 9000], **FEATS)
    assert policy.decide(f) == fallback_choice(f) == Choice("pkv-workqueue")
    assert fallback_choice(StepFeatures.of([4096] * 256, **FEATS)) == Choice("pkv-grouped")
    assert fallback_choice(StepFeatures.of([4096] * 4, **FEATS)) == Choice("pkv-split")


def test_shipped_h200_policy_decides_quickly_and_deterministically():
    policy = load_policy("NVIDIA H200")
    assert policy.table and policy.gpu == "NVIDIA H200"
    assert all(c.backend.startswith("pkv-") for c in policy.pkv_table.values())
    lens = torch.randint(1, 60000, (128,), generator=torch.Generator().manual_seed(0)).numpy()
    times, picks = [], set()
    for _ in range(200):
        t = time.perf_counter()
        choice = policy.decide(StepFeatures.of(lens, **FEATS))
        times.append(time.perf_counter() - t)
        picks.add(choice)
    times.sort()
    assert len(picks) == 1 and times[100] < 20e-6


@pytest.mark.parametrize("form", ["csr"])
def test_plan_auto_runs_the_policy_choice(form):
    case = make_case(seq_lens=[300, 20, 90], num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    key = StepFeatures.of([300, 20, 90], num_kv_heads=2, head_dim=64, elem_size=2, sm_count=4,
                          page_size=16, group=4).bin()
    policy = Policy(gpu="cpu", table={key: Choice("fi-xqa")},
                    pkv_table={key: Choice("pkv-workqueue", 2)})
    wrapper = DecodeWrapper("NHD", policy=policy)
    plan = wrapper.plan(**csr_kwargs(case.table), num_qo_heads=8, num_kv_heads=2, head_dim=64,
                        page_size=16, backend="auto")
    assert plan.schedule.backend == "workqueue" and plan.schedule.split_pages == 2
    ref, _ = reference_decode(case.q, case.kv_cache, layout="NHD", **csr_kwargs(case.table))
    assert relative_error(wrapper.run(case.q, case.kv_cache), ref) <= TOLERANCE[torch.float16]


def test_plan_auto_runs_a_graph_mode_choice_as_the_work_queue():
    """The policy may pick pkv-graph (the work-queue with the default split, planned on the GPU);
    plan(backend="auto") on the host runs the same schedule, planned on the host."""
    lens = [300, 20, 90]
    case = make_case(seq_lens=lens, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    key = StepFeatures.of(lens, **FEATS).bin()
    policy = Policy(gpu="cpu", table={key: Choice("pkv-graph")}, pkv_table={key: Choice("pkv-graph")})
    wrapper = DecodeWrapper("NHD", policy=policy)
    plan = wrapper.plan(**csr_kwargs(case.table), num_qo_heads=8, num_kv_heads=2, head_dim=64,
                        page_size=16, backend="auto")
    default = DecodeWrapper("NHD").plan(**csr_kwargs(case.table), num_qo_heads=8, num_kv_heads=2,
                                        head_dim=64, page_size=16, backend="workqueue")
    assert plan.schedule.backend == "workqueue"
    assert plan.schedule.split_pages == default.schedule.split_pages
    ref, _ = reference_decode(case.q, case.kv_cache, layout="NHD", **csr_kwargs(case.table))
    assert relative_error(wrapper.run(case.q, case.kv_cache), ref) <= TOLERANCE[torch.float16]
