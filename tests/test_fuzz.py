"""A fuzz test of the public API (hypothesis): plan(), run(), graph-mode plan(), PagedKVCache,
read_trace and the command line's argument parsing, each given one argument drawn from valid
and invalid values. Every call ends one of two ways: a result that matches the float64
reference, or a ValueError or TypeError that names the argument, with a poisoned `out`
unchanged and the wrapper's previous plan still running as before."""
import math
import re

import numpy as np
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from paged_case import DEVICE, ON_GPU, csr_kwargs, make_case
from persistentkv import TOLERANCE, DecodeWrapper, PagedKVCache, reference_decode, relative_error
from persistentkv.bench.traces import read_trace
from persistentkv.tuning import KernelConfig

HEADS = dict(num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4)
# Examples that run kernels through the interpreter take about a second each: no shrinking, so a
# failure reports its first example within the suite's time rather than after minutes of search.
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)
NAN = float("nan")


def _meta(t):
    return t.to("meta")


def _strided(t):
    """t's values in every second element of a larger tensor (a non-contiguous view)."""
    big = torch.zeros(t.numel() * 2, dtype=t.dtype, device=t.device)
    big[::2] = t.reshape(-1)
    return big[::2]


# (argument, value or a function of the valid value, whether it is a valid alternative)
PLAN_VALUES = [
    ("num_qo_heads", 0, False), ("num_qo_heads", -4, False), ("num_qo_heads", 4.0, False),
    ("num_qo_heads", True, False), ("num_qo_heads", "4", False), ("num_qo_heads", None, False),
    ("num_qo_heads", 5, False), ("num_qo_heads", np.int64(4), True),
    ("num_kv_heads", 0, False), ("num_kv_heads", 3, False), ("num_kv_heads", 2.0, False),
    ("head_dim", 0, False), ("head_dim", 24, False), ("head_dim", 1024, False),
    ("head_dim", 16.0, False),
    ("page_size", 0, False), ("page_size", -4, False), ("page_size", 4.5, False),
    ("backend", "fast", False), ("backend", None, False), ("backend", 3, False),
    ("backend", "balanced", True), ("backend", "grouped", True),
    ("split_pages", 0, False), ("split_pages", -1, False), ("split_pages", 1.5, False),
    ("split_pages", True, False), ("split_pages", 1, True), ("split_pages", np.int64(2), True),
    ("sm_scale", 0.0, False), ("sm_scale", -1.0, False), ("sm_scale", NAN, False),
    ("sm_scale", math.inf, False), ("sm_scale", True, False), ("sm_scale", "0.1", False),
    ("sm_scale", np.float32(0.2), True), ("sm_scale", 0.3, True),
    ("deterministic", "yes", False), ("deterministic", 1, False), ("deterministic", True, True),
    ("check_page_table", "no", False), ("check_page_table", True, True),
    ("config", 123, False), ("config", "fast", False),
    ("config", KernelConfig(block_n=16, num_stages=2), True),
    ("kv_indptr", lambda t: t.long(), False), ("kv_indptr", lambda t: t[:-1], False),
    ("kv_indptr", lambda t: t[None], False), ("kv_indptr", _meta, False),
    ("kv_indices", lambda t: t.long(), False), ("kv_indices", _strided, False),
    ("kv_indices", _meta, False), ("kv_indices", lambda t: t.reshape(1, -1), False),
    ("kv_last_page_len", lambda t: t.long(), False), ("kv_last_page_len", lambda t: t[:-1], False),
    ("kv_last_page_len", lambda t: t.cpu(), True),
]
RUN_VALUES = [
    ("q", lambda t: t.float(), False), ("q", lambda t: t[:, :2], False),
    ("q", lambda t: t[..., :8], False),
    ("q", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), False),   # strided head_dim
    ("q", lambda t: t.transpose(0, 1).contiguous().transpose(0, 1), True),    # strided rows
    ("q", lambda t: t[0], False), ("q", _meta, False), ("q", lambda t: t.cpu().numpy(), False),
    ("kv_cache", lambda t: t.float(), False), ("kv_cache", lambda t: t[:, 0], False),
    ("kv_cache", lambda t: (t[:, 0],), False), ("kv_cache", lambda t: t.cpu().numpy(), False),
    ("kv_cache", lambda t: (t[:, 0].contiguous(), t[:, 1].contiguous()), True),
    ("out", lambda t: torch.full_like(t[:, :2], NAN), False),
    ("out", lambda t: torch.full_like(t, NAN, dtype=torch.float32), False),
    ("out", lambda t: torch.full_like(t[:, :1], NAN).expand_as(t), False),   # heads overlap
    ("out", lambda t: "out", False), ("out", lambda t: torch.full_like(t, NAN), True),
    ("return_lse", "no", False), ("return_lse", 1, False), ("return_lse", True, True),
]


def _names(exc: Exception, argument: str) -> bool:
    """The error message names the argument (or, for a page-table tensor, the table it is part of)."""
    text = str(exc)
    return argument in text or (argument.startswith("kv_") and "page table" in text)


@st.composite
def problems(draw):
    # at least two pages, so that a strided kv_indices is not one entry
    lens = st.lists(st.integers(0, 40), min_size=1, max_size=3).filter(
        lambda lens: sum(-(-n // HEADS["page_size"]) for n in lens) >= 2)
    return dict(lens=draw(lens, label="lens"),
                layout=draw(st.sampled_from(["NHD", "HND"]), label="layout"),
                seed=draw(st.integers(0, 2**16), label="seed"))


def _setup(p):
    case = make_case(seq_lens=p["lens"], **HEADS, layout=p["layout"], seed=p["seed"])
    wrapper = DecodeWrapper(p["layout"])
    table = csr_kwargs(case.table)
    wrapper.plan(**table, **HEADS, backend="split", split_pages=1)
    before = wrapper.run(case.q, case.kv_cache)
    return case, wrapper, table, before


def _check(case, out, sm_scale=None):
    ref, _ = reference_decode(case.q, case.kv_cache, layout=case.layout, sm_scale=sm_scale,
                              **csr_kwargs(case.table))
    active = torch.as_tensor(case.table.seq_lens > 0, device=out.device)
    if active.any():
        err = relative_error(out[active], ref[active])
        assert err <= TOLERANCE[out.dtype], err


def _same(case, out, before) -> bool:
    """Bitwise equal on the active rows (an inactive row's output is left as it was)."""
    active = torch.as_tensor(case.table.seq_lens > 0, device=out.device)
    return torch.equal(out[active], before[active])


def _still_runs(case, wrapper, before):
    """The wrapper's current plan gives what it gave before the failed call, bitwise."""
    assert _same(case, wrapper.run(case.q, case.kv_cache), before)


@settings(max_examples=6 if ON_GPU else 12, deadline=None, phases=NO_SHRINK)
@given(p=problems(), which=st.sampled_from(PLAN_VALUES))
def test_plan_arguments(p, which):
    name, value, valid = which
    case, wrapper, table, before = _setup(p)
    kwargs = {**table, **HEADS, "backend": "split", "split_pages": None}
    if callable(value):
        value = value(kwargs[name])
    kwargs[name] = value
    if name == "backend" and value in ("balanced", "grouped"):
        kwargs["split_pages"] = None
    try:
        plan = wrapper.plan(**kwargs)
    except (ValueError, TypeError) as exc:
        assert not valid, f"{name}={value!r} is valid: {exc}"
        assert _names(exc, name), f"{name}={value!r}: {exc}"
        _still_runs(case, wrapper, before)
        return
    assert valid, f"{name}={value!r} was taken"
    _check(case, wrapper.run(case.q, case.kv_cache), sm_scale=plan.sm_scale)


@settings(max_examples=6 if ON_GPU else 10, deadline=None, phases=NO_SHRINK)
@given(p=problems(), which=st.sampled_from(RUN_VALUES))
def test_run_arguments(p, which):
    name, value, valid = which
    case, wrapper, _, before = _setup(p)
    args = dict(q=case.q, kv_cache=case.kv_cache, out=None, return_lse=False)
    base = case.q if name == "out" else args[name]
    args[name] = value(base) if callable(value) else value
    poisoned = args["out"] if isinstance(args["out"], torch.Tensor) else None
    try:
        result = wrapper.run(args["q"], args["kv_cache"], out=args["out"],
                             return_lse=args["return_lse"])
    except (ValueError, TypeError) as exc:
        assert not valid, f"{name} is valid: {exc}"
        assert _names(exc, name), f"{name}: {exc}"
        if poisoned is not None and poisoned.dtype.is_floating_point:
            assert torch.isnan(poisoned.float()).all()
        _still_runs(case, wrapper, before)
        return
    assert valid, f"{name}={args[name]!r} was taken"
    out = result[0] if args["return_lse"] else result
    _check(case, out)
    assert _same(case, out, before)


@settings(max_examples=4 if ON_GPU else 15, deadline=None, phases=NO_SHRINK)
@given(p=problems(), which=st.sampled_from([
    ("max_batch_size", 0), ("max_batch_size", 2.5), ("max_batch_size", True),
    ("max_num_pages", 0), ("max_num_pages", "64"), ("max_batch_size", 1), ("max_num_pages", 1)]))
def test_graph_mode_arguments(p, which):
    """Graph mode's sizes: a bad one is named at construction; a table over them at plan()."""
    name, value = which
    case = make_case(seq_lens=p["lens"], **HEADS, layout=p["layout"], seed=p["seed"])
    sizes = dict(max_batch_size=len(p["lens"]), max_num_pages=64)
    sizes[name] = value
    try:
        wrapper = DecodeWrapper(p["layout"], use_cuda_graph=True, **sizes)
        wrapper.plan(**csr_kwargs(case.table), **HEADS)
    except (ValueError, TypeError) as exc:
        assert _names(exc, name) or re.search("max_batch_size|max_num_pages", str(exc)), exc
        return
    assert (sizes["max_batch_size"] == len(p["lens"])
            and sum(len(r) for r in case.table.row_pages) <= sizes["max_num_pages"])
    _check(case, wrapper.run(case.q, case.kv_cache))


@settings(max_examples=30, deadline=None)
@given(which=st.sampled_from([
    ("num_layers", 0), ("num_layers", "2"), ("num_layers", 1.0), ("num_pages", 0),
    ("num_pages", -3), ("page_size", 0), ("page_size", 2.5), ("num_kv_heads", None),
    ("head_dim", 0), ("dtype", torch.float32), ("dtype", "float16"), ("layout", "XYZ"),
    ("init", "ones"), ("num_pages", np.int64(8)), ("page_size", np.int32(4))]),
    tokens=st.integers(-2, 40) | st.sampled_from([np.int64(3), 2.0, True, "3"]))
def test_paged_kv_cache_arguments(which, tokens):
    """PagedKVCache and append_tokens: an error names the argument and changes nothing."""
    name, value = which
    kwargs = dict(num_layers=1, num_pages=8, page_size=4, num_kv_heads=2, head_dim=16,
                  device=DEVICE)
    kwargs[name] = value
    try:
        cache = PagedKVCache(**kwargs)
    except (ValueError, TypeError) as exc:
        assert _names(exc, name), exc
        return
    cache.add_sequence("s")
    free = cache.allocator.num_free_pages
    try:
        cache.append_tokens("s", tokens)
    except (ValueError, TypeError) as exc:
        assert "num_tokens" in str(exc)
        assert cache.seq_len("s") == 0 and cache.allocator.num_free_pages == free
        return
    except Exception as exc:   # the pool ran out: named, and nothing changed
        assert type(exc).__name__ == "OutOfPagesError" and cache.seq_len("s") == 0
        return
    assert cache.seq_len("s") == int(tokens)


@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=80) | st.text(max_size=80).map(str.encode),
       suffix=st.sampled_from([".csv", ".jsonl"]))
def test_read_trace_on_arbitrary_bytes(tmp_path_factory, data, suffix):
    """Any file: a trace, or a ValueError naming the file."""
    path = tmp_path_factory.mktemp("t") / f"t{suffix}"
    path.write_bytes(data)
    try:
        trace = read_trace(path, batch_slots=2)
    except ValueError as exc:
        assert str(exc).startswith(path.name), exc
        return
    assert trace.requests


@settings(max_examples=60, deadline=None)
@given(argv=st.lists(st.sampled_from([
    "bench", "evaluate", "calibrate", "sweep", "--grid", "--preset", "llama3-8b", "llama5",
    "llama3-8b,gpt-oss", "--num-kv-heads", "--head-dim", "--page-size", "--dtype", "fp8",
    "bf16", "0", "3", "100", "-1", "x", "--layers", "--cells", "B1 L1K", "--backends",
    "pkv-split", "pkv-nope"]), max_size=6))
def test_command_line_parsing(argv):
    """Parsing and the shape options: an argparse exit (code 2) or a ValueError naming the
    option, never another exception."""
    from persistentkv.cli import build_parser, model_shapes

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        assert exc.code == 2
        return
    if not hasattr(args, "preset"):
        return
    try:
        model_shapes(args)
    except (ValueError, TypeError) as exc:
        assert re.search(r"preset|num_qo_heads|num_kv_heads|head_dim|page_size", str(exc)), exc
