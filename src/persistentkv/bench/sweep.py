"""`persistentkv sweep`: device time of kernel configurations on static batches, to fill tuning.py."""
from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from pathlib import Path

import torch

from ..tuning import KernelConfig
from ..wrapper import BACKENDS
from .backends import PersistentKV
from .measure import graph_time_per_layer, kv_bytes_per_layer, reference_output
from .results import environment, results_json
from .runner import (L2_ROTATION_BYTES, MAX_ROTATION_LAYERS, ModelShape, RunOptions,
                     layers_that_fit, make_cache, step_inputs)
from ..reference import TOLERANCE, relative_error

SWEEP_CELLS = {"B1 L1K": [1024], "B1 L8K": [8192], "B1 L32K": [32768], "B4 L1K": [1024] * 4,
               "B8 L1K": [1024] * 8, "B8 L8K": [8192] * 8, "B32 L8K": [8192] * 32,
               "B128 L1K": [1024] * 128, "B8 zipf": [259, 2040, 917, 24851, 2345, 270, 264, 372],
               "B128 L8K": [8192] * 128, "B32 L32K": [32768] * 32, "B8 L128K": [131072] * 8}


def config_grid(spec: dict[str, list]) -> list[tuple[str, KernelConfig]]:
    """(backend, config) pairs from lists of values per KernelConfig field plus 'backend' (our
    wrapper backends; default: "split", the split rule)."""
    if not isinstance(spec, dict):
        raise ValueError(f"spec must be a JSON object of lists, got {spec!r}")
    fields = {f.name for f in dataclasses.fields(KernelConfig)}
    for key, values in spec.items():
        if key != "backend" and key not in fields:
            raise ValueError(f"spec key {key!r} is no KernelConfig field (fields: "
                             f"{sorted(fields)}) nor 'backend'")
        if not isinstance(values, list) or not values:
            raise ValueError(f"spec[{key!r}] must be a non-empty list, got {values!r}")
    spec = dict(spec)
    backends = spec.pop("backend", ["split"])
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ValueError(f"spec['backend'] must list backends of {BACKENDS}, got {unknown}")
    keys = list(spec)
    out = []
    for values in itertools.product(*(spec[k] for k in keys)):
        try:
            cfg = KernelConfig(**dict(zip(keys, values)))
        except (TypeError, ValueError) as err:
            raise ValueError(f"spec gives a KernelConfig it refuses, {dict(zip(keys, values))}: "
                             f"{err}") from None
        out.extend((b, cfg) for b in backends)
    return out


def run_sweep(*, device: torch.device, cells: list[str], spec: dict[str, list], shape: ModelShape,
              out_path: Path, reps: int = 10) -> list[dict]:
    rows = []
    candidates = config_grid(spec)
    unknown = [c for c in cells if c not in SWEEP_CELLS]
    if not cells or unknown:
        raise ValueError(f"cells must be one or more of {list(SWEEP_CELLS)}, got {cells}")
    for cell in cells:
        lens = SWEEP_CELLS[cell]
        per_layer = sum(lens) * shape.bytes_per_token()
        layers = min(MAX_ROTATION_LAYERS, max(4, math.ceil(L2_ROTATION_BYTES / per_layer)))
        num_pages = sum(-(-n // shape.page_size) for n in lens) + 1
        opts = RunOptions(layers=layers, rotate_l2=False)   # its own rotation, above
        layers = layers_that_fit(shape, num_pages, opts)
        cache = make_cache(shape, num_pages=num_pages, layers=layers, device=device, seed=0)
        for i, n in enumerate(lens):
            cache.add_sequence(i)
            cache.append_tokens(i, n)
        step = step_inputs(cache, list(range(len(lens))), shape, torch.Generator().manual_seed(0))
        ref = reference_output(step)
        for backend, cfg in candidates:
            b = PersistentKV(backend, layout=shape.layout, config=cfg)
            try:
                b.plan(step)
                err = relative_error(b.run(0), ref)
            except Exception as exc:  # noqa: BLE001 - a configuration that does not fit is a row
                rows.append({"cell": cell, "backend": backend, **cfg.__dict__, "us": math.nan,
                             "error": math.nan, "note": f"{type(exc).__name__}: {exc}"[:200]})
                continue
            us = graph_time_per_layer(b, step, layers, reps=reps) if err <= TOLERANCE[shape.dtype] else math.nan
            rows.append({"cell": cell, "backend": backend, **cfg.__dict__, "us": us, "error": err,
                         "split_tokens": b.wrapper.current_plan.info()["split_tokens"],
                         "tbps": kv_bytes_per_layer(step) / us / 1e6 if us == us else math.nan})
        timed = [r for r in rows if r["cell"] == cell and r["us"] == r["us"]]
        if timed:
            best = min(timed, key=lambda r: r["us"])
            print(f"{cell:<9} best {best['us']:7.1f} us ({best['tbps']:.2f} TB/s): "
                  f"{best['backend']} block_n={best['block_n']} warps={best['num_warps']} "
                  f"stages={best['num_stages']} waves={best['waves']} "
                  f"min_split={best['min_split_tokens']} split={best['split_tokens']}", flush=True)
        else:   # every configuration failed here: the rows' notes say why; the cells go on
            print(f"{cell:<9} no configuration ran (see the rows' notes)", flush=True)
        del cache, step
        torch.cuda.empty_cache()
    # the single configuration with the best geometric mean over the cells
    by_cfg: dict[tuple, list[float]] = {}
    for r in rows:
        by_cfg.setdefault((r["backend"], *(r[f.name] for f in dataclasses.fields(KernelConfig))),
                          []).append(r["us"])
    ranked = sorted((statistics.geometric_mean(v), k) for k, v in by_cfg.items()
                    if len(v) == len(cells) and all(x == x for x in v))
    for gm, k in ranked[:8]:
        print(f"geomean {gm:7.2f} us: {k}")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    env = environment(device, functional=False)
    env["shape"] = shape.record()
    out_path.write_text(results_json({"environment": env, "rows": rows,
                                      "ranked": [(gm, list(k)) for gm, k in ranked]}))
    return rows
