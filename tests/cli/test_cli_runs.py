"""``quicksave ls`` and ``quicksave verify`` on a run folder and on a parent of run
folders (local here; on S3 in tests/storage/test_cli_store.py): ls lists each run's
checkpoints, verify checks each checkpoint and fails if any is corrupt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import quicksave
from quicksave.cli.main import main
from quicksave.loading.catalog import list_checkpoints

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _save(path: Path, step: int) -> None:
    quicksave.save({"w": torch.full((256,), float(step)), "step": step}, path, step=step)


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    """``runs/`` holding two run folders (one with an uncommitted save and a stock DCP
    checkpoint), a folder that holds no checkpoint, a hidden folder and a loose file."""
    root = tmp_path / "runs"
    for step in (20, 10):
        _save(root / "run-a" / f"step-{step}", step)
    _save(root / "run-b" / "step-5", 5)
    pending = root / "run-b" / "step-10.tmp-0123456789ab"
    pending.mkdir()
    (pending / "rank-00000-00.safetensors").write_bytes(b"x" * 10)
    dcp.save({"x": torch.ones(4)}, checkpoint_id=str(root / "run-b" / "dcp-7"), no_dist=True)
    (root / "logs").mkdir()
    (root / "logs" / "train.log").write_text("loss 1.0\n")
    _save(root / ".trash" / "step-1", 1)  # hidden folders are not searched
    (root / "README").write_text("runs of the team\n")
    return root


def _corrupt(ckpt: Path) -> None:
    data = next(ckpt.glob("rank-*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01
    data.write_bytes(bytes(raw))


# --------------------------------------------------------------------------- ls
def test_ls_of_a_parent_lists_each_runs_checkpoints(runs: Path, capsys) -> None:
    capsys.readouterr()
    rc, out, err = run(capsys, "ls", str(runs))
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == [
        "RUN",
        "NAME",
        "STEP",
        "STATUS",
        "FORMAT",
        "SIZE",
        "MODIFIED",
        "TIERS",
    ]
    assert [line.split()[:5] for line in lines[1:]] == [
        ["run-a", "step-10", "10", "committed", "quicksave"],
        ["run-a", "step-20", "20", "committed", "quicksave"],
        ["run-b", "step-5", "5", "committed", "quicksave"],
        ["run-b", "dcp-7", "7", "committed", "dcp"],
        ["run-b", "step-10.tmp-0123456789ab", "10", "uncommitted", "quicksave"],
    ]

    rc, out, _ = run(capsys, "ls", str(runs), "--json")
    doc = json.loads(out)
    assert [(d["run"], d["name"], d["path"]) for d in doc][:3] == [
        ("run-a", "run-a/step-10", str(runs / "run-a" / "step-10")),
        ("run-a", "run-a/step-20", str(runs / "run-a" / "step-20")),
        ("run-b", "run-b/step-5", str(runs / "run-b" / "step-5")),
    ]


def test_ls_of_a_run_folder_is_unchanged(runs: Path, capsys) -> None:
    rc, out, _ = run(capsys, "ls", str(runs / "run-a"))
    lines = out.splitlines()
    assert rc == 0 and lines[0].split()[0] == "NAME"  # no RUN column: one run
    assert [line.split()[:2] for line in lines[1:]] == [["step-10", "10"], ["step-20", "20"]]


def test_ls_depth_bounds_the_search(runs: Path, capsys) -> None:
    rc, out, err = run(capsys, "ls", str(runs), "--depth", "1")
    assert rc == 0 and out == ""
    assert err == f"no checkpoints in {runs} (1 folder level searched)\n"
    deeper = runs.parent / "team"
    _save(deeper / "x" / "y" / "step-3", 3)
    assert list_checkpoints(deeper) == []
    (info,) = list_checkpoints(deeper, depth=3)
    assert (info.run, info.name, info.step) == ("x/y", "x/y/step-3", 3)


def test_a_checkpoint_is_a_leaf(runs: Path) -> None:
    """What is inside a checkpoint is never searched (nor listed as another one)."""
    _save(runs / "run-a" / "step-10" / "nested", 99)  # (a user's mistake)
    infos = list_checkpoints(runs / "run-a" / "step-10")
    assert [i.name for i in infos] == ["."]


# --------------------------------------------------------------------------- verify
def test_verify_a_run_folder_checks_each_checkpoint(runs: Path, capsys) -> None:
    rc, out, err = run(capsys, "verify", str(runs / "run-a"))
    assert rc == 0, out + err
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        f"OK {runs / 'run-a' / 'step-10'}",
        f"OK {runs / 'run-a' / 'step-20'}",
        f"OK {runs / 'run-a'}",
    ]
    assert lines[-1].endswith(": 2 checkpoints verified, 0 failed, 0 skipped")


def test_verify_a_folder_fails_if_any_checkpoint_is_corrupt(runs: Path, capsys) -> None:
    _corrupt(runs / "run-a" / "step-20")
    rc, out, _ = run(capsys, "verify", str(runs))
    assert rc == 1
    lines = out.splitlines()
    assert lines[0].startswith(f"OK {runs / 'run-a' / 'step-10'}: ")
    assert any(line.startswith("CORRUPT rank-") for line in lines)
    assert f"FAILED {runs / 'run-a' / 'step-20'}: 1 problem" in lines
    assert f"SKIP {runs / 'run-b' / 'dcp-7'}: a stock DCP checkpoint" in "\n".join(lines)
    assert (
        f"SKIP {runs / 'run-b' / 'step-10.tmp-0123456789ab'}: uncommitted (a save in "
        "progress, or left by a crash)" in lines
    )
    assert lines[-1] == f"FAILED {runs}: 3 checkpoints verified, 1 failed, 2 skipped"

    rc, out, _ = run(capsys, "verify", str(runs), "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["ok"] is False
    assert (doc["verified"], doc["failed"], doc["skipped"]) == (3, 1, 2)
    results = {c["name"]: c["result"] for c in doc["checkpoints"]}
    assert results == {
        "run-a/step-10": "ok",
        "run-a/step-20": "corrupt",
        "run-b/step-5": "ok",
        "run-b/dcp-7": "skipped",
        "run-b/step-10.tmp-0123456789ab": "skipped",
    }
    bad = next(c for c in doc["checkpoints"] if c["result"] == "corrupt")
    assert bad["report"]["problems"] and bad["report"]["path"] == str(runs / "run-a" / "step-20")


def test_verify_a_folder_with_nothing_committed_is_an_error(tmp_path: Path, capsys) -> None:
    pending = tmp_path / "run" / "step-1.tmp-0123456789ab"
    pending.mkdir(parents=True)
    (pending / "rank-00000-00.safetensors").write_bytes(b"x")
    rc, out, err = run(capsys, "verify", str(tmp_path / "run"))
    assert rc == 2
    assert out.startswith(f"SKIP {pending}: uncommitted")
    assert err.startswith("quicksave: error: no committed quicksave checkpoint to verify")


def test_verify_of_one_checkpoint_or_a_folder_of_none_is_as_before(runs: Path, capsys) -> None:
    rc, out, _ = run(capsys, "verify", str(runs / "run-a" / "step-10"))
    assert rc == 0 and len(out.splitlines()) == 1 and out.startswith("OK ")
    rc, _, err = run(capsys, "verify", str(runs / "logs"))
    assert rc == 2 and "not a" in err and str(runs / "logs") in err
