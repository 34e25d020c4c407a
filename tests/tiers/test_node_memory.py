"""Node memory and its agent (quicksave.tiers.node_memory, quicksave.tiers.agent), with
real trainer processes, real agents and a real tmpfs: what a SIGKILLed trainer leaves,
when the memory is freed, one agent per job folder, and who may read it."""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from quicksave.errors import CheckpointError
from quicksave.tiers import agent
from quicksave.tiers.node_memory import NodeMemory, NodeMemoryConfig, job_key

DEADLINE_S = 30.0

# A trainer: waits for GO (if given), attaches, lists rank 0's folder, writes a snapshot
# file there, prints what it saw; then on stdin "done" detaches with job_done=True, and
# otherwise waits (to be killed).
TRAINER = """
import json, os, sys, time
from quicksave.tiers.node_memory import NodeMemory, NodeMemoryConfig
root, key, folder, idle, go = sys.argv[1:6]
while go and not os.path.exists(go):
    time.sleep(0.001)
mem = NodeMemory.attach(
    NodeMemoryConfig(root=root, idle_timeout_s=float(idle)), key=key, folder_url=folder
)
d = mem.rank_dir(0)
seen = sorted(os.listdir(d))
(d / f"snap-{os.getpid()}").write_bytes(b"x" * 4096)
print(json.dumps({"agent": mem.agent_pid, "seen": seen, "path": str(mem.path)}), flush=True)
if sys.stdin.readline().strip() == "done":
    mem.detach(job_done=True)
    print("detached", flush=True)
sys.stdin.readline()
"""


def wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {DEADLINE_S:.0f} s: {what}")
        time.sleep(0.05)


class Trainer:
    """A trainer subprocess (``TRAINER``)."""

    def __init__(self, root: Path, key: str, folder: str, idle_s: float, go: str = "") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", TRAINER, str(root), key, folder, repr(idle_s), go],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def line(self) -> str:
        """The next line it prints (fails after DEADLINE_S, or if it exits first)."""
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(DEADLINE_S):
                raise AssertionError(f"trainer {self.proc.pid} printed nothing in time")
        out = self.proc.stdout.readline()
        assert out, f"trainer {self.proc.pid} exited with {self.proc.wait()}"
        return out.strip()

    def attached(self) -> dict:
        return json.loads(self.line())

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def agents_of(path: Path) -> list[int]:
    """The pids of the agent processes running for ``path`` (read from ``/proc``)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"quicksave.tiers.agent" in argv and os.fsencode(path) in argv:
            if agent.start_time(int(pid)) is not None:  # not a zombie
                found.append(int(pid))
    return found


@pytest.fixture
def root() -> Iterator[Path]:
    """A fresh tmpfs root for node memory; its agents are stopped and it is removed after."""
    if not os.path.isdir("/dev/shm"):
        pytest.fail("these tests need a tmpfs at /dev/shm")
    path = Path(tempfile.mkdtemp(prefix="quicksave-test-", dir="/dev/shm"))
    yield path
    for job in path.glob("quicksave-*/*"):
        for pid in agents_of(job):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def trainers() -> Iterator[list[Trainer]]:
    """Trainer subprocesses of the test, killed after it."""
    started: list[Trainer] = []
    yield started
    for t in started:
        t.kill()


def running(pid: int) -> bool:
    return agent.start_time(pid) is not None


def test_a_killed_trainers_snapshot_waits_in_memory_for_the_next_one(root, trainers) -> None:
    first = Trainer(root, "job1", "/ckpt/run", 300.0)
    trainers.append(first)
    seen = first.attached()
    job = Path(seen["path"])
    snap = job / "rank-0" / f"snap-{first.proc.pid}"
    assert seen["seen"] == [] and snap.stat().st_size == 4096

    first.kill()
    # the agent has seen the trainer die (it dropped its registration) and kept the memory
    wait_until(lambda: os.listdir(job / agent.TRAINERS) == [], "the dead trainer dropped")
    assert snap.read_bytes() == b"x" * 4096
    assert running(seen["agent"]) and agents_of(job) == [seen["agent"]]

    second = Trainer(root, "job1", "/ckpt/run", 300.0)
    trainers.append(second)
    again = second.attached()
    assert again["path"] == seen["path"]
    assert again["seen"] == [snap.name]
    assert again["agent"] == seen["agent"]


def test_the_memory_is_freed_after_the_idle_timeout(root, trainers) -> None:
    t = Trainer(root, "job1", "/ckpt/run", 1.0)
    trainers.append(t)
    seen = t.attached()
    t.kill()
    wait_until(lambda: not os.path.exists(seen["path"]), "the job folder deleted")
    wait_until(lambda: not running(seen["agent"]), "the agent exited")


def test_the_end_of_the_job_frees_the_memory_at_once(root, trainers) -> None:
    # idle timeout far beyond the deadline: only the job's end can free it in time
    t = Trainer(root, "job1", "/ckpt/run", 3600.0)
    trainers.append(t)
    seen = t.attached()
    t.send("done")
    assert t.line() == "detached"
    wait_until(lambda: not os.path.exists(seen["path"]), "the job folder deleted")
    wait_until(lambda: not running(seen["agent"]), "the agent exited")
    assert t.proc.poll() is None  # the trainer lives on: its end freed nothing


def test_the_end_of_the_job_waits_for_the_trainers_still_attached(root, trainers) -> None:
    first, second, third = (Trainer(root, "job1", "/ckpt/run", 3600.0) for _ in range(3))
    trainers.extend((first, second, third))
    job = Path(first.attached()["path"])
    second.attached()
    third.attached()
    first.send("done")
    assert first.line() == "detached" and (job / agent.ENDED).exists()
    # the agent looks after the job's end was marked (it drops the killed third trainer)
    # and keeps the memory: the second trainer is still attached
    third.kill()
    wait_until(lambda: len(os.listdir(job / agent.TRAINERS)) == 1, "the killed trainer dropped")
    assert (job / "rank-0" / f"snap-{second.proc.pid}").exists()
    second.kill()  # the last one gone: the job is over
    wait_until(lambda: not job.exists(), "the job folder deleted")


def test_trainers_attaching_at_once_start_one_agent(root, trainers) -> None:
    go = root / "go"
    trainers.extend(Trainer(root, "job1", "/ckpt/run", 300.0, str(go)) for _ in range(4))
    go.touch()
    seen = [t.attached() for t in trainers]
    assert len({s["agent"] for s in seen}) == 1
    assert agents_of(Path(seen[0]["path"])) == [seen[0]["agent"]]
    assert len(os.listdir(Path(seen[0]["path"]) / agent.TRAINERS)) == 4


def test_each_key_has_its_own_private_folder_and_one_checkpoint_folder(root) -> None:
    config = NodeMemoryConfig(root=str(root), idle_timeout_s=300.0)
    a = NodeMemory.attach(config, key="job-a", folder_url="/ckpt/a")
    b = NodeMemory.attach(config, key="job-b", folder_url="/ckpt/b")
    try:
        assert a.path == root / f"quicksave-{os.getuid()}" / "job-a"
        assert b.path == root / f"quicksave-{os.getuid()}" / "job-b"
        assert a.agent_pid != b.agent_pid
        for d in (a.path.parent, a.path, a.rank_dir(3)):
            assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
        assert json.loads((a.path / "job.json").read_text())["folder_url"] == "/ckpt/a"

        with pytest.raises(CheckpointError) as e:
            NodeMemory.attach(config, key="job-a", folder_url="/ckpt/b")
        assert str(e.value) == (
            "node memory key 'job-a' belongs to the checkpoint folder '/ckpt/a', not "
            "'/ckpt/b': a job cannot read another job's memory; give each job its own "
            f"job_id [path={a.path}]"
        )
    finally:
        a.detach(job_done=True)
        b.detach(job_done=True)
    wait_until(lambda: not a.path.exists() and not b.path.exists(), "both folders deleted")


def test_a_folder_others_can_enter_is_refused(root) -> None:
    parent = root / f"quicksave-{os.getuid()}"
    parent.mkdir(mode=0o755)
    os.chmod(parent, 0o755)
    with pytest.raises(CheckpointError, match="not this user's alone") as e:
        NodeMemory.attach(NodeMemoryConfig(root=str(root)), key="job1", folder_url="/ckpt")
    assert e.value.path == str(parent)
    assert os.listdir(parent) == []


def test_sigterm_frees_the_memory(root) -> None:
    mem = NodeMemory.attach(NodeMemoryConfig(root=str(root)), key="job1", folder_url="/ckpt")
    os.kill(mem.agent_pid, signal.SIGTERM)
    wait_until(lambda: not mem.path.exists(), "the job folder deleted")
    wait_until(lambda: not running(mem.agent_pid), "the agent exited")
    mem.detach(job_done=False)  # nothing left to unregister: no error


def test_the_agent_never_imports_torch(root) -> None:
    mem = NodeMemory.attach(NodeMemoryConfig(root=str(root)), key="job1", folder_url="/ckpt")
    try:
        maps = Path(f"/proc/{mem.agent_pid}/maps").read_text()
        assert "python" in maps and "torch" not in maps  # the running agent
    finally:
        mem.detach(job_done=True)
    code = "import sys, quicksave.tiers.agent; print([m for m in sys.modules if 'torch' in m])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_registration_counts_only_with_its_process_start_time(tmp_path) -> None:
    (tmp_path / agent.TRAINERS).mkdir()
    me, start = os.getpid(), agent.start_time(os.getpid())
    assert start is not None
    names = {
        "live": agent.registration_name(me, start, "a"),
        "reused pid": agent.registration_name(me, start + 1, "b"),
        "garbage": "not-a-registration",
    }
    for name in names.values():
        (tmp_path / agent.TRAINERS / name).touch()
    assert agent.live_trainers(tmp_path) == [names["live"]]
    assert os.listdir(tmp_path / agent.TRAINERS) == [names["live"]]


def test_the_job_key() -> None:
    env = {"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "4242"}
    assert job_key(None, "/ckpt", environ=env) == "4242"  # torchrun's default id is no id
    assert job_key(None, "/ckpt", environ={**env, "TORCHELASTIC_RUN_ID": "r1"}) == "r1"
    assert job_key("mine", "/ckpt", environ=env) == "mine"
    # an unsafe id is made safe, with a hash so that "a/b" and "a_b" differ
    assert job_key("a/b", "/ckpt") == "a_b-" + job_key("a/b", "/ckpt").split("-")[-1]
    assert job_key("a/b", "/ckpt") != job_key("a_b", "/ckpt") == "a_b"
    assert job_key("..", "/ckpt").startswith("-") and "/" not in job_key("../x", "/ckpt")
    assert len(job_key("x" * 300, "/ckpt")) == 57
    # no id: the folder's hash, the same for a restarted job
    url = job_key(None, "s3://bucket/run", environ={})
    assert url.startswith("url-") and len(url) == 20
    assert url == job_key(None, "s3://bucket/run", environ={})
    assert url != job_key(None, "s3://bucket/run2", environ={})
