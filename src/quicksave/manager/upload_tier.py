"""The manager's object-store tier: due checkpoints of the local folder uploaded in the
background (:mod:`quicksave.tiers.upload`), with their own retention, and read back by
``load()`` when the store holds a newer step than the folder.

Wiring only: the session's list of tiers gets one more :class:`~quicksave.manager.tiers.
Tier` (the store's location, its manifest-last commit, its writer lease and
``KeepLatestK(upload.keep)``); the training thread offers each due step once it sees it
commit (:meth:`UploadTier.poll`, from ``save()``), and holds the steps being copied out
of the folder's retention (:attr:`CheckpointSession.held`).

Ownership: rank 0 takes the store folder's writer lease when the manager is built (the
ranks learn the outcome in one broadcast); without it no rank uploads (logged): another
live job writes there. Only the lease holder deletes on the store (crashed copies'
objects, retention).
"""

from __future__ import annotations

import logging
import time

from quicksave.errors import CheckpointError, CorruptCheckpointError
from quicksave.manager.config import CheckpointConfig
from quicksave.manager.folder import load_newest
from quicksave.manager.lease import WriterLease, take_writer_lease
from quicksave.manager.policies import KeepLatestK
from quicksave.manager.session import CheckpointSession
from quicksave.manager.step_io import StepIO
from quicksave.manager.tiers import Tier
from quicksave.ranks import collectives
from quicksave.storage import parse_location
from quicksave.tiers.upload import TIER, Uploader

logger = logging.getLogger("quicksave")


class UploadTier:
    """One rank's object-store tier (see the module docstring). Every rank builds one
    alike (collective: a gloo group, one broadcast).

    Args:
        config: the manager's config; ``config.upload`` is set.
        session: the folder's session (its metrics say what committed).
    """

    def __init__(self, config: CheckpointConfig, session: CheckpointSession) -> None:
        assert config.upload is not None
        self.config = config
        self.upload = config.upload
        self.session = session
        self.rank = session.rank() or 0
        storage = self.upload.storage or config.storage
        self.location = parse_location(self.upload.url, what="upload URL", options=storage)
        self.tier = Tier.at(self.location, KeepLatestK(self.upload.keep))
        session.tiers.append(self.tier)
        self.uploader: Uploader | None = None
        self._lease: WriterLease | None = None
        self._scanned = 0  # session.metrics before this index are settled and seen
        self._offered = -1
        if session.read_only_reason is not None:
            return
        group = None
        why: str | None = None
        if self.rank == 0:
            self._lease, why = take_writer_lease(
                self.location, "use another upload.url, or stop that job", self.tier.lease
            )
        if session.world_size() > 1:
            group = collectives.new_gloo_group(
                collectives.group_ranks(session.checkpoint_group()), config.commit_timeout_s
            )
            why = collectives.broadcast_object(why, 0, session.checkpoint_group())
        if why is not None:
            logger.warning("quicksave: no uploads to %s: %s", self.location.url, why)
            return
        backend = self.location.open(rank=self.rank)
        if self._lease is not None:
            backend = self._lease.guard(backend) or backend
        self._backend = backend
        self.uploader = Uploader(
            session.location,
            self.location,
            self.rank,  # its group has the session's ranks, in their order
            session.world_size(),
            group,
            backend,
            self._retain if self._lease is not None else None,
        )

    def due(self, step: int) -> bool:
        return step > 0 and step % self.upload.every == 0

    def poll(self) -> None:
        """Offer the newest due step that committed in the folder since the last call
        (training thread, no I/O), and hold the steps being uploaded out of the
        folder's retention."""
        if self.uploader is None:
            return
        metrics = self.session.metrics
        newest = -1
        while self._scanned < len(metrics):
            record = metrics[self._scanned]
            if record.status == "in_flight":
                break
            if record.status == "committed" and record.kind == "full" and self.due(record.step):
                newest = max(newest, record.step)
            self._scanned += 1
        if newest > self._offered:
            self._offered = newest
            self.uploader.offer(newest)
        self.session.held = self.uploader.holding()

    def _retain(self, step: int) -> None:
        """Rank 0, in the uploader's thread after ``step`` committed on the store."""
        assert self._lease is not None
        self.tier.retain(
            self._lease,
            set(),
            step,
            stale_after_s=self.location.options.stale_after_s,
            allow_dcp=False,
            backend=self._backend,
        )

    def steps(self) -> list[int]:
        """The steps committed on the store, ascending."""
        return self.tier.reader.committed_steps(self.location, allow_dcp=False, backend=None)

    def close(self) -> None:
        """Wait for the upload in flight and the one waiting (up to ``close_timeout_s``),
        then release the store's lease."""
        if self.uploader is not None:
            self.poll()
            if self.uploader.close(self.config.close_timeout_s):
                self._backend.close()
            self.session.held = frozenset()
        if self._lease is not None:
            self._lease.release()
            self._lease = None


def newer_steps(tier: UploadTier) -> list[int]:
    """Every rank alike (``load()`` with no step, before the memory tier): the steps
    committed on the store that are newer than the folder's newest, ascending (rank 0
    lists both and tells the others: one broadcast). [] where it cannot list (logged)."""
    session = tier.session
    steps: list[int] = []
    if tier.rank == 0:
        try:
            folder = session.committed_steps()
            newest = folder[-1] if folder else -1
            steps = [s for s in tier.steps() if s > newest]
        except CheckpointError as e:
            logger.warning("quicksave: cannot list %s: %s", tier.location.url, e)
    if session.world_size() > 1:
        steps = collectives.broadcast_object(steps, 0, session.checkpoint_group())
    return steps


def load_from_store(tier: UploadTier, io: StepIO, strict: bool, steps: list[int]) -> int | None:
    """Every rank alike: load the newest of ``steps`` (:func:`newer_steps`) from the
    store, an older one after a step that fails its checks. None: none loaded (``steps``
    is empty, or none passes its checks: logged, each named); the caller loads from the
    folder."""
    session = tier.session
    if not steps:
        return None

    def load(step: int) -> None:
        where = tier.location.child(f"step-{step}")
        checkpoint = tier.tier.reader.require_committed(
            tier.location, where, step, session.rank(), allow_dcp=False, backend=None
        )
        io.load_step(step, checkpoint, strict=strict)

    begin = time.perf_counter()
    try:
        loaded = load_newest(lambda: steps, load, None, tier.location.url, session.rank())
    except CorruptCheckpointError as e:
        logger.error("quicksave: nothing loaded from the %s tier: %s", TIER, e)
        return None
    if loaded is not None:
        logger.log(
            session.info_level(),
            "quicksave: resumed from the %s tier (%s), step %d in %.3f s",
            TIER,
            tier.location.url,
            loaded,
            time.perf_counter() - begin,
        )
    return loaded
