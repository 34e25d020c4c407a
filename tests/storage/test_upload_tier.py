"""The object-store tier (``CheckpointConfig(upload=...)``) on a real S3 server
(SeaweedFS on loopback): due steps of the local folder uploaded in the background and
committed there by the manifest written last, with their own retention; a failing
upload logged (tier, rank, step, URL) while training goes on, and never visible as a
checkpoint; a trainer killed mid-upload leaves nothing visible either; a job whose
folder is lost resumes from the store, bit-exact."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from quicksave.cli.main import main as cli_main
from quicksave.errors import CheckpointError
from quicksave.loading.run_folder import committed_steps
from quicksave.manager import (
    CheckpointConfig,
    CheckpointManager,
    MemoryTierConfig,
    ModelState,
    OptimizerState,
    UploadTierConfig,
)
from quicksave.storage import S3Options, StorageOptions, parse_location
from quicksave_tools.testing.faultproxy import FaultProxy


def _options(s3_server, endpoint_url: str | None = None, **kw: Any) -> StorageOptions:
    return StorageOptions(
        s3=S3Options(
            endpoint_url=endpoint_url or s3_server.endpoint_url,
            access_key_id=s3_server.access_key_id,
            secret_access_key=s3_server.secret_access_key,
            region=s3_server.region,
            **kw,
        )
    )


class _Job:
    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def states(self) -> dict[str, Any]:
        return {
            "model": ModelState(self.model),
            "optimizer": OptimizerState(self.model, self.optim),
        }

    def step(self, step: int) -> None:
        g = torch.Generator().manual_seed(step)
        self.optim.zero_grad()
        self.model(torch.randn(8, 32, generator=g)).square().mean().backward()
        self.optim.step()

    def snapshot(self) -> dict[str, torch.Tensor]:
        out = {f"p.{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
        for i, entry in enumerate(self.optim.state.values()):
            for k, v in entry.items():
                out[f"s.{i}.{k}"] = torch.as_tensor(v).clone()
        return out


def _settle(manager: CheckpointManager) -> None:
    """The folder's saves committed and offered, and the upload (if any) done."""
    manager.wait()
    tier = manager.upload_tier
    assert tier is not None and tier.uploader is not None
    tier.poll()
    deadline = time.monotonic() + 60
    while not tier.uploader.idle():
        assert time.monotonic() < deadline, "the upload did not end"
        time.sleep(0.02)


def _store_steps(url: str, options: StorageOptions) -> list[int]:
    return committed_steps(parse_location(url, options=options), allow_dcp=False)


# --------------------------------------------------------------------------- config


def test_upload_every_must_be_a_multiple_of_the_folders_interval(tmp_path) -> None:
    with pytest.raises(CheckpointError, match=r"upload.every \(6\) must be a multiple"):
        CheckpointConfig(
            folder=str(tmp_path), interval=4, upload=UploadTierConfig("s3://bucket/p", every=6)
        )
    with pytest.raises(CheckpointError, match=r"upload.every \(4\) must be a multiple"):
        CheckpointConfig(
            folder=str(tmp_path),
            interval=2,
            interval_type="seconds",
            upload=UploadTierConfig("s3://bucket/p", every=4),
        )


def test_upload_copies_a_local_folder_to_a_store(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="folder 's3://bucket/ckpt' must be a local path"):
        CheckpointConfig(
            folder="s3://bucket/ckpt",
            interval=2,
            upload=UploadTierConfig("s3://bucket/up", every=2),
        )
    with pytest.raises(CheckpointError, match=r"upload.url '.*/up' a store's URL"):
        CheckpointConfig(
            folder=str(tmp_path / "ckpt"),
            interval=2,
            upload=UploadTierConfig(str(tmp_path / "up"), every=2),
        )


# --------------------------------------------------------------------------- uploads


def test_due_steps_upload_commit_and_resume_from_the_store_bit_exact(
    s3_server, s3_bucket, tmp_path, monkeypatch, capsys
) -> None:
    options = _options(s3_server)
    url = f"s3://{s3_bucket}/run"
    upload = UploadTierConfig(url, every=4, keep=2)
    config = CheckpointConfig(
        folder=str(tmp_path / "ckpt"),
        interval=2,
        keep_latest_k=2,
        async_mode="thread",
        storage=options,
        upload=upload,
    )
    job = _Job()
    manager = CheckpointManager(config, job.states())
    saved = {}
    for step in range(1, 13):
        job.step(step)
        manager.save(step)
        _settle(manager)
        saved[step] = job.snapshot()
    tier = manager.upload_tier
    assert tier is not None and tier.uploader is not None
    assert tier.uploader.log.committed == [4, 8, 12]
    assert tier.uploader.failures == 0
    manager.close()
    assert _store_steps(url, options) == [8, 12]  # keep=2
    assert committed_steps(str(tmp_path / "ckpt")) == [10, 12]  # the folder's own
    assert [t.location.url for t in manager.session.tiers] == [str(tmp_path / "ckpt"), url]

    # quicksave ls says which tiers hold each step
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    assert cli_main(["ls", str(tmp_path / "ckpt"), "--upload", url, "--json"]) == 0
    listed = {e["step"]: e["tiers"] for e in json.loads(capsys.readouterr().out)}
    assert listed == {8: ["object-store"], 10: ["folder"], 12: ["folder", "object-store"]}

    # the local folder is lost: a new job resumes from the store
    fresh = _Job(seed=7)
    again = CheckpointManager(
        CheckpointConfig(folder=str(tmp_path / "new"), interval=2, storage=options, upload=upload),
        fresh.states(),
    )
    assert again.load() == 12
    assert again.last_load is not None and again.last_load.tier == "object-store"
    got = fresh.snapshot()
    assert got.keys() == saved[12].keys()
    for k, v in saved[12].items():
        assert torch.equal(got[k], v), k
    again.close()


def test_a_failing_upload_is_logged_never_visible_and_training_goes_on(
    s3_server, s3_bucket, tmp_path, caplog
) -> None:
    url = f"s3://{s3_bucket}/run"
    with FaultProxy("127.0.0.1", s3_server.ports["s3"]) as proxy:
        options = _options(
            s3_server,
            proxy.endpoint_url,
            retry_deadline_s=1.0,
            connect_timeout_s=1.0,
            read_timeout_s=2.0,
        )
        config = CheckpointConfig(
            folder=str(tmp_path / "ckpt"),
            interval=2,
            async_mode="thread",
            storage=options,
            upload=UploadTierConfig(url, every=2),
        )
        job = _Job()
        manager = CheckpointManager(config, job.states())
        caplog.set_level(logging.ERROR, logger="quicksave")
        for step in range(1, 7):
            job.step(step)
            proxy.mode = "drop" if step == 4 else "pass"
            manager.save(step)
            _settle(manager)
        proxy.mode = "pass"
        tier = manager.upload_tier
        assert tier is not None and tier.uploader is not None
        assert tier.uploader.failures == 1
        assert tier.uploader.log.committed == [2, 6]
        manager.close()
        assert _store_steps(url, options) == [2, 6]  # step 4: not visible
        assert committed_steps(str(tmp_path / "ckpt")) == [2, 4, 6]  # untouched
    failed = [r.getMessage() for r in caplog.records if "upload of step 4" in r.getMessage()]
    assert failed and all(
        f"the object-store tier's upload of step 4 on rank 0 to {url}/step-4 failed" in m
        for m in failed
    ), failed


KILLED_TRAINER = textwrap.dedent(
    """
    import sys, time
    import torch
    from quicksave.manager import (CheckpointConfig, CheckpointManager, ModelState,
                                   UploadTierConfig)
    from quicksave.storage import S3Options, StorageOptions

    folder, url, endpoint, key, secret, region = sys.argv[1:7]
    s3 = S3Options(endpoint_url=endpoint, access_key_id=key, secret_access_key=secret,
                   region=region)
    options = StorageOptions(s3=s3, lease_expiry_s=2.0, lease_renew_s=0.5)
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weights: 2 data files
    config = CheckpointConfig(folder=folder, interval=2, async_mode="thread",
                              storage=options, upload=UploadTierConfig(url, every=2))
    manager = CheckpointManager(config, {"model": ModelState(model)})
    for step in (1, 2):
        manager.save(step)
    manager.wait()
    manager.save(3)  # sees step 2 committed: its upload starts
    print("uploading", flush=True)
    time.sleep(600)  # killed meanwhile
    """
)


def test_a_trainer_killed_mid_upload_leaves_no_visible_step(s3_server, s3_bucket, tmp_path) -> None:
    url = f"s3://{s3_bucket}/run"
    folder = str(tmp_path / "ckpt")
    client = s3_server.client()
    with FaultProxy("127.0.0.1", s3_server.ports["s3"]) as proxy:
        args = [
            folder,
            url,
            proxy.endpoint_url,
            s3_server.access_key_id,
            s3_server.secret_access_key,
            s3_server.region,
        ]
        proc = subprocess.Popen(
            [sys.executable, "-c", KILLED_TRAINER, *args], stdout=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "uploading"
            proxy.set_mode("delay", delay_s=0.05)  # 64 KiB per 50 ms: the copy takes seconds
            deadline = time.monotonic() + 60
            names: list[str] = []
            while not names:  # the first data file is there, the manifest is not
                assert time.monotonic() < deadline, "no object of step 2 appeared"
                listed = client.list_objects_v2(Bucket=s3_bucket, Prefix="run/step-2/")
                names = [o["Key"] for o in listed.get("Contents", [])]
                time.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
            proxy.mode = "pass"
    assert "run/step-2/manifest.json" not in names
    options = dataclasses.replace(_options(s3_server), lease_expiry_s=2.0, lease_renew_s=0.5)
    assert _store_steps(url, options) == []  # half a step: never visible

    # the next job takes the store over (the killed one's lease expired); step 2 copied
    # again goes over what the killed copy left (removed first), then step 4
    time.sleep(2.5)
    config = CheckpointConfig(
        folder=folder,
        interval=2,
        async_mode="thread",
        storage=options,
        upload=UploadTierConfig(url, every=2),
    )
    model = torch.nn.Linear(1024, 1024)
    manager = CheckpointManager(config, {"model": ModelState(model)})
    assert manager.load() == 2
    assert manager.last_load is not None and manager.last_load.tier == "folder"
    tier = manager.upload_tier
    assert tier is not None and tier.uploader is not None
    tier.uploader.offer(2)
    manager.save(3)
    manager.save(4)
    _settle(manager)
    assert tier.uploader.log.committed == [2, 4] and tier.uploader.failures == 0
    manager.close()
    assert _store_steps(url, options) == [2, 4]
    client.close()


def test_the_folder_keeps_a_step_while_its_upload_runs(s3_server, s3_bucket, tmp_path) -> None:
    url = f"s3://{s3_bucket}/run"
    folder = str(tmp_path / "ckpt")
    with FaultProxy("127.0.0.1", s3_server.ports["s3"]) as proxy:
        options = _options(s3_server, proxy.endpoint_url)
        config = CheckpointConfig(
            folder=folder,
            interval=2,
            keep_latest_k=1,
            async_mode="thread",
            storage=options,
            upload=UploadTierConfig(url, every=4),
        )
        torch.manual_seed(0)
        model = torch.nn.Linear(1024, 1024)  # 4 MiB: a copy of seconds through the proxy
        manager = CheckpointManager(config, {"model": ModelState(model)})
        tier = manager.upload_tier
        assert tier is not None and tier.uploader is not None
        proxy.set_mode("delay", delay_s=0.05)
        kept_while_uploading = []
        for step in range(1, 9):
            with torch.no_grad():
                model.weight.add_(1.0)
            manager.save(step)
            manager.wait()  # committed, and the folder's retention (keep 1) done
            if 4 in tier.uploader.holding():
                kept_while_uploading.append((step, committed_steps(folder)))
        # step 4's copy outlived the saves of 6 and 8, and the folder kept it meanwhile
        assert (8, [4, 8]) in kept_while_uploading, kept_while_uploading
        proxy.mode = "pass"
        manager.close()  # waits for step 4's upload, then step 8's
        assert tier.uploader.log.committed == [4, 8] and tier.uploader.failures == 0
        assert _store_steps(url, options) == [4, 8]
        # released, step 4 is the folder's retention's again, after its next commit
        assert committed_steps(folder) == [4, 8]


def _kill_agents(where: Path) -> None:
    for record in where.rglob("agent.json"):
        try:
            os.kill(int(json.loads(record.read_text())["pid"]), signal.SIGKILL)
        except (OSError, ValueError, KeyError):
            pass


def test_a_newer_step_on_the_store_wins_over_older_node_memory(
    s3_server, s3_bucket, tmp_path
) -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm (tmpfs) on this machine")
    root = Path("/dev/shm") / f"qs-upload-{uuid.uuid4().hex[:12]}"
    root.mkdir()
    options = _options(s3_server)
    url = f"s3://{s3_bucket}/run"
    folder = tmp_path / "ckpt"
    memory = MemoryTierConfig(every=3, keep=1, root=str(root), job_id=root.name)
    config = CheckpointConfig(
        folder=str(folder),
        interval=2,
        async_mode="thread",
        storage=options,
        memory=memory,
        upload=UploadTierConfig(url, every=4),
    )
    try:
        job = _Job()
        manager = CheckpointManager(config, job.states())
        with pytest.raises(RuntimeError, match="the trainer fails"), manager:
            for step in range(1, 9):
                job.step(step)
                manager.save(step)
                _settle(manager)
            assert manager.memory_tier is not None and manager.memory_tier.steps() == [3]
            saved = job.snapshot()
            raise RuntimeError("the trainer fails")  # the node's memory outlives it
        shutil.rmtree(folder)  # and the folder is lost
        fresh = _Job(seed=3)
        again = CheckpointManager(config, fresh.states())
        assert again.load() == 8  # the store's step 8, not node memory's step 3
        assert again.last_load is not None and again.last_load.tier == "object-store"
        got = fresh.snapshot()
        assert all(torch.equal(got[k], v) for k, v in saved.items())
        again.close()
    finally:
        _kill_agents(root)
        shutil.rmtree(root, ignore_errors=True)
