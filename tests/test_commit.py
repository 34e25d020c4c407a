"""Commit: a checkpoint is visible whole or not at all — during a save, after a failed
save, and after the saving process is SIGKILLed at any moment."""

from __future__ import annotations

import errno
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import CheckpointException

import quicksave
from helpers.checks import check_checkpoint
from helpers.state import assert_bit_equal
from quicksave.commit import CheckpointKind, classify, is_temp_name
from quicksave.commit import files as commit
from quicksave.commit.files import clean_stale_temporaries
from quicksave.commit.kinds import final_name, temp_name
from quicksave.commit.strategy import EXISTS_REPLACEABLE
from quicksave.loading.catalog import list_checkpoints
from quicksave.storage import posix_io
from quicksave.worker import persist

HELPERS = Path(__file__).parent / "helpers"


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g), "n": seed}


def _snapshot(root: Path) -> dict[str, bytes]:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


# ------------------------------------------------------------------ while saving


def test_only_a_temporary_exists_while_saving(ckpt: Path, monkeypatch):
    seen: dict[str, object] = {}
    real_write = persist.write_rank
    real_publish = commit.publish

    def write_rank(backend, directory, *args, **kwargs):
        seen["during_write"] = sorted(os.listdir(ckpt.parent))
        seen["kind_target"] = classify(str(ckpt))
        seen["kind_tmp"] = classify(directory)
        return real_write(backend, directory, *args, **kwargs)

    def publish(tmp, final, expected, **kwargs):
        seen["before_rename"] = sorted(os.listdir(tmp))
        seen["kind_before_rename"] = classify(tmp)
        with pytest.raises(quicksave.NotCommittedError):
            quicksave.load(_state(), tmp)
        with pytest.raises(quicksave.CheckpointNotFoundError):
            quicksave.load(_state(), final)
        real_publish(tmp, final, expected, **kwargs)

    monkeypatch.setattr(persist, "write_rank", write_rank)
    monkeypatch.setattr(commit, "publish", publish)
    quicksave.save(_state(), ckpt)

    (tmp_name,) = seen["during_write"]
    # hidden, the name encoded (FORMAT.md §6): nothing a scan by name takes for "ckpt"
    assert tmp_name.startswith(".quicksave.ckpt.tmp-")
    assert len(tmp_name) == len(".quicksave.ckpt.tmp-") + 12
    assert seen["kind_target"] is CheckpointKind.MISSING
    assert seen["kind_tmp"] is CheckpointKind.UNCOMMITTED
    assert "manifest.json" in seen["before_rename"] and ".metadata" in seen["before_rename"]
    assert seen["kind_before_rename"] is CheckpointKind.UNCOMMITTED  # manifest alone is no commit
    assert os.listdir(ckpt.parent) == ["ckpt"]  # no temporary left behind
    assert classify(str(ckpt)) is CheckpointKind.QUICKSAVE
    check_checkpoint(ckpt)


def test_existing_checkpoint_is_never_overwritten(ckpt: Path):
    quicksave.save(_state(1), ckpt, step=1)
    before = _snapshot(ckpt.parent)
    with pytest.raises(quicksave.CheckpointExistsError) as info:
        quicksave.save(_state(2), ckpt, step=2)
    assert info.value.message == (
        "a committed checkpoint already exists here; quicksave never overwrites one unless "
        "asked: pass overwrite=True (quicksave.save, StorageWriter, AsyncSaver.save on one "
        "rank) to replace it atomically, or choose another path or delete it first"
    )
    assert info.value.path == str(ckpt)
    assert _snapshot(ckpt.parent) == before  # untouched, and no temporary created
    dest = _state(9)
    quicksave.load(dest, ckpt)
    assert_bit_equal(dest["w"], _state(1)["w"])
    assert dest["n"] == 1


def test_existing_dcp_checkpoint_is_never_overwritten(ckpt: Path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(ckpt), no_dist=True)
    before = _snapshot(ckpt.parent)
    with pytest.raises(quicksave.CheckpointExistsError):
        quicksave.save(_state(), ckpt)
    assert _snapshot(ckpt.parent) == before


def test_storage_writer_refuses_existing_checkpoint(ckpt: Path):
    import torch.distributed.checkpoint as dcp

    quicksave.save(_state(1), ckpt)
    before = _snapshot(ckpt.parent)
    with pytest.raises(CheckpointException) as info:  # DCP wraps every rank's failure
        dcp.save(_state(2), storage_writer=quicksave.StorageWriter(ckpt), no_dist=True)
    (failure,) = info.value.failures.values()
    failure = failure[0] if isinstance(failure, tuple) else failure  # (exception, traceback)
    assert isinstance(failure, quicksave.CheckpointExistsError)
    assert failure.message == EXISTS_REPLACEABLE
    assert _snapshot(ckpt.parent) == before


def test_target_is_a_non_empty_plain_directory(ckpt: Path):
    ckpt.mkdir()
    (ckpt / "notes.txt").write_text("mine")
    with pytest.raises(quicksave.CheckpointExistsError) as info:
        quicksave.save(_state(), ckpt)
    assert info.value.message.startswith(  # refused before anything is written
        "a directory that is not empty (not a committed checkpoint) is in the way"
    )
    assert sorted(os.listdir(ckpt.parent)) == ["ckpt"]  # no temporary was made
    assert sorted(os.listdir(ckpt)) == ["notes.txt"]
    assert os.listdir(ckpt) == ["notes.txt"] and (ckpt / "notes.txt").read_text() == "mine"


def test_target_is_an_empty_directory(ckpt: Path):
    ckpt.mkdir()
    quicksave.save(_state(), ckpt)
    assert classify(str(ckpt)) is CheckpointKind.QUICKSAVE
    assert os.listdir(ckpt.parent) == ["ckpt"]


# ----------------------------------------------------------------- failed saves


def test_failure_while_writing_data_leaves_nothing(ckpt: Path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(persist, "write_rank", boom)
    with pytest.raises(quicksave.CheckpointError) as info:
        quicksave.save(_state(), ckpt)
    assert info.value.message == "RuntimeError: disk on fire"
    assert (info.value.path, info.value.rank) == (str(ckpt), 0)
    assert os.listdir(ckpt.parent) == []


def test_enospc_on_fsync_names_file_and_rank(ckpt: Path, monkeypatch):
    real_fsync = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".safetensors"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(quicksave.CheckpointError) as info:
        quicksave.save(_state(), ckpt)
    err = info.value
    assert err.message == "writing checkpoint data failed: ENOSPC (No space left on device)"
    assert err.rank == 0 and ".tmp-" in err.path and err.path.endswith(".safetensors")
    assert os.listdir(ckpt.parent) == []


@pytest.mark.parametrize("target", ["write_durable", "publish"])
def test_failure_while_committing_leaves_nothing(ckpt: Path, monkeypatch, target: str):
    def boom(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(posix_io if target == "write_durable" else commit, target, boom)
    with pytest.raises(quicksave.CheckpointError) as info:
        quicksave.save(_state(), ckpt)
    assert "Input/output error" in info.value.message and info.value.rank == 0
    assert os.listdir(ckpt.parent) == []


def test_parent_cannot_be_created(tmp_path: Path):
    (tmp_path / "a_file").write_text("x")
    target = tmp_path / "a_file" / "ckpt"
    with pytest.raises(quicksave.CheckpointError) as info:
        quicksave.save(_state(), target)
    assert info.value.message.startswith("cannot create the checkpoint's temporary directory: ")
    assert "ENOTDIR" in info.value.message
    assert info.value.path == str(target) and info.value.rank == 0
    assert os.listdir(tmp_path) == ["a_file"]


def test_failed_save_can_be_retried(ckpt: Path, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(commit, "publish", lambda *args: (_ for _ in ()).throw(OSError("x")))
        with pytest.raises(quicksave.CheckpointError):
            quicksave.save(_state(), ckpt)
    quicksave.save(_state(), ckpt)
    check_checkpoint(ckpt)


# ------------------------------------------------------------ classify and cleanup


def test_classify_and_clean_stale_temporaries(tmp_path: Path):
    quicksave.save(_state(), tmp_path / "step-1")
    quicksave.save(_state(), tmp_path / "step-2.tmp-0123456789ab")  # committed content, tmp name
    (tmp_path / "step-3.tmp-aaaaaaaaaaaa").mkdir()
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "rank-00000-00.safetensors").write_bytes(b"x")
    (tmp_path / "plain").mkdir()
    (tmp_path / "file.txt").write_text("x")
    kinds = {p.name: classify(str(p)) for p in tmp_path.iterdir()}
    assert kinds == {
        "step-1": CheckpointKind.QUICKSAVE,
        "step-2.tmp-0123456789ab": CheckpointKind.UNCOMMITTED,
        "step-3.tmp-aaaaaaaaaaaa": CheckpointKind.UNCOMMITTED,
        "partial": CheckpointKind.UNCOMMITTED,
        "plain": CheckpointKind.NOT_CHECKPOINT,
        "file.txt": CheckpointKind.NOT_CHECKPOINT,
    }
    assert classify(str(tmp_path / "nope")) is CheckpointKind.MISSING
    removed = clean_stale_temporaries(str(tmp_path))
    assert removed == ["step-2.tmp-0123456789ab", "step-3.tmp-aaaaaaaaaaaa"]
    assert sorted(os.listdir(tmp_path)) == ["file.txt", "partial", "plain", "step-1"]
    assert clean_stale_temporaries(str(tmp_path / "nope")) == []


def test_temporaries_are_hidden_and_hold_their_checkpoints_name_encoded():
    """FORMAT.md §6: ``.quicksave.<encoded name>.tmp-<token>``; the encoded name is
    letters, digits, - and %XX only, so no scan by name (``*.ckpt``, ``hpc_ckpt_<N>``)
    takes a temporary for its checkpoint."""
    for name in ["hpc_ckpt_2.ckpt", "epoch=3-step=40.ckpt", "step-5", "ünï côdé", ".x%41"]:
        tmp = temp_name(name, "355f6ce9e4fe")
        assert tmp.startswith(".quicksave.") and tmp.endswith(".tmp-355f6ce9e4fe")
        assert re.fullmatch(r"[A-Za-z0-9%-]+", tmp[len(".quicksave.") : -len(".tmp-355f6ce9e4fe")])
        assert is_temp_name(tmp) and final_name(tmp) == name
    assert temp_name("hpc_ckpt_2.ckpt", "ab") == ".quicksave.hpc%5Fckpt%5F2%2Eckpt.tmp-ab"
    long = "é" * 200 + ".ckpt"  # 405 bytes: only the beginning of the name is kept
    doomed = temp_name(long, "del" + "0" * 12)
    assert len(doomed.encode()) <= 255 and is_temp_name(doomed)
    assert long.startswith(final_name(doomed)) and len(final_name(doomed)) > 30
    assert final_name("step-5.tmp-0123456789ab") == "step-5"  # earlier versions' names


def test_an_interrupted_saves_leftover_is_hidden_and_cleaned(tmp_path: Path, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(commit, "publish", lambda *args, **kwargs: None)  # dies before the rename
        quicksave.save(_state(), tmp_path / "hpc_ckpt_2.ckpt")
        quicksave.save(_state(), tmp_path / "step-7")
    left = sorted(os.listdir(tmp_path))
    assert [final_name(n) for n in left] == ["hpc_ckpt_2.ckpt", "step-7"]
    for name in left:
        assert name.startswith(".quicksave.") and "ckpt_" not in name
        assert not name.endswith(".ckpt")
        assert classify(str(tmp_path / name)) is CheckpointKind.UNCOMMITTED
    partial = tmp_path / temp_name("step-9", "0123456789ab")  # no manifest yet
    partial.mkdir()
    (partial / "rank-00000-00.safetensors").write_bytes(b"x")
    # quicksave ls: uncommitted; the step from the manifest, else the checkpoint's name
    assert {(i.name, i.step, i.committed) for i in list_checkpoints(str(tmp_path))} == {
        (left[0], None, False),
        (left[1], None, False),
        (partial.name, 9, False),
    }
    (tmp_path / "step-3.tmp-aaaaaaaaaaaa").mkdir()  # an earlier version's leftover
    assert clean_stale_temporaries(str(tmp_path)) == sorted(
        [*left, partial.name, "step-3.tmp-aaaaaaaaaaaa"]
    )
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------- crash test


class _Server:
    """The fork server of helpers/crash_child.py, with line reads that time out."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HELPERS.parent), *sys.path])}
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(HELPERS / "crash_child.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.saved: set[int] = set()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put("<eof>")

    def expect(self, prefix: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line.startswith("saved "):
                self.saved.add(int(line.split()[1]))
            elif line.startswith(prefix):
                return line
            else:
                raise AssertionError(f"unexpected line from crash server: {line!r}")

    def go(self, root: Path, first: int, crash_point: str) -> int:
        self.proc.stdin.write(f"go {root} {first} {crash_point}\n")
        self.proc.stdin.flush()
        return int(self.expect("pid ").split()[1])

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _check_root(root: Path, checked: set[str]) -> tuple[int, int]:
    """Every entry is a committed checkpoint that loads bit-exactly and verifies, or an
    uncommitted temporary that refuses to load. Returns (committed, temporaries)."""
    from crash_child import state_for

    from quicksave.loading.verify import verify_checkpoint

    committed = temps = 0
    for entry in sorted(root.iterdir()):
        kind = classify(str(entry))
        if is_temp_name(entry.name):
            assert kind is CheckpointKind.UNCOMMITTED, entry
            with pytest.raises(quicksave.NotCommittedError):
                quicksave.load(state_for(0), entry)
            temps += 1
            continue
        assert kind is CheckpointKind.QUICKSAVE, f"{entry.name} is {kind}"
        committed += 1
        if entry.name in checked:
            continue
        step = int(entry.name.removeprefix("step-"))
        expected = state_for(step)
        dest = {
            "model": {k: torch.zeros_like(v) for k, v in expected["model"].items()},
            "step": -1,
            "tag": "",
        }
        quicksave.load(dest, entry)
        for k, v in expected["model"].items():
            assert_bit_equal(dest["model"][k], v, f"{entry.name}: {k}")
        assert (dest["step"], dest["tag"]) == (step, f"step-{step}")
        report = verify_checkpoint(entry)
        assert report.ok, [str(p) for p in report.problems]
        check_checkpoint(entry)
        checked.add(entry.name)
    return committed, temps


@pytest.mark.slow
def test_sigkill_at_any_moment_leaves_only_whole_checkpoints(tmp_path: Path):
    sys.path.insert(0, str(HELPERS))
    root = tmp_path / "run"
    root.mkdir()
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    server = _Server()
    checked: set[str] = set()
    temps_seen = 0
    try:
        server.expect("ready")
        plan = [("before-manifest", None), ("before-rename", None), ("after-rename", None)]
        plan += [("none", rng.uniform(0.05, 0.8)) for _ in range(5)]
        for i, (crash_point, delay) in enumerate(plan):
            first = 1000 * (i + 1)
            pid = server.go(root, first, crash_point)
            if delay is not None:
                time.sleep(delay)
                os.kill(pid, signal.SIGKILL)
            status = int(server.expect("exited ").split()[1])
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
                f"saver ended with status {status} (seed {seed})"
            )
            _, temps = _check_root(root, checked)
            temps_seen += temps
            if crash_point in ("before-manifest", "before-rename"):
                assert not (root / f"step-{first}").exists()
                assert temps == 1  # the killed save's temporary, never visible
            if crash_point == "after-rename":
                assert (root / f"step-{first}").exists()
            # Every save the saver reported as done is committed.
            for step in server.saved:
                assert (root / f"step-{step}").is_dir(), f"step-{step} lost (seed {seed})"
            removed = clean_stale_temporaries(str(root))
            assert len(removed) == temps and all(is_temp_name(n) for n in removed)
            assert all(not is_temp_name(p.name) for p in root.iterdir())
    finally:
        server.close()
        sys.path.remove(str(HELPERS))
    assert len(checked) >= 1 and temps_seen >= 2


def test_a_rename_the_filesystem_refuses_commits_by_copy_manifest_last(tmp_path, monkeypatch):
    # an overlay or FUSE filesystem may refuse to rename a directory (EXDEV)
    import errno as errno_

    import quicksave

    real_rename = os.rename
    order: list[str] = []

    def refusing(src, dst, *a, **k):
        if os.path.isdir(src):
            raise OSError(errno_.EXDEV, "Invalid cross-device link")
        return real_rename(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", refusing)
    target = tmp_path / "ckpt"
    real_open = open

    def noting(path, mode="r", *a, **k):
        if "x" in mode:
            order.append(os.path.basename(path))
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr("builtins.open", noting)
    state = {"w": torch.arange(6.0), "step": 3}
    quicksave.save(state, target)
    monkeypatch.setattr("builtins.open", real_open)
    assert order[-2:] == [".metadata", "manifest.json"], order  # the commit, last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary left
    back = quicksave.load_state(target)
    assert torch.equal(back["w"], state["w"]) and back["step"] == 3
