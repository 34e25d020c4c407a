"""quicksave.load: strict and non-strict key matching, shape/dtype checks, and detection
of every kind of damage to the files (naming file, fqn and rank)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import quicksave
from helpers.checks import check_checkpoint, seal_manifest
from helpers.state import assert_bit_equal, filler_like
from quicksave.errors import CorruptCheckpointError, IncompatibleStateError


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(64, 64, generator=g), "b": torch.randn(8, generator=g)},
        "step": 5,
        "name": "run",
    }


def _dest() -> dict:
    return {
        "model": {"w": torch.zeros(64, 64), "b": torch.zeros(8)},
        "step": 0,
        "name": "",
    }


@pytest.fixture
def saved(ckpt: Path) -> Path:
    quicksave.save(_state(), ckpt, step=5)
    check_checkpoint(ckpt)
    return ckpt


def _chunk(path: Path, fqn: str) -> dict:
    return json.loads((path / "manifest.json").read_bytes())["tensors"][fqn]["chunks"][0]


def _load_error(cls, dest: dict, path: Path, **kwargs):
    with pytest.raises(cls) as info:
        quicksave.load(dest, path, **kwargs)
    return info.value


# --------------------------------------------------------------------- key matching


def test_full_load(saved: Path):
    dest = _dest()
    quicksave.load(dest, saved)
    expected = _state()
    assert_bit_equal(dest["model"]["w"], expected["model"]["w"])
    assert_bit_equal(dest["model"]["b"], expected["model"]["b"])
    assert (dest["step"], dest["name"]) == (5, "run")


def test_strict_missing_keys(saved: Path):
    dest = _dest()
    dest["model"]["extra"] = torch.zeros(3)
    dest["later"] = 1
    err = _load_error(IncompatibleStateError, dest, saved)
    assert str(err) == (
        "state dict keys do not match the checkpoint (missing from checkpoint: later, "
        "model.extra); pass strict=False to load the intersection "
        f"[path={saved}, fqn=later, rank=0]"
    )
    assert torch.equal(dest["model"]["w"], torch.zeros(64, 64))  # checked before any read


def test_strict_unexpected_keys(saved: Path):
    dest = _dest()
    del dest["model"]["b"], dest["name"]
    err = _load_error(IncompatibleStateError, dest, saved)
    assert str(err) == (
        "state dict keys do not match the checkpoint (in the checkpoint but not in the "
        "state dict of this process: model.b, name); pass strict=False to load the "
        "intersection "
        f"[path={saved}, fqn=model.b, rank=0]"
    )
    assert torch.equal(dest["model"]["w"], torch.zeros(64, 64))


def test_non_strict_loads_only_the_intersection(saved: Path):
    sentinel = torch.full((3,), 7.0)
    dest = {
        "model": {"w": torch.zeros(64, 64), "new_layer": sentinel.clone()},
        "step": 0,
        "fresh_value": "keep me",
    }
    quicksave.load(dest, saved, strict=False)
    assert_bit_equal(dest["model"]["w"], _state()["model"]["w"])
    assert dest["step"] == 5
    assert torch.equal(dest["model"]["new_layer"], sentinel)  # untouched
    assert dest["fresh_value"] == "keep me"
    assert set(dest) == {"model", "step", "fresh_value"} and set(dest["model"]) == {
        "w",
        "new_layer",
    }  # nothing only in the checkpoint was added


def test_non_strict_still_checks_shapes(saved: Path):
    dest = {"model": {"w": torch.zeros(64, 63)}}
    err = _load_error(IncompatibleStateError, dest, saved, strict=False)
    assert str(err) == (
        f"shape mismatch: checkpoint [64, 64], state dict [64, 63] [path={saved}, fqn=model.w, "
        "rank=0]"
    )


def test_shape_mismatch(saved: Path):
    dest = _dest()
    dest["model"]["b"] = torch.zeros(9)
    err = _load_error(IncompatibleStateError, dest, saved)
    assert str(err) == (
        f"shape mismatch: checkpoint [8], state dict [9] [path={saved}, fqn=model.b, rank=0]"
    )
    assert torch.equal(dest["model"]["w"], torch.zeros(64, 64))


def test_dtype_mismatch(saved: Path):
    dest = _dest()
    dest["model"]["w"] = torch.zeros(64, 64, dtype=torch.bfloat16)
    err = _load_error(IncompatibleStateError, dest, saved)
    assert str(err) == (
        "dtype mismatch: checkpoint float32, state dict bfloat16 "
        f"[path={saved}, fqn=model.w, rank=0]"
    )


def test_tensor_where_a_value_was_saved(saved: Path):
    dest = _dest()
    dest["step"] = torch.zeros(1)
    err = _load_error(IncompatibleStateError, dest, saved)
    assert str(err) == (
        "checkpoint holds a non-tensor value here but the state dict has a tensor "
        f"[path={saved}, fqn=step, rank=0]"
    )


def test_value_where_a_tensor_was_saved(saved: Path):
    dest = _dest()
    dest["model"]["b"] = "bias"
    err = _load_error(IncompatibleStateError, dest, saved)
    assert str(err) == (
        "checkpoint holds a tensor here but the state dict has a value of type str "
        f"[path={saved}, fqn=model.b, rank=0]"
    )


# ------------------------------------------------------------------------ corruption


def _flip(file: Path, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_corrupted_data_byte(saved: Path, where: str):
    chunk = _chunk(saved, "model.w")
    pos = {"first": 0, "middle": chunk["length"] // 2, "last": chunk["length"] - 1}[where]
    file = saved / chunk["file"]
    _flip(file, chunk["offset"] + pos)
    err = _load_error(CorruptCheckpointError, _dest(), saved)
    assert err.message.startswith("checksum mismatch in chunk at offsets [0, 0] (stored ")
    assert (err.path, err.fqn, err.rank) == (str(file), "model.w", 0)
    assert f"[path={file}, fqn=model.w, rank=0]" in str(err)


def test_corruption_in_a_tensor_not_loaded_is_not_read(saved: Path):
    chunk = _chunk(saved, "model.b")
    _flip(saved / chunk["file"], chunk["offset"])
    dest = {"model": {"w": torch.zeros(64, 64)}}
    quicksave.load(dest, saved, strict=False)
    assert_bit_equal(dest["model"]["w"], _state()["model"]["w"])
    err = _load_error(CorruptCheckpointError, _dest(), saved)
    assert err.fqn == "model.b"


def test_corruption_detected_with_non_contiguous_destination(saved: Path):
    # Goes through the bounce buffer rather than straight into the destination.
    chunk = _chunk(saved, "model.w")
    _flip(saved / chunk["file"], chunk["offset"] + 100)
    dest = _dest()
    dest["model"]["w"] = torch.zeros(64, 64).t()
    err = _load_error(CorruptCheckpointError, dest, saved)
    assert err.fqn == "model.w" and "checksum mismatch" in err.message


@pytest.mark.parametrize("keep", [0, 4096, 4096 + 1000])
def test_truncated_data_file(saved: Path, keep: int):
    chunk = _chunk(saved, "model.w")
    file = saved / chunk["file"]
    os.truncate(file, keep)
    err = _load_error(CorruptCheckpointError, _dest(), saved)
    assert str(err) == (
        f"data file is truncated: chunk needs bytes {chunk['offset']}.."
        f"{chunk['offset'] + chunk['length']}, file ends at {keep} "
        f"[path={file}, fqn=model.w, rank=0]"
    )


def test_missing_data_file(saved: Path):
    chunk = _chunk(saved, "model.w")
    file = saved / chunk["file"]
    file.unlink()
    err = _load_error(CorruptCheckpointError, _dest(), saved)
    assert str(err) == f"data file is missing [path={file}, fqn=model.w, rank=0]"


def test_corrupted_manifest(saved: Path):
    manifest = saved / "manifest.json"
    _flip(manifest, 40)
    err = _load_error(CorruptCheckpointError, _dest(), saved)
    assert err.message.startswith("manifest checksum mismatch (stored ")
    assert err.message.endswith("): the manifest was modified or damaged")
    assert err.path == str(manifest)


@pytest.mark.parametrize("size", [0, 1, 100, -3])
def test_truncated_manifest(saved: Path, size: int):
    manifest = saved / "manifest.json"
    data = manifest.read_bytes()
    manifest.write_bytes(data[:size])
    err = _load_error(CorruptCheckpointError, _dest(), saved)
    assert err.path == str(manifest)
    if size == -3:
        assert err.message.startswith("manifest checksum mismatch")
    else:
        assert err.message == "manifest has no manifest_xxh3_64 checksum"


def test_manifest_pointing_past_the_file(saved: Path):
    # A self-consistent manifest whose chunk lies beyond the end of its file.
    doc = json.loads((saved / "manifest.json").read_bytes())
    chunk = doc["tensors"]["model.b"]["chunks"][0]
    chunk["offset"] += 1 << 20
    (saved / "manifest.json").write_bytes(seal_manifest(doc))
    err = _load_error(CorruptCheckpointError, _dest(), saved)
    assert err.message.startswith("data file is truncated: chunk needs bytes ")
    assert err.fqn == "model.b" and err.path == str(saved / chunk["file"])


def test_load_leaves_checkpoint_bytes_alone(saved: Path, tmp_path: Path):
    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    quicksave.load(_dest(), saved)
    for p in copy.iterdir():
        assert (saved / p.name).read_bytes() == p.read_bytes()


def test_load_into_filler_is_exact_for_many_dtypes(ckpt: Path):
    sd = {
        str(d).removeprefix("torch."): torch.arange(6).to(d)
        for d in (torch.float16, torch.bfloat16, torch.int8, torch.uint16, torch.complex64)
    }
    quicksave.save(sd, ckpt)
    dest = {k: filler_like(v) for k, v in sd.items()}
    quicksave.load(dest, ckpt, thread_count=1)
    for k in sd:
        assert_bit_equal(dest[k], sd[k], k)
