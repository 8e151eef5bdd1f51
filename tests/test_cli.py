"""The command line: bad input gets a one-line error naming the value, and exit code 2."""
import pytest

from persistentkv.cli import main


@pytest.mark.parametrize("argv, message", [
    (["bench", "--layers", "0"], "layers must be a positive int, got 0"),
    (["bench", "--samples", "-2"], "samples must be a positive int, got -2"),
    (["bench", "--memory-gb", "0"], "memory budget must be > 0 GB, got 0.0"),
    (["bench", "--backends", "pkv-fast"], "unknown backend(s) ['pkv-fast']"),
    (["bench", "--trace-file", "no/such/trace.jsonl"], "no/such/trace.jsonl"),
    (["report", "no/such/results.json"], "no such results file: no/such/results.json"),
])
def test_bad_arguments(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bad_trace_file_names_the_line(tmp_path, capsys):
    path = tmp_path / "mine.csv"
    path.write_text("context_len,output_len\n100,5\nabc,3\n")
    assert main(["bench", "--trace-file", str(path), "--batch-slots", "2"]) == 2
    err = capsys.readouterr().err
    assert "line 3" in err and "'abc'" in err


def test_parser_does_not_import_triton():
    """The CLI picks Triton's interpreter on a machine without a GPU, which only works when
    triton is imported after that choice (triton.language's jit helpers are decorated at import)."""
    import subprocess
    import sys

    code = ("import sys, persistentkv.cli as c; c.build_parser(); "
            "sys.exit(1 if 'triton' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
