"""Which steps of a checkpoint folder this node's memory holds, and which its
object-store tier holds (for ``quicksave ls``).

The memory tier's snapshots live under ``<root>/quicksave-<uid>/<key>/`` (one job
folder per job, :mod:`.node_memory`), whose ``job.json`` names the checkpoint folder
they belong to, in ``world-<W>/rank-<r>/step-<N>`` (one single-rank checkpoint per rank)
and, for the peer replicas this node keeps of other nodes' ranks,
``world-<W>/replica-of-<r>/step-<N>``. A step counts as held when it is committed there
for every rank of its world size, as the rank's own snapshot or a replica of it.
Only this user's job folders are read. The object-store tier's steps are the
checkpoints committed under its URL (``UploadTierConfig.url``: ``<url>/step-<N>``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from quicksave.loading.run_folder import committed_steps
from quicksave.storage import parse_location

_WORLD = re.compile(r"world-(\d+)")
_HOLDS = re.compile(r"(?:rank|replica-of)-(\d+)")  # a rank's own snapshots, or a replica


@dataclass(frozen=True)
class MemoryHolding:
    """One step in this node's memory: the ranks whose snapshot of it this node holds
    (own or replica), of ``world_size``."""

    step: int
    ranks: int
    world_size: int
    path: str  # the job folder

    @property
    def complete(self) -> bool:
        return self.ranks == self.world_size


def memory_holdings(folder_url: str, root: str = "/dev/shm") -> list[MemoryHolding]:
    """The steps of the checkpoint folder ``folder_url`` that this node's memory holds
    (``root``: the tmpfs the memory tier uses), by step; [] if none (or no tmpfs)."""
    base = Path(root) / f"quicksave-{os.getuid()}"
    found: dict[tuple[int, int], dict[int, str]] = {}
    try:
        jobs = sorted(p for p in base.iterdir() if p.is_dir())
    except OSError:
        return []
    for job in jobs:
        try:
            owner = json.loads((job / "job.json").read_text()).get("folder_url")
        except (OSError, ValueError, AttributeError):
            continue
        if owner != folder_url:
            continue
        for world in _children(job, _WORLD):
            size = int(_WORLD.fullmatch(world.name).group(1))  # type: ignore[union-attr]
            for held in _children(world, _HOLDS):
                rank = int(_HOLDS.fullmatch(held.name).group(1))  # type: ignore[union-attr]
                for step in committed_steps(str(held), allow_dcp=False):
                    found.setdefault((step, size), {}).setdefault(rank, str(job))
    return [
        MemoryHolding(step, len(ranks), size, next(iter(ranks.values())))
        for (step, size), ranks in sorted(found.items())
    ]


def _children(folder: Path, pattern: re.Pattern[str]) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if p.is_dir() and pattern.fullmatch(p.name))
    except OSError:
        return []


def store_steps(url: str) -> list[int]:
    """The steps committed in the object-store tier at ``url``, ascending (credentials
    and endpoint from the environment's standard chain)."""
    return committed_steps(parse_location(url, what="upload URL"), allow_dcp=False)
