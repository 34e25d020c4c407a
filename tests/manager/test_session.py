"""``CheckpointSession``, the folder's public interface under ``CheckpointManager`` and
torchtitan's backend: taking the folder, listing, tracking synchronous commits,
retention, fallback load, release. One rank, local folders."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from quicksave import api
from quicksave.commit import CheckpointKind
from quicksave.commit.rename import RenameCommit
from quicksave.errors import CheckpointNotFoundError
from quicksave.loading.checkpoint import Checkpoint
from quicksave.manager import CheckpointConfig
from quicksave.manager.lease import LEASE_NAME, FolderLease
from quicksave.manager.policies import KeepLatestK
from quicksave.manager.records import SaveRecord
from quicksave.manager.session import CheckpointSession
from quicksave.manager.tiers import FolderReader
from quicksave.storage import Location


def _session(folder: Path, keep: int = 2) -> CheckpointSession:
    config = CheckpointConfig(folder=str(folder), async_mode="disabled")
    return CheckpointSession(config, retention=KeepLatestK(keep))


def _commit(session: CheckpointSession, step: int) -> None:
    """A synchronous save of ``step`` as a front end makes it, then its bookkeeping."""
    path = session.step_path(step)
    api.save({"t": torch.full((4,), float(step))}, path, step=step)
    session.committed(SaveRecord(step, "full", path, 16, 0.0, 0.0, 0.0, 0.0))


def test_the_writer_takes_the_folder_and_a_second_one_is_read_only(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    first = _session(folder)
    assert first.take_folder(read_only=None, hint="stop that job") is None
    assert first.lease is not None and (folder / LEASE_NAME).exists()
    second = _session(folder)
    try:
        reason = second.take_folder(read_only=None, hint="stop that job")
        assert reason is not None and f"pid {os.getpid()}" in reason
        assert reason.startswith("this process (") and "close() that one first" in reason
        assert second.read_only_reason == reason and second.lease is None
    finally:
        second.release()
        first.release()
    assert not (folder / LEASE_NAME).exists()
    third = _session(folder)
    assert third.take_folder(read_only=None, hint="") is None  # released: free again
    third.release()


def test_a_read_only_session_creates_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    session = _session(folder)
    assert session.take_folder(read_only="eval only", hint="") == "eval only"
    assert session.read_only_reason == "eval only" and session.lease is None
    assert not folder.exists() and session.committed_steps() == []
    session.release()


def test_taking_a_folder_without_locks_warns_naming_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    folder = tmp_path / "ckpt"
    session = _session(folder)
    with caplog.at_level(logging.WARNING, logger="quicksave"):
        assert session.take_folder(read_only=None, hint="") is None
    try:
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(str(folder) in m and "not enforced" in m for m in warned), warned
    finally:
        session.release()


def test_commits_are_listed_and_retention_keeps_the_newest(tmp_path: Path) -> None:
    session = _session(tmp_path / "ckpt", keep=2)
    session.take_folder(read_only=None, hint="")
    try:
        for step in (1, 2, 3):
            _commit(session, step)
            session.housekeep(protect={step}, wait=True)
        assert session.committed_steps() == [2, 3]
        assert session.last_good == 3 and [r.step for r in session.metrics] == [1, 2, 3]
        assert session.is_committed(session.step_path(3))
        assert not session.is_committed(session.step_path(1))
        session.require_committed(3)
        with pytest.raises(CheckpointNotFoundError):
            session.require_committed(1)
    finally:
        session.release()


def test_load_newest_falls_back_and_notes_the_step_loaded(tmp_path: Path) -> None:
    session = _session(tmp_path / "ckpt", keep=5)
    session.take_folder(read_only=None, hint="")
    try:
        for step in (1, 2):
            _commit(session, step)
        tried: list[int] = []

        def load_step(step: int, checkpoint: Checkpoint) -> None:
            assert checkpoint.url == session.step_path(step)
            assert checkpoint.kind is CheckpointKind.QUICKSAVE  # from the folder's listing
            tried.append(step)
            if step == 2:
                os.remove(os.path.join(session.step_path(2), "manifest.json"))
                raise CheckpointNotFoundError("vanished", path=session.step_path(2))
            session.loaded(step)

        assert session.load_newest(load_step) == 1
        assert tried == [2, 1] and session.last_good == 1
    finally:
        session.release()
    empty = _session(tmp_path / "empty")
    assert empty.load_newest(lambda step, checkpoint: None) is None
    empty.release()


def test_one_rank_settles_and_agrees_alone(tmp_path: Path) -> None:
    session = _session(tmp_path / "ckpt")
    assert session.world_size() == 1 and session.rank() is None and session.is_coordinator()
    session.settle()  # nothing failed: nothing raised
    failure = CheckpointNotFoundError("gone")
    assert session.agree_failure(failure) is failure and session.agree_failure(None) is None
    session.release()


def test_the_session_holds_one_tier_with_the_parts_its_scheme_names(tmp_path: Path) -> None:
    session = _session(tmp_path / "ckpt", keep=3)
    try:
        [tier] = session.tiers
        assert tier.location == session.location and tier.location.url == session.folder
        assert tier.strategy is RenameCommit
        assert tier.lease == FolderLease.at
        assert isinstance(tier.retention, KeepLatestK) and tier.retention.k == 3
        assert isinstance(tier.reader, FolderReader)
        policy = KeepLatestK(1)
        session.retention = policy  # what a front end sets goes to the tier
        assert tier.retention is policy
    finally:
        session.release()


class _ListedReader(FolderReader):
    """A test double of a tier's reader: the folder's, recording what it is asked."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def committed_steps(self, location: Location, *, allow_dcp: bool, backend: Any) -> list[int]:
        self.asked.append(location.url)
        return super().committed_steps(location, allow_dcp=allow_dcp, backend=backend)


class _NamedLease(FolderLease):
    """A test double of a tier's writer lease: the flock lease, under another name."""

    unenforced_why = "a test double"


def test_a_session_uses_the_parts_of_its_tier(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    session = _session(folder)
    reader = _ListedReader()
    session.tiers = [dataclasses.replace(session.tier, reader=reader, lease=_NamedLease.at)]
    try:
        assert session.take_folder(read_only=None, hint="") is None
        assert isinstance(session.lease, _NamedLease)
        _commit(session, 5)
        assert session.committed_steps() == [5]
        assert reader.asked == [str(folder)]
    finally:
        session.release()
