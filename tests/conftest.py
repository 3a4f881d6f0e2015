import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


@pytest.fixture
def device():
    """The device tests run on: CUDA when the run asks for it (MOE_TEST_DEVICE=cuda), else CPU."""
    import os

    return torch.device(os.environ.get("MOE_TEST_DEVICE", "cpu"))
