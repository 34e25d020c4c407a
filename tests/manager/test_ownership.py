"""Folder ownership: the writer lease, clean-up that cannot hit a live writer, commits
that re-check their files, load() that falls back, and the pickle policy."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import quicksave
from quicksave.commit import files as commit
from quicksave.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    WorkerFailedError,
)
from quicksave.format import MANIFEST_NAME
from quicksave.loading.verify import verify_checkpoint
from quicksave.manager import CheckpointConfig, CheckpointManager
from quicksave.manager import folder as folder_mod
from quicksave.manager.lease import LEASE_NAME, FolderLease


class Box:
    """A Stateful holding one tensor and a counter."""

    def __init__(self, n: int = 1024) -> None:
        self.t = torch.zeros(n)
        self.count = 0

    def state_dict(self) -> dict:
        return {"t": self.t, "count": self.count}

    def load_state_dict(self, sd: dict) -> None:
        self.t.copy_(sd["t"])
        self.count = sd["count"]

    def set(self, value: int) -> None:
        self.t.fill_(float(value))
        self.count = value


def manager(folder: Path, box: Box, **kw) -> CheckpointManager:
    kw.setdefault("async_mode", "disabled")
    return CheckpointManager(CheckpointConfig(folder=str(folder), interval=1, **kw), {"box": box})


def save_steps(folder: Path, steps: list[int], **kw) -> None:
    box = Box()
    with manager(folder, box, **kw) as m:
        for s in steps:
            box.set(s)
            assert m.save(s, force=True)


def data_file(step_dir: Path) -> Path:
    return next(step_dir.glob("rank-*.safetensors"))


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------- the writer lease


def test_second_writer_is_read_only_and_says_who_holds_the_folder(tmp_path, caplog):
    save_steps(tmp_path, [1])
    box = Box()
    writer = manager(tmp_path, box)
    assert writer.read_only_reason is None
    with caplog.at_level(logging.WARNING, logger="quicksave"):
        second = manager(tmp_path, Box())
    assert second.read_only_reason is not None
    assert f"pid {os.getpid()}" in second.read_only_reason
    assert "read-only" in caplog.text
    with pytest.raises(CheckpointError, match="does not write checkpoints") as e:
        second.save(2, force=True)
    assert e.value.path == str(tmp_path)
    assert "writer lease" in str(e.value)
    restored = Box()
    assert manager(tmp_path, restored, read_only=True).load() == 1
    assert restored.count == 1
    assert second.load() == 1  # a read-only manager still loads
    box.set(2)
    assert writer.save(2, force=True)  # the first writer is unharmed
    writer.close()
    second.close()
    third = manager(tmp_path, Box())  # the lease is free again after close()
    assert third.read_only_reason is None
    third.close()


def test_lease_is_released_when_the_holder_is_killed(tmp_path):
    code = textwrap.dedent(
        f"""
        import sys, time
        from quicksave.manager.lease import FolderLease
        lease = FolderLease({str(tmp_path)!r})
        assert lease.try_acquire()
        print("held", flush=True)
        time.sleep(60)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        m = manager(tmp_path, Box())
        assert m.read_only_reason is not None
        assert f"pid {child.pid}" in m.read_only_reason
        m.close()
    finally:
        child.kill()
        child.wait()
    m = manager(tmp_path, Box())  # SIGKILL released the flock
    assert m.read_only_reason is None
    m.close()


def test_read_only_manager_creates_and_deletes_nothing(tmp_path):
    folder = tmp_path / "never-created"
    m = manager(folder, Box(), read_only=True, async_mode="process")
    assert m.load() is None
    assert m.session.writer is None  # no worker process, no staging pool
    assert not folder.exists()
    with pytest.raises(CheckpointError, match="read_only=True"):
        m.save(1, force=True)
    m.close()


def test_only_the_lease_holder_cleans_up_temporaries(tmp_path):
    save_steps(tmp_path, [1])
    stale = tmp_path / "step-2.tmp-0123456789ab"
    stale.mkdir()
    (stale / "rank-00000-00.safetensors").write_bytes(b"x" * 10)
    holder = FolderLease(str(tmp_path))
    assert holder.try_acquire()  # a live writer
    manager(tmp_path, Box()).close()  # becomes read-only: cleans nothing
    manager(tmp_path, Box(), read_only=True).close()
    assert stale.exists()
    holder.release()
    manager(tmp_path, Box()).close()  # lease free: the owner is provably gone
    assert not stale.exists()
    assert not list(tmp_path.glob("*.tmp-*"))


def test_lease_file_that_is_a_symlink_makes_a_read_only_manager(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("not yours")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / LEASE_NAME).symlink_to(target)
    m = manager(folder, Box())
    assert m.read_only_reason is not None and LEASE_NAME in m.read_only_reason
    assert target.read_text() == "not yours"
    m.close()


def test_eval_loop_beside_a_writing_job_never_tears_a_checkpoint(tmp_path):
    """A writer saving every step in process mode while managers are built on its
    folder and load from it: every committed checkpoint verifies, every save commits."""
    box = Box(1 << 16)
    writer = manager(tmp_path, box, async_mode="process", keep_latest_k=3)
    readers, loaded = 0, 0
    for step in range(1, 41):
        box.set(step)
        writer.save(step)
        reader = manager(tmp_path, Box(1 << 16))
        readers += 1
        got = reader.load()
        loaded += got is not None
        reader.close()
    writer.close()
    assert all(r.status == "committed" for r in writer.metrics)
    steps = folder_mod.committed_steps(str(tmp_path))
    assert steps[-1] == 40
    for s in steps:
        assert verify_checkpoint(str(tmp_path / f"step-{s}")).ok
    assert not list(tmp_path.glob("*.tmp-*"))
    assert loaded >= readers - 2  # only the first saves may not be committed yet


# ---------------------------------------------------------------- commits re-check


def test_commit_refuses_a_temporary_that_lost_a_file(tmp_path, monkeypatch):
    """Another process removes the temporary while the writer works: that save fails
    loudly and nothing is committed."""
    real = commit.publish

    def sabotaged(tmp, final, expected, **kwargs):
        os.unlink(next(Path(tmp).glob("rank-*.safetensors")))
        return real(tmp, final, expected, **kwargs)

    monkeypatch.setattr(commit, "publish", sabotaged)
    with pytest.raises(CheckpointError, match="gone from the temporary directory"):
        quicksave.save({"t": torch.ones(8)}, tmp_path / "step-1")
    assert not (tmp_path / "step-1").exists()


def test_commit_loses_the_race_to_a_clean_up_without_committing(tmp_path):
    tmp = tmp_path / "step-1.tmp-aaaaaaaaaaaa"
    tmp.mkdir()
    (tmp / "a").write_bytes(b"12345")
    assert commit.clean_stale_temporaries(str(tmp_path)) == [tmp.name]
    with pytest.raises(CheckpointError, match="gone from the temporary"):
        commit.publish(str(tmp), str(tmp_path / "step-1"), {"a": 5})
    assert not (tmp_path / "step-1").exists()


def test_commit_refuses_a_file_of_another_size(tmp_path):
    tmp = tmp_path / "x.tmp-aaaaaaaaaaaa"
    tmp.mkdir()
    (tmp / "a").write_bytes(b"123")
    with pytest.raises(CheckpointError, match="expected 5"):
        commit.publish(str(tmp), str(tmp_path / "x"), {"a": 5})
    assert tmp.exists() and not (tmp_path / "x").exists()


def test_save_onto_a_file_fails_before_writing(tmp_path):
    target = tmp_path / "taken"
    target.write_text("precious")
    with pytest.raises(CheckpointExistsError, match="a file is in the way") as e:
        quicksave.save({"t": torch.ones(1 << 20)}, target)
    assert e.value.path == str(target)
    assert target.read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no temporary left
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("x")
    with pytest.raises(CheckpointExistsError, match="not empty"):
        quicksave.save({"t": torch.ones(4)}, full)
    empty = tmp_path / "empty"
    empty.mkdir()
    quicksave.save({"t": torch.ones(4)}, empty)  # an empty directory is fine
    assert verify_checkpoint(str(empty)).ok


# ---------------------------------------------------------------- load() falls back


@pytest.mark.parametrize("damage", ["flip", "missing-file", "manifest"])
def test_load_falls_back_past_a_torn_newest_and_quarantines_it(tmp_path, damage, caplog):
    save_steps(tmp_path, [1, 2, 3])
    newest = tmp_path / "step-3"
    if damage == "flip":
        flip_last_byte(data_file(newest))
    elif damage == "missing-file":
        data_file(newest).unlink()
    else:
        (newest / MANIFEST_NAME).write_text("{}")
    box = Box()
    m = manager(tmp_path, box)
    with caplog.at_level(logging.ERROR, logger="quicksave"):
        assert m.load() == 2
    assert box.count == 2 and torch.equal(box.t, torch.full((1024,), 2.0))
    assert "step 3 cannot be loaded" in caplog.text
    assert not newest.exists()
    assert len(list(tmp_path.glob("step-3.corrupt-*"))) == 1
    assert m.committed_steps() == [1, 2]
    box.set(3)
    assert m.save(3, force=True)  # the step can be saved again
    m.close()
    assert verify_checkpoint(str(newest)).ok


def test_read_only_load_falls_back_without_touching_the_folder(tmp_path):
    save_steps(tmp_path, [1, 2])
    flip_last_byte(data_file(tmp_path / "step-2"))
    box = Box()
    assert manager(tmp_path, box, read_only=True).load() == 1
    assert box.count == 1
    assert (tmp_path / "step-2").exists()
    assert not list(tmp_path.glob("*.corrupt-*"))


def test_load_raises_when_no_checkpoint_passes(tmp_path):
    save_steps(tmp_path, [1, 2])
    for s in (1, 2):
        flip_last_byte(data_file(tmp_path / f"step-{s}"))
    with pytest.raises(CorruptCheckpointError, match="no committed checkpoint") as e:
        manager(tmp_path, Box(), read_only=True).load()
    assert "step 2:" in str(e.value) and "step 1:" in str(e.value)


def test_explicit_step_does_not_fall_back(tmp_path):
    save_steps(tmp_path, [1, 2])
    flip_last_byte(data_file(tmp_path / "step-2"))
    with pytest.raises(CorruptCheckpointError):
        manager(tmp_path, Box(), read_only=True).load(2)


def test_retention_keeps_the_last_checkpoint_that_passed(tmp_path, monkeypatch):
    save_steps(tmp_path, [1, 2, 3])
    flip_last_byte(data_file(tmp_path / "step-3"))
    monkeypatch.setattr(folder_mod, "quarantine", lambda path, why, *_: None)  # cannot move
    monkeypatch.setattr("quicksave.manager.session.quarantine", lambda path, why, *_: None)
    m = manager(tmp_path, Box(), keep_latest_k=1)
    assert m.load() == 2
    m.session.retain(set())
    assert m.committed_steps() == [2, 3]  # 3 is the newest, 2 the last good one
    m.close()


# ---------------------------------------------------------------- pickle policy


class _Boom:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_manager_never_runs_a_planted_pickle(tmp_path):
    save_steps(tmp_path, [1])
    marker = tmp_path / "pwned"
    planted = tmp_path / "step-999999"
    planted.mkdir()
    (planted / ".metadata").write_bytes(pickle.dumps(_Boom(str(marker))))
    box = Box()
    m = manager(tmp_path, box)
    assert m.committed_steps() == [1]
    assert m.latest_step() == 1
    assert m.load() == 1
    with pytest.raises(CheckpointNotFoundError, match="allow_dcp=True"):
        m.load(999999)
    m.close()
    opted = manager(tmp_path, Box(), allow_dcp=True)
    assert opted.committed_steps() == [1, 999999]
    assert opted.load() == 1  # the planted one is refused by the restricted unpickler
    opted.close()
    with pytest.raises(CheckpointError):
        quicksave.load({"box": Box()}, planted)
    assert not marker.exists()


def test_manager_loads_a_stock_dcp_folder_only_when_asked(tmp_path):
    state = {"box": {"t": torch.arange(16.0), "count": 7}}
    dcp.save(state, checkpoint_id=str(tmp_path / "step-5"), no_dist=True)
    assert manager(tmp_path, Box(16), read_only=True).load() is None
    box = Box(16)
    assert manager(tmp_path, box, read_only=True, allow_dcp=True).load() == 5
    assert box.count == 7 and torch.equal(box.t, torch.arange(16.0))


# ---------------------------------------------------------------- worker start-up


def test_worker_that_cannot_start_is_a_checkpoint_error(tmp_path, monkeypatch):
    fake = tmp_path / "python-not-executable"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o644)
    monkeypatch.setattr(sys, "executable", str(fake))
    with pytest.raises(WorkerFailedError, match="cannot start the checkpoint worker"):
        manager(tmp_path / "ckpt", Box(), async_mode="process").save(1, force=True)


def test_default_worker_timeout_detects_a_stopped_worker_within_ten_seconds(tmp_path):
    box = Box(1 << 16)
    m = manager(tmp_path, box, async_mode="process", staging="blocking")
    assert m.config.worker_timeout_s <= 10
    box.set(1)
    m.save(1)
    assert m.session.writer is not None and m.session.writer.drain(60)
    pid = m.session.writer.saver.worker_pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        began = time.monotonic()
        box.set(2)
        with pytest.raises(WorkerFailedError, match=r"it is stopped \(state [Tt]: SIGSTOP") as e:
            m.save(2)
            m.session.writer.drain(60)
            m.save(3)
        assert time.monotonic() - began < 10
        assert e.value.rank == 0
    finally:
        with contextlib.suppress(ProcessLookupError):  # the manager killed it
            os.kill(pid, signal.SIGCONT)
    box.set(4)
    assert m.save(4)  # a new worker
    m.close()
    assert 4 in m.committed_steps()
    assert m.metrics[-1].status == "committed"


def test_bad_user_metadata_is_refused_before_any_write(tmp_path):
    from quicksave.errors import IncompatibleStateError

    target = tmp_path / "step-1"
    with pytest.raises(IncompatibleStateError, match="user_metadata") as e:
        quicksave.save({"t": torch.ones(4)}, target, user_metadata={"x": float("nan")})
    assert e.value.path == str(target)
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_deleted_under_a_load_is_not_found_not_corrupt(tmp_path, monkeypatch):
    from quicksave.loading.reader import CheckpointReader

    target = tmp_path / "step-1"
    quicksave.save({"t": torch.ones(4)}, target)
    real = CheckpointReader.read_manifest

    def then_retention_deletes(self):
        manifest = real(self)
        commit.remove_tree(self.path)  # what another job's retention does
        return manifest

    monkeypatch.setattr(CheckpointReader, "read_manifest", then_retention_deletes)
    with pytest.raises(CheckpointNotFoundError, match="deleted while it was being loaded"):
        quicksave.load({"t": torch.zeros(4)}, target)


def test_retention_waits_for_a_checkpoint_known_to_pass(tmp_path):
    """A writer that never loaded, beside a torn newest checkpoint: nothing is deleted
    until one of its own saves commits (if that save failed, the older good ones must
    still be there)."""
    save_steps(tmp_path, [1, 2, 3])
    data_file(tmp_path / "step-3").unlink()
    box = Box()
    m = manager(tmp_path, box, keep_latest_k=1, async_mode="process")
    box.set(4)
    assert m.save(4, force=True)
    assert {1, 2} <= set(m.committed_steps())  # in flight: nothing deleted yet
    m.close()
    assert m.committed_steps() == [4]  # committed: now the policy applies


def test_deleting_under_a_parent_named_like_a_temporary_stays_in_that_parent(tmp_path, monkeypatch):
    folder = tmp_path / "run.tmp-x" / "ckpt"
    save_steps(folder, [1, 2])
    monkeypatch.setattr(commit.shutil, "rmtree", lambda *a, **k: None)  # crash mid-delete
    assert commit.remove_tree(str(folder / "step-1"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.tmp-x"]
    (doomed,) = [p.name for p in folder.iterdir() if p.name != "step-2"]
    assert doomed.startswith(".quicksave.step-1.tmp-del")  # beside it: start-up cleans it
