"""The training scripts in ``examples/``, run as a user runs them: under torchrun, on CPU
with gloo, each rank a real process.

Every script prints ``final state digest: <hex>`` (a SHA-256 of the full model and
optimizer state) and, after loading a checkpoint, ``resumed from step N ... state
digest: <hex>``. The tests compare those digests: a run killed with SIGKILL and resumed
ends bit-exactly where an uninterrupted run ends, and a checkpoint loaded on another
world size (FSDP2), another pipeline split (PP) or in a plain process (TP) holds exactly
the state that was saved.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 240.0  # one launch; a few seconds when the machine is idle
FINAL = re.compile(r"^final state digest: ([0-9a-f]{64})$", re.MULTILINE)
RESUMED = re.compile(r"^resumed from step (\d+)\b.*state digest: ([0-9a-f]{64})$", re.MULTILINE)


def launch(
    script: str, nproc: int | None, *args: str, restarts: int = 0
) -> subprocess.CompletedProcess[str]:
    """Run ``examples/<script>`` under torchrun with ``nproc`` ranks (``None``: as a
    plain ``python`` process; ``restarts``: torchrun's ``--max-restarts``). On timeout,
    torchrun gets SIGTERM (it stops its ranks, which stop their checkpoint workers),
    then everything left in its group SIGKILL."""
    if nproc is None:
        cmd = [sys.executable, str(EXAMPLES / script), *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "--max-restarts",
            str(restarts),
            str(EXAMPLES / script),
            *args,
        ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {TIMEOUT_S} s; output:\n{out[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def succeed(script: str, nproc: int | None, *args: str, restarts: int = 0) -> str:
    run = launch(script, nproc, *args, restarts=restarts)
    assert run.returncode == 0, f"{' '.join(run.args)} exited {run.returncode}:\n{run.stdout}"
    return run.stdout


def crash(script: str, nproc: int, folder: Path, step: int) -> None:
    """A run told to SIGKILL itself after the checkpoint of ``step``: it must die there,
    leaving that checkpoint committed and no later one."""
    run = launch(script, nproc, "--folder", str(folder), "--kill-at", str(step))
    out = run.stdout
    killed = [f"rank {rank}: SIGKILL after step {step}" in out for rank in range(nproc)]
    assert run.returncode != 0 and all(killed), f"not killed as asked:\n{out}"
    assert f"step {step + 1} loss" not in out and not FINAL.search(out), out
    steps = sorted(p.name for p in folder.iterdir() if p.name.startswith("step-"))
    assert steps == [f"step-{step}"], steps


def final_digest(out: str) -> str:
    found = FINAL.findall(out)
    assert len(found) == 1, out
    return found[0]


def resumed(out: str) -> tuple[int, str]:
    found = RESUMED.findall(out)
    assert len(found) == 1, out
    return int(found[0][0]), found[0][1]


def test_fsdp2_resume_after_sigkill_is_bit_exact_and_reshards_to_three_ranks(
    tmp_path: Path,
) -> None:
    script = "fsdp2_quicksave.py"
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    out = succeed(script, 2, "--folder", str(straight), "--steps", "8", "--interval", "4")
    assert not RESUMED.search(out), out  # a fresh folder: nothing to resume
    want = final_digest(out)

    crash(script, 2, crashed, 4)
    out = succeed(script, 2, "--folder", str(crashed), "--steps", "8", "--interval", "4")
    assert resumed(out)[0] == 4
    assert final_digest(out) == want

    # The 2-rank checkpoint of step 8 on 3 ranks: the loaded state is the saved state,
    # and training goes on from it.
    out = succeed(script, 3, "--folder", str(straight), "--steps", "10", "--interval", "4")
    assert resumed(out) == (8, want)
    assert "step 10 loss" in out
    assert final_digest(out) != want


def test_fsdp2_rank_killed_under_torchrun_restarts_resumes_from_node_memory(
    tmp_path: Path,
) -> None:
    """torchrun --max-restarts 1: one rank SIGKILLs itself after the memory snapshot of
    step 6 (the folder's newest is step 4); the restarted job resumes from node memory
    at step 6 and ends where an uninterrupted run ends; its memory is freed at the end."""
    script = "fsdp2_quicksave.py"
    want = final_digest(succeed(script, 2, "--folder", str(tmp_path / "straight")))
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm (tmpfs) on this machine")
    root = shm / f"qs-example-{os.getpid()}-{tmp_path.name}"
    root.mkdir()
    try:
        out = succeed(
            script,
            2,
            *("--folder", str(tmp_path / "crashed"), "--memory-every", "1"),
            *("--memory-root", str(root), "--kill-rank-at", "6"),
            restarts=1,
        )
        assert "rank 1: SIGKILL after step 6" in out, out
        assert "resumed from step 6 on 2 ranks (memory)" in out, out
        assert final_digest(out) == want
        jobs = root / f"quicksave-{os.getuid()}"
        deadline = time.monotonic() + 60  # the agent frees the job's memory on close()
        while any(jobs.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(jobs.iterdir()), list(jobs.rglob("*"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_tp_resume_after_sigkill_is_bit_exact_and_loads_in_a_plain_process(
    tmp_path: Path,
) -> None:
    script = "tp_quicksave.py"
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    want = final_digest(succeed(script, 2, "--folder", str(straight)))

    crash(script, 2, crashed, 4)
    out = succeed(script, 2, "--folder", str(crashed))
    assert resumed(out)[0] == 4
    assert final_digest(out) == want

    out = succeed(script, None, "--folder", str(straight), "--plain")
    assert f"loaded step 8 into a plain Model from {straight / 'step-8'}" in out, out
    assert re.findall(r"^plain state digest: ([0-9a-f]{64})$", out, re.MULTILINE) == [want]


def test_pp_resume_after_sigkill_is_bit_exact_and_loads_into_another_split(
    tmp_path: Path,
) -> None:
    script = "pp_quicksave.py"
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    want = final_digest(succeed(script, 4, "--folder", str(straight), "--layers", "8"))

    crash(script, 4, crashed, 4)
    out = succeed(script, 4, "--folder", str(crashed), "--layers", "8")
    assert "resumed from step 4 on 4 stages of 2 layers" in out, out
    assert final_digest(out) == want

    # Saved by 4 stages of 2 layers, loaded (strictly) by 2 stages of 4 layers.
    out = succeed(script, 2, "--folder", str(straight), "--layers", "8", "--steps", "10")
    assert "resumed from step 8 on 2 stages of 4 layers" in out, out
    assert resumed(out) == (8, want)
    assert "step 10 loss" in out


def test_tensorboard_example_logs_every_checkpoint_and_traces_its_phases(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir, trace = tmp_path / "tb", tmp_path / "trace.json"
    out = succeed(
        "tensorboard_metrics.py",
        None,
        *("--folder", str(tmp_path / "ckpt"), "--logdir", str(logdir), "--trace", str(trace)),
    )
    assert f"logged 4 checkpoints to {logdir}" in out, out
    assert f"trace with the writer's phases: {trace} (8 writer events)" in out, out

    # what TensorBoard reads back from the event file
    events = EventAccumulator(str(logdir))
    events.Reload()
    durable = events.Scalars("quicksave/durable_s")
    assert [e.step for e in durable] == [2, 4, 6, 8] and all(e.value > 0 for e in durable)
    assert [e.value for e in events.Scalars("quicksave/failed")] == [0.0] * 4
    assert [e.value for e in events.Scalars("quicksave/step")] == [2.0, 4.0, 6.0, 8.0]
    assert all(e.value > 0 for e in events.Scalars("quicksave/throughput_mbps"))
    assert len(events.Scalars("train/loss")) == 8

    # the trace: the training process's ranges, and the worker process's phases
    ranges = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    trainer = {e["pid"] for e in ranges if e["name"] == "quicksave.save.submit"}
    assert len(trainer) == 1
    writer = [e for e in ranges if e["pid"] not in trainer and e["name"].startswith("quicksave.")]
    phases = ("quicksave.save.commit", "quicksave.save.persist")
    assert sorted((e["args"]["step"], e["name"]) for e in writer) == [
        (step, name) for step in (2, 4, 6, 8) for name in phases
    ]


def wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """The rows ``wandb.log`` wrote into an offline run's ``run-<id>.wandb`` file: W&B's
    record log (a ``:W&B`` header, then LevelDB-log records of 32 KiB blocks, each a
    protobuf ``Record``), read back without W&B's servers."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    block, pos, pieces, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a record header: padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        pieces += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        i.key or "/".join(i.nested_key): json.loads(i.value_json)
                        for i in record.history.item
                    }
                )
    return rows


def test_wandb_example_logs_every_checkpoint(tmp_path: Path) -> None:
    out = succeed(
        "wandb_metrics.py", None, "--folder", str(tmp_path / "ckpt"), "--dir", str(tmp_path / "wb")
    )
    found = re.search(r"^logged 4 checkpoints to W&B run (\w+) \(offline, (.+)\)$", out, re.M)
    assert found, out
    (run_dir,) = (tmp_path / "wb" / "wandb").glob(f"offline-run-*-{found[1]}")
    rows = wandb_history(run_dir)
    saves = [r for r in rows if "quicksave/step" in r]
    assert [r["quicksave/step"] for r in saves] == [2, 4, 6, 8]
    for r in saves:
        assert r["quicksave/failed"] == 0 and r["quicksave/bytes"] > 0
        assert 0 < r["quicksave/blocking_s"] and 0 < r["quicksave/durable_s"]
        assert r["quicksave/throughput_mbps"] > 0
    assert sum("train/loss" in r for r in rows) == 8
