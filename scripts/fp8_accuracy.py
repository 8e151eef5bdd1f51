"""What an fp8 (e4m3) KV cache costs in accuracy, per scale granularity: one decode step on K/V
drawn in fp16, then stored in fp8 per tensor (a calibrated scale: 4 sigma / 448) and per token
(amax / 448), against the float64 reference on the fp16 original and on the fp8 values.
Run: PYTHONPATH=src python scripts/fp8_accuracy.py [--out results/h200/fp8-accuracy.json]
(on the CPU it runs a small step through Triton's interpreter)."""
import argparse
import json

import torch

from persistentkv.cli import choose_device

DEVICE = choose_device()   # the interpreter on the CPU: chosen before any kernel is defined

from persistentkv import DecodeWrapper, PagedKVCache, reference_decode, relative_error  # noqa: E402
from persistentkv.quant import FP8, FP8_MAX  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    gpu = DEVICE == "cuda"
    device = torch.device(DEVICE)
    (hq, hkv, dim), lens = ((32, 8, 128), [8192] * 8) if gpu else ((8, 2, 64), [300, 70])
    gen = torch.Generator().manual_seed(0)
    pages = sum(-(-n // 16) for n in lens) + 1
    rows = {}
    for name, kwargs in (("fp16", dict(dtype=torch.float16)),
                         ("fp8, per tensor", dict(dtype=FP8, kv_scale="tensor",
                                                  k_scale=4 / FP8_MAX, v_scale=4 / FP8_MAX)),
                         ("fp8, per token", dict(dtype=FP8, kv_scale="token"))):
        cache = PagedKVCache(num_layers=1, num_pages=pages, page_size=16, num_kv_heads=hkv,
                             head_dim=dim, layout="HND", device=device, shuffle_seed=0, **kwargs)
        gen.manual_seed(0)
        for seq, n in enumerate(lens):   # the same fp16 K/V for every cache
            cache.add_sequence(seq)
            k = torch.randn(1, n, hkv, dim, generator=gen).half()
            v = torch.randn(1, n, hkv, dim, generator=gen).half()
            cache.append(seq, k, v)
        rows[name] = cache
    table = rows["fp16"].page_table()      # the same pages in every cache (one shuffle seed)
    indptr, indices, last = table.csr(device)
    csr = dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last)
    q = torch.randn(len(lens), hq, dim, generator=gen).half().to(device)
    original, _ = reference_decode(q, rows["fp16"].pools[0], layout="HND", **csr)
    report = {}
    for name, cache in rows.items():
        scales = cache.scales(0)
        wrapper = DecodeWrapper("HND")
        wrapper.plan(**csr, num_qo_heads=hq, num_kv_heads=hkv, head_dim=dim, page_size=16)
        out = wrapper.run(q, cache.pools[0], **scales)
        same, _ = reference_decode(q, cache.pools[0], layout="HND", **scales, **csr)
        report[name] = {"vs its own values (float64)": relative_error(out, same),
                        "vs the fp16 original (float64)": relative_error(out, original),
                        "reference on its values vs the fp16 original": relative_error(same, original)}
        print(f"{name:16s} " + "  ".join(f"{k}: {v:.2e}" for k, v in report[name].items()))
    result = {"shape": {"num_qo_heads": hq, "num_kv_heads": hkv, "head_dim": dim, "seq_lens": lens},
              "device": torch.cuda.get_device_name() if gpu else "cpu", "errors": report}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
