"""Node memory: a job's checkpoints in the node's RAM, kept alive past a crashed trainer.

The memory tier is quicksave's ordinary checkpoint format written into a job-scoped
folder on a tmpfs (``/dev/shm`` by default): files there are RAM, and they outlive the
process that wrote them. This module gives that folder an owner and a lifetime:

- **Where**: ``<root>/quicksave-<uid>/<key>/`` (the *job folder*; ``rank_dir(r)`` is each
  rank's ``rank-<r>/`` in it), every level mode 0700 and owned by the user: another user
  reads nothing. ``key`` names the job (:func:`job_key`: the launcher's job id, else a hash
  of the checkpoint folder's URL, so that a restarted job finds its memory), and
  ``job.json`` records the checkpoint folder the memory belongs to: a job of another folder
  that comes with the same key gets a :class:`~quicksave.errors.CheckpointError`, never
  the first job's state.
- **Who keeps it**: one agent process per job folder and node
  (``quicksave.tiers.agent``), started by the first trainer that attaches, in a session of
  its own so that killing the trainer (SIGKILL included) or its process group leaves it
  running. Every trainer that attaches registers itself (pid and process start time, so
  a reused pid does not count as the trainer).
- **When the memory is freed** (the agent deletes the job folder and exits): when the job
  ends (a trainer detaches with ``job_done=True``, and no trainer is still attached), or
  after ``idle_timeout_s`` with no live trainer attached, or when the agent gets SIGTERM.
  Nothing else frees it, and nothing frees it sooner.
- **What a crashed trainer leaves**: its snapshots, as files in the job folder, readable
  by a trainer of the same job (same key, same folder URL) that attaches on this node
  within ``idle_timeout_s``; the agent that kept them is the one it joins.
- **Limits**: the folder is RAM counted against the tmpfs's size (and the memory cgroup
  of whoever wrote it); a SIGKILL of the agent itself leaves the folder behind until a
  trainer of the same key attaches again (and starts a new agent) or the node reboots;
  a launcher that kills every process of a job step at its end (Slurm) ends the agent with
  it, and the memory with the agent (SIGTERM). The empty ``quicksave-<uid>`` folder stays.
  The agent and the trainers must see the same ``/proc`` (one PID namespace).

Who calls what: each trainer process calls :meth:`NodeMemory.attach` once (any number of
ranks of a node may do so at the same time: one agent is started), uses ``rank_dir`` for
its ranks, and calls :meth:`NodeMemory.detach` when it closes (``job_done=True`` when the
training is over and the memory is no longer wanted).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import stat
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from quicksave.errors import CheckpointError
from quicksave.storage.local import lock_within
from quicksave.tiers import agent
from quicksave.worker.main import environment

# Where a launcher names the job, in order; a value in NO_JOB_ID names none (torchrun's
# default --rdzv-id is "none": every such job would share it).
JOB_ID_VARIABLES = (
    "TORCHELASTIC_RUN_ID",  # torchrun (the same across --max-restarts)
    "SLURM_JOB_ID",  # Slurm (the same across job steps)
    "FLUX_JOB_ID",
    "PBS_JOBID",
    "LSB_JOBID",  # IBM LSF
)
NO_JOB_ID = frozenset({"", "none"})
JOB_FILE = "job.json"
WAIT_S = 60.0  # the longest an attach waits for another trainer's attach or for the agent
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class NodeMemoryConfig:
    """Where a node keeps a job's memory and for how long (module docstring).

    Attributes:
        root: a tmpfs mount to hold the job folders.
        job_id: the job's name; None: the launcher's (``JOB_ID_VARIABLES``), else a hash of
            the checkpoint folder's URL (see :func:`job_key`).
        idle_timeout_s: the agent frees the job's memory and exits once no live trainer has
            been attached this long; a trainer restarted later starts from storage. The
            agent runs with the value of the trainer that started it.
    """

    root: str = "/dev/shm"
    job_id: str | None = None
    idle_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {self.idle_timeout_s!r}")


def job_key(
    job_id: str | None, folder_url: str, *, environ: Mapping[str, str] | None = None
) -> str:
    """A file-name-safe key for a job's memory on a node.

    Args:
        job_id: the job's name, or None for the launcher's (the first of
            ``JOB_ID_VARIABLES`` set in ``environ``, ``os.environ`` by default).
        folder_url: the job's checkpoint folder; with no job id, the key is a hash of it,
            so that a job restarted with the same folder finds its memory.

    Returns:
        The job id with any character outside ``[A-Za-z0-9_.-]`` replaced (and a hash of
        the id appended when one was, or when it is longer than 64 characters, so that two
        ids never share a key), else ``url-<16 hex digits>``.

    Example:
        >>> job_key("train/42", "s3://b/run")
        'train_42-09239409'
    """
    env = os.environ if environ is None else environ
    if job_id is None:
        job_id = next(
            (env[v] for v in JOB_ID_VARIABLES if env.get(v, "").strip().lower() not in NO_JOB_ID),
            None,
        )
    if job_id is None:
        return "url-" + _digest(folder_url)[:16]
    safe = _SAFE.sub("_", job_id).lstrip(".")
    if safe != job_id or len(safe) > 64:
        safe = f"{safe[:48]}-{_digest(job_id)[:8]}"
    return safe


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class NodeMemory:
    """A trainer's attachment to its job's memory on this node (module docstring).

    Built by :meth:`attach`; ``path`` is the job folder, ``agent_pid`` the agent keeping it.
    """

    def __init__(self, path: Path, registration: Path, agent_pid: int) -> None:
        self.path = path
        self._registration: Path | None = registration
        self._agent_pid = agent_pid

    @classmethod
    def attach(cls, config: NodeMemoryConfig, *, key: str, folder_url: str) -> NodeMemory:
        """Attach this process to the job's memory: make the job folder (or find it), start
        the node's agent for it unless one runs, and register this process as a trainer.

        Args:
            config: where and how long.
            key: the job's key (:func:`job_key`).
            folder_url: the job's checkpoint folder; the job folder belongs to it.

        Raises:
            CheckpointError: the job folder belongs to another checkpoint folder (both
                named), a folder on the way is not this user's alone (or ``root`` is
                missing), or the agent could not be started (its log's end quoted).

        Example:
            >>> mem = NodeMemory.attach(NodeMemoryConfig(), key=job_key(None, url),
            ...                         folder_url=url)
            >>> mem.rank_dir(rank)  # write the rank's snapshot here
            >>> mem.detach(job_done=True)
        """
        if key != job_key(key, "") or key in (".", ".."):
            raise CheckpointError(f"node memory key {key!r} is not a safe file name")
        parent = Path(config.root) / f"quicksave-{os.getuid()}"
        path = parent / key
        deadline = time.monotonic() + WAIT_S
        while True:
            _private_dir(parent)
            _private_dir(path)
            with _attach_lock(path, deadline) as held:
                if not held:  # deleted by its agent meanwhile: make it again
                    continue
                _claim(path, key, folder_url)
                with contextlib.suppress(FileNotFoundError):
                    (path / agent.ENDED).unlink()  # a trainer of the job is back
                registration = _register(path)
                try:
                    agent_pid = _ensure_agent(path, config.idle_timeout_s, deadline)
                except BaseException:
                    registration.unlink()
                    raise
                return cls(path, registration, agent_pid)

    def rank_dir(self, rank: int) -> Path:
        """The folder of ``rank``'s snapshots (``<job folder>/rank-<rank>``), made mode
        0700 if missing."""
        d = self.path / f"rank-{int(rank)}"
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)
            os.chmod(d, 0o700)
        return d

    @property
    def agent_pid(self) -> int:
        """The pid of the agent that keeps the job folder (the one running when this
        process attached)."""
        return self._agent_pid

    def detach(self, *, job_done: bool) -> None:
        """Unregister this process. ``job_done``: the job is over; once no trainer is
        attached, the agent frees the memory and exits (at once, not after the idle
        timeout). A second call does nothing."""
        if self._registration is None:
            return
        if job_done:  # before unregistering: the agent must not see "idle" without it
            with contextlib.suppress(FileNotFoundError):
                (self.path / agent.ENDED).touch()
        with contextlib.suppress(FileNotFoundError):
            self._registration.unlink()
        self._registration = None


def _private_dir(path: Path) -> None:
    """Make ``path`` mode 0700, or check that it is a folder of this user's alone."""
    while True:
        try:
            os.mkdir(path, 0o700)
            os.chmod(path, 0o700)  # whatever the umask
        except FileExistsError:
            pass
        except FileNotFoundError:
            raise CheckpointError(
                "node memory's root does not exist (a tmpfs mount is expected)",
                path=path.parent,
            ) from None
        try:
            st = os.lstat(path)
            break
        except FileNotFoundError:
            continue  # deleted by its agent meanwhile
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise CheckpointError(
            f"node memory folder is not this user's alone (uid {st.st_uid}, mode "
            f"{stat.filemode(st.st_mode)}; expected a folder of uid {os.getuid()}, mode "
            "drwx------): refusing to use it",
            path=path,
        )


@contextlib.contextmanager
def _attach_lock(path: Path, deadline: float) -> Iterator[bool]:
    """Hold the job folder's attach lock (an ``flock`` on the folder itself, which the agent
    holds while it deletes the folder). Yields False if the folder was deleted while this
    waited."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        yield False
        return
    try:
        if not lock_within(fd, deadline):
            raise CheckpointError(
                f"node memory: waited {WAIT_S:.0f} s for the attach lock that "
                "another process holds",
                path=path,
            )
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        fst = os.fstat(fd)
        yield st is not None and (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)
    finally:
        os.close(fd)  # releases the lock


def _claim(path: Path, key: str, folder_url: str) -> None:
    """Record which checkpoint folder the job folder belongs to, or check that it is this
    one (under the attach lock)."""
    job_file = path / JOB_FILE
    try:
        owner = json.loads(job_file.read_text())["folder_url"]
    except FileNotFoundError:
        record = {"key": key, "folder_url": folder_url, "uid": os.getuid(), "created": time.time()}
        tmp = path / f"{JOB_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, job_file)
        return
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"node memory's {JOB_FILE} is unreadable ({e})", path=job_file) from e
    if owner != folder_url:
        raise CheckpointError(
            f"node memory key {key!r} belongs to the checkpoint folder {owner!r}, not "
            f"{folder_url!r}: a job cannot read another job's memory; give each job its own "
            "job_id",
            path=path,
        )


def _register(path: Path) -> Path:
    """Register this process as a trainer attached to the job folder."""
    trainers = path / agent.TRAINERS
    with contextlib.suppress(FileExistsError):
        os.mkdir(trainers, 0o700)
    pid = os.getpid()
    start = agent.start_time(pid)
    assert start is not None  # this process runs
    reg = trainers / agent.registration_name(pid, start, uuid.uuid4().hex[:8])
    os.close(os.open(reg, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    return reg


def _agent_alive(path: Path) -> bool:
    fd = os.open(path / agent.AGENT_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases it if this took it
    return False


def _ensure_agent(path: Path, idle_s: float, deadline: float) -> int:
    """Start the job folder's agent unless one runs (under the attach lock: one agent);
    returns its pid."""
    if _agent_alive(path):
        return _agent_pid(path)
    log = path / agent.AGENT_LOG
    # close_fds (Popen's default): the agent holds none of the trainer's files, so a
    # staging pool's memory is not kept alive by it
    with open(log, "ab") as err:
        proc = subprocess.Popen(
            agent.agent_command(path, idle_s),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=environment(),
            cwd="/",
            start_new_session=True,
        )
    try:
        rc = proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = None
    if rc != 0:
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise CheckpointError(
            f"node memory: the agent did not start (exit code {rc}); its log ends:\n{tail}",
            path=path,
        )
    return _agent_pid(path)


def _agent_pid(path: Path) -> int:
    return int(json.loads((path / agent.AGENT_FILE).read_text())["pid"])
