"""``overwrite=True``: ``quicksave.save`` and ``AsyncSaver.save`` replace a committed
checkpoint atomically (the new one is written beside it and the two directories are
exchanged at the commit), and a failed save leaves the old one whole."""

from __future__ import annotations

import functools
import os

import pytest
import torch

import quicksave
from quicksave.commit import CheckpointKind, classify
from quicksave.commit import files as commit
from quicksave.commit.strategy import EXISTS_REPLACEABLE
from quicksave.errors import CheckpointError, CheckpointExistsError, IncompatibleStateError
from quicksave.saving.config import EngineConfig
from quicksave.saving.engine import AsyncSaver


def _state(v: float) -> dict:
    return {"w": torch.full((64,), v), "meta": {"epoch": int(v), "name": f"v{v}"}}


def _loaded(path) -> dict:
    dest = {"w": torch.zeros(64), "meta": {"epoch": -1, "name": ""}}
    quicksave.load(dest, path)
    return dest


def _siblings(path) -> list[str]:
    return sorted(os.listdir(os.path.dirname(os.fspath(path))))


def test_save_overwrite_replaces_a_committed_checkpoint(ckpt):
    quicksave.save(_state(1.0), ckpt, step=1)
    ino = os.stat(ckpt).st_ino
    quicksave.save(_state(2.0), ckpt, step=2, overwrite=True)
    got = _loaded(ckpt)
    assert torch.equal(got["w"], torch.full((64,), 2.0))
    assert got["meta"] == {"epoch": 2, "name": "v2.0"}
    assert os.stat(ckpt).st_ino != ino  # a new directory took the name
    assert _siblings(ckpt) == ["ckpt"]  # the old one and the temporary are gone


def test_save_overwrite_onto_nothing_is_a_plain_save(ckpt):
    quicksave.save(_state(3.0), ckpt, overwrite=True)
    assert torch.equal(_loaded(ckpt)["w"], torch.full((64,), 3.0))


def test_save_without_overwrite_still_refuses(ckpt):
    quicksave.save(_state(1.0), ckpt)
    with pytest.raises(CheckpointExistsError, match="already exists") as e:
        quicksave.save(_state(2.0), ckpt)
    assert e.value.path == str(ckpt)
    assert torch.equal(_loaded(ckpt)["w"], torch.full((64,), 1.0))


def test_overwrite_never_replaces_what_is_not_a_checkpoint(tmp_path):
    f = tmp_path / "file.ckpt"
    f.write_bytes(b"torch.save bytes")
    with pytest.raises(CheckpointExistsError, match="a file is in the way"):
        quicksave.save(_state(1.0), f, overwrite=True)
    assert f.read_bytes() == b"torch.save bytes"
    d = tmp_path / "dir"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointExistsError, match="not empty"):
        quicksave.save(_state(1.0), d, overwrite=True)
    assert (d / "notes.txt").read_text() == "mine"


def test_failed_overwrite_before_io_keeps_the_old_checkpoint(ckpt):
    quicksave.save(_state(1.0), ckpt, step=1)
    bad = {**_state(2.0), "hparams": {"data_dir": object()}}
    with pytest.raises(IncompatibleStateError) as e:
        quicksave.save(bad, ckpt, overwrite=True)
    assert e.value.path == str(ckpt) and e.value.fqn == "hparams.data_dir"
    assert torch.equal(_loaded(ckpt)["w"], torch.full((64,), 1.0))
    assert _siblings(ckpt) == ["ckpt"]


def test_failed_overwrite_while_writing_keeps_the_old_checkpoint(ckpt, monkeypatch):
    quicksave.save(_state(1.0), ckpt, step=1)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(quicksave.worker.persist, "write_file", disk_full)
    with pytest.raises(CheckpointError, match="No space left"):
        quicksave.save(_state(2.0), ckpt, overwrite=True)
    monkeypatch.undo()
    assert torch.equal(_loaded(ckpt)["w"], torch.full((64,), 1.0))
    assert _siblings(ckpt) == ["ckpt"]  # the new save's temporary was removed


def test_failed_overwrite_at_the_commit_keeps_the_old_checkpoint(ckpt, monkeypatch):
    quicksave.save(_state(1.0), ckpt, step=1)

    def damaged(tmp, expected, final):
        raise CheckpointError("cannot commit: a file is gone", path=final)

    monkeypatch.setattr(commit, "check_whole", damaged)
    with pytest.raises(CheckpointError, match="a file is gone"):
        quicksave.save(_state(2.0), ckpt, overwrite=True)
    monkeypatch.undo()
    assert torch.equal(_loaded(ckpt)["w"], torch.full((64,), 1.0))
    assert _siblings(ckpt) == ["ckpt"]


@pytest.mark.parametrize("url", ["s3://bucket/run/last.ckpt", "msc://profile/run/last.ckpt"])
def test_overwrite_on_an_object_store_is_refused_before_any_io(url):
    with pytest.raises(CheckpointError, match="not supported on an object store") as e:
        quicksave.save(_state(1.0), url, overwrite=True)
    assert e.value.path == url
    with pytest.raises(CheckpointError, match="not supported on an object store"):
        quicksave.StorageWriter(url, overwrite=True)


def test_storage_writer_overwrite_through_dcp(ckpt):
    import torch.distributed.checkpoint as dcp

    quicksave.save(_state(1.0), ckpt)
    writer = quicksave.StorageWriter(ckpt, overwrite=True)
    dcp.save(_state(5.0), storage_writer=writer, no_dist=True)
    assert torch.equal(_loaded(ckpt)["w"], torch.full((64,), 5.0))
    with pytest.raises(dcp.CheckpointException) as e:
        dcp.save(_state(6.0), storage_writer=quicksave.StorageWriter(ckpt), no_dist=True)
    assert isinstance(e.value.failures[0][0], CheckpointExistsError)


# ------------------------------------------------------------------ the async engine


def test_async_saver_overwrite_replaces(ckpt):
    with AsyncSaver(EngineConfig(mode="thread")) as saver:
        saver.save(_state(1.0), ckpt, step=1).wait()
        with pytest.raises(CheckpointExistsError):  # the writer checks, not save()
            saver.save(_state(2.0), ckpt, step=2).wait()
        saver.save(_state(2.0), ckpt, step=2, overwrite=True).wait()
    assert torch.equal(_loaded(ckpt)["w"], torch.full((64,), 2.0))
    assert _siblings(ckpt) == ["ckpt"]


def test_async_saver_failed_overwrite_keeps_the_old_checkpoint(ckpt, monkeypatch):
    with AsyncSaver(EngineConfig(mode="thread")) as saver:
        saver.save(_state(1.0), ckpt, step=1).wait()

        def damaged(tmp, expected, final):
            raise CheckpointError("cannot commit: a file is gone", path=final)

        monkeypatch.setattr(commit, "check_whole", damaged)
        handle = saver.save(_state(2.0), ckpt, step=2, overwrite=True)
        with pytest.raises(CheckpointError, match="a file is gone"):
            handle.wait()
        monkeypatch.undo()
    assert torch.equal(_loaded(ckpt)["w"], torch.full((64,), 1.0))
    assert _siblings(ckpt) == ["ckpt"]


def test_async_saver_overwrite_on_an_object_store_is_refused():
    with AsyncSaver(EngineConfig(mode="thread")) as saver:
        with pytest.raises(CheckpointError, match="not supported on an object store"):
            saver.save(_state(1.0), "s3://bucket/run/last.ckpt", overwrite=True)


def test_overwrite_without_an_atomic_exchange_never_loses_the_old_checkpoint(
    ckpt, monkeypatch, caplog
):
    """Where the filesystem cannot exchange two directories, the old checkpoint is moved
    to ``<name>.replaced-<token>`` (invisible, never cleaned up) and deleted only once
    the new one is in place; a crash between the renames leaves it there whole."""
    quicksave.save(_state(1.0), ckpt, step=1)
    monkeypatch.setattr(commit, "_rename_exchange", lambda a, b: False)
    quicksave.save(_state(2.0), ckpt, step=2, overwrite=True)
    assert torch.equal(_loaded(ckpt)["w"], torch.full((64,), 2.0))
    assert _siblings(ckpt) == ["ckpt"]
    assert "cannot exchange directories atomically" in caplog.text

    # A crash right after the old one was moved aside: it is whole and invisible.
    real_rename = os.rename

    def crash_on_second_rename(src, dst):
        real_rename(src, dst)
        if commit.REPLACED_MARK in os.fspath(dst):
            raise KeyboardInterrupt("killed between the two renames")

    monkeypatch.setattr(commit.os, "rename", crash_on_second_rename)
    with pytest.raises(KeyboardInterrupt, match="killed between the two renames"):
        quicksave.save(_state(3.0), ckpt, step=3, overwrite=True)  # an interrupt stays one
    assert not os.path.exists(ckpt)  # the window: nothing at the name
    (aside,) = [n for n in _siblings(ckpt) if commit.REPLACED_MARK in n]
    parked = os.path.join(os.path.dirname(os.fspath(ckpt)), aside)
    assert classify(parked) is CheckpointKind.UNCOMMITTED  # never listed
    monkeypatch.setattr(commit.os, "rename", real_rename)
    os.rename(parked, os.fspath(ckpt) + "-restored")
    assert torch.equal(_loaded(os.fspath(ckpt) + "-restored")["w"], torch.full((64,), 2.0))


def test_the_refusal_names_overwrite_and_following_it_works(tmp_path):
    """Each entry point that has ``overwrite`` refuses a committed checkpoint with a
    message naming ``overwrite=True``; passing it then replaces the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException

    from quicksave.compat.nvrx import (
        AsyncCallsQueue,
        AsyncRequest,
        FileSystemWriterAsync,
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
    )

    def via_save(path, overwrite):
        quicksave.save(_state(2.0), path, overwrite=overwrite)

    def via_engine(path, overwrite):
        saver = AsyncSaver(EngineConfig(mode="thread"))
        try:
            handle = saver.save(_state(2.0), path, overwrite=overwrite)
            handle.wait()
        finally:
            saver.close()

    def via_storage_writer(path, overwrite, cls=quicksave.StorageWriter):
        writer = cls(path, overwrite=overwrite)
        try:
            dcp.save(_state(2.0), storage_writer=writer, no_dist=True)
        except CheckpointException as e:  # DCP wraps the rank's failure
            (failure,) = e.failures.values()
            raise failure[0] if isinstance(failure, tuple) else failure from None

    def via_nvrx_writer(path, overwrite):  # NVRx's flow: plan, then a queued request
        writer = FileSystemWriterAsync(str(path), overwrite=overwrite)
        ret = save_state_dict_async_plan(_state(2.0), writer, None, 0)
        save_fn, preload_fn, save_args = writer.get_save_function_and_args()
        queue = AsyncCallsQueue()
        try:
            finalize = functools.partial(save_state_dict_async_finalize, *ret)
            queue.schedule_async_request(
                AsyncRequest(save_fn, save_args, [finalize], preload_fn=preload_fn)
            )
            queue.maybe_finalize_async_calls(blocking=True)
        finally:
            queue.close()

    for name, call in {
        "save": via_save,
        "AsyncSaver.save": via_engine,
        "StorageWriter": via_storage_writer,
        "FileSystemWriterAsync": via_nvrx_writer,
    }.items():
        path = tmp_path / name
        quicksave.save(_state(1.0), path)
        with pytest.raises(CheckpointExistsError) as e:
            call(path, False)
        assert e.value.message == EXISTS_REPLACEABLE, name
        assert "quicksave never overwrites one unless asked: pass overwrite=True" in str(e.value)
        assert e.value.path == str(path)
        assert torch.equal(_loaded(path)["w"], torch.full((64,), 1.0)), name
        call(path, True)  # the way the message names
        assert torch.equal(_loaded(path)["w"], torch.full((64,), 2.0)), name
