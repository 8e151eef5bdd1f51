"""Test setup: without CUDA the kernels run in Triton's interpreter, which must be chosen before
any kernel module is imported."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from paged_case import DEVICE, ON_GPU  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    """Tests marked slow are long interpreter cases that the CPU suite leaves to the GPU one."""
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="slow in Triton's interpreter: the GPU suite runs it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    return DEVICE
