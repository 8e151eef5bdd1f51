"""An fp8 (e4m3) KV cache: quantization on append, the scales' two granularities, their checks.

Per tensor: one k_scale and one v_scale a layer (vLLM's and FlashInfer's convention: run() takes
each layer's; PagedKVCache keeps one pair for all its layers); a stored value x8 stands for
scale * x8. Per token: one scale per token and KV head for its K row and one
for its V row, kept beside the pool as fp32 [pages, 2, Hkv, page_size] (index 0 of dim 1: K),
each the row's amax / 448, so that a token appended alone never saturates and never rescales the
tokens before it. Quantization saturates: a value beyond the scale's range becomes +-448 x scale,
never inf or NaN.
"""
from __future__ import annotations

import torch

from .checks import check_fp32_scale

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                 # the largest finite e4m3 value
SCALE_GRANULARITIES = ("tensor", "token")
MIN_SCALE = 1e-12               # a token row of zeros still gets a positive scale


def quantize(x: torch.Tensor, scale) -> torch.Tensor:
    """x / scale in e4m3, saturated to +-448 (scale: a float, or a tensor broadcasting to x)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """Per-row scales of x [..., D]: amax / 448 over the last dim's finite values, at least
    MIN_SCALE; fp32 [...]. An inf then saturates to +-448 x scale as in a per-tensor cache (an
    inf amax would zero the row's other values and store the inf as NaN)."""
    magnitude = x.float().abs()
    magnitude = torch.where(torch.isfinite(magnitude), magnitude, 0.0)
    return (magnitude.amax(dim=-1) / FP8_MAX).clamp_min(MIN_SCALE)


MAX_SCALE = 2.0**64   # past it, q . k of e4m3 values times the scale can overflow fp32's scores


def check_scale(name: str, value: object) -> float:
    """A per-tensor scale: a positive real number inside fp32's normal range (the kernel's), at
    most MAX_SCALE."""
    scale = check_fp32_scale(name, value)
    if scale > MAX_SCALE:
        raise ValueError(f"{name} must be at most 2^64 (the scores times a larger scale can "
                         f"overflow fp32), got {value!r}")
    return scale


def check_cache_scales(*, cache_dtype: torch.dtype, planned: torch.dtype | None,
                       tensor_scales: bool, kv_scales, num_pages: int, num_kv_heads: int,
                       page_size: int, device: torch.device) -> None:
    """run()'s cache against its plan and its scales: the dtype plan(kv_data_type=) named (None:
    any); an fp8 cache with exactly one kind of scales (tensor_scales: k_scale/v_scale given),
    fp16/bf16 with none; per-token scales as check_token_scales wants them."""
    if planned is not None and cache_dtype != planned:
        raise ValueError(f"the kv_cache is {cache_dtype}, but the plan was made for "
                         f"kv_data_type={planned}")
    fp8 = cache_dtype == FP8
    if not fp8 and (tensor_scales or kv_scales is not None):
        raise ValueError(f"k_scale, v_scale and kv_scales dequantize an fp8 kv_cache; this "
                         f"one is {cache_dtype}")
    if fp8 and tensor_scales == (kv_scales is not None):
        raise ValueError("an fp8 kv_cache needs its scales: k_scale= and v_scale= (per "
                         "tensor) or kv_scales= (per token), one of the two"
                         if not tensor_scales else
                         "give k_scale/v_scale (per tensor) or kv_scales (per token), not both")
    if kv_scales is not None:
        check_token_scales(kv_scales, num_pages=num_pages, num_kv_heads=num_kv_heads,
                           page_size=page_size, device=device)


def check_token_scales(kv_scales: object, *, num_pages: int, num_kv_heads: int, page_size: int,
                       device: torch.device) -> torch.Tensor:
    """Per-token scales as the kernel reads them: contiguous fp32 [pages, 2, Hkv, page_size] on
    the cache's device (values are not read: positive by construction, PagedKVCache.append)."""
    if not isinstance(kv_scales, torch.Tensor):
        raise TypeError(f"kv_scales must be a torch.Tensor, got {type(kv_scales).__name__}")
    if kv_scales.dtype != torch.float32:
        raise TypeError(f"kv_scales must have dtype torch.float32, got {kv_scales.dtype}")
    want = (num_pages, 2, num_kv_heads, page_size)
    if tuple(kv_scales.shape) != want or not kv_scales.is_contiguous():
        raise ValueError(f"kv_scales must be a contiguous [num_pages, 2, num_kv_heads, "
                         f"page_size] = {list(want)} tensor, got shape {list(kv_scales.shape)} "
                         f"and strides {kv_scales.stride()}")
    if kv_scales.device != device:
        raise ValueError(f"kv_scales is on {kv_scales.device}, but the kv_cache is on {device}")
    return kv_scales
