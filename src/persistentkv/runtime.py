"""Facts about where kernels run: the interpreter or a GPU, and how many SMs it has."""
from __future__ import annotations

import functools
import os

import numpy as np
import torch

CPU_SM_COUNT = 4  # the interpreter runs programs one by one; a small grid keeps it quick


def interpreting() -> bool:
    """True when Triton's CPU interpreter runs the kernels (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1). Triton's own is a constexpr function: microseconds per
    call from host code, which plan() and run() cannot afford."""
    return 1 << (n - 1).bit_length()


_NUMPY_MAJOR = int(np.__version__.split(".")[0])


def check_interpreter_numpy() -> None:
    if _NUMPY_MAJOR >= 2 and interpreting():
        raise RuntimeError(
            f"Triton's interpreter cannot run these kernels with numpy {np.__version__} (a loop bound "
            "loaded from memory fails under numpy 2); install numpy<2 (pip install 'numpy<2')"
        )


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return CPU_SM_COUNT
