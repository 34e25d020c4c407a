"""Time-based save decisions that every rank takes alike, without stalling a step.

With several ranks a time-based policy (``EveryNSeconds``) can answer differently on
each rank: their clocks and step times differ. Ranks that disagree on whether to save
deadlock in the save's collectives. :class:`IntervalAgreement` makes them agree while
keeping the collective off the training step's critical path:

* every ``check_steps`` steps (the *check steps*: the first ``save`` call, then each
  step that reaches the next multiple of ``check_steps``) each rank launches one
  asynchronous all-reduce (MAX) of one integer, "my policy says a save is due";
* the result is consumed at the next check step, a step every rank knows in advance.
  The all-reduce had ``check_steps`` steps to finish, so waiting for it there costs
  nothing in the normal case;
* if any rank voted "due", every rank saves at that same check step; otherwise none
  does. Agreement holds by construction: every rank sees the same reduced value at
  the same step.

A save therefore comes at most ``2 * check_steps`` steps after the interval ran out.
Forced saves (``save(step, force=True)``) and ``last_step`` are decisions every rank
makes alike without talking (the caller passes the same ``force`` and the same steps on
every rank), so they never wait for a vote; a vote still in flight when one happens is
ignored (the forced save restarted the interval). Step-based policies need none of this
and cost zero collectives.

The manager's agreements live here: :func:`agree_any_due` (the vote) and
:func:`agree_reports` (the outcome of saves, at a call every rank makes alike: see
``failures.py``); both talk through ``quicksave.ranks.collectives``. At a due ``save()``
the outcome's integers ride on the save's own vote instead (:class:`OutcomeVote`, the
engine's ``plan_vote.Rider``), so that a steady save costs one small all-reduce.
:class:`IntervalAgreement` itself is a pure state machine over an injected vote function
(tests drive it with a fake one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist

from quicksave.errors import CheckpointError
from quicksave.manager.failures import FailureLedger, Report
from quicksave.manager.policies import EveryNSeconds
from quicksave.ranks.collectives import (
    PendingInts,
    all_gather_object,
    all_reduce_ints,
    all_reduce_ints_async,
)


class Vote(Protocol):
    """A launched vote; ``wait()`` returns True if any rank voted "due"."""

    def wait(self) -> bool:
        """Block until every rank's vote is in (normally done already); the result."""
        ...


VoteFn = Callable[[bool], Vote]


@dataclass
class _AllReduceVote:
    """An all-reduce in flight (``collectives.all_reduce_ints_async``)."""

    pending: PendingInts

    def wait(self) -> bool:
        return bool(self.pending.wait()[0])


def agree_any_due(due: bool, group: dist.ProcessGroup | None) -> Vote:
    """Launch this rank's vote: one asynchronous all-reduce (MAX) of one integer.

    Every rank of ``group`` must call it at the same point of its call sequence (the
    check steps of :class:`IntervalAgreement` guarantee that).

    Args:
        due: this rank's policy says a save is due.
        group: the checkpoint process group (gloo, so the tensor stays on the CPU).

    Returns:
        A :class:`Vote` whose ``wait()`` is True if any rank voted ``due``.

    Example::

        vote = agree_any_due(policy_says_due, group)
        ...  # some training steps later, on every rank
        if vote.wait():
            save()
    """
    return _AllReduceVote(all_reduce_ints_async([int(bool(due))], "max", group))


class OutcomeVote:
    """The outcome of earlier saves, riding on a save's vote (``plan_vote.Rider``).

    Each round of the engine's save vote carries this rank's two integers of
    :func:`agree_reports` (read from ``ledger`` then); the agreed maxima wait here for
    the settling call that ends the ``save()`` (:meth:`take`), which then needs no
    all-reduce of its own. Every rank's save either votes and returns, or raises on
    every rank alike (the vote does not hand its maxima over then), so every rank takes
    the same branch at the settling call. A failure a rank meets after the vote (its
    own staging, say) is settled at the next agreement point.

    Used by the training thread only (the engine votes on it, under the saver's lock).
    """

    def __init__(self, ledger: FailureLedger) -> None:
        self._ledger = ledger
        self._agreed: tuple[int, ...] | None = None

    def values(self) -> tuple[int, int]:
        """ "Some failure to tell" (0/1) and the newest step this rank saw committed."""
        return _flags(self._ledger.report())

    def agreed(self, maxima: tuple[int, ...]) -> None:
        """The ranks' maxima of :meth:`values` (the same on every rank)."""
        self._agreed = maxima

    def take(self) -> tuple[int, ...] | None:
        """The maxima agreed since the last ``take()``, or None; forgets them."""
        agreed, self._agreed = self._agreed, None
        return agreed


def _flags(report: Report) -> tuple[int, int]:
    return (1 if report.needs_exchange else 0, report.newest_committed)


def agree_reports(
    report: Report,
    group: dist.ProcessGroup | None,
    rank: int,
    voted: tuple[int, ...] | None = None,
) -> list[Report]:
    """Every rank's :class:`~quicksave.manager.failures.Report`, the same list (in rank
    order) on every rank of ``group``.

    One all-reduce (MAX) of two integers, "some rank has failures to tell"
    and the newest step any rank saw committed (``voted``: those maxima, agreed already
    on a save's vote, :class:`OutcomeVote`: no all-reduce); only when the first is set,
    one ``all_gather_object`` of the reports. Every rank must call it at the same point
    of its call sequence (a due ``save()``, ``wait()``, ``load()``, ``close()``), with
    ``voted`` given on every rank or on none.

    Raises:
        CheckpointError: the collective failed (a rank crashed, or stopped making the
            same calls: see its log), naming ``rank``.

    Example::

        reports = agree_reports(ledger.report(), group, rank)
        verdict = ledger.settle(reports)  # the same on every rank
    """
    try:
        agreed = voted if voted is not None else all_reduce_ints(_flags(report), "max", group)
        any_failures, newest = agreed
        if not any_failures:
            return [Report(newest_committed=newest)]
        reports: list[Report | None] = all_gather_object(report, group)
    except (RuntimeError, ValueError) as e:
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(
            "the ranks could not agree on the outcome of their saves (did a rank crash, "
            f"or stop calling save()/wait()/close() with the others? see its log): {cause}",
            rank=rank,
        ) from e
    return [r for r in reports if r is not None]


def needs_agreement(policy: object) -> bool:
    """Whether ``policy``'s answers can differ between ranks, so ranks must agree.

    ``EveryNSeconds`` does (it reads a clock); step-based policies do not. A custom
    policy opts in (or out) with a class attribute ``needs_agreement = True``.

    Example::

        needs_agreement(EveryNSeconds(60))  # True
        needs_agreement(EveryNSteps(100))   # False
    """
    declared = getattr(policy, "needs_agreement", None)
    if isinstance(declared, bool):
        return declared
    return isinstance(policy, EveryNSeconds)


class IntervalAgreement:
    """Turns each rank's "a save is due" into one decision all ranks share.

    Call order (every rank, the same ``step`` sequence): :meth:`decide` once per
    ``save(step)`` call, with the policy's local answer. Only check steps launch a vote
    (one collective, asynchronous) and consume the previous one; other steps do nothing.

    Args:
        check_steps: steps between two check steps (>= 1).
        vote: launches one vote and returns it (:func:`agree_any_due` bound to the
            checkpoint group; a fake in tests).

    Raises:
        CheckpointError: ``check_steps`` is not an integer >= 1.

    Example::

        agreement = IntervalAgreement(10, lambda due: agree_any_due(due, group))
        for step in range(1, steps + 1):
            train_step()
            if agreement.decide(step, policy.should_save(step, now(), False), forced=False):
                save(step)
    """

    def __init__(self, check_steps: int, vote: VoteFn) -> None:
        if isinstance(check_steps, bool) or not isinstance(check_steps, int) or check_steps < 1:
            raise CheckpointError(
                f"interval_check_steps must be an integer >= 1, got {check_steps!r}"
            )
        self.check_steps = check_steps
        self._vote = vote
        self._pending: Vote | None = None
        self._pending_void = False  # a forced save came after the vote was cast
        self._last_check: int | None = None
        self.votes_launched = 0

    @property
    def next_check(self) -> int | None:
        """The next check step (None before the first call: that call is one)."""
        if self._last_check is None:
            return None
        return (self._last_check // self.check_steps + 1) * self.check_steps

    @property
    def vote_in_flight(self) -> bool:
        """A vote was launched and not consumed yet."""
        return self._pending is not None

    def is_check_step(self, step: int) -> bool:
        """Whether ``decide(step, ...)`` launches a vote (and consumes the previous one).

        The first call, each step at or past the next multiple of ``check_steps``, and
        a step lower than the last check step (training went back, e.g. after a load)
        are check steps; every rank sees the same steps, so every rank agrees on them.
        """
        nxt = self.next_check
        if nxt is None or self._last_check is None:
            return True
        return step >= nxt or step < self._last_check

    def decide(self, step: int, due: bool, forced: bool) -> bool:
        """The decision every rank takes for ``step``.

        Args:
            step: the step of this ``save`` call (the same sequence on every rank).
            due: this rank's policy says a save is due (its local, clock-based answer).
            forced: a save every rank makes alike (``force=True``, ``last_step``).

        Returns:
            True if this step saves: ``forced``, or a check step whose consumed vote
            had some rank say "due".
        """
        if not self.is_check_step(step):
            if forced and self._pending is not None:
                self._pending_void = True  # this save restarts the interval
            return forced
        agreed = False
        if self._pending is not None:
            # Launched one check step ago, so normally complete: no stall here.
            result = self._pending.wait()
            agreed = result and not self._pending_void
        saving = forced or agreed
        self._pending = self._vote(bool(due) and not saving)
        self._pending_void = False
        self._last_check = step
        self.votes_launched += 1
        return saving

    def __repr__(self) -> str:
        return (
            f"IntervalAgreement(check_steps={self.check_steps}, next_check={self.next_check}, "
            f"vote_in_flight={self.vote_in_flight})"
        )
