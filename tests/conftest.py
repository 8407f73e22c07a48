"""Shared pytest configuration for cula's tests.

Tests marked ``@pytest.mark.gpu`` need a CUDA device; on a machine without one they are skipped
automatically here, so each GPU test file does not have to repeat the check (they may still add their
own ``skipif`` for clarity).
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every ``gpu``-marked test when ``torch.cuda.is_available()`` is False."""
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
