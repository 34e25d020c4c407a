"""One classification per load on S3, whatever the entry point: ``quicksave.load(path)``,
``dcp.load`` through ``quicksave.StorageReader``, ``manager.load(step)`` and
``manager.load()`` each make one listing of the store (``tests/test_load_classify.py``
counts the same on ``memory://``)."""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import quicksave
from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState
from quicksave.storage.s3.backend import S3Backend


@pytest.fixture
def listings(s3_server, monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    """The S3 environment chain pointing at the server, and every listing the S3
    backend makes (``list`` and ``children``), by kind."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    calls: collections.Counter = collections.Counter()
    for name in ("list", "children"):
        real = getattr(S3Backend, name)

        def counted(self: Any, prefix: str, _real: Callable = real, _name: str = name) -> Any:
            calls[_name] += 1
            return _real(self, prefix)

        monkeypatch.setattr(S3Backend, name, counted)
    return calls


def test_each_load_lists_the_store_once(listings: collections.Counter, s3_bucket: str) -> None:
    path = f"s3://{s3_bucket}/a"
    quicksave.save({"w": torch.arange(6.0), "n": 3}, path)
    out: dict[str, Any] = {"w": torch.zeros(6), "n": 0}
    listings.clear()
    quicksave.load(out, path)
    assert sum(listings.values()) == 1
    assert torch.equal(out["w"], torch.arange(6.0)) and out["n"] == 3

    out = {"w": torch.zeros(6), "n": 0}
    listings.clear()
    with warnings.catch_warnings():  # DCP: torch.distributed is not initialized
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=quicksave.StorageReader(path), no_dist=True)
    assert sum(listings.values()) == 1
    assert torch.equal(out["w"], torch.arange(6.0))


def test_a_manager_load_lists_the_store_once(listings: collections.Counter, s3_bucket: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    saved = model.weight.detach().clone()
    config = CheckpointConfig(folder=f"s3://{s3_bucket}/run", async_mode="disabled")
    with CheckpointManager(config, {"model": ModelState(model)}) as manager:
        manager.save(1, force=True)
        manager.save(2, force=True)
        for load, lists in ((lambda: manager.load(2), 1), (manager.load, 1)):
            with torch.no_grad():
                model.weight.zero_()
            listings.clear()
            assert load() == 2
            assert sum(listings.values()) == lists
            assert torch.equal(model.weight, saved)
