"""DCP-layout checkpoints (FORMAT.md §8) on a real S3 server (SeaweedFS on loopback):
the footer probe and the manifest's ranged reads through the store, listing, loading,
verifying, and the manager folder's commit-first deletion and quarantine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import quicksave
from helpers.dcp_layout import DATA_FILE, write_dcp_layout_checkpoint
from helpers.state import raw
from quicksave.commit import CheckpointKind, classify
from quicksave.errors import CorruptCheckpointError
from quicksave.loading.catalog import list_checkpoints
from quicksave.loading.verify import verify_checkpoint
from quicksave.manager import folder
from quicksave.tools.inspect_checkpoint import inspect_checkpoint


@pytest.fixture
def s3_env(s3_server, monkeypatch) -> None:
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)


def state() -> dict:
    g = torch.Generator().manual_seed(2)
    return {
        "w": torch.randn(8, 3, generator=g).to(torch.bfloat16),
        "b": torch.arange(5, dtype=torch.int32),
        "step": 4,
    }


def blank() -> dict:
    return {"w": torch.zeros(8, 3, dtype=torch.bfloat16), "b": torch.zeros(5, dtype=torch.int32)}


def upload(s3_server, bucket: str, local: Path, prefix: str) -> None:
    client = s3_server.client()
    try:
        for p in sorted(local.iterdir(), key=lambda p: p.name == ".metadata"):  # commit last
            client.put_object(Bucket=bucket, Key=f"{prefix}/{p.name}", Body=p.read_bytes())
    finally:
        client.close()


def keys(s3_server, bucket: str, prefix: str) -> set[str]:
    client = s3_server.client()
    try:
        got = client.list_objects_v2(Bucket=bucket, Prefix=prefix)
        return {o["Key"] for o in got.get("Contents", [])}
    finally:
        client.close()


def test_dcp_layout_on_a_store(s3_env, s3_server, s3_bucket, tmp_path: Path) -> None:
    write_dcp_layout_checkpoint(tmp_path / "step-4", state(), step=4, split={"w": 2})
    upload(s3_server, s3_bucket, tmp_path / "step-4", "f/step-4")
    root = f"s3://{s3_bucket}/f"
    url = f"{root}/step-4"

    assert classify(url) is CheckpointKind.QUICKSAVE
    (info,) = list_checkpoints(root)
    assert (info.name, info.step, info.committed, info.layout) == ("step-4", 4, True, "dcp")
    assert folder.committed_steps(root, allow_dcp=False) == [4]
    assert inspect_checkpoint(url).layout == "dcp"
    report = verify_checkpoint(url)
    assert report.ok, report.problems
    dest = {**blank(), "step": 0}
    quicksave.load(dest, url)
    assert torch.equal(raw(dest["w"]), raw(state()["w"])) and dest["step"] == 4

    moved = folder.quarantine(url, "a test")
    assert moved is not None
    assert keys(s3_server, s3_bucket, "f/step-4/") == {f"f/step-4/{DATA_FILE}"}
    assert f"{moved.removeprefix(f's3://{s3_bucket}/')}/.metadata" in keys(
        s3_server, s3_bucket, "f/"
    )
    assert folder.committed_steps(root, allow_dcp=True) == []


def test_damage_and_deletion_on_a_store(s3_env, s3_server, s3_bucket, tmp_path: Path) -> None:
    local = tmp_path / "step-4"
    write_dcp_layout_checkpoint(local, state(), step=4)
    data = bytearray((local / DATA_FILE).read_bytes())
    data[-3] ^= 1  # the last tensor item's zip end record: outside every chunk
    (local / DATA_FILE).write_bytes(bytes(data))
    upload(s3_server, s3_bucket, local, "g/step-4")
    url = f"s3://{s3_bucket}/g/step-4"
    problems = verify_checkpoint(url).problems
    assert [(p.file, p.kind) for p in problems] == [(DATA_FILE, "checksum")]

    meta = bytearray((local / ".metadata").read_bytes())
    meta[-1] ^= 1  # the footer's second magic
    (local / ".metadata").write_bytes(bytes(meta))
    upload(s3_server, s3_bucket, local, "g/step-4")
    with pytest.raises(CorruptCheckpointError, match="magic") as info:
        quicksave.load(blank(), url)
    assert info.value.path == f"{url}/.metadata"

    folder.delete_checkpoint(url)
    assert keys(s3_server, s3_bucket, "g/") == set()
