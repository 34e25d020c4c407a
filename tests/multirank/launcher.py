"""Run a test function on N real processes joined in a gloo process group.

This is the one helper every multi-rank test goes through::

    run_ranks(fn, world_size, *args)  ──▶  zygote process (fresh interpreter, new session)
                                             imports fn's module (torch) once, then
                                             fork() × world_size ──▶ rank r:
                                               init_process_group("gloo", FileStore)
                                               fn(r, world_size, *args) → result file

Importing torch costs ~3 CPU seconds; the zygote pays it once per group instead of once
per rank, and the fork happens before any torch thread pool exists, so it is safe. The
group meets through a ``FileStore`` in a private temporary directory (no port to race
for) and talks over loopback.

Nothing can hang: collectives get a timeout; once a rank fails, the others get a grace
period (they are probably waiting for it in a collective) and are then killed; and the
launcher has a hard wall-clock limit after which it SIGKILLs the whole session. Every
process also dies with its parent (``PR_SET_PDEATHSIG`` on Linux). Failures come back
as :class:`DistTestFailure` with each failed rank's traceback and output, the rank that
failed first listed first.

Example::

    def _check(rank: int, world_size: int, root: str) -> int:
        import torch.distributed as dist
        assert dist.get_world_size() == world_size
        return rank * 10

    def test_something(tmp_path):
        assert run_ranks(_check, 3, str(tmp_path)) == [0, 10, 20]

``fn`` must be a module-level function of an importable module; ``args``/``kwargs`` and
the return value must pickle with the standard library alone (str, int, dict, ...).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

LOG_TAIL_CHARS = 4000  # of each failed rank's output, in the failure message
POLL_S = 0.05


class DistTestFailure(AssertionError):
    """One or more ranks failed, crashed or timed out; the message holds their tracebacks."""


@dataclass(frozen=True)
class LaunchConfig:
    """How ranks are started and how long they may take.

    Attributes:
        timeout_s: hard wall-clock limit for the whole group; everything is killed after it.
        grace_s: once a rank failed, how long the others get to finish before being killed.
        collective_timeout_s: the process group's timeout, so a collective waiting on a
            dead peer errors out instead of blocking.
        env: extra environment variables for the ranks.
        preload: modules the zygote imports before forking, so that no rank pays for
            them (e.g. ``torch._dynamo``, which DTensor imports on first use: ~1.3 s).
        crash_after_result: each rank SIGKILLs itself once its result is written (no
            teardown, no exit handlers): a trainer crash, for the tests of what outlives
            it.
    """

    timeout_s: float = 120.0
    grace_s: float = 15.0
    collective_timeout_s: float = 60.0
    env: dict[str, str] = field(default_factory=dict)
    preload: tuple[str, ...] = ()
    crash_after_result: bool = False


@dataclass(frozen=True)
class _GroupSpec:
    """Everything the zygote needs; pickled into a file it reads at start."""

    module: str
    module_file: str
    function: str
    world_size: int
    work_dir: str
    sys_path: list[str]
    grace_s: float
    collective_timeout_s: float
    preload: tuple[str, ...]
    crash_after_result: bool
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def result_path(self, rank: int) -> str:
        return os.path.join(self.work_dir, f"result-{rank}.pkl")

    def log_path(self, rank: int) -> str:
        return os.path.join(self.work_dir, f"log-{rank}.txt")

    @property
    def status_path(self) -> str:
        return os.path.join(self.work_dir, "exit-codes.json")

    @property
    def zygote_log_path(self) -> str:
        return os.path.join(self.work_dir, "log-zygote.txt")


def _child_env(config: LaunchConfig) -> dict[str, str]:
    env = dict(os.environ)
    # Two busy cores: one intra-op thread per rank keeps N ranks from oversubscribing.
    env.setdefault("OMP_NUM_THREADS", "1")
    # gloo binds to the interface the host name resolves to, which in containers can be
    # unreachable; loopback always works for a single-host group.
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.update(config.env)
    return env


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    config: LaunchConfig | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    Args:
        fn: a module-level function (looked up by module and name in the ranks).
        world_size: number of processes, each one rank of a fresh default process group.
        *args: positional arguments after ``rank, world_size`` (picklable).
        config: timeouts and extra environment; defaults to ``LaunchConfig()``.
        **kwargs: keyword arguments for ``fn`` (picklable).

    Returns:
        The return values of ``fn``, indexed by rank.

    Raises:
        DistTestFailure: some rank raised (its traceback is in the message), exited
            without a result, or the group ran past ``config.timeout_s`` (all killed).

    Example::

        values = run_ranks(_check, 4, str(tmp_path), config=LaunchConfig(timeout_s=60))
    """
    config = config or LaunchConfig()
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    module = sys.modules[fn.__module__]
    work = tempfile.mkdtemp(prefix="quicksave-dist-")
    try:
        spec = _GroupSpec(
            module=fn.__module__,
            module_file=os.path.abspath(module.__file__ or ""),
            function=fn.__qualname__,
            world_size=world_size,
            work_dir=work,
            sys_path=list(sys.path),
            grace_s=config.grace_s,
            collective_timeout_s=config.collective_timeout_s,
            preload=tuple(config.preload),
            crash_after_result=config.crash_after_result,
            args=args,
            kwargs=kwargs,
        )
        spec_file = os.path.join(work, "spec.pkl")
        with open(spec_file, "wb") as f:
            pickle.dump(spec, f)
        timed_out = _run_zygote(spec, spec_file, config)
        values, problems = _collect(spec, timed_out, config)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if problems:
        raise DistTestFailure(
            f"{len(problems)} of {world_size} ranks failed running {fn.__qualname__} "
            "(first to fail first):\n\n" + "\n\n".join(problems)
        )
    return values


def _run_zygote(spec: _GroupSpec, spec_file: str, config: LaunchConfig) -> bool:
    """Start the zygote, wait for it; return True if the hard limit was hit."""
    with open(spec.zygote_log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), spec_file],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_child_env(config),
            start_new_session=True,  # the zygote and every rank share one process group
        )
    timed_out = False
    try:
        proc.wait(timeout=config.timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        # Always, also on KeyboardInterrupt: no rank may outlive the launch.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
    return timed_out


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - LOG_TAIL_CHARS))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _read_result(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


def _collect(
    spec: _GroupSpec, timed_out: bool, config: LaunchConfig
) -> tuple[list[Any], list[str]]:
    try:
        with open(spec.status_path) as f:
            codes = {int(k): v for k, v in json.load(f).items()}
    except (OSError, ValueError):
        codes = {}
    values: list[Any] = []
    problems: list[tuple[float, int, str]] = []
    for rank in range(spec.world_size):
        res = _read_result(spec.result_path(rank))
        if res is not None and res["ok"]:
            values.append(res["value"])
            continue
        values.append(None)
        code = codes.get(rank)
        if res is not None:
            what = f"--- rank {rank} raised:\n{res['traceback']}"
        elif timed_out:
            what = f"--- rank {rank} was killed: the group ran past {config.timeout_s:.0f} s"
        elif code is not None and code < 0:
            what = (
                f"--- rank {rank} was killed by signal {-code} "
                f"(still running {spec.grace_s:.0f} s after a peer failed?)"
            )
        elif code is not None:
            what = f"--- rank {rank} exited with code {code} and no result"
        else:
            what = (
                f"--- rank {rank} never reported; the zygote's output:\n"
                f"{_tail(spec.zygote_log_path)}"
            )
        # The rank that raised first is usually the cause, the others its victims.
        when = res["time"] if res is not None else float("inf")
        text = f"{what}\n--- rank {rank} output (tail):\n{_tail(spec.log_path(rank))}"
        problems.append((when, rank, text))
    return values, [text for _, _, text in sorted(problems)]


# ---------------------------------------------------------------------- child side
def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _load_function(spec: _GroupSpec) -> Callable[..., Any]:
    for p in reversed(spec.sys_path):
        if p not in sys.path:
            sys.path.insert(0, p)
    try:
        module = importlib.import_module(spec.module)
    except ImportError:
        # The test module may only be importable by path (e.g. pytest's importlib mode).
        mod_spec = importlib.util.spec_from_file_location(spec.module, spec.module_file)
        if mod_spec is None or mod_spec.loader is None:
            raise
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[spec.module] = module
        mod_spec.loader.exec_module(module)
    fn: Any = module
    for part in spec.function.split("."):
        fn = getattr(fn, part)
    return fn


def _write_result(path: str, payload: dict[str, Any]) -> None:
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        try:
            pickle.dump(payload, f)
        except Exception as e:  # an unpicklable return value must still report something
            f.seek(0)
            f.truncate()
            msg = f"return value does not pickle: {e!r}"
            pickle.dump({"ok": False, "traceback": msg, "time": time.time()}, f)
    os.rename(tmp, path)  # the launcher never sees half a result


def _rank_main(spec: _GroupSpec, fn: Callable[..., Any], rank: int) -> int:
    """Body of one forked rank; returns its exit code."""
    _die_with_parent()
    log = os.open(spec.log_path(rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    import datetime

    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{os.path.join(spec.work_dir, 'store')}",
            rank=rank,
            world_size=spec.world_size,
            timeout=datetime.timedelta(seconds=spec.collective_timeout_s),
        )
        value = fn(rank, spec.world_size, *spec.args, **spec.kwargs)
    except BaseException:
        failure = {"ok": False, "traceback": traceback.format_exc(), "time": time.time()}
        _write_result(spec.result_path(rank), failure)
        # No teardown: peers may be stuck in a collective, and tearing the group down
        # could block on them; the zygote kills them after the grace period.
        return 1
    _write_result(spec.result_path(rank), {"ok": True, "value": value})
    if spec.crash_after_result:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()
    return 0


def _reap(pids: dict[int, int], grace_s: float) -> dict[int, int]:
    """Wait for the ranks (pid -> rank); kill the rest ``grace_s`` after the first failure."""
    codes: dict[int, int] = {}
    first_failure: float | None = None
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            code = os.waitstatus_to_exitcode(status)
            codes[pids[pid]] = code
            if code != 0 and first_failure is None:
                first_failure = time.monotonic()
            continue
        if first_failure is not None and time.monotonic() - first_failure > grace_s:
            for p, r in pids.items():
                if r not in codes:
                    try:
                        os.kill(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        time.sleep(POLL_S)
    return codes


def _zygote_main(spec_file: str) -> int:
    _die_with_parent()
    with open(spec_file, "rb") as f:
        spec: _GroupSpec = pickle.load(f)
    fn = _load_function(spec)  # imports torch and the test module once, for every rank
    for name in ("torch.distributed", *spec.preload):
        importlib.import_module(name)

    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int] = {}
    for rank in range(spec.world_size):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _rank_main(spec, fn, rank)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)  # never run the zygote's own clean-up in a rank
        pids[pid] = rank
    codes = _reap(pids, spec.grace_s)
    with open(spec.status_path, "w") as f:
        json.dump(codes, f)
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(_zygote_main(sys.argv[1]))
