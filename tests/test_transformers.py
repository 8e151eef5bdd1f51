"""transformers' continuous batching through "paged|persistentkv": a tiny random Llama gives the
same greedy tokens as transformers' own "paged|sdpa", with prompts shorter and longer than 16
tokens (the longer ones' prefills through torch's sdpa), and the decode steps run through
PersistentKV's kernel."""
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the [transformers] extra is not installed")

from paged_case import DEVICE, ON_GPU
from persistentkv.integrations.transformers import NAME, paged_attention_forward, register, split_step
from persistentkv.wrapper import DecodeWrapper


def test_split_step_keeps_long_prefills_for_sdpa():
    """Of a step with a request of 37 queries over 45 tokens, a decode token over 10 and a
    request of 3 queries over 7 (block 4): the first is a prefill, the others decode rows, their
    queries at positions 37 and 38-40 of the step."""
    cu_q = np.array([0, 37, 38, 41])
    cu_k = np.array([0, 45, 55, 62])
    slots = np.concatenate([np.arange(100, 145), np.arange(8, 18), np.arange(40, 47)])
    table, seq_lens, qo_indptr, decode_q, prefills = split_step(cu_q, cu_k, slots, block_size=4)
    assert prefills == [(0, 37, 0, 45)]
    assert seq_lens.tolist() == [10, 7] and qo_indptr.tolist() == [0, 1, 4]
    assert decode_q.tolist() == [37, 38, 39, 40]
    assert table[0, :3].tolist() == [2, 3, 4] and table[1, :2].tolist() == [10, 11]


def test_generate_batch_matches_paged_sdpa():
    from transformers import (ContinuousBatchingConfig, GenerationConfig, LlamaConfig,
                              LlamaForCausalLM)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=512)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = LlamaForCausalLM(config).to(device, torch.float16).eval()
    gen = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
    prompts = [[1, 5, 9, 3, 7], list(range(2, 40)), [4, 4, 8], list(range(60, 80))]
    # our plan reads the host; a cache sized for the batch (on the CPU transformers would take
    # 90% of the host's memory, slow to set up)
    no_graphs = ContinuousBatchingConfig(use_cuda_graph=False, num_blocks=8, max_batch_tokens=256)
    calls, kernel_runs = [], []
    decode_run = DecodeWrapper.run

    def counted(*args, **kwargs):
        calls.append(1)
        return paged_attention_forward(*args, **kwargs)

    def counted_run(self, q, *args, **kwargs):
        kernel_runs.append(q.shape[0])
        return decode_run(self, q, *args, **kwargs)

    tokens = {}
    for impl in ("paged|sdpa", register()):
        if impl == NAME:
            transformers.AttentionInterface.register(NAME, counted)
        model.set_attn_implementation(impl)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(DecodeWrapper, "run", counted_run)
            out = model.generate_batch(prompts, generation_config=gen, progress_bar=False,
                                       warmup=False, continuous_batching_config=no_graphs)
        tokens[impl] = {k: v.generated_tokens for k, v in out.items()}
    assert len(tokens[NAME]) == len(prompts) and all(len(t) == 6 for t in tokens[NAME].values())
    assert tokens[NAME] == tokens["paged|sdpa"]
    assert len(calls) >= 2 * 6                      # every layer of every step came through us
    assert kernel_runs.count(len(prompts)) >= 2 * 5   # every decode step: one kernel run a layer
    assert max(kernel_runs) <= 16, kernel_runs          # prefills of 20 and 38 tokens went to sdpa


def test_outside_continuous_batching_is_refused():
    with pytest.raises(ValueError, match="runs inside continuous batching"):
        paged_attention_forward(torch.nn.Module(), torch.zeros(1, 2, 1, 16), None, None, None)


def test_e2e_agreement_and_prompts():
    from persistentkv.bench.e2e import AGREEMENT_TOKENS, agreement, prompts_for

    a = [list(range(40)), [1, 2, 3]]
    b = [list(range(20)) + [0] * 20, [1, 9, 3]]
    assert agreement(a, a) == 1.0
    assert agreement(a, b) == (20 / AGREEMENT_TOKENS + 2 / 3) / 2
    prompts = prompts_for(50, 100, vocab=64, seed=1)
    assert len(prompts) == 50 and all(25 <= len(p) < 175 for p in prompts)
    assert all(1 <= t < 64 for p in prompts for t in p)


def test_e2e_prefix_and_first_token_metrics():
    from persistentkv.bench.e2e import first_token_agreement, matching_prefix

    a = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    b = [[1, 2, 0, 4], [0, 6, 7, 8], [9, 9]]
    assert first_token_agreement(a, a) == 1.0 and matching_prefix(a, a) == (4 + 4 + 2) / 3
    assert first_token_agreement(a, b) == 2 / 3
    assert matching_prefix(a, b) == (2 + 0 + 2) / 3       # up to the first mismatch only


def test_e2e_teacher_forced_scoring_follows_the_forced_tokens():
    """Forced to any tokens, two implementations agree on the same contexts (paged|eager and
    paged|persistentkv against paged|sdpa, to fp16 rounding), while the same implementation on
    other contexts does not: the check sees a real difference through the chaos of free runs."""
    from persistentkv.bench.e2e import build_model, teacher_forced_diff, teacher_forced_hidden

    register()
    model = build_model("tiny", device=DEVICE, dtype=torch.float16)
    prompts = [list(range(3, 23)), [7, 1, 4, 1, 5]]             # a prefill cut into pieces, a short one
    gen = torch.Generator().manual_seed(0)
    forced = [torch.randint(1, 128, (4,), generator=gen).tolist() for _ in prompts]
    other = [torch.randint(1, 128, (4,), generator=gen).tolist() for _ in prompts]
    ref = teacher_forced_hidden(model, "paged|sdpa", prompts, forced)
    assert all(h is not None and h.shape == (4, 128) for h in ref)
    for impl in ("paged|eager", NAME):
        same = teacher_forced_diff(model, teacher_forced_hidden(model, impl, prompts, forced), ref)
        assert same["tf_scored_requests"] == 2 and same["tf_top1_agreement"] == 1.0
        assert same["tf_logits_rel_diff"] < 5e-3, (impl, same)
    moved = teacher_forced_diff(model, teacher_forced_hidden(model, "paged|sdpa", prompts, other), ref)
    assert moved["tf_logits_rel_diff"] > 0.1, moved     # tokens 1-3 follow other contexts


def test_e2e_run_of_a_tiny_model(tmp_path):
    """The whole command on a tiny batch (on the GPU where there is one): rows for the reference, the control and ours, with the
    warm-up's time in the first batch's rows and the teacher-forced check near zero."""
    from persistentkv.bench.e2e import run_e2e

    rows = run_e2e(model_name="tiny", requests=[2], mean_prompt=12, new_tokens=3,
                   impls=["paged|sdpa", "paged|eager", NAME], device=DEVICE,
                   out_dir=tmp_path, tag="t")
    assert [r["impl"] for r in rows] == ["paged|sdpa", "paged|eager", NAME]
    assert (tmp_path / "t.json").exists()
    for r in rows:
        assert r["reference"] == "paged|sdpa" and r["warmup_s"] > 0
        assert 0 <= r["token_agreement"] <= 1 and 0 <= r["matching_prefix"] <= 3
        assert r["tf_scored_requests"] == 2 and r["tf_logits_rel_diff"] < 5e-3
    assert rows[0]["tf_logits_max_abs_diff"] == 0.0 and rows[0]["speedup"] == 1.0


def test_e2e_reports_an_implementation_that_raises(tmp_path):
    """An implementation other than the reference that raises (say, a control out of memory) is
    a row with its error, and the others are measured as usual; the reference's errors stop."""
    from transformers import AttentionInterface

    from persistentkv.bench.e2e import run_e2e

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory (a test)")

    AttentionInterface.register("paged|broken", broken)
    try:
        rows = run_e2e(model_name="tiny", requests=[2], mean_prompt=12, new_tokens=2,
                       impls=["paged|sdpa", "paged|broken"], device=torch.device("cpu"),
                       out_dir=tmp_path, tag="t", teacher_forced=False)
        assert [r["impl"] for r in rows] == ["paged|sdpa", "paged|broken"]
        assert rows[0]["error"] is None and rows[0]["decode_tokens_per_s"] > 0
        assert rows[1]["error"].startswith("RuntimeError") and rows[1]["decode_tokens_per_s"] is None
        with pytest.raises(RuntimeError, match=r"paged\|broken: 2 of 2 requests"):
            run_e2e(model_name="tiny", requests=[2], mean_prompt=12, new_tokens=2,
                    impls=["paged|broken", "paged|sdpa"], device=torch.device("cpu"),
                    out_dir=tmp_path, tag="t2", teacher_forced=False)
    finally:
        AttentionInterface._global_mapping.pop("paged|broken", None)


def test_e2e_profile_wrapper_restores_the_attention_interface():
    """--profile's wrapper replaces the implementation's entry under its own name (so that mask
    creation, keyed on the name, is unchanged) and puts it back, also when the run raises."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from persistentkv.bench.e2e import wrapped_attention

    register()
    before = dict(AttentionInterface._global_mapping)
    local_before = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    for impl in ("paged|sdpa", NAME):
        original = ALL_ATTENTION_FUNCTIONS.get_interface(impl, None)

        def wrap(fn):
            def wrapper(*args, **kwargs):
                return fn(*args, **kwargs)
            return wrapper

        with pytest.raises(RuntimeError, match="inside"):
            with wrapped_attention(impl, wrap) as got:
                assert got is original
                inside = ALL_ATTENTION_FUNCTIONS.get_interface(impl, None)
                assert inside is not original and inside.__name__ == "wrapper"
                raise RuntimeError("inside")
        assert ALL_ATTENTION_FUNCTIONS.get_interface(impl, None) is original
    assert AttentionInterface._global_mapping == before
    assert ALL_ATTENTION_FUNCTIONS._local_mapping == local_before
    with pytest.raises(ValueError, match="not registered"):
        with wrapped_attention("paged|no-such-attention", wrap):
            pass
    assert AttentionInterface._global_mapping == before


def test_e2e_profiled_run_of_a_tiny_model(tmp_path):
    """--profile on a tiny batch: attention's share (the CUDA kernels' time on a GPU, self CPU
    time without one) in every row, the
    attention interface as it was, the table's numbers in the JSON and a PNG beside it."""
    import json

    from transformers import AttentionInterface

    from persistentkv.bench.e2e import run_e2e

    register()
    before = dict(AttentionInterface._global_mapping)
    rows = run_e2e(model_name="tiny", requests=[2], mean_prompt=8, new_tokens=3,
                   impls=["paged|sdpa", NAME], device=DEVICE, out_dir=tmp_path,
                   tag="p", teacher_forced=False, profile=True)
    assert AttentionInterface._global_mapping == before
    assert [r["impl"] for r in rows] == ["paged|sdpa", NAME]
    for r in rows:
        assert r["profile_basis"] == ("cuda kernels" if ON_GPU else "cpu self time")
        assert 0 < r["attention_share"] <= 1 and 0 < r["decode_attention_share"] <= 1, r
        assert 0 < r["attention_ms"] <= r["profiled_ms"]
        assert r["profile_decode_steps"] >= 1 and r["attention_ms_per_decode_step"] > 0
        assert r["attention_calls_per_step"] == 2     # the tiny model's two layers
    saved = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert saved[1]["attention_share"] == rows[1]["attention_share"]
    assert (tmp_path / "p.png").stat().st_size > 1024


@pytest.mark.parametrize("n_q, n_k", [(18, 23), (19, 19)])
def test_prefill_rows_against_float64(n_q, n_k):
    """A prefill row (a chunk whose queries end at its last token, or a whole prompt) through
    torch's sdpa on its tokens gathered from scattered cache slots, against float64."""
    from persistentkv.integrations.transformers import _prefill

    gen = torch.Generator().manual_seed(n_q)
    k_cache, v_cache = (torch.randn(64, 2, 16, generator=gen) for _ in range(2))
    slots = torch.randperm(64, generator=gen)[:n_k]
    q = torch.randn(n_q, 4, 16, generator=gen)
    out = _prefill(q, k_cache, v_cache, slots, 0.25)
    k, v = k_cache[slots].double(), v_cache[slots].double()          # [n_k, Hkv, D]
    ref = torch.empty(n_q, 4, 16, dtype=torch.float64)
    for i in range(n_q):
        seen = n_k - n_q + i + 1
        for h in range(4):
            p = torch.softmax(0.25 * k[:seen, h // 2] @ q[i, h].double(), dim=0)
            ref[i, h] = p @ v[:seen, h // 2]
    assert torch.linalg.norm(out.double() - ref) / torch.linalg.norm(ref) < 1e-5


def test_attention_time_from_cuda_events():
    """The profile's CUDA arithmetic on hand-made events: kernels inside the attention range over
    all kernels, the decode steps' share, kernel time linked to no range, and our kernels by
    name (which needs no linking)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Kernel

    from persistentkv.bench.e2e import ATTENTION_LABEL, STEP_LABELS, attention_time

    def kernel(name, us):
        return SimpleNamespace(name=name, device_type=DeviceType.CUDA, is_async=False,
                               is_user_annotation=False, time_range=SimpleNamespace(
                                   elapsed_us=lambda: us), cpu_parent=None)

    def cpu(name, parent, kernels, inner_us=0.0):
        """A CPU range that launched `kernels` itself and holds ranges of inner_us of kernels
        (as torch.profiler: a kernel belongs to the op that launched it, totals add children)."""
        own = [Kernel(k.name, 0, k.time_range.elapsed_us()) for k in kernels]
        return SimpleNamespace(name=name, device_type=DeviceType.CPU, is_async=False,
                               is_user_annotation=False, cpu_parent=parent, cpu_time_total=1.0,
                               self_cpu_time_total=1.0, kernels=own,
                               device_time_total=sum(k.duration for k in own) + inner_us)

    decode_kernel, gemm = kernel("paged_decode_kernel_0d1d", 300.0), kernel("sm90_gemm", 700.0)
    unlinked = kernel("paged_decode_kernel_0d1d", 100.0)
    step = cpu(STEP_LABELS["decode"], None, [gemm], inner_us=300.0)
    attention = cpu(ATTENTION_LABEL, step, [decode_kernel])
    row = attention_time([step, attention, decode_kernel, gemm, unlinked], device=True)
    assert row["profile_basis"] == "cuda kernels"
    assert row["attention_share"] == pytest.approx(300 / 1100)
    assert row["decode_attention_share"] == pytest.approx(300 / 1000)
    assert row["device_ms_unlinked"] == pytest.approx(0.1) and row["profiled_ms"] == pytest.approx(1.1)
    assert row["pkv_kernel_ms"] == pytest.approx(0.4)
