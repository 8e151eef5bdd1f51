"""What a kernel's warps wait on, from Nsight Compute's CSV (`scripts/gpu-check.sh stalls`).

    python scripts/stall_table.py results/<gpu>/<run>/stalls/raw-fp16.csv [raw-fp8vt.csv ...]
    python scripts/stall_table.py --source results/<gpu>/<run>/stalls/source-fp8vt.csv [--top 30]

A raw page (`--page raw`) gives one row of metrics a launch: the table lists each stall reason's
cycles per issued instruction (`smsp__average_warps_issue_stalled_<reason>_per_issue_active`),
largest first, one column a file. A source page (`--page source --print-source sass`) gives one
row an instruction: the table lists the instructions with the most stall samples, with their
share of all samples and the two reasons that sampled them most.
"""
from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from pathlib import Path

_REASON = re.compile(r"smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio$")


def _csv_rows(path: Path) -> list[list[str]]:
    """The CSV rows of an ncu report, without the profiler's own lines before them."""
    lines = path.read_text(errors="replace").splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"')), None)
    if start is None:
        raise ValueError(f"path={str(path)!r} holds no CSV table (did ncu run?)")
    return list(csv.reader(io.StringIO("\n".join(lines[start:]))))


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def stall_reasons(path: Path) -> dict[str, float]:
    """Stall reason -> cycles a warp stalls on it per issued instruction (first launch)."""
    rows = _csv_rows(path)
    header = rows[0]
    values = next(row for row in rows[1:] if row and row[0].strip().isdigit())
    reasons = {}
    for name, value in zip(header, values):
        match = _REASON.search(name)
        if match and not match.group(1).endswith("not_issued"):
            reasons[match.group(1)] = _number(value)
    if not reasons:
        raise ValueError(f"path={str(path)!r} has no per-issue stall metrics (WarpStateStats)")
    return reasons


def print_reasons(paths: list[Path]) -> None:
    """One row a stall reason, one column a raw page, ordered by the largest of a row."""
    tables = [stall_reasons(path) for path in paths]
    order = sorted(tables[0], key=lambda reason: -max(t.get(reason, 0.0) for t in tables))
    names = [path.stem for path in paths]
    print(f"{'reason':<24}" + "".join(f"{name:>14}" for name in names))
    for reason in order:
        cells = [t.get(reason, 0.0) for t in tables]
        if max(cells) >= 0.01:
            print(f"{reason:<24}" + "".join(f"{cell:>14.2f}" for cell in cells))
    print(f"{'(sum)':<24}" + "".join(f"{sum(t.values()):>14.2f}" for t in tables))


def print_source(path: Path, *, top: int) -> None:
    """The `top` instructions of a source page by stall samples, with their two main reasons."""
    rows = _csv_rows(path)
    start = next((i for i, row in enumerate(rows) if "Source" in row), 0)   # after the kernel's name
    header, rows = rows[start], rows[start:]
    try:
        samples = header.index("Warp Stall Sampling (All Samples)")
        source = header.index("Source")
    except ValueError as error:
        raise ValueError(f"path={str(path)!r} is not a SASS source page: {error}") from None
    address = header.index("Address") if "Address" in header else None
    reason_columns = [i for i, name in enumerate(header)
                      if name.startswith("stall_") and not name.endswith("(Not Issued)")]
    body = [row for row in rows[1:] if len(row) == len(header) and _number(row[samples]) > 0]
    total = sum(_number(row[samples]) for row in body) or 1.0
    print(f"{path.name}: {len(body)} instructions with samples, {total:.0f} samples")
    for row in sorted(body, key=lambda r: -_number(r[samples]))[:top]:
        reasons = sorted(reason_columns, key=lambda i: -_number(row[i]))[:2]
        why = ", ".join(f"{header[i][6:]} {_number(row[i]):.0f}" for i in reasons
                        if _number(row[i]) > 0)
        where = row[address] if address is not None else ""
        print(f"{100 * _number(row[samples]) / total:5.1f}%  {where:>8}  "
              f"{row[source].strip()[:60]:<60}  {why}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--source", action="store_true", help="the files are SASS source pages")
    parser.add_argument("--top", type=int, default=25, help="instructions listed a source page")
    args = parser.parse_args(argv)
    if args.source:
        for path in args.paths:
            print_source(path, top=args.top)
    else:
        print_reasons(args.paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
