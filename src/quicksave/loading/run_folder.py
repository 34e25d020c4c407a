"""A run folder: the folder whose ``step-<N>`` directories are one run's checkpoints.

Which steps it holds committed (what "latest", ``load()`` and retention see), and the
message for a load pointed at the folder itself instead of one of its checkpoints:
that error names the checkpoints it holds and the two ways to load one, instead of only
"not a checkpoint" (only on that error path: one listing of the folder).
"""

from __future__ import annotations

import re

from quicksave.commit import COMMITTED, CheckpointKind, open_strategy
from quicksave.errors import CheckpointError
from quicksave.storage import Location, parse_location
from quicksave.storage.backend import Backend

NOT_A_CHECKPOINT = "not a checkpoint (no manifest.json)"
STEP_DIR = re.compile(r"step-(0|[1-9][0-9]*)")
MAX_STEP_NAME = 5 + 20  # "step-" and at most 20 digits: a step beyond int64 is no step
_STEP = re.compile(r"step-(\d+)")
_SHOWN = 5  # names listed in the message; the rest are counted


def committed_kinds(
    folder: str | Location, *, allow_dcp: bool = True, backend: Backend | None = None
) -> dict[int, CheckpointKind]:
    """The committed ``step-<N>`` checkpoints in ``folder`` (one listing of it), each
    step with its kind: quicksave ones, and stock DCP ones if ``allow_dcp``.
    Temporaries, quarantined checkpoints and directories without their commit are not
    listed; a directory that vanishes while the folder is listed (retention, clean-up)
    is simply not listed."""
    kinds = COMMITTED if allow_dcp else (CheckpointKind.QUICKSAVE,)
    with open_strategy(folder, backend) as s:
        found = s.committed(parse_location(folder), _is_step_name)
    return {int(name[5:]): kind for name, kind in sorted(found.items()) if kind in kinds}


def committed_steps(
    folder: str | Location, *, allow_dcp: bool = True, backend: Backend | None = None
) -> list[int]:
    """Steps with a committed checkpoint in ``folder``, ascending (see
    :func:`committed_kinds`)."""
    return sorted(committed_kinds(folder, allow_dcp=allow_dcp, backend=backend))


def _is_step_name(name: str) -> bool:
    return STEP_DIR.fullmatch(name) is not None and len(name) <= MAX_STEP_NAME


def checkpoints_in(folder: Location, backend: Backend | None = None) -> list[str]:
    """The names of the committed checkpoints directly under ``folder``: other names
    first (by name), then the ``step-<N>`` ones by step; [] if it cannot be listed."""
    try:
        with open_strategy(folder, backend) as strategy:
            names = list(strategy.committed(folder))
    except (CheckpointError, OSError):
        return []
    return sorted(names, key=_order)


def _order(name: str) -> tuple[int, int, str]:
    match = _STEP.fullmatch(name)
    return (1, int(match.group(1)), name) if match else (0, 0, name)


def not_a_checkpoint(folder: Location, backend: Backend | None = None) -> str:
    """The message for ``folder`` holding no checkpoint of its own: plain, or, when it
    holds checkpoints, which ones and how to load one of them."""
    names = checkpoints_in(folder, backend)
    if not names:
        return NOT_A_CHECKPOINT
    shown = names if len(names) <= _SHOWN else ["…", *names[-(_SHOWN - 1) :]]
    steps = [n for n in names if _STEP.fullmatch(n)]
    pick = steps[-1] if steps else names[-1]
    newest = " (the newest)" if steps else ""
    return (
        f"{NOT_A_CHECKPOINT}: a folder of {len(names)} checkpoint"
        f"{'s' if len(names) > 1 else ''} ({', '.join(shown)}); load one by its path, "
        f"e.g. {folder.child(pick).url}{newest}, or let a CheckpointManager on this folder "
        "resume from the newest (manager.load())"
    )
