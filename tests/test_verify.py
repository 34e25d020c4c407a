"""quicksave.loading.verify: every changed, missing or added byte of a checkpoint is reported."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import quicksave
from helpers.checks import manifest_doc, seal_manifest
from quicksave.errors import CheckpointNotFoundError, NotCommittedError
from quicksave.loading.verify import verify_checkpoint
from quicksave.loading.verify_report import Problem, VerifyReport

# Stock DCP calls in one process warn that torch.distributed is off; that is intended here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def small_state() -> dict:
    """A few tensors of different dtypes (odd byte counts, so chunks need padding), a
    dtype safetensors lacks, an empty and a 0-dim tensor, and plain values."""
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(7, 5, generator=g),
            "h": torch.randn(4, 4, generator=g).to(torch.bfloat16),
            "c": torch.randn(3, dtype=torch.complex128, generator=g),
            "e": torch.empty(0, dtype=torch.uint8),
            "s": torch.tensor(3.5, dtype=torch.float64),
        },
        "b": torch.arange(3, dtype=torch.int64),
        "flag": torch.tensor([True, False, True]),
        "half": torch.randn(33, generator=g).half(),
        "opt": {"lr": 0.1, "betas": (0.9, 0.99), "name": "adam"},
        "step": 5,
    }


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "step-5"
    quicksave.save(small_state(), path, step=5)
    return path


def expected_problem(doc: dict, name: str, offset: int) -> tuple[str, str | None]:
    """(kind, fqn) verify must report when byte ``offset`` of file ``name`` changes."""
    if name == "manifest.json":
        return "manifest", None
    entry = doc["files"][name]
    if "data_start" not in entry:
        return "checksum", None
    if offset < entry["data_start"]:
        return "header", None
    for fqn, t in doc["tensors"].items():
        for c in t["chunks"]:
            if c["file"] == name and c["offset"] <= offset < c["offset"] + c["length"]:
                return "chunk", fqn
    return "padding", None


def test_intact_checkpoint_passes(checkpoint: Path) -> None:
    report = verify_checkpoint(checkpoint)
    assert isinstance(report, VerifyReport)
    assert report.ok, report.problems
    assert report.problems == ()
    assert report.files_checked == len(os.listdir(checkpoint))
    assert report.bytes_checked == sum(p.stat().st_size for p in checkpoint.iterdir())
    assert (report.tensors, report.objects) == (8, 4)


def test_every_single_byte_flip_truncation_and_extension_is_detected(checkpoint: Path) -> None:
    doc = manifest_doc(checkpoint)
    names = sorted(os.listdir(checkpoint))
    assert {"manifest.json", ".metadata"} <= set(names) and len(names) >= 4
    total = sum((checkpoint / n).stat().st_size for n in names)
    assert 25_000 < total < 60_000, total  # small enough to flip every byte quickly
    checked = 0
    for name in names:
        path = checkpoint / name
        original = path.read_bytes()
        fd = os.open(path, os.O_RDWR)
        try:
            for offset, byte in enumerate(original):
                mask = 0x01 if offset % 2 else 0xFF  # the smallest and the largest change
                os.pwrite(fd, bytes([byte ^ mask]), offset)
                report = verify_checkpoint(checkpoint)
                kind, fqn = expected_problem(doc, name, offset)
                found = [(p.file, p.kind, p.fqn) for p in report.problems]
                assert (name, kind, fqn) in found, (name, offset, mask, found)
                checked += 1
                os.pwrite(fd, bytes([byte]), offset)
            os.ftruncate(fd, len(original) - 1)
            report = verify_checkpoint(checkpoint)
            assert not report.ok and any(p.file == name for p in report.problems), name
            os.ftruncate(fd, len(original))
            os.pwrite(fd, original[-1:], len(original) - 1)
            os.pwrite(fd, b"\0", len(original))  # one extra (zero) byte at the end
            report = verify_checkpoint(checkpoint)
            assert not report.ok and any(p.file == name for p in report.problems), name
            os.ftruncate(fd, len(original))
        finally:
            os.close(fd)
        assert path.read_bytes() == original
    assert checked == total
    assert verify_checkpoint(checkpoint).ok


def test_problem_names_file_fqn_and_offsets(checkpoint: Path) -> None:
    doc = manifest_doc(checkpoint)
    chunk = doc["tensors"]["model.w"]["chunks"][0]
    with open(checkpoint / chunk["file"], "r+b") as f:
        f.seek(chunk["offset"] + 3)
        f.write(b"\x7f")
    report = verify_checkpoint(checkpoint)
    assert report.problems == (
        Problem(
            chunk["file"],
            "model.w",
            "chunk",
            f"checksum mismatch in chunk bytes {chunk['offset']}..{chunk['offset'] + 140}: "
            f"manifest {chunk['xxh3_64']}, file {report.problems[0].message[-16:]}",
        ),
    )
    assert str(report.problems[0]).startswith(f"{chunk['file']}: model.w: chunk: checksum")


def test_truncated_data_file_names_the_lost_tensor(checkpoint: Path) -> None:
    doc = manifest_doc(checkpoint)
    chunk = doc["tensors"]["model.s"]["chunks"][0]
    data = checkpoint / chunk["file"]
    os.truncate(data, chunk["offset"] + 4)
    found = {(p.kind, p.fqn) for p in verify_checkpoint(checkpoint).problems}
    assert ("size", None) in found
    assert ("truncated", "model.s") in found


def test_padding_must_be_zero(checkpoint: Path) -> None:
    doc = manifest_doc(checkpoint)
    chunk = doc["tensors"]["b"]["chunks"][0]  # "model.w" follows it in the same file
    assert doc["tensors"]["model.w"]["chunks"][0]["file"] == chunk["file"]
    with open(checkpoint / chunk["file"], "r+b") as f:
        f.seek(chunk["offset"] + chunk["length"] + 10)  # just after the chunk: padding
        f.write(b"\x01\x02")
    (problem,) = verify_checkpoint(checkpoint).problems
    assert problem.kind == "padding" and problem.file == chunk["file"]
    assert f"first at byte {chunk['offset'] + chunk['length'] + 10}" in problem.message
    assert problem.message.startswith("2 non-zero byte(s)")


def test_missing_and_unexpected_files(checkpoint: Path) -> None:
    (checkpoint / ".metadata").unlink()
    (checkpoint / "notes.txt").write_text("hi")
    (checkpoint / "sub").mkdir()
    found = {(p.file, p.kind) for p in verify_checkpoint(checkpoint).problems}
    assert found == {
        (".metadata", "missing-file"),
        ("notes.txt", "unexpected-file"),
        ("sub", "unexpected-file"),
    }


def test_resealed_manifest_with_wrong_size_is_caught(checkpoint: Path) -> None:
    """A manifest edited and given a valid checksum still has to match the files."""
    doc = manifest_doc(checkpoint)
    name = next(n for n, f in doc["files"].items() if "rank" in f)
    doc["files"][name]["size"] += 4096
    (checkpoint / "manifest.json").write_bytes(seal_manifest(doc))
    found = {(p.file, p.fqn, p.kind) for p in verify_checkpoint(checkpoint).problems}
    assert (name, None, "size") in found


def test_resealed_manifest_with_wrong_chunk_length_is_one_problem(checkpoint: Path) -> None:
    """Lengths are checked against shape and dtype when the manifest is parsed."""
    doc = manifest_doc(checkpoint)
    doc["tensors"]["b"]["chunks"][0]["length"] = 16
    (checkpoint / "manifest.json").write_bytes(seal_manifest(doc))
    (problem,) = verify_checkpoint(checkpoint).problems
    assert (problem.file, problem.fqn, problem.kind) == ("manifest.json", "b", "manifest")
    assert problem.message == (
        "manifest: tensors['b'].chunks[0].length is 16, but sizes [3] of 8-byte elements need 24"
    )


def test_corrupt_manifest_is_one_problem(checkpoint: Path) -> None:
    data = bytearray((checkpoint / "manifest.json").read_bytes())
    data[10] ^= 0x20
    (checkpoint / "manifest.json").write_bytes(bytes(data))
    (problem,) = verify_checkpoint(checkpoint).problems
    assert problem.file == "manifest.json" and problem.kind == "manifest"
    assert "manifest checksum mismatch" in problem.message


def test_progress_bar_goes_to_stderr(checkpoint: Path, capsys: pytest.CaptureFixture) -> None:
    assert verify_checkpoint(checkpoint, progress=True).ok
    out, err = capsys.readouterr()
    assert out == "" and "verify" in err


def test_not_a_quicksave_checkpoint_raises(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError) as e:
        verify_checkpoint(tmp_path / "nope")
    assert str(e.value) == f"no such file or directory [path={tmp_path / 'nope'}]"

    with pytest.raises(CheckpointNotFoundError, match=r"not a checkpoint \(no manifest\.json\)"):
        verify_checkpoint(tmp_path)

    tmp = tmp_path / "step-9.tmp-0123456789ab"
    tmp.mkdir()
    with pytest.raises(NotCommittedError, match="never committed") as e:
        verify_checkpoint(tmp)
    assert e.value.path == str(tmp)

    dcp_dir = tmp_path / "dcp"
    dcp.save({"x": torch.ones(2)}, checkpoint_id=str(dcp_dir), no_dist=True)
    with pytest.raises(CheckpointNotFoundError, match="stock torch.distributed.checkpoint"):
        verify_checkpoint(dcp_dir)
