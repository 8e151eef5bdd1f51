"""transformers' continuous batching through "paged|persistentkv": a tiny random Llama gives the
same greedy tokens as transformers' own "paged|sdpa", with prompts shorter and longer than 16
tokens, every step through PersistentKV's kernel (prompts as rows of 16 queries; in window layers
staged); models with windows, sinks and soft-cap give transformers' eager tokens."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers", reason="the [transformers] extra is not installed")

from paged_case import DEVICE, ON_GPU
from persistentkv.integrations.transformers import (NAME, paged_attention_forward, register,
                                                    rows_of_queries, split_step)
from persistentkv.wrapper import DecodeWrapper


def test_split_step_cuts_long_requests_into_rows():
    """Of a step with a request of 37 queries over 45 tokens (8 cached), a decode token over 10
    and a request of 3 queries over 7 (block 4): the first is three rows of 16, 16 and 5 of its
    queries, over its first 24, 40 and 45 tokens, then a row of one query and one of three, at
    positions 37 and 38-40 of the step; a request without queries is in no row; nothing is
    staged without a window."""
    cu_q = np.array([0, 37, 38, 41, 41])     # and a request with no query this step
    cu_k = np.array([0, 45, 55, 62, 62])
    reads = np.concatenate([np.arange(100, 145), np.arange(8, 18), np.arange(40, 47)])
    writes = np.concatenate([np.arange(108, 145), [17], [44, 45, 46]])
    rows, staged = split_step(cu_q, cu_k, reads, writes, block_size=4)
    assert staged is None
    assert rows.seq_lens.tolist() == [24, 40, 45, 10, 7]
    assert rows.qo_indptr.tolist() == [0, 16, 32, 37, 38, 41]
    assert rows.decode_queries.tolist() == list(range(41))
    assert rows.block_table[2, :12].tolist() == list(range(25, 37))   # slots 100-144
    assert rows.block_table[0, :6].tolist() == list(range(25, 31))
    assert rows.block_table[3, :3].tolist() == [2, 3, 4]
    assert rows.block_table[4, :2].tolist() == [10, 11]
    fewer, _ = split_step(cu_q, cu_k, reads, writes, block_size=4, max_queries=2)   # group 64
    assert fewer.seq_lens.tolist()[-3:] == [10, 6, 7]
    assert fewer.qo_indptr.tolist()[-4:] == [37, 38, 40, 41]
    fresh, staged = split_step(np.array([0, 20, 23]), np.array([0, 20, 23]),
                               np.zeros(0, np.int64),
                               np.concatenate([np.arange(40, 60), [8, 9, 10]]), block_size=4)
    assert fresh.seq_lens.tolist() == [16, 20, 3] and staged is None
    assert fresh.block_table[1, :5].tolist() == list(range(10, 15))
    assert fresh.block_table[2, :1].tolist() == [2]


@pytest.mark.parametrize("group, most", [(1, 16), (4, 16), (7, 16), (8, 16), (9, 8), (16, 8),
                                         (32, 4), (128, 1)])
def test_rows_of_queries_fit_a_tile(group, most):
    """A request of more queries than this is cut into several rows (the kernel's tile holds
    at most 128 rows of query tokens x group)."""
    assert rows_of_queries(group) == most


def test_split_step_of_a_window_group_reads_each_ring():
    """A window of 6 tokens in blocks of 4: each request's ring is 6 slots over blocks [b0, b1]
    (b1 half used). A decode token whose ring has wrapped (past 10: the reads start at ring
    position 5) is a row over both pages, the full one first; a decode token whose ring has not
    (past 2) a row of 3 tokens; two queries in a window are staged (4 cached tokens, then the 2
    new ones, in pages 0-1 of the staging pool), as is a fresh prompt."""
    sentinel = 65
    cu_q = np.array([0, 1, 2, 4])
    cu_k = np.array([0, 6, 9, 15])
    reads = np.array([5, 0, 1, 2, 3, sentinel,      # past 10, ring blocks [0, 1]: positions 5, 0-3
                      20, 21, sentinel,             # past 2, ring block [5]
                      9, 10, 11, 28, sentinel, sentinel])   # past 4 of blocks [2, 7], 2 queries
    writes = np.array([4, 22, 29, 30])
    rows, staged = split_step(cu_q, cu_k, reads, writes, block_size=4, window=6)
    assert rows.seq_lens.tolist() == [6, 3] and rows.qo_indptr.tolist() == [0, 1, 2]
    assert rows.block_table.tolist() == [[0, 1], [5, 0]]
    assert staged.num_pages == 2 and staged.block_table.tolist() == [[0, 1]]
    assert staged.seq_lens.tolist() == [6] and staged.decode_queries.tolist() == [2, 3]
    assert staged.cached_dst.tolist() == [0, 1, 2, 3]
    assert reads[staged.cached_reads].tolist() == [9, 10, 11, 28]
    assert staged.new_dst.tolist() == [4, 5] and staged.new_queries.tolist() == [2, 3]
    fresh, staged = split_step(np.array([0, 1, 9]), np.array([0, 1, 9]), np.zeros(0, np.int64),
                               np.array([40, 68, 68, 0, 1, 2, 3, 4, 5]), block_size=4, window=6)
    assert fresh.seq_lens.tolist() == [1] and fresh.block_table.tolist() == [[10]]
    assert staged.seq_lens.tolist() == [8] and staged.block_table.tolist() == [[0, 1]]
    assert staged.new_queries.tolist() == list(range(1, 9)) and len(staged.cached_dst) == 0


@pytest.mark.parametrize("ring, pages", [
    ([5, 0, 1, 2, 3, 4], [0, 1]), ([8, 9, 10], [2]), ([4, 5, 6, 7, 0, 1, 2, 3], [0, 1]),
    ([0, 1, 4, 5], None),           # two pages partly filled
    ([0, 2, 3, 4, 5, 6, 7], None),  # a hole at offset 1
    ([0, 1, 1], None)])             # a slot twice
def test_window_rings_that_are_rows(ring, pages):
    """A decode token's ring (its cached slots, then the new token's) is a row of its pages, the
    full ones first, when it fills them from offset 0; otherwise the request is staged. Each
    ring sits between two others in the step, which must come out unchanged."""
    sentinel = 1000
    rings = [[40, 41], ring, [48, 49, 50, 51, 52]]       # pages 10; the ring; 12, then 13
    reads = np.concatenate([r[:-1] + [sentinel] for r in rings])
    writes = np.array([r[-1] for r in rings])
    cu_k = np.concatenate([[0], np.cumsum([len(r) for r in rings])])
    rows, staged = split_step(np.arange(4), cu_k, reads, writes, block_size=4, window=8)
    table = [list(r[:n]) for r, n in zip(rows.block_table.tolist(),
                                         [-(-n // 4) for n in rows.seq_lens])]
    if pages is None:
        assert table == [[10], [12, 13]] and rows.decode_queries.tolist() == [0, 2]
        assert staged.decode_queries.tolist() == [1] and staged.seq_lens.tolist() == [len(ring)]
        assert reads[staged.cached_reads].tolist() == ring[:-1]
    else:
        assert table == [[10], pages, [12, 13]] and staged is None
        assert rows.seq_lens.tolist() == [2, len(ring), 5]


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
    assert kernel_runs[:2] == [sum(map(len, prompts))] * 2, kernel_runs   # the prompts too


def _tiny_model(arch: str, **config):
    """A tiny random model of arch, a window layer then a full one (window 6; the same weights
    for the same arch): gpt-oss with sinks, Gemma-2 with a soft-cap of 2, Gemma-3. Its q and k
    projections are scaled up so that the scores are large enough for each variant to change
    the greedy tokens (the tests check that it does)."""
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM,
                              Gemma3TextConfig, GptOssConfig, GptOssForCausalLM)

    shape = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=16, sliding_window=6,
                 max_position_embeddings=512)
    if arch == "gpt-oss":
        cls, scale, kind = GptOssForCausalLM, 4.0, GptOssConfig
        shape.update(num_local_experts=4, num_experts_per_tok=2,
                     layer_types=["sliding_attention", "full_attention"])
    elif arch == "gemma2":
        cls, scale, kind = Gemma2ForCausalLM, 16.0, Gemma2Config
        shape.update(attn_logit_softcapping=2.0)
    else:
        cls, scale, kind = Gemma3ForCausalLM, 4.0, Gemma3TextConfig
        shape.update(sliding_window_pattern=2)
    torch.manual_seed(0)
    model = cls(kind(**{**shape, **config})).to(torch.float16).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(("q_proj", "k_proj")):
                module.weight.mul_(scale)
            if hasattr(module, "sinks"):
                module.sinks.normal_(0.0, 2.0)
    return model


def _eager_tokens(model, prompts, gen):
    """Greedy tokens of transformers' own (not paged) eager attention, a request at a time."""
    model.set_attn_implementation("eager")
    return [model.generate(torch.tensor([p]), generation_config=gen)[0, len(p):].tolist()
            for p in prompts]


@pytest.mark.parametrize("arch", ["gpt-oss", "gemma2",   # sinks, soft-cap; gemma3's windows
                                  pytest.param("gemma3", marks=pytest.mark.slow)])
def test_generate_batch_serves_windows_sinks_and_soft_cap(arch):
    """Models with window layers (a ring of 6 slots over blocks of 4, which wraps), gpt-oss's
    sinks and Gemma-2's soft-cap give the greedy tokens of transformers' own eager attention
    (which applies all three), for prompts shorter and longer than the window and than 16
    tokens, one prefilled in chunks (each chunk's cached tokens read before its write wraps the
    ring over them); the same model without its variant gives other tokens. Every step of both
    layers runs through the kernel (the window layer's prompts staged). (transformers' paged|sdpa ignores sinks and soft-cap, and refuses
    gpt-oss; its paged|eager ignores soft-cap.)"""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=-1, pad_token_id=0)
    prompts = [[1, 5, 9, 3, 7], list(range(2, 40)), [4, 4, 8], list(range(60, 80)), [9],
               [(7 * i) % 120 + 1 for i in range(90)]]    # prefilled in chunks of at most 32
    model = _tiny_model(arch)
    reference = _eager_tokens(model, prompts, gen)
    if arch == "gpt-oss":
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "sinks"):
                    module.sinks.fill_(-1e4)
        assert _eager_tokens(model, prompts, gen) != reference      # the sinks matter
        model = _tiny_model(arch)
    without = {"gemma2": dict(attn_logit_softcapping=None), "gemma3": dict(sliding_window=512),
               "gpt-oss": dict(sliding_window=512)}[arch]
    assert _eager_tokens(_tiny_model(arch, **without), prompts, gen) != reference
    model.to(DEVICE)
    runs = {}
    decode_run = DecodeWrapper.run

    def counted_run(self, q, *args, **kwargs):
        runs[id(self)] = runs.get(id(self), 0) + 1
        return decode_run(self, q, *args, **kwargs)

    model.set_attn_implementation(register())
    cb = ContinuousBatchingConfig(use_cuda_graph=False, num_blocks=64, max_batch_tokens=32,
                                  block_size=4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DecodeWrapper, "run", counted_run)
        out = model.generate_batch(prompts, generation_config=gen, progress_bar=False,
                                   warmup=False, continuous_batching_config=cb)
    tokens = [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]
    assert tokens == reference
    counts = sorted(runs.values())      # the window group's staged rows, then both groups' rows
    assert len(runs) == 3 and counts[0] >= 3 and counts[1] >= 9, runs   # every decode step


def test_outside_continuous_batching_and_float32_are_refused():
    with pytest.raises(ValueError, match="runs inside continuous batching"):
        paged_attention_forward(torch.nn.Module(), torch.zeros(1, 2, 1, 16), None, None, None)
    with pytest.raises(TypeError, match="float16 or bfloat16 models; this one computes in "
                                        "torch.float32"):
        paged_attention_forward(torch.nn.Module(), torch.zeros(1, 2, 1, 16), None, None, None,
                                cache=object())


def _one_layer_step():
    """(cache, module, q, kv, step metadata) of one layer's step of two new tokens, with a cache
    object that has only what paged_attention_forward reads (pages of 4 slots, 2 KV heads,
    head dim 16, 4 query heads)."""
    pages = torch.zeros(8, 2, 16, dtype=torch.float16)
    cache = SimpleNamespace(num_key_value_heads=2, head_dim=16, block_size=4,
                            layer_index_to_group_indices={0: (0, 0)}, sliding_windows={0: 1},
                            key_cache=[pages], value_cache=[pages.clone()])
    module = SimpleNamespace(layer_idx=0, scaling=0.25, config=SimpleNamespace())
    q, kv = torch.ones(1, 4, 2, 16, dtype=torch.float16), torch.ones(1, 2, 2, 16,
                                                                      dtype=torch.float16)
    meta = dict(cu_seq_lens_q=torch.tensor([0, 2]), cu_seq_lens_k=torch.tensor([0, 2]),
                write_index=[torch.tensor([0, 1])])
    return cache, module, q, kv, meta


def test_bad_steps_are_refused_before_the_cache_is_written():
    """Each names what is wrong, and the cache's pages are as they were."""
    cache, module, q, kv, meta = _one_layer_step()
    pages = cache.key_cache[0]
    cases = [
        (module, q, {**meta, "write_index": None}, "needs continuous batching's write_index"),
        (module, q, {**meta, "cu_seq_lens_k": None}, "needs continuous batching's cu_seq_lens_k"),
        (module, torch.ones(4, 2, 16, dtype=torch.float16), meta,
         r"takes query \[1, num_heads, tokens, head_dim\], got shape \[4, 2, 16\]"),
        (module, torch.ones(1, 3, 2, 16, dtype=torch.float16), meta,
         "num_qo_heads=3 must be a multiple of num_kv_heads=2"),
        (SimpleNamespace(scaling=0.25), q, meta, "layer_idx=None"),
        (SimpleNamespace(layer_idx=0, scaling=0.25, config=SimpleNamespace(
            sliding_window=1, layer_types=["sliding_attention", "full_attention"])), q, meta,
         "cannot serve sliding_window=1"),
    ]
    for mod, query, kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            paged_attention_forward(mod, query, kv, kv, None, cache=cache, **kwargs)
        assert not pages.any() and not cache.value_cache[0].any()
    with pytest.raises(ValueError, match=r"applies no dropout; got dropout=0.1 \(put the model "
                                         r"in eval mode\)"):
        paged_attention_forward(module, q, kv, kv, None, cache=cache, dropout=0.1, **meta)
    partial = SimpleNamespace(**{k: v for k, v in vars(cache).items() if k != "key_cache"})
    with pytest.raises(TypeError, match="the cache given \\(SimpleNamespace\\) has no key_cache"):
        paged_attention_forward(module, q, kv, kv, None, cache=partial, **meta)
    assert not pages.any() and not cache.value_cache[0].any()


def test_a_negative_soft_cap_caps_as_its_magnitude(monkeypatch):
    """cap * tanh(s / cap) is odd in cap (as transformers' eager Gemma-2 computes it): the rows
    run with |cap|."""
    from persistentkv.integrations import transformers as integration

    seen = []
    state = SimpleNamespace(staging=None, cache_rows=SimpleNamespace(
        run=lambda q, pool, out, **variant: seen.append(variant["soft_cap"])))
    monkeypatch.setattr(integration, "_split_groups",
                        lambda plans, *args: plans.update({0: state}))
    cache, module, q, kv, meta = _one_layer_step()
    paged_attention_forward(module, q, kv, kv, None, cache=cache, softcap=-2.0, **meta)
    assert seen == [2.0]


def test_e2e_model_shapes():
    """Each model of `persistentkv e2e` is built as named (on the meta device: no memory)."""
    from persistentkv.bench.e2e import MODELS, build_model

    shapes = {}
    for name in MODELS:
        config = build_model(name, device=torch.device("meta"), dtype=torch.bfloat16).config
        shapes[name] = (config.num_hidden_layers, config.num_attention_heads,
                        config.num_key_value_heads, config.head_dim)
    assert shapes["llama3-8b"] == (32, 32, 8, 128) and shapes["qwen2.5-7b"] == (28, 28, 4, 128)
    assert shapes["gpt-oss-20b"] == (24, 64, 8, 64) and shapes["tiny"] == (2, 8, 2, 16)
    assert shapes["tiny-gpt-oss"] == (2, 8, 2, 16) and shapes["gemma3-12b"] == (48, 16, 8, 256)
    config = build_model("gpt-oss-20b", device=torch.device("meta"), dtype=torch.bfloat16).config
    assert config.sliding_window == 128 and config.layer_types[:2] == ["sliding_attention",
                                                                       "full_attention"]
    config = build_model("gemma3-12b", device=torch.device("meta"), dtype=torch.bfloat16).config
    assert config.sliding_window == 1024
    assert config.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]


def test_e2e_fixed_routing_sends_every_token_to_the_same_experts():
    """--fixed-routing: whatever the hidden states, each router picks the same experts with the
    same scores; a model without experts is refused by name."""
    from persistentkv.bench.e2e import build_model

    model = build_model("tiny-gpt-oss", device=torch.device("cpu"), dtype=torch.float32,
                        fixed_routing=True)
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    assert len(routers) == 2
    for router in routers:
        _, scores, experts = router(torch.randn(5, 64) * 10)
        assert (experts == torch.arange(router.top_k)).all()
        assert torch.allclose(scores, scores[:1].expand_as(scores))
    with pytest.raises(ValueError, match="'tiny'"):
        build_model("tiny", device=torch.device("cpu"), dtype=torch.float32, fixed_routing=True)


def test_e2e_cli_offers_every_model():
    """The CLI's --model choices are written out (its parser imports no torch); they must be
    MODELS' names."""
    from persistentkv.bench.e2e import MODELS
    from persistentkv.cli import build_parser

    e2e = build_parser()._subparsers._group_actions[0].choices["e2e"]
    model = next(a for a in e2e._actions if a.dest == "model")
    assert sorted(model.choices) == sorted(MODELS)


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
    assert {r["dtype"] for r in rows} == {"bfloat16" if ON_GPU else "float16"}


def test_e2e_runs_the_model_in_the_dtype_asked(tmp_path):
    """`persistentkv e2e --dtype`: the other of the two dtypes than the device's default runs
    (tokens from every implementation); float32, which the kernel does not take, is refused by
    name before a model is built."""
    from persistentkv.bench.e2e import run_e2e

    other = torch.float16 if ON_GPU else torch.bfloat16
    rows = run_e2e(model_name="tiny", requests=[2], mean_prompt=12, new_tokens=2,
                   impls=["paged|sdpa", NAME], device=DEVICE, out_dir=tmp_path, tag="d",
                   teacher_forced=False, dtype=other)
    assert [(r["impl"], r["dtype"], r["error"]) for r in rows] == [
        ("paged|sdpa", str(other)[6:], None), (NAME, str(other)[6:], None)]
    assert rows[1]["decode_tokens_per_s"] > 0
    with pytest.raises(ValueError, match=r"dtype must be .*float32"):
        run_e2e(model_name="tiny", requests=[2], mean_prompt=12, new_tokens=2,
                impls=["paged|sdpa", NAME], device=DEVICE, out_dir=tmp_path, tag="f",
                dtype=torch.float32)


def test_e2e_run_of_a_tiny_gpt_oss(tmp_path):
    """The command on a model with window layers and sinks, against paged|eager (paged|sdpa
    refuses gpt-oss): the teacher-forced check agrees on every scored position."""
    from persistentkv.bench.e2e import reference_impl, run_e2e

    rows = run_e2e(model_name="tiny-gpt-oss", requests=[3], mean_prompt=20, new_tokens=4,
                   impls=[reference_impl("tiny-gpt-oss"), NAME], device=DEVICE, out_dir=tmp_path,
                   tag="g")
    assert [r["impl"] for r in rows] == ["paged|eager", NAME] and rows[1]["error"] is None
    assert rows[1]["tf_scored_requests"] == 3 and rows[1]["tf_top1_agreement"] == 1.0
    # the run is in bf16 on a GPU (paged|eager's weights rounded to it too): the bf16 bound there
    assert rows[1]["tf_logits_rel_diff"] < (1e-2 if ON_GPU else 5e-3), rows[1]


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
    time without one) and the host's time per step, attention's part inside it, in every row;
    the attention interface as it was, the table's numbers in the JSON and a PNG beside it."""
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
        for kind in ("decode", "prefill"):            # host wall times, attention's inside
            assert 0 < r[f"attention_host_ms_per_{kind}_step"] < r[f"host_ms_per_{kind}_step"]
    saved = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert saved[1]["attention_share"] == pytest.approx(rows[1]["attention_share"], rel=1e-5)  # 6 digits
    assert (tmp_path / "p.png").stat().st_size > 1024


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


@settings(max_examples=60, deadline=None)
@given(block_size=st.sampled_from([4, 8, 16]), window=st.one_of(st.none(), st.integers(2, 40)),
       plans=st.lists(st.lists(st.sampled_from([1, 1, 1, 2, 3, 7, 20]), min_size=1, max_size=12),
                      min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_split_step_reads_each_querys_tokens_from_transformers_indices(block_size, window, plans,
                                                                       seed):
    """transformers' own allocators (full, sliding window) make the read and write indices of
    random requests, step after step (prompt chunks, decode tokens, a few tokens at a time), in
    blocks drawn at random; a simulated cache records which token each slot holds. Every row
    holds consecutive queries of one request and every query is in one row. A row over the
    cache must read, after the write, exactly the tokens its last query attends to (the
    window's, or all of them); a staged row (window groups), from the staging pool filled
    before the write, the request's tokens in order through its last query, from no later than
    the first one in its first query's window."""
    from transformers.generation.continuous_batching.cache_manager import (
        FullAttentionCacheAllocator, SlidingAttentionCacheAllocator)

    sentinel, trash = 10_000 * block_size + 1, 10_001 * block_size
    blocks = np.random.default_rng(seed).permutation(10_000).tolist()

    class Blocks:   # transformers' BlockManager, reduced to handing out random free blocks
        def get_free_blocks(self, n, last_block_id, shareable, group_id):
            return [blocks.pop() for _ in range(n)]

    cm = (FullAttentionCacheAllocator(0, block_size, allow_block_sharing=False) if window is None
          else SlidingAttentionCacheAllocator(0, block_size, window, sentinel, trash))
    held = {}                                   # slot -> (request, position)
    past = [0] * len(plans)
    for step in range(max(len(p) for p in plans)):
        live = [r for r, p in enumerate(plans) if step < len(p)]
        cu_q, cu_k, reads, writes = [0], [0], [], []
        for r in live:
            n = plans[r][step]
            cm.allocate_blocks(-(-(past[r] + n) // block_size) - len(cm.block_table.get(r, [])),
                               r, Blocks())
            got = cm.get_read_indices(r, past[r], n)
            reads += got
            writes += cm.get_write_indices(r, past[r], n)
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + len(got))
        rows, staged = split_step(np.array(cu_q), np.array(cu_k), np.array(reads),
                                  np.array(writes), block_size, window=window)
        assert window is not None or staged is None
        pool = {}                                   # the staging pool's slots, before the write
        if staged is not None:
            for dst, i in zip(staged.cached_dst, staged.cached_reads):
                pool[int(dst)] = held[reads[i]]
            for dst, i in zip(staged.new_dst, staged.new_queries):
                b = int(np.searchsorted(cu_q, i, side="right")) - 1
                pool[int(dst)] = (live[b], past[live[b]] + int(i) - cu_q[b])
        for i, slot in enumerate(writes):
            b = int(np.searchsorted(cu_q, i, side="right")) - 1
            if slot != trash:
                held[slot] = (live[b], past[live[b]] + i - cu_q[b])
        covered = []
        for part, tokens in ((rows, held), (staged, pool)):
            for row in range(0 if part is None else len(part.seq_lens)):
                lo, hi = part.qo_indptr[row], part.qo_indptr[row + 1]
                queries = part.decode_queries[lo:hi].tolist()
                b = int(np.searchsorted(cu_q, queries[0], side="right")) - 1
                assert queries == list(range(queries[0], queries[-1] + 1))
                assert queries[-1] < cu_q[b + 1]
                r, newest = live[b], past[live[b]] + queries[-1] - cu_q[b]
                pages, length = part.block_table[row], int(part.seq_lens[row])
                seen = [tokens[int(pages[t // block_size]) * block_size + t % block_size]
                        for t in range(length)]
                if part is staged:   # the plan's window (window - 1 to the left) does the rest
                    start = seen[0][1]
                    assert seen == [(r, p) for p in range(start, newest + 1)]
                    assert start <= max(0, newest - len(queries) + 1 - window + 1)
                else:
                    first = 0 if window is None else max(0, newest - window + 1)
                    want = [(r, p) for p in range(first, newest + 1)]
                    assert (seen if window is None else sorted(seen)) == want
                    assert window is None or len(queries) == 1
                covered += queries
        assert sorted(covered) == list(range(cu_q[-1]))
        for b, r in enumerate(live):
            past[r] += cu_q[b + 1] - cu_q[b]
