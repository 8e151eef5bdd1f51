"""`persistentkv e2e`: a model end to end in transformers' continuous batching, decoding through
"paged|persistentkv" against transformers' own paged attention implementations.

The model is built from a config with random weights (no downloads): a Llama-3-8B shape, a
Qwen2.5-7B shape, or (the default without a GPU) a tiny Llama that runs through Triton's
interpreter. Requests get random prompts of mixed lengths (uniform in [mean / 4, 7 mean / 4])
and generate greedily. Reported per implementation and batch: decode tokens/s (tokens after
each request's first, over the span from the first request's first token to the last one's
last), the wall time, and the greedy tokens' agreement with the first implementation (the
share of each request's first 32 tokens that match, averaged).
"""
from __future__ import annotations

import json
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


def run_one(model, impl: str, prompts, *, new_tokens: int) -> dict:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model.set_attn_implementation(impl)
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    # the same for every implementation: no CUDA graphs (paged|persistentkv plans on the host)
    cb = ContinuousBatchingConfig(use_cuda_graph=False)
    start = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                               progress_bar=False, record_timestamps=True)
    wall = time.perf_counter() - start
    outs = [out[k] for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]
    stamps = [o.timestamps for o in outs if o.timestamps]
    span = max(s[-1] for s in stamps) - min(s[0] for s in stamps) if stamps else float("nan")
    decoded = sum(max(0, len(o.generated_tokens) - 1) for o in outs)
    return {"impl": impl, "wall_s": wall, "decode_tokens": decoded,
            "decode_tokens_per_s": decoded / span if span > 0 else float("nan"),
            "tokens": [o.generated_tokens for o in outs]}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    shares = []
    for x, y in zip(a, b):
        n = min(AGREEMENT_TOKENS, len(x), len(y))
        shares.append(sum(p == q for p, q in zip(x[:n], y[:n])) / n if n else 1.0)
    return sum(shares) / len(shares) if shares else float("nan")


def run_e2e(*, model_name: str, requests: list[int], mean_prompt: int, new_tokens: int,
            impls: list[str], device: torch.device, out_dir: Path, tag: str) -> list[dict]:
    from ..integrations.transformers import register

    register()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    model = build_model(model_name, device=device, dtype=dtype)
    rows = []
    for n in requests:
        prompts = prompts_for(n, mean_prompt, model.config.vocab_size, seed=n)
        results = [run_one(model, impl, prompts, new_tokens=new_tokens) for impl in impls]
        for r in results:
            rows.append({"model": model_name, "requests": n, "mean_prompt": mean_prompt,
                         "new_tokens": new_tokens, "impl": r["impl"], "wall_s": r["wall_s"],
                         "decode_tokens_per_s": r["decode_tokens_per_s"],
                         "agreement_with_" + impls[0]: agreement(r["tokens"], results[0]["tokens"]),
                         "speedup_vs_" + impls[0]: (r["decode_tokens_per_s"]
                                                    / results[0]["decode_tokens_per_s"])})
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

    table = Table(title="PersistentKV end to end (transformers continuous batching)")
    keys = [k for k in rows[0] if k not in ("model", "mean_prompt", "new_tokens")]
    for k in keys:
        table.add_column(k)
    for r in rows:
        table.add_row(*(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys))
    Console().print(table)
