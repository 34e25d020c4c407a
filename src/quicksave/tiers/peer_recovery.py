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
   matched and none waits on a rank busy with a later one. The holder sends the
   snapshot's manifest, then answers the receiver's reads until it is told the load is
   over; the receiver loads the snapshot with those reads as its data files
   (:class:`~quicksave.loading.checkpoint.RemoteFiles`): each stored chunk travels once,
   straight into the destination tensor that wants it, and is checked against the
   manifest's xxh3 where it landed. Nothing is written to the receiver's memory; its
   next snapshot is its own again.

Transfers of one fetch (tags from ``_TAG``): header (holder → receiver: step, file names
and sizes), the manifest's bytes, then per load of the receiver (its states, or each of
their streamed parts) a read list (receiver → holder), the holder's answer (whether it
serves them) and the bytes; last the receiver's "done".
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from quicksave.commit import CheckpointKind
from quicksave.errors import CheckpointError
from quicksave.format import MANIFEST_NAME
from quicksave.format.manifest import LAYOUT_QUICKSAVE
from quicksave.format.manifest_parse import from_json_bytes
from quicksave.loading.checkpoint import Checkpoint
from quicksave.ranks import collectives
from quicksave.storage import parse_location
from quicksave.tiers.peer_files import Outgoing, check_names
from quicksave.tiers.peer_replicas import replica_dir

logger = logging.getLogger("quicksave")
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
    step: int,
    holders: Sequence[int],
    rank: int,
    world_dir: Path,
    group: Any,
    load: Callable[[Checkpoint], bool],
    served: threading.Event | None = None,
) -> bool:
    """Load the snapshots of ``step`` that ranks lack from their holders (module
    docstring, 3.): every rank calls it alike, with the same ``holders``.

    Args:
        step: the step to fetch.
        holders: ``holders_by_step(...)[step]``.
        rank: this rank.
        world_dir: this node's ``<job folder>/world-<W>`` (where its replicas are).
        group: a gloo group of every rank (point to point transfers).
        load: on a rank that lacks its snapshot: loads the given checkpoint (its data
            files the holder's, read through ``checkpoint.remote``) into the states;
            returns whether reads go on after it returned (the optimizers' states
            streaming in: the stream calls ``checkpoint.remote.close()`` once its last
            read is done).
        served: set on a holder once a receiver's first load has its bytes (it may
            train; later reads of its stream are served on).

    Returns:
        Whether this rank loaded its snapshot from a peer.

    Raises:
        CheckpointError: a transfer that names this rank failed (a peer died or timed
            out), or the load did (a torn replica fails its checksums); the ranks then
            agree on the failure as for any failed load.
    """
    served = served or threading.Event()
    loaded = False
    for target, holder in enumerate(holders):
        if holder == target or rank not in (holder, target):
            continue
        try:
            if rank == holder:
                path = replica_dir(world_dir, target) / f"step-{step}"
                _serve(path, step, target, group, served)
            else:
                loaded = _load_from(step, holder, group, load)
        except RuntimeError as e:
            raise CheckpointError(
                f"fetching rank {target}'s snapshot of step {step} from the replica on rank "
                f"{holder} failed: {e}",
                rank=rank,
            ) from e
    return loaded


class _Reads:
    """A holder's replica as the data files of the receiver's load (``RemoteFiles``)."""

    def __init__(self, holder: int, group: Any, sizes: dict[str, int], path: str) -> None:
        self.holder = holder
        self.group = group
        self.sizes = sizes
        self.path = path
        self._lock = threading.Lock()  # one exchange at a time (the stream's thread too)
        self._closed = False

    def read(
        self,
        reads: list[tuple[str, int, memoryview]],
        landed: Callable[[int], None] | None = None,
    ) -> None:
        asked = [[name, offset, len(view)] for name, offset, view in reads]
        into = [torch.frombuffer(view, dtype=torch.uint8) for _, _, view in reads if len(view)]
        which = [i for i, (_, _, view) in enumerate(reads) if len(view)]  # (empty: not sent)
        with self._lock:
            if self._closed:
                raise CheckpointError("the peer's replica is no longer served", path=self.path)
            try:
                self._exchange(asked, into, None if landed is None else lambda j: landed(which[j]))
            except RuntimeError as e:
                raise CheckpointError(
                    f"reading from the replica on rank {self.holder} failed: {e}", path=self.path
                ) from e
        if landed is not None:  # the empty ones are in too
            for i, (_, _, view) in enumerate(reads):
                if not len(view):
                    landed(i)

    def _exchange(
        self, asked: list, into: list[torch.Tensor], landed: Callable[[int], None] | None
    ) -> None:
        group = self.group
        collectives.exchange_objects({"reads": asked}, self.holder, None, group, _TAG + 4)
        answer = collectives.exchange_objects(None, None, self.holder, group, _TAG + 6)
        if not isinstance(answer, dict) or answer.get("error") is not None:
            error = answer.get("error") if isinstance(answer, dict) else repr(answer)
            raise CheckpointError(f"rank {self.holder} refused the reads: {error}", path=self.path)
        collectives.exchange_tensors([], None, into, self.holder, group, _TAG + 8, landed)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                collectives.exchange_objects({"done": True}, self.holder, None, self.group,
                                             _TAG + 4)  # fmt: skip
            except RuntimeError as e:  # the holder is gone: it serves nobody anyway
                logger.warning("quicksave: telling rank %d the reads are done: %s", self.holder, e)


def _load_from(step: int, holder: int, group: Any, load: Callable[[Checkpoint], bool]) -> bool:
    header = collectives.exchange_objects(None, None, holder, group, _TAG)
    if not isinstance(header, dict) or header.get("step") != step:
        raise CheckpointError(f"rank {holder} sent {header!r} for step {step}'s snapshot")
    if header.get("files") is None:
        return False  # the holder lost it: the load from this rank's memory fails
    sizes = dict(check_names(header["files"]))
    path = str(header.get("path"))
    manifest = torch.empty(sizes.get(MANIFEST_NAME, 0), dtype=torch.uint8)
    collectives.exchange_tensors([], None, [manifest] if manifest.numel() else [], holder, group,
                                 _TAG + 2)  # fmt: skip
    reads = _Reads(holder, group, sizes, path)
    streaming = False
    try:
        if not manifest.numel():
            raise CheckpointError("the peer's copy has no manifest", path=path)
        parsed = from_json_bytes(manifest.numpy().tobytes(), path, layout=LAYOUT_QUICKSAVE)
        checkpoint = Checkpoint(
            parse_location(path), CheckpointKind.QUICKSAVE, read={"manifest": parsed}, remote=reads
        )
        streaming = load(checkpoint)
    finally:  # the holder serves until it hears "done", whatever the load's outcome
        if not streaming:
            reads.close()
    return True


def _serve(path: Path, step: int, target: int, group: Any, served: threading.Event) -> None:
    try:
        outgoing: Outgoing | None = Outgoing.open(str(path))
    except CheckpointError:
        outgoing = None  # the receiver hears "none": its load fails, every rank skips
    files = None if outgoing is None else outgoing.files
    header = {"step": step, "files": files, "path": str(path)}
    collectives.exchange_objects(header, target, None, group, _TAG)
    if outgoing is None:
        return
    try:
        maps = outgoing.by_name()
        manifest = maps.get(MANIFEST_NAME)
        sends = [] if manifest is None or not manifest.numel() else [manifest]
        collectives.exchange_tensors(sends, target, [], None, group, _TAG + 2)
        while True:
            asked = collectives.exchange_objects(None, None, target, group, _TAG + 4)
            if not isinstance(asked, dict) or "reads" not in asked:
                return  # done (or nonsense: the receiver's load is over either way)
            slices, error = _slices(maps, asked["reads"])
            collectives.exchange_objects({"error": error}, target, None, group, _TAG + 6)
            if error is None:
                collectives.exchange_tensors(slices, target, [], None, group, _TAG + 8)
            served.set()  # the receiver's first load is in: it may train
    finally:
        outgoing.close()


def _slices(maps: Mapping[str, torch.Tensor], reads: Any) -> tuple[list[torch.Tensor], Any]:
    """The bytes ``reads`` asks for, as views of the mapped files (empty ones left out,
    as the receiver leaves them out), or the reason they cannot be served."""
    out = []
    for read in reads if isinstance(reads, list) else [None]:
        name, offset, length = read if isinstance(read, list) and len(read) == 3 else (None,) * 3
        data = maps.get(name) if isinstance(name, str) else None
        if (
            data is None
            or not isinstance(offset, int)
            or not isinstance(length, int)
            or offset < 0
            or length < 0
            or offset + length > data.numel()
        ):
            return [], f"no such bytes in the replica: {read!r}"
        if length:
            out.append(data[offset : offset + length])
    return out, None
