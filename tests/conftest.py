import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # Under MOE_TEST_DEVICE=cuda every test that takes the ``device`` fixture runs on the GPU, so it is a
    # CUDA test of that run: bench/gpu-check.sh selects the GPU's tests with ``-m cuda`` alone.
    on_cuda = os.environ.get("MOE_TEST_DEVICE") == "cuda"
    for item in items:
        if on_cuda and "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cuda)
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


@pytest.fixture
def device():
    """The device tests run on: CUDA when the run asks for it (MOE_TEST_DEVICE=cuda), else CPU."""
    return torch.device(os.environ.get("MOE_TEST_DEVICE", "cpu"))
