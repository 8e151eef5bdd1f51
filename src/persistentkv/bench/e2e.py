"""`persistentkv e2e`: a model end to end in transformers' continuous batching, decoding through
"paged|persistentkv" against transformers' own paged attention implementations.

The model is built from a config with random weights (no downloads): a Llama-3-8B shape, a
Qwen2.5-7B shape, or (the default without a GPU) a tiny Llama that runs through Triton's
interpreter. Requests get random prompts of mixed lengths (uniform in [mean / 4, 7 mean / 4])
and generate greedily.

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
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

from .results import environment

MODELS = {   # (layers, hidden, intermediate, Hq, Hkv, head_dim, vocab)
    "llama3-8b": ("llama", 32, 4096, 14336, 32, 8, 128, 128256),
    "qwen2.5-7b": ("qwen2", 28, 3584, 18944, 28, 4, 128, 152064),
    "tiny": ("llama", 2, 128, 256, 8, 2, 16, 128),
}
AGREEMENT_TOKENS = 32
WARMUP_TOKENS = 2


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def build_model(name: str, *, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random-weight causal LM of the named shape."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    if name not in MODELS:
        raise ValueError(f"model must be one of {list(MODELS)}, got {name!r}")
    family, layers, hidden, inter, hq, hkv, dim, vocab = MODELS[name]
    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    config = config_cls(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter,
                        num_attention_heads=hq, num_key_value_heads=hkv, head_dim=dim,
                        vocab_size=vocab, max_position_embeddings=32768)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
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
    cb = ContinuousBatchingConfig(use_cuda_graph=False, **_cpu_cache_size(model, prompts,
                                                                          new_tokens))
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                               progress_bar=False, record_timestamps=record_timestamps)
    outs = [out[k] for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]
    short = [(i, o.error) for i, o in enumerate(outs) if len(o.generated_tokens) != new_tokens]
    if len(outs) != len(prompts) or short:
        raise RuntimeError(f"{impl}: {len(short)} of {len(prompts)} requests did not generate "
                           f"{new_tokens} tokens (first: {short[:1]})")
    return outs


def _cpu_cache_size(model, prompts, new_tokens: int) -> dict:
    """On the CPU, a cache sized for the batch: transformers would size it to 90% of the host's
    memory (slow to set up, the same tokens). On a GPU, transformers' own sizing."""
    if model.device.type == "cuda":
        return {}
    block = 256   # ContinuousBatchingConfig's default block_size
    blocks = sum(-(-(len(p) + new_tokens) // block) for p in prompts)
    return {"num_blocks": blocks + 4, "max_batch_tokens": 8192}


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


def run_e2e(*, model_name: str, requests: list[int], mean_prompt: int, new_tokens: int,
            impls: list[str], device: torch.device, out_dir: Path, tag: str,
            teacher_forced: bool = True) -> list[dict]:
    from ..integrations.transformers import register

    register()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    model = build_model(model_name, device=device, dtype=dtype)
    ref_name = impls[0]
    first = prompts_for(requests[0], mean_prompt, model.config.vocab_size, seed=requests[0])
    warmups = {impl: warm_up(model, impl, first) for impl in impls}   # untimed: the JIT compile
    rows = []
    for n in requests:
        prompts = prompts_for(n, mean_prompt, model.config.vocab_size, seed=n)
        results = [run_one(model, impl, prompts, new_tokens=new_tokens) for impl in impls]
        ref = results[0]
        ref_hidden = None
        for r in results:
            row = {"model": model_name, "requests": n, "mean_prompt": mean_prompt,
                   "new_tokens": new_tokens, "impl": r["impl"], "reference": ref_name,
                   "wall_s": r["wall_s"],
                   "warmup_s": warmups[r["impl"]] if n == requests[0] else None,
                   "decode_tokens_per_s": r["decode_tokens_per_s"],
                   "speedup": r["decode_tokens_per_s"] / ref["decode_tokens_per_s"],
                   "token_agreement": agreement(r["tokens"], ref["tokens"]),
                   "first_token_agreement": first_token_agreement(r["tokens"], ref["tokens"]),
                   "matching_prefix": matching_prefix(r["tokens"], ref["tokens"])}
            if teacher_forced:   # every implementation scores the reference's tokens
                hidden = teacher_forced_hidden(model, r["impl"], prompts, ref["tokens"])
                if ref_hidden is None:
                    ref_hidden = hidden
                row.update(teacher_forced_diff(model, hidden, ref_hidden))
            rows.append(row)
    _print_table(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{tag}.json"
    env = environment(device, command=sys.argv, functional=device.type != "cuda")
    env["transformers"] = transformers_version()
    path.write_text(json.dumps({"environment": env, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")
    return rows


def _print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"PersistentKV end to end (transformers continuous batching), against "
                        f"{rows[0]['reference']}")
    keys = [k for k in rows[0]
            if k not in ("model", "mean_prompt", "new_tokens", "reference", "tf_scored_requests")]
    for k in keys:
        table.add_column(k.replace("_", " "))
    for r in rows:
        table.add_row(*("-" if r.get(k) is None else f"{r[k]:.3g}" if isinstance(r[k], float)
                        else str(r[k]) for k in keys))
    Console(width=200).print(table)
