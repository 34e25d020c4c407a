"""The manager's node-memory tier (``CheckpointConfig(memory=...)``): a trainer killed
with SIGKILL and restarted on the same node resumes from node memory, bit-exact,
without the folder holding that step; the folder wins when it is newer; a torn
snapshot is skipped, never trusted; the job's memory is freed when the job ends.

Real processes, a real tmpfs folder (a private root under /dev/shm per test), real
SIGKILL.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from helpers.node_sim import gone

SHM = Path("/dev/shm")

TRAINER = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    from quicksave.manager import (CheckpointConfig, CheckpointManager, MemoryTierConfig,
                                   ModelState, OptimizerState)

    folder, root, mode, steps, interval, out, seed = sys.argv[1:8]
    steps, interval, seed = int(steps), int(interval), int(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    memory = MemoryTierConfig(every=1, keep=2, root=root, job_id="job-a", idle_timeout_s=120)
    config = CheckpointConfig(folder=folder, interval=interval, async_mode=mode, memory=memory,
                              stream_load=True)
    manager = CheckpointManager(config, {"model": ModelState(model),
                                         "optimizer": OptimizerState(model, optim)})
    start = manager.load() or 0
    record = manager.last_load
    try:
        manager.wait()  # the optimizers' states, streamed in behind load()
    except Exception as e:
        with open(out + ".json", "w") as f:
            json.dump({"start": start, "tier": record.tier, "error": str(e),
                       "memory_steps": manager.memory_tier.steps()}, f)
        os._exit(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
    for step in range(start + 1, steps + 1):
        optim.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        manager.save(step)
    manager.wait()  # the folder's saves and the memory tier's snapshots
    state = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "optim": {k: ({kk: vv.clone() if torch.is_tensor(vv) else vv for kk, vv in st.items()})
                       for k, st in optim.state_dict()["state"].items()}}
    torch.save(state, out + ".pt")
    with open(out + ".json", "w") as f:
        json.dump({"start": start, "tier": record.tier if record else None,
                   "memory_steps": manager.memory_tier.steps(),
                   "folder_steps": manager.committed_steps(),
                   "job_dir": str(manager.memory_tier.node.path),
                   "failures": manager.memory_tier.failures}, f)
    if os.environ.get("QS_HANG"):
        print("ready", flush=True)
        time.sleep(600)
    manager.close()
    """
)


@pytest.fixture
def shm_root():
    if not SHM.is_dir():
        pytest.skip("no /dev/shm (tmpfs) on this machine")
    root = SHM / f"qs-test-{uuid.uuid4().hex[:12]}"
    root.mkdir()
    yield root
    # the agents of the test: stop any left (a failed test), then the folder
    for record in root.rglob("agent.json"):
        try:
            os.kill(int(json.loads(record.read_text())["pid"]), signal.SIGKILL)
        except (OSError, ValueError, KeyError):
            pass
    shutil.rmtree(root, ignore_errors=True)


def _run(tmp_path, shm_root, name, *, steps, interval=100, seed=0, hang=False, mode="process"):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    out = tmp_path / name
    args = [sys.executable, str(script), str(tmp_path / "ckpt"), str(shm_root), mode]
    args += [str(steps), str(interval), str(out), str(seed)]
    env = dict(os.environ, QS_HANG="1" if hang else "")
    if not hang:
        subprocess.run(args, env=env, check=True, timeout=600)
        return json.loads(Path(f"{out}.json").read_text()), out
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGKILL)  # the trainer dies; its node memory must not
    proc.wait(timeout=60)
    return json.loads(Path(f"{out}.json").read_text()), out


def _same(a: Path, b: Path) -> None:
    import torch

    x, y = torch.load(f"{a}.pt"), torch.load(f"{b}.pt")
    assert x["model"].keys() == y["model"].keys()
    for k in x["model"]:
        assert torch.equal(x["model"][k], y["model"][k]), k
    assert x["optim"].keys() == y["optim"].keys()
    for k in x["optim"]:
        for kk, v in x["optim"][k].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(y["optim"][k][kk])), (k, kk)


@pytest.mark.parametrize("mode", ["process", "disabled"])
def test_sigkilled_trainer_resumes_from_node_memory(tmp_path, shm_root, mode):
    first, saved = _run(tmp_path, shm_root, "first", steps=7, hang=True, mode=mode)
    assert first["start"] == 0 and first["failures"] == 0
    assert first["memory_steps"] == [6, 7]  # keep=2
    assert first["folder_steps"] == []  # interval 100: the folder holds no step
    # `quicksave ls` says which tiers hold each step: node memory only, here
    ls = subprocess.run(
        [sys.executable, "-m", "quicksave", "ls", str(tmp_path / "ckpt"), "--json"]
        + ["--memory-root", str(shm_root)],
        capture_output=True,
        text=True,
        check=True,
    )
    listed = json.loads(ls.stdout)
    assert [(d["step"], d["tiers"], d["committed"]) for d in listed] == [
        (6, ["memory"], True),
        (7, ["memory"], True),
    ]
    # a new trainer (other initial weights, an optimizer without state) on the node
    second, resumed = _run(tmp_path, shm_root, "second", steps=7, seed=5, mode=mode)
    assert second["start"] == 7 and second["tier"] == "memory"
    _same(saved, resumed)  # bit-exact: model and AdamW state
    # its close() ended the job: the agent frees the job's memory
    assert gone(second["job_dir"])


def test_newer_folder_wins_and_a_torn_snapshot_is_skipped(tmp_path, shm_root):
    first, saved = _run(tmp_path, shm_root, "first", steps=5, interval=5, hang=True)
    assert first["folder_steps"] == [5] and first["memory_steps"] == [3, 4]
    second, resumed = _run(tmp_path, shm_root, "second", steps=5, interval=5, seed=3)
    assert second["start"] == 5 and second["tier"] == "folder"
    _same(saved, resumed)

    # now memory holds 6 and 7, newer than the folder's 5; tear the newest
    third, saved7 = _run(tmp_path, shm_root, "third", steps=7, interval=5, hang=True)
    assert third["memory_steps"] == [6, 7]
    snapshot = Path(third["job_dir"]) / "world-1" / "rank-0" / "step-7"
    _tear(snapshot, "model.0.weight")
    fourth, _ = _run(tmp_path, shm_root, "fourth", steps=5, interval=5, seed=9)
    # step 7 fails its checksums and is skipped; 6 is the newest whole one
    assert fourth["start"] == 6 and fourth["tier"] == "memory"


def test_a_torn_optimizer_state_streamed_in_is_raised_and_never_picked_again(tmp_path, shm_root):
    """The optimizers' states stream in after load() returned: a chunk of them that
    fails its checksum is raised by the next manager call (here wait(); an optimizer
    step would too), naming it, and the torn snapshot is removed, so that the next
    resume takes the newest whole one."""
    first, _ = _run(tmp_path, shm_root, "first", steps=7, hang=True)
    snapshot = Path(first["job_dir"]) / "world-1" / "rank-0" / "step-7"
    _tear(snapshot, "optimizer.state.0.weight.exp_avg")
    second, _ = _run(tmp_path, shm_root, "second", steps=7, seed=5)
    assert second["start"] == 7 and second["tier"] == "memory"
    assert "checksum mismatch" in second["error"], second
    assert "optimizer.state.0.weight.exp_avg" in second["error"], second
    assert second["memory_steps"] == [6]  # step 7 is gone from memory
    third, _ = _run(tmp_path, shm_root, "third", steps=7, seed=6)
    assert third["start"] == 6 and third["tier"] == "memory" and "error" not in third


def _tear(snapshot: Path, fqn: str) -> None:
    """Overwrite 8 bytes in the middle of ``fqn``'s first chunk in ``snapshot``."""
    manifest = json.loads((snapshot / "manifest.json").read_text())
    chunk = manifest["tensors"][fqn]["chunks"][0]
    with open(snapshot / chunk["file"], "r+b") as f:
        f.seek(chunk["offset"] + chunk["length"] // 2)
        f.write(b"\xff" * 8)  # bytes the manifest's checksum does not match


def test_a_memory_tier_that_cannot_attach_leaves_nothing_started(tmp_path, shm_root) -> None:
    """The node's memory for this job id belongs to another checkpoint folder: the
    manager raises naming both, and what its construction had taken (the folder's
    writer lease, the worker process) is given back, so that another manager can take
    the folder at once."""
    import psutil
    import torch

    from quicksave.errors import CheckpointError
    from quicksave.manager import (
        CheckpointConfig,
        CheckpointManager,
        MemoryTierConfig,
        ModelState,
    )

    model = torch.nn.Linear(4, 4)
    memory = MemoryTierConfig(every=1, keep=1, root=str(shm_root), job_id="shared-id")
    first = CheckpointManager(
        CheckpointConfig(folder=str(tmp_path / "a"), async_mode="thread", memory=memory),
        {"model": ModelState(model)},
    )
    try:
        before = {p.pid for p in _children()}
        folder = str(tmp_path / "b")
        config = CheckpointConfig(folder=folder, async_mode="process", memory=memory)
        with pytest.raises(CheckpointError) as raised:
            CheckpointManager(config, {"model": ModelState(model)})
        assert str(tmp_path / "a") in str(raised.value) and folder in str(raised.value)
        # no worker process left behind (its exit is reaped in the background)
        extra = [p for p in _children() if p.pid not in before]
        _, alive = psutil.wait_procs(extra, timeout=60)
        assert not alive, [p.cmdline() for p in alive]
        # the folder's lease was given back: a manager without the tier takes it
        manager = CheckpointManager(
            CheckpointConfig(folder=folder, async_mode="thread"), {"model": ModelState(model)}
        )
        manager.close()
    finally:
        first.close()


def _children():
    import psutil

    return psutil.Process().children(recursive=True)
