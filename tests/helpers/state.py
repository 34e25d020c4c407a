"""Build test state dicts and compare tensors bit for bit."""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
import torch


def storable_dtypes() -> list[torch.dtype]:
    """Every dtype this torch can allocate with ``torch.zeros`` (quantized ones excluded)."""
    found = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    out = []
    for dtype in sorted(found, key=str):
        try:
            torch.zeros(1, dtype=dtype)
        except (RuntimeError, NotImplementedError):
            continue  # quantized dtypes need a quantizer
        out.append(dtype)
    return out


def quantized_dtypes() -> list[torch.dtype]:
    return [torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4]


def raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in C order, as uint8 (works for 0-dim, empty, non-contiguous)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaNs, infs and subnormals included).

    bool gets only 0/1 bytes: other bytes are not valid booleans.
    """
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    size = torch.empty((), dtype=dtype).element_size()
    data = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    return data.view(dtype).reshape(shape)


def filler_like(t: torch.Tensor, byte: int = 0xA5) -> torch.Tensor:
    """A tensor of ``t``'s shape and dtype whose bytes are all ``byte`` (bool: all True)."""
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    if out.numel():
        out.reshape(-1).view(torch.uint8).fill_(1 if t.dtype == torch.bool else byte)
    return out


def assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert torch.equal(raw(actual), raw(expected)), f"{what}: bytes differ"


def placeholder_like(value: Any) -> Any:
    """Same container structure as ``value`` (dicts, lists), tensors replaced by filler,
    other leaves by a marker string, so a load must replace every leaf."""
    if isinstance(value, torch.Tensor):
        return filler_like(value)
    if isinstance(value, dict):
        return {k: placeholder_like(v) for k, v in value.items()}
    if isinstance(value, list):
        return [placeholder_like(v) for v in value]
    return "<placeholder>"


def assert_same_value(actual: Any, expected: Any, where: str = "value") -> None:
    """Deep equality that is exact for floats (-0.0, NaN), tensors, arrays and BytesIO."""
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert_bit_equal(actual, expected, where)
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert actual.tobytes() == expected.tobytes(), where
    elif isinstance(expected, np.generic):
        assert actual.dtype == expected.dtype and actual.tobytes() == expected.tobytes(), where
    elif isinstance(expected, float):
        assert (math.isnan(actual) and math.isnan(expected)) or (
            actual == expected and math.copysign(1, actual) == math.copysign(1, expected)
        ), f"{where}: {actual!r} != {expected!r}"
    elif isinstance(expected, io.BytesIO):
        assert actual.getvalue() == expected.getvalue(), where
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for k in expected:
            assert_same_value(actual[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: length"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_value(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


class Holder:
    """A ``Stateful`` that holds any state dict as it is (for manager tests)."""

    def __init__(self, value: dict[str, Any]) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return self.value

    def load_state_dict(self, value: dict[str, Any]) -> None:
        self.value = value


class ManagerJob:
    """A tiny training job for manager tests: a linear model, its optimizer and a train
    state, stepped on a constant batch."""

    def __init__(self, features: int = 8, out: int = 4, optim: type = torch.optim.SGD) -> None:
        from quicksave.manager import TrainState

        torch.manual_seed(0)
        self.features = features
        self.model = torch.nn.Linear(features, out)
        self.optim = optim(self.model.parameters(), lr=0.1)
        self.train_state = TrainState()

    def states(self) -> dict[str, Any]:
        from quicksave.manager import ModelState, OptimizerState

        return {
            "model": ModelState(self.model),
            "optim": OptimizerState(self.model, self.optim),
            "train_state": self.train_state,
        }

    def step(self) -> int:
        self.optim.zero_grad()
        self.model(torch.ones(2, self.features)).sum().backward()
        self.optim.step()
        self.train_state.step += 1
        return self.train_state.step
