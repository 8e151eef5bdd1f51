"""The command line: bad input gets a one-line error naming the value, and exit code 2."""
import json
import re

import pytest
import torch

from persistentkv.cli import main


@pytest.mark.parametrize("argv, message", [
    (["bench", "--layers", "0"], "layers must be a positive int, got 0"),
    (["bench", "--samples", "-2"], "samples must be a positive int, got -2"),
    (["bench", "--memory-gb", "0"], "memory budget must be > 0 GB, got 0.0"),
    (["bench", "--backends", "pkv-fast"], "unknown backend(s) ['pkv-fast']"),
    (["bench", "--trace-file", "no/such/trace.jsonl"], "no/such/trace.jsonl"),
    (["report", "no/such/results.json"], "no such results file: no/such/results.json"),
    (["bench", "--backends", "pkv-workqueue,pkv-graph"],
     "unknown backend(s) ['pkv-workqueue', 'pkv-graph']"),
    (["bench", "--backends", "pkv-split:warps0"],
     "KernelConfig.num_warps must be a positive int, got 0"),
    (["calibrate", "--candidates", "pkv-split,pkv-auto,fi-xqa"],
     "candidates must be pkv-grouped, pkv-split, pkv-balanced or pkv-split@N, got "
     "['pkv-auto', 'fi-xqa']"),
    (["evaluate", "--backends", "pkv-split@x"], "unknown backend(s) ['pkv-split@x']"),
    (["bench", "--grid", "--cells", "B1 L1K,B3 zipf"], "unknown grid cell(s) ['B3 zipf']"),
    (["bench", "--cells", "B1 L1K"], "add --grid"),
    (["calibrate", "--seeds", "1,2,1"], "--seeds names a value twice, got '1,2,1'"),
    (["bench", "--preset", "llama3-70b-tp8", "--num-kv-heads", "2"],
     "--preset llama3-70b-tp8 sets the heads and head dim; drop ['--num-kv-heads']"),
    (["calibrate", "--preset", "llama3-8b,gpt-oss"],
     "persistentkv calibrate takes one --preset, got llama3-8b,gpt-oss"),
    # checked on a CPU machine too, where the functional run takes its own small shape
    (["bench", "--traces", "nosuch"], "unknown trace(s) ['nosuch']"),
    (["bench", "--head-dim", "100"], "head_dim must be a multiple of 16 up to 512, got 100"),
    (["bench", "--page-size", "0"], "page_size must be >= 1, got 0"),
    (["bench", "--grid", "--layout", "HND_VT", "--page-size", "3"],   # also on the CPU's shape
     "the HND_VT layout takes a page_size that is a power of two, got 3"),
    (["evaluate", "--num-qo-heads", "12", "--num-kv-heads", "8"],
     "num_qo_heads=12 must be a multiple of num_kv_heads=8"),
    (["explain", "--cell", "B1 L1K", "--seq-lens", "100"], "give one of --cell NAME"),
    (["explain", "--seq-lens", "100,x"], "--seq-lens must be comma-separated ints, got '100,x'"),
    (["explain", "--seq-lens", "100,0"], "seq_lens must be one or more positive lengths"),
    (["explain", "--cell", "B1 L1K", "--q-len", "17"], "q_len must be an int in [1, 16], got 17"),
    (["explain", "--cell", "B1 L1K", "--num-sms", "0"], "num_sms must be >= 1, got 0"),
    (["explain", "--cell", "B1 L1K", "--backend", "fi-xqa"],
     "backend must be pkv-NAME[@PAGES][:<key><value>...] with NAME one of"),
    (["explain", "--cell", "B1 L1K", "--backend", "auto"], "(e.g. 'pkv-auto', "),
    (["calibrate", "--seeds", ""], "--seeds expects one or more integers >= 0, got ''"),
    (["evaluate", "--seeds", "1,x"], "--seeds expects comma-separated integers, got '1,x'"),
    (["e2e", "--requests", ""], "--requests expects one or more integers >= 1, got ''"),
    (["e2e", "--requests", "0"], "--requests expects one or more integers >= 1, got '0'"),
    (["e2e", "--new-tokens", "-3"], "--new-tokens must be >= 1, got -3"),
    (["bench", "--memory-gb", "inf"], "memory budget must be > 0 GB, got inf"),
    (["demo", "--seed", "-1"], "--seed must be in [0, 2^32), got -1"),
    (["bench", "--grid", "--q-len", "\u00b2"], "q_len must be 1 to 16 or 'mix', got '\u00b2'"),
    (["bench", "--grid", "--q-len", "01"], "q_len must be 1 to 16 or 'mix', got '01'"),
    (["bench", "--grid", "--trace-file", "t.csv"], "--trace-file t.csv replays its own trace"),
    (["bench", "--grid", "--traces", "mixed"], "--traces mixed replays traces; --grid runs static"),
    (["bench", "--preset", "gpt-oss", "--shape", "llama3-8b,gpt-oss"],
     "--preset names gpt-oss more than once"),
    (["explain", "--seq-lens", "3000000000"], "seq_lens must be at most 4194304 tokens a row"),
])
def test_bad_arguments(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_report_refuses_a_file_that_is_no_results_before_writing(tmp_path, capsys):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"steps": []}))
    assert main(["report", str(path), "--out", str(tmp_path / "plots")]) == 2
    assert "is not a results file of `persistentkv bench`: it has no 'summary', 'environment'" \
        in capsys.readouterr().err
    assert not (tmp_path / "plots").exists()
    chain = tmp_path / "pdl.json"       # a layer-chain file: its steps have no status (KeyError)
    chain.write_text(json.dumps({"summary": [], "environment": {},
                                 "steps": [{"setting": "pdl0", "us_per_step": 3.0}]}))
    assert main(["report", str(chain), "--out", str(tmp_path / "plots")]) == 2
    assert "its steps need backend, case, status" in capsys.readouterr().err
    assert not (tmp_path / "plots").exists()


def test_refit_refuses_files_that_are_no_results(tmp_path, capsys):
    """Each --from-results file is read as a results file, named when it is not one; files of
    two GPUs are not fitted together."""
    text, no_steps = tmp_path / "notes.txt", tmp_path / "summary.json"
    text.write_text("not json")
    no_steps.write_text(json.dumps({"environment": {"device": "test"}}))
    for path, message in ((text, "is no results JSON"),
                          (no_steps, "holds no 'environment' and 'steps'")):
        assert main(["calibrate", "--from-results", str(path), "--out",
                     str(tmp_path / "p.json")]) == 2
        assert f"from_results file {str(path)!r} {message}" in capsys.readouterr().err
    paths = []
    for gpu in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
        paths.append(tmp_path / f"{gpu}.json")
        paths[-1].write_text(json.dumps({"environment": {"device": gpu}, "steps": []}))
    assert main(["calibrate", "--from-results", *map(str, paths), "--out",
                 str(tmp_path / "p.json")]) == 2
    assert "from_results files were measured on different GPUs or shapes" \
        in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_refit_from_results_without_candidate_steps(tmp_path, capsys):
    """Measurements of an older version (its labels are no candidates now) are named, not fitted."""
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"environment": {"device": "test"}, "steps": [
        {"case": "t", "step": 0, "backend": "pkv-workqueue", "status": "ok", "rows": 1,
         "tokens": 10, "max_seq_len": 10, "graph_us": 1.0, "eager_us": 2.0}]}))
    assert main(["calibrate", "--from-results", str(path), "--out", str(tmp_path / "p.json")]) == 2
    assert f"from_results=['{path}'] holds no step of a candidate" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_defaults_name_the_new_backends():
    from persistentkv.bench.adaptive import CANDIDATES
    from persistentkv.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["calibrate"]).candidates == ",".join(CANDIDATES)
    assert parser.parse_args(["bench"]).backends.split(",")[:4] == ["pkv-grouped", "pkv-split",
                                                                   "pkv-balanced", "pkv-auto"]
    assert parser.parse_args(["evaluate"]).backends == (
        "pkv-grouped,pkv-split,pkv-split@16,pkv-split@64,fi-cuda-core,fi-tensor-core,fi-xqa")


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


def test_preset_lists(capsys, tmp_path):
    """--preset (or --shape, the same option) takes a comma list, or is repeated (bench and
    evaluate run each, one results file per preset); an unknown name is an argparse error naming
    it."""
    from persistentkv.cli import build_parser, model_shapes

    args = build_parser().parse_args(["bench", "--preset", "llama3-70b-tp8,gemma2-9b"])
    assert build_parser().parse_args(["bench", "--shape", "llama3-70b-tp8,gemma2-9b"]) == args
    assert build_parser().parse_args(["bench", "--preset", "llama3-70b-tp8", "--shape",
                                      " gemma2-9b"]) == args
    assert [(p, s.num_kv_heads, s.head_dim) for p, s in model_shapes(args)] == [
        ("llama3-70b-tp8", 1, 128), ("gemma2-9b", 8, 256)]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--preset", "llama3-8b,llama5"])
    assert "unknown preset(s) ['llama5']" in capsys.readouterr().err
    assert main(["bench", "--grid", "--preset", "llama3-8b,qwen2.5-7b", "--backends",
                 "pkv-split", "--cells", " B1 L1K", "--memory-gb", "2", "--out",
                 str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["llama3-8b.json",
                                                               "qwen2.5-7b.json"]
    printed = capsys.readouterr().out
    assert "nan" not in printed.lower()
    if not torch.cuda.is_available():
        assert "TB/s" not in printed                                # nothing a CPU run cannot say


def test_out_naming_a_file_is_refused_before_the_run(tmp_path, capsys):
    (tmp_path / "taken").write_text("")
    for argv in (["bench", "--out", str(tmp_path / "taken")],
                 ["evaluate", "--out", str(tmp_path / "taken")],
                 ["calibrate", "--out", str(tmp_path / "taken" / "policy.json")],
                 ["calibrate", "--out", str(tmp_path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "is a file" in err or "is a folder" in err, (argv, err)


def test_presets_give_the_model_shapes():
    from persistentkv.bench.runner import MODEL_PRESETS, ModelShape

    shape = ModelShape.of("llama3-70b-tp8", page_size=64)
    assert (shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, shape.page_size) == (8, 1, 128, 64)
    assert ModelShape.of(None, num_kv_heads=4) == ModelShape(num_kv_heads=4)
    assert MODEL_PRESETS["qwen2.5-7b"] == (28, 4, 128) and MODEL_PRESETS["gemma2-9b"] == (16, 8, 256)
    with pytest.raises(ValueError, match="preset must be one of"):
        ModelShape.of("llama5")


def test_explain_reports_the_tasks_of_a_given_split(capsys):
    """Splits of 4 pages (64 tokens) of rows of 1000 and 100 tokens: 16 + 2 tasks a KV head, the
    last of each row short (1000 - 15 * 64 = 40, 100 - 64 = 36 tokens), on 2 programs an SM."""
    assert main(["explain", "--seq-lens", "1000,100", "--backend", "pkv-split@4",
                 "--num-sms", "50", "--preset", "llama3-8b"]) == 0
    out = capsys.readouterr().out
    assert "choice split@4 (given" in out and "split 64 tokens" in out
    assert "18 tasks a KV head (144 items on 100 programs: 1.44 rounds)" in out
    assert "2 rows cut, at most 16 splits a row" in out
    assert "tokens a task: min 36, median 64, max 64" in out
    assert "tile: 4 query rows (G_PAD 16), 64-token K/V tiles, 4 warps, 3 stages" in out


def test_explain_says_where_a_fitted_policy_leaves_the_rule(capsys):
    """The H200's 8/1/128 policy has bins from its calibration traces; B128 L1K reached none
    (r4-l0-s0), so the default rule decides there; B8 bimodal's bin (r2-l2-s1) is the table's."""
    from persistentkv.policy import load_policy

    policy = load_policy("NVIDIA H200", shape=(8, 1, 128))
    assert "r4-l0-s0" not in policy.table and "r2-l2-s1" in policy.table
    for cell, left in (("B128 L1K", True), ("B8 bimodal", False)):
        assert main(["explain", "--cell", cell, "--preset", "llama3-70b-tp8", "--gpu",
                     "NVIDIA H200", "--backend", "pkv-auto"]) == 0
        out = capsys.readouterr().out
        assert "NVIDIA H200's policy at 8/1/128" in out
        assert ("which leaves this bin to the default rule" in out) == left, out


def test_explain_reports_the_merge_levels_of_the_most_cut_row(capsys):
    """A row of S <= ONE_LEVEL_SPLITS splits merges in one level, a longer one in groups of
    ceil(sqrt(S)) and then the groups (kernels/decode.py _merge_split); whole rows merge nothing.
    Splits of 1 page (16 tokens): a 256-token row is 16 splits, one of 257 tokens 17 (groups of
    5, then 4), one of 4096 tokens 256 (16 then 16)."""
    from persistentkv.bench.explain import merge_chain

    assert merge_chain(1) == () and merge_chain(2) == (2,) and merge_chain(16) == (16,)
    assert merge_chain(17) == (5, 4) and merge_chain(256) == (16, 16)
    assert merge_chain(257) == (17, 16)
    for lens, expected in (("256", "merge: the most-cut row's 16 partials in one level"),
                           ("257,40", "merge: the most-cut row's partials in two levels, groups "
                                      "of 5, then its 4 groups' results"),
                           ("4096", "groups of 16, then its 16 groups' results")):
        assert main(["explain", "--seq-lens", lens, "--backend", "pkv-split@1",
                     "--preset", "llama3-8b"]) == 0
        assert expected in capsys.readouterr().out
    assert main(["explain", "--seq-lens", "4096", "--backend", "pkv-grouped",
                 "--preset", "llama3-8b"]) == 0
    assert "merge: none (no row is cut)" in capsys.readouterr().out


def test_explain_counts_the_tile_rows_and_the_split_floor_of_many_queries(capsys):
    """gpt-oss (group 8) at 16 queries a row in one tile (no M-blocks, on small steps either):
    128 tile rows, whose splits are at least min_split_tokens x 128 // 32 tokens
    (schedule.min_split_tokens): 512 by default, so a 1K row is 2 tasks a KV head; 128 with
    min_split_tokens 32."""
    from persistentkv.schedule import MIN_SPLIT_TILE_ROWS
    from persistentkv.tuning import default_config

    rows_over = 128 // MIN_SPLIT_TILE_ROWS
    floor = default_config(head_dim=64, num_kv_heads=8).min_split_tokens * rows_over
    for backend, split in (("pkv-split:tilerows0:smallstep0", floor),
                           ("pkv-split:tilerows0:smallstep0:minsplit32", 32 * rows_over)):
        assert main(["explain", "--cell", "B1 L1K", "--preset", "gpt-oss", "--q-len", "16",
                     "--backend", backend]) == 0
        out = capsys.readouterr().out
        assert f"split {split} tokens" in out
        assert f"{1024 // split} tasks a KV head ({8 * 1024 // split} items on 264 programs" in out
        assert "tile: 128 query rows (G_PAD 128)" in out


def test_explain_counts_m_blocks(capsys):
    """gpt-oss at 16 queries a row: each task's 128 rows run as M-blocks, by default 2 of 64
    rows, with ':tilerows32' 4 of 32; a task is that many items a KV head, and the split floor is
    a block's (64 rows: 256 tokens, 32 rows: 128)."""
    for backend, blocks, split in (("pkv-split", 2, 256), ("pkv-split:tilerows32", 4, 128)):
        assert main(["explain", "--cell", "B1 L1K", "--preset", "gpt-oss", "--q-len", "16",
                     "--backend", backend]) == 0
        out = capsys.readouterr().out
        assert f"split {split} tokens" in out
        tasks = 1024 // split
        assert f"{tasks} tasks a KV head ({tasks * 8 * blocks} items on 264 programs" in out
        assert f"tile: 128 query rows ({blocks} M-blocks of G_PAD {128 // blocks})" in out


def test_explain_plans_the_step_size_from_its_page_list(capsys):
    """explain plans from a CSR page list, as the benchmark does, so a large step's programs are
    the ones it runs: head dim 512 at 8 queries a row (64 rows) in blocks of 16 on B1 L1K (4
    MB of K/V), and on B32 L8K (1 GB) in one 64-row program a value block, two value blocks
    (':largerows0' off: 4 blocks of 16)."""
    d512 = ["--num-qo-heads", "16", "--num-kv-heads", "2", "--head-dim", "512", "--q-len", "8",
            "--num-sms", "132"]
    for cell, backend, text in (
            ("B1 L1K", "pkv-auto", "4 M-blocks of G_PAD 16), 16-token K/V tiles, 4 warps, 3"),
            ("B32 L8K", "pkv-auto", "G_PAD 64, 2 value blocks), 16-token K/V tiles, 4 warps, 2"),
            ("B32 L8K", "pkv-auto:largerows0", "4 M-blocks of G_PAD 16), 16-token")):
        assert main(["explain", "--cell", cell, "--backend", backend, *d512]) == 0
        assert f"tile: 64 query rows ({text}" in capsys.readouterr().out, (cell, backend)


def test_explain_plans_chunks_from_shorter_splits_at_head_dim_256(capsys):
    """The default rule's chunks start from splits of WIDE_HEAD_BALANCED_FROM_TOKENS at head dims
    129-256 (tuning.py, v42), 16K elsewhere: B8 uniform's 4816-token splits (132 SMs) are chunks
    at gemma2-9b's 16/8/256, and splits at 16/8/128 and under ':balfrom16384'; B8 L8K's 2048 stay
    splits at head dim 256."""
    from persistentkv.tuning import WIDE_HEAD_BALANCED_FROM_TOKENS, default_config

    assert default_config(head_dim=256, num_kv_heads=8).balanced_from_tokens \
        == WIDE_HEAD_BALANCED_FROM_TOKENS < 4816
    for cell, head_dim, backend, choice in (("B8 uniform", "256", "pkv-auto", "choice balanced"),
                                            ("B8 uniform", "128", "pkv-auto", "choice split"),
                                            ("B8 uniform", "256", "pkv-auto:balfrom16384",
                                             "choice split"),
                                            ("B8 L8K", "256", "pkv-auto", "choice split")):
        assert main(["explain", "--cell", cell, "--num-qo-heads", "16", "--num-kv-heads", "8",
                     "--head-dim", head_dim, "--num-sms", "132", "--backend", backend]) == 0
        assert capsys.readouterr().out.split("\n")[1].strip().startswith(choice), \
            (cell, head_dim, backend)


def test_grid_cells_name_uniform_batches_off_the_grid():
    """'B<rows> L<K>K' names a uniform batch the grid lacks; the grid's own names keep their
    lengths and the grid's order; a malformed name, or one of more tokens than the grid's
    largest cells (GRID_MAX_TOKENS), is refused."""
    from persistentkv.bench.suite import grid_cases
    cases = grid_cases(["B16 L2K", "B1 L1K", "B4 zipf"])
    assert cases[:2] == [("B1 L1K", [1024]), ("B4 zipf", [430, 647, 1891, 1622])]
    assert cases[2] == ("B16 L2K", [2048] * 16)
    assert grid_cases(["B4 L1024K"]) == [("B4 L1024K", [1 << 20] * 4)]   # 4M tokens, the most
    for name in ("B0 L1K", "B16 L2k", "B5000 L1K", "B2 L4096K", "B16 L02K", "B8 L1024K"):
        with pytest.raises(ValueError, match=re.escape(f"unknown grid cell(s) [{name!r}]")):
            grid_cases([name])


def test_evaluate_judges_the_policy_plan_takes(monkeypatch, tmp_path):
    """On an fp8 cache plan() takes the policy fitted on fp8 steps first: evaluate --kv-fp8 asks
    for that one too (it judged the fp16 one)."""
    import persistentkv.bench.adaptive as adaptive
    import persistentkv.policy as policy_module

    asked = []
    real = policy_module.load_policy
    monkeypatch.setattr(policy_module, "load_policy",
                        lambda *a, **kw: asked.append(kw) or real(*a, **kw))
    monkeypatch.setattr(adaptive, "run_evaluate", lambda **kw: None)
    assert main(["evaluate", "--kv-fp8", "token", "--out", str(tmp_path)]) == 0
    assert main(["evaluate", "--out", str(tmp_path)]) == 0
    assert [kw["kv_fp8"] for kw in asked] == [True, False]
