"""The plan exchange: ``central_round``, the one gather/scatter through the coordinator
that every exchange of plans runs (quicksave's own multi-rank planning in
``saving/plan_vote.py`` and ``quicksave.save``, and the DCP planners' in
``compat/nvrx/dcp_steps`` and ``loading/steps``), and how failures travel through it.

Every rank of the group calls ``central_round`` once per exchange, in the same order.

Example::

    share = central_round(local_plan, plan_all, group, coordinator=0, rank=rank)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from quicksave.errors import CheckpointError
from quicksave.ranks import collectives as talk

__all__ = [
    "central_round",
    "collective_error",
    "failures_in",
    "raise_own_interrupt",
    "sendable",
]


def collective_error(e: Exception, rank: int, what: str) -> CheckpointError:
    """A broken collective as the error every rank raises (names ``rank``)."""
    cause = str(e).splitlines()[0] if str(e) else type(e).__name__
    return CheckpointError(
        f"{what} failed (did a rank crash or time out? see its log); nothing was saved: {cause}",
        rank=rank,
    )


def sendable(e: BaseException, rank: int) -> CheckpointError:
    """A failure as it travels to the coordinator (a ``CheckpointError`` pickles with
    its fields; anything else is described). An interrupt stays attached locally as
    the ``__cause__`` (it does not travel), and :func:`raise_own_interrupt` raises it on
    this rank once the others know."""
    if isinstance(e, CheckpointError):
        return e
    if isinstance(e, Exception):
        return CheckpointError(f"{type(e).__name__}: {e}", rank=rank)
    err = CheckpointError(f"rank {rank} was interrupted ({type(e).__name__})", rank=rank)
    err.__cause__ = e
    return err


def raise_own_interrupt(mine: Any) -> None:
    """Re-raise this rank's own interrupt (a Ctrl-C stops the loop, it is not a failed
    save to catch and go on from)."""
    if isinstance(mine, CheckpointError):
        cause = mine.__cause__
        if cause is not None and not isinstance(cause, Exception):
            raise cause


def failures_in(gathered: list[Any]) -> list[tuple[int, BaseException]]:
    """``(rank, failure)`` of every rank that sent a failure to a round."""
    return [(r, g) for r, g in enumerate(gathered) if isinstance(g, BaseException)]


def central_round(
    mine: Any,
    decide: Callable[[list[Any]], list[Any]],
    group: Any,
    coordinator: int,
    rank: int,
    *,
    distributed: bool = True,
    path: str | None = None,
) -> Any:
    """The plan exchange: ONE gather of every rank's ``mine`` on the coordinator,
    ``decide(gathered)`` there (one reply per rank, in rank order), ONE scatter of the
    replies; returns this rank's reply. Every exchange of plans runs through here:
    quicksave's own (``saving/plan_vote.exchange_plans``; ``saving/sync_save``:
    ``quicksave.save``'s plan and commit rounds) and the DCP planners'
    (``compat/nvrx/dcp_steps``: the NVRx-compatible API's save planning;
    ``loading/steps``: every load's), whose ``decide`` is the planner's global step.

    Every rank of ``group`` calls it (``distributed=False``: this process alone, no
    collective, the same outcomes). A ``decide`` that fails fails every rank alike: a
    ``CheckpointError`` as it is (it pickles with its fields; one that names no rank
    names the coordinator), anything else as a
    ``CheckpointError`` naming the coordinator (and ``path``); no rank is left waiting.
    An interrupt (``KeyboardInterrupt``, ``SystemExit``) in ``decide`` reaches the other
    ranks as such an error, and the coordinator re-raises the interrupt itself; a rank
    whose ``mine`` is its own interrupt (:func:`sendable`) re-raises it once the round
    is over.

    Example::

        share = central_round(local_plan, plan_all, group, coordinator=0, rank=rank)
    """
    interrupt: BaseException | None = None
    if not distributed:
        replies, interrupt = _decide([mine], decide, coordinator, path)
        kind, value = replies[0]
    else:
        gathered = talk.gather_object(mine, coordinator, group)
        replies = None
        if rank == coordinator:
            assert gathered is not None
            replies, interrupt = _decide(gathered, decide, coordinator, path)
        kind, value = talk.scatter_object(replies, coordinator, group)
    if interrupt is not None:
        raise interrupt
    if kind == "error":
        raise_own_interrupt(mine)  # this rank's own Ctrl-C, now that the others know
        raise value
    return value


def _decide(
    gathered: list[Any],
    decide: Callable[[list[Any]], list[Any]],
    coordinator: int,
    path: str | None,
) -> tuple[list[tuple[str, Any]], BaseException | None]:
    """The coordinator's replies of a ``central_round`` — ``("ok", reply)`` per rank, or
    the same ``("error", CheckpointError)`` for every rank — and an interrupt that
    ``decide`` raised, if any."""
    n = len(gathered)

    def error(message: str) -> list[tuple[str, Any]]:
        return [("error", CheckpointError(message, path=path, rank=coordinator))] * n

    try:
        replies = list(decide(gathered))
    except CheckpointError as e:
        if e.rank is None:  # found by the coordinator's decision: it is the rank named
            e.rank = coordinator
        return [("error", e)] * n, None
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, not only this one
        return error(f"rank {coordinator} (the coordinator) failed: {type(e).__name__}: {e}"), None
    except BaseException as e:  # noqa: BLE001 - an interrupt: the others hear, this one stops
        return error(
            f"rank {coordinator} (the coordinator) was interrupted ({type(e).__name__})"
        ), e
    if len(replies) != n:
        return error(f"the coordinator gave {len(replies)} replies for {n} ranks"), None
    return [("ok", reply) for reply in replies], None
