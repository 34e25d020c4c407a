"""Checkpoints on a real S3 server (SeaweedFS on loopback): save/load/verify/ls/convert,
the manager, commit without rename, clean-up by age, corruption, bad destinations."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.helpers.state import assert_bit_equal, random_tensor, storable_dtypes

import quicksave
from quicksave.errors import (
    CheckpointError,
    CheckpointExistsError,
    CorruptCheckpointError,
)
from quicksave.loading.catalog import list_checkpoints
from quicksave.loading.verify import verify_checkpoint
from quicksave.manager import CheckpointConfig, CheckpointManager, OptimizerState
from quicksave.storage import S3Options, StorageOptions
from quicksave.tools.convert import convert
from quicksave.tools.inspect_checkpoint import inspect_checkpoint


@pytest.fixture
def s3_env(s3_server, monkeypatch, tmp_path) -> dict[str, str]:
    """The AWS environment chain pointing at the server; cwd is an empty temporary
    directory, so that anything written locally by mistake is seen."""
    env = s3_server.env()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    return env


def _objects(s3_server, bucket: str, prefix: str = "") -> dict[str, int]:
    client = s3_server.client()
    try:
        out: dict[str, int] = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for o in page.get("Contents", []):
                out[o["Key"]] = o["Size"]
        return out
    finally:
        client.close()


def _admin_options(s3_server, endpoint_url: str | None = None, **kw: Any) -> S3Options:
    """S3Options with the server's admin credentials (``endpoint_url``: e.g. a proxy's)."""
    return S3Options(
        endpoint_url=endpoint_url or s3_server.endpoint_url,
        access_key_id=s3_server.access_key_id,
        secret_access_key=s3_server.secret_access_key,
        region=s3_server.region,
        **kw,
    )


def _state(seed: int = 0) -> dict[str, Any]:
    sd: dict[str, Any] = {
        f"t.{str(dt).removeprefix('torch.')}": random_tensor((7, 5), dt, seed)
        for dt in storable_dtypes()
    }
    big = random_tensor((3, 1000, 1000), torch.float32, seed + 1)  # 12 MB: multipart
    sd["layout.big"] = big
    sd["layout.view"] = big[1, ::3, 5:17]  # not contiguous
    sd["layout.scalar"] = torch.tensor(2.5, dtype=torch.float64)
    sd["layout.empty"] = torch.empty(0, 4, dtype=torch.int16)
    sd["nested"] = {"a": torch.arange(10), "list": [torch.ones(3), 4], "name": "x"}
    sd["step"] = 17
    return sd


def _blank(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value.contiguous())
    if isinstance(value, dict):
        return {k: _blank(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_blank(v) for v in value]
    return type(value)() if isinstance(value, (int, float, str)) else value


def _assert_same(actual: Any, expected: Any, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert_bit_equal(actual, expected.contiguous(), where)
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), where
        for k in expected:
            _assert_same(actual[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where


def test_save_load_round_trip_every_dtype_and_layout(s3_env, s3_server, s3_bucket) -> None:
    sd = _state()
    url = f"s3://{s3_bucket}/run/step-1"
    quicksave.save(sd, url, step=1, user_metadata={"who": "test"})
    out = _blank(sd)
    quicksave.load(out, url)
    _assert_same(out, sd)
    assert not os.listdir("."), "nothing is ever written locally for a URL"
    keys = _objects(s3_server, s3_bucket)
    assert "run/step-1/manifest.json" in keys and "run/step-1/.metadata" in keys
    assert verify_checkpoint(url).ok
    summary = inspect_checkpoint(url)
    assert summary.step == 1 and summary.user_metadata == {"who": "test"}


def test_async_engine_saves_straight_from_the_pool(s3_env, s3_bucket) -> None:
    from quicksave.saving.config import EngineConfig
    from quicksave.saving.engine import AsyncSaver

    sd = _state(3)
    saver = AsyncSaver(EngineConfig(thread_count=2))
    try:
        for step in (1, 2):
            url = f"s3://{s3_bucket}/a/step-{step}"
            handle = saver.save(sd, url, step=step)
            assert handle is not None
            result = handle.wait(120)
            assert result.path == url
    finally:
        saver.close()
    out = _blank(sd)
    quicksave.load(out, f"s3://{s3_bucket}/a/step-2")
    _assert_same(out, sd)
    assert [i.step for i in list_checkpoints(f"s3://{s3_bucket}/a")] == [1, 2]
    assert not os.listdir(".")


def test_explicit_options_override_the_environment(s3_server, s3_bucket, monkeypatch) -> None:
    for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(k, "nonsense-" + k if k != "AWS_ENDPOINT_URL" else "http://127.0.0.1:9")
    opts = StorageOptions(s3=_admin_options(s3_server))
    sd = {"w": torch.randn(8, 8)}
    quicksave.save(sd, f"s3://{s3_bucket}/o/step-1", storage=opts)
    out = {"w": torch.zeros(8, 8)}
    quicksave.load(out, f"s3://{s3_bucket}/o/step-1", storage=opts)
    assert torch.equal(out["w"], sd["w"])
    assert s3_server.secret_access_key not in repr(opts)


def test_existing_checkpoint_and_leftovers_are_never_overwritten(s3_env, s3_server, s3_bucket):
    url = f"s3://{s3_bucket}/r/step-1"
    quicksave.save({"w": torch.ones(3)}, url)
    with pytest.raises(CheckpointExistsError, match="already exists") as info:
        quicksave.save({"w": torch.zeros(3)}, url)
    assert info.value.path == url
    client = s3_server.client()
    client.put_object(Bucket=s3_bucket, Key="r/step-2/rank-00000-00.safetensors", Body=b"x")
    client.close()
    with pytest.raises(CheckpointExistsError, match="uncommitted save"):
        quicksave.save({"w": torch.zeros(3)}, f"s3://{s3_bucket}/r/step-2")
    out = {"w": torch.zeros(3)}
    quicksave.load(out, url)
    assert torch.equal(out["w"], torch.ones(3))


class _Weights(torch.nn.Module):
    def __init__(self, value: float = 0.0) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((3,), value))


def _manager(folder: str, model: torch.nn.Module, **kw: Any) -> CheckpointManager:
    return CheckpointManager(
        CheckpointConfig(folder=folder, async_mode="disabled", **kw), {"model": model}
    )


def test_prefix_without_manifest_is_never_a_checkpoint(s3_env, s3_server, s3_bucket) -> None:
    folder = f"s3://{s3_bucket}/f"
    for step in (1, 2):
        with _manager(folder, _Weights(float(step))) as m:
            m.save(step, force=True)
    client = s3_server.client()
    client.delete_object(Bucket=s3_bucket, Key="f/step-2/manifest.json")  # a torn save
    client.close()
    infos = {i.name: i for i in list_checkpoints(folder)}
    assert infos["step-1"].committed and not infos["step-2"].committed
    with pytest.raises(quicksave.NotCommittedError):
        quicksave.load({"model": _Weights()}, f"{folder}/step-2")
    model = _Weights()
    with _manager(folder, model) as m:
        assert m.committed_steps() == [1]
        assert m.load() == 1
    assert torch.equal(model.w.detach(), torch.full((3,), 1.0))


def test_corruption_is_caught_by_verify_and_load(s3_env, s3_server, s3_bucket) -> None:
    sd = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    url = f"s3://{s3_bucket}/c/step-1"
    quicksave.save(sd, url)
    client = s3_server.client()
    key = next(k for k in _objects(s3_server, s3_bucket, "c/step-1/") if k.endswith(".safetensors"))
    data = bytearray(client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    data[-7] ^= 0x40  # inside the last tensor's bytes
    client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(data))
    client.close()
    report = verify_checkpoint(url)
    assert not report.ok
    assert any(p.kind == "chunk" for p in report.problems), report.problems
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as info:
        quicksave.load({"w": torch.zeros(64, 64), "b": torch.zeros(64)}, url)
    assert info.value.path is not None and info.value.path.startswith(f"s3://{s3_bucket}/c/step-1")


def test_manager_lifecycle_with_retention(s3_env, s3_server, s3_bucket) -> None:
    model = torch.nn.Linear(32, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    folder = f"s3://{s3_bucket}/job"
    config = CheckpointConfig(folder=folder, interval=2, keep_latest_k=2)

    def states() -> dict[str, Any]:
        return {"model": model, "optim": OptimizerState(model, opt)}

    manager = CheckpointManager(config, states())
    try:
        for step in range(1, 11):
            model(torch.randn(4, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
            manager.save(step)
    finally:
        manager.close()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    keys = _objects(s3_server, s3_bucket, "job/")
    assert "job/.quicksave-lease.json" in keys  # the writer lease, released, stays
    steps = sorted({k.split("/")[1] for k in keys} - {".quicksave-lease.json"})
    assert steps == ["step-10", "step-8"], steps  # retention removed manifest and data
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    manager = CheckpointManager(config, states())
    try:
        assert manager.committed_steps() == [8, 10]
        assert manager.load() == 10
    finally:
        manager.close()
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert not os.listdir(".")


def test_startup_cleans_only_stale_leftovers(s3_env, s3_server, s3_bucket) -> None:
    folder = f"s3://{s3_bucket}/clean"
    quicksave.save({"w": torch.ones(2)}, f"{folder}/step-1")
    client = s3_server.client()
    client.put_object(Bucket=s3_bucket, Key="clean/step-2/rank-00000-00.safetensors", Body=b"x")
    client.put_object(Bucket=s3_bucket, Key="clean/step-1/part-rank-00001.json", Body=b"{}")
    upload = client.create_multipart_upload(
        Bucket=s3_bucket, Key="clean/step-3/rank-00000-00.safetensors"
    )
    client.close()

    def start(stale_after_s: float) -> None:
        config = CheckpointConfig(
            folder=folder,
            async_mode="disabled",
            storage=StorageOptions(stale_after_s=stale_after_s),
        )
        CheckpointManager(config, {"model": _Weights()}).close()

    start(3600.0)  # a concurrent writer's fresh objects are never hit
    keys = _objects(s3_server, s3_bucket, "clean/")
    assert "clean/step-2/rank-00000-00.safetensors" in keys
    assert "clean/step-1/part-rank-00001.json" in keys
    time.sleep(1.1)
    start(0.5)
    keys = _objects(s3_server, s3_bucket, "clean/")
    assert not any(k.startswith("clean/step-2/") for k in keys), keys
    assert "clean/step-1/part-rank-00001.json" not in keys
    assert "clean/step-1/manifest.json" in keys  # the committed checkpoint stays whole
    client = s3_server.client()
    uploads = client.list_multipart_uploads(Bucket=s3_bucket, Prefix="clean/").get("Uploads", [])
    client.close()
    assert upload["UploadId"] not in {u["UploadId"] for u in uploads}
    out = {"w": torch.zeros(2)}
    quicksave.load(out, f"{folder}/step-1")
    assert torch.equal(out["w"], torch.ones(2))


def test_bad_destinations_fail_at_once_naming_the_url(s3_server, s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    monkeypatch.setenv("AWS_REGION", s3_server.region)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key_id)
    secret = "wrong-secret-do-not-print-0123456789abcdef"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    sd = {"w": torch.ones(4)}
    cases: list[tuple[str, StorageOptions | None]] = [(f"s3://{s3_bucket}/bad/step-1", None)]
    good = _admin_options(s3_server)
    cases.append(("s3://no-such-bucket-qs/x/step-1", StorageOptions(s3=good)))
    dead = S3Options(
        endpoint_url="http://127.0.0.1:9",  # nothing listens there
        access_key_id="k",
        secret_access_key=secret,
        region="us-east-1",
        max_attempts=2,
        retry_deadline_s=2.0,
        connect_timeout_s=1.0,
    )
    cases.append((f"s3://{s3_bucket}/dead/step-1", StorageOptions(s3=dead)))
    denied = S3Options(
        endpoint_url=s3_server.endpoint_url,
        access_key_id=s3_server.restricted_access_key_id,
        secret_access_key=s3_server.restricted_secret_access_key,
        region=s3_server.region,
    )
    cases.append((f"s3://{s3_bucket}/denied/step-1", StorageOptions(s3=denied)))
    for url, opts in cases:
        began = time.monotonic()
        with pytest.raises(CheckpointError) as info:
            quicksave.save(sd, url, storage=opts)
        took = time.monotonic() - began
        text = f"{info.value} {info.value!r}"
        assert url.rsplit("/", 2)[0] in text, text
        assert secret not in text and s3_server.secret_access_key not in text, text
        assert took < 60, f"{url}: {took:.1f} s"  # a hang guard, not a timing test
        with pytest.raises(CheckpointError):
            CheckpointManager(
                CheckpointConfig(
                    folder=url.rsplit("/", 1)[0],
                    async_mode="disabled",
                    storage=opts or StorageOptions(),
                ),
                {"model": _Weights()},
            )


def test_unknown_and_malformed_urls_are_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for url in ("gs://b/x", "s3://", "s3:///x", "s3://b/../x", "s3://Bad_Bucket/x"):
        with pytest.raises(CheckpointError) as info:
            quicksave.save({"w": torch.ones(2)}, url)
        assert info.value.path == url
    assert not os.listdir(tmp_path)


def test_convert_between_local_and_s3(s3_env, s3_bucket, tmp_path) -> None:
    sd = {"w": torch.randn(10, 10), "meta": {"lr": 0.1}}
    local = tmp_path / "local" / "step-5"
    quicksave.save(sd, str(local), step=5)
    url = f"s3://{s3_bucket}/conv/step-5"
    assert convert(str(local), url, "quicksave") == url
    out = {"w": torch.zeros(10, 10), "meta": {"lr": 0.0}}
    quicksave.load(out, url)
    assert torch.equal(out["w"], sd["w"]) and out["meta"] == {"lr": 0.1}
    assert inspect_checkpoint(url).step == 5
    back = tmp_path / "back" / "step-5"
    convert(url, str(back), "quicksave")
    out2 = {"w": torch.zeros(10, 10), "meta": {"lr": 0.0}}
    quicksave.load(out2, str(back))
    assert torch.equal(out2["w"], sd["w"])
    torch_file = tmp_path / "model.pt"
    convert(url, str(torch_file), "torch")
    assert torch.equal(torch.load(torch_file)["w"], sd["w"])
    remote_file = f"s3://{s3_bucket}/conv/model.safetensors"
    convert(url, remote_file, "safetensors")
    with pytest.raises(CheckpointExistsError):
        convert(url, remote_file, "safetensors")


def test_cli_on_s3_urls(s3_env, s3_bucket) -> None:
    quicksave.save({"w": torch.randn(5)}, f"s3://{s3_bucket}/cli/step-3", step=3)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2] / "src")])

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "quicksave.cli.main", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )

    r = cli("ls", f"s3://{s3_bucket}/cli")
    assert r.returncode == 0, r.stderr
    assert "step-3" in r.stdout and "committed" in r.stdout
    r = cli("verify", f"s3://{s3_bucket}/cli/step-3")
    assert r.returncode == 0, r.stdout + r.stderr
    r = cli("inspect", f"s3://{s3_bucket}/cli/step-3")
    assert r.returncode == 0 and "w" in r.stdout, r.stderr
    r = cli("verify", f"s3://{s3_bucket}/cli/step-4")
    assert r.returncode != 0 and f"s3://{s3_bucket}/cli/step-4" in r.stderr + r.stdout
    assert not os.listdir(".")


def _spawn_trainer(folder: str, steps: int, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("s3_trainer.py")), folder, str(steps)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    )


def _read_until(proc: subprocess.Popen[str], prefix: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"trainer never printed {prefix!r}")


def test_sigkill_of_the_trainer_mid_upload(s3_env, s3_server, s3_bucket, fault_proxy) -> None:
    """Uploads slowed by the proxy; the trainer (and with it its worker, which follows
    its parent) is SIGKILLed at random moments of several runs: every listed checkpoint
    verifies, each restart resumes from the newest committed one, clean-up at start-up
    leaves nothing half-visible."""
    import random
    import signal

    rng = random.Random(7)
    env = dict(os.environ, **s3_server.env())
    env["AWS_ENDPOINT_URL"] = fault_proxy.endpoint_url
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2] / "src")
    fault_proxy.set_mode("delay", delay_s=0.002)  # per chunk: uploads take ~1 s
    folder = f"s3://{s3_bucket}/kill"
    resumed: list[int] = []
    for _ in range(4):
        proc = _spawn_trainer(folder, 1000, env)
        try:
            resumed.append(int(_read_until(proc, "resumed", 120).split()[1]))
            for _ in range(3):  # one save in flight at a time: step N+2 committed
                _read_until(proc, "saved", 120)
            time.sleep(rng.uniform(0.0, 2.0))
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        time.sleep(0.3)  # the worker notices its parent's death within a second
        for info in [i for i in list_checkpoints(folder) if i.committed]:
            assert verify_checkpoint(info.path).ok, info.path
    fault_proxy.set_mode("pass")
    assert resumed == sorted(resumed) and resumed[-1] > 0, resumed
    newest = max(i.step for i in list_checkpoints(folder) if i.committed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = CheckpointConfig(
        folder=folder, async_mode="disabled", storage=StorageOptions(stale_after_s=0.0)
    )
    with CheckpointManager(config, {"model": model, "optim": OptimizerState(model, opt)}) as m:
        assert m.load() == newest
    leftovers = [i for i in list_checkpoints(folder) if not i.committed]
    assert leftovers == [], leftovers  # start-up clean-up (stale_after_s=0) took them


def test_sigkill_of_the_worker_mid_upload(s3_env, s3_server, s3_bucket, fault_proxy) -> None:
    """The worker process dies mid-upload: the save fails with WorkerFailedError naming
    the step, nothing of it is visible, the newest committed checkpoint loads, later
    saves (a new worker) commit."""
    import signal

    opts = StorageOptions(s3=_admin_options(s3_server, fault_proxy.endpoint_url))
    folder = f"s3://{s3_bucket}/wk"
    model = torch.nn.Linear(512, 512)
    config = CheckpointConfig(folder=folder, interval=1, storage=opts)
    with CheckpointManager(config, {"model": model}) as m:
        m.save(1)
    with CheckpointManager(config, {"model": model}) as m:
        fault_proxy.set_mode("delay", delay_s=0.05)
        with torch.no_grad():
            model.weight.add_(1.0)
        m.save(2)
        time.sleep(1.0)  # the upload is crawling through the proxy
        pid = m.session.writer.saver.worker_pid if m.session.writer is not None else None
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        fault_proxy.set_mode("pass")
        with pytest.raises(quicksave.WorkerFailedError) as info:
            m.save(3)
            m.close()
        assert "step 2" in str(info.value)
    infos = {i.step: i for i in list_checkpoints(folder)}
    assert infos[1].committed and (2 not in infos or not infos[2].committed)
    newest = max(s for s, i in infos.items() if i.committed)  # 3 if save(3) went on
    loaded = torch.nn.Linear(512, 512)
    with CheckpointManager(
        CheckpointConfig(folder=folder, async_mode="disabled", storage=opts), {"model": loaded}
    ) as m:
        assert m.load() == newest
        m.save(4, force=True)
        assert 4 in m.committed_steps()


def test_msc_round_trip_and_manager(s3_server, s3_bucket, tmp_path, monkeypatch) -> None:
    from msc_config import msc_config_for

    monkeypatch.chdir(tmp_path)
    config_path = msc_config_for(s3_server, s3_bucket, tmp_path / "msc", profile="ckpts")
    monkeypatch.setenv("MSC_CONFIG", config_path)
    sd = _state(5)
    url = "msc://ckpts/run/step-1"
    quicksave.save(sd, url, step=1)
    out = _blank(sd)
    quicksave.load(out, url)
    _assert_same(out, sd)
    assert verify_checkpoint(url).ok
    assert "run/step-1/manifest.json" in _objects(s3_server, s3_bucket, "run/")
    model = _Weights(3.0)
    config = CheckpointConfig(folder="msc://ckpts/job", interval=1, keep_latest_k=1)
    with CheckpointManager(config, {"model": model}) as m:
        for step in (1, 2, 3):
            m.save(step)
    loaded = _Weights()
    with CheckpointManager(config, {"model": loaded}) as m:
        assert m.committed_steps() == [3] and m.load() == 3
    assert torch.equal(loaded.w.detach(), model.w.detach())
    assert sorted(os.listdir(tmp_path)) == ["msc"]


def test_a_store_that_stops_answering_fails_the_save_within_save_timeout(
    s3_env, s3_server, s3_bucket, fault_proxy
) -> None:
    """The server accepts connections and never answers (its own timeouts are long):
    the save fails with a CheckpointError after save_timeout_s, never a hang, and the
    previous checkpoint is intact."""
    patient = _admin_options(
        s3_server,
        fault_proxy.endpoint_url,
        read_timeout_s=300.0,
        retry_deadline_s=600.0,
    )
    folder = f"s3://{s3_bucket}/hang"
    model = _Weights(1.0)
    # save_timeout_s: generous enough for the healthy save of step 1 on a loaded machine
    config = CheckpointConfig(
        folder=folder, interval=1, save_timeout_s=15.0, storage=StorageOptions(s3=patient)
    )
    with CheckpointManager(config, {"model": model}) as m:
        m.save(1)
    began = time.monotonic()
    with pytest.raises(CheckpointError) as info:
        with CheckpointManager(config, {"model": model}) as m:
            fault_proxy.set_mode("blackhole")
            m.save(2)
    took = time.monotonic() - began
    fault_proxy.set_mode("pass")
    assert took < 120, took  # a hang guard: save_timeout_s is 15 s
    assert "step 2" in str(info.value) or "step-2" in str(info.value), info.value
    assert [i.step for i in list_checkpoints(folder) if i.committed] == [1]
