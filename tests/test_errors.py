"""quicksave's errors: one family, each naming path, fqn and rank, with exact messages."""

from __future__ import annotations

import errno
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import quicksave
from quicksave.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleStateError,
    NotCommittedError,
    WorkerFailedError,
)

SUBCLASSES = [
    CheckpointNotFoundError,
    NotCommittedError,
    CorruptCheckpointError,
    IncompatibleStateError,
    CheckpointExistsError,
    WorkerFailedError,
]


def test_family():
    for cls in SUBCLASSES:
        assert issubclass(cls, CheckpointError) and issubclass(cls, Exception)
        assert getattr(quicksave, cls.__name__) is cls


def test_str_names_path_fqn_rank():
    err = CorruptCheckpointError("bad bytes", path=Path("/c/x"), fqn="m.w", rank=3)
    assert str(err) == "bad bytes [path=/c/x, fqn=m.w, rank=3]"
    assert (err.message, err.path, err.fqn, err.rank) == ("bad bytes", "/c/x", "m.w", 3)
    assert str(CheckpointError("plain")) == "plain"
    assert str(CheckpointError("r", rank=0)) == "r [rank=0]"


@pytest.mark.parametrize("cls", [CheckpointError, *SUBCLASSES])
def test_errors_survive_pickling(cls):
    # DCP gathers per-rank exceptions through pickle: the fields must survive.
    err = cls("msg", path="/p", fqn="a.b", rank=2)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls and str(back) == str(err)
    assert (back.message, back.path, back.fqn, back.rank) == ("msg", "/p", "a.b", 2)


# --------------------------------------------------------------- wrong paths on load


def test_load_missing_path(tmp_path: Path):
    path = tmp_path / "nope"
    with pytest.raises(CheckpointNotFoundError) as info:
        quicksave.load({"w": torch.zeros(1)}, path)
    assert str(info.value) == f"no such file or directory [path={path}]"
    # a FileNotFoundError too, as frameworks catch a missing checkpoint (Lightning)
    assert isinstance(info.value, FileNotFoundError)
    assert (info.value.errno, info.value.filename) == (errno.ENOENT, str(path))
    with pytest.raises(FileNotFoundError):
        quicksave.load_state(path)


def test_load_folder_that_is_not_a_checkpoint(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CheckpointNotFoundError) as info:
        quicksave.load({"w": torch.zeros(1)}, tmp_path)
    assert str(info.value) == f"not a checkpoint (no manifest.json) [path={tmp_path}]"


def test_load_a_file(tmp_path: Path):
    path = tmp_path / "model.pt"
    torch.save({"w": torch.zeros(1)}, path)
    with pytest.raises(CheckpointNotFoundError) as info:
        quicksave.load({"w": torch.zeros(1)}, path)
    assert info.value.message == "not a checkpoint (no manifest.json)"


def test_load_uncommitted(tmp_path: Path):
    quicksave.save({"w": torch.ones(2)}, tmp_path / "done")
    tmp = tmp_path / "step-5.tmp-0123456789ab"
    os.rename(tmp_path / "done", tmp)  # complete content, but never committed
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "rank-00000-00.safetensors").write_bytes(b"\0" * 10)
    for path in (tmp, partial):
        with pytest.raises(NotCommittedError) as info:
            quicksave.load({"w": torch.zeros(2)}, path)
        assert str(info.value) == (
            "checkpoint was never committed (a save was interrupted or is still running); "
            f"it is never loaded [path={path}]"
        )


def test_storage_reader_on_a_stock_dcp_dir(tmp_path: Path):
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    reader = quicksave.StorageReader(tmp_path / "d")
    with pytest.raises(CheckpointNotFoundError) as info:
        reader.read_metadata()
    assert info.value.message == (
        "this is a stock torch.distributed.checkpoint directory, not a quicksave one; "
        "quicksave.load() reads it through DCP's own reader"
    )


# ---------------------------------------------------------- bad input to save


def test_save_refuses_a_non_mapping(ckpt: Path):
    with pytest.raises(IncompatibleStateError) as info:
        quicksave.save([torch.ones(1)], ckpt)
    assert str(info.value) == (
        f"state_dict must be a mapping of names to values, got list [path={ckpt}]"
    )
    assert os.listdir(ckpt.parent) == []


@pytest.mark.parametrize(
    "tensor, message",
    [
        (
            torch.empty(2, device="meta"),
            "tensor is on the meta device (it has no data); materialize it first",
        ),
        (
            torch.eye(2).to_sparse(),
            "torch.sparse_coo tensors are not supported; save .to_dense() instead",
        ),
        (
            torch.quantize_per_tensor(torch.ones(2), 0.5, 0, torch.qint8),
            "quantized tensors (qint8) cannot be stored as raw bytes; save .int_repr() with its "
            "scale and zero point instead",
        ),
    ],
    ids=["meta", "sparse", "quantized"],
)
def test_save_refuses_unstorable_tensors_before_any_io(ckpt: Path, tensor, message: str):
    with pytest.raises(IncompatibleStateError) as info:
        quicksave.save({"fine": torch.ones(1), "layer": {"x": tensor}}, ckpt)
    assert str(info.value) == f"{message} [path={ckpt}, fqn=layer.x]"
    assert os.listdir(ckpt.parent) == []


def test_save_refuses_unstorable_object_before_any_io(ckpt: Path):
    class Opaque:
        pass

    with pytest.raises(IncompatibleStateError) as info:
        quicksave.save({"w": torch.ones(1), "cfg": {"thing": Opaque()}}, ckpt)
    assert str(info.value) == (
        "value of type test_errors.test_save_refuses_unstorable_object_before_any_io.<locals>."
        "Opaque cannot be stored without pickle; convert it to tensors, numbers, strings, "
        "bytes, lists or dicts (e.g. in the Stateful's state_dict()) "
        f"[path={ckpt}, fqn=cfg.thing]"
    )
    assert os.listdir(ckpt.parent) == []
