"""Small policy objects the manager applies: when to save, and which checkpoints to delete.

They do no I/O and talk to no other rank, so they can be unit-tested with plain numbers.
The manager owns the clock (``now``) and the list of committed steps and passes them in.

Multi-rank note: a time-based decision can differ between ranks (their clocks and step
times differ), and ranks that disagree on whether to save deadlock in the save's
collectives. The manager therefore only feeds a policy's answer into
``CheckpointManager._agree``, the one place where ranks will reach agreement.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from quicksave.errors import CheckpointError


@runtime_checkable
class SavePolicy(Protocol):
    """Decides whether ``save(step)`` writes a checkpoint.

    Call order (the manager's): ``should_save`` on every ``save(step)``; ``saved`` after a
    checkpoint of ``step`` was written (so time-based policies restart their interval).
    """

    def should_save(self, step: int, now: float, force: bool) -> bool:
        """True if a checkpoint of ``step`` should be written at time ``now``."""
        ...

    def saved(self, step: int, now: float) -> None:
        """Note that a checkpoint of ``step`` was written at time ``now``."""
        ...


@runtime_checkable
class RetentionPolicy(Protocol):
    """Chooses which committed checkpoints to delete."""

    def to_delete(self, committed_steps: list[int], in_flight: set[int]) -> list[int]:
        """The steps among ``committed_steps`` to delete, oldest first.

        Implementations must never return the newest committed step nor a step in
        ``in_flight`` (being written, or just written by the caller).
        """
        ...


class EveryNSteps:
    """Save when ``step`` is a multiple of ``n`` (or when forced).

    Example::

        policy = EveryNSteps(100)
        policy.should_save(200, now=0.0, force=False)  # True
        policy.should_save(250, now=0.0, force=False)  # False
    """

    def __init__(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise CheckpointError(f"EveryNSteps needs a whole number of steps >= 1, got {n!r}")
        self.n = n

    def should_save(self, step: int, now: float, force: bool) -> bool:
        return force or step % self.n == 0

    def saved(self, step: int, now: float) -> None:
        pass  # a step-based decision has no memory

    def __repr__(self) -> str:
        return f"EveryNSteps({self.n})"


class EveryNSeconds:
    """Save when at least ``seconds`` have passed since the last save (or since ``start``,
    or since the first ``should_save`` call if ``start`` is None), or when forced.

    The policy only remembers the time of the last save; ``now`` comes from the caller's
    clock (monotonic seconds), so tests drive it without sleeping.

    Example::

        policy = EveryNSeconds(60.0, start=0.0)
        policy.should_save(1, now=30.0, force=False)  # False
        policy.should_save(2, now=61.0, force=False)  # True
    """

    def __init__(self, seconds: float, *, start: float | None = None) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise CheckpointError(
                f"EveryNSeconds needs a positive number of seconds, got {seconds!r}"
            )
        self.seconds = float(seconds)
        self.last: float | None = start

    def should_save(self, step: int, now: float, force: bool) -> bool:
        if self.last is None:
            self.last = now  # the interval starts when training does, not at the epoch
        return force or now - self.last >= self.seconds

    def saved(self, step: int, now: float) -> None:
        self.last = now

    def __repr__(self) -> str:
        return f"EveryNSeconds({self.seconds})"


class KeepLatestK:
    """Keep the ``k`` newest committed checkpoints (``k == 0``: keep everything).

    The newest committed checkpoint and anything in flight are never deleted, whatever
    ``k`` is; in-flight steps do not take one of the ``k`` places (they are not committed).

    Example::

        KeepLatestK(2).to_delete([10, 20, 30, 40], in_flight=set())  # [10, 20]
    """

    def __init__(self, k: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise CheckpointError(f"KeepLatestK needs k >= 0 (0 keeps all), got {k!r}")
        self.k = k

    def to_delete(self, committed_steps: list[int], in_flight: set[int]) -> list[int]:
        if self.k == 0 or not committed_steps:
            return []
        steps = sorted(set(committed_steps))
        newest = steps[-1]
        doomed = steps[: -self.k] if len(steps) > self.k else []
        return [s for s in doomed if s != newest and s not in in_flight]

    def __repr__(self) -> str:
        return f"KeepLatestK({self.k})"
