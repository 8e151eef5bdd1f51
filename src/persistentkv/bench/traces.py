"""Seeded, serving-like decode traces, replayed under continuous batching. Pure Python + numpy.

A trace is a list of requests, each with a context already in the KV cache (`context_len` tokens),
a number of decode steps to run (`output_len`) and the step from which it may start
(`arrival_step`). `replay` runs it through `batch_slots` slots, first come first served, and yields
one `Step` per decode step: the rows of the batch, as (request id, seq_len in tokens).

    trace = make_trace("bimodal", batch_slots=32, num_requests=256, seed=0)
    for step in replay(trace):
        seq_lens = [seq_len for _, seq_len in step.rows]     # one decode batch, [len(rows)] tokens
    pool_tokens = peak_tokens(trace)                          # size a page pool from this

Generators (`GENERATORS`, all drawn from `numpy.random.default_rng(seed)`; lengths in tokens,
bounds inclusive). Every generator also takes:
    out_min=32, out_max=256   output lengths (decode steps), uniform integers in [out_min, out_max]
    arrival_rate=None         None: every request arrives at step 0 (a full queue, the batch stays
                              full); a positive float r: a Poisson stream of r requests per step on
                              average, request 0 arriving at step 0 (arrival_step = floor of time)
`bimodal`   contexts short, uniform in [256, 2048], or long, uniform in [16384, 65536];
            long_fraction=0.5 is the probability of a long one.
`uniform`   contexts uniform in [256, 32768].
`zipf`      heavy-tailed contexts in [64, 131072]: a bounded Zipf law, P(context = x) ~ x**-alpha,
            drawn through the inverse CDF of its continuous form and floored; alpha=1.2 (> 0; 1 is
            log-uniform, larger is shorter). At the default the median is ~780, the mean ~9100.
`bucketed`  contexts drawn uniformly from buckets=(2048, 8192, 32768, 131072); meant for one
            request at a time (batch_slots=1), giving latency per context length.
"""
from __future__ import annotations

import csv
import inspect
import json
import math
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

__all__ = ["Request", "Trace", "Step", "GENERATORS", "make_trace", "read_trace", "replay",
           "peak_tokens"]


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(name: str, value: object, *, minimum: int) -> int:
    """`value` as an int >= minimum; TypeError for a non-integer, ValueError below the minimum."""
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


# -- data -----------------------------------------------------------------------------------------
# What one request may ask for: a context of 4M tokens (16 GiB of fp16 KV per layer at 32/8/128),
# 128K decode steps, an arrival 1M steps in. Past these a replay would only run out of memory or
# time (every step of a trace is listed before it is measured).
MAX_CONTEXT_LEN = 1 << 22
MAX_OUTPUT_LEN = 1 << 17
MAX_ARRIVAL_STEP = 1 << 20
_LIMITS = {"context_len": (1, MAX_CONTEXT_LEN), "output_len": (1, MAX_OUTPUT_LEN),
           "arrival_step": (0, MAX_ARRIVAL_STEP)}


@dataclass(frozen=True)
class Request:
    """One request: `context_len` tokens cached when it starts, `output_len` decode steps, and the
    earliest step at which it may take a slot; each within _LIMITS."""

    context_len: int
    output_len: int
    arrival_step: int = 0

    def __post_init__(self):
        for name, (minimum, maximum) in _LIMITS.items():
            value = _check_int(name, getattr(self, name), minimum=minimum)
            if value > maximum:
                raise ValueError(f"{name} must be <= {maximum}, got {value}")
            object.__setattr__(self, name, value)


@dataclass(frozen=True)
class Trace:
    """Requests in arrival (FIFO) order, replayed through `batch_slots` slots.

    `seed` is None for a trace read from a file; `params` holds the generator's parameters, with
    their defaults filled in (for a file: its path and format), for the results file.
    """

    name: str
    batch_slots: int
    requests: tuple[Request, ...]
    seed: int | None
    params: dict = field(default_factory=dict)

    def __post_init__(self):
        batch_slots = _check_int("batch_slots", self.batch_slots, minimum=1)
        object.__setattr__(self, "batch_slots", batch_slots)
        requests = tuple(self.requests)
        for i, request in enumerate(requests):
            if not isinstance(request, Request):
                raise TypeError(f"requests[{i}] must be a Request, got {type(request).__name__}")
        object.__setattr__(self, "requests", requests)


@dataclass(frozen=True)
class Step:
    """One decode step of a replay.

    rows: the batch, (request_id, seq_len) per active request in slot order; request_id indexes
        `trace.requests`, seq_len counts tokens including the one decoded at this step.
    started: request ids that took a slot at this step.  finished: request ids whose last decode
        step this is (their slots are free from the next step).
    slots: the slot index of each row (rows skip empty slots, so a row's position is not its slot).
    """

    index: int
    rows: tuple[tuple[int, int], ...]
    started: tuple[int, ...]
    finished: tuple[int, ...]
    slots: tuple[int, ...] = ()


# -- generators -----------------------------------------------------------------------------------
ZIPF_RANGE = (64, 131072)
BUCKETS = (2048, 8192, 32768, 131072)


def _check_real(gen: str, name: str, value: object, *, low: float, high: float = math.inf,
                low_open: bool = False) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and value <= high
    if not ok:
        bounds = f"{'>' if low_open else '>='} {low}"
        if high != math.inf:
            bounds += f" and <= {high}"
        raise ValueError(f"{gen}: {name} must be a finite number {bounds}, got {value!r}")
    return float(value)


def _lengths_and_arrivals(gen: str, rng: np.random.Generator, contexts: np.ndarray, *,
                          out_min: object, out_max: object,
                          arrival_rate: object) -> tuple[Request, ...]:
    """Draw output lengths, then arrival steps, for `contexts` [n]; build the requests."""
    for name, value in (("out_min", out_min), ("out_max", out_max)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"{gen}: {name} must be a positive int, got {value!r}")
    if out_min > out_max:
        raise ValueError(f"{gen}: out_min must be <= out_max, "
                         f"got out_min={out_min!r}, out_max={out_max!r}")
    if arrival_rate is not None:
        arrival_rate = _check_real(gen, "arrival_rate", arrival_rate, low=0.0, low_open=True)
    n = len(contexts)
    outputs = rng.integers(int(out_min), int(out_max), size=n, endpoint=True)
    if arrival_rate is None:
        arrivals = np.zeros(n, dtype=np.int64)
    else:
        gaps = rng.exponential(1.0 / arrival_rate, size=max(n - 1, 0))
        arrivals = np.floor(np.concatenate([[0.0], np.cumsum(gaps)])).astype(np.int64)
    return tuple(Request(int(c), int(o), int(a)) for c, o, a in zip(contexts, outputs, arrivals))


def bimodal(rng: np.random.Generator, num_requests: int, *, long_fraction: float = 0.5,
            out_min: int = 32, out_max: int = 256,
            arrival_rate: float | None = None) -> tuple[Request, ...]:
    """Short contexts uniform in [256, 2048] and, with probability `long_fraction`, long ones
    uniform in [16384, 65536]."""
    long_fraction = _check_real("bimodal", "long_fraction", long_fraction, low=0.0, high=1.0)
    is_long = rng.random(num_requests) < long_fraction
    short = rng.integers(256, 2048, size=num_requests, endpoint=True)
    long = rng.integers(16384, 65536, size=num_requests, endpoint=True)
    return _lengths_and_arrivals("bimodal", rng, np.where(is_long, long, short), out_min=out_min,
                                 out_max=out_max, arrival_rate=arrival_rate)


def uniform(rng: np.random.Generator, num_requests: int, *, out_min: int = 32, out_max: int = 256,
            arrival_rate: float | None = None) -> tuple[Request, ...]:
    """Contexts uniform in [256, 32768]."""
    contexts = rng.integers(256, 32768, size=num_requests, endpoint=True)
    return _lengths_and_arrivals("uniform", rng, contexts, out_min=out_min, out_max=out_max,
                                 arrival_rate=arrival_rate)


def zipf(rng: np.random.Generator, num_requests: int, *, alpha: float = 1.2, out_min: int = 32,
         out_max: int = 256, arrival_rate: float | None = None) -> tuple[Request, ...]:
    """Contexts in [64, 131072] with P(x) ~ x**-alpha: the continuous density on [64, 131073)
    sampled by inverse CDF, then floored."""
    alpha = _check_real("zipf", "alpha", alpha, low=0.0, low_open=True)
    lo, hi = float(ZIPF_RANGE[0]), float(ZIPF_RANGE[1] + 1)
    u = rng.random(num_requests)
    if abs(alpha - 1.0) < 1e-12:                         # density 1/x: log-uniform
        x = lo * (hi / lo) ** u
    else:
        e = 1.0 - alpha
        x = (lo ** e + u * (hi ** e - lo ** e)) ** (1.0 / e)
    contexts = np.clip(np.floor(x), *ZIPF_RANGE).astype(np.int64)
    return _lengths_and_arrivals("zipf", rng, contexts, out_min=out_min, out_max=out_max,
                                 arrival_rate=arrival_rate)


def bucketed(rng: np.random.Generator, num_requests: int, *, buckets: tuple[int, ...] = BUCKETS,
             out_min: int = 32, out_max: int = 256,
             arrival_rate: float | None = None) -> tuple[Request, ...]:
    """Contexts drawn uniformly from `buckets`; for one request at a time (batch_slots=1)."""
    values = list(buckets) if isinstance(buckets, (list, tuple)) else None
    if not values or not all(_is_int(b) and b >= 1 for b in values):
        raise ValueError("bucketed: buckets must be a non-empty list of positive ints, "
                         f"got {buckets!r}")
    contexts = rng.choice(np.asarray(values, dtype=np.int64), size=num_requests)
    return _lengths_and_arrivals("bucketed", rng, contexts, out_min=out_min, out_max=out_max,
                                 arrival_rate=arrival_rate)


GENERATORS: dict[str, Callable[..., tuple[Request, ...]]] = {
    "bimodal": bimodal, "uniform": uniform, "zipf": zipf, "bucketed": bucketed,
}


def make_trace(name: str, *, batch_slots: int, num_requests: int, seed: int, **params) -> Trace:
    """A generated trace: `num_requests` requests from generator `name`, drawn with
    numpy.random.default_rng(seed); same arguments, same trace. `params` go to the generator."""
    if name not in GENERATORS:
        raise ValueError(f"unknown trace generator {name!r}; known: {sorted(GENERATORS)}")
    batch_slots = _check_int("batch_slots", batch_slots, minimum=1)
    num_requests = _check_int("num_requests", num_requests, minimum=1)
    seed = _check_int("seed", seed, minimum=0)
    gen = GENERATORS[name]
    defaults = {p.name: p.default for p in inspect.signature(gen).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    for key, value in params.items():
        if key not in defaults:
            raise ValueError(f"{name}: unknown parameter {key}={value!r}; "
                             f"known: {sorted(defaults)}")
    resolved = {**defaults, **params}
    requests = gen(np.random.default_rng(seed), num_requests, **resolved)
    if isinstance(resolved.get("buckets"), tuple):
        resolved["buckets"] = list(resolved["buckets"])   # as it reads back from JSON
    return Trace(name=name, batch_slots=batch_slots, requests=requests, seed=seed, params=resolved)


# -- files ----------------------------------------------------------------------------------------
_FIELDS = (("context_len", True), ("output_len", True), ("arrival_step", False))


def _request_from(record: dict, where: str) -> Request:
    """A Request from one parsed line (JSON values or CSV strings); ValueError naming `where`."""
    values = {}
    for key, required in _FIELDS:
        minimum, maximum = _LIMITS[key]
        raw = record.get(key)
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            if required:
                raise ValueError(f"{where}: missing {key}")
            values[key] = 0
            continue
        value = None
        if isinstance(raw, str):
            try:
                value = int(raw.strip())
            except ValueError:
                pass
        elif _is_int(raw):
            value = int(raw)
        if value is None or value < minimum:
            kind = "a positive integer" if minimum == 1 else "a non-negative integer"
            raise ValueError(f"{where}: {key} must be {kind}, got {raw!r}")
        if value > maximum:
            raise ValueError(f"{where}: {key} must be <= {maximum}, got {raw!r}")
        values[key] = value
    return Request(**values)


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of a UTF-8 file; a byte that is no UTF-8 is a ValueError naming the
    line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                yield lineno, raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path.name} line {lineno}: not UTF-8 text (byte "
                                 f"{raw[e.start]:#04x} at column {e.start + 1})") from None


def _read_jsonl(path: Path) -> list[Request]:
    requests = []
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        where = f"{path.name} line {lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {line.strip()[:40]!r}")
        requests.append(_request_from(record, where))
    return requests


def _read_csv(path: Path) -> list[Request]:
    requests = []
    reader = csv.reader(text for _, text in _lines(path))
    header = None
    while True:
        try:
            row = next(reader, None)
        except csv.Error as e:
            raise ValueError(f"{path.name} line {reader.line_num}: not CSV ({e})") from None
        if row is None:
            break
        if not any(cell.strip() for cell in row):
            continue
        where = f"{path.name} line {reader.line_num}"
        if header is None:
            header = [cell.strip() for cell in row]
            for key, required in _FIELDS:
                if required and key not in header:
                    raise ValueError(f"{where}: header lacks column {key!r}, got {header}")
            continue
        requests.append(_request_from(dict(zip(header, row)), where))
    return requests


def read_trace(path: str | os.PathLike, *, batch_slots: int, name: str | None = None) -> Trace:
    """A trace from a file, one request per line, in order: JSONL (.jsonl, .json; objects with
    context_len, output_len and optional arrival_step) or CSV (.csv; a header naming those columns,
    others ignored). Blank lines are skipped; an empty arrival_step is 0. `name` defaults to the
    file's stem. Any bad line raises ValueError with the file name and line number."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"trace file {str(path)!r} is a directory")
    if not path.is_file():
        raise FileNotFoundError(f"no such trace file: {str(path)!r}")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        fmt, reader = "jsonl", _read_jsonl
    elif suffix == ".csv":
        fmt, reader = "csv", _read_csv
    else:
        raise ValueError(f"{path.name}: unknown trace format {path.suffix!r}; "
                         "use .jsonl or .json (JSON lines) or .csv")
    batch_slots = _check_int("batch_slots", batch_slots, minimum=1)
    requests = reader(path)
    if not requests:
        raise ValueError(f"{path.name}: no requests in the file")
    return Trace(name=path.stem if name is None else name, batch_slots=batch_slots,
                 requests=tuple(requests), seed=None, params={"path": str(path), "format": fmt})


# -- replay ---------------------------------------------------------------------------------------
def replay(trace: Trace, *, max_steps: int | None = None) -> Iterator[Step]:
    """The decode steps of `trace` under continuous batching with `trace.batch_slots` slots.

    At the start of each step, each free slot (lowest index first) takes the next request in trace
    order if it has arrived (arrival_step <= step); a request that has not arrived holds back those
    behind it (FIFO). Every active request then decodes one token: at its k-th step (k from 0) its
    seq_len is context_len + k + 1. After output_len steps it leaves; its slot is free at the next
    step. A step with no active request while requests are pending yields empty rows. Ends when
    every request is done, or after `max_steps` steps.
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"trace must be a Trace, got {type(trace).__name__}")
    if max_steps is not None:
        max_steps = _check_int("max_steps", max_steps, minimum=0)
    requests = trace.requests
    slots: list[list[int] | None] = [None] * trace.batch_slots     # [request_id, k] per slot
    next_id, active, step = 0, 0, 0
    while next_id < len(requests) or active:
        if max_steps is not None and step >= max_steps:
            return
        started = []
        for s in range(len(slots)):
            if (slots[s] is None and next_id < len(requests)
                    and requests[next_id].arrival_step <= step):
                slots[s] = [next_id, 0]
                started.append(next_id)
                next_id += 1
                active += 1
        rows, slot_ids, finished = [], [], []
        for s, entry in enumerate(slots):
            if entry is None:
                continue
            rid, k = entry
            rows.append((rid, requests[rid].context_len + k + 1))
            slot_ids.append(s)
            if k + 1 == requests[rid].output_len:
                finished.append(rid)
                slots[s] = None
                active -= 1
            else:
                entry[1] = k + 1
        yield Step(index=step, rows=tuple(rows), started=tuple(started), finished=tuple(finished),
                   slots=tuple(slot_ids))
        step += 1


def peak_tokens(trace: Trace, *, max_steps: int | None = None) -> int:
    """The most tokens in the KV cache at any step of `replay(trace)`: max over steps of the sum of
    seq_len (0 for no steps). A pool of page_size-token pages needs at most
    ceil(peak_tokens / page_size) + batch_slots pages (one partly filled page per row)."""
    return max((sum(seq_len for _, seq_len in step.rows)
                for step in replay(trace, max_steps=max_steps)), default=0)
