"""Checks that a manager's calls fit what its folder already holds, with errors that say
what is there and what to do.

- :func:`check_not_behind` (the first due ``save()`` of a manager that has not called
  ``load()``): a step below the newest committed one is refused. Saved anyway, the
  next resume would load that newest checkpoint, not this run's, and retention, which
  keeps the highest steps, would delete this run's checkpoints first.
- :func:`states_mismatch` (a strict ``load()`` that failed on its keys): when the
  checkpoint holds other states than the manager's (one written by ``quicksave.save``
  or another program into the folder), the error names the checkpoint, the states it
  holds and the manager's, and suggests ``load(step=...)``.

Every rank runs them alike (the same listing, the same manifest), so every rank raises
alike; no collective.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from quicksave.errors import CheckpointError, IncompatibleStateError
from quicksave.manager.folder import stored_metadata

if TYPE_CHECKING:
    from quicksave.manager.session import CheckpointSession

logger = logging.getLogger("quicksave")

_STEPS_SHOWN = 8


def _steps(steps: list[int]) -> str:
    shown = [str(s) for s in steps[-_STEPS_SHOWN:]]
    return ", ".join((["…"] if len(steps) > _STEPS_SHOWN else []) + shown)


def _names(names: Iterable[str]) -> str:
    return ", ".join(repr(n) for n in sorted(names)) or "none"


def check_not_behind(step: int, session: CheckpointSession) -> bool:
    """Raise unless ``step`` is at or above every committed step of ``session``'s
    folder (listed here: one listing, on every rank alike).

    Args:
        step: the step a manager that has not loaded is about to save.

    Returns:
        True once checked; False if the folder could not be listed (logged: the save
        goes on, and its own writes meet the store's trouble; the next due save checks).

    Raises:
        CheckpointError: a committed step is above ``step``; nothing was written.
    """
    try:
        committed = session.committed_steps()
    except (CheckpointError, OSError) as e:
        logger.warning(
            "quicksave: could not list %s to compare step %d with its checkpoints (%s); "
            "the next save compares",
            session.folder,
            step,
            e,
        )
        return False
    if not committed or committed[-1] <= step:
        return True
    newest = committed[-1]
    raise CheckpointError(
        f"step {step} is below the newest committed checkpoint in this folder (step "
        f"{newest}) and this manager has not called load(): saved, step {newest} would "
        "stay the one a resume loads, and retention (which keeps the highest steps) would "
        f"delete this run's checkpoints first. Call load() before training to resume from "
        f"step {newest}, or give a new run a new folder; nothing was written",
        path=session.folder,
        rank=session.rank(),
    )


def stored_state_names(fqns: Iterable[str], wanted: Iterable[str]) -> set[str]:
    """The top-level state names of a checkpoint whose keys are ``fqns``: a name of
    ``wanted`` where a key is it or lies under it (names may hold dots), else the key's
    first dotted component."""
    wanted = sorted(wanted, key=len, reverse=True)
    held = set()
    for fqn in fqns:
        name = next((w for w in wanted if fqn == w or fqn.startswith(f"{w}.")), None)
        held.add(name if name is not None else fqn.split(".", 1)[0])
    return held


def states_mismatch(
    error: IncompatibleStateError,
    *,
    step: int,
    fqns: Iterable[str],
    wanted: Iterable[str],
    committed: list[int],
) -> IncompatibleStateError | None:
    """The error a strict manager load should raise instead of ``error`` when the
    checkpoint of ``step`` holds other top-level states than ``wanted``; None when it
    holds the same ones (``error`` says what differs inside them).

    Args:
        error: what the load raised (its path and rank are kept).
        fqns: the checkpoint's keys.
        wanted: the names of the states being loaded.
        committed: the folder's committed steps, ascending.
    """
    wanted = set(wanted)
    held = stored_state_names(fqns, wanted)
    if held == wanted:
        return None
    newest = " (the newest committed one)" if committed and committed[-1] == step else ""
    differs = []
    if wanted - held:
        differs.append(f"not in the checkpoint: {_names(wanted - held)}")
    if held - wanted:
        differs.append(f"not this manager's: {_names(held - wanted)}")
    others = [s for s in committed if s != step]
    ways = ["keep other checkpoints out of the manager's folder"]
    if others:
        ways.insert(
            0,
            f"load one this manager wrote with load(step=N) (other committed steps: "
            f"{_steps(others)})",
        )
    todo = ", ".join(ways)
    return IncompatibleStateError(
        f"the checkpoint of step {step}{newest} holds the states {_names(held)}, and this "
        f"manager loads {_names(wanted)} ({'; '.join(differs)}): it was written by "
        f"something else (quicksave.save, another program). {todo[0].upper()}{todo[1:]}, "
        "or load(strict=False) to load the states both have",
        path=error.path,
        rank=error.rank,
    )


def explain_load_mismatch(
    error: IncompatibleStateError,
    session: CheckpointSession,
    step: int,
    wanted: Iterable[str],
    allow_dcp_pickle: bool = False,
) -> IncompatibleStateError | None:
    """:func:`states_mismatch` for the checkpoint of ``step`` in ``session``'s folder,
    reading its keys and the folder's committed steps (only on this error path); None
    when they cannot be read (the load's own error stands) or the states match."""
    try:
        fqns = stored_metadata(
            session.where(session.step_path(step)), allow_dcp_pickle=allow_dcp_pickle
        )
        committed = session.committed_steps()
    except (CheckpointError, OSError):
        return None
    return states_mismatch(error, step=step, fqns=fqns, wanted=wanted, committed=committed)
