"""One measurement of a benchmark in a fresh interpreter (:func:`run_in_fresh_process`):
the parent writes the run's spec as JSON, ``python -c CHILD spec_path`` runs it and
writes its result JSON, the parent reads it back. Used by ``quicksave bench --training``
and the training part of ``quicksave bench --storage``, so that memory, threads and
worker processes do not leak from one run into the next."""

from __future__ import annotations

import json
import subprocess
import sys
import traceback
from collections.abc import Callable
from typing import Any


def run_in_fresh_process(
    child: str,
    spec: dict[str, Any],
    spec_path: str,
    timeout_s: float,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter: ``python -c child spec_path``, where
    ``spec`` (written to ``spec_path``) names the JSON file the child writes its result
    to (``spec["result"]``). Returns that result, or ``{"failed": why}`` with the tail of
    the child's stderr when it wrote none (crashed, or ran past ``timeout_s``). ``env``:
    the child's environment (default: this process's)."""
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", child, spec_path],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
        tail = (proc.stderr or "")[-2000:]
    except subprocess.TimeoutExpired:
        proc, tail = None, f"timed out after {timeout_s:.0f} s"
    try:
        with open(spec["result"]) as f:
            return json.load(f)
    except (OSError, ValueError):
        code = "" if proc is None else f" (exit code {proc.returncode})"
        return {"failed": f"no result{code}: {tail.strip()}"}


def child_entry(argv: list[str], run: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """The child's side of :func:`run_in_fresh_process`: read the spec at ``argv[0]``,
    ``run(spec)``, write its result — or the failure, one line, with the traceback's
    tail — to ``spec["result"]``. Returns the exit code (0: it ran)."""
    with open(argv[0]) as f:
        spec = json.load(f)
    try:
        result = run(spec)
    except Exception as e:  # noqa: BLE001 - reported to the parent in the result
        text = f"{type(e).__name__}: {e}".replace("\n", " ")
        result = {"failed": text if len(text) <= 400 else text[:399] + "…"}
        if "method" in spec:
            result["method"] = spec["method"]
        result["traceback"] = traceback.format_exc()[-4000:]
    with open(spec["result"], "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    return 0 if "failed" not in result else 1
