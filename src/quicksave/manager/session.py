"""``CheckpointSession``: one job's use of one checkpoint folder, shared by every front end.

Everything about owning and using a checkpoint folder that is not the "when and what to
save" policy of a front end (``CheckpointManager``, torchtitan's backend): the writer
lease, the clean-up of what crashed saves left, which steps are committed, the saves in
flight and their records, the failure bookkeeping settled alike on every rank, the
fallback load to the newest checkpoint that passes its checks, and retention.

Call order (every rank of the process group builds one session and makes the same
calls, in the same order; "collective" marks the calls that talk to the other ranks)::

    CheckpointSession(config, process_group, retention=...)
    → take_folder(...)            collective with several ranks: one all-reduce
    → writer = AsyncWriter(...)   optional, the front end's (async modes only)
    → per save: poll() → [replace_uncommitted(path) → track(...) or committed(record)]
      → settle()                  collective with several ranks (agree=True)
      → housekeep(protect)        the lease holder only deletes; never raises
    → load: drain() → load_newest(load_step) or require_committed(step), then
      loaded(step) after each successful load; agree_failure(error): collective
    → close_writer(timeout) → release()

The folder's layout is :mod:`quicksave.manager.folder`'s; where its checkpoints live,
with what commits, leases, retains and reads them there, is the session's
:class:`~quicksave.manager.tiers.Tier` (the folder's first).

Ownership: one job writes a folder. The coordinator of a writing session holds the
folder's writer lease from :meth:`~CheckpointSession.take_folder` to
:meth:`~CheckpointSession.release`; only the lease holder deletes anything (leftovers
of crashed or failed saves, retention, quarantine). A session taken while another live
process holds the lease is read-only: it loads, and its front end refuses to save,
naming the holder. The collectives run on the session's own gloo group
(:meth:`~CheckpointSession.checkpoint_group`), created by the first call that needs it;
every rank reaches that call alike.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from quicksave.commit import COMMITTED, classify
from quicksave.errors import CheckpointError
from quicksave.loading.checkpoint import Checkpoint
from quicksave.loading.run_folder import committed_kinds
from quicksave.manager.async_writer import AsyncWriter
from quicksave.manager.config import CheckpointConfig
from quicksave.manager.failures import FailureLedger, Key, log_verdict
from quicksave.manager.folder import (
    create_folder,
    load_newest,
    quarantine,
    replace_uncommitted,
)
from quicksave.manager.housekeeper import Housekeeper
from quicksave.manager.interval import OutcomeVote, agree_any_due, agree_reports
from quicksave.manager.lease import WriterLease, clean_folder, take_writer_lease
from quicksave.manager.policies import KeepLatestK, RetentionPolicy
from quicksave.manager.records import SaveRecord, log_committed, report
from quicksave.manager.tiers import Tier
from quicksave.ranks import collectives
from quicksave.saving.config import EngineConfig
from quicksave.saving.dist_save import DistContext
from quicksave.saving.handle import SaveHandle
from quicksave.storage import Location, parse_location
from quicksave.storage.backend import Backend

logger = logging.getLogger("quicksave")


class CheckpointSession:
    """One job's use of ``config.folder``: ownership, listing, tracking, failures, load
    fallback and retention (see the module docstring for the order of calls).

    Args:
        config: the folder, storage options, timeouts, ``on_save_error``,
            ``allow_dcp`` / ``allow_dcp_pickle`` (:class:`CheckpointConfig`).
        process_group: the ranks that checkpoint together (default: the world).
        retention: which committed checkpoints to keep (default:
            ``KeepLatestK(config.keep_latest_k)``).

    Attributes:
        tiers: where the checkpoints live, each with its commit strategy, writer lease,
            retention and reader (``tiers.py``): the folder, then any tier behind it.
        location: the folder as a :class:`~quicksave.storage.Location`.
        folder: its path or URL.
        metrics: one :class:`SaveRecord` per checkpoint written, completed when it commits.
        read_only_reason: why this session does not write (set by :meth:`take_folder`).
        last_good: the newest step known to pass its checks (loaded, or committed here).
        ledger: the failures noted and settled (``failures.py``).
        writer: the front end's :class:`AsyncWriter`, once it builds one (async modes).

    Raises:
        CheckpointError: ``config.folder`` is not a valid folder.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        process_group: dist.ProcessGroup | None = None,
        *,
        retention: RetentionPolicy | None = None,
    ) -> None:
        self.config = config
        location = parse_location(config.folder, what="checkpoint folder", options=config.storage)
        keep = retention or KeepLatestK(config.keep_latest_k)
        self.tiers: list[Tier] = [Tier.at(location, keep)]
        self.folder = location.url
        self.process_group = process_group
        self.metrics: list[SaveRecord] = []
        self.read_only_reason: str | None = None
        self.last_good: int | None = None
        self.ledger = FailureLedger(
            config.on_save_error, config.max_consecutive_failures, self.folder
        )
        self.outcome_vote = OutcomeVote(self.ledger)  # rides on each save's vote
        self.writer: AsyncWriter | None = None
        self.held: frozenset[int] = frozenset()  # a tier behind copies them: retention keeps
        self._lease: WriterLease | None = None  # held by a writing coordinator
        self._store: Backend | None = None  # the folder's backend (see backend())
        self._group: dist.ProcessGroup | None = None  # see checkpoint_group()
        self._housekeeping_due = False  # a commit was seen: retention may delete now
        self._leftovers: set[str] = set()  # failed saves' paths, for housekeeping
        self._leftovers_lock = threading.Lock()  # the housekeeper's thread reads them
        self._keeper: Housekeeper | None = None  # the lease holder's housekeeping thread

    @property
    def tier(self) -> Tier:
        """The folder's tier (the first)."""
        return self.tiers[0]

    @property
    def location(self) -> Location:
        return self.tier.location

    @property
    def retention(self) -> RetentionPolicy:
        return self.tier.retention

    @retention.setter
    def retention(self, policy: RetentionPolicy) -> None:
        self.tier.retention = policy

    # ---------------------------------------------------------------- ranks

    def rank(self) -> int | None:
        """This rank in ``process_group``; None without ``torch.distributed``."""
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(self.process_group)
        return None

    def world_size(self) -> int:
        """The ranks of ``process_group`` (1 without ``torch.distributed``)."""
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(self.process_group)
        return 1

    def is_coordinator(self) -> bool:
        """Rank 0 of the group: the one that takes the lease and deletes."""
        return (self.rank() or 0) == 0

    def info_level(self) -> int:
        """The level of the lines every rank would log alike (resume, commit): INFO on
        the coordinator, DEBUG on the others (``log_level="info"`` shows one line)."""
        return logging.INFO if self.is_coordinator() else logging.DEBUG

    def checkpoint_group(self) -> dist.ProcessGroup | None:
        """The gloo group of the checkpoint collectives (the interval agreement's votes,
        the saves' planning, settling): its own group, over the ranks of
        ``process_group``, so that checkpoint collectives never queue behind training
        ones, and with ``commit_timeout_s`` as its timeout, so that a rank that never
        arrives fails the others' save instead of hanging them. Created by the first
        call (creating it is collective: every rank makes that call alike)."""
        if self._group is None:
            ranks = (
                None
                if self.process_group is None
                else dist.get_process_group_ranks(self.process_group)
            )
            self._group = dist.new_group(
                ranks=ranks,
                backend="gloo",
                timeout=timedelta(seconds=self.config.commit_timeout_s),
            )
        return self._group

    def dist_context(self) -> DistContext:
        """Where multi-rank saves coordinate: the checkpoint group for the planning
        collective, and the default store for the commit records."""
        group = self.checkpoint_group()
        return DistContext(
            group=group,
            store=dist.distributed_c10d._get_default_store(),
            rank=dist.get_rank(group),
            world_size=dist.get_world_size(group),
            coordinator=0,
            commit_timeout_s=self.config.commit_timeout_s,
            rider=self.outcome_vote,
        )

    # ---------------------------------------------------------------- the folder

    def step_path(self, step: int) -> str:
        """The directory of the checkpoint of ``step``: ``<folder>/step-<step>``."""
        return self.location.child(f"step-{step}").url

    def export_path(self, step: int) -> str:
        """The directory of the model export of ``step``: ``<folder>/export-step-<step>``."""
        return self.location.child(f"export-step-{step}").url

    def where(self, path: str) -> Location:
        """The location of ``path`` (a step's path or URL), reached with the config's
        storage options."""
        return parse_location(path, options=self.config.storage)

    def backend(self) -> Backend | None:
        """The session's backend of the folder, opened once (a new S3 client is slow
        to make: once per session, not per save) and closed by :meth:`release`. Once
        the lease is held, every deletion through it re-checks the lease first (on an
        object store, where the lease is an object with an expiry)."""
        if self._store is None:
            # Never a hang, and a call of the training thread (a pre-check, retention)
            # ends well within the checkpoint group's timeout: the other ranks may be
            # waiting for this one in the next settling collective.
            budget = min(self.config.save_timeout_s, self.config.commit_timeout_s / 2)
            bounded = self.location.bounded(budget)
            self._store = bounded.open(rank=self.rank() or 0)
            if self._lease is not None:
                self._store = self._lease.guard(self._store)
        return self._store

    def committed_steps(self, *, allow_dcp: bool | None = None) -> list[int]:
        """Steps with a committed checkpoint in the folder, ascending (stock DCP ones
        with ``allow_dcp``, default ``config.allow_dcp``). Temporaries, quarantined
        checkpoints and directories without their commit are not listed."""
        dcp = self.config.allow_dcp if allow_dcp is None else allow_dcp
        return self.tier.reader.committed_steps(
            self.location, allow_dcp=dcp, backend=self.backend()
        )

    def is_committed(self, path: str) -> bool:
        """Whether a committed checkpoint is at ``path`` (False if that cannot be told)."""
        try:
            return classify(self.where(path), self.backend()) in COMMITTED
        except CheckpointError:
            return False

    def require_committed(self, step: int) -> Checkpoint:
        """The committed checkpoint of ``step``, classified once (a load hands it on, so
        that nothing classifies it again), or ``CheckpointNotFoundError`` /
        ``NotCommittedError`` naming the step and the committed steps."""
        return self.tier.reader.require_committed(
            self.location,
            self.where(self.step_path(step)),
            step,
            self.rank(),
            allow_dcp=self.config.allow_dcp,
            backend=self.backend(),
        )

    def writer_config(self, engine: EngineConfig) -> EngineConfig:
        """``engine`` for this session's writer: where this rank holds the folder's
        lease, its writer may remove a crashed save's leftover at a target."""
        return dataclasses.replace(engine, clear_uncommitted=self._lease is not None)

    def claim(self, path: str) -> bool:
        """A save is about to write ``path`` (training thread, no I/O): housekeeping
        leaves a leftover there alone from now on. False if housekeeping is removing
        one there right now (the save must not be made: it would race the deletion)."""
        return self._keeper is None or self._keeper.claim(path)

    def unclaim(self, path: str) -> None:
        """The save to ``path`` ended."""
        if self._keeper is not None:
            self._keeper.unclaim(path)

    def replace_uncommitted(self, path: str) -> None:
        """On the lease holder: delete an uncommitted leftover at ``path`` before a save
        writes there (it would block the commit). Elsewhere nothing."""
        if self._lease is not None:
            replace_uncommitted(self.where(path), self.backend())

    # ---------------------------------------------------------------- ownership

    def take_folder(self, *, read_only: str | None, hint: str) -> str | None:
        """Create the folder and, on the coordinator, take its writer lease (a warning
        naming the folder where the lease is not enforced) and clean up what crashed
        saves left. Sets and returns :attr:`read_only_reason` (None: this session writes).

        Args:
            read_only: why the caller asked not to write (then nothing is created,
                taken or cleaned, no rank talks, nothing is logged), or None.
            hint: what to do when another live job holds the lease (ends the message).

        Several ranks: every rank learns whether the coordinator got the lease (one
        all-reduce on the checkpoint group), so that all refuse to save alike instead
        of waiting for each other in a save's collectives.
        """
        if read_only is not None:
            self.read_only_reason = read_only
            return read_only
        reason: str | None = None
        create_folder(self.location, self.rank())
        if self.is_coordinator():
            self._lease, reason = take_writer_lease(self.location, hint, self.tier.lease)
            if self._lease is not None:
                stale = self.config.storage.stale_after_s
                clean_folder(self._lease, self.location, stale, backend=self.backend())
        if self.world_size() > 1:
            # The same one-integer MAX vote as the interval agreement: "any rank is
            # read-only" (only the coordinator can be, for the lease).
            any_read_only = agree_any_due(reason is not None, self.checkpoint_group()).wait()
            if any_read_only and reason is None:
                reason = "the coordinator could not take the folder's writer lease (see its log)"
        if reason is not None:
            logger.warning(
                "quicksave: %s is read-only here (loads work, saves raise): %s",
                self.folder,
                reason,
            )
        self.read_only_reason = reason
        return reason

    @property
    def lease(self) -> WriterLease | None:
        """The folder's writer lease where this rank holds it (and so may delete), else
        None (other ranks, read-only sessions, after :meth:`release`)."""
        return self._lease

    # ---------------------------------------------------------------- tracking

    @property
    def in_flight(self) -> set[int]:
        """Steps being written in the background (retention never touches them)."""
        return self.writer.in_flight_steps if self.writer is not None else set()

    def track(self, record: SaveRecord, handle: SaveHandle, begin: float) -> None:
        """Follow a save handed to the writer (``record.status == "in_flight"``) until
        :meth:`poll` sees it finish. ``begin``: ``time.monotonic()`` when the front
        end's save call started."""
        assert self.writer is not None
        self.writer.track(len(self.metrics), record, handle, begin)
        self.metrics.append(record)

    def committed(self, record: SaveRecord) -> None:
        """Note a checkpoint committed synchronously by this call (its record)."""
        self.metrics.append(record)
        log_committed(record, self.info_level())
        report(record, self.config.on_metrics)
        self._housekeeping_due = True
        if record.kind == "full":
            self.last_good = max(self.last_good or -1, record.step)
            self.ledger.committed(record.step)

    def write_failed(self, key: Key, path: str, error: CheckpointError, blocking_s: float) -> None:
        """Note a write of this call that failed before the writer had it (a synchronous
        save, a refused hand-off): the ledger's failure, and its record."""
        self.ledger.failed(key, error)
        step, kind = key
        asynchronous = self.writer is not None and kind == "full"
        mode = self.config.async_mode if asynchronous else "disabled"
        record = SaveRecord(
            step, kind, path, 0, blocking_s, status="failed", mode=mode, error=str(error)
        )
        self.metrics.append(record)
        report(record, self.config.on_metrics)

    def poll(self) -> list[CheckpointError]:
        """Collect the background saves that finished, without waiting: records, commit
        lines, the ledger; a commit makes housekeeping due. No I/O, raises nothing;
        returns the failures seen now (also noted in the ledger)."""
        if self.writer is None:
            return []
        finished, errors = self.writer.poll()
        self._finished(finished, errors)
        return errors

    def _finished(
        self, finished: list[tuple[int, SaveRecord]], errors: list[CheckpointError]
    ) -> None:
        for index, record in finished:
            self.metrics[index] = record
            self.unclaim(record.path)
            report(record, self.config.on_metrics)
            if record.status == "committed":
                log_committed(record, self.info_level())
                self._housekeeping_due = True
                if record.kind == "full" and (self.last_good or -1) < record.step:
                    self.last_good = record.step
            elif record.status == "failed":
                logger.warning(
                    "quicksave: the checkpoint of step %d was not committed (%s)",
                    record.step,
                    record.path,
                )
        self.ledger.note(finished, errors)

    def drain(self, timeout: float | None = None) -> list[CheckpointError]:
        """Wait for every save in flight (up to ``timeout``; default
        ``close_timeout_s``, at least ``save_timeout_s + 60`` while saves are in
        flight), then :meth:`poll`; returns its failures.

        Raises:
            CheckpointError: saves still in flight at the limit (named).
        """
        if self.writer is None:
            return []
        pending = sorted(self.in_flight)
        limit = self.config.close_timeout_s if timeout is None else timeout
        if timeout is None and pending:
            limit = max(limit, float(self.config.save_timeout_s) + 60.0)
        done = self.writer.drain(limit)
        errors = self.poll()
        if not done:
            left = sorted(self.in_flight)
            raise CheckpointError(
                f"saves of steps {left or pending} still in flight after {limit:g} s",
                path=self.folder,
                rank=self.rank(),
            )
        return errors

    def close_writer(self, timeout: float) -> list[CheckpointError]:
        """Stop the writer (waiting up to ``timeout`` for the saves in flight; one still
        in flight then is abandoned, and reported); returns the failures."""
        if self.writer is None:
            return []
        finished, errors = self.writer.close(timeout)
        self._finished(finished, errors)
        return errors

    # ---------------------------------------------------------------- failures

    def settle(self, *, agree: bool = True) -> None:
        """A settling point: every rank's failures so far combined alike on every rank
        (several ranks: one collective, ``agree_reports``, or none when this call's
        save vote carried the reports, ``OutcomeVote``; ``agree=False``: this rank
        alone), then acted on: logged, or raised (``config.on_save_error``).

        Raises:
            CheckpointError: the verdict says so (``failures.py``).
        """
        report = self.ledger.report()
        voted = self.outcome_vote.take()  # what this call's save vote agreed, if any
        if agree and self.world_size() > 1:
            reports = agree_reports(report, self.checkpoint_group(), self.rank() or 0, voted)
        else:
            reports = [report]
        verdict = self.ledger.settle(reports)
        for failure in verdict.failures:
            step, kind = failure.key
            if step is not None and self._lease is not None:
                with self._leftovers_lock:
                    self._leftovers.add(
                        self.export_path(step) if kind == "export" else self.step_path(step)
                    )
        log_verdict(verdict, self.config.on_save_error, self.is_coordinator())
        if verdict.raise_error is not None:
            raise verdict.raise_error

    def agree_failure(self, failure: CheckpointError | None) -> CheckpointError | None:
        """Several ranks: every rank's failure (or None) to every rank (one all-gather
        on the checkpoint group); returns the lowest failing rank's failure (it names
        its rank) on every rank alike, so that all ranks take the same branch (raise,
        or try the next checkpoint) and none waits in a collective the others left.
        One rank: ``failure``."""
        if self.world_size() == 1:
            return failure
        gathered = collectives.all_gather_object(failure, self.checkpoint_group())
        return next((f for f in gathered if f is not None), None)

    # ---------------------------------------------------------------- load

    def load_newest(self, load_step: Callable[[int, Checkpoint], None]) -> int | None:
        """Load the newest committed step that passes its checks with
        ``load_step(step, checkpoint)`` (older ones are tried after a corrupt one, which
        the lease holder moves aside as ``step-<N>.corrupt-*``): ``folder.load_newest``.
        The listing of the folder classifies each checkpoint: ``checkpoint`` is its
        result, not classified again. Returns the step loaded, or None if there is no
        committed step.

        Raises:
            CorruptCheckpointError: no committed step passes its checks.
        """
        on_corrupt = None
        if self._lease is not None:  # a writer moves a corrupt checkpoint aside

            def on_corrupt(candidate: int, why: str) -> None:
                quarantine(self.where(self.step_path(candidate)), why, self.backend())

        listed: dict[int, Checkpoint] = {}

        def list_steps() -> list[int]:
            kinds = committed_kinds(
                self.location, allow_dcp=self.config.allow_dcp, backend=self.backend()
            )
            listed.clear()
            for step, kind in kinds.items():
                listed[step] = Checkpoint(self.where(self.step_path(step)), kind)
            return sorted(listed)

        def load(step: int) -> None:
            load_step(step, listed[step])

        return load_newest(list_steps, load, on_corrupt, self.folder, self.rank())

    def loaded(self, step: int) -> None:
        """Note that ``step`` was loaded (it passes its checks: retention keeps it); the
        writer can plan its staging now that the optimizer states exist."""
        self.last_good = step
        if self.writer is not None:
            self.writer.prepare_if_due(background=False)

    # ---------------------------------------------------------------- retention

    def housekeep(self, protect: set[int] | None = None, *, wait: bool = False) -> None:
        """On the lease holder, once a commit was seen: remove what failed saves left,
        then apply retention (never a step in flight or in ``protect``). It runs in the
        housekeeper's thread (``housekeeper.py``): this call does no I/O and returns at
        once, unless ``wait`` (``wait()``, ``export()``, synchronous saves), which waits
        for it up to ``close_timeout_s``. Never raises: a failure is logged, and the work
        is tried again after the next commit (not at every call, which would stall each
        step on a store that is down)."""
        if self._lease is not None and self._housekeeping_due:
            self._housekeeping_due = False
            if self._keeper is None:
                name = f"quicksave-housekeeper-{self.folder}"
                self._keeper = Housekeeper(self._housekeep_now, name)
            # the steps in flight now (the thread never reads the writer's state itself)
            self._keeper.request((protect or set()) | self.in_flight | self.held)
        if wait and self._keeper is not None:
            self._keeper.wait_idle(self.config.close_timeout_s)

    def _housekeep_now(self, keeper: Housekeeper, protect: set[int]) -> None:
        """The housekeeper thread's round (see :meth:`housekeep`)."""
        try:
            with self._leftovers_lock:
                todo = sorted(self._leftovers)
            for path in todo:
                if not keeper.start_removing(path):
                    continue  # a save writes there now: its own check decides
                try:
                    self.replace_uncommitted(path)
                finally:
                    keeper.done_removing()
                with self._leftovers_lock:
                    self._leftovers.discard(path)
            self._retain(protect)
        except (CheckpointError, OSError) as e:
            logger.warning(
                "quicksave: retention or clean-up in %s failed on rank %s (%s); nothing is "
                "lost, it runs again after the next commit",
                self.folder,
                self.rank() or 0,
                e,
            )

    def retain(self, protect: set[int]) -> None:
        """Apply the retention policy now (lease holder only; raises what the deletion
        raises). Keeps the steps in flight, ``protect`` and :attr:`last_good`; nothing
        is deleted before some checkpoint is known to pass its checks."""
        self._retain(protect | self.in_flight | self.held)

    def _retain(self, keep_steps: set[int]) -> None:
        if self._lease is not None:  # only the lease holder deletes
            self.tier.retain(
                self._lease,
                keep_steps,
                self.last_good,
                stale_after_s=self.config.storage.stale_after_s,
                allow_dcp=self.config.allow_dcp,
                backend=self.backend(),
            )

    # ---------------------------------------------------------------- end

    def release(self) -> None:
        """Give the folder up: release the lease, close the store's backend.
        Idempotent. Housekeeping asked for and not done yet runs first (waited for up
        to ``close_timeout_s``)."""
        if self._keeper is not None:
            keeper, self._keeper = self._keeper, None
            if not keeper.stop(self.config.close_timeout_s):
                logger.warning(
                    "quicksave: housekeeping in %s still waits on the store after %g s; "
                    "left to end on its own",
                    self.folder,
                    self.config.close_timeout_s,
                )
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        if self._store is not None:
            self._store.close()
            self._store = None
