"""The state of one call of ``AsyncCallsQueue`` and the ranks' agreement on it.

Order of calls (every rank, training thread, inside ``maybe_finalize_async_calls`` with
``no_dist=False``): for the oldest unfinalized :class:`Call`, :func:`agree_on_call` (ONE
MIN all-reduce of four small integers: done everywhere? failed somewhere? the same call
everywhere?); only when a failure is agreed, :func:`failures_everywhere` (ONE all-gather
of every rank's cause), so that each rank can name every failed rank. Every rank of the
group must make the same calls, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from quicksave.compat.nvrx.errors import AsyncCheckpointError
from quicksave.compat.nvrx.request import AsyncRequest
from quicksave.errors import CheckpointError
from quicksave.ranks import collectives as talk


@dataclass
class Call:
    call_id: int
    request: AsyncRequest
    path: str | None = None  # named in errors, when known
    done: bool = False
    error: CheckpointError | None = None
    preloading: bool = False


@dataclass(frozen=True)
class Agreement:
    all_done: bool
    failed_rank: int | None  # lowest rank whose call failed


_NO_FAILURE = 2**62


def agree_on_call(call_id: int, done: bool, failed: bool, process_group: Any = None) -> Agreement:
    """Collective: every rank says whether its oldest call is done (or
    failed); one MIN all-reduce of four small integers gives every rank the same answer.

    Raises:
        AsyncCheckpointError: ranks are at different calls (they scheduled different
            requests, or not all of them are finalizing).
    """
    me = torch.distributed.get_rank()
    all_done, failed_rank, lo, hi = talk.all_reduce_ints(
        [int(done), me if failed else _NO_FAILURE, call_id, -call_id], "min", process_group
    )
    if lo != -hi:
        raise AsyncCheckpointError(
            f"ranks are finalizing different async calls (ids {lo}..{-hi}): every rank must "
            "schedule the same requests and call maybe_finalize_async_calls together",
            rank=me,
        )
    return Agreement(bool(all_done), None if failed_rank == _NO_FAILURE else failed_rank)


def failures_everywhere(call: Call, process_group: Any) -> dict[int, tuple[str, str | None]]:
    """Collective (only once a failure is agreed): every rank's failure of this call,
    rank -> (message, path), so that each rank can name every failed rank and cause."""
    mine = None
    if call.error is not None:
        mine = (call.error.message, call.error.path)
    gathered = talk.all_gather_object((torch.distributed.get_rank(), mine), process_group)
    return {rank: what for rank, what in gathered if what is not None}


def call_name(fn: Any) -> str:
    """``fn``'s name in error messages (a ``functools.partial``: its function's)."""
    if fn is None:
        return "no-op"
    inner = getattr(fn, "func", fn)  # functools.partial
    return getattr(inner, "__qualname__", None) or type(inner).__name__


def dist_rank() -> int | None:
    """This process's rank, or None without ``torch.distributed``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return None
