"""Stock DCP readers meeting a quicksave checkpoint (docs/FORMAT.md §5).

A quicksave-layout checkpoint without ``dcp_compat`` holds raw tensor bytes and keeps
its objects in the manifest: DCP's ``FileSystemReader`` cannot load it. Its ``.metadata``
says so: ``storage_data`` is an empty ``QuicksaveStorageData`` whose lookups raise a
``CheckpointError`` naming the format and what to do (before: ``KeyError:
MetadataIndex(fqn='pos', ...)``). With ``dcp_compat=True`` stock DCP still loads it.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

import quicksave
from quicksave.errors import CheckpointError
from quicksave.format.dcp_guard import QuicksaveStorageData, stock_reader_message
from quicksave.loading.verify import verify_checkpoint

MESSAGE = (
    "this is a quicksave checkpoint (format v1: its index is manifest.json, its data "
    "files hold raw tensor bytes), which torch.distributed.checkpoint's stock readers "
    "(FileSystemReader, dcp.load, stock torchtitan) cannot load. Load it with "
    "quicksave.load(state_dict, path) or dcp.load(state_dict, "
    "storage_reader=quicksave.StorageReader(path)), or convert it once: "
    "quicksave convert --to dcp CKPT OUT"
)


def _state() -> dict:
    return {"m": {"w": torch.ones(3)}, "pos": 5}


def _empty() -> dict:
    return {"m": {"w": torch.zeros(3)}, "pos": 0}


def test_stock_dcp_load_names_the_format_and_the_fix(ckpt: Path) -> None:
    quicksave.save(_state(), ckpt)
    with pytest.raises(CheckpointException) as info:
        dcp.load(_empty(), checkpoint_id=str(ckpt), no_dist=True)
    failure = info.value.failures[0]  # (exception, traceback) in torch 2.13
    failure = failure[0] if isinstance(failure, tuple) else failure
    assert isinstance(failure, CheckpointError)
    assert failure.message == MESSAGE
    assert failure.path == str(ckpt) and failure.fqn in ("m.w", "pos")
    # the one-line version DCP prints also carries it (and no KeyError)
    assert MESSAGE in str(info.value) and "KeyError" not in str(info.value)


def test_storage_data_is_an_empty_guard_and_deterministic(tmp_path: Path) -> None:
    for name in ("a", "b"):
        quicksave.save(_state(), tmp_path / name, step=3)
    raw = (tmp_path / "a" / ".metadata").read_bytes()
    assert raw == (tmp_path / "b" / ".metadata").read_bytes()
    md = pickle.loads(raw)
    assert isinstance(md, Metadata) and md.storage_meta is None
    assert type(md.storage_data) is QuicksaveStorageData and len(md.storage_data) == 0
    assert set(md.state_dict_metadata) == {"m.w", "pos"}
    with pytest.raises(CheckpointError) as info:
        md.storage_data[MetadataIndex("pos")]
    assert (info.value.message, info.value.fqn) == (stock_reader_message(), "pos")
    assert md.storage_data.get(MetadataIndex("pos")) is None  # get() does not raise


def test_quicksave_readers_are_unaffected(ckpt: Path) -> None:
    quicksave.save(_state(), ckpt)
    out = _empty()
    quicksave.load(out, ckpt)
    assert torch.equal(out["m"]["w"], torch.ones(3)) and out["pos"] == 5
    out = _empty()
    dcp.load(out, storage_reader=quicksave.StorageReader(ckpt), no_dist=True)
    assert torch.equal(out["m"]["w"], torch.ones(3)) and out["pos"] == 5
    assert verify_checkpoint(str(ckpt)).ok
    shown = subprocess.run(
        [sys.executable, "-m", "quicksave", "inspect", str(ckpt)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0 and "m.w" in shown.stdout, shown.stderr


def test_dcp_compatible_layout_still_loads_with_stock_dcp(ckpt: Path) -> None:
    dcp.save(_state(), storage_writer=quicksave.StorageWriter(ckpt, dcp_compat=True), no_dist=True)
    out = _empty()
    dcp.load(out, checkpoint_id=str(ckpt), no_dist=True)
    assert torch.equal(out["m"]["w"], torch.ones(3)) and out["pos"] == 5
    assert type(pickle.loads((ckpt / ".metadata").read_bytes()).storage_data) is dict


def test_without_quicksave_the_unpickler_names_it(ckpt: Path) -> None:
    quicksave.save(_state(), ckpt)
    script = textwrap.dedent(
        f"""
        import sys

        class NoQuicksave:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "quicksave":
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

        sys.meta_path.insert(0, NoQuicksave())
        import torch
        import torch.distributed.checkpoint as dcp
        try:
            dcp.load({{"m": {{"w": torch.zeros(3)}}, "pos": 0}}, checkpoint_id={str(ckpt)!r},
                     no_dist=True)
        except BaseException as e:
            print(str(e))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert "No module named 'quicksave'" in done.stdout, done.stdout + done.stderr
