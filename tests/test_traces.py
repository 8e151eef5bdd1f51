"""Benchmark traces: seeded generators, continuous-batching replay, trace files. Pure CPU."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persistentkv.bench.traces import (GENERATORS, Request, Step, Trace, make_trace, peak_tokens,
                                       read_trace, replay)


def contexts(trace):
    return np.array([r.context_len for r in trace.requests])


def hand_trace(requests, batch_slots):
    return Trace(name="hand", batch_slots=batch_slots,
                 requests=tuple(Request(*r) for r in requests), seed=None, params={})


# -- generators -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_same_seed_same_trace_other_seed_other(name):
    a = make_trace(name, batch_slots=4, num_requests=64, seed=7)
    b = make_trace(name, batch_slots=4, num_requests=64, seed=7)
    c = make_trace(name, batch_slots=4, num_requests=64, seed=8)
    assert a == b
    assert a.requests != c.requests
    assert a.name == name and a.seed == 7 and len(a.requests) == 64
    assert {"out_min", "out_max", "arrival_rate"} <= set(a.params)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_output_lengths_and_default_arrivals(name):
    t = make_trace(name, batch_slots=4, num_requests=500, seed=1, out_min=5, out_max=9)
    outs = {r.output_len for r in t.requests}
    assert outs == set(range(5, 10))
    assert all(r.arrival_step == 0 for r in t.requests)
    assert all(isinstance(r.context_len, int) and r.context_len >= 1 for r in t.requests)


def test_bimodal_both_modes_and_fraction():
    c = contexts(make_trace("bimodal", batch_slots=8, num_requests=2000, seed=0))
    short, long = (c >= 256) & (c <= 2048), (c >= 16384) & (c <= 65536)
    assert (short | long).all() and short.any() and long.any()
    assert 0.4 < long.mean() < 0.6
    c = contexts(make_trace("bimodal", batch_slots=8, num_requests=2000, seed=0, long_fraction=0.1))
    assert 0.05 < (c >= 16384).mean() < 0.15
    c = contexts(make_trace("bimodal", batch_slots=8, num_requests=200, seed=0, long_fraction=0.0))
    assert c.max() <= 2048


def test_uniform_range():
    c = contexts(make_trace("uniform", batch_slots=8, num_requests=2000, seed=0))
    assert c.min() >= 256 and c.max() <= 32768
    assert c.min() < 2000 and c.max() > 30000


def test_zipf_bounded_and_heavy_tailed():
    c = contexts(make_trace("zipf", batch_slots=8, num_requests=5000, seed=0))
    assert c.min() >= 64 and c.max() <= 131072
    assert np.median(c) * 4 < c.mean()                  # heavy tail: median well below mean
    assert c.max() > 65536 and (c < 1024).mean() > 0.4
    steeper = contexts(make_trace("zipf", batch_slots=8, num_requests=5000, seed=0, alpha=2.0))
    assert np.median(steeper) < np.median(c)
    flat = contexts(make_trace("zipf", batch_slots=8, num_requests=5000, seed=0, alpha=1))
    assert flat.min() >= 64 and flat.max() <= 131072


def test_bucketed_values_only_from_buckets():
    c = contexts(make_trace("bucketed", batch_slots=1, num_requests=400, seed=0))
    assert set(c.tolist()) == {2048, 8192, 32768, 131072}
    c = contexts(make_trace("bucketed", batch_slots=1, num_requests=50, seed=0, buckets=[100, 300]))
    assert set(c.tolist()) == {100, 300}


def test_arrival_rate_spreads_arrivals():
    t = make_trace("uniform", batch_slots=4, num_requests=200, seed=0, arrival_rate=0.5)
    arrivals = [r.arrival_step for r in t.requests]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
    assert 300 < arrivals[-1] < 500                      # ~199 gaps of mean 2 steps


@pytest.mark.parametrize("kwargs, match", [
    ({"long_fraction": 1.5}, "long_fraction.*1.5"),
    ({"out_min": 0}, "out_min.*0"),
    ({"out_min": 10, "out_max": 5}, "out_min"),
    ({"out_max": 2.5}, "out_max.*2.5"),
    ({"arrival_rate": -1}, "arrival_rate.*-1"),
    ({"bogus": 3}, "bogus=3"),
    ({"alpha": 1.2}, "alpha=1.2"),                       # a zipf parameter, unknown to bimodal
])
def test_bad_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_trace("bimodal", batch_slots=2, num_requests=4, seed=0, **kwargs)


def test_bad_generator_arguments():
    with pytest.raises(ValueError, match="'nope'"):
        make_trace("nope", batch_slots=2, num_requests=4, seed=0)
    with pytest.raises(ValueError, match="alpha.*-1"):
        make_trace("zipf", batch_slots=2, num_requests=4, seed=0, alpha=-1)
    with pytest.raises(ValueError, match="buckets"):
        make_trace("bucketed", batch_slots=1, num_requests=4, seed=0, buckets=[])
    with pytest.raises(ValueError, match="batch_slots"):
        make_trace("uniform", batch_slots=0, num_requests=4, seed=0)
    with pytest.raises(ValueError, match="num_requests"):
        make_trace("uniform", batch_slots=1, num_requests=-3, seed=0)
    with pytest.raises(TypeError, match="batch_slots"):
        make_trace("uniform", batch_slots=2.0, num_requests=4, seed=0)
    with pytest.raises(TypeError, match="num_requests"):
        make_trace("uniform", batch_slots=2, num_requests=True, seed=0)
    with pytest.raises(ValueError, match="context_len"):
        Request(0, 5)


# -- replay ---------------------------------------------------------------------------------------
def test_replay_hand_trace():
    # 2 slots; request 2 arrives at step 1, request 3 only at step 6 (a gap after the others end).
    t = hand_trace([(10, 3), (100, 1), (20, 2, 1), (5, 1, 6)], batch_slots=2)
    steps = list(replay(t))
    assert [s.index for s in steps] == list(range(7))
    assert steps[0] == Step(0, ((0, 11), (1, 101)), (0, 1), (1,), (0, 1))
    assert steps[1] == Step(1, ((0, 12), (2, 21)), (2,), (), (0, 1))    # slot 1 reused at next step
    assert steps[2] == Step(2, ((0, 13), (2, 22)), (), (0, 2), (0, 1))
    for i in (3, 4, 5):                                  # nothing active, request 3 pending
        assert steps[i] == Step(i, (), (), (), ())
    assert steps[6] == Step(6, ((3, 6),), (3,), (3,), (0,))


def test_replay_fifo_does_not_skip_a_late_request():
    # Request 1 arrives at step 2; request 2 (arrived at 0) waits behind it though a slot is free.
    t = hand_trace([(1, 5), (1, 1, 2), (1, 1, 0)], batch_slots=3)
    steps = list(replay(t))
    assert [s.started for s in steps[:3]] == [(0,), (), (1, 2)]
    assert steps[2].rows == ((0, 4), (1, 2), (2, 2)) and steps[2].slots == (0, 1, 2)


def test_replay_slot_keeps_its_position():
    t = hand_trace([(1, 1), (1, 3), (1, 1)], batch_slots=2)
    steps = list(replay(t))
    assert [s.slots for s in steps] == [(0, 1), (0, 1), (1,)]
    assert [[rid for rid, _ in s.rows] for s in steps] == [[0, 1], [2, 1], [1]]


def test_replay_max_steps_and_errors():
    t = hand_trace([(10, 50), (10, 50)], batch_slots=1)
    assert [s.index for s in replay(t, max_steps=3)] == [0, 1, 2]
    assert list(replay(t, max_steps=0)) == []
    assert len(list(replay(t))) == 100
    with pytest.raises(ValueError, match="max_steps"):
        list(replay(t, max_steps=-1))
    with pytest.raises(TypeError, match="Trace"):
        list(replay([Request(1, 1)]))


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_total_decode_steps_equal_output_lens(name):
    t = make_trace(name, batch_slots=5, num_requests=40, seed=3, out_min=1, out_max=20,
                   arrival_rate=0.3)
    assert sum(len(s.rows) for s in replay(t)) == sum(r.output_len for r in t.requests)


def test_peak_tokens_is_max_over_replay():
    t = make_trace("bimodal", batch_slots=6, num_requests=30, seed=2, out_min=1, out_max=40,
                   arrival_rate=0.2)
    assert peak_tokens(t) == max(sum(n for _, n in s.rows) for s in replay(t))
    assert peak_tokens(t, max_steps=1) == sum(n for _, n in next(replay(t)).rows)
    assert peak_tokens(t, max_steps=0) == 0
    assert peak_tokens(hand_trace([(10, 3), (100, 1)], batch_slots=2)) == 112


requests_st = st.lists(st.tuples(st.integers(1, 50), st.integers(1, 6), st.integers(0, 12)),
                       min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(requests=requests_st, batch_slots=st.integers(1, 4))
def test_replay_properties(requests, batch_slots):
    t = hand_trace(requests, batch_slots)
    seen = {}                                            # request id -> [(step, seq_len, slot)]
    num_started = 0
    for i, s in enumerate(replay(t)):
        assert s.index == i and len(s.rows) <= batch_slots
        assert len(s.slots) == len(s.rows) and list(s.slots) == sorted(set(s.slots))
        num_started += len(s.started)
        if len(s.rows) < batch_slots and num_started < len(requests):
            assert t.requests[num_started].arrival_step > i        # free slot only while waiting
        for (rid, seq_len), slot in zip(s.rows, s.slots):
            seen.setdefault(rid, []).append((i, seq_len, slot))
    assert num_started == len(requests)
    first_steps = [seen[rid][0][0] for rid in range(len(requests))]
    assert first_steps == sorted(first_steps)                       # FIFO
    for rid, r in enumerate(t.requests):
        steps, seq_lens, slots = zip(*seen[rid])
        assert len(steps) == r.output_len and steps[0] >= r.arrival_step
        assert list(steps) == list(range(steps[0], steps[0] + r.output_len))
        assert list(seq_lens) == list(range(r.context_len + 1, r.context_len + r.output_len + 1))
        assert len(set(slots)) == 1


# -- files ----------------------------------------------------------------------------------------
def test_read_trace_round_trip_jsonl_and_csv(tmp_path):
    t = make_trace("zipf", batch_slots=4, num_requests=30, seed=5, arrival_rate=0.7)
    jsonl = tmp_path / "mix.jsonl"
    lines = [json.dumps({"context_len": r.context_len, "output_len": r.output_len,
                         "arrival_step": r.arrival_step}) for r in t.requests]
    jsonl.write_text("\n".join(lines[:10]) + "\n\n" + "\n".join(lines[10:]) + "\n")
    got = read_trace(jsonl, batch_slots=4)
    assert got.requests == t.requests and got.name == "mix" and got.batch_slots == 4
    assert got.seed is None and got.params["format"] == "jsonl"

    csv_path = tmp_path / "mix.csv"
    rows = ["id,arrival_step,output_len,context_len,note"]
    rows += [f"{i},{r.arrival_step},{r.output_len},{r.context_len},x" for i, r in enumerate(t.requests)]
    csv_path.write_text("\n".join(rows) + "\n\n")
    got = read_trace(str(csv_path), batch_slots=2, name="other")
    assert got.requests == t.requests and got.name == "other" and got.params["format"] == "csv"


def test_read_trace_optional_arrival_step(tmp_path):
    p = tmp_path / "t.json"
    p.write_text('{"context_len": 5, "output_len": 2}\n{"context_len": 7, "output_len": 1, "arrival_step": 3}\n')
    assert read_trace(p, batch_slots=1).requests == (Request(5, 2, 0), Request(7, 1, 3))
    p = tmp_path / "t.csv"
    p.write_text("context_len,output_len\n5,2\n")
    assert read_trace(p, batch_slots=1).requests == (Request(5, 2, 0),)


@pytest.mark.parametrize("text, match", [
    ("context_len,output_len\n5,2\n\n7\n", "t.csv line 4: missing output_len"),
    ("context_len,output_len\n5,2\n-3,4\n", "t.csv line 3: context_len must be a positive integer, got '-3'"),
    ("context_len,output_len\n5,2\n6,1\nabc,4\n", "t.csv line 4: context_len must be a positive integer, got 'abc'"),
    ("context_len,output_len\n5,0\n", "t.csv line 2: output_len must be a positive integer, got '0'"),
    ("context_len,output_len,arrival_step\n5,1,-1\n", "t.csv line 2: arrival_step must be a non-negative"),
    ("context_len,output_len\n5.5,1\n", r"t.csv line 2: context_len .* got '5.5'"),
    ("context_len,steps\n5,1\n", "t.csv line 1: header lacks column 'output_len'"),
    ("", "t.csv: no requests"),
    ("context_len,output_len\n\n", "t.csv: no requests"),
])
def test_read_trace_csv_errors(tmp_path, text, match):
    p = tmp_path / "t.csv"
    p.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_trace(p, batch_slots=1)


@pytest.mark.parametrize("line, match", [
    ('{"output_len": 2}', "t.jsonl line 3: missing context_len"),
    ('{"context_len": -4, "output_len": 2}', "t.jsonl line 3: context_len must be a positive integer, got -4"),
    ('{"context_len": "abc", "output_len": 2}', "t.jsonl line 3: context_len .* got 'abc'"),
    ('{"context_len": 4, "output_len": 2.5}', "t.jsonl line 3: output_len .* got 2.5"),
    ('{"context_len": true, "output_len": 2}', "t.jsonl line 3: context_len .* got True"),
    ('{"context_len": 4, "output_len": 2', "t.jsonl line 3: not valid JSON"),
    ('[4, 2]', "t.jsonl line 3: expected a JSON object"),
    ('{"context_len": 1000000000000, "output_len": 2}',
     "t.jsonl line 3: context_len must be <= 4194304, got 1000000000000"),
    ('{"context_len": 5, "output_len": 100000000}', "t.jsonl line 3: output_len must be <= 131072"),
    ('{"context_len": 5, "output_len": 2, "arrival_step": 1e12}', "t.jsonl line 3: arrival_step"),
    ('{"context_len": 5, "output_len": 2, "arrival_step": 1000000000000}',
     "t.jsonl line 3: arrival_step must be <= 1048576"),
])
def test_read_trace_jsonl_errors(tmp_path, line, match):
    p = tmp_path / "t.jsonl"
    p.write_text('{"context_len": 5, "output_len": 2}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=match):
        read_trace(p, batch_slots=1)


def test_read_trace_bad_extension_and_empty(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("context_len,output_len\n5,2\n")
    with pytest.raises(ValueError, match=r"t.txt: unknown trace format '.txt'"):
        read_trace(p, batch_slots=1)
    p = tmp_path / "e.jsonl"
    p.write_text("\n  \n")
    with pytest.raises(ValueError, match="e.jsonl: no requests"):
        read_trace(p, batch_slots=1)


def test_read_trace_file_errors(tmp_path):
    """A byte that is no UTF-8 names its line; a directory or a missing file is named."""
    p = tmp_path / "t.csv"
    p.write_bytes(b"context_len,output_len\n5,2\n\xff\xfe,2\n")
    with pytest.raises(ValueError, match=r"t.csv line 3: not UTF-8 text \(byte 0xff at column 1\)"):
        read_trace(p, batch_slots=1)
    (tmp_path / "d.jsonl").mkdir()
    with pytest.raises(ValueError, match="d.jsonl' is a directory"):
        read_trace(tmp_path / "d.jsonl", batch_slots=1)
    with pytest.raises(FileNotFoundError, match="no such trace file"):
        read_trace(tmp_path / "none.csv", batch_slots=1)
    with pytest.raises(ValueError, match="output_len must be <= 131072, got 200000"):
        Request(context_len=5, output_len=200000)
