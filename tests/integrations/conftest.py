"""Lightning's ``Trainer(deterministic=True)`` turns on torch's deterministic algorithms
for the whole process and never turns them off; in this pytest process that changed
later tests (``torch.empty`` then fills memory, and fails for dtypes such as uint3).
Each test module here gives the process its settings back when it is done."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _restore_torch_determinism() -> Iterator[None]:
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = fill
    if cublas is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas
