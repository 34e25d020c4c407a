"""``quicksave ls`` and ``quicksave verify`` on an S3 bucket (SeaweedFS) holding run
folders: ls of the bucket lists each run's checkpoints (it used to say "no
checkpoints"), verify of a run or of the bucket checks each checkpoint."""

from __future__ import annotations

import json
import os

import pytest
import torch

import quicksave
from quicksave.cli.main import main


@pytest.fixture
def s3_env(s3_server, monkeypatch, tmp_path) -> None:
    """The AWS environment chain pointing at the server; an empty working directory, so
    that anything written locally by mistake is seen."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _save(url: str, step: int) -> None:
    quicksave.save({"w": torch.full((256,), float(step)), "step": step}, url, step=step)


def test_ls_and_verify_a_bucket_of_runs(s3_env, s3_server, s3_bucket, capsys) -> None:
    bucket = f"s3://{s3_bucket}"
    for run_name, step in (("run-a", 1), ("run-a", 2), ("run-b", 3)):
        _save(f"{bucket}/{run_name}/step-{step}", step)
    client = s3_server.client()
    try:  # a save that crashed before its manifest: no commit
        client.put_object(Bucket=s3_bucket, Key="run-b/step-4/rank-00000-00.safetensors", Body=b"x")
    finally:
        client.close()

    rc, out, err = run(capsys, "ls", bucket)
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["RUN", "NAME", "STEP"]
    assert [line.split()[:4] for line in lines[1:]] == [
        ["run-a", "step-1", "1", "committed"],
        ["run-a", "step-2", "2", "committed"],
        ["run-b", "step-3", "3", "committed"],
        ["run-b", "step-4", "4", "uncommitted"],
    ]
    rc, out, _ = run(capsys, "ls", bucket, "--json")
    assert [d["path"] for d in json.loads(out)][:2] == [
        f"{bucket}/run-a/step-1",
        f"{bucket}/run-a/step-2",
    ]
    rc, out, _ = run(capsys, "ls", f"{bucket}/run-a")
    assert out.splitlines()[0].split()[0] == "NAME"  # one run: no RUN column

    rc, out, err = run(capsys, "verify", f"{bucket}/run-a")
    assert rc == 0, out + err
    assert [line.rsplit(": ", 1)[0] for line in out.splitlines()] == [
        f"OK {bucket}/run-a/step-1",
        f"OK {bucket}/run-a/step-2",
        f"OK {bucket}/run-a",
    ]

    client = s3_server.client()
    try:  # one flipped bit in step-2's data
        key = next(
            o["Key"]
            for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="run-a/step-2/")["Contents"]
            if o["Key"].endswith(".safetensors")
        )
        data = bytearray(client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
        data[-1] ^= 0x01
        client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(data))
    finally:
        client.close()
    rc, out, _ = run(capsys, "verify", bucket)
    assert rc == 1
    lines = out.splitlines()
    assert f"FAILED {bucket}/run-a/step-2: 1 problem" in lines
    assert any(line.startswith(f"OK {bucket}/run-b/step-3: ") for line in lines)
    assert f"SKIP {bucket}/run-b/step-4: uncommitted (a save in progress, or left by a crash)" in (
        lines
    )
    assert lines[-1] == f"FAILED {bucket}: 3 checkpoints verified, 1 failed, 1 skipped"
    assert os.listdir(".") == []  # nothing went to local disk
