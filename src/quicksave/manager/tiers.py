"""The tiers of a checkpoint session: each place a job's checkpoints live, with what
commits, owns, prunes and reads them there.

A :class:`Tier` bundles a location with its commit strategy, its writer lease, its
retention and its reader. A :class:`~quicksave.manager.session.CheckpointSession` holds
a list of them: the folder of ``CheckpointConfig.folder`` first, then the object store
of ``CheckpointConfig.upload`` (:mod:`quicksave.manager.upload_tier`) when there is
one, with its own strategy, lease, retention and reader; nothing in the folder's tier
changes for it. Each part is chosen
where it lives: the strategy and the lease by the location's scheme
(:func:`~quicksave.commit.strategy_class`, :func:`~quicksave.manager.lease.lease_kind`),
the retention by the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from quicksave.commit import CommitStrategy, strategy_class
from quicksave.loading.checkpoint import Checkpoint, require_committed
from quicksave.loading.run_folder import committed_steps
from quicksave.manager.folder import apply_retention
from quicksave.manager.lease import WriterLease, clean_folder, lease_kind
from quicksave.manager.policies import RetentionPolicy
from quicksave.manager.references import BaseCache
from quicksave.storage import Location
from quicksave.storage.backend import Backend


class TierReader(Protocol):
    """What a session asks of a tier's checkpoints before it loads one: which steps
    are committed there, and whether one step is."""

    def committed_steps(
        self, location: Location, *, allow_dcp: bool, backend: Backend | None
    ) -> list[int]:
        """The committed steps under ``location``, ascending."""
        ...

    def require_committed(
        self,
        location: Location,
        path: Location,
        step: int,
        rank: int | None,
        *,
        allow_dcp: bool,
        backend: Backend | None,
    ) -> Checkpoint:
        """The committed checkpoint of ``step`` at ``path``, classified once (a load
        hands it on), or ``CheckpointNotFoundError`` / ``NotCommittedError`` naming the
        step and the committed steps."""
        ...


class FolderReader:
    """A folder of ``step-<N>`` checkpoints (:mod:`quicksave.manager.folder`)."""

    def committed_steps(
        self, location: Location, *, allow_dcp: bool, backend: Backend | None
    ) -> list[int]:
        return committed_steps(location, allow_dcp=allow_dcp, backend=backend)

    def require_committed(
        self,
        location: Location,
        path: Location,
        step: int,
        rank: int | None,
        *,
        allow_dcp: bool,
        backend: Backend | None,
    ) -> Checkpoint:
        return require_committed(
            path, allow_dcp=allow_dcp, backend=backend, step=step, folder=location, rank=rank
        )


@dataclass
class Tier:
    """One place the job's checkpoints live.

    Attributes:
        location: the folder of its checkpoints.
        strategy: how a checkpoint commits there (the class; opened per backend).
        lease: what makes its writer lease (only its holder deletes there).
        retention: which of its committed checkpoints to keep (a front end may set a
            new one).
        reader: which of its steps are committed.
        bases: which steps its checkpoints refer to, as read so far (retention keeps
            those).
    """

    location: Location
    strategy: type[CommitStrategy]
    lease: Callable[[Location], WriterLease]
    retention: RetentionPolicy
    reader: TierReader
    bases: BaseCache = field(default_factory=BaseCache)

    @classmethod
    def at(cls, location: Location, retention: RetentionPolicy) -> Tier:
        """The tier of ``location`` with the parts its scheme names.

        Raises:
            CheckpointError: its scheme names a strategy or lease no registry holds.
        """
        return cls(
            location, strategy_class(location), lease_kind(location), retention, FolderReader()
        )

    def retain(
        self,
        lease: WriterLease,
        keep: set[int],
        last_good: int | None,
        *,
        stale_after_s: float,
        allow_dcp: bool,
        backend: Backend | None,
    ) -> None:
        """Apply the tier's retention as ``lease``'s holder: first what a previous
        holder of a store lease left (once, when due), then the policy, keeping ``keep``
        and ``last_good``. Nothing is deleted before some checkpoint is known to pass
        its checks (``last_good`` None): the newest one may be torn, and deleting the
        older ones could leave nothing loadable if the job's own save then fails."""
        clean_folder(
            lease,
            self.location,
            stale_after_s,
            backend=backend,
            keep={f"step-{s}" for s in keep},
            deferred=True,
        )
        if last_good is not None:
            apply_retention(
                self.location,
                self.retention,
                keep | {last_good},
                allow_dcp=allow_dcp,
                backend=backend,
                bases=self.bases,
            )
