"""What the manager does when a save fails, decided alike on every rank.

A save can fail at the call that makes it (collecting, planning, a synchronous write) or
later, in the background (the worker's write, upload or commit). Each rank learns of a
background failure when it polls its own writer, and ranks poll at different moments: a
rank that raised as soon as it saw one would leave the others waiting in the next
collective (a gloo "Connection closed by peer"). So failures are not acted on where
they are seen. Each rank notes them in its :class:`FailureLedger`, and they are
*settled* at an agreement point, a call every rank makes at the same moment of its call
sequence (a ``save()`` that is due, ``wait()``, ``load()``, ``close()``; with one rank,
every call). There the ranks' :class:`Report` s are combined (``agree_reports`` in
``interval.py``, the manager's one collective module) and :meth:`FailureLedger.settle`,
a pure function of the combined reports and of what was settled before, gives the same
:class:`Verdict` on every rank: which saves failed (each once, with the lowest rank's
error), how many failed in a row, and whether the caller must raise.

The policy (``CheckpointConfig.on_save_error``):

* ``"raise"`` (default): a failed save raises its ``CheckpointError`` on every rank, at
  the settling call;
* ``"log"``: it is logged and counted, training goes on, later saves are made as usual;
  after ``max_consecutive_failures`` failed saves with no commit in between, the next
  settling call raises on every rank (a job must not run on for long without
  checkpoints).

An ``IncompatibleStateError`` (the state itself cannot be saved: a program error, not an
outage) raises under either policy.

Pure: no I/O and no collectives here (the manager passes in what its writer reported
and what the ranks agreed).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from quicksave.commit import final_name, is_temp_name
from quicksave.errors import CheckpointError, IncompatibleStateError
from quicksave.manager.records import SaveRecord

logger = logging.getLogger("quicksave")

ON_SAVE_ERROR = ("raise", "log")

Key = tuple[int | None, str]  # (step, kind) of one save; step None: not known
_STEP_NAME = re.compile(r"^(export-)?step-(\d+)$")


@dataclass(frozen=True)
class Failure:
    """One failed save as one rank saw it (pickled across ranks: ``CheckpointError``
    keeps its fields when pickled)."""

    key: Key
    error: CheckpointError


@dataclass(frozen=True)
class Report:
    """What one rank brings to an agreement point.

    Attributes:
        failures: failed saves this rank saw that were not settled yet.
        newest_committed: the newest step this rank saw committed (-1: none).
    """

    failures: tuple[Failure, ...] = ()
    newest_committed: int = -1

    @property
    def needs_exchange(self) -> bool:
        """More to tell than one all-reduce carries (the failures themselves)."""
        return bool(self.failures)


@dataclass(frozen=True)
class Verdict:
    """What every rank does at an agreement point (the same on every rank).

    Attributes:
        failures: the saves settled as failed now, oldest first, each with the error of
            the lowest rank that reported it.
        consecutive: failed saves since the newest commit (after this settling).
        total: failed saves since the manager was built.
        raise_error: the error every rank raises now, or None (nothing failed, or the
            ``"log"`` policy is within its limit).
    """

    failures: tuple[Failure, ...] = ()
    consecutive: int = 0
    total: int = 0
    raise_error: CheckpointError | None = None


@dataclass
class FailureLedger:
    """One rank's notes of save outcomes, settled alike on every rank.

    Call order: :meth:`committed` / :meth:`failed` as outcomes arrive (any time, no
    communication) → :meth:`report` at an agreement point → the ranks' reports combined
    (in rank order) → :meth:`settle` with them → act on the :class:`Verdict`.
    :meth:`attempting` when a save of a step starts, so that a step saved again after a
    failure is judged afresh.

    Args:
        on_save_error: ``"raise"`` or ``"log"`` (see the module docstring).
        max_consecutive_failures: with ``"log"``, raise once this many saves in a row
            have failed.
        folder: named in the errors this ledger makes.

    Example::

        ledger = FailureLedger("log", 3, "s3://bucket/run")
        ledger.failed((10, "full"), CheckpointError("upload failed"))
        verdict = ledger.settle([ledger.report()])  # one rank
        verdict.consecutive, verdict.raise_error  # 1, None
    """

    on_save_error: str = "raise"
    max_consecutive_failures: int = 3
    folder: str | None = None
    total: int = 0
    _pending: list[Failure] = field(default_factory=list)
    _seen_committed: int = -1  # newest step this rank saw committed
    _newest_committed: int = -1  # newest committed step every rank agreed on
    _settled: set[Key] = field(default_factory=set)
    _failed_since_commit: list[Key] = field(default_factory=list)

    @property
    def consecutive(self) -> int:
        """Failed saves settled since the newest agreed commit."""
        return len(self._failed_since_commit)

    def attempting(self, key: Key) -> None:
        """A save of ``key`` starts (on every rank alike): judge its outcome afresh."""
        self._settled.discard(key)

    def committed(self, step: int) -> None:
        """This rank saw the save of ``step`` commit."""
        self._seen_committed = max(self._seen_committed, step)

    def failed(self, key: Key, error: CheckpointError) -> None:
        """This rank saw the save of ``key`` fail with ``error``."""
        if key not in self._settled and not any(f.key == key for f in self._pending):
            self._pending.append(Failure(key, error))

    def note(
        self, finished: Sequence[tuple[int, SaveRecord]], errors: Sequence[CheckpointError]
    ) -> None:
        """What a poll of the writer returned: each save's final record, and the errors
        (matched to their saves by path; a failed record without one gets a generic
        error, an error without a record counts for the save its path names)."""
        failed = {(r.step, r.kind): r for _, r in finished if r.status == "failed"}
        for _, record in finished:
            if record.status == "committed" and record.kind == "full":
                self.committed(record.step)
        for error in errors:
            key = step_of(error.path)
            if key not in failed and key[0] is not None:
                key = next((k for k in failed if k[0] == key[0]), key)
            failed.pop(key, None)
            self.failed(key, error)
        for key, record in failed.items():
            self.failed(
                key,
                CheckpointError(
                    f"the checkpoint of step {record.step} was not committed (see this "
                    "rank's log for why)",
                    path=record.path,
                ),
            )

    def report(self) -> Report:
        """This rank's report for the next agreement point."""
        return Report(tuple(self._pending), self._seen_committed)

    def settle(self, reports: Sequence[Report]) -> Verdict:
        """Combine every rank's report (the same list, in rank order, on every rank)
        into the verdict, and remember what was settled.

        Returns:
            The :class:`Verdict`; ``raise_error`` is set when every rank must raise.
        """
        newest = max([self._newest_committed, *(r.newest_committed for r in reports)])
        if newest > self._newest_committed:
            self._newest_committed = newest
            self._failed_since_commit = [
                k for k in self._failed_since_commit if k[0] is not None and k[0] > newest
            ]
        new: dict[Key, Failure] = {}
        for report in reports:  # rank order: the lowest rank's error wins
            for failure in report.failures:
                if failure.key not in self._settled and failure.key not in new:
                    new[failure.key] = failure
        settled = tuple(sorted(new.values(), key=lambda f: (f.key[0] is None, f.key[0] or 0)))
        for failure in settled:
            self._settled.add(failure.key)
            self.total += 1
            step = failure.key[0]
            if step is None or step > self._newest_committed:
                self._failed_since_commit.append(failure.key)
        self._pending = [f for f in self._pending if f.key not in self._settled]
        return Verdict(settled, self.consecutive, self.total, self._to_raise(settled))

    def _to_raise(self, settled: tuple[Failure, ...]) -> CheckpointError | None:
        if not settled:
            return None
        errors = [f.error for f in settled]
        program = [e for e in errors if isinstance(e, IncompatibleStateError)]
        if program:
            return combined(program)
        if self.on_save_error == "raise":
            return combined(errors)
        if self.consecutive < self.max_consecutive_failures:
            return None
        last = errors[-1]
        in_order = sorted(self._failed_since_commit, key=lambda k: (k[0] is None, k[0] or 0))
        steps = ", ".join(_name(k) for k in in_order)
        since = (
            f"step {self._newest_committed}"
            if self._newest_committed >= 0
            else "none since this job started"
        )
        return CheckpointError(
            f"{self.consecutive} saves in a row failed ({steps}; "
            f"max_consecutive_failures={self.max_consecutive_failures}); the last one: "
            f"{last.message}. Training stops here rather than run on without checkpoints: "
            f"fix the storage and resume (newest committed checkpoint: {since}), or raise "
            "CheckpointConfig.max_consecutive_failures",
            path=last.path or self.folder,
            fqn=last.fqn,
            rank=last.rank,
        )


def log_verdict(verdict: Verdict, policy: str, coordinator: bool) -> None:
    """The log lines of a settled verdict that does not raise (``"log"`` policy): one
    ERROR per failed save on the coordinator (the others: INFO; every rank settled the
    same failures)."""
    if verdict.raise_error is not None:
        return
    level = logging.ERROR if coordinator else logging.INFO
    for failure in verdict.failures:
        logger.log(
            level,
            "quicksave: %s failed (on_save_error=%r: training goes on; %d in a row, %d in all): %s",
            _what(failure.key),
            policy,
            verdict.consecutive,
            verdict.total,
            failure.error,
        )


def combined(errors: Sequence[CheckpointError]) -> CheckpointError:
    """The failures settled at once as one error (the first one's type), naming every
    failed save: none may reach the trainer as a log line only."""
    if len(errors) == 1:
        return errors[0]
    first = errors[0]
    names = ", ".join(checkpoint_name(e.path) for e in errors)
    others = "; ".join(str(e) for e in errors[1:])
    error = type(first)(
        f"{len(errors)} checkpoints were not committed ({names}): {first.message} (also: {others})",
        path=first.path,
        fqn=first.fqn,
        rank=first.rank,
    )
    error.__cause__ = first
    return error


def checkpoint_name(path: str | None) -> str:
    """``step-12`` for an error's path: the checkpoint, its temporary, or a file in it."""
    if path is None:
        return "?"
    parts = [p for p in path.replace("\\", "/").split("/") if p]
    for part in reversed(parts[-2:]):
        if is_temp_name(part):
            return final_name(part)
        if _STEP_NAME.match(part):
            return part
    return parts[-1] if parts else "?"


def step_of(path: str | None) -> Key:
    """The (step, kind) of the save an error's path belongs to; (None, "full") if the
    path names no checkpoint of a manager's folder."""
    match = _STEP_NAME.match(checkpoint_name(path))
    if match is None:
        return (None, "full")
    return (int(match.group(2)), "export" if match.group(1) else "full")


def _name(key: Key) -> str:
    step, kind = key
    if step is None:
        return "a save"
    return f"step {step}" if kind != "export" else f"the export of step {step}"


def _what(key: Key) -> str:
    step, kind = key
    if step is None:
        return "a save"
    return f"the save of step {step}" if kind != "export" else f"the export of step {step}"
