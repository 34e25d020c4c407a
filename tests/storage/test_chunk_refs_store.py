"""Chunk references on an object store (FORMAT.md §9): an incremental checkpoint under an
S3 prefix reads its referenced chunks from the sibling ``step-<base>`` prefix through the
same checked ranged reads, and a damaged or missing base fails naming both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import quicksave
from helpers.chunk_refs import refer
from helpers.state import assert_bit_equal, random_tensor
from quicksave.errors import CorruptCheckpointError
from quicksave.format import MANIFEST_NAME
from quicksave.loading.verify import verify_checkpoint
from quicksave.tools.convert import convert


def _state(seed: int) -> dict[str, torch.Tensor]:
    return {
        "frozen": random_tensor((256, 64), torch.bfloat16, seed=1),
        "head": random_tensor((7,), torch.float32, seed=seed),
    }


def _upload(client, bucket: str, local: Path, prefix: str) -> None:
    """Upload a local checkpoint: data first, the manifest (the commit) last."""
    names = sorted(p.name for p in local.iterdir())
    for name in sorted(names, key=lambda n: n == MANIFEST_NAME):
        client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=(local / name).read_bytes())


@pytest.fixture
def store_run(s3_server, s3_bucket, tmp_path, monkeypatch) -> tuple[str, object]:
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    folder = tmp_path / "run"
    quicksave.save(_state(3), folder / "step-1", step=1)
    quicksave.save(_state(4), folder / "step-3", step=3)
    refer(folder / "step-3", 1, ["frozen"])
    client = s3_server.client()
    for step in (1, 3):
        _upload(client, s3_bucket, folder / f"step-{step}", f"run/step-{step}")
    yield f"s3://{s3_bucket}/run", client
    client.close()


def test_a_store_checkpoint_reads_its_references(store_run, tmp_path) -> None:
    url, _ = store_run
    out = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    quicksave.load(out, f"{url}/step-3")
    for k, v in _state(4).items():
        assert_bit_equal(out[k], v, k)
    assert verify_checkpoint(f"{url}/step-3").ok
    copy = tmp_path / "copy"
    convert(f"{url}/step-3", copy, "quicksave")
    out = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    quicksave.load(out, copy)
    assert_bit_equal(out["frozen"], _state(4)["frozen"], "frozen")


def test_a_damaged_or_missing_base_on_a_store_names_both(store_run, s3_bucket) -> None:
    url, client = store_run
    listing = client.list_objects_v2(Bucket=s3_bucket, Prefix="run/step-1/")["Contents"]
    key = next(o["Key"] for o in listing if o["Key"].endswith(".safetensors"))
    data = bytearray(client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    data[4096] ^= 0x40  # inside frozen's bytes (the first chunk of the data region)
    client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(data))
    out = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as info:
        quicksave.load(out, f"{url}/step-3")
    assert info.value.path.startswith(f"{url}/step-1/")
    assert f"{url}/step-3" in info.value.message
    report = verify_checkpoint(f"{url}/step-3")
    assert [(p.fqn, p.kind) for p in report.problems] == [("frozen", "reference")]
    client.delete_object(Bucket=s3_bucket, Key=f"run/step-1/{MANIFEST_NAME}")
    with pytest.raises(CorruptCheckpointError, match="not a committed checkpoint") as info:
        quicksave.load(out, f"{url}/step-3")
    assert info.value.path == f"{url}/step-3" and f"{url}/step-1" in info.value.message


def test_the_upload_tier_copies_a_referring_step_self_contained(
    s3_server, s3_bucket, tmp_path, monkeypatch, caplog
) -> None:
    """The object-store tier fills a referring checkpoint's holes from its local bases:
    the copy refers to nothing (format version 1), loads without any base on the store
    and is byte for byte the full checkpoint; a damaged local base fails the copy
    naming both checkpoints, and nothing is committed."""
    import logging
    import shutil

    from quicksave.loading.run_folder import committed_steps
    from quicksave.storage import parse_location
    from quicksave.tiers.upload import Uploader

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    folder = tmp_path / "run"
    quicksave.save(_state(3), folder / "step-1", step=1)
    quicksave.save(_state(4), folder / "step-3", step=3)
    full = {p.name: p.read_bytes() for p in (folder / "step-3").iterdir()}
    refer(folder / "step-3", 1, ["frozen"])
    target = parse_location(f"s3://{s3_bucket}/up")
    client = s3_server.client()

    def upload(step: int) -> Uploader:
        with target.open() as backend:
            uploader = Uploader(parse_location(folder), target, 0, 1, None, backend)
            uploader.offer(step)
            assert uploader.close(60)
        return uploader

    # a damaged base: the copy fails, naming the base's file and the referring step
    chunk = json.loads(full[MANIFEST_NAME])["tensors"]["frozen"]["chunks"][0]
    data = folder / "step-1" / chunk["file"]
    original = data.read_bytes()
    damaged = bytearray(original)
    damaged[chunk["offset"]] ^= 0x40  # inside frozen's bytes
    data.write_bytes(bytes(damaged))
    with caplog.at_level(logging.ERROR, logger="quicksave"):
        assert upload(3).failures == 1
    assert "checksum mismatch" in caplog.text and str(folder / "step-3") in caplog.text
    assert str(folder / "step-1") in caplog.text
    assert committed_steps(target) == []
    data.write_bytes(original)

    assert upload(3).failures == 0
    assert committed_steps(target) == [3]  # its base is not on the store, nor needed
    for name, body in full.items():
        got = client.get_object(Bucket=s3_bucket, Key=f"up/step-3/{name}")["Body"].read()
        assert got == body, name  # the full checkpoint's bytes, the manifest included
    shutil.rmtree(folder)
    assert verify_checkpoint(f"s3://{s3_bucket}/up/step-3").ok
    out = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    quicksave.load(out, f"s3://{s3_bucket}/up/step-3")
    for k, v in _state(4).items():
        assert_bit_equal(out[k], v, k)
    client.close()


def test_incremental_saves_to_a_store_are_refused_naming_the_url(
    s3_server, s3_bucket, monkeypatch
) -> None:
    """``IncrementalConfig`` with the folder on a store: refused when the config is made
    (the manager) or at the save (an ``AsyncSaver``), naming the URL and what to do,
    before anything is written: a store has no sparse objects, so a referring
    checkpoint would upload its holes as zeros, as many bytes as a full save."""
    from quicksave.errors import CheckpointError
    from quicksave.manager import CheckpointConfig

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    url = f"s3://{s3_bucket}/incr"
    incremental = quicksave.IncrementalConfig(enabled=True, block_bytes=64 << 10)
    with pytest.raises(CheckpointError, match="need a filesystem folder") as info:
        CheckpointConfig(folder=url, interval=1, incremental=incremental)
    assert info.value.path == url and "UploadTierConfig" in info.value.message
    CheckpointConfig(folder=url, interval=1)  # off: as before

    state = {"frozen": random_tensor((512, 256), torch.float32, seed=1), "head": torch.zeros(7)}
    config = quicksave.EngineConfig(mode="thread", incremental=incremental)
    with quicksave.AsyncSaver(config) as saver:
        with pytest.raises(CheckpointError, match="is an object store") as info:
            saver.save(state, f"{url}/step-1", step=1)
        assert info.value.path == f"{url}/step-1"
    client = s3_server.client()
    try:
        assert client.list_objects_v2(Bucket=s3_bucket, Prefix="incr/").get("KeyCount") == 0
    finally:
        client.close()
