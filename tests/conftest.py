"""Test setup: without CUDA the kernels run in Triton's interpreter, which must be chosen before
any kernel module is imported."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from paged_case import DEVICE  # noqa: E402,F401


@pytest.fixture
def device() -> torch.device:
    return DEVICE
