"""Shared pieces of the engine, worker and stage tests: states, process and mount probes.

Nothing here mocks a process: the probes read /proc, the mounts are real tmpfs mounts
(the tests that need them run as root, which this CI does).
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import quicksave
from quicksave.commit.kinds import temp_name
from quicksave.loading.verify import verify_checkpoint

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().parent / "engine_child.py"
WORK_TMP = REPO  # a real disk (ext4) for fsync-heavy tests; /tmp may be the same disk


def big_state(mib: int, value: float, pieces: int = 4) -> dict[str, torch.Tensor]:
    """``mib`` MiB of float32 in ``pieces`` tensors, every element equal to ``value``."""
    numel = mib * 2**20 // 4 // pieces
    return {f"w{i}": torch.full((numel,), value + i, dtype=torch.float32) for i in range(pieces)}


def zeros_like_state(sd: dict[str, Any]) -> dict[str, Any]:
    return {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else zeros_like_state(v)
        for k, v in sd.items()
    }


def load_back(like: dict[str, Any], path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load ``path`` into fresh zero tensors shaped like ``like`` (after verifying it)."""
    report = verify_checkpoint(path)
    assert report.ok, str(report)
    out = zeros_like_state(like)
    quicksave.load(out, path)
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN payloads and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ra = a.detach().reshape(-1).contiguous().view(torch.uint8)
    rb = b.detach().reshape(-1).contiguous().view(torch.uint8)
    return torch.equal(ra, rb)


def visible_entries(parent: str | os.PathLike[str]) -> list[str]:
    return sorted(os.listdir(parent))


def temporaries(parent: str | os.PathLike[str]) -> list[str]:
    return [n for n in os.listdir(parent) if ".tmp-" in n]


def proc_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (zombies count as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_dead(pid: int, timeout: float) -> float | None:
    """Seconds until ``pid`` is gone, or None if still alive after ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not proc_alive(pid):
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


def wait_partial_file(final: str | os.PathLike[str], timeout: float = 60.0) -> str:
    """Wait until the save into ``final`` has a non-empty data file in its temporary
    directory (the worker is writing) and return that file."""
    final = os.fspath(final)
    temporary = temp_name(os.path.basename(final), "*")  # FORMAT.md §6
    pattern = os.path.join(os.path.dirname(final), temporary, "rank-*.safetensors")
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        for f in glob.glob(pattern):
            try:
                if os.path.getsize(f) > 0:
                    return f
            except FileNotFoundError:
                pass
        time.sleep(0.0005)
    raise AssertionError(f"no data file appeared under {pattern} within {timeout} s")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pool_mappings(pid: int | str = "self") -> int:
    """Distinct staging-pool mappings (memfd) in a process."""
    with open(f"/proc/{pid}/maps") as f:
        return len({line.split()[4] for line in f if "quicksave-pool" in line})


def open_fds(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def stop_and_continue(pid: int, seconds: float) -> None:
    """SIGSTOP ``pid`` now, SIGCONT it ``seconds`` later (from a timer thread)."""
    import threading

    os.kill(pid, signal.SIGSTOP)
    threading.Timer(seconds, lambda: os.kill(pid, signal.SIGCONT)).start()


@contextlib.contextmanager
def tmpfs(size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` mounted on a fresh directory; always unmounted after."""
    mnt = Path(tempfile.mkdtemp(prefix="qs-tmpfs-"))
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
            check=True,
            capture_output=True,
        )
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        mnt.rmdir()
        raise RuntimeError(f"cannot mount a tmpfs (needs root): {e}") from e
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)
        mnt.rmdir()


def remount_ro(mnt: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True, capture_output=True)


def run_child(*args: str, timeout: float = 120.0, prefix: tuple[str, ...] = ()) -> str:
    """Run tests/helpers_engine/engine_child.py to completion; return its stdout."""
    p = subprocess.run(
        [*prefix, sys.executable, str(CHILD), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    assert p.returncode == 0, f"child failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return p.stdout


def start_child(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(CHILD), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def engine_plan(state_dict: Any) -> Any:
    """The single-rank engine's plan of ``state_dict`` (its collector and planner, no
    saver), with the engine's default files per rank."""
    from quicksave.saving.config import EngineConfig
    from quicksave.saving.engine_plan import plan_one_rank
    from quicksave.saving.rank_plans import collect_local

    state = collect_local(state_dict, 0, whole=True)
    return plan_one_rank(state.plan, EngineConfig().thread_count)
