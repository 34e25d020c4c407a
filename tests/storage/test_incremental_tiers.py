"""Incremental saves (``IncrementalConfig``, FORMAT.md §9) with the manager's tiers, on a
real S3 server (SeaweedFS on loopback) and real files: the folder's checkpoints refer
to earlier ones; the object-store tier uploads each due step as a self-contained copy
(its holes filled from the folder's bases: nothing on the store refers to anything),
so every step the store lists verifies (``quicksave verify``) and loads bit-exactly
after the folder's retention deleted the steps the uploads were made from; node-memory
snapshots are full (in-place buffers) and no checkpoint refers across tiers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import uuid
from pathlib import Path

import pytest
import torch

import quicksave
from helpers.lora_job import COLS, ROWS
from helpers.lora_job import Job as _Job
from helpers.state import assert_bit_equal
from quicksave.cli.main import main as cli_main
from quicksave.format import MANIFEST_NAME
from quicksave.loading.run_folder import committed_steps
from quicksave.loading.verify import verify_checkpoint
from quicksave.manager import (
    CheckpointConfig,
    CheckpointManager,
    MemoryTierConfig,
    UploadTierConfig,
)
from quicksave.storage import S3Options, StorageOptions, parse_location


def _incremental() -> quicksave.IncrementalConfig:
    # (a full save every 8: the folder's retention then deletes the bases of old uploads)
    return quicksave.IncrementalConfig(
        enabled=True, block_bytes=64 << 10, min_bytes=1024, full_every=8
    )


def _options(s3_server) -> StorageOptions:
    return StorageOptions(
        s3=S3Options(
            endpoint_url=s3_server.endpoint_url,
            access_key_id=s3_server.access_key_id,
            secret_access_key=s3_server.secret_access_key,
            region=s3_server.region,
        )
    )


def _bases(manifest: bytes) -> set[int]:
    doc = json.loads(manifest)
    return {c["base"] for t in doc["tensors"].values() for c in t["chunks"] if "base" in c}


def _local_bases(checkpoint: Path) -> set[int]:
    return _bases((checkpoint / MANIFEST_NAME).read_bytes())


def _settle(manager: CheckpointManager) -> None:
    """The folder's saves committed and offered, and the upload (if any) done."""
    manager.wait()
    tier = manager.upload_tier
    if tier is None or tier.uploader is None:
        return
    tier.poll()
    deadline = time.monotonic() + 60
    while not tier.uploader.idle():
        assert time.monotonic() < deadline, "the upload did not end"
        time.sleep(0.02)


def _load_model(url: str, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    quicksave.load({"model": out}, url, strict=False)
    return out


def test_uploads_of_referring_steps_are_self_contained_and_outlive_the_folder(
    s3_server, s3_bucket, tmp_path, monkeypatch, capsys
) -> None:
    for k, v in s3_server.env().items():  # for quicksave.load and the CLI
        monkeypatch.setenv(k, v)
    options = _options(s3_server)
    url = f"s3://{s3_bucket}/run"
    folder = tmp_path / "ckpt"
    config = CheckpointConfig(
        folder=str(folder),
        interval=1,
        keep_latest_k=2,
        async_mode="thread",
        storage=options,
        incremental=_incremental(),
        upload=UploadTierConfig(url, every=4, keep=2),
    )
    job = _Job()
    saved: dict[int, dict[str, torch.Tensor]] = {}
    referred: dict[int, set[int]] = {}  # due step -> the folder steps its checkpoint refers to
    with CheckpointManager(config, job.states()) as manager:
        for step in range(1, 13):
            job.step()
            assert manager.save(step)
            manager.wait()
            if step % 4 == 0:
                referred[step] = _local_bases(folder / f"step-{step}")
            _settle(manager)
            saved[step] = job.snapshot()
        tier = manager.upload_tier
        assert tier is not None and tier.uploader is not None
        assert tier.uploader.log.committed == [4, 8, 12] and tier.uploader.failures == 0
    # the folder's checkpoints of the due steps referred to earlier ones (the case at hand)
    assert all(referred[s] and max(referred[s]) < s for s in (4, 8, 12)), referred
    # the folder's retention deleted what the uploads of 4 and 8 were made from
    kept = committed_steps(folder)
    assert (
        4 not in kept and 8 not in kept and not set().union(referred[4], referred[8]) & set(kept)
    ), kept
    store = parse_location(url, options=options)
    assert committed_steps(store, allow_dcp=False) == [8, 12]  # keep=2
    client = s3_server.client()
    try:
        for step in (8, 12):
            key = f"run/step-{step}/{MANIFEST_NAME}"
            manifest = client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
            assert json.loads(manifest)["format_version"] == 1 and not _bases(manifest)
            sent = client.list_objects_v2(Bucket=s3_bucket, Prefix=f"run/step-{step}/")
            local_size = sum(o["Size"] for o in sent["Contents"])
            assert local_size > ROWS * COLS * 4  # the frozen weight's bytes are there
    finally:
        client.close()
    for step in (8, 12):
        report = verify_checkpoint(f"{url}/step-{step}")
        assert report.ok, report.problems
        got = _load_model(f"{url}/step-{step}", saved[step])
        for k, v in saved[step].items():
            assert_bit_equal(got[k], v, f"store step {step}: {k}")
    assert cli_main(["verify", url]) == 0, capsys.readouterr()

    # the folder is lost: a new job resumes from the store, bit-exact
    shutil.rmtree(folder)
    fresh = _Job(seed=5)
    with CheckpointManager(config, fresh.states()) as again:
        assert again.load() == 12
        got = fresh.snapshot()
    for k, v in saved[12].items():
        assert_bit_equal(got[k], v, k)


def _kill_agents(where: Path) -> None:
    for record in where.rglob("agent.json"):
        try:
            os.kill(int(json.loads(record.read_text())["pid"]), signal.SIGKILL)
        except (OSError, ValueError, KeyError):
            pass


def test_memory_snapshots_stay_full_and_nothing_refers_across_tiers(tmp_path) -> None:
    """Node-memory snapshots are in-place buffers: full at every step; the folder's
    checkpoints refer only to the folder's own steps; both load bit-exactly."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm (tmpfs) on this machine")
    root = Path("/dev/shm") / f"qs-incr-{uuid.uuid4().hex[:12]}"
    root.mkdir()
    folder = tmp_path / "ckpt"
    config = CheckpointConfig(
        folder=str(folder),
        interval=3,  # the folder at 3, 6, 9; node memory at every other step
        async_mode="thread",
        incremental=_incremental(),
        memory=MemoryTierConfig(every=1, keep=2, root=str(root), job_id=root.name),
    )
    try:
        job = _Job()
        saved: dict[int, dict[str, torch.Tensor]] = {}
        with CheckpointManager(config, job.states()) as manager:
            for step in range(1, 10):
                job.step()
                assert manager.save(step) == (step % 3 == 0)
                manager.wait()  # the folder's saves and the snapshots
                saved[step] = job.snapshot()
            tier = manager.memory_tier
            assert tier is not None
            memory = Path(tier.folder)
            snapshots = tier.steps()
            assert snapshots == [7, 8]
            for step in snapshots:
                assert not _local_bases(memory / f"step-{step}"), step
                assert verify_checkpoint(memory / f"step-{step}").ok
                got = _load_model(str(memory / f"step-{step}"), saved[step])
                for k, v in saved[step].items():
                    assert_bit_equal(got[k], v, f"memory step {step}: {k}")
        steps = committed_steps(folder)
        referring = [s for s in steps if _local_bases(folder / f"step-{s}")]
        assert referring, "the folder's saves beside the memory tier refer to nothing"
        for step in steps:
            assert _local_bases(folder / f"step-{step}") <= set(steps)
            assert verify_checkpoint(folder / f"step-{step}").ok
            got = _load_model(str(folder / f"step-{step}"), saved[step])
            for k, v in saved[step].items():
                assert_bit_equal(got[k], v, f"folder step {step}: {k}")
    finally:
        _kill_agents(root)
        shutil.rmtree(root, ignore_errors=True)
