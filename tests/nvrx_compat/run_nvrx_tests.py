#!/usr/bin/env python3
"""Run NVIDIA Resiliency Extension's own async-checkpoint tests against quicksave.

A measuring tool, not a test: it copies NVRx's unit tests
(``tests/checkpointing/unit/test_async_save.py``, ``test_async_writer.py``,
``test_async_writer_msc.py``) and examples (``examples/checkpointing/async_ckpt.py``,
``async_writer.py``) from an NVRx checkout into a temporary directory, rewrites the copies
with a fixed set of test-side patches (listed in ``PATCHES``; the checkout itself is never
touched), runs every test id on 1 rank and on 2 ranks (gloo, CPU), and prints a table of
pass/fail per world size with the first error line of every failure.

Patches (and nothing else):

* ``'nccl'`` -> ``'gloo'``
* ``torch.cuda.set_device(...)`` -> ``pass``
* tensors on the CPU instead of CUDA (``'cuda'``/``f'cuda:{torch.cuda.current_device()}'``
  -> ``'cpu'``)
* ``FSDP(m)`` -> ``m``
* ``conftest.py``: an autouse fixture seeds torch's CPU generator with CUDA's default seed
  before each test (on a GPU the tests' random tensors come from the CUDA generator, which
  starts from the same seed in every process, so every rank holds the same values; the
  CPU generator's default seed differs per process)
* with ``--target quicksave`` (the default): ``nvidia_resiliency_ext.checkpointing.async_ckpt``
  -> ``quicksave.async_api``; with ``--target nvrx`` the imports stay, to run NVRx itself.

With ``--target nvrx`` on a machine without CUDA (or with ``--nvrx-cpu-shim``), NVRx's own
CUDA calls are made to run on the CPU by ``cpu_shim/sitecustomize.py`` (first on the ranks'
``PYTHONPATH``; NVRx's files are not edited); see that file for the list of patches.

NVRx's test harness (``tests/checkpointing/unit/test_utilities.py``) reads ``RANK``,
``LOCAL_RANK`` and ``WORLD_SIZE`` and rendezvouses over ``tcp://MASTER_ADDR:MASTER_PORT``;
this script starts the ranks itself with exactly the variables ``torchrun`` would set, one
``python -m pytest <test id>`` per rank, so that a hung or crashed rank can be killed and
every test id runs in fresh processes.

Usage (see README.md next to this file)::

    python tests/nvrx_compat/run_nvrx_tests.py /path/to/nvidia-resiliency-ext
    python tests/nvrx_compat/run_nvrx_tests.py --from-mirror /path/to/repo.git \\
        --ref v0.7.0-main --quicksave-ref HEAD --json out.json
"""

from __future__ import annotations

import argparse
import ast
import datetime
import difflib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

UNIT_DIR = "tests/checkpointing/unit"
TEST_FILES = [
    f"{UNIT_DIR}/test_async_save.py",
    f"{UNIT_DIR}/test_async_writer.py",
    f"{UNIT_DIR}/test_async_writer_msc.py",
]
# The harness the test files import (package __init__, conftest, Utils/Model).
SUPPORT_FILES = [
    f"{UNIT_DIR}/__init__.py",
    f"{UNIT_DIR}/conftest.py",
    f"{UNIT_DIR}/test_utilities.py",
]
EXAMPLE_FILES = [
    "examples/checkpointing/async_ckpt.py",
    "examples/checkpointing/async_writer.py",
]
NVRX_ASYNC = "nvidia_resiliency_ext.checkpointing.async_ckpt"
QS_ASYNC = "quicksave.async_api"
PKG_SRC = "src/nvidia_resiliency_ext"

REPO_ROOT = Path(__file__).resolve().parents[2]
CPU_SHIM = Path(__file__).resolve().parent / "cpu_shim" / "sitecustomize.py"


class SetupError(Exception):
    """A problem before any test ran (bad path, missing file, git failure...)."""


# --------------------------------------------------------------------------------------
# Test-side patches (text rewriting of the copies)
# --------------------------------------------------------------------------------------


def _replace_calls(text: str, name: str, keep_argument: bool) -> tuple[str, int]:
    """Replace every call ``name(<balanced>)`` by its argument text (or drop it)."""
    out, i, n = [], 0, 0
    pat = re.compile(r"(?<![\w.])" + re.escape(name) + r"\(")
    while True:
        m = pat.search(text, i)
        if not m:
            out.append(text[i:])
            break
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[j], 0)
            j += 1
        if depth:  # unbalanced: leave the rest alone
            out.append(text[i:])
            break
        out.append(text[i : m.start()])
        out.append(text[m.end() : j - 1].strip() if keep_argument else "")
        i, n = j, n + 1
    return "".join(out), n


def _p_nccl(text: str) -> tuple[str, int]:
    return re.subn(r"""(['"])nccl\1""", r"\1gloo\1", text)


def _p_set_device(text: str) -> tuple[str, int]:
    return re.subn(
        r"^([ \t]*)torch\.cuda\.set_device\(.*\)[ \t]*$",
        r"\1pass  # nvrx_compat: torch.cuda.set_device removed",
        text,
        flags=re.M,
    )


def _p_cpu(text: str) -> tuple[str, int]:
    text, a = re.subn(r"""f(['"])cuda:\{torch\.cuda\.current_device\(\)\}\1""", "'cpu'", text)
    text, b = re.subn(r"""(['"])cuda\1""", r"\1cpu\1", text)
    return text, a + b


def _p_fsdp(text: str) -> tuple[str, int]:
    return _replace_calls(text, "FSDP", keep_argument=True)


def _p_imports(text: str) -> tuple[str, int]:
    return re.subn(re.escape(NVRX_ASYNC) + r"\b", QS_ASYNC, text)


PATCHES = [
    ("nccl->gloo", _p_nccl),
    ("no torch.cuda.set_device", _p_set_device),
    ("cuda->cpu", _p_cpu),
    ("FSDP(m)->m", _p_fsdp),
    (f"{NVRX_ASYNC}->{QS_ASYNC}", _p_imports),
]


# c10's default_rng_seed_val: the seed of every CUDA default generator in every process.
CUDA_DEFAULT_SEED = 67280421310721
SEED_FIXTURE = f"""

# nvrx_compat: the tests' tensors come from the CPU generator here, not from the CUDA one;
# seed it as CUDA's default generator is seeded (the same in every process), so that every
# rank holds the same values, as on a GPU.
@pytest.fixture(autouse=True)
def _nvrx_compat_cuda_default_seed():
    import torch

    torch.manual_seed({CUDA_DEFAULT_SEED})
"""


def patch_text(text: str, target: str, rel: str = "") -> tuple[str, dict[str, int]]:
    counts = {}
    for name, fn in PATCHES:
        if fn is _p_imports and target != "quicksave":
            continue
        text, n = fn(text)
        if n:
            counts[name] = n
    if rel == f"{UNIT_DIR}/conftest.py":
        text = text.rstrip("\n") + "\n" + SEED_FIXTURE
        counts["CUDA default seed"] = 1
    return text, counts


# --------------------------------------------------------------------------------------
# Source preparation
# --------------------------------------------------------------------------------------


def extract_from_git(git_dir: Path, ref: str, dest: Path, paths: list[str] | None = None) -> str:
    """``git archive <ref> [paths]`` of ``git_dir`` into ``dest``; returns the commit id."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(git_dir), "rev-parse", "--verify", f"{ref}^{{commit}}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        data = subprocess.run(
            ["git", "-C", str(git_dir), "archive", "--format=tar", commit, *(paths or [])],
            check=True,
            capture_output=True,
        ).stdout
    except FileNotFoundError as e:
        raise SetupError("git is not installed") from e
    except subprocess.CalledProcessError as e:
        msg = (e.stderr or b"").decode(errors="replace").strip() if e.stderr else ""
        raise SetupError(f"git failed on {git_dir} at {ref!r}: {msg}") from e
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        if sys.version_info >= (3, 12) or hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # pragma: no cover - old Pythons without extraction filters
            tar.extractall(dest)
    return commit


def nvrx_version(root: Path) -> str:
    m = re.search(r'^version\s*=\s*"([^"]+)"', _read(root / "pyproject.toml"), re.M)
    # 0.0.0 is the placeholder that poetry-dynamic-versioning replaces at build time.
    return m.group(1) if m and m.group(1) != "0.0.0" else "(version set at build time)"


def _read(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except OSError:
        return ""


@dataclass
class Workdir:
    root: Path  # the patched copy: rootdir of the pytest runs and cwd of every rank
    pythonpath: list[str]
    patches: dict[str, dict[str, int]]
    diff: str


def prepare_workdir(nvrx_root: Path, work: Path, target: str) -> Workdir:
    missing = [p for p in TEST_FILES + SUPPORT_FILES if not (nvrx_root / p).is_file()]
    if missing:
        raise SetupError(f"{nvrx_root} is not an NVRx checkout: missing {', '.join(missing)}")
    work.mkdir(parents=True, exist_ok=True)
    # NVRx's pytest config (rootdir + ini), so that pytest does not pick up some other one.
    if (nvrx_root / "pyproject.toml").is_file():
        shutil.copy2(nvrx_root / "pyproject.toml", work / "pyproject.toml")
    patches, diffs = {}, []
    for rel in SUPPORT_FILES + TEST_FILES + EXAMPLE_FILES:
        src = nvrx_root / rel
        if not src.is_file():
            continue  # a missing example is reported when it is run
        orig = src.read_text(encoding="utf-8")
        new, counts = patch_text(orig, target, rel)
        dst = work / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(new, encoding="utf-8")
        if counts:
            patches[rel] = counts
            diffs.extend(
                difflib.unified_diff(
                    orig.splitlines(True), new.splitlines(True), f"a/{rel}", f"b/{rel}"
                )
            )
    # The rest of nvidia_resiliency_ext the tests import (checkpointing.utils.diff,
    # checkpointing.local.base_state_dict) is pure Python: take it from the source tree.
    pythonpath = []
    pkg = nvrx_root / PKG_SRC
    if target == "quicksave":
        if not pkg.is_dir():
            raise SetupError(f"{pkg} missing (needed for the tests' non-async_ckpt imports)")
        shim = work / "nvrx_src"
        shutil.copytree(pkg, shim / "nvidia_resiliency_ext")
        # Without async_ckpt, so that an import the rewriting missed fails loudly instead
        # of silently testing NVRx.
        shutil.rmtree(shim / "nvidia_resiliency_ext/checkpointing/async_ckpt", True)
        pythonpath.append(str(shim))
    elif not _nvrx_installed():
        if not pkg.is_dir():
            raise SetupError(f"--target nvrx: no installed nvidia_resiliency_ext and no {pkg}")
        shutil.copytree(pkg, work / "nvrx_src" / "nvidia_resiliency_ext")
        pythonpath.append(str(work / "nvrx_src"))
    (work / "patches.diff").write_text("".join(diffs), encoding="utf-8")
    return Workdir(work, pythonpath, patches, "".join(diffs))


def install_cpu_shim(dest: Path) -> Path:
    """Copy the CPU shim (``cpu_shim/sitecustomize.py``) into ``dest``; returns ``dest``.

    ``dest`` must go first on the ``PYTHONPATH`` of the processes that should get it.
    """
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(CPU_SHIM, dest / "sitecustomize.py")
    return dest


def cuda_available(python: str, env: dict | None = None) -> bool:
    """``torch.cuda.is_available()`` in ``python`` (a fresh process, without the shim)."""
    out = subprocess.run(
        [python, "-c", "import torch; print(torch.cuda.is_available())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode != 0:
        raise SetupError(f"{python}: cannot import torch: {last_exception_line(out.stderr)}")
    return out.stdout.strip() == "True"


def check_cpu_shim(python: str, env: dict, cwd: Path) -> None:
    """Raise SetupError unless the shim is active in a process started with ``env``."""
    ok = "__import__('torch').cuda.current_device() == 'cpu'"
    code = (
        "import multiprocessing as mp\n"
        "if __name__ == '__main__':\n"
        "    with mp.get_context('spawn').Pool(1) as p:\n"
        f"        print({ok}, p.apply(eval, ({ok!r},)))\n"
    )
    out = subprocess.run(
        [python, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    if out.stdout.split() != ["True", "True"]:
        raise SetupError(
            "the CPU shim is not active in the ranks or their spawned children (it acts only "
            "when torch.cuda.is_available() is False): "
            + (last_exception_line(out.stderr) or out.stdout.strip() or exit_text(out.returncode))
        )


def _nvrx_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("nvidia_resiliency_ext") is not None


# --------------------------------------------------------------------------------------
# Test ids
# --------------------------------------------------------------------------------------


def _param_id(value) -> str:
    if isinstance(value, bool | int | float | str) or value is None:
        return str(value)
    raise ValueError(value)


def static_test_ids(path: Path, rel: str) -> list[str]:
    """Test ids by reading the file (for a file pytest cannot collect, e.g. on an ImportError).

    Handles what NVRx's files use: test classes/functions with literal
    ``pytest.mark.parametrize`` lists.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"))
    ids: list[str] = []

    def fn_ids(fn: ast.FunctionDef, prefix: str) -> list[str]:
        if not fn.name.startswith("test"):
            return []
        suffixes = [""]
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and ast.unparse(dec.func).endswith("parametrize")):
                continue
            values = ast.literal_eval(dec.args[1])
            ps = [
                "-".join(map(_param_id, v)) if isinstance(v, tuple) else _param_id(v)
                for v in values
            ]
            suffixes = [f"{p}-{s}" if s else p for p in ps for s in suffixes]
        return [f"{prefix}{fn.name}" + (f"[{s}]" if s else "") for s in suffixes]

    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    ids += fn_ids(item, f"{rel}::{node.name}::")
        elif isinstance(node, ast.FunctionDef):
            ids += fn_ids(node, f"{rel}::")
    return ids


def collect_test_ids(wd: Workdir, python: str, env: dict, timeout: float) -> list[str]:
    """Ask pytest (1 rank's environment); fall back to reading files it cannot collect."""
    cenv = dict(env, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    cmd = [python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    try:
        out = subprocess.run(
            cmd + TEST_FILES,
            cwd=wd.root,
            env=cenv,
            capture_output=True,
            text=True,
            timeout=timeout,
        ).stdout
    except subprocess.TimeoutExpired:
        out = ""
    collected = [ln.strip() for ln in out.splitlines() if "::" in ln and ln.startswith("tests/")]
    ids = []
    for rel in TEST_FILES:
        mine = [i for i in collected if i.startswith(rel + "::")]
        ids += mine or static_test_ids(wd.root / rel, rel)
    return ids


# --------------------------------------------------------------------------------------
# Launching ranks
# --------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankRun:
    rank: int
    returncode: int | None  # None: killed by us
    killed: str = ""  # why we killed it ("timeout", "peer failed")
    stdout: Path | None = None
    stderr: Path | None = None
    ended: float = float("inf")  # seconds after the start when it was seen to exit


def _kill_group(proc: subprocess.Popen, sig=signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def launch(
    argv: list[str],
    world_size: int,
    cwd: Path,
    env: dict,
    logdir: Path,
    timeout: float,
    grace: float,
) -> tuple[list[RankRun], float]:
    """Start ``world_size`` ranks of ``argv`` with torchrun's environment; wait, bounded.

    Each rank gets its own session (process group) so that it and any worker processes it
    spawned can be killed together. A rank still running ``grace`` seconds after another
    failed (typically stuck in a collective) is killed, as is everything at ``timeout``.
    """
    logdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs, runs = [], []
    threads = max(1, (os.cpu_count() or 1) // world_size)
    for r in range(world_size):
        renv = dict(env)
        renv.update(
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            GROUP_RANK="0",
            ROLE_RANK=str(r),
            ROLE_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        renv.setdefault("OMP_NUM_THREADS", str(threads))
        out, err = logdir / f"rank{r}.out", logdir / f"rank{r}.err"
        with open(out, "wb") as fo, open(err, "wb") as fe:
            procs.append(
                subprocess.Popen(
                    [a.replace("{rank}", str(r)) for a in argv],
                    cwd=cwd,
                    env=renv,
                    stdout=fo,
                    stderr=fe,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        runs.append(RankRun(r, None, stdout=out, stderr=err))
    t0 = time.monotonic()
    first_fail_at = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            now = time.monotonic()
            for run, c in zip(runs, codes, strict=True):
                if c is not None and run.ended == float("inf"):
                    run.ended = now - t0
            if all(c is not None for c in codes):
                break
            if first_fail_at is None and any(c not in (None, 0) for c in codes):
                first_fail_at = now
            why = ""
            if now - t0 > timeout:
                why = f"timeout after {timeout:.0f}s"
            elif first_fail_at is not None and now - first_fail_at > grace:
                why = f"killed {grace:.0f}s after another rank failed"
            if why:
                for p, run, c in zip(procs, runs, codes, strict=True):
                    if c is None:
                        run.killed = why
                        _kill_group(p)
                for p in procs:
                    try:
                        p.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        pass
                break
            time.sleep(0.2)
    finally:
        for p, run in zip(procs, runs, strict=True):
            if p.poll() is None:  # interrupted (Ctrl-C): no orphans
                _kill_group(p)
                p.wait()
            run.returncode = None if run.killed else p.returncode
            _kill_group(p)  # leftover workers of this rank, if any
    return runs, time.monotonic() - t0


# --------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------


@dataclass
class Outcome:
    status: str  # pass / fail / skip
    reason: str = ""
    seconds: float = 0.0
    rank_codes: list = field(default_factory=list)


_EXC_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*)$")


def first_error_line(text: str, fallback: str = "") -> str:
    for ln in text.splitlines():
        if ln.startswith("E "):
            s = ln[1:].strip()
            if s:
                return s
    return (fallback or "").strip().splitlines()[0] if (fallback or "").strip() else ""


def last_exception_line(text: str) -> str:
    # torch.distributed prefixes an uncaught exception's lines with "[rankN]: ".
    lines = [re.sub(r"^\[rank\d+\]: ?", "", ln) for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        m = _EXC_LINE.match(ln)
        if m and not ln.startswith(" "):
            return m.group(1).strip()
    return ""


def exit_text(code: int | None) -> str:
    if code is None:
        return "killed"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


def _short(s: str, n: int = 220) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 3] + "..."


def rank_junit(path: Path) -> tuple[str, str] | None:
    """(status, first error line) for the one test in a rank's junit file, or None."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    status, reason = None, ""
    for tc in root.iter("testcase"):
        for tag in ("failure", "error"):
            el = tc.find(tag)
            if el is not None and status != "fail":
                status = "fail"
                reason = first_error_line(el.text or "", el.get("message", ""))
        if status is None:
            status = "skip" if tc.find("skipped") is not None else "pass"
    if status is None:  # nothing ran (e.g. "no tests ran" on an id that does not exist)
        return ("fail", "no test ran")
    return status, reason


def test_outcome(runs: list[RankRun], logdir: Path, seconds: float) -> Outcome:
    statuses = []
    for run in runs:
        junit = rank_junit(logdir / f"rank{run.rank}.xml")
        err_tail = last_exception_line(_read(run.stderr) + "\n" + _read(run.stdout))
        if run.killed and junit is not None:
            # pytest reported, then the process did not exit (e.g. a checkpoint worker
            # left running by a failed test): the report says why.
            what = junit[1] if junit[0] == "fail" else f"test reported {junit[0]}"
            statuses.append(("fail", f"{what} (then did not exit: {run.killed})"))
        elif run.killed:
            tail = f" (last error in its log: {err_tail})" if err_tail else ""
            statuses.append(("fail", f"{run.killed}{tail}"))
        elif junit is None:
            tail = f": {err_tail}" if err_tail else ""
            statuses.append(("fail", f"{exit_text(run.returncode)}, no report{tail}"))
        elif junit[0] == "pass" and run.returncode != 0:
            tail = f": {err_tail}" if err_tail else ""
            statuses.append(("fail", f"passed but {exit_text(run.returncode)}{tail}"))
        else:
            statuses.append(junit)
    codes = [r.returncode for r in runs]
    if all(s == "pass" for s, _ in statuses):
        return Outcome("pass", seconds=seconds, rank_codes=codes)
    if all(s == "skip" for s, _ in statuses):
        return Outcome("skip", statuses[0][1], seconds, codes)
    # The root cause is most likely the rank that failed first (the others then fail in a
    # collective or wait until killed); a rank we killed only if no rank failed by itself.
    bad = [(r, s) for r, s in enumerate(statuses) if s[0] == "fail"]
    real = [(r, s) for r, s in bad if not runs[r].killed] or bad
    r, (_, why) = min(real, key=lambda rs: (runs[rs[0]].ended, rs[0]))
    prefix = f"rank {r}: " if len(runs) > 1 else ""
    return Outcome("fail", _short(prefix + why), seconds, codes)


def first_failure(runs: list[RankRun]) -> str:
    """Why the group failed, from the rank that failed first on its own (not killed by
    the launcher after another rank's failure): its last exception line, or how it
    ended; ``"rank r: "`` in front when there are several ranks."""
    real = [r for r in runs if not r.killed and r.returncode != 0] or runs
    run = min(real, key=lambda r: (r.ended, r.rank))
    err_tail = last_exception_line(_read(run.stderr))
    if run.killed:
        why = run.killed + (f" (last error in its log: {err_tail})" if err_tail else "")
    else:
        why = err_tail or exit_text(run.returncode)
    return (f"rank {run.rank}: " if len(runs) > 1 else "") + why


def example_outcome(runs: list[RankRun], seconds: float) -> Outcome:
    codes = [r.returncode for r in runs]
    if all(c == 0 for c in codes):
        return Outcome("pass", seconds=seconds, rank_codes=codes)
    return Outcome("fail", _short(first_failure(runs)), seconds, codes)


def exit_code_text(o: Outcome) -> str:
    return _codes(o.rank_codes)


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def _ws_label(ws: int) -> str:
    return f"{ws} rank" + ("s" if ws != 1 else "")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="nvrx_compat_", dir=args.tmpdir))
    _log(f"work directory: {tmp}")
    try:
        report = _run(args, tmp)
    except BaseException:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
        report["work_dir"] = None
    return report


def _run(args: argparse.Namespace, tmp: Path) -> dict:
    source: dict = {}
    if args.from_mirror:
        nvrx_root = tmp / "nvrx"
        commit = extract_from_git(Path(args.from_mirror), args.ref, nvrx_root)
        source = {"mirror": str(args.from_mirror), "ref": args.ref, "commit": commit}
    else:
        nvrx_root = Path(args.nvrx_root).resolve()
        if not nvrx_root.is_dir():
            raise SetupError(f"{nvrx_root}: not a directory")
        source = {"path": str(nvrx_root)}
    source["nvrx_version"] = nvrx_version(nvrx_root)

    wd = prepare_workdir(nvrx_root, tmp / "work", args.target)
    env = dict(os.environ)
    pythonpath = list(wd.pythonpath)
    qs: dict = {}
    if args.target == "quicksave" and args.quicksave_ref:
        qs_src = tmp / "quicksave"
        commit = extract_from_git(REPO_ROOT, args.quicksave_ref, qs_src, ["src"])
        pythonpath.insert(0, str(qs_src / "src"))
        qs = {"ref": args.quicksave_ref, "commit": commit}
    shim = args.nvrx_cpu_shim
    if shim is None:  # default: on for NVRx on a machine without CUDA
        shim = args.target == "nvrx" and not cuda_available(args.python)
    if shim:
        pythonpath.insert(0, str(install_cpu_shim(tmp / "cpu_shim")))
    if env.get("PYTHONPATH"):
        pythonpath.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("PYTEST_ADDOPTS", None)
    if shim:
        check_cpu_shim(args.python, env, wd.root)
        _log("CPU shim active (cpu_shim/sitecustomize.py first on PYTHONPATH)")

    # Which implementation the ranks will import, checked up front.
    probe_mod = QS_ASYNC if args.target == "quicksave" else NVRX_ASYNC + ".core"
    probe = subprocess.run(
        [
            args.python,
            "-c",
            f"import importlib; m = importlib.import_module({probe_mod!r}); print(m.__file__)",
        ],
        cwd=wd.root,
        env=env,
        capture_output=True,
        text=True,
        timeout=args.timeout,
    )
    if probe.returncode != 0:
        raise SetupError(
            f"--target {args.target}: cannot import {probe_mod}: "
            + last_exception_line(probe.stderr)
        )
    qs["module_file"] = probe.stdout.strip()
    _log(f"target {args.target}: {probe_mod} from {qs['module_file']}")
    for rel, counts in wd.patches.items():
        _log(f"  patched {rel}: " + ", ".join(f"{k} x{v}" for k, v in counts.items()))

    ids = collect_test_ids(wd, args.python, env, args.timeout)
    if args.k:
        ids = [i for i in ids if any(k in i for k in args.k)]
    _log(f"{len(ids)} test ids")

    results: dict[str, dict[str, Outcome]] = {i: {} for i in ids}
    examples: dict[str, dict[str, Outcome]] = {}
    for ws in args.world_sizes:
        for n, tid in enumerate(ids):
            logdir = tmp / "logs" / f"ws{ws}" / f"t{n:02d}"
            (logdir / "pytest").mkdir(parents=True)  # pytest makes only the last level
            argv = [
                args.python,
                "-m",
                "pytest",
                "-s",
                "-v",
                "-p",
                "no:cacheprovider",
                "--basetemp",
                # tmp_path_dist_ckpt is <basetemp>/../tmp_dist_ckpt: shared by the ranks.
                str(logdir / "pytest" / "rank{rank}"),
                "--junitxml",
                str(logdir / "rank{rank}.xml"),
                tid,
            ]
            runs, secs = launch(argv, ws, wd.root, env, logdir, args.timeout, args.grace)
            o = test_outcome(runs, logdir, secs)
            o.reason = o.reason.replace(str(tmp), "$TMP")
            results[tid][str(ws)] = o
            _log(f"[{_ws_label(ws)}] {o.status.upper():4} {tid} ({secs:.0f}s) {o.reason}")
        if args.no_examples:
            continue
        for rel in EXAMPLE_FILES:
            name = Path(rel).name
            logdir = tmp / "logs" / f"ws{ws}" / name
            if not (wd.root / rel).is_file():
                o = Outcome("fail", f"{rel} not in the checkout")
            else:
                ckpt_dir = tmp / "ckpt" / f"ws{ws}" / name
                argv = [args.python, rel, "--ckpt_dir", str(ckpt_dir) + "/"]
                runs, secs = launch(
                    argv, ws, wd.root, env, logdir, args.example_timeout, args.grace
                )
                o = example_outcome(runs, secs)
                o.reason = o.reason.replace(str(tmp), "$TMP")
            examples.setdefault(name, {})[str(ws)] = o
            _log(f"[{_ws_label(ws)}] {exit_code_text(o)} {name} ({o.seconds:.0f}s) {o.reason}")

    report = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "target": args.target,
        "nvrx": source,
        "implementation": qs,
        "python": args.python,
        "cpu_shim": shim,
        "world_sizes": args.world_sizes,
        "patches": wd.patches,
        "tests": {i: {ws: asdict(o) for ws, o in r.items()} for i, r in results.items()},
        "examples": {e: {ws: asdict(o) for ws, o in r.items()} for e, r in examples.items()},
        "totals": {},
        "work_dir": str(tmp),
    }
    for ws in map(str, args.world_sizes):
        t_pass = sum(r[ws].status == "pass" for r in results.values())
        e_pass = sum(r[ws].status == "pass" for r in examples.values() if ws in r)
        report["totals"][ws] = {
            "tests_passed": t_pass,
            "tests": len(results),
            "examples_passed": e_pass,
            "examples": len(examples),
        }
    return report


def render(report: dict) -> str:
    wss = [str(w) for w in report["world_sizes"]]
    ids = list(report["tests"])
    short = [i.removeprefix(UNIT_DIR + "/") for i in ids]
    width = max([len(s) for s in short] + [10])
    lines = []
    src = report["nvrx"]
    where = f"{src.get('ref')} ({src.get('commit', '')[:12]})" if "ref" in src else src["path"]
    lines.append(f"NVRx {src.get('nvrx_version')} tests from {where}, target: {report['target']}")
    impl = report["implementation"]
    if impl.get("commit"):
        lines.append(f"quicksave at {impl['ref']} ({impl['commit'][:12]})")
    lines.append(f"implementation module: {impl.get('module_file')}")
    if report.get("cpu_shim"):
        lines.append("CPU shim: on (NVRx's CUDA calls run on the CPU; cpu_shim/sitecustomize.py)")
    lines.append("")
    head = f"{'test id':<{width}}  " + "  ".join(f"{_ws_label(int(w)):>11}" for w in wss)
    lines += [head, "-" * len(head)]
    for i, s in zip(ids, short, strict=True):
        cells = [report["tests"][i].get(w, {}).get("status", "-").upper() for w in wss]
        lines.append(f"{s:<{width}}  " + "  ".join(f"{c:>11}" for c in cells))
    for name, r in report["examples"].items():
        cells = []
        for w in wss:
            o = r.get(w)
            cells.append("-" if o is None else (_codes(o["rank_codes"])))
        lines.append(f"{'example ' + name:<{width}}  " + "  ".join(f"{c:>11}" for c in cells))
    lines.append("")
    tot = report["totals"]
    n = len(ids)
    lines.append(
        "tests: " + ", ".join(f"{tot[w]['tests_passed']}/{n} on {_ws_label(int(w))}" for w in wss)
    )
    if report["examples"]:
        ne = len(report["examples"])
        lines.append(
            "examples (exit 0): "
            + ", ".join(f"{tot[w]['examples_passed']}/{ne} on {_ws_label(int(w))}" for w in wss)
        )
        lines.append(
            "tests + examples: "
            + ", ".join(
                f"{tot[w]['tests_passed'] + tot[w]['examples_passed']}/{n + ne}"
                f" on {_ws_label(int(w))}"
                for w in wss
            )
        )
    fails = []
    for w in wss:
        for i, s in zip(ids, short, strict=True):
            o = report["tests"][i].get(w)
            if o and o["status"] != "pass":
                fails.append(f"  [{_ws_label(int(w))}] {s}: {o['reason']}")
        for name, r in report["examples"].items():
            o = r.get(w)
            if o and o["status"] != "pass":
                fails.append(f"  [{_ws_label(int(w))}] example {name}: {o['reason']}")
    if fails:
        lines += ["", "failures (first error line):", *fails]
    if report.get("work_dir"):
        lines += ["", f"logs and patched copies kept in {report['work_dir']}"]
    return "\n".join(lines)


def render_markdown(report: dict) -> str:
    """The table as Markdown, one first-error line per failing test (for README.md)."""
    wss = [str(w) for w in report["world_sizes"]]
    head = ["test id", *(_ws_label(int(w)) for w in wss), "first error line"]
    rows = [head, ["---"] * len(head)]

    def reasons(r: dict) -> str:
        out = {}
        for w in wss:
            o = r.get(w)
            if o and o["status"] != "pass":
                out.setdefault(re.sub(r"^rank \d+: ", "", o["reason"]), []).append(w)
        if len(out) == 1:
            return next(iter(out)) if out else ""
        return "; ".join(f"{_ws_label(int(ws[0]))}: {why}" for why, ws in out.items())

    for i, r in report["tests"].items():
        cells = [r.get(w, {}).get("status", "-") for w in wss]
        rows.append([f"`{i.removeprefix(UNIT_DIR + '/')}`", *cells, reasons(r)])
    for name, r in report["examples"].items():
        cells = ["-" if r.get(w) is None else _codes(r[w]["rank_codes"]) for w in wss]
        rows.append([f"example `{name}`", *cells, reasons(r)])
    md = ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    tot, n, ne = report["totals"], len(report["tests"]), len(report["examples"])
    md.append("")
    md.append(
        "Tests: "
        + ", ".join(f"{tot[w]['tests_passed']}/{n} on {_ws_label(int(w))}" for w in wss)
        + (
            "; tests + examples: "
            + ", ".join(
                f"{tot[w]['tests_passed'] + tot[w]['examples_passed']}/{n + ne}"
                f" on {_ws_label(int(w))}"
                for w in wss
            )
            if ne
            else ""
        )
        + "."
    )
    return "\n".join(md) + "\n"


def _codes(codes: list) -> str:
    """An example's exit code(s) over its ranks: "exit 0", "exit 1", "exit 0/1", "killed"."""
    if any(c is None for c in codes):
        return "killed"
    return "exit " + "/".join(sorted({str(c) for c in codes}))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Run NVRx's async-checkpoint unit tests and examples against quicksave "
        "(or NVRx itself) on 1 and 2 ranks (gloo, CPU) and print a pass/fail table.",
    )
    p.add_argument("nvrx_root", nargs="?", help="an NVRx checkout or extract (not modified)")
    p.add_argument(
        "--from-mirror",
        metavar="PATH",
        help="a git repository of NVRx; --ref is extracted from it with git archive",
    )
    p.add_argument("--ref", default="v0.7.0-main", help="with --from-mirror (default %(default)s)")
    p.add_argument(
        "--target",
        choices=["quicksave", "nvrx"],
        default="quicksave",
        help="quicksave: rewrite the async_ckpt imports to quicksave.async_api (default); "
        "nvrx: keep them, to run NVRx itself (installed, or pure-Python from the checkout)",
    )
    p.add_argument(
        "--nvrx-cpu-shim",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--target nvrx: run NVRx's CUDA calls on the CPU with cpu_shim/sitecustomize.py "
        "(default: on when torch.cuda.is_available() is False)",
    )
    p.add_argument(
        "--quicksave-ref",
        metavar="REF",
        help="test quicksave's src/ at this git ref of this repository (git archive into the "
        "temp dir, first on PYTHONPATH) instead of the installed/working-tree quicksave",
    )
    p.add_argument(
        "--world-sizes",
        default="1,2",
        type=lambda s: [int(x) for x in s.split(",") if x.strip()],
        help="comma-separated (default %(default)s)",
    )
    p.add_argument("--timeout", type=float, default=240, help="seconds per test run (all ranks)")
    p.add_argument("--example-timeout", type=float, default=900, help="seconds per example run")
    p.add_argument(
        "--grace",
        type=float,
        default=30,
        help="seconds a rank may keep running after another rank failed (default %(default)s)",
    )
    p.add_argument("-k", action="append", help="only test ids containing this (repeatable)")
    p.add_argument("--no-examples", action="store_true", help="skip the two examples")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="also write the table as Markdown")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, patched copies)")
    p.add_argument("--tmpdir", help="where to make the temp dir (default: system temp)")
    p.add_argument("--python", default=sys.executable, help="interpreter for the ranks")
    args = p.parse_args(argv)
    if bool(args.nvrx_root) == bool(args.from_mirror):
        p.error("give exactly one of NVRX_ROOT or --from-mirror PATH")
    if args.quicksave_ref and args.target != "quicksave":
        p.error("--quicksave-ref only applies to --target quicksave")
    if args.nvrx_cpu_shim and args.target != "nvrx":
        p.error("--nvrx-cpu-shim only applies to --target nvrx")
    if not args.world_sizes or min(args.world_sizes) < 1:
        p.error("--world-sizes needs positive integers")
    return args


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # so that launch() kills the ranks it started and run() cleans up


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    try:
        report = run(args)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if args.markdown:
        Path(args.markdown).write_text(render_markdown(report), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
