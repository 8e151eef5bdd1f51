"""A small decode step through every backend of plan(), checked against the float64 reference."""
from __future__ import annotations

import torch

from .cache import PagedKVCache
from .reference import TOLERANCE, reference_decode, relative_error
from .wrapper import BACKENDS, DecodeWrapper


def run_demo(*, device: str, seed: int = 0) -> int:
    """Llama-3-8B attention shape (Hq 32, Hkv 8, d 128, page 16), mixed lengths; returns an exit code."""
    torch.manual_seed(seed)
    lens = [3000, 17, 1, 640] if device == "cuda" else [300, 17, 1, 64]
    heads, kv_heads, dim, page = 32, 8, 128, 16
    cache = PagedKVCache(num_layers=1, num_pages=sum(-(-n // page) for n in lens) + 8, page_size=page,
                         num_kv_heads=kv_heads, head_dim=dim, device=device, shuffle_seed=seed,
                         init="randn")
    for i, n in enumerate(lens):
        cache.add_sequence(i)
        cache.append_tokens(i, n)
    indptr, indices, last = cache.page_table().csr(device)
    q = torch.randn(len(lens), heads, dim, dtype=torch.float16, device=device)
    ref, _ = reference_decode(q, cache.pools[0], layout="NHD", kv_indptr=indptr, kv_indices=indices,
                              kv_last_page_len=last)
    mode = "GPU" if device == "cuda" else "CPU (Triton interpreter: a functional check, not a timing)"
    print(f"PersistentKV decode on {mode}: rows of {lens} tokens, Hq {heads}, Hkv {kv_heads}, "
          f"d {dim}, page {page}, fp16")
    failed = 0
    for backend in BACKENDS:
        wrapper = DecodeWrapper("NHD")
        plan = wrapper.plan(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last,
                            num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=dim, page_size=page,
                            backend=backend)
        err = relative_error(wrapper.run(q, cache.pools[0]), ref)
        ok = err <= TOLERANCE[torch.float16]
        failed += not ok
        info = plan.info()
        print(f"  {backend:<8} {str(info['choice']):<10} split {info['split_tokens']:>5} tokens, "
              f"{info['num_tasks']} tasks on {plan.programs} programs: relative error {err:.1e} "
              f"{'ok' if ok else 'FAILED'}")
    return 1 if failed else 0
