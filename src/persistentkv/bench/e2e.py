"""`persistentkv e2e`: a model end to end in transformers' continuous batching, decoding through
"paged|persistentkv" against transformers' own paged attention implementations.

The model is built from a config with random weights (no downloads): a Llama-3-8B shape, a
Qwen2.5-7B shape, a gpt-oss-20b shape (window layers of 128 tokens between full ones, attention
sinks, 32 experts; transformers' paged|sdpa refuses it, so paged|eager is its reference), a
Gemma-3-12B shape (window layers of 1024 tokens, five of every six; head dim 256), or (the
default without a GPU) a tiny Llama that runs through Triton's interpreter (and a tiny
gpt-oss, window layers of 8 tokens). Requests get random prompts of mixed lengths (uniform in
[mean / 4, 7 mean / 4]) and generate greedily.

Timing. Before its first timed run each implementation runs once untimed (the first batch's
prompts, WARMUP_TOKENS new tokens): Triton compiles our kernels on their first launches in the
process, and that compilation stays out of the timed runs (a later batch whose shapes need a new
specialization can still compile inside its run). Reported per implementation and batch:
decode tokens/s (tokens after each request's first, over the span from the first request's
first token to the last one's last), the wall time of generate_batch (the manager's start, the
prefill and the decode) and the untimed warm-up's seconds (warmup_s, in the first batch's rows).

Correctness against the first implementation, the reference. With random weights the logits are
nearly tied, so one rounding difference can flip a greedy token, and every later token then
follows a different context: the free-running numbers cannot tell a bug from that chaos.
  * token_agreement: the share of each request's first AGREEMENT_TOKENS tokens that match,
    averaged; first_token_agreement: the share of requests whose first token (the prefill's)
    matches; matching_prefix: the mean number of tokens before a request's first mismatch.
  * teacher-forced (tf_*), robust to chaos: every implementation decodes the same prompts
    once more (untimed) with its greedy tokens forced to the reference's, so that it runs the
    same prefill and decode steps on the same contexts; the LM head's inputs at the rows that
    predicted those tokens are projected through the LM head in float32. tf_top1_agreement: the
    share of those positions whose top-1 token is the reference's; tf_logits_max_abs_diff and
    tf_logits_rel_diff (||logits - ref|| / ||ref|| over all positions) against the reference's
    logits; tf_ref_margin_median: the median of the reference's top-1 minus top-2 logit there,
    the scale a difference must reach to flip a token.
A control helps read them: "paged|eager" (transformers' other paged implementation; the default
set on the CPU, --impls on a GPU, where its per-head scores [Hq, q, k] are not counted by
transformers' cache sizing) against "paged|sdpa" shows how far two correct implementations
differ in the same dtype.

Profile (--profile; off by default, the timed runs unchanged). After a batch's timed runs each
implementation runs once more, untimed (the same prompts, min(new_tokens, PROFILE_TOKENS) new
tokens), under torch.profiler (CPU and, on a GPU, CUDA activities; every thread, since
generate_batch runs the model in a background thread). For that run the attention function is
replaced, under the implementation's own name in transformers' AttentionInterface (a new name
would change continuous batching's mask creation, keyed on "paged|sdpa" and "paged|eager"), by
a wrapper that calls it inside record_function(ATTENTION_LABEL); each model forward is a step,
labelled decode (every query length 1) or prefill. The entry is put back afterwards, also when
the run raises. Reported: attention_share, the CUDA time of the kernels launched inside the
attention ranges over all kernels' time in the run; decode_attention_share, the same within the
decode steps (the prefill dominates a short run of long prompts); attention_ms_per_decode_step;
attention_ms and profiled_ms (the totals); device_ms_unlinked, kernel time the profiler linked to
no CPU event (counted in the total, in no range: if it is large the shares are low bounds);
pkv_kernel_ms, the device time of PersistentKV's own kernels by name (PKV_KERNELS: planner, page
guard, decode: in full-attention layers the prefills' too), which needs no linking;
host_ms_per_decode_step and host_ms_per_prefill_step, the host's wall time of a model forward of
each kind, and attention_host_ms_per_*_step the part of it inside the attention function (with
the profiler's overhead, which grows with the number of ops: for comparing implementations, not
for timing). On the CPU the times are self CPU time (profile_basis says which), under Triton's
interpreter a measure of the interpreter, not of the kernels.

Files: <tag>.json (the environment and the rows) and <tag>.png in --out: decode tokens/s per
implementation against the number of requests and, when profiled, attention's shares.
"""
from __future__ import annotations

import functools
import math
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from .results import environment, results_json

def _shape(layers, hidden, inter, hq, hkv, dim, vocab, **extra) -> dict:
    return dict(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter,
                num_attention_heads=hq, num_key_value_heads=hkv, head_dim=dim, vocab_size=vocab,
                **extra)


MODELS = {   # name: (transformers config class, its arguments)
    "llama3-8b": ("LlamaConfig", _shape(32, 4096, 14336, 32, 8, 128, 128256)),
    "qwen2.5-7b": ("Qwen2Config", _shape(28, 3584, 18944, 28, 4, 128, 152064)),
    # window layers (128 tokens) alternate with full ones; sinks on every layer; 32 experts
    "gpt-oss-20b": ("GptOssConfig", _shape(24, 2880, 2880, 64, 8, 64, 201088,
                                           num_local_experts=32, num_experts_per_tok=4,
                                           max_position_embeddings=131072)),
    # window layers (1024 tokens) on five of every six layers; head dim 256
    "gemma3-12b": ("Gemma3TextConfig", _shape(48, 3840, 15360, 16, 8, 256, 262208,
                                              sliding_window=1024, sliding_window_pattern=6,
                                              max_position_embeddings=131072)),
    "tiny": ("LlamaConfig", _shape(2, 128, 256, 8, 2, 16, 128)),
    "tiny-gpt-oss": ("GptOssConfig", _shape(2, 64, 64, 8, 2, 16, 128, num_local_experts=4,
                                            num_experts_per_tok=2, sliding_window=8,
                                            max_position_embeddings=4096)),
}


def reference_impl(name: str) -> str:
    """The first implementation of a run (its reference) when --impls is not given:
    transformers' paged|sdpa, or paged|eager where paged|sdpa refuses the model (gpt-oss)."""
    return "paged|eager" if MODELS[name][0] == "GptOssConfig" else "paged|sdpa"


AGREEMENT_TOKENS = 32
WARMUP_TOKENS = 2
PROFILE_TOKENS = 8   # new tokens of the profiled run (at most --new-tokens)
GPU_OSS_BATCH_TOKENS = 2048   # gpt-oss on a GPU: paged|eager's [64, q, k] fp32 scores under 20 GB
ATTENTION_LABEL = "persistentkv.e2e.attention"
STEP_LABELS = {"decode": "persistentkv.e2e.decode_step", "prefill": "persistentkv.e2e.prefill_step"}


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def build_model(name: str, *, device: torch.device, dtype: torch.dtype, seed: int = 0,
                fixed_routing: bool = False):
    """A random-weight causal LM of the named shape. fixed_routing (mixture-of-experts models):
    every router's weight zeroed and its bias descending by 1 an expert, so that each token
    goes to the same experts with the same scores whatever its hidden state: a control that
    keeps a routing flip (random routers' margins are small) from amplifying an attention
    difference in the agreement numbers."""
    import transformers
    from transformers import AutoModelForCausalLM

    if name not in MODELS:
        raise ValueError(f"model must be one of {list(MODELS)}, got {name!r}")
    config_cls, shape = MODELS[name]
    config = getattr(transformers, config_cls)(**{"max_position_embeddings": 32768, **shape})
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if fixed_routing:
        routers = [m for m in model.modules() if hasattr(m, "top_k") and hasattr(m, "num_experts")
                   and hasattr(m, "bias") and hasattr(m, "weight")]
        if not routers:
            raise ValueError(f"fixed_routing needs a mixture-of-experts model, got {name!r}")
        with torch.no_grad():
            for router in routers:
                router.weight.zero_()
                router.bias.copy_(-torch.arange(router.num_experts, dtype=router.bias.dtype))
    return model.eval()


def prompts_for(num_requests: int, mean_len: int, vocab: int, *, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(1, mean_len // 4), max(2, 7 * mean_len // 4), (num_requests,),
                         generator=gen)
    return [torch.randint(1, vocab, (int(n),), generator=gen).tolist() for n in lens]


def _generate(model, impl: str, prompts, *, new_tokens: int, record_timestamps: bool = False):
    """generate_batch's outputs in the prompts' order, each checked to hold new_tokens tokens."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model.set_attn_implementation(impl)
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    # the same for every implementation: no CUDA graphs (paged|persistentkv plans on the host)
    cb = ContinuousBatchingConfig(use_cuda_graph=False, **_cache_size(model, prompts, new_tokens))
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                               progress_bar=False, record_timestamps=record_timestamps)
    outs = [out[k] for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]
    short = [(i, o.error) for i, o in enumerate(outs) if len(o.generated_tokens) != new_tokens]
    if len(outs) != len(prompts) or short:
        raise RuntimeError(f"{impl}: {len(short)} of {len(prompts)} requests did not generate "
                           f"{new_tokens} tokens (first: {short[:1]})")
    return outs


def _cache_size(model, prompts, new_tokens: int) -> dict:
    """The paged cache's sizing, the same for every implementation. On a GPU, transformers' own
    sizing, except for gpt-oss. Its reference paged|eager materializes every head's scores over
    the packed batch ([Hq, q, k], float32 in its softmax), which that sizing does not count (v16:
    a 20 GB allocation ran out of memory at 32 x 1K with half the free memory given to the
    cache). So gpt-oss, and any model on the CPU (where transformers would size the cache to 90%
    of the host's memory: slow to set up), get a cache of the batch's own blocks, and gpt-oss on
    a GPU batches of at most GPU_OSS_BATCH_TOKENS tokens."""
    on_gpu = model.device.type == "cuda"
    if on_gpu and model.config.model_type != "gpt_oss":
        return {}
    block = 256   # ContinuousBatchingConfig's default block_size
    blocks = sum(-(-(len(p) + new_tokens) // block) for p in prompts)
    return {"num_blocks": blocks + 4, "max_batch_tokens": GPU_OSS_BATCH_TOKENS if on_gpu else 8192}


def run_one(model, impl: str, prompts, *, new_tokens: int) -> dict:
    start = time.perf_counter()
    outs = _generate(model, impl, prompts, new_tokens=new_tokens, record_timestamps=True)
    wall = time.perf_counter() - start
    stamps = [o.timestamps for o in outs if o.timestamps]
    span = max(s[-1] for s in stamps) - min(s[0] for s in stamps) if stamps else float("nan")
    decoded = sum(max(0, len(o.generated_tokens) - 1) for o in outs)
    return {"impl": impl, "wall_s": wall, "decode_tokens": decoded,
            "decode_tokens_per_s": decoded / span if span > 0 else float("nan"),
            "tokens": [o.generated_tokens for o in outs]}


def warm_up(model, impl: str, prompts) -> float:
    """One untimed generate_batch (WARMUP_TOKENS new tokens): the kernels' JIT compile happens
    here, not in a timed run. Returns its seconds."""
    start = time.perf_counter()
    _generate(model, impl, prompts, new_tokens=WARMUP_TOKENS)
    return time.perf_counter() - start


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of each request's first AGREEMENT_TOKENS tokens that match, averaged."""
    shares = []
    for x, y in zip(a, b):
        n = min(AGREEMENT_TOKENS, len(x), len(y))
        shares.append(sum(p == q for p, q in zip(x[:n], y[:n])) / n if n else 1.0)
    return sum(shares) / len(shares) if shares else float("nan")


def first_token_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of requests whose first generated token (the prefill's) matches."""
    pairs = [(x[0], y[0]) for x, y in zip(a, b) if x and y]
    return sum(p == q for p, q in pairs) / len(pairs) if pairs else float("nan")


def matching_prefix(a: list[list[int]], b: list[list[int]]) -> float:
    """The mean number of tokens before each request's first mismatch (its length when none)."""
    lens = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        lens.append(n)
    return sum(lens) / len(lens) if lens else float("nan")


def teacher_forced_hidden(model, impl: str, prompts, tokens) -> list[torch.Tensor | None]:
    """Request i's final hidden states [len(tokens[i]), hidden], the LM head's inputs, that
    predict tokens[i] when generate_batch decodes prompts[i] with its greedy tokens forced to
    tokens[i]: the same prefill and decode steps as a free run, on the reference's contexts.
    None for a request whose chunks could not be told apart from another's.

    Hooks: the decoder's forward (after it) reads each step's packed input_ids, position_ids and
    cu_seq_lens_q, and gives each chunk to the request whose next position it starts at and whose
    tokens it holds (the step's order of requests is transformers' own); the LM head's forward
    (after it) keeps the hidden state of each row that predicts a token and sets that row's
    logits so that the greedy choice is the forced token."""
    seqs = [list(p) + list(t) for p, t in zip(prompts, tokens)]
    firsts = [len(p) - 1 for p in prompts]   # the position that predicts tokens[i][0]
    progress = [0] * len(seqs)
    kept: list[dict[int, torch.Tensor]] = [{} for _ in seqs]
    ambiguous: set[int] = set()
    step = {"targets": {}, "keep": None}     # packed index -> (request, token index)

    def on_model(module, args, kwargs):
        keep = kwargs.get("logits_to_keep")
        step["keep"] = keep.tolist() if isinstance(keep, torch.Tensor) else None

    def on_decoder(module, args, kwargs, output):
        ids = kwargs["input_ids"][0].tolist()
        pos = kwargs["position_ids"][0].tolist()
        cu = kwargs["cu_seq_lens_q"].tolist()
        targets = step["targets"] = {}
        for b in range(len(cu) - 1):
            lo, hi = cu[b], cu[b + 1]
            if hi == lo:
                continue
            start, chunk = pos[lo], ids[lo:hi]
            owners = [i for i, s in enumerate(seqs)
                      if progress[i] == start and s[start: start + len(chunk)] == chunk]
            if not owners:
                raise RuntimeError(f"{impl}: a chunk of {len(chunk)} tokens at position {start} "
                                   f"matches no request")
            if len(owners) > 1:
                ambiguous.update(owners)
            i = owners[0]
            progress[i] += len(chunk)
            t = start + len(chunk) - 1 - firsts[i]
            if 0 <= t < len(tokens[i]):
                targets[hi - 1] = (i, t)

    def on_head(module, args, output):
        hidden = args[0]             # [1, rows, hidden]: the packed tokens, or logits_to_keep's
        rows = step["keep"] if step["keep"] is not None else range(hidden.shape[1])
        for row, packed in enumerate(rows):
            target = step["targets"].get(packed)
            if target is None:
                continue
            i, t = target
            kept[i][t] = hidden[0, row].detach().clone()
            output[0, row] = torch.finfo(output.dtype).min / 2
            output[0, row, tokens[i][t]] = 0
        return output

    decoder = model.get_decoder()
    handles = [model.register_forward_pre_hook(on_model, with_kwargs=True),
               decoder.register_forward_hook(on_decoder, with_kwargs=True),
               model.get_output_embeddings().register_forward_hook(on_head)]
    try:
        outs = _generate(model, impl, prompts, new_tokens=max(len(t) for t in tokens))
    finally:
        for h in handles:
            h.remove()
    forced = [o.generated_tokens[: len(t)] == list(t) for o, t in zip(outs, tokens)]
    return [torch.stack([k[t] for t in range(len(tok))])
            if forced[i] and i not in ambiguous and len(k) == len(tok) else None
            for i, (k, tok) in enumerate(zip(kept, tokens))]


def teacher_forced_diff(model, hidden: list, ref: list) -> dict:
    """tf_* metrics (module docstring) of the hidden states `hidden` against the reference's
    `ref` (teacher_forced_hidden's), through the LM head in float32, a request at a time;
    requests either side could not score are left out (tf_scored_requests counts the rest)."""
    head = model.get_output_embeddings()
    weight = head.weight.float()
    bias = None if getattr(head, "bias", None) is None else head.bias.float()
    same = positions = 0
    max_abs, diff_sq, ref_sq, margins = 0.0, 0.0, 0.0, []
    for h, r in zip(hidden, ref):
        if h is None or r is None:
            continue
        a, b = h.float() @ weight.T, r.float() @ weight.T
        if bias is not None:
            a, b = a + bias, b + bias
        top2 = b.topk(2, dim=-1).values
        same += int((a.argmax(-1) == b.argmax(-1)).sum())
        positions += len(b)
        max_abs = max(max_abs, (a - b).abs().max().item())
        diff_sq += (a - b).double().pow(2).sum().item()
        ref_sq += b.double().pow(2).sum().item()
        margins.append((top2[:, 0] - top2[:, 1]).cpu())
    if not positions:
        return {"tf_top1_agreement": math.nan, "tf_logits_max_abs_diff": math.nan,
                "tf_logits_rel_diff": math.nan, "tf_ref_margin_median": math.nan,
                "tf_scored_requests": 0}
    return {"tf_top1_agreement": same / positions, "tf_logits_max_abs_diff": max_abs,
            "tf_logits_rel_diff": math.sqrt(diff_sq / ref_sq) if ref_sq else math.nan,
            "tf_ref_margin_median": torch.cat(margins).median().item(),
            "tf_scored_requests": len(margins)}


@contextmanager
def wrapped_attention(impl: str, wrap):
    """Inside the block, the attention function registered as `impl` is wrap(original), under
    the same name, so that everything keyed on the name (continuous batching's mask creation for
    "paged|sdpa" and "paged|eager", its paged handling) stays as it is. The entry is replaced
    where transformers' lookup finds it (the shared ALL_ATTENTION_FUNCTIONS' local mapping first,
    then AttentionInterface's global mapping, which models' own interfaces share) and put back on
    the way out, also when the block raises."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    table = local if impl in local else AttentionInterface._global_mapping
    if impl not in table:
        raise ValueError(f"{impl!r} is not registered in transformers' AttentionInterface, so "
                         f"--profile cannot wrap it")
    original = table[impl]
    table[impl] = wrap(original)
    try:
        yield original
    finally:
        table[impl] = original


def _profile_all_threads():
    """The profiler's config for every thread: generate_batch runs the model in a background
    thread, which the profiler does not follow otherwise. None where torch lacks the option."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        return None


def profile_one(model, impl: str, prompts, *, new_tokens: int) -> dict:
    """One untimed generate_batch (min(new_tokens, PROFILE_TOKENS) new tokens) under
    torch.profiler, with the attention function wrapped in record_function(ATTENTION_LABEL) and
    each model forward (a step) in a decode or prefill label (decode: every query length 1).
    Device (CUDA kernel) time on a GPU, self CPU time on the CPU (profile_basis says which)."""
    cuda = model.device.type == "cuda"
    calls = {"attention": 0, "decode": 0, "prefill": 0}
    host = {"decode": 0.0, "prefill": 0.0, "attention decode": 0.0, "attention prefill": 0.0}
    open_steps = []

    def wrap(fn):
        @functools.wraps(fn)
        def profiled_attention(*args, **kwargs):
            calls["attention"] += 1
            start = time.perf_counter()
            try:
                with torch.profiler.record_function(ATTENTION_LABEL):
                    return fn(*args, **kwargs)
            finally:
                if open_steps:
                    host["attention " + open_steps[-1][1]] += time.perf_counter() - start
        return profiled_attention

    def step_starts(module, args, kwargs):
        q = kwargs.get("max_seqlen_q")
        kind = "decode" if q is not None and int(q) == 1 else "prefill"
        calls[kind] += 1
        rf = torch.profiler.record_function(STEP_LABELS[kind])
        rf.__enter__()
        open_steps.append((rf, kind, time.perf_counter()))

    def step_ends(module, args, kwargs, output):
        if open_steps:
            rf, kind, start = open_steps.pop()
            host[kind] += time.perf_counter() - start
            rf.__exit__(None, None, None)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    handles = [model.register_forward_pre_hook(step_starts, with_kwargs=True),
               model.register_forward_hook(step_ends, with_kwargs=True, always_call=True)]
    try:
        with wrapped_attention(impl, wrap), torch.profiler.profile(
                activities=activities, experimental_config=_profile_all_threads()) as prof:
            _generate(model, impl, prompts, new_tokens=min(new_tokens, PROFILE_TOKENS))
            if cuda:
                torch.cuda.synchronize(model.device)
    finally:
        for h in handles:
            h.remove()
    row = attention_time(prof.events(), device=cuda)
    steps = calls["decode"] + calls["prefill"]
    row.update({"profile_new_tokens": min(new_tokens, PROFILE_TOKENS),
                "profile_decode_steps": calls["decode"], "profile_prefill_steps": calls["prefill"],
                "attention_calls_per_step": calls["attention"] / steps if steps else math.nan,
                "attention_ms_per_decode_step": (row.pop("_decode_attention_ms") / calls["decode"]
                                                 if calls["decode"] else math.nan)})
    for kind in ("decode", "prefill"):   # host wall times, profiler overhead included
        n = calls[kind]
        row[f"host_ms_per_{kind}_step"] = host[kind] * 1e3 / n if n else math.nan
        row[f"attention_host_ms_per_{kind}_step"] = (host["attention " + kind] * 1e3 / n
                                                     if n else math.nan)
    return row


def _has_ancestor(event, names) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in names:
            return True
        parent = parent.cpu_parent
    return False


PKV_KERNELS = ("plan_kernel", "guard_pages_kernel", "paged_decode_kernel")   # Triton's names


def attention_time(events, *, device: bool) -> dict:
    """Attention's share of a profiled run's time from torch.profiler's events (profile_one's
    labels). device=True: the CUDA time of the kernels launched inside the attention ranges (and
    the decode steps') over all kernels' time, summed over kernels (streams that overlap count
    twice); device_ms_unlinked is the kernel time that the profiler linked to no CPU event, in
    the total but in no range. device=False: self CPU time inside the ranges over all self CPU
    time (under the interpreter a measure of the interpreter)."""
    from torch.autograd import DeviceType

    labels = {ATTENTION_LABEL, *STEP_LABELS.values()}
    cpu = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    if device:
        def inside(e):
            return e.device_time_total
        kernels = [e for e in events if e.device_type != DeviceType.CPU and not e.is_async
                   and not e.is_user_annotation and e.name not in labels]
        total = sum(e.time_range.elapsed_us() for e in kernels)
        linked = sum(k.duration for e in cpu for k in e.kernels)
    else:
        def inside(e):
            return e.cpu_time_total
        total = sum(e.self_cpu_time_total for e in cpu)

    def ranges(name):   # outermost ranges of that label
        return [e for e in cpu if e.name == name and not _has_ancestor(e, {name})]

    attention = ranges(ATTENTION_LABEL)
    attn_us = sum(inside(e) for e in attention)
    decode_attn_us = sum(inside(e) for e in attention if _has_ancestor(e, {STEP_LABELS["decode"]}))
    decode_us = sum(inside(e) for e in ranges(STEP_LABELS["decode"]))
    row = {"profile_basis": "cuda kernels" if device else "cpu self time",
           "attention_share": attn_us / total if total else math.nan,
           "decode_attention_share": decode_attn_us / decode_us if decode_us else math.nan,
           "attention_ms": attn_us / 1e3, "profiled_ms": total / 1e3,
           "_decode_attention_ms": decode_attn_us / 1e3}
    if device:
        row["device_ms_unlinked"] = max(0.0, total - linked) / 1e3
        row["pkv_kernel_ms"] = sum(e.time_range.elapsed_us() for e in kernels
                                   if e.name.startswith(PKV_KERNELS)) / 1e3
    return row


def run_e2e(*, model_name: str, requests: list[int], mean_prompt: int, new_tokens: int,
            impls: list[str], device: torch.device, out_dir: Path, tag: str,
            teacher_forced: bool = True, profile: bool = False,
            fixed_routing: bool = False, dtype: torch.dtype | None = None) -> list[dict]:
    """dtype: the model's (None: bfloat16 on a GPU, float16 on the CPU)."""
    from ..integrations.transformers import register

    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype!r}")
    register()
    model = build_model(model_name, device=device, dtype=dtype, fixed_routing=fixed_routing)
    ref_name = impls[0]
    failed: dict[str, str] = {}   # an implementation that raised: reported, not run again

    def attempt(impl: str, fn, *args, **kwargs):
        """fn(...), or None once `impl` has raised (the reference's errors propagate)."""
        if impl in failed:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - e.g. a control that runs out of memory
            if impl == ref_name:
                raise
            failed[impl] = f"{type(exc).__name__}: {exc}"[:300]
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return None

    first = prompts_for(requests[0], mean_prompt, model.config.vocab_size, seed=requests[0])
    warmups = {impl: attempt(impl, warm_up, model, impl, first) for impl in impls}   # the JIT
    rows = []
    for n in requests:
        prompts = prompts_for(n, mean_prompt, model.config.vocab_size, seed=n)
        timed = {impl: attempt(impl, run_one, model, impl, prompts, new_tokens=new_tokens)
                 for impl in impls}
        ref = timed[ref_name]
        # untimed, after the timed runs: one profiled run per implementation (--profile)
        profiles = ({impl: attempt(impl, profile_one, model, impl, prompts, new_tokens=new_tokens)
                     for impl in impls} if profile else {})
        ref_hidden = None
        for impl in impls:
            r = timed[impl]
            if r is None:
                rows.append({"model": model_name, "requests": n, "impl": impl,
                             "reference": ref_name, "error": failed.get(impl)})
                continue
            row = {"model": model_name, "dtype": str(dtype).removeprefix("torch."),
                   "requests": n, "mean_prompt": mean_prompt,
                   "new_tokens": new_tokens, "impl": r["impl"], "reference": ref_name,
                   "wall_s": r["wall_s"],
                   "warmup_s": warmups[r["impl"]] if n == requests[0] else None,
                   "decode_tokens_per_s": r["decode_tokens_per_s"],
                   "speedup": r["decode_tokens_per_s"] / ref["decode_tokens_per_s"],
                   "token_agreement": agreement(r["tokens"], ref["tokens"]),
                   "first_token_agreement": first_token_agreement(r["tokens"], ref["tokens"]),
                   "matching_prefix": matching_prefix(r["tokens"], ref["tokens"])}
            if teacher_forced:   # every implementation scores the reference's tokens
                hidden = attempt(impl, teacher_forced_hidden, model, impl, prompts, ref["tokens"])
                if ref_hidden is None:
                    ref_hidden = hidden
                if hidden is not None:
                    row.update(teacher_forced_diff(model, hidden, ref_hidden))
            row.update(profiles.get(impl) or {})
            row["error"] = failed.get(impl)
            rows.append(row)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    rows = [{k: r.get(k) for k in keys} for r in rows]
    _print_table(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{tag}.json"
    env = environment(device, functional=device.type != "cuda")
    env["transformers"] = transformers_version()
    path.write_text(results_json({"environment": env, "rows": rows}))
    print(f"wrote {path}")
    plot = plot_e2e(rows, out_dir / f"{tag}.png", title=f"{model_name}, {device.type}")
    print(f"wrote {plot}")
    return rows


PROFILE_KEYS = ("profile_basis", "attention_share", "decode_attention_share",
                "attention_ms_per_decode_step", "attention_ms", "profiled_ms",
                "device_ms_unlinked", "pkv_kernel_ms", "profile_new_tokens", "profile_decode_steps",
                "profile_prefill_steps", "attention_calls_per_step", "host_ms_per_decode_step",
                "attention_host_ms_per_decode_step", "host_ms_per_prefill_step",
                "attention_host_ms_per_prefill_step")


def plot_e2e(rows: list[dict], path: Path, *, title: str = "") -> Path:
    """A PNG: decode tokens/s per implementation against the number of requests, and when the
    rows were profiled, attention's share (of the decode steps' time, solid; of the whole
    profiled run, hatched) beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = list(dict.fromkeys(r["impl"] for r in rows))
    batches = sorted({r["requests"] for r in rows})
    profiled = any("attention_share" in r for r in rows)
    fig, axes = plt.subplots(1, 2 if profiled else 1, figsize=(12 if profiled else 6.5, 4.2),
                             squeeze=False)
    width = 0.8 / len(impls)
    at = {(r["impl"], r["requests"]): r for r in rows}

    def bars(ax, key, **kw):
        for j, impl in enumerate(impls):
            xs = [i + (j - (len(impls) - 1) / 2) * width for i in range(len(batches))]
            ys = [at.get((impl, n), {}).get(key, math.nan) for n in batches]
            ax.bar(xs, [math.nan if y is None else y for y in ys], width,
                   color=f"C{j}", label=impl if "hatch" not in kw else None, **kw)
        ax.set_xticks(range(len(batches)), [str(n) for n in batches])
        ax.set_xlabel("concurrent requests")

    ax = axes[0][0]
    bars(ax, "decode_tokens_per_s")
    ax.set_ylabel("decode tokens/s")
    speeds = [r["decode_tokens_per_s"] for r in rows if (r.get("decode_tokens_per_s") or 0) > 0]
    if speeds and max(speeds) > 20 * min(speeds):   # e.g. the interpreter against torch
        ax.set_yscale("log")
    ax.set_title("decode throughput")
    ax.legend(fontsize=8)
    if profiled:
        ax = axes[0][1]
        bars(ax, "decode_attention_share")
        bars(ax, "attention_share", fill=False, hatch="//", edgecolor="black", linewidth=0.5)
        basis = next(r["profile_basis"] for r in rows if "profile_basis" in r)
        ax.set_ylabel(f"attention share ({basis})")
        ax.set_ylim(0, 1)
        ax.set_title("attention's share: decode steps (solid), whole run (hatched)")
        ax.legend(fontsize=8)
    fig.suptitle(f"PersistentKV end to end{': ' + title if title else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"PersistentKV end to end (transformers continuous batching), against "
                        f"{rows[0]['reference']}")
    keys = [k for k in rows[0] if k not in PROFILE_KEYS and k not in
            ("model", "mean_prompt", "new_tokens", "reference", "tf_scored_requests")]
    _add_rows(table, keys, rows)
    console = Console(width=200)
    console.print(table)
    if "attention_share" in rows[0]:
        basis = rows[0]["profile_basis"]
        table = Table(title=f"Attention's share of the profiled run ({basis}; "
                            f"{rows[0]['profile_new_tokens']} new tokens, untimed)")
        keys = ["impl", "requests"] + [k for k in PROFILE_KEYS if k in rows[0]
                                       and k not in ("profile_basis", "profile_new_tokens")]
        _add_rows(table, keys, rows)
        console.print(table)


def _add_rows(table, keys: list[str], rows: list[dict]) -> None:
    for k in keys:
        table.add_column(k.replace("_", " "))
    for r in rows:
        table.add_row(*("-" if r.get(k) is None else f"{r[k]:.3g}" if isinstance(r[k], float)
                        else str(r[k]) for k in keys))
