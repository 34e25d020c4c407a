"""Interoperability with stock torch.distributed.checkpoint, and the promise that loading
a quicksave checkpoint never unpickles anything."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.serialization
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import quicksave
from helpers.checks import check_checkpoint
from helpers.state import assert_same_value, placeholder_like, random_tensor


def _state() -> dict:
    return {
        "model": {
            "w": random_tensor((16, 8), torch.float32, seed=1),
            "h": random_tensor((5,), torch.bfloat16, seed=2),
            "i": random_tensor((3, 3), torch.int64, seed=3),
            "s": random_tensor((), torch.float64, seed=4),
        },
        "optim": {
            "state": {"w": {"exp_avg": random_tensor((16, 8), torch.float32, seed=5)}},
            "param_groups": [{"lr": 0.01, "betas": (0.9, 0.99), "params": ["w"]}],
        },
        "step": 12,
        "note": "stock",
    }


def test_stock_dcp_save_then_quicksave_load(tmp_path: Path):
    path = tmp_path / "dcp"
    sd = _state()
    dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    dest = placeholder_like(sd)
    quicksave.load(dest, path)
    assert_same_value(dest, sd, "sd")


def test_stock_dcp_save_then_quicksave_load_non_strict(tmp_path: Path):
    path = tmp_path / "dcp"
    sd = _state()
    dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    dest = {"model": {"w": torch.zeros(16, 8)}, "untouched": torch.ones(2)}
    quicksave.load(dest, path, strict=False)
    assert torch.equal(dest["model"]["w"], sd["model"]["w"])
    assert torch.equal(dest["untouched"], torch.ones(2))


def test_quicksave_then_stock_dcp_load_with_storage_reader(ckpt: Path):
    sd = _state()
    quicksave.save(sd, ckpt)
    check_checkpoint(ckpt)
    dest = placeholder_like(sd)
    dcp.load(
        dest,
        storage_reader=quicksave.StorageReader(ckpt),
        planner=DefaultLoadPlanner(),
        no_dist=True,
    )
    assert_same_value(dest, sd, "sd")


def test_stock_dcp_save_with_storage_writer_then_quicksave_load(ckpt: Path):
    sd = _state()
    dcp.save(sd, storage_writer=quicksave.StorageWriter(ckpt, step=4), no_dist=True)
    doc = check_checkpoint(ckpt)
    assert doc["step"] == 4 and doc["world_size"] == 1
    dest = placeholder_like(sd)
    quicksave.load(dest, ckpt)
    assert_same_value(dest, sd, "sd")


def test_storage_writer_through_checkpoint_id(ckpt: Path):
    sd = {"w": torch.arange(10.0)}
    writer = quicksave.StorageWriter("/nonexistent/elsewhere")
    dcp.save(sd, checkpoint_id=str(ckpt), storage_writer=writer, no_dist=True)
    dest = {"w": torch.zeros(10)}
    dcp.load(
        dest, checkpoint_id=str(ckpt), storage_reader=quicksave.StorageReader("/x"), no_dist=True
    )
    assert torch.equal(dest["w"], sd["w"])


def _forbid_unpickling(monkeypatch) -> list[str]:
    calls: list[str] = []

    def refuse(name):
        def fn(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} called while loading a quicksave checkpoint")

        return fn

    class NoUnpickler:
        def __init__(self, *args, **kwargs):
            refuse("pickle.Unpickler")()

    monkeypatch.setattr(pickle, "load", refuse("pickle.load"))
    monkeypatch.setattr(pickle, "loads", refuse("pickle.loads"))
    monkeypatch.setattr(pickle, "Unpickler", NoUnpickler)
    monkeypatch.setattr(torch, "load", refuse("torch.load"))
    monkeypatch.setattr(torch.serialization, "load", refuse("torch.serialization.load"))
    return calls


def test_quicksave_load_never_unpickles(ckpt: Path, monkeypatch):
    import io
    import random

    import numpy as np

    sd = _state()
    sd["extra"] = {
        "rng": random.Random(1).getstate(),
        "np": np.random.RandomState(2).get_state(),
        "blob": io.BytesIO(b"\x80\x04K\x01."),  # pickle bytes, stored as bytes only
        "dtype": torch.bfloat16,
    }
    quicksave.save(sd, ckpt)
    calls = _forbid_unpickling(monkeypatch)
    dest = placeholder_like(sd)
    quicksave.load(dest, ckpt)
    assert calls == []
    monkeypatch.undo()
    assert_same_value(dest, sd, "sd")


def test_forbidding_unpickling_is_effective(tmp_path: Path, monkeypatch):
    # Guards the test above: the same patching makes a pickle-based load fail.
    path = tmp_path / "dcp"
    dcp.save({"w": torch.ones(2), "o": {"x": 1}}, checkpoint_id=str(path), no_dist=True)
    calls = _forbid_unpickling(monkeypatch)
    with pytest.raises(quicksave.CheckpointError, match="called while loading") as info:
        quicksave.load({"w": torch.zeros(2), "o": {"x": 0}}, path)
    assert calls
    assert calls[0] in str(info.value)  # the refusal itself, not some other failure


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_dcp_metadata_is_unpickled_restricted_by_default(tmp_path: Path):
    path = tmp_path / "dcp"
    dcp.save({"w": torch.ones(2), "o": {"x": 1}}, checkpoint_id=str(path), no_dist=True)
    dest = {"w": torch.zeros(2), "o": {"x": 0}}
    quicksave.load(dest, path)  # DCP's own metadata classes pass the restriction
    assert torch.equal(dest["w"], torch.ones(2)) and dest["o"] == {"x": 1}
    marker = tmp_path / "ran"
    (path / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(marker))))
    with pytest.raises(quicksave.CheckpointError) as info:
        quicksave.load({"w": torch.zeros(2)}, path)
    assert info.value.path is not None and str(path) in info.value.path
    assert "system" in str(info.value)  # names the refused global
    assert not marker.exists()


def test_quicksave_checkpoint_loads_with_allow_dcp_pickle_false(ckpt: Path):
    quicksave.save({"w": torch.ones(3)}, ckpt)
    dest = {"w": torch.zeros(3)}
    quicksave.load(dest, ckpt, allow_dcp_pickle=False)
    assert torch.equal(dest["w"], torch.ones(3))
