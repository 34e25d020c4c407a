#!/usr/bin/env python3
"""Run Lightning's own checkpointing tests with QuicksaveCheckpointIO as Lightning's default.

A measuring tool (README.md next to this file). It copies ``tests/tests_pytorch`` and
``pyproject.toml`` (pytest's ini: filterwarnings, strict markers) of a Lightning source
tree into a temporary directory, twice: ``stock/`` as it is and ``quicksave/`` with the
test-side rewrites below in the selected test files. Then it runs the selected tests in
one pytest process per mode:

* ``stock``: Lightning as installed, its default ``TorchCheckpointIO``;
* ``sync``: ``QuicksaveCheckpointIO()`` as the default ``CheckpointIO`` of every strategy
  that was given none, in every process of the run (``side/sitecustomize.py``);
* ``async``: the same with ``QuicksaveCheckpointIO(async_save=True)``.

Rewrites of the ``quicksave/`` copies (and nothing else; the applied diff is
``patches.diff`` in the temp dir), all through ``side/qs_lightning_read.py``:
``torch.load(...)`` and Lightning's ``cloud_io._load`` (imported as ``pl_load``) read a
quicksave checkpoint (a directory) with quicksave's reader, ``Cls.load_from_checkpoint(...)``
goes through ``quicksave.integrations.lightning.load_from_checkpoint`` for one, and
``os.path.isfile(p)`` is also true where a committed quicksave checkpoint is at ``p``; a
regular file goes to the original call unchanged.

Every test that passes stock must pass in both quicksave modes unless ``exclusions.py``
excludes it, for one of the reasons it allows. ``--check`` makes that the exit status.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import importlib.metadata
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from exclusions import EXCLUSIONS, excluded  # noqa: E402

REPO_ROOT = HERE.parents[1]
SIDE = HERE / "side"
MODES = ("stock", "sync", "async")

# The selection: Lightning's checkpointing folder and the other files whose subject is the
# checkpoint (its connector, restoring, the CheckpointIO plugins). Not included:
# checkpointing/test_legacy_checkpoints.py (345 tests that load torch.save files of older
# Lightning releases, downloaded from Lightning's S3 bucket by its CI).
TEST_FILES = [
    "tests/tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py",
    "tests/tests_pytorch/checkpointing/test_model_checkpoint.py",
    "tests/tests_pytorch/checkpointing/test_torch_saving.py",
    "tests/tests_pytorch/checkpointing/test_trainer_checkpoint.py",
    "tests/tests_pytorch/trainer/connectors/test_checkpoint_connector.py",
    "tests/tests_pytorch/models/test_restore.py",
    "tests/tests_pytorch/plugins/test_checkpoint_io_plugin.py",
    "tests/tests_pytorch/plugins/test_async_checkpoint.py",
]
# Lightning's test requirements (requirements/pytorch/test.txt, extra.txt) the selection
# imports: without them files fail to collect or tests are skipped in every mode.
TEST_REQUIREMENTS = {
    "cloudpickle": "cloudpickle",
    "jsonargparse": "jsonargparse",
    "omegaconf": "omegaconf",
    "sklearn": "scikit-learn",
}
# Lightning's addopts without --color=yes and --doctest-modules (no doctests in the
# selection) and --ignore=legacy/checkpoints (no legacy tests).
ADDOPTS = "--strict-markers --disable-pytest-warnings"


class SetupError(Exception):
    """A problem before any test ran (bad path, wrong Lightning, missing requirement...)."""


# ------------------------------------------------------------------ test-side rewrites

READ_IMPORT = "import qs_lightning_read as _qs_read  # lightning_compat"
PL_LOAD_IMPORT = re.compile(
    r"^from lightning\.fabric\.utilities\.cloud_io import _load as pl_load$", re.M
)
LOAD_FROM_CHECKPOINT = re.compile(r"(?<![\w.])([A-Za-z_]\w*)\.load_from_checkpoint\(")


def _p_torch_load(text: str) -> tuple[str, int]:
    return re.subn(r"(?<![\w.])torch\.load\(", "_qs_read.torch_load(", text)


def _p_pl_load(text: str) -> tuple[str, int]:
    return PL_LOAD_IMPORT.subn(
        "from qs_lightning_read import torch_load as pl_load  # lightning_compat", text
    )


def _p_load_from_checkpoint(text: str) -> tuple[str, int]:
    return LOAD_FROM_CHECKPOINT.subn(r"_qs_read.load_from_checkpoint(\1, ", text)


def _p_isfile(text: str) -> tuple[str, int]:
    return re.subn(r"(?<![\w.])os\.path\.isfile\(", "_qs_read.isfile(", text)


PATCHES = [
    ("torch.load -> quicksave reader for directories", _p_torch_load),
    ("os.path.isfile -> also true for a quicksave checkpoint", _p_isfile),
    ("pl_load -> quicksave reader for directories", _p_pl_load),
    ("Cls.load_from_checkpoint -> quicksave's for directories", _p_load_from_checkpoint),
]


def patch_text(text: str) -> tuple[str, dict[str, int]]:
    counts = {}
    for name, fn in PATCHES:
        text, n = fn(text)
        if n:
            counts[name] = n
    if counts:  # the import, before the file's first import (after __future__ ones)
        lines = text.splitlines(True)
        first = next(
            i
            for i, ln in enumerate(lines)
            if re.match(r"(import |from \S+ import )", ln) and not ln.startswith("from __future__")
        )
        lines.insert(first, READ_IMPORT + "\n")
        text = "".join(lines)
    return text, counts


# ------------------------------------------------------------------ source and environment


def extract_from_git(git_dir: Path, ref: str, dest: Path) -> str:
    """``git archive <ref> tests/tests_pytorch pyproject.toml`` into ``dest``; the commit."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(git_dir), "rev-parse", "--verify", f"{ref}^{{commit}}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        data = subprocess.run(
            [
                "git",
                "-C",
                str(git_dir),
                "archive",
                "--format=tar",
                commit,
                "tests/tests_pytorch",
                "pyproject.toml",
            ],
            check=True,
            capture_output=True,
        ).stdout
    except FileNotFoundError as e:
        raise SetupError("git is not installed") from e
    except subprocess.CalledProcessError as e:
        msg = (e.stderr or b"").decode(errors="replace").strip()
        raise SetupError(f"git failed on {git_dir} at {ref!r}: {msg}") from e
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        tar.extractall(dest, filter="data")
    return commit


def pinned_lightning() -> str:
    """The Lightning version of quicksave's dev extra (``lightning==X`` in pyproject.toml)."""
    text = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    m = re.search(r'"lightning==([^"]+)"', text)
    if not m:
        raise SetupError("pyproject.toml pins no lightning==X in its dev extra")
    return m.group(1)


def check_environment(python: str, env: dict[str, str], allow_other: bool) -> str:
    """The Lightning version in ``python``; SetupError if it is not the pinned one (unless
    ``allow_other``) or a test requirement is missing."""
    code = (
        "import importlib.metadata as m, importlib.util as u, json\n"
        f"mods = {sorted(TEST_REQUIREMENTS)!r}\n"
        "print(json.dumps([m.version('lightning'), [x for x in mods if u.find_spec(x) is None],"
        " __import__('quicksave').__file__]))\n"
    )
    out = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SetupError(f"{python}: {out.stderr.strip().splitlines()[-1:]}")
    version, missing, qs_file = json.loads(out.stdout)
    if missing:
        names = " ".join(TEST_REQUIREMENTS[x] for x in missing)
        raise SetupError(
            f"Lightning's test requirements missing in {python}: {names} "
            f"(pip install {names}; README.md)"
        )
    pin = pinned_lightning()
    if version != pin and not allow_other:
        raise SetupError(
            f"lightning {version} is installed, quicksave pins {pin} (pyproject.toml dev "
            "extra); --any-lightning to run anyway"
        )
    if not Path(qs_file).resolve().is_relative_to(REPO_ROOT / "src"):
        raise SetupError(f"quicksave imports from {qs_file}, not from {REPO_ROOT / 'src'}")
    return version


def prepare(source: Path, work: Path) -> tuple[dict[str, dict[str, int]], str]:
    """``work/stock`` and ``work/quicksave`` copies; the rewrite counts and the diff."""
    missing = [p for p in TEST_FILES + ["pyproject.toml"] if not (source / p).is_file()]
    if missing:
        raise SetupError(f"{source} is not a Lightning source tree: missing {', '.join(missing)}")
    for name in ("stock", "quicksave"):
        shutil.copytree(source / "tests" / "tests_pytorch", work / name / "tests" / "tests_pytorch")
        shutil.copy2(source / "pyproject.toml", work / name / "pyproject.toml")
    patches, diffs = {}, []
    for rel in TEST_FILES:
        orig = (source / rel).read_text(encoding="utf-8")
        new, counts = patch_text(orig)
        if counts:
            (work / "quicksave" / rel).write_text(new, encoding="utf-8")
            patches[rel] = counts
            diffs.extend(
                difflib.unified_diff(
                    orig.splitlines(True), new.splitlines(True), f"a/{rel}", f"b/{rel}"
                )
            )
    diff = "".join(diffs)
    (work / "patches.diff").write_text(diff, encoding="utf-8")
    return patches, diff


# ------------------------------------------------------------------ running


def junit_results(path: Path) -> dict[str, tuple[str, str]]:
    """``{test id: (passed|failed|skipped, first message line)}`` from a junit file."""
    results = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        if not cls:  # a file that failed to collect: "<module path> (collection)"
            node = case.find("error")
            text = node.text if node is not None and node.text else ""
            results[name.replace(".", "/") + ".py (collection)"] = ("failed", last_e_line(text))
            continue
        parts = cls.split(".")
        # classname: tests.tests_pytorch.x.test_file[.Class]
        n = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
        test_id = "/".join(parts[: n + 1]) + ".py::" + "::".join(parts[n + 1 :] + [name])
        outcome, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                text = node.get("message") or node.text or ""
                msg = first_line(text)
                break
        results[test_id] = (outcome, msg)
    return results


def last_e_line(text: str) -> str:
    """The last ``E   ...`` line of a pytest traceback (the exception)."""
    lines = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    return lines[-1] if lines else first_line(text)


def first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            line = line.strip()
            return line if len(line) <= 240 else line[:237] + "..."
    return ""


def run_mode(mode: str, work: Path, python: str, env: dict, timeout: float, ks: list[str]) -> dict:
    tree = work / ("stock" if mode == "stock" else "quicksave")
    junit = work / f"junit-{mode}.xml"
    cmd = [
        python,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "qs_lightning_default",
        "-o",
        f"addopts={ADDOPTS}",
        f"--junitxml={junit}",
        "--basetemp",
        str(work / f"tmp-{mode}"),
        *TEST_FILES,
    ]
    for k in ks:
        cmd += ["-k", k]
    env = dict(env, QS_LIGHTNING_MODE=mode)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout
        )
        code = proc.returncode
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code = None
        log = (
            (e.stdout or b"").decode(errors="replace")
            if isinstance(e.stdout, bytes)
            else (e.stdout or "")
        )
    seconds = time.monotonic() - t0
    (work / f"log-{mode}.txt").write_text(log, encoding="utf-8")
    if not junit.is_file():
        tail = "\n".join(log.strip().splitlines()[-15:])
        raise SetupError(
            f"mode {mode}: pytest wrote no report (exit {code}); its output ends:\n{tail}"
        )
    return {"exit": code, "seconds": round(seconds, 1), "results": junit_results(junit)}


# ------------------------------------------------------------------ comparison and report


def compare(runs: dict[str, dict]) -> dict:
    """Per quicksave mode: the stock passes that fail there (excluded or not), and the
    exclusions that pass anyway."""
    stock = runs["stock"]["results"]
    passed_stock = {t for t, (o, _) in stock.items() if o == "passed"}
    out = {}
    for mode in runs:
        if mode == "stock":
            continue
        res = runs[mode]["results"]
        lost = sorted(t for t in passed_stock if res.get(t, ("missing", ""))[0] != "passed")
        out[mode] = {
            "excluded": [t for t in lost if excluded(t)],
            "defects": [
                (t, res.get(t, ("missing", "not run"))[1]) for t in lost if not excluded(t)
            ],
            "excluded_but_passed": sorted(t for t in passed_stock if excluded(t) and t not in lost),
        }
    return out


TEARDOWN = "failed on teardown"  # junit's message when the test passed and teardown failed


def counts(results: dict[str, tuple[str, str]]) -> dict[str, int]:
    c = {"passed": 0, "failed": 0, "skipped": 0, "failed_at_teardown_only": 0}
    for outcome, msg in results.values():
        c[outcome] += 1
        c["failed_at_teardown_only"] += msg.startswith(TEARDOWN)
    return c


def render(report: dict) -> str:
    lines = [
        f"Lightning tests {report['lightning_ref']} ({report['lightning_commit'][:12]}) against "
        f"lightning {report['lightning_installed']}, quicksave {report['quicksave_head']}",
        "",
        "| mode | passed | failed (of which only at teardown) | skipped | seconds "
        "| stock passes lost: excluded | not excluded |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, run in report["runs"].items():
        c = run["counts"]
        cmp = report["comparison"].get(mode)
        ex = len(cmp["excluded"]) if cmp else ""
        de = len(cmp["defects"]) if cmp else ""
        lines.append(
            f"| {mode} | {c['passed']} | {c['failed']} ({c['failed_at_teardown_only']}) "
            f"| {c['skipped']} | {run['seconds']} | {ex} | {de} |"
        )
    for mode, cmp in report["comparison"].items():
        if cmp["defects"]:
            lines += ["", f"{mode}: stock passes that fail, not excluded:"]
            # a test that passed and then failed at teardown: grouped by message
            teardown: dict[str, list[str]] = {}
            for t, msg in cmp["defects"]:
                if msg.startswith(TEARDOWN):
                    teardown.setdefault(re.sub(r"\b(0x[0-9a-f]+|\d{6,})\b", "N", msg), []).append(t)
                else:
                    lines.append(f"  {t}: {msg}")
            for msg, tests in teardown.items():
                lines.append(f"  {len(tests)} tests that passed, then {msg}")
                lines += [f"    {t}" for t in tests] if report.get("verbose") else []
        if cmp["excluded"]:
            lines += ["", f"{mode}: stock passes that fail, excluded (exclusions.py):"]
            for t in cmp["excluded"]:
                reason, why = excluded(t)
                lines.append(f"  {t}: {reason}: {why}")
        if cmp["excluded_but_passed"]:
            lines += ["", f"{mode}: excluded, but passed:"]
            lines += [f"  {t}" for t in cmp["excluded_but_passed"]]
    lines += ["", f"{report['verdict']}"]
    return "\n".join(lines)


def verdict(comparison: dict) -> tuple[bool, str]:
    bad = {m: len(c["defects"]) for m, c in comparison.items() if c["defects"]}
    if bad:
        return False, "FAIL: stock passes lost outside the exclusions: " + ", ".join(
            f"{m} {n}" for m, n in bad.items()
        )
    return True, "OK: every stock pass outside the exclusions passes in " + ", ".join(comparison)


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", nargs="?", type=Path, help="a Lightning source tree (read only)")
    p.add_argument("--from-mirror", type=Path, help="a git repository of Lightning")
    p.add_argument("--ref", default="2.6.5", help="with --from-mirror: the tag or commit")
    p.add_argument("--modes", default="stock,sync,async")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per mode")
    p.add_argument("-k", action="append", default=[], help="pytest -k expression (repeatable)")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--any-lightning", action="store_true", help="run with another Lightning")
    p.add_argument("--check", action="store_true", help="exit 1 unless the verdict is OK")
    p.add_argument("--json", type=Path)
    p.add_argument("--keep", action="store_true", help="keep the temp dir (copies, logs)")
    p.add_argument("-v", "--verbose", action="store_true", help="list every failing test id")
    p.add_argument("--tmpdir", type=Path)
    args = p.parse_args(argv)
    if (args.source is None) == (args.from_mirror is None):
        p.error("give a Lightning source tree or --from-mirror (one of them)")
    modes = args.modes.split(",")
    if "stock" not in modes or not set(modes) <= set(MODES):
        p.error(f"--modes: stock and some of sync, async (got {args.modes})")
    args.modes = [m for m in MODES if m in modes]
    return args


def run(args: argparse.Namespace, work: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(SIDE), str(REPO_ROOT / "src")] + [p for p in [env.get("PYTHONPATH")] if p]
    )
    installed = check_environment(args.python, env, args.any_lightning)
    if args.from_mirror is not None:
        source = work / "lightning"
        commit = extract_from_git(args.from_mirror, args.ref, source)
        ref = args.ref
    else:
        source, ref = args.source.resolve(), str(args.source)
        commit = "(source tree)"
    patches, _ = prepare(source, work)
    runs = {}
    for mode in args.modes:
        print(f"[lightning_compat] running {mode} ...", file=sys.stderr, flush=True)
        r = run_mode(mode, work, args.python, env, args.timeout, args.k)
        runs[mode] = {**r, "counts": counts(r["results"])}
        print(
            f"[lightning_compat] {mode}: {runs[mode]['counts']} in {r['seconds']} s",
            file=sys.stderr,
        )
    comparison = compare(runs)
    ok, text = verdict(comparison)
    head = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return {
        "date": datetime.date.today().isoformat(),
        "lightning_ref": ref,
        "lightning_commit": commit,
        "lightning_installed": installed,
        "quicksave_head": head or "(unknown)",
        "torch": importlib.metadata.version("torch"),
        "patches": patches,
        "exclusions": {k: list(v) for k, v in EXCLUSIONS.items()},
        "runs": runs,
        "comparison": comparison,
        "ok": ok,
        "verdict": text,
        "verbose": args.verbose,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="lightning_compat-", dir=args.tmpdir))
    try:
        report = run(args, tmp)
    except SetupError as e:
        print(f"lightning_compat: {e}", file=sys.stderr)
        return 2
    finally:
        if args.keep:
            print(f"[lightning_compat] kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=list) + "\n", encoding="utf-8")
    return 0 if report["ok"] or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
