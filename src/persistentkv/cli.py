"""Command line: `persistentkv demo` (and the benchmark's commands)."""
from __future__ import annotations

import argparse
import os
import sys


def choose_device() -> str:
    """'cuda' when a GPU is there; else the CPU, with the kernels in Triton's interpreter.

    Must run before any kernel module is imported.
    """
    import torch

    if torch.cuda.is_available():
        return "cuda"
    os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


def cmd_demo(args: argparse.Namespace) -> int:
    device = choose_device()
    from .demo import run_demo

    return run_demo(device=device, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="persistentkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a small decode through every schedule, checked against the "
                                       "float64 reference (GPU if present, else the CPU interpreter)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
