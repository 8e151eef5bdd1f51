"""Argument checks shared by the public entries; every message names the argument and its value."""
from __future__ import annotations

import numbers

import numpy as np
import torch

MAX_GROUP = 64        # query heads per KV head
MAX_HEAD_DIM = 512
FP32_TINY = 1.1754943508222875e-38   # the smallest normal fp32
FP32_MAX = 3.4028234663852886e38


def check_positive_int(name: str, value: object) -> int:
    """An integer >= 1 (int or numpy integer, not bool), as an int."""
    return check_count(name, value, minimum=1)


def check_count(name: str, value: object, *, minimum: int = 0) -> int:
    """An integer (int or numpy integer, not bool) >= minimum, as an int: TypeError for a value that
    is no integer, ValueError below the minimum."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {int(value)}")
    return int(value)


def check_fp32_scale(name: str, value: object, *, zero: bool = False,
                     factor: float = 1.0) -> float:
    """A positive real number that the kernels' fp32 holds as a normal number (between about
    1.2e-38 and 3.4e38) after they multiply it by `factor`, or 0 where zero=True (an option
    that is off)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a float, got {value!r}")
    x = float(value)
    if zero and x == 0:
        return x
    lo, hi = FP32_TINY / factor, FP32_MAX / factor
    if not (lo <= x <= hi):   # NaN fails too
        raise ValueError(f"{name} must be {'0 or ' if zero else ''}a positive finite float in "
                         f"[{lo:.4g}, {hi:.4g}] (fp32's normal range), got {value!r}")
    return x


def check_tensor(name: str, value: object, *, dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
                 dim: int | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    dtypes = (dtype,) if isinstance(dtype, torch.dtype) else dtype
    if dtypes is not None and value.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {want}, got {value.dtype}")
    if dim is not None and value.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {list(value.shape)}")
    return value


def check_same_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, but the page table was planned on {device}")


def check_sinks(sinks: object, *, num_qo_heads: int, device: torch.device) -> None:
    """sinks: a contiguous float32 [num_qo_heads] tensor on `device` (one logit per query head)."""
    check_tensor("sinks", sinks, dtype=(torch.float32,), dim=1)
    if tuple(sinks.shape) != (num_qo_heads,) or sinks.stride(0) != 1:
        raise ValueError(f"sinks must be a contiguous [num_qo_heads] = [{num_qo_heads}] tensor, "
                         f"got shape {list(sinks.shape)} and strides {sinks.stride()}")
    check_same_device(device, sinks=sinks)


def check_attention_shape(*, num_qo_heads: object, num_kv_heads: object, head_dim: object,
                          page_size: object) -> tuple[int, int, int, int]:
    """The heads, head dim and page size plan() takes, as ints."""
    num_qo_heads, num_kv_heads, head_dim, page_size = (
        check_positive_int(name, value) for name, value in
        (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
         ("page_size", page_size)))
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads={num_qo_heads} must be a multiple of "
                         f"num_kv_heads={num_kv_heads}")
    if num_qo_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(f"group size num_qo_heads/num_kv_heads={num_qo_heads // num_kv_heads} "
                         f"is over the supported {MAX_GROUP}")
    return num_qo_heads, num_kv_heads, check_head_dim(head_dim), page_size


def check_head_dim(head_dim: object) -> int:
    """A head dim the kernels take: a multiple of 16 up to MAX_HEAD_DIM."""
    head_dim = check_positive_int("head_dim", head_dim)
    if head_dim % 16 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be a multiple of 16 up to {MAX_HEAD_DIM}, got {head_dim}")
    return head_dim


def check_device(value: object) -> torch.device:
    """A torch.device, or a string or index torch.device() takes; a CUDA device only where torch
    has one."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch.device or a device string such as 'cuda:0', "
                         f"got {value!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device is {value!r}, but this torch has no CUDA device")
    return device


def check_offsets(name: str, offsets: np.ndarray) -> np.ndarray:
    """An offsets array (kv_indptr, qo_indptr) read on the host: it starts at 0 and never
    decreases; returns the counts between offsets."""
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0]={offsets[0]}")
    counts = np.diff(offsets)
    if (counts < 0).any():
        r = int(np.flatnonzero(counts < 0)[0])
        raise ValueError(f"{name} must be non-decreasing, got {name}[{r}]={offsets[r]} > "
                         f"{name}[{r + 1}]={offsets[r + 1]}")
    return counts
