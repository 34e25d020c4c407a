"""The writer lease on object stores (manager/store_lease.py), against SeaweedFS.

Two managers on one ``s3://`` prefix: the second is read-only and deletes nothing while
the first's save is in flight, which commits; a holder SIGKILLed on this machine is
taken over at once, one of another machine after its lease expires (and its leftovers go
only after one more expiry period); renewals keep a long save's lease alive; a lease
lost to another writer stops every deletion; conditional writes are detected (S3, MSC,
local files), and a store that ignores them gets a best-effort lease and a warning.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import quicksave
from quicksave.errors import CheckpointError
from quicksave.loading.verify import verify_checkpoint
from quicksave.manager import CheckpointConfig, CheckpointManager, store_lease
from quicksave.manager.store_lease import LEASE_NAME, Holder, LeaseRecord, StoreLease
from quicksave.storage import StorageOptions, parse_location
from quicksave.storage.local import LocalBackend
from quicksave.storage.s3 import S3Backend

pytestmark = pytest.mark.slow

ELSEWHERE = Holder("another-machine", 4242, "another-boot", 1, 1)


@pytest.fixture
def s3_env(s3_server, monkeypatch, tmp_path) -> dict[str, str]:
    """The AWS environment chain pointing at the server; cwd an empty directory."""
    env = s3_server.env()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    return env


def _keys(s3_server, bucket: str, prefix: str) -> dict[str, str]:
    """Key -> ETag of every object under ``prefix``."""
    client = s3_server.client()
    try:
        out: dict[str, str] = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for o in page.get("Contents", []):
                out[o["Key"]] = o["ETag"]
        return out
    finally:
        client.close()


def _put(s3_server, bucket: str, key: str, body: bytes = b"x" * 64) -> None:
    client = s3_server.client()
    try:
        client.put_object(Bucket=bucket, Key=key, Body=body)
    finally:
        client.close()


def _lease_record(s3_server, bucket: str, prefix: str) -> LeaseRecord | None:
    client = s3_server.client()
    try:
        raw = client.get_object(Bucket=bucket, Key=f"{prefix}/{LEASE_NAME}")["Body"].read()
    finally:
        client.close()
    return LeaseRecord.decode(raw)


def _options(s3_server, endpoint_url: str | None = None, **lease: Any) -> StorageOptions:
    opts = s3_server.storage_options(endpoint_url=endpoint_url)
    return dataclasses.replace(opts, **lease)


def _spawn_holder(folder: str, env: dict[str, str], expiry_s: float, machine: str):
    child_env = dict(os.environ, **env)
    child_env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2] / "src")
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("lease_holder.py")), folder,
         str(expiry_s), "0.2", machine],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env,
        start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 120.0)
    line = proc.stdout.readline() if ready else "(nothing within 120 s)"
    if line.strip() != "holding":
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        raise AssertionError(f"the lease holder did not start: {line!r} {proc.stderr.read()}")
    return proc


def _kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


# ---------------------------------------------------------------- conditional writes


def test_seaweedfs_honours_conditional_writes(s3_server, s3_bucket) -> None:
    with S3Backend(s3_bucket, s3_server.storage_options().s3) as b:
        tag = b.put_if("c/obj", b"one")
        assert tag is not None
        assert b.put_if("c/obj", b"two") is None  # If-None-Match: * on an existing key
        assert b.put_if("c/obj", b"two", if_match='"0123"') is None  # a stale version
        assert b.get_tagged("c/obj", 100) == (b"one", tag)
        newer = b.put_if("c/obj", b"three", if_match=tag)
        assert newer is not None and newer != tag
        assert b.get_tagged("c/obj", 100) == (b"three", newer)
        assert b.put_if("c/obj", b"four", if_match=tag) is None  # the old version is gone
        assert b.get_tagged("c/missing", 100) is None
    lease = StoreLease(parse_location(f"s3://{s3_bucket}/run", options=s3_server.storage_options()))
    try:
        assert lease.try_acquire() and lease.enforced and lease.previous == "none"
    finally:
        lease.release()


def test_msc_conditional_writes_through_the_profile(s3_server, s3_bucket, tmp_path) -> None:
    import multistorageclient  # noqa: F401  (pinned in the dev extra)
    from msc_config import msc_config_for

    from quicksave.storage.msc import MscBackend

    config = msc_config_for(s3_server, s3_bucket, tmp_path, profile="qs")
    with MscBackend("qs", StorageOptions(msc_config=config)) as b:
        tag = b.put_if("m/obj", b"one")
        assert tag is not None and b.put_if("m/obj", b"two") is None
        assert b.put_if("m/obj", b"two", if_match='"0123"') is None
        assert b.get_tagged("m/obj", 100) == (b"one", tag)
        assert b.put_if("m/obj", b"three", if_match=tag) is not None
    lease = StoreLease(parse_location("msc://qs/run", options=StorageOptions(msc_config=config)))
    try:
        assert lease.try_acquire() and lease.enforced
    finally:
        lease.release()


def test_local_conditional_writes(tmp_path) -> None:
    b = LocalBackend(fsync=False)
    key = str(tmp_path / "obj")
    tag = b.put_if(key, b"one")
    assert tag is not None and b.put_if(key, b"two") is None
    assert b.get_tagged(key, 100) == (b"one", tag)
    assert b.put_if(key, b"two", if_match="0" * 16) is None
    results: list[str | None] = []
    barrier = threading.Barrier(4)

    def replace(body: bytes) -> None:
        barrier.wait()
        results.append(b.put_if(key, body, if_match=tag))

    threads = [threading.Thread(target=replace, args=(bytes([65 + i]),)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [r for r in results if r is not None]
    assert len(won) == 1, results  # one compare-and-swap of one version wins
    assert b.get_tagged(key, 100)[1] == won[0]
    assert sorted(os.listdir(tmp_path)) == ["obj"]  # no spare files left behind


def test_a_store_that_ignores_conditions_gets_a_best_effort_lease(
    s3_env, s3_server, s3_bucket, monkeypatch, caplog
) -> None:
    def unconditional(self, key: str, data: bytes, *, if_match: str | None = None) -> str:
        self.put(key, memoryview(data))  # what a store without conditional writes does
        return '"ignored"'

    monkeypatch.setattr(S3Backend, "put_if", unconditional)
    config = CheckpointConfig(folder=f"s3://{s3_bucket}/be", async_mode="disabled")
    with caplog.at_level(logging.WARNING, logger="quicksave"):
        first = CheckpointManager(config, {"model": torch.nn.Linear(2, 2)})
    try:
        assert first.read_only_reason is None
        assert "best-effort" in caplog.text and f"s3://{s3_bucket}/be" in caplog.text
        assert first.session.lease is not None and not first.session.lease.enforced
        # still seen by a second writer (read back after the settle pause)
        second = CheckpointManager(config, {"model": torch.nn.Linear(2, 2)})
        assert second.read_only_reason is not None
        assert f"pid {os.getpid()}" in second.read_only_reason
        second.close()
        first.save(1, force=True)
    finally:
        first.close()
    assert not any(k.endswith("probe") or "-probe-" in k for k in _keys(s3_server, s3_bucket, ""))


# ---------------------------------------------------------------- two writers


def _slow_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(1024, 2048)  # 8 MiB of weights: seconds through the proxy


def test_second_writer_is_read_only_and_deletes_nothing_while_a_save_is_in_flight(
    s3_env, s3_server, s3_bucket, fault_proxy, monkeypatch
) -> None:
    folder = f"s3://{s3_bucket}/two"
    opts = _options(s3_server, fault_proxy.endpoint_url, lease_expiry_s=20.0, lease_renew_s=0.2)
    model = _slow_model()
    first = CheckpointManager(CheckpointConfig(folder=folder, storage=opts), {"model": model})
    try:
        _put(s3_server, s3_bucket, "two/step-1/rank-00000-00.safetensors")  # a crashed try
        fault_proxy.set_mode("delay", delay_s=0.05)
        assert first.save(2, force=True)  # in flight: the upload crawls through the proxy
        before = _keys(s3_server, s3_bucket, "two/")
        seconds = []
        for machine in ("here", "elsewhere"):
            config = CheckpointConfig(
                folder=folder, storage=_options(s3_server, lease_expiry_s=20.0)
            )
            with monkeypatch.context() as patch:
                if machine == "elsewhere":  # a job on another node: only renewals tell
                    patch.setattr(store_lease, "this_process", lambda: ELSEWHERE)
                second = CheckpointManager(config, {"model": torch.nn.Linear(1024, 2048)})
            seconds.append(second)
            reason = second.read_only_reason
            assert reason is not None and f"pid {os.getpid()}" in reason, reason
            if machine == "here":  # another manager of this very process
                assert reason.startswith(f"this process (pid {os.getpid()} on host "), reason
                assert "another manager in this process writes to this folder" in reason
            else:
                assert reason.startswith("another live process holds"), reason
            with pytest.raises(CheckpointError, match="writer lease") as info:
                second.save(3, force=True)  # never replaces the in-flight step-2, or step-1
            assert f"pid {os.getpid()}" in str(info.value)
            assert second.latest_step() is None
        assert 2 in first.session.in_flight  # all of this happened while the save was in flight
        after = _keys(s3_server, s3_bucket, "two/")
        assert set(before) <= set(after)  # the second writers deleted nothing
        for second in seconds:
            second.close()
        fault_proxy.set_mode("pass")
        first.wait()
        assert first.committed_steps() == [2]
        assert verify_checkpoint(first.step_path(2)).ok
    finally:
        fault_proxy.set_mode("pass")
        first.close()
    out = torch.nn.Linear(1024, 2048)
    quicksave.load({"model": out.state_dict()}, f"{folder}/step-2")
    assert torch.equal(out.weight, model.weight)
    record = _lease_record(s3_server, s3_bucket, "two")
    assert record is not None and record.released and record.holder.pid == os.getpid()


def test_renewals_keep_a_long_saves_lease_alive(
    s3_env, s3_server, s3_bucket, fault_proxy, monkeypatch
) -> None:
    expiry = 4.0
    folder = f"s3://{s3_bucket}/long"
    opts = _options(s3_server, fault_proxy.endpoint_url, lease_expiry_s=expiry, lease_renew_s=0.2)
    config = CheckpointConfig(folder=folder, storage=opts)
    first = CheckpointManager(config, {"model": _slow_model()})
    try:
        fault_proxy.set_mode("delay", delay_s=0.1)
        assert first.save(1, force=True)
        time.sleep(expiry * 1.5)  # longer than the lease lives without a renewal
        assert 1 in first.session.in_flight, "the save ended too soon to test anything"
        record = _lease_record(s3_server, s3_bucket, "long")
        assert record is not None and record.token == first.session.lease._token
        assert record.renewed_at - record.since > expiry  # renewed past one expiry period
        config = CheckpointConfig(
            folder=folder, storage=_options(s3_server, lease_expiry_s=expiry, lease_renew_s=0.2)
        )
        with monkeypatch.context() as patch:  # a job on another node: only renewals tell
            patch.setattr(store_lease, "this_process", lambda: ELSEWHERE)
            second = CheckpointManager(config, {"model": torch.nn.Linear(1024, 2048)})
        assert second.read_only_reason is not None  # it saw a renewal: the holder lives
        second.close()
        fault_proxy.set_mode("pass")
        first.wait()
        assert first.committed_steps() == [1]
        assert first.session.lease.held and first.session.lease.renewals >= 5
    finally:
        fault_proxy.set_mode("pass")
        first.close()


# ---------------------------------------------------------------- dead holders


def test_holder_killed_on_this_machine_is_taken_over_at_once(s3_env, s3_server, s3_bucket):
    folder = f"s3://{s3_bucket}/kill"
    holder = _spawn_holder(folder, s3_env, 30.0, "here")
    try:
        _put(s3_server, s3_bucket, "kill/step-7/rank-00000-00.safetensors")  # its save
        config = CheckpointConfig(
            folder=folder, async_mode="disabled", storage=StorageOptions(stale_after_s=0.0)
        )
        with CheckpointManager(config, {"model": torch.nn.Linear(4, 4)}) as m:
            assert m.read_only_reason is not None and f"pid {holder.pid}" in m.read_only_reason
        assert "kill/step-7/rank-00000-00.safetensors" in _keys(s3_server, s3_bucket, "kill/")
    finally:
        _kill(holder)
    # the lease is 30 s from expiring, but its holder is provably gone
    with CheckpointManager(config, {"model": torch.nn.Linear(4, 4)}) as m:
        assert m.read_only_reason is None
        assert m.session.lease.previous == "gone"
        assert not any(k.startswith("kill/step-7/") for k in _keys(s3_server, s3_bucket, "kill/"))
        m.save(7, force=True)
        assert m.committed_steps() == [7]


def test_expired_holder_of_another_machine_is_taken_over_and_cleaned_up_after_expiry(
    s3_env, s3_server, s3_bucket
) -> None:
    expiry = 2.0
    folder = f"s3://{s3_bucket}/away"
    holder = _spawn_holder(folder, s3_env, expiry, "elsewhere")
    leftover = "away/step-7/rank-00000-00.safetensors"
    try:
        _put(s3_server, s3_bucket, leftover)  # its in-flight save
    finally:
        _kill(holder)
    storage = StorageOptions(stale_after_s=0.0, lease_expiry_s=expiry, lease_renew_s=0.2)
    config = CheckpointConfig(folder=folder, async_mode="disabled", storage=storage)
    with CheckpointManager(config, {"model": torch.nn.Linear(4, 4)}) as m:
        assert m.read_only_reason is None  # no renewal came: expired, taken over
        assert m.session.lease.previous == "expired"
        assert leftover in _keys(s3_server, s3_bucket, "away/")  # not yet: no evidence yet
        record = _lease_record(s3_server, s3_bucket, "away")
        assert record is not None and record.token == m.session.lease._token
        time.sleep(expiry)  # held for one expiry period: the old holder had time to notice
        m.save(1, force=True)  # its commit runs the clean-up that was due
        assert m.committed_steps() == [1]
        assert not any(k.startswith("away/step-7/") for k in _keys(s3_server, s3_bucket, "away/"))


def test_a_lost_lease_stops_every_deletion(s3_env, s3_server, s3_bucket) -> None:
    folder = f"s3://{s3_bucket}/lost"
    storage = StorageOptions(lease_expiry_s=30.0, lease_renew_s=0.2)
    config = CheckpointConfig(folder=folder, async_mode="disabled", storage=storage)
    with CheckpointManager(config, {"model": torch.nn.Linear(4, 4)}) as m:
        lease = m.session.lease
        assert lease is not None and lease.held
        _put(s3_server, s3_bucket, "lost/step-9/rank-00000-00.safetensors")
        usurper = LeaseRecord("f" * 32, ELSEWHERE, time.time(), time.time(), 0, 30.0, 5.0)
        _put(s3_server, s3_bucket, f"lost/{LEASE_NAME}", usurper.encode())
        deadline = time.monotonic() + 60
        while lease.held and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not lease.held  # its next renewal was refused
        guarded = lease.guard(None)
        with pytest.raises(CheckpointError, match="lost the folder's writer lease"):
            guarded.delete(["lost/step-9/rank-00000-00.safetensors"])
        assert "lost/step-9/rank-00000-00.safetensors" in _keys(s3_server, s3_bucket, "lost/")
    record = _lease_record(s3_server, s3_bucket, "lost")
    assert record == usurper  # close() did not release over the new holder


def test_a_lease_object_of_another_format_is_respected_while_it_changes(
    s3_server, s3_bucket
) -> None:
    key = f"odd/{LEASE_NAME}"
    _put(s3_server, s3_bucket, key, b'{"lease": 2, "beat": 0}')  # a newer quicksave's?
    stop = threading.Event()

    def newer_holder() -> None:  # renews its lease in a format we cannot read
        beat = 0
        while not stop.wait(0.1):
            beat += 1
            _put(s3_server, s3_bucket, key, b'{"lease": 2, "beat": %d}' % beat)

    beating = threading.Thread(target=newer_holder)
    beating.start()
    folder = parse_location(
        f"s3://{s3_bucket}/odd", options=_options(s3_server, lease_expiry_s=10.0)
    )
    try:
        lease = StoreLease(folder)
        assert not lease.try_acquire()  # it changed while watched: someone renews it
        assert "cannot read" in lease.holder()
        lease.release()
    finally:
        stop.set()
        beating.join()
    quiet = parse_location(
        f"s3://{s3_bucket}/odd",
        options=_options(s3_server, lease_expiry_s=1.0, lease_renew_s=0.2),
    )
    lease = StoreLease(quiet)
    begin = time.monotonic()
    try:
        assert lease.try_acquire()  # unchanged for one expiry period of watching
        assert time.monotonic() - begin >= 1.0
        assert lease.previous == "expired"
    finally:
        lease.release()


# ---------------------------------------------------------------- torchtitan


def test_torchtitan_backend_takes_the_same_lease(
    s3_env, s3_server, s3_bucket, monkeypatch, caplog
) -> None:
    import torchtitan  # noqa: F401  (pinned in the dev extra)

    from helpers import titan
    from quicksave.integrations.torchtitan import QuicksaveCheckpointManager

    def config() -> Any:
        return QuicksaveCheckpointManager.Config(
            enable=True, folder=f"s3://{s3_bucket}/titan", interval=2, async_mode="disabled"
        )

    first = titan.build(config(), "")
    try:
        assert first.checkpointer.read_only_reason is None
        titan.train(first, until=2)
        second = titan.build(config(), "")
        reason = second.checkpointer.read_only_reason
        assert reason is not None and f"pid {os.getpid()}" in reason, reason
        second.checkpointer.close()
        assert first.checkpointer.committed_steps() == [2]
    finally:
        first.checkpointer.close()

    def unconditional(self, key: str, data: bytes, *, if_match: str | None = None) -> str:
        self.put(key, memoryview(data))
        return '"ignored"'

    monkeypatch.setattr(S3Backend, "put_if", unconditional)
    with caplog.at_level(logging.WARNING, logger="quicksave"):
        third = titan.build(config(), "")
    try:
        assert third.checkpointer.read_only_reason is None
        assert "best-effort" in caplog.text  # said where the lease is not enforced
    finally:
        third.checkpointer.close()
