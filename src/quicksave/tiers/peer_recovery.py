"""Recovery from peer replicas: which step every rank can get, from where, and the
fetch of the snapshots a rank's own memory lacks from the ranks that hold replicas of
them (:mod:`quicksave.tiers.peer_replicas` makes the replicas).

Call order (every rank alike, on the training thread; the memory tier does it):

1. every rank reports what it holds (its own steps; the steps of each source whose
   replicas it holds) and the reports are all-gathered (one collective, by the caller);
2. :func:`holders_by_step` (pure, the same on every rank): for each step, where each
   rank's snapshot of it can come from (its own memory first, else the lowest rank that
   holds a replica), for the steps every rank can get;
3. for the step tried, :func:`fetch`: every rank walks the same list of transfers (holder
   → rank, in rank order) and takes part in those that name it, so each transfer is
   matched and none waits on a rank busy with a later one; the receiver commits the
   snapshot into its own memory by the local rule, then loads it as its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from quicksave.errors import CheckpointError
from quicksave.ranks import collectives
from quicksave.tiers.peer_files import Incoming, Outgoing, check_names, scratch
from quicksave.tiers.peer_replicas import replica_dir

Report = tuple[list[int], Mapping[int, list[int]]]  # (own steps, {source: steps})
_TAG = 1 << 16  # the fetch's tags (apart from any exchange of the replication thread)


def holders_by_step(reports: Sequence[Report]) -> dict[int, list[int]]:
    """For each step that every rank can get, the rank each one gets it from (itself:
    own memory), by rank.

    Example:
        >>> holders_by_step([([5], {1: [5]}), ([], {0: [5]})])
        {5: [0, 0]}
    """
    every: set[int] = set()
    for own, replicas in reports:
        every.update(own)
        for steps in replicas.values():
            every.update(steps)
    out = {}
    for step in sorted(every):
        holders = []
        for rank, (own, _) in enumerate(reports):
            if step in own:
                holders.append(rank)
                continue
            holder = next(
                (h for h, (_, reps) in enumerate(reports) if step in reps.get(rank, ())), None
            )
            if holder is None:
                break
            holders.append(holder)
        else:
            out[step] = holders
    return out


def fetch(
    step: int, holders: Sequence[int], rank: int, world_dir: Path, own: Path, group: Any
) -> bool:
    """Move the snapshots of ``step`` that ranks lack to them from their holders (module
    docstring, 3.): every rank calls it alike, with the same ``holders``.

    Args:
        step: the step to fetch.
        holders: ``holders_by_step(...)[step]``.
        rank: this rank.
        world_dir: this node's ``<job folder>/world-<W>`` (where its replicas are).
        own: this rank's own snapshots' folder (a fetched one is committed there).
        group: a gloo group of every rank (point to point transfers).

    Returns:
        Whether this rank received its snapshot from a peer.

    Raises:
        CheckpointError: a transfer that names this rank failed (a peer died or timed
            out); the ranks then agree on the failure as for any failed load.
    """
    received = False
    for target, holder in enumerate(holders):
        if holder == target or rank not in (holder, target):
            continue
        try:
            if rank == holder:
                _send(replica_dir(world_dir, target) / f"step-{step}", step, target, group)
            else:
                received = _receive(own / f"step-{step}", step, holder, group)
        except RuntimeError as e:
            raise CheckpointError(
                f"fetching rank {target}'s snapshot of step {step} from the replica on rank "
                f"{holder} failed: {e}",
                rank=rank,
            ) from e
    return received


def _send(path: Path, step: int, target: int, group: Any) -> None:
    try:
        outgoing: Outgoing | None = Outgoing.open(str(path))
    except CheckpointError:
        outgoing = None  # the receiver hears "none": its load fails, every rank skips
    header = {"step": step, "files": None if outgoing is None else outgoing.files}
    collectives.exchange_objects(header, target, None, group, _TAG)
    if outgoing is not None:
        collectives.exchange_tensors(outgoing.tensors(), target, [], None, group, _TAG + 2)
        outgoing.close()


def _receive(final: Path, step: int, holder: int, group: Any) -> bool:
    header = collectives.exchange_objects(None, None, holder, group, _TAG)
    if not isinstance(header, dict) or header.get("step") != step:
        raise CheckpointError(f"rank {holder} sent {header!r} for step {step}'s snapshot")
    if header.get("files") is None:
        return False
    listed = check_names(header["files"])
    try:
        incoming: Incoming | None = Incoming(final, listed)
    except OSError:
        incoming = None  # the bytes are taken and dropped; the load then fails
    recvs = scratch(listed) if incoming is None else incoming.tensors()
    try:
        collectives.exchange_tensors([], None, recvs, holder, group, _TAG + 2)
    except BaseException:
        if incoming is not None:
            incoming.discard()
        raise
    if incoming is None:
        return False
    incoming.commit()
    return True
