"""A folder of checkpoints where one checkpoint was expected.

A load, an export or ``load_state`` pointed at a run folder (``ckpt/``, whose
``step-<N>`` directories are the checkpoints) finds no ``manifest.json`` there; the
error names the checkpoints it holds and the two ways to load one, instead of only
"not a checkpoint". Only on that error path: one listing of the folder.
"""

from __future__ import annotations

import re

from quicksave.commit import open_strategy
from quicksave.errors import CheckpointError
from quicksave.storage import Location
from quicksave.storage.backend import Backend

NOT_A_CHECKPOINT = "not a checkpoint (no manifest.json)"
_STEP = re.compile(r"step-(\d+)")
_SHOWN = 5  # names listed in the message; the rest are counted


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
