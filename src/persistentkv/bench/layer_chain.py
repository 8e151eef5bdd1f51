"""`persistentkv layer-chain`: one decode step of a chain of transformer-like layers, each decode
kernel between a model's own kernels, with programmatic dependent launch (KernelConfig.pdl) off
and on.

Back-to-back attention launches (the bench's graphs) overlap work that a real model serializes;
here every decode launch follows the previous layer's matmuls and the new token's K/V write, as
in a model, so that what PDL saves (the decode kernel's launch and prologue overlapping the
kernel before it) is what is measured. Per layer, on a static batch of B rows of L tokens:

    qkv = x @ Wqkv                       x [B, hidden], Wqkv [hidden, (Hq + 2 Hkv) D]
    K/V of the new token -> its row's last slot of this layer's pool (pages scattered)
    attn = DecodeWrapper.run(q, pool)    q [B, Hq, D] -> [B, Hq, D]
    x = rmsnorm(x + attn @ Wo)           Wo [Hq D, hidden], hidden = Hq D

One plan() per step serves every layer; it is captured in the step's CUDA graph with the layers.
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

from .results import check_out_dir, environment, write_results
from .runner import ModelShape

L2_BYTES = 60 << 20          # the H200's L2: all layers' pools together must exceed it
FUNCTIONAL = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
FUNCTIONAL_RUN = dict(batch=2, context=40, layers=2)
SETTINGS = (("pdl0", False), ("pdl1", True))


@dataclasses.dataclass
class Chain:
    """The weights, pools, page table and static buffers of one layer chain."""

    shape: ModelShape
    batch: int
    context: int
    x0: torch.Tensor            # [B, hidden], the step's input
    wqkv: list                  # per layer [hidden, (Hq + 2 Hkv) D]
    wo: list                    # per layer [Hq D, hidden]
    norm: list                  # per layer [hidden]
    pools: list                 # per layer [P, 2, Hkv, S, D] (HND) or [P, 2, S, Hkv, D] (NHD)
    table: dict                 # kv_indptr, kv_indices, kv_last_page_len (device, int32)
    last_page: torch.Tensor     # int64 [B]: the page of each row's new token
    last_slot: torch.Tensor     # int64 [B]: its slot in that page

    @property
    def layers(self) -> int:
        return len(self.pools)

    @property
    def pool_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pools)


def build_chain(shape: ModelShape, *, batch: int, context: int, layers: int,
                device: torch.device, seed: int = 0) -> Chain:
    """Random weights (scaled for unit activations), random pools, and a page table of `batch`
    rows of `context` tokens each (the last one the step's new token) over scattered pages."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    draw = torch.Generator(device=device).manual_seed(seed)
    hq, hkv, d, page = shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, shape.page_size
    hidden, dtype = hq * d, shape.dtype

    def randn(*size, scale=1.0):
        return torch.randn(*size, generator=draw, dtype=dtype, device=device).mul_(scale)

    pages_per_row = -(-context // page)
    num_pages = batch * pages_per_row + 1
    perm = torch.randperm(num_pages, generator=gen)[:batch * pages_per_row]
    indices = perm.to(torch.int32).reshape(batch, pages_per_row)
    last = (context - 1) % page
    inner = (hkv, page) if shape.layout == "HND" else (page, hkv)
    table = dict(kv_indptr=torch.arange(0, batch * pages_per_row + 1, pages_per_row,
                                        dtype=torch.int32, device=device),
                 kv_indices=indices.reshape(-1).to(device),
                 kv_last_page_len=torch.full((batch,), last + 1, dtype=torch.int32, device=device))
    return Chain(shape=shape, batch=batch, context=context, x0=randn(batch, hidden),
                 wqkv=[randn(hidden, (hq + 2 * hkv) * d, scale=hidden ** -0.5)
                       for _ in range(layers)],
                 wo=[randn(hq * d, hidden, scale=(hq * d) ** -0.5) for _ in range(layers)],
                 norm=[1.0 + randn(hidden, scale=0.1) for _ in range(layers)],
                 pools=[randn(num_pages, 2, *inner, d) for _ in range(layers)],
                 table=table, last_page=indices[:, -1].long().to(device),
                 last_slot=torch.full((batch,), last, dtype=torch.int64, device=device))


def split_qkv(chain: Chain, qkv: torch.Tensor):
    """qkv [B, (Hq + 2 Hkv) D] -> views q [B, Hq, D], k and v [B, Hkv, D]."""
    s = chain.shape
    q, k, v = qkv.split([s.num_qo_heads * s.head_dim, s.num_kv_heads * s.head_dim,
                         s.num_kv_heads * s.head_dim], dim=-1)
    b = qkv.shape[0]
    return (q.view(b, s.num_qo_heads, s.head_dim), k.view(b, s.num_kv_heads, s.head_dim),
            v.view(b, s.num_kv_heads, s.head_dim))


def write_token(chain: Chain, pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Each row's new K/V [B, Hkv, D] into its last slot of the pool (two index_put_ launches)."""
    if chain.shape.layout == "HND":   # pool[page, 0, :, slot] is [Hkv, D]
        pool[chain.last_page, 0, :, chain.last_slot] = k
        pool[chain.last_page, 1, :, chain.last_slot] = v
    else:                             # pool[page, 0, slot] is [Hkv, D]
        pool[chain.last_page, 0, chain.last_slot] = k
        pool[chain.last_page, 1, chain.last_slot] = v


def step_body(chain: Chain, wrapper, config, qkv_out: list, attn_out: list, x_out: torch.Tensor):
    """One decode step of the chain: plan(), then every layer; layer l's qkv goes to qkv_out[l]
    (the matmul's own output), its attention to attn_out[l] and the last layer's x to x_out
    (static buffers, read after a replay)."""
    s = chain.shape

    def body():
        wrapper.plan(**chain.table, num_qo_heads=s.num_qo_heads, num_kv_heads=s.num_kv_heads,
                     head_dim=s.head_dim, page_size=s.page_size, config=config)
        x = chain.x0
        for layer in range(chain.layers):
            q, k, v = split_qkv(chain, torch.matmul(x, chain.wqkv[layer], out=qkv_out[layer]))
            write_token(chain, chain.pools[layer], k, v)
            attn = wrapper.run(q, chain.pools[layer], out=attn_out[layer])
            h = x + attn.view(chain.batch, -1) @ chain.wo[layer]
            x = torch.nn.functional.rms_norm(h, (h.shape[-1],), chain.norm[layer], eps=1e-6)
        x_out.copy_(x)
    return body


def attention_error(chain: Chain, layer: int, qkv: torch.Tensor, attn: torch.Tensor,
                    sm_scale: float) -> float:
    """Relative error of a layer's attention output against the float64 reference over its pool,
    from the q the step computed (its qkv); the new token's K/V must be in their slots."""
    from ..reference import reference_decode, relative_error

    q, k, v = split_qkv(chain, qkv)
    pool = chain.pools[layer]
    if chain.shape.layout == "HND":
        got_k = pool[chain.last_page, 0, :, chain.last_slot]
        got_v = pool[chain.last_page, 1, :, chain.last_slot]
    else:
        got_k = pool[chain.last_page, 0, chain.last_slot]
        got_v = pool[chain.last_page, 1, chain.last_slot]
    if not (torch.equal(got_k, k) and torch.equal(got_v, v)):
        return float("inf")           # the new token's K/V are not in their rows' last slots
    ref, _ = reference_decode(q, pool, layout=chain.shape.layout, sm_scale=sm_scale,
                              **chain.table)
    return relative_error(attn, ref)


def run_layer_chain(*, device: torch.device, shape: ModelShape, batch: int = 8,
                    context: int = 4096, layers: int = 32, replays: int = 20, seed: int = 0,
                    out_dir: Path, tag: str | None = None) -> int:
    """Time one decode step of the chain in CUDA-graph replays with PDL off and on (the two
    graphs alternating, median of `replays` after warm-up), check layer 0's attention against
    the float64 reference (and every later layer's, from the q it computed) and the two
    settings' last outputs against each other; write
    <tag>.json / .csv under out_dir. On the CPU: a tiny functional run through the interpreter
    (PDL is off there whatever the setting; no graphs; timings mean nothing). Returns 0, or 1
    when a check failed."""
    from ..launch import use_pdl
    from ..reference import TOLERANCE, relative_error
    from ..tuning import default_config
    from ..wrapper import DecodeWrapper

    for name, value in (("batch", batch), ("context", context), ("layers", layers),
                        ("replays", replays)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if shape.kv_fp8 is not None:
        raise ValueError(f"the layer chain writes fp16/bf16 K/V; kv_fp8={shape.kv_fp8!r} is not "
                         f"supported")
    check_out_dir(out_dir)
    functional = device.type != "cuda"
    if functional:
        print("No GPU: a functional run through Triton's interpreter at a tiny shape (8/2/64, "
              "2 layers, 2 rows of 40 tokens), eager, no graphs; PDL is off in the interpreter "
              "whatever the setting, and the timings mean nothing.")
        shape = dataclasses.replace(shape, **FUNCTIONAL)
        batch, context, layers = FUNCTIONAL_RUN["batch"], FUNCTIONAL_RUN["context"], \
            FUNCTIONAL_RUN["layers"]
    tag = tag or "pdl" + ("-functional" if functional else "")
    chain = build_chain(shape, batch=batch, context=context, layers=layers, device=device,
                        seed=seed)
    base = default_config(head_dim=shape.head_dim, num_kv_heads=shape.num_kv_heads)
    hidden = shape.num_qo_heads * shape.head_dim
    runs = []
    for name, pdl in SETTINGS:
        config = dataclasses.replace(base, pdl=pdl)
        wrapper = DecodeWrapper(shape.layout)

        def nan(*size):
            return torch.full(size, float("nan"), dtype=shape.dtype, device=device)

        qkv = [nan(batch, (shape.num_qo_heads + 2 * shape.num_kv_heads) * shape.head_dim)
               for _ in range(layers)]
        attn = [nan(batch, shape.num_qo_heads, shape.head_dim) for _ in range(layers)]
        x_out = nan(batch, hidden)
        runs.append(dict(name=name, config=config, wrapper=wrapper, qkv=qkv, attn=attn,
                         x_out=x_out, body=step_body(chain, wrapper, config, qkv, attn, x_out),
                         pdl_effective=use_pdl(config, device)))

    if functional:
        times = [[] for _ in runs]
        for r in range(2):                       # alternating, like the graphs
            for i in range(len(runs)):
                at = (r + i) % len(runs)
                t0 = time.perf_counter()
                runs[at]["body"]()
                times[at].append((time.perf_counter() - t0) * 1e6)
        again = [run["body"] for run in runs]
    else:
        from .measure import capture_graph, replay_times

        graphs = [capture_graph(run["body"]) for run in runs]
        times = replay_times(graphs, reps=replays, warmup=3)
        again = [graph.replay for graph in graphs]

    failures = []
    summary, steps = [], []
    off_us = statistics.median(times[0])
    tolerance = TOLERANCE[shape.dtype]
    for run, ts, step in zip(runs, times, again):
        step()                                   # the pools as this setting's step leaves them
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        plan = run["wrapper"].current_plan
        errors = [attention_error(chain, layer, run["qkv"][layer], run["attn"][layer],
                                  plan.sm_scale) for layer in range(layers)]
        chain_err = relative_error(run["x_out"], runs[0]["x_out"])
        status, note = "ok", ""
        if not errors[0] <= tolerance:
            status, note = "failed", (f"layer 0 attention: relative error {errors[0]:.2e} over "
                                      f"{tolerance:.0e}")
        elif not max(errors) <= tolerance:
            worst = max(range(layers), key=lambda i: errors[i])
            status, note = "failed", (f"layer {worst} attention: relative error "
                                      f"{errors[worst]:.2e} over {tolerance:.0e}")
        elif not chain_err <= tolerance:
            status, note = "failed", (f"the last layer's x differs from pdl0's: relative error "
                                      f"{chain_err:.2e}")
        if status != "ok":
            failures.append(f"{run['name']}: {note}")
        us = statistics.median(ts)
        summary.append({
            "case": f"B{batch} L{context}", "setting": run["name"],
            "backend": "pkv-auto" + (":pdl1" if run["config"].pdl else ""), "status": status,
            "note": note, "pdl_effective": run["pdl_effective"], "layers": layers,
            "batch": batch, "context": context, "replays": len(ts), "us_per_step": us,
            "us_per_layer": us / layers, "ratio_vs_pdl0": us / off_us,
            "saved_us_per_layer": (off_us - us) / layers, "layer0_error": errors[0],
            "max_layer_error": max(errors), "chain_error_vs_pdl0": chain_err,
            "chain_bitwise_equal_pdl0": bool(torch.equal(run["x_out"], runs[0]["x_out"])),
            "programs": plan.programs})
        steps.extend({"setting": run["name"], "replay": i, "us_per_step": t}
                     for i, t in enumerate(ts))

    env = environment(device, functional=functional)
    env["shape"] = {**shape.record(), "hidden": hidden}
    env["options"] = {"batch": batch, "context": context, "layers": layers, "replays": replays,
                      "seed": seed, "plan": "captured in the step's graph, once per step",
                      "timing": "eager, perf_counter" if functional else
                      "CUDA events around each graph replay, pdl0 and pdl1 alternating"}
    env["pools_mb"] = chain.pool_bytes / 1e6
    env["pools_exceed_l2"] = chain.pool_bytes > L2_BYTES
    if device.type == "cuda":
        env["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    paths = write_results(out_dir, env=env, summary=summary, steps=steps, tag=tag)
    _print_table(summary, title=f"PersistentKV layer chain ({env['device']}, {shape.num_qo_heads}/"
                                f"{shape.num_kv_heads}/{shape.head_dim}, B{batch} L{context}, "
                                f"{layers} layers)", functional=functional)
    if not functional and not env["pools_exceed_l2"]:
        print(f"note: the pools ({env['pools_mb']:.0f} MB) fit in L2")
    print(f"wrote {', '.join(str(p) for p in paths)}")
    for line in failures:
        print(f"FAILED: {line}")
    return 1 if failures else 0


def _print_table(summary: list[dict], *, title: str, functional: bool) -> None:
    cols = [("setting", "setting"), ("status", "status"), ("pdl_effective", "PDL on"),
            ("us_per_step", "us/step"), ("us_per_layer", "us/layer"),
            ("ratio_vs_pdl0", "x pdl0"), ("saved_us_per_layer", "saved us/layer"),
            ("layer0_error", "layer-0 rel err"), ("max_layer_error", "max layer rel err"),
            ("chain_bitwise_equal_pdl0", "= pdl0")]

    def cell(key, v):
        if key in ("layer0_error", "max_layer_error"):
            return f"{v:.1e}"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
        return str(v)

    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:   # rich is in the [bench] extra
        print(title)
        for r in summary:
            print({head: cell(key, r[key]) for key, head in cols})
        return
    table = Table(title=title + ("  [functional run: timings mean nothing]" if functional else ""))
    for key, head in cols:
        table.add_column(head, justify="left" if key in ("setting", "status") else "right")
    for r in summary:
        table.add_row(*(cell(key, r[key]) for key, _ in cols))
    Console(file=sys.stdout, width=160).print(table)
