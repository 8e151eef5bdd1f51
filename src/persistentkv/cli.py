"""Command line: `persistentkv demo` (and the benchmark's commands)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def choose_device() -> str:
    """'cuda' when a GPU is there; else the CPU, with the kernels in Triton's interpreter.

    Must run before triton is imported at all (triton.language's own jit helpers are decorated
    at import): the parser imports nothing that imports triton.
    """
    import torch

    if torch.cuda.is_available():
        return "cuda"
    os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


def cmd_demo(args: argparse.Namespace) -> int:
    if not 0 <= args.seed < 2**32:   # torch's and the allocator's seeds
        raise ValueError(f"--seed must be in [0, 2^32), got {args.seed}")
    device = choose_device()
    from .demo import run_demo

    return run_demo(device=device, seed=args.seed)


def model_shapes(args: argparse.Namespace) -> list:
    """[(preset or None, ModelShape)] of the shape options (add_shape_arguments): one per preset
    of --preset NAME[,NAME...], or the one the head flags give."""
    import torch

    from .bench.runner import ModelShape

    presets = args.preset or [None]
    if args.preset:
        twice = sorted({p for p in args.preset if args.preset.count(p) > 1})
        if twice:
            raise ValueError(f"--preset names {', '.join(twice)} more than once")
        given = [f"--{k.replace('_', '-')}" for k in ("num_qo_heads", "num_kv_heads", "head_dim")
                 if getattr(args, k) is not None]
        if given:
            raise ValueError(f"--preset {','.join(args.preset)} sets the heads and head dim; "
                             f"drop {given}")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    return [(preset, ModelShape.of(preset, num_qo_heads=args.num_qo_heads,
                                   num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                                   page_size=args.page_size, dtype=dtype, layout=args.layout,
                                   kv_fp8=args.kv_fp8))
            for preset in presets]


def model_shape(args: argparse.Namespace):
    """The one ModelShape of the shape options, for the commands that take one shape."""
    shapes = model_shapes(args)
    if len(shapes) > 1:
        raise ValueError(f"persistentkv {args.command} takes one --preset, got "
                         f"{','.join(args.preset)}")
    return shapes[0][1]


def _tag_for(args: argparse.Namespace, preset: str | None, shapes: list) -> str | None:
    """A results file's stem: --tag, or per preset when there are several (tag-preset)."""
    if len(shapes) == 1:
        return args.tag
    return f"{args.tag}-{preset}" if args.tag else preset


def _preset_list(text: str) -> list[str]:
    from .bench.runner import MODEL_PRESETS   # (no triton)

    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODEL_PRESETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown preset(s) {unknown or [text]}; choose from "
                                         f"{', '.join(MODEL_PRESETS)}")
    return names


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    from .bench.runner import MODEL_PRESETS   # (no triton)

    parser.add_argument("--preset", "--shape", dest="preset", type=_preset_list,
                        action="extend", metavar="NAME[,NAME...]",
                        help="model shapes (Hq/Hkv/head_dim; bench and evaluate take several, "
                             "in one list or repeated): "
                             + ", ".join(f"{k} {'/'.join(map(str, v))}"
                                         for k, v in MODEL_PRESETS.items()))
    parser.add_argument("--num-qo-heads", type=int, help="default 32")
    parser.add_argument("--num-kv-heads", type=int, help="default 8")
    parser.add_argument("--head-dim", type=int, help="default 128")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    parser.add_argument("--layout", choices=["HND", "NHD", "HND_VT"], default="HND",
                        help="HND_VT: V's blocks transposed (ours only; docs/perf-notes.md v17)")
    parser.add_argument("--kv-fp8", choices=["tensor", "token"],
                        help="an e4m3 KV cache, scales per tensor or per (token, KV head); q and "
                             "the output stay in --dtype")


def cmd_bench(args: argparse.Namespace) -> int:
    device = choose_device()
    import torch

    from .bench.runner import RunOptions
    from .bench.suite import run_bench

    shapes = model_shapes(args)
    if args.q_len != "1" and not args.grid:
        raise ValueError(f"--q-len {args.q_len} applies to --grid (static batches), not to traces")
    if args.grid and args.traces:
        raise ValueError(f"--traces {args.traces} replays traces; --grid runs static batches: "
                         f"give one of them")
    if args.trace_file and (args.grid or args.traces):
        raise ValueError(f"--trace-file {args.trace_file} replays its own trace: give it without "
                         f"--grid and --traces")
    opts = RunOptions(layers=args.layers, samples=args.samples, seed=args.seed,
                      memory_budget_gb=args.memory_gb, q_len=args.q_len,
                      window_left=args.window_left, logits_soft_cap=args.soft_cap,
                      sinks=args.sinks)
    status = 0
    for preset, shape in shapes:
        status = max(status, run_bench(
            device=torch.device(device), grid=args.grid,
            cells=[c.strip() for c in args.cells.split(",")] if args.cells else None,
            traces=args.traces.split(",") if args.traces else None, trace_file=args.trace_file,
            batch_slots=args.batch_slots, backends=args.backends.split(","), shape=shape,
            opts=opts, out_dir=Path(args.out), tag=_tag_for(args, preset, shapes)))
    return status


def cmd_sweep(args: argparse.Namespace) -> int:
    device = choose_device()
    if device != "cuda":
        raise SystemExit("persistentkv sweep times kernels: it needs a GPU")
    import json

    import torch

    from .bench.sweep import SWEEP_CELLS, run_sweep

    cells = ([c.strip() for c in args.cells.split(",") if c.strip()] if args.cells
             else list(SWEEP_CELLS))
    try:
        spec = json.loads(args.spec)
    except json.JSONDecodeError as err:
        raise ValueError(f"--spec must be JSON, got {args.spec!r}: {err}") from None
    run_sweep(device=torch.device("cuda"), cells=cells, spec=spec,
              shape=model_shape(args), out_path=Path(args.out))
    return 0


def _ints(option: str, text: str, *, minimum: int) -> list[int]:
    """A non-empty comma-separated list of integers >= minimum (option: its flag, for errors)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{option} expects comma-separated integers, got {text!r}") from None
    if not values or min(values) < minimum:
        raise ValueError(f"{option} expects one or more integers >= {minimum}, got {text!r}")
    if len(set(values)) < len(values):
        raise ValueError(f"{option} names a value twice, got {text!r}")
    return values


def cmd_calibrate(args: argparse.Namespace) -> int:
    device = choose_device()
    import torch

    from .bench.adaptive import run_calibrate
    from .bench.runner import RunOptions

    run_calibrate(device=torch.device(device), seeds=_ints("--seeds", args.seeds, minimum=0),
                  candidates=args.candidates.split(","), shape=model_shape(args),
                  opts=RunOptions(layers=args.layers, samples=args.samples),
                  objective=args.objective, out_path=Path(args.out),
                  from_results=[Path(p) for p in args.from_results] or None)
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    device = choose_device()
    import torch

    from .bench.adaptive import run_evaluate
    from .bench.runner import RunOptions
    from .policy import load_policy

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    shapes = model_shapes(args)
    seeds = _ints("--seeds", args.seeds, minimum=0)
    for preset, shape in shapes:
        policy = load_policy(name, args.policy,   # as plan() picks it (an fp8 cache's first)
                             shape=(shape.num_qo_heads, shape.num_kv_heads, shape.head_dim),
                             kv_fp8=shape.kv_fp8 is not None)
        run_evaluate(device=torch.device(device), policy=policy, seeds=seeds,
                     backends=args.backends.split(","), shape=shape,
                     opts=RunOptions(layers=args.layers, samples=args.samples,
                                     eager_reps=args.eager_reps), out_dir=Path(args.out),
                     tag=_tag_for(args, preset, shapes))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .bench.report import make_report, matrix_heatmap

    paths = [Path(p) for p in args.results]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"no such results file: {', '.join(missing)}")
    written = ([matrix_heatmap(paths, Path(args.out) / "shape-matrix.png")] if args.matrix
               else make_report(paths, Path(args.out)))
    for p in written:
        print(f"wrote {p}")
    return 0


def cmd_e2e(args: argparse.Namespace) -> int:
    requests = _ints("--requests", args.requests, minimum=1)
    if args.new_tokens < 1:
        raise ValueError(f"--new-tokens must be >= 1, got {args.new_tokens}")
    device = choose_device()
    import torch

    from .bench.e2e import reference_impl, run_e2e

    model = args.model or ("llama3-8b" if device == "cuda" else "tiny")
    reference = reference_impl(model)
    impls = args.impls or (f"{reference},paged|persistentkv" if device == "cuda"
                           or reference != "paged|sdpa"
                           else "paged|sdpa,paged|eager,paged|persistentkv")
    run_e2e(model_name=model, requests=requests, mean_prompt=args.mean_prompt,
            new_tokens=args.new_tokens, impls=impls.split(","), device=torch.device(device),
            out_dir=Path(args.out), tag=args.tag or f"e2e-{model}",
            teacher_forced=not args.no_teacher_forced, profile=args.profile,
            fixed_routing=args.fixed_routing,
            dtype=None if args.dtype is None else {"fp16": torch.float16,
                                                   "bf16": torch.bfloat16}[args.dtype])
    return 0


def cmd_layer_chain(args: argparse.Namespace) -> int:
    device = choose_device()
    import torch

    from .bench.layer_chain import run_layer_chain
    from .bench.runner import ModelShape

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    shape = ModelShape.of(args.preset, page_size=args.page_size, dtype=dtype, layout=args.layout)
    return run_layer_chain(device=torch.device(device), shape=shape, batch=args.batch,
                           context=args.context, layers=args.layers, replays=args.replays,
                           seed=args.seed, out_dir=Path(args.out), tag=args.tag)


def cmd_explain(args: argparse.Namespace) -> int:
    device = choose_device()
    from .bench.backends import pkv_backend_config
    from .bench.explain import explain_step
    from .bench.suite import grid_cases

    shape = model_shape(args)
    if (args.cell is None) == (args.seq_lens is None):
        raise ValueError("give one of --cell NAME (a grid cell) and --seq-lens N[,N...]")
    if args.cell is not None:
        (name, lens), = grid_cases([args.cell])
    else:
        try:
            lens = [int(n) for n in args.seq_lens.split(",")]
        except ValueError:
            raise ValueError(f"--seq-lens must be comma-separated ints, got {args.seq_lens!r}") \
                from None
        name = f"B{len(lens)} of {min(lens)}-{max(lens)} tokens"
    backend, split_pages, config = pkv_backend_config(args.backend, head_dim=shape.head_dim,
                                                      num_kv_heads=shape.num_kv_heads)
    report = explain_step(lens, shape=shape, num_sms=args.num_sms, gpu_name=args.gpu,
                          q_len=args.q_len, backend=backend, split_pages=split_pages,
                          config=config, device=device)
    print(f"{name}, {shape.num_qo_heads}/{shape.num_kv_heads}/{shape.head_dim}, "
          f"{args.q_len} {'query' if args.q_len == 1 else 'queries'} a row, {args.backend} "
          f"on {args.num_sms} SMs:")
    for line in report.lines():
        print(f"  {line}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="persistentkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a small decode through every plan() backend, checked "
                                       "against the float64 reference (GPU if present, else the "
                                       "CPU interpreter)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=cmd_demo)

    from .bench.backends import ALL_BACKENDS, CONFIG_SUFFIXES   # (no triton here: see choose_device)

    bench = sub.add_parser("bench", help="trace-replay benchmark against FlashInfer and baselines "
                                         "(GPU; on the CPU a tiny functional run)")
    bench.add_argument("--grid", action="store_true", help="static batches B x L and fixed mixes")
    bench.add_argument("--traces", help="comma-separated subset of the suite, e.g. b8-bimodal,b1-bucketed")
    bench.add_argument("--trace-file", help="replay your own trace (JSONL or CSV: context_len, "
                                            "output_len[, arrival_step])")
    bench.add_argument("--batch-slots", type=int, default=8, help="slots for --trace-file")
    bench.add_argument("--backends", default=",".join(ALL_BACKENDS),
                       help="comma-separated; ours take KernelConfig suffixes :<key><value>, key one "
                            f"of {', '.join(CONFIG_SUFFIXES)}, e.g. pkv-auto:pdl1:maxreg168")
    bench.add_argument("--layers", type=int, default=32, help="layers, each with its own pool")
    bench.add_argument("--samples", type=int, default=16, help="measured steps per trace")
    bench.add_argument("--memory-gb", type=float, default=60.0, help="budget for all layers' pools")
    bench.add_argument("--cells", help="comma-separated subset of the grid's cells, e.g. "
                                       "'B1 L32K,B8 zipf', or uniform batches off the grid "
                                       "named 'B<rows> L<K>K' (e.g. 'B16 L2K')")
    bench.add_argument("--q-len", default="1",
                       help="query tokens per row of the grid's batches (1-16, or 'mix': 2-8 per "
                            "row; speculative-decoding verification); compare with fi-prefill")
    bench.add_argument("--window-left", type=int, default=-1,
                       help="a sliding window: each query sees itself and the window_left "
                            "positions before it (-1: none)")
    bench.add_argument("--soft-cap", type=float, default=0.0,
                       help="logit soft-cap: scores become cap * tanh(score / cap) (0: none)")
    bench.add_argument("--sinks", action="store_true",
                       help="a learned sink logit per query head (drawn per layer)")
    add_shape_arguments(bench)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--out", default="results", help="folder for the JSON and CSV files")
    bench.add_argument("--tag", help="file name stem of the results (default: traces or grid)")
    bench.set_defaults(func=cmd_bench)

    sweep = sub.add_parser("sweep", help="time kernel configurations on static batches (GPU)")
    sweep.add_argument("--cells", help="comma-separated subset of the sweep's static batches")
    sweep.add_argument("--spec", default='{"block_n": [32, 64, 128], "num_warps": [4], '
                                         '"num_stages": [2, 3, 4], "waves": [1, 2], '
                                         '"min_split_tokens": [64, 128]}',
                       help="JSON: lists of values per KernelConfig field, and 'backend'")
    add_shape_arguments(sweep)
    sweep.add_argument("--out", default="results/sweep.json")
    sweep.set_defaults(func=cmd_sweep)

    explain = sub.add_parser("explain", help="what plan() makes of a step on a GPU of N SMs: "
                                             "the choice, tasks, rounds and tile (runs on the "
                                             "CPU; nothing timed)")
    explain.add_argument("--cell", help="a grid cell of `bench --grid`, e.g. 'B1 L1K', 'B8 zipf'")
    explain.add_argument("--seq-lens", help="the rows' lengths in tokens, e.g. 1024,30000")
    explain.add_argument("--q-len", type=int, default=1, help="query tokens a row (1-16)")
    explain.add_argument("--backend", default="pkv-auto",
                         help="one of ours, as bench names them, e.g. pkv-split@16, "
                              "pkv-auto:minsplit32")
    explain.add_argument("--num-sms", type=int, default=132, help="SMs of the GPU (H200: 132)")
    explain.add_argument("--gpu", default="NVIDIA H200",
                         help="the GPU whose shipped policy decides")
    add_shape_arguments(explain)
    explain.set_defaults(func=cmd_explain)

    from .bench.adaptive import CALIBRATION_SEEDS, CANDIDATES, HELD_OUT_SEEDS   # (no triton)

    calibrate = sub.add_parser("calibrate", help="fit the policy that pkv-auto decides with, on "
                                                 "calibration traces")
    calibrate.add_argument("--seeds", default=",".join(map(str, CALIBRATION_SEEDS)))
    calibrate.add_argument("--candidates", default=",".join(CANDIDATES),
                           help="our fixed choices: pkv-grouped, pkv-split, pkv-balanced, "
                                "pkv-split@N")
    calibrate.add_argument("--objective", choices=["graph_us", "eager_us"], default="graph_us")
    calibrate.add_argument("--from-results", nargs="*", default=[],
                           help="refit from `persistentkv bench` JSON files instead of measuring")
    calibrate.add_argument("--layers", type=int, default=32)
    calibrate.add_argument("--samples", type=int, default=6)
    add_shape_arguments(calibrate)
    calibrate.add_argument("--out", default="results/policy.json")
    calibrate.set_defaults(func=cmd_calibrate)

    evaluate = sub.add_parser("evaluate", help="pkv-auto (the policy on the device) against every "
                                               "fixed backend on held-out trace seeds")
    evaluate.add_argument("--policy", help="policy JSON (default: the one shipped for this GPU)")
    evaluate.add_argument("--seeds", default=",".join(map(str, HELD_OUT_SEEDS)))
    evaluate.add_argument("--backends", default="pkv-grouped,pkv-split,pkv-split@16,pkv-split@64,"
                                                "fi-cuda-core,fi-tensor-core,fi-xqa",
                          help="the fixed backends; pkv-auto with --policy is added")
    evaluate.add_argument("--layers", type=int, default=32)
    evaluate.add_argument("--samples", type=int, default=8)
    evaluate.add_argument("--eager-reps", type=int, default=3,
                          help="timed eager repetitions of each step (median)")
    add_shape_arguments(evaluate)
    evaluate.add_argument("--out", default="results")
    evaluate.add_argument("--tag", default="evaluate")
    evaluate.set_defaults(func=cmd_evaluate)

    e2e = sub.add_parser("e2e", help="a random-weight model in transformers' continuous batching, "
                                     "paged|persistentkv against transformers' paged attention")
    # bench.e2e.MODELS' names, written out: that module imports torch (a test keeps them equal)
    e2e.add_argument("--model", choices=["llama3-8b", "qwen2.5-7b", "gpt-oss-20b", "gemma3-12b",
                                         "tiny", "tiny-gpt-oss"],
                     help="default: llama3-8b on a GPU, tiny on the CPU")
    e2e.add_argument("--requests", default="8,32,128", help="concurrent requests per run")
    e2e.add_argument("--mean-prompt", type=int, default=4096, help="mean prompt tokens")
    e2e.add_argument("--new-tokens", type=int, default=64)
    e2e.add_argument("--impls",
                     help="attention implementations; the first is the reference (default: "
                          "paged|sdpa,paged|persistentkv on a GPU, paged|eager first for "
                          "gpt-oss-20b, which paged|sdpa refuses; on the CPU paged|sdpa, "
                          "paged|eager, the control: two correct implementations' difference, "
                          "and paged|persistentkv)")
    e2e.add_argument("--no-teacher-forced", action="store_true",
                     help="skip the teacher-forced scoring (one more prefill per implementation "
                          "and batch: the reference's tokens through each)")
    e2e.add_argument("--dtype", choices=["fp16", "bf16"],
                     help="the model's dtype (default: bf16 on a GPU, fp16 on the CPU); fp16's "
                          "finer rounding is a control for the agreement numbers")
    e2e.add_argument("--fixed-routing", action="store_true",
                     help="mixture-of-experts models (gpt-oss-20b): every token to the same "
                          "experts, so that random routers' flips do not amplify an attention "
                          "difference in the agreement numbers (a control)")
    e2e.add_argument("--profile", action="store_true",
                     help="one more untimed run per implementation and batch (at most 8 new "
                          "tokens) under torch.profiler: attention's share of the CUDA kernel "
                          "time (of the whole run and of its decode steps) and its ms per decode "
                          "step; on the CPU of the self CPU time, the interpreter's")
    e2e.add_argument("--out", default="results",
                     help="folder for <tag>.json and <tag>.png (tokens/s per implementation "
                          "and batch; attention's share with --profile)")
    e2e.add_argument("--tag")
    e2e.set_defaults(func=cmd_e2e)

    from .bench.runner import MODEL_PRESETS   # (no triton)

    chain = sub.add_parser("layer-chain", help="one decode step through a chain of layers (qkv "
                                               "matmul, K/V write, attention, o matmul, rmsnorm) "
                                               "in a CUDA graph, programmatic dependent launch of "
                                               "the decode kernel off against on (GPU; on the CPU "
                                               "a tiny functional run)")
    chain.add_argument("--preset", choices=list(MODEL_PRESETS), default="llama3-8b",
                       help="heads and head dim; hidden = num_qo_heads x head_dim")
    chain.add_argument("--batch", type=int, default=8, help="rows of the static batch")
    chain.add_argument("--context", type=int, default=4096,
                       help="tokens per row, the step's new token included")
    chain.add_argument("--layers", type=int, default=32, help="layers, each with its own pool")
    chain.add_argument("--replays", type=int, default=20,
                       help="timed replays of each graph (median), after warm-up")
    chain.add_argument("--page-size", type=int, default=16)
    chain.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    chain.add_argument("--layout", choices=["HND", "NHD"], default="HND")
    chain.add_argument("--seed", type=int, default=0)
    chain.add_argument("--out", default="results", help="folder for the JSON and CSV files")
    chain.add_argument("--tag", help="file name stem (default: pdl; pdl-functional on the CPU)")
    chain.set_defaults(func=cmd_layer_chain)

    report = sub.add_parser("report", help="PNG plots from results JSON files")
    report.add_argument("results", nargs="+")
    report.add_argument("--out", default="results/plots")
    report.add_argument("--matrix", action="store_true",
                        help="one heatmap (shape-matrix.png) of pkv-auto x FlashInfer's best, a "
                             "row per results file (one shape's grid each), a column per case")
    report.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .bench.results import record_command

    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    record_command(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:   # bad input: a message, not a traceback
        print(f"persistentkv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        record_command(None)


if __name__ == "__main__":
    sys.exit(main())
