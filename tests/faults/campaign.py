#!/usr/bin/env python
"""Run quicksave's fault-injection campaigns and print their sizes and outcomes.

Usage (from the repository root)::

    .venv/bin/python tests/faults/campaign.py --scale 10
    .venv/bin/python tests/faults/campaign.py --scale 3 --only sigkill,hung_worker --seed 7

``--scale N`` multiplies every campaign's size (scale 1 is the fast subset that
``pytest -q`` runs). The tests in this folder run the same campaigns: at scale 1 by
default, and at ``QUICKSAVE_CAMPAIGN_SCALE`` (default 10) with ``-m campaign``.
Docs and measured numbers: docs/RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import campaign_bytes  # noqa: E402
import campaign_crash  # noqa: E402
import campaign_sharing  # noqa: E402
import campaign_space  # noqa: E402
import faultkit  # noqa: E402
from faultkit import Result  # noqa: E402
from forkserver import ForkServer  # noqa: E402

DEFAULT_SCALE = 10


@dataclass(frozen=True)
class Campaign:
    """One campaign: its function, its size at scale 1, and what it needs.

    ``run(size, rng, server, work)``; ``server`` is None unless ``forks``.
    ``unavailable(work)`` says why this machine cannot run it (then it is skipped)."""

    name: str
    run: Callable[[Any, random.Random, ForkServer | None, Path], Result]
    base: float
    unit: str
    forks: bool
    unavailable: Callable[[Path], str | None] = lambda work: None

    def size(self, scale: float) -> Any:
        n = self.base * scale
        return n if self.unit == "seconds" else max(1, int(round(n)))


def _no_tmpfs(work: Path) -> str | None:
    try:
        with faultkit.tmpfs("1m"):
            return None
    except RuntimeError as e:
        return str(e)


CAMPAIGNS: dict[str, Campaign] = {
    c.name: c
    for c in (
        Campaign(
            "corruption",
            lambda n, rng, s, w: campaign_bytes.corruption(n, rng, w),
            100,
            "trials",
            False,
        ),
        Campaign("sigkill", campaign_crash.kills, 2, "kills per target", True),
        Campaign(
            "full_disk",
            lambda n, rng, s, w: campaign_space.full_disk(n, rng, w),
            3,
            "cycles",
            False,
            _no_tmpfs,
        ),
        Campaign(
            "permission_flips_chmod",
            lambda n, rng, s, w: campaign_space.permission_flips(n, rng, s, w, how="chmod"),
            2,
            "flips",
            True,
            lambda w: faultkit.can_drop_capabilities(),
        ),
        Campaign(
            "permission_flips_chattr",
            lambda n, rng, s, w: campaign_space.permission_flips(n, rng, s, w, how="chattr"),
            2,
            "flips",
            True,
            faultkit.can_chattr,
        ),
        Campaign("two_jobs", campaign_sharing.two_jobs, 3.0, "seconds", True),
        Campaign("second_writer", campaign_sharing.second_writer, 3, "attempts", True),
        Campaign(
            "readers_keep1",
            lambda n, rng, s, w: campaign_sharing.readers_vs_retention(n, rng, s, w, keep=1),
            3.0,
            "seconds",
            True,
        ),
        Campaign(
            "readers_keep2",
            lambda n, rng, s, w: campaign_sharing.readers_vs_retention(n, rng, s, w, keep=2),
            3.0,
            "seconds",
            True,
        ),
        Campaign(
            "torn_newest",
            lambda n, rng, s, w: campaign_bytes.torn_newest(n, rng, w),
            6,
            "trials",
            False,
        ),
        Campaign(
            "hung_worker",
            lambda n, rng, s, w: campaign_crash.hung_worker(n, rng, w),
            1,
            "trials",
            False,
        ),
    )
}


def env_scale() -> float:
    """The campaign scale of ``pytest -m campaign``: ``QUICKSAVE_CAMPAIGN_SCALE``."""
    return float(os.environ.get("QUICKSAVE_CAMPAIGN_SCALE", DEFAULT_SCALE))


def scales() -> list[Any]:
    """``pytest.mark.parametrize`` values of every campaign test: ``fast`` (scale 1, in
    ``pytest -q``) and ``campaign`` (``QUICKSAVE_CAMPAIGN_SCALE``; marked ``slow`` and
    ``campaign``, so deselected unless asked for)."""
    import pytest

    return [
        pytest.param(1.0, id="fast"),
        pytest.param(env_scale(), id="campaign", marks=[pytest.mark.slow, pytest.mark.campaign]),
    ]


def check(name: str, scale: float, work: Path, server: ForkServer | None = None) -> Result:
    """Run a campaign for a test: skip (with the reason) where this machine cannot
    inject the fault, fail on any violation, else return the Result."""
    import pytest

    out = run_campaign(name, scale, seed=int(os.environ.get("QUICKSAVE_CAMPAIGN_SEED", 1)),
                       work=work, server=server)  # fmt: skip
    if isinstance(out, str):
        from helpers.skip_policy import ROOT_SKIP

        pytest.skip(f"{ROOT_SKIP}: {name}: {out}")
    out.check()
    return out


def run_campaign(
    name: str, scale: float, seed: int, work: Path, server: ForkServer | None
) -> Result | str:
    """Run one campaign in a fresh directory under ``work``: its Result, or why it
    cannot run on this machine."""
    c = CAMPAIGNS[name]
    work = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=work))
    reason = c.unavailable(work)
    if reason is not None:
        return reason
    try:
        res = c.run(c.size(scale), random.Random(seed), server if c.forks else None, work)
    except Exception as e:  # noqa: BLE001 - a crashed campaign is a failed one, not an abort
        res = Result(name)
        res.violate("campaign_crashed", faultkit.describe(e))
    finally:
        if server is not None:
            left = server.kill_all()  # a campaign that failed half-way leaves none running
            if left:
                print(f"[{name}] killed children still running: {left}")
    res.size.setdefault(c.unit, c.size(scale))
    res.notes.insert(0, f"seed {seed}, scale {scale:g}")
    return res


def _commit() -> str:
    """HEAD of the checkout this file is in (and whether src/ differs from it)."""
    p = subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, cwd=HERE
    )
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", "src"],
        capture_output=True,
        text=True,
        cwd=HERE,
    ).stdout.strip()
    if p.returncode != 0:
        return "unknown (not a git checkout: pass --commit)"
    return p.stdout.strip() + (" (src/ modified)" if dirty else "")


def _headline(res: Result) -> str:
    """The outcome columns of the table: failures first, then what happened."""
    bad = {k: v for k, v in res.outcomes.items() if k in res.must_be_zero and v}
    return ", ".join(f"{k}={v}" for k, v in sorted(bad.items())) or "none"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=DEFAULT_SCALE)
    parser.add_argument("--only", default="", help="comma-separated campaign names")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--commit",
        help="the commit under test, when this is not a git checkout (e.g. a git archive)",
    )
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(CAMPAIGNS)
    unknown = [n for n in names if n not in CAMPAIGNS]
    if unknown:
        parser.error(f"unknown campaigns {unknown}; known: {', '.join(CAMPAIGNS)}")
    commit = args.commit or _commit()
    print(f"quicksave fault campaigns: scale {args.scale:g}, seed {args.seed}, commit {commit}")
    print(f"machine: {os.cpu_count()} cores, {platform.platform()}")
    work = Path(tempfile.mkdtemp(prefix="qs-campaigns-"))
    server = ForkServer() if any(CAMPAIGNS[n].forks for n in names) else None
    results: list[tuple[str, Result | str]] = []
    t0 = time.monotonic()
    try:
        for name in names:
            out = run_campaign(name, args.scale, args.seed, work, server)
            results.append((name, out))
            print(out.summary() if isinstance(out, Result) else f"[{name}] SKIPPED: {out}")
            print(flush=True)
    finally:
        if server is not None:
            server.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{'campaign':<26} {'size':<34} {'time':>7}  failures")
    failed = 0
    for name, out in results:
        if isinstance(out, str):
            print(f"{name:<26} {'skipped: ' + out[:60]}")
            continue
        size = ", ".join(f"{k}={v}" for k, v in out.size.items() if "[" not in k)
        failures = out.failures()
        failed += bool(failures)
        print(f"{name:<26} {size[:34]:<34} {out.seconds:>6.1f}s  {_headline(out)}")
        for v in out.violations[:5]:
            print(f"{'':<26} {v[:150]}")
    print(f"total {time.monotonic() - t0:.0f} s; {failed} campaign(s) with failures")
    if args.json:
        payload = {
            "commit": commit,
            "scale": args.scale,
            "seed": args.seed,
            "results": {n: out if isinstance(out, str) else asdict(out) for n, out in results},
        }
        args.json.write_text(json.dumps(payload, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
