"""Shared pytest fixtures: CUDA-marked tests are skipped when no GPU is present."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def device(request):
    """Run a test on the CPU, and on CUDA too when a GPU is present."""
    return torch.device(request.param)
