"""Shared pieces of the fault-injection suite: a deterministic job, bit-exact checks,
folder and process probes, mounts, privilege drops, and outcome tallies (``Result``).

Nothing here mocks quicksave: the jobs run real ``CheckpointManager`` instances in real
processes, writing real files with real fsyncs; faults are real signals, real mounts,
real permission bits and real bytes changed on disk.

The deterministic job: the state at step ``s`` is a pure function of ``(seed, s)``: a
small model trained by SGD with momentum on data drawn from a generator seeded by
``(seed, s)``, and a payload of tensors (a few MiB, so that saves take real time) equal
to ``base(seed) + s``. Replaying ``s`` steps from scratch gives the state bit-exactly, so
any checkpoint can be checked by a process that never saw the job that wrote it.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import xxhash

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # tests/: the shared helpers (the fork server's
    sys.path.insert(0, str(HERE.parent))  # children and the runner start without it)
from helpers_engine.engine_util import proc_alive, wait_dead  # noqa: E402, F401 (re-exported)

REPO = HERE.parents[1]

# ---------------------------------------------------------------- the deterministic job


class Payload:
    """A ``Stateful`` holding tensors that are a pure function of (seed, step).

    Not a ModelState/OptimizerState: the manager copies it before ``save()`` returns,
    so the job may overwrite it right after ``save()``."""

    def __init__(self, seed: int, kib: int) -> None:
        g = torch.Generator().manual_seed(seed)
        n = max(1, kib * 1024 // 8)  # f32: half of the bytes, i64: a quarter, bf16: 1/8
        self.base32 = torch.randn(n, generator=g)
        self.f32 = self.base32.clone()
        self.bf16 = torch.zeros(n // 2 + 3, dtype=torch.bfloat16)  # odd length: padding
        self.i64 = torch.zeros(n // 4 + 1, dtype=torch.int64)
        self.step = 0

    def set_step(self, step: int) -> None:
        torch.add(self.base32, float(step), out=self.f32)
        self.bf16.fill_(float(step % 251) / 8.0)
        torch.arange(self.i64.numel(), out=self.i64)
        self.i64.add_(step * 1_000_003)
        self.step = step

    def state_dict(self) -> dict[str, Any]:
        return {"f32": self.f32, "bf16": self.bf16, "i64": self.i64, "step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for name in ("f32", "bf16", "i64"):
            if sd[name] is not getattr(self, name):
                getattr(self, name).copy_(sd[name])
        self.step = int(sd["step"])


class Job:
    """The deterministic job (see the module docstring)."""

    def __init__(self, seed: int, payload_kib: int) -> None:
        from quicksave.manager import ModelState, OptimizerState, TrainState

        self.seed = seed
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        self.optim = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.payload = Payload(seed, payload_kib)
        self.train = TrainState()
        self._states = {
            "model": ModelState(self.model),
            "optim": OptimizerState(self.model, self.optim),
            "payload": self.payload,
            "train": self.train,
        }

    def states(self) -> dict[str, Any]:
        return self._states

    def step(self, s: int) -> None:
        """Train step ``s`` (the state becomes the state of step ``s``)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + s)
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        loss = ((self.model(x) - y) ** 2).mean()
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()
        self.payload.set_step(s)
        self.train.step = s

    def fingerprint(self) -> str:
        """A digest of every tensor and value of the state (bit-exact)."""
        h = xxhash.xxh3_64()
        for name, state in sorted(self._states.items()):
            h.update(name.encode())
            _feed(h, state.state_dict())
        return h.hexdigest()


def _feed(h: xxhash.xxh3_64, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        h.update(b"{")
        for k in sorted(value, key=str):
            h.update(repr(k).encode())
            _feed(h, value[k])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for v in value:
            _feed(h, v)
        h.update(b"]")
    else:
        h.update(repr(value).encode())


class Replay:
    """Fingerprints of the job's state at each step, by replaying it once from step 0
    (cached, so checking many loads costs one replay)."""

    def __init__(self, seed: int, payload_kib: int) -> None:
        self.seed, self.kib = seed, payload_kib
        self._job = Job(seed, payload_kib)
        self._done = 0
        self._prints: dict[int, str] = {}

    def fingerprint(self, step: int) -> str:
        if step in self._prints:
            return self._prints[step]
        if step < self._done:  # an old step not cached: replay from scratch
            self._job, self._done = Job(self.seed, self.kib), 0
        while self._done < step:
            self._done += 1
            self._job.step(self._done)
            self._prints[self._done] = self._job.fingerprint()
        return self._prints[step]


# ---------------------------------------------------------------- bit-exact comparison


def same_bits(a: Any, b: Any) -> bool:
    """Bit-exact equality of (nested) state dicts: tensors byte for byte, dtype and
    shape included; everything else with ``==``."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(
                a.detach().reshape(-1).contiguous().view(torch.uint8),
                b.detach().reshape(-1).contiguous().view(torch.uint8),
            )
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(same_bits(x, y) for x, y in zip(a, b, strict=True))
        )
    return type(a) is type(b) and a == b


def zeros_like(sd: Any) -> Any:
    """A destination for ``quicksave.load``: zero tensors, placeholder plain values."""
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: zeros_like(v) for k, v in sd.items()}
    return None


# ---------------------------------------------------------------- folder probes


def temporaries(folder: str | os.PathLike[str]) -> list[str]:
    """``*.tmp-*`` entries of ``folder``."""
    try:
        return sorted(n for n in os.listdir(folder) if ".tmp-" in n)
    except FileNotFoundError:
        return []


def committed_dirs(folder: str | os.PathLike[str]) -> list[str]:
    """Committed checkpoint directories of ``folder`` (by the library's own rule)."""
    from quicksave.manager.folder import committed_steps

    return [os.path.join(folder, f"step-{s}") for s in committed_steps(os.fspath(folder))]


def verify_problems(path: str) -> list[str] | None:
    """``quicksave.loading.verify``'s problems with ``path`` (empty: intact), or None if the
    directory vanished while being checked (deleted by retention)."""
    from quicksave.errors import CheckpointNotFoundError, NotCommittedError
    from quicksave.loading.verify import verify_checkpoint

    try:
        report = verify_checkpoint(path)
    except (CheckpointNotFoundError, NotCommittedError):
        return None
    if not report.ok and not os.path.exists(path):
        return None
    return [str(p) for p in report.problems]


def names_step(message: str, step: int) -> bool:
    """Whether an error message names ``step`` (``step-N``, ``step N``, ``steps [.., N]``)."""
    import re

    return re.search(rf"\bsteps? \[?(?:\d+, )*{step}\b|\bstep-{step}\b", message) is not None


def unreported(failed_steps: list[int], messages: list[str]) -> list[int]:
    """The failed saves that no raised CheckpointError named: the trainer was never
    told of them (at most a log line)."""
    return [s for s in failed_steps if not any(names_step(m, s) for m in messages)]


def describe(e: BaseException) -> str:
    """An exception with where it was raised (file:line of the innermost frame)."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{type(e).__name__}{where}: {e}"


# ---------------------------------------------------------------- processes


def children_of(pid: int) -> list[int]:
    """Live child processes of ``pid`` (from ``/proc/<pid>/task/*/children``)."""
    kids: list[int] = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path) as f:
                kids += [int(x) for x in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return [k for k in sorted(set(kids)) if proc_alive(k)]


def kill_quietly(pid: int | None, sig: int = signal.SIGKILL) -> None:
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def drop_dac_capabilities() -> None:
    """Make this process (and everything it executes) obey file permission bits,
    although it runs as root: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the
    bounding set (so an exec cannot regain them) and from the current sets.

    Raises:
        OSError: the kernel refused (no CAP_SETPCAP, e.g. in some containers).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    pr_capbset_drop = 24
    caps = (1, 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
    for cap in caps:
        if libc.prctl(pr_capbset_drop, cap, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_CAPBSET_DROP, {cap}): {os.strerror(err)}")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this pid
    data = (ctypes.c_uint32 * 6)()
    if libc.capget(header, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"capget: {os.strerror(err)}")
    mask = 0xFFFFFFFF & ~sum(1 << c for c in caps)
    for i in (0, 1, 2):  # effective, permitted, inheritable (low 32 capabilities)
        data[i] &= mask
    if libc.capset(header, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"capset: {os.strerror(err)}")


def can_drop_capabilities() -> str | None:
    """None if a child can drop its DAC capabilities here, else why not."""
    code = (
        "import sys; sys.path.insert(0, %r); import faultkit, os; "
        "faultkit.drop_dac_capabilities(); d = %r; os.chmod(d, 0o555)\n"
        "try:\n    open(os.path.join(d, 'x'), 'w')\nexcept PermissionError:\n"
        "    print('denied')\nelse:\n    print('allowed')"
    )
    d = tempfile.mkdtemp(prefix="qs-capcheck-")
    try:
        p = subprocess.run(
            [sys.executable, "-c", code % (str(HERE), d)], capture_output=True, text=True
        )
    finally:
        os.chmod(d, 0o755)
        for name in os.listdir(d):
            os.unlink(os.path.join(d, name))
        os.rmdir(d)
    if p.returncode != 0:
        return f"cannot drop capabilities: {p.stderr.strip().splitlines()[-1:]}"
    if p.stdout.strip() != "denied":
        return "permission bits are not enforced even without CAP_DAC_OVERRIDE"
    return None


# ---------------------------------------------------------------- mounts


@contextlib.contextmanager
def tmpfs(size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` mounted on a fresh directory; always unmounted after.

    Raises:
        RuntimeError: the mount failed (not root, no mount privilege).
    """
    mnt = Path(tempfile.mkdtemp(prefix="qs-faults-tmpfs-"))
    p = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if p.returncode != 0:
        mnt.rmdir()
        raise RuntimeError(f"cannot mount a tmpfs: {p.stderr.strip() or p.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)
        with contextlib.suppress(OSError):
            mnt.rmdir()


def _dirs(folder: Path) -> list[Path]:
    dirs = [folder]
    for root, subdirs, _files in os.walk(folder):
        dirs += [Path(root) / d for d in subdirs]
    return dirs


def set_writable(folder: Path, writable: bool) -> None:
    """Permission flip: ``folder`` and every directory under it to 0755 or 0555."""
    for d in _dirs(folder):
        with contextlib.suppress(FileNotFoundError):
            os.chmod(d, 0o755 if writable else 0o555)


def set_immutable(folder: Path, immutable: bool) -> None:
    """``chattr +i`` (or ``-i``) on ``folder`` and every directory under it: no entry
    can be created, renamed or removed there, by root too (files stay writable).

    Raises:
        RuntimeError: ``chattr`` failed (no such tool, a filesystem without the flag).
    """
    for _ in range(5):  # directories may appear or vanish while we walk
        p = subprocess.run(
            ["chattr", "+i" if immutable else "-i", *map(str, _dirs(folder))],
            capture_output=True,
            text=True,
        )
        if p.returncode == 0:
            return
    raise RuntimeError(f"chattr failed: {p.stderr.strip()}")


def can_chattr(work: Path) -> str | None:
    """None if ``chattr +i`` works on directories under ``work``, else why not."""
    d = Path(tempfile.mkdtemp(prefix="qs-chattr-", dir=work))
    try:
        set_immutable(d, True)
        try:
            (d / "x").touch()
            return "chattr +i did not stop root from creating a file"
        except PermissionError:
            return None
        finally:
            set_immutable(d, False)
    except (RuntimeError, FileNotFoundError) as e:
        return f"chattr +i is not available here: {e}"
    finally:
        with contextlib.suppress(OSError):
            for name in os.listdir(d):
                os.unlink(d / name)
            d.rmdir()


# ---------------------------------------------------------------- outcomes


@dataclass
class Result:
    """What one campaign did and what came of it.

    ``size``: counts of what was done (trials, kills, saves, ...). ``outcomes``: counts
    of what happened; the keys named in ``must_be_zero`` are failures of quicksave
    (silent corruption, torn commits, orphans, unreported failures, hangs, ...).
    ``violations``: one line per failure, with the detail needed to reproduce it.
    ``timings``: lists of seconds (time-to-error, worker exit after its trainer)."""

    name: str
    size: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    must_be_zero: tuple[str, ...] = ()
    violations: list[str] = field(default_factory=list)
    timings: dict[str, list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    rows: dict[str, dict[str, int]] = field(default_factory=dict)
    seconds: float = 0.0

    def tally(self, row: str, column: str, n: int = 1) -> None:
        """A breakdown table (e.g. corruption outcomes by file region)."""
        cells = self.rows.setdefault(row, {})
        cells[column] = cells.get(column, 0) + n

    def count(self, key: str, n: int = 1) -> None:
        self.outcomes[key] = self.outcomes.get(key, 0) + n

    def grow(self, key: str, n: int = 1) -> None:
        self.size[key] = self.size.get(key, 0) + n

    def violate(self, key: str, detail: str) -> None:
        self.count(key)
        self.violations.append(f"{key}: {detail}")

    def require(self, condition: bool, detail: str) -> None:
        """The fault was really injected (else the campaign proved nothing)."""
        if not condition:
            self.violate("fault_not_injected", detail)

    def time(self, key: str, seconds: float) -> None:
        self.timings.setdefault(key, []).append(seconds)

    def failures(self) -> list[str]:
        bad = [f"{k}={self.outcomes[k]}" for k in self.must_be_zero if self.outcomes.get(k)]
        return bad + self.violations[:20]

    def summary(self) -> str:
        def fmt(d: dict[str, int]) -> str:
            return ", ".join(f"{k}={v}" for k, v in sorted(d.items())) or "-"

        lines = [f"[{self.name}] {self.seconds:.1f} s", f"  size: {fmt(self.size)}"]
        lines.append(f"  outcomes: {fmt(self.outcomes)}")
        for key, values in sorted(self.timings.items()):
            if values:
                lines.append(
                    f"  {key}: n={len(values)} min={min(values):.3f} "
                    f"median={sorted(values)[len(values) // 2]:.3f} max={max(values):.3f} s"
                )
        if self.rows:
            columns = sorted({c for cells in self.rows.values() for c in cells})
            lines.append("  " + " | ".join(["row"] + columns))
            for row, cells in sorted(self.rows.items()):
                lines.append("  " + " | ".join([row] + [str(cells.get(c, 0)) for c in columns]))
        lines += [f"  note: {n}" for n in self.notes[:12]]
        lines += [f"  VIOLATION {v}" for v in self.violations[:20]]
        return "\n".join(lines)

    def check(self) -> None:
        """Fail (AssertionError) on any violation, printing the summary."""
        print(self.summary())
        assert not self.failures(), self.summary()
