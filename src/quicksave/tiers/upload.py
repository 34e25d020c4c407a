"""The object-store tier: committed checkpoints of a local folder copied, in the
background, to ``<url>/step-<N>`` on an object store.

**What is copied**: the files of a checkpoint that committed in the local folder, read
back from there (never re-staged from the trainer's tensors); an incremental one
(FORMAT.md §9) self-contained, its holes filled from the local checkpoints holding
them (:mod:`quicksave.tiers.standalone`). Each rank copies the data
files its manifest entry names as its own (``FileEntry.rank``); rank 0 also the files of
no rank, and then commits by the object store's own rule
(:class:`~quicksave.commit.manifest_last.ManifestLastCommit`: one listing checks every
object of the manifest with its size, then the manifest, written last, is the commit).
A copy cut short leaves objects without a manifest: never listed, loaded or kept;
removed by rank 0 after a failed round, and (a killed trainer's) by the next round
that copies that step or the lease holder's clean-up of stale leftovers.

**When** (:class:`Uploader`): the training thread :meth:`~Uploader.offer`\\ s each step
due for upload once it sees it commit; a background thread copies it. At most one
upload is in flight per rank, and at most one step waits: a newer offer replaces the
waiting one (the store then lags by at most one upload, and holds fewer steps than
the folder when uploads are slower than the saves).

**Rounds** (several ranks): every rank's thread takes part in each round, over a gloo
group of its own (made once, by every rank alike, with ``commit_timeout_s`` as its
timeout), with three collectives::

    all_gather(offered step)   → the round's step: the largest (committed on every rank:
                                 a multi-rank checkpoint commits once for all of them)
    broadcast(rank 0's look)   → committed on the store already (skip), or free (a
                                 crashed copy's leftovers removed first)
    all_gather(copy outcome)   → every rank's files are there: rank 0 commits; else none

A round waits until every rank offered a step (each sees the commit at its next manager
call) or closes. A collective that fails (a rank died, the timeout) stops the uploads on
that rank (logged); the training and the folder go on.

A failed copy or commit is logged (naming the tier, rank, step and URL), counted in
:attr:`Uploader.failures`, and never touches the local folder.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from quicksave.commit import COMMITTED, CheckpointKind, open_strategy
from quicksave.commit.manifest_reader import read_manifest
from quicksave.commit.outputs import upload_file
from quicksave.errors import CheckpointError
from quicksave.format import MANIFEST_NAME
from quicksave.format.manifest import Manifest, to_json_bytes
from quicksave.ranks import collectives
from quicksave.storage import Location
from quicksave.storage.backend import Backend, join
from quicksave.tiers.standalone import references_by_file, standalone, upload_filled

logger = logging.getLogger("quicksave")

TIER = "object-store"
_NONE = -1  # a rank's offer in a round when it has nothing (it is closing)


@dataclass
class UploadLog:
    """What this rank's uploader did: the steps committed on the store (rank 0 knows;
    the others: every rank's copy succeeded), bytes this rank copied, seconds per
    round."""

    committed: list[int] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


class Uploader:
    """One rank's background uploads from ``source`` (a local folder of ``step-<N>``
    checkpoints) to ``target`` (an object store prefix).

    Call order: :meth:`offer` from the training thread after a due step committed in
    the source (every rank offers the same steps, at its own pace); :meth:`holding` for
    the steps the source's retention must keep; :meth:`close` once, on every rank.

    Args:
        source: the local folder.
        target: the object store folder.
        rank, world_size: this rank in ``group``.
        group: the uploads' gloo group (None with one rank).
        backend: ``target``'s backend (guarded by its writer lease on rank 0), used by
            the thread only.
        after_commit: rank 0, after a step committed on the store: its retention
            (called in the thread; what it raises is logged).
    """

    def __init__(
        self,
        source: Location,
        target: Location,
        rank: int,
        world_size: int,
        group: Any,
        backend: Backend,
        after_commit: Callable[[int], None] | None = None,
    ) -> None:
        self.source = source
        self.target = target
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.backend = backend
        self.after_commit = after_commit
        self.failures = 0
        self.last_error: CheckpointError | None = None
        self.stopped: str | None = None  # why the uploads stopped (a failed collective)
        self.log = UploadLog()
        self._cond = threading.Condition()
        self._waiting: int | None = None  # the newest step offered and not taken yet
        self._running: int | None = None  # the step being copied
        self._done = -1  # the newest step a round took
        self._closing = False
        self._thread = threading.Thread(
            target=self._run, name=f"quicksave-upload-{rank}", daemon=True
        )
        self._thread.start()

    def offer(self, step: int) -> None:
        """Upload ``step`` (committed in ``source``) when the thread is free; replaces a
        step still waiting. Steps not newer than the last one taken are ignored."""
        with self._cond:
            if self._closing or self.stopped or step <= self._done or step == self._running:
                return
            if self._waiting is None or step > self._waiting:
                self._waiting = step
                self._cond.notify_all()

    def holding(self) -> frozenset[int]:
        """The steps the source's retention must keep: the one being copied, the one
        waiting."""
        with self._cond:
            return frozenset(s for s in (self._running, self._waiting) if s is not None)

    def idle(self) -> bool:
        with self._cond:
            return self._running is None and self._waiting is None

    def close(self, timeout: float) -> bool:
        """Copy what is waiting, then stop (up to ``timeout``). Returns False if an
        upload was still running then (left to end on its own, never committed half)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning(
                "quicksave: the %s tier's upload to %s still runs on rank %d after %g s; "
                "left to end on its own",
                TIER,
                self.target.url,
                self.rank,
                timeout,
            )
            return False
        return True

    # ---------------------------------------------------------------- the thread

    def _take(self) -> int | None:
        """The step this rank offers in the next round: waits for an offer newer than
        the last round's (or the close); _NONE when closing with nothing (several
        ranks: the others may still have one); None: stop."""
        with self._cond:
            while True:
                if self._waiting is not None and self._waiting <= self._done:
                    self._waiting = None  # a round took a newer step meanwhile
                if self._waiting is not None or self._closing:
                    break
                self._cond.wait()
            step, self._waiting = self._waiting, None
            if step is None:
                return None if self.world_size == 1 else _NONE
            self._running = step
            return step

    def _run(self) -> None:
        while True:
            mine = self._take()
            if mine is None:
                return
            try:
                step = self._round(mine)
            except Exception as e:  # a collective failed: the ranks are out of step
                self.stopped = str(e)
                logger.error(
                    "quicksave: the %s tier's uploads to %s stopped on rank %d: %s",
                    TIER,
                    self.target.url,
                    self.rank,
                    e,
                )
                with self._cond:
                    self._running = self._waiting = None
                return
            with self._cond:
                self._running = None
                if step is None:  # every rank closes with nothing left
                    return
                self._done = max(self._done, step)

    def _round(self, mine: int) -> int | None:
        """One round (see the module docstring); the step it took, or None: none."""
        step = mine
        if self.world_size > 1:
            step = max(collectives.all_gather_object(mine, self.group))
            if step == _NONE:
                return None
            with self._cond:
                self._running = step
        begin = time.perf_counter()
        dest = self.target.child(f"step-{step}")
        look: str | None = None
        if self.rank == 0:
            look = self._prepare(dest, step)
        if self.world_size > 1:
            look = collectives.broadcast_object(look, 0, self.group)
        if look == "committed":
            return step
        error: str | None = look
        sent = 0
        if error is None:
            try:
                sent = self._copy(step, dest)
            except Exception as e:  # any failure of the copy is this round's
                error = f"rank {self.rank}: {e}"
                self._failed(step, dest, e)
        errors = [error]
        if self.world_size > 1:
            errors = collectives.all_gather_object(error, self.group)
        failed = [e for e in errors if e is not None]
        if self.rank == 0:
            if failed:
                logger.error(
                    "quicksave: the %s tier did not commit step %d at %s: %s",
                    TIER,
                    step,
                    dest.url,
                    "; ".join(failed),
                )
                self._discard(dest)
            else:
                self._commit(step, dest)
        elif not failed:
            self.log.committed.append(step)
        self.log.sent.append(sent)
        self.log.seconds.append(time.perf_counter() - begin)
        return step

    def _prepare(self, dest: Location, step: int) -> str | None:
        """Rank 0, before any rank copies: "committed" (there already), None (free:
        a crashed copy's objects removed), or why the step cannot be copied."""
        try:
            with open_strategy(dest, self.backend) as s:
                kind = s.classify(dest)
                if kind in COMMITTED:
                    logger.info("quicksave: %s holds step %d already", self.target.url, step)
                    return "committed"
                if kind is CheckpointKind.UNCOMMITTED:
                    s.remove(dest)  # objects without a manifest: a crashed copy's
        except CheckpointError as e:
            self._failed(step, dest, e)
            return f"rank 0: {e}"
        return None

    def _discard(self, dest: Location) -> None:
        """Rank 0, after a failed round (every rank's copy has ended): remove what was
        copied, best effort (objects without a manifest are invisible anyway, and the
        next copy of the step, or the lease holder's clean-up, removes what stays)."""
        try:
            with open_strategy(dest, self.backend) as s:
                if s.classify(dest) is CheckpointKind.UNCOMMITTED:
                    s.remove(dest)
        except CheckpointError as e:
            logger.warning("quicksave: could not remove the failed copy at %s: %s", dest.url, e)

    def _files(self, step: int) -> tuple[str, dict[str, int], list[str], Manifest]:
        """The local checkpoint's directory, every file of it the store must hold but
        the manifest (name -> size), the ones this rank copies, and its manifest."""
        where = self.source.child(f"step-{step}").key
        if not os.path.isfile(os.path.join(where, MANIFEST_NAME)):
            raise CheckpointError(
                f"the {TIER} tier copies checkpoints with a {MANIFEST_NAME}: none here",
                path=where,
                rank=self.rank,
            )
        manifest = read_manifest(where)
        expected = {name: entry.size for name, entry in manifest.files.items()}
        mine = [name for name, entry in manifest.files.items() if entry.rank == self.rank]
        if self.rank == 0:  # the files of no rank, and any the manifest does not name
            mine += [n for n, e in manifest.files.items() if e.rank is None]
            for name in sorted(os.listdir(where)):
                path = os.path.join(where, name)
                if name != MANIFEST_NAME and name not in expected and os.path.isfile(path):
                    expected[name] = os.path.getsize(path)
                    mine.append(name)
        return where, expected, mine, manifest

    def _copy(self, step: int, dest: Location) -> int:
        """Copy this rank's files of ``step``; returns the bytes copied."""
        where, _, mine, manifest = self._files(step)
        refs = references_by_file(manifest)
        sent = 0
        for name in mine:
            local = os.path.join(where, name)
            if name in refs:
                upload_filled(
                    self.backend,
                    join(dest.key, name),
                    self.source.child(f"step-{step}"),
                    name,
                    refs[name],
                    self.rank,
                )
            else:
                upload_file(self.backend, join(dest.key, name), local)
            sent += os.path.getsize(local)
        return sent

    def _commit(self, step: int, dest: Location) -> None:
        """Rank 0, once every rank's files are there: the manifest, last."""
        try:
            where, expected, _, parsed = self._files(step)
            if parsed.bases():  # the copy holds every byte: it refers to nothing
                manifest = to_json_bytes(standalone(parsed))
            else:
                with open(os.path.join(where, MANIFEST_NAME), "rb") as f:
                    manifest = f.read()
            with open_strategy(dest, self.backend) as s:
                s.commit(dest.key, dest, {MANIFEST_NAME: manifest}, expected)
        except Exception as e:  # logged, counted; the next round goes on
            self._failed(step, dest, e)
            return
        self.log.committed.append(step)
        logger.info("quicksave: uploaded step %d to %s", step, dest.url)
        if self.after_commit is not None:
            try:
                self.after_commit(step)
            except Exception as e:  # it runs again after the next commit
                logger.warning(
                    "quicksave: the %s tier's retention in %s failed: %s",
                    TIER,
                    self.target.url,
                    e,
                )

    def _failed(self, step: int, dest: Location, error: BaseException) -> None:
        self.failures += 1
        self.last_error = error if isinstance(error, CheckpointError) else None
        logger.error(
            "quicksave: the %s tier's upload of step %d on rank %d to %s failed "
            "(training goes on; the local folder is untouched): %s",
            TIER,
            step,
            self.rank,
            dest.url,
            error,
        )
