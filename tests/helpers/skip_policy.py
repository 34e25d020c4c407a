"""The suite cannot go quietly green: a skip fails the run unless its reason is allowed.

``tests/conftest.py`` registers :class:`SkipPolicy`. Two kinds of skip are allowed, each
by the start of its reason, and listed at the end of the run as "not run here":

* :data:`GPU_SKIP`: the test needs a CUDA device (tests/gpu);
* :data:`ROOT_SKIP`: the test needs root, or a privilege or kernel feature this machine
  does not grant (the root-only fault injections of tests/faults: a tmpfs mount,
  ``chattr +i``, dropping capabilities; physical frame numbers in /proc/self/pagemap).

Any other skip (a missing dev dependency, a fixture that could not start its server, a
test that skips to hide a failure) is listed as not allowed and the run exits 1 even if
every test that ran passed. Keep the allowed list this small: a new kind of allowed
skip is a decision, made here, not in a test. ``xfail`` is not a skip (an expectation
written in the test) and is not counted.
"""

from __future__ import annotations

import pytest

GPU_SKIP = "needs a CUDA device"
ROOT_SKIP = "needs root (or a privilege this machine does not grant)"
ALLOWED = (GPU_SKIP, ROOT_SKIP)


def skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    """The reason a skipped report gives (``pytest.skip``'s message, ``skipif``'s
    ``reason``), without pytest's "Skipped: " prefix."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


class SkipPolicy:
    """Records every skip of the session; fails the session on one not allowed."""

    def __init__(self) -> None:
        self.skips: list[tuple[str, str]] = []  # (node id, reason)

    def _record(self, report: pytest.CollectReport | pytest.TestReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skips.append((report.nodeid, skip_reason(report)))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._record(report)  # a module skipped as a whole

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._record(report)

    def not_allowed(self) -> list[tuple[str, str]]:
        return [(n, r) for n, r in self.skips if not r.startswith(ALLOWED)]

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.not_allowed() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:  # noqa: ANN001
        if not self.skips:
            return
        tr = terminalreporter
        tr.section("skip policy (tests/helpers/skip_policy.py)")
        allowed = [(n, r) for n, r in self.skips if r.startswith(ALLOWED)]
        for prefix in ALLOWED:
            ids = [n for n, r in allowed if r.startswith(prefix)]
            if ids:
                tr.write_line(f"not run here ({prefix}): {len(ids)}")
                for node in ids:
                    tr.write_line(f"  {node}")
        bad = self.not_allowed()
        if bad:
            tr.write_line(
                f"{len(bad)} skip(s) not allowed (reason not starting with one of "
                f"{list(ALLOWED)}): the run fails",
                red=True,
                bold=True,
            )
            for node, reason in bad:
                tr.write_line(f"  {node}: {reason}", red=True)
