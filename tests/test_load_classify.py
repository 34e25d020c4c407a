"""One classification per load, whatever the entry point: on a store, where classifying
a checkpoint costs a listing, ``manager.load(step)``, ``manager.load()``,
``quicksave.load(path)`` and ``dcp.load`` through ``quicksave.StorageReader`` each list
once (the result is handed down the load, never classified again). ``memory://`` is an
fsspec store committed manifest-last, as S3: its listings are counted on the backend."""

from __future__ import annotations

import collections
import os
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import quicksave
from quicksave import CheckpointConfig, CheckpointManager, ModelState
from quicksave.storage.fsspec_store import FsspecBackend


@pytest.fixture
def listings(monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    """Every listing a store backend makes (``list`` and ``children``), by kind."""
    calls: collections.Counter = collections.Counter()
    for name in ("list", "children"):
        real = getattr(FsspecBackend, name)

        def counted(self: Any, prefix: str, _real: Callable = real, _name: str = name) -> Any:
            calls[_name] += 1
            return _real(self, prefix)

        monkeypatch.setattr(FsspecBackend, name, counted)
    return calls


@pytest.fixture
def root() -> Iterator[str]:
    yield f"memory://qs-classify-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def test_quicksave_load_lists_once(root: str, listings: collections.Counter) -> None:
    quicksave.save({"w": torch.arange(6.0), "n": 3}, f"{root}/a")
    out: dict[str, Any] = {"w": torch.zeros(6), "n": 0}
    listings.clear()
    quicksave.load(out, f"{root}/a")
    assert sum(listings.values()) == 1
    assert torch.equal(out["w"], torch.arange(6.0)) and out["n"] == 3


def test_dcp_load_through_the_storage_reader_lists_once(
    root: str, listings: collections.Counter
) -> None:
    quicksave.save({"w": torch.arange(6.0)}, f"{root}/a")
    out = {"w": torch.zeros(6)}
    listings.clear()
    with warnings.catch_warnings():  # DCP: torch.distributed is not initialized
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=quicksave.StorageReader(f"{root}/a"), no_dist=True)
    assert sum(listings.values()) == 1
    assert torch.equal(out["w"], torch.arange(6.0))


def test_a_manager_load_lists_once(root: str, listings: collections.Counter) -> None:
    model = _model()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    config = CheckpointConfig(folder=f"{root}/run", async_mode="disabled")
    with CheckpointManager(config, {"model": ModelState(model)}) as manager:
        manager.save(1, force=True)
        manager.save(2, force=True)
        with torch.no_grad():
            model.weight.zero_()
        listings.clear()
        assert manager.load(2) == 2  # the step asked for: classified once
        assert sum(listings.values()) == 1
        assert torch.equal(model.weight, saved["weight"])

        with torch.no_grad():
            model.weight.zero_()
        listings.clear()
        assert manager.load() == 2  # the newest: the folder's one listing classifies it
        assert dict(listings) == {"list": 1}
        assert torch.equal(model.weight, saved["weight"])
