"""Exact comparison of (nested) state dicts, for resume and snapshot tests."""

from __future__ import annotations

import copy
from typing import Any

import torch


def snapshot(states: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of every state's ``state_dict()``: the values at this moment."""
    return {name: copy.deepcopy(state.state_dict()) for name, state in states.items()}


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Bit-exact equality of tensors (and dtype), containers and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
