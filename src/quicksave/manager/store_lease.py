"""The writer lease of a checkpoint folder on an object store (``s3://``, ``msc://``).

Why: a store has no ``flock``. Two writers on one prefix (two jobs launched by mistake)
each believed they owned it, and one deleted the other's in-flight save as "an
uncommitted leftover". Here the lease is one small JSON object,
``<folder>/.quicksave-lease.json`` (:class:`LeaseRecord`): who holds it (host, pid, a
random token, start time), when it was last renewed, and after how long without
renewal it expires.

Taking it (the coordinator of a writing manager, when the manager is built):

- no lease object: create it, conditionally (``If-None-Match: *``): of two writers
  starting at once exactly one wins;
- released by its holder (``close()``): replace it (``If-Match`` its version);
- held by a process of this machine (same host, boot and pid namespace): that process
  alive and renewing → read-only at once; gone (no such pid, or a new process under it)
  → take it over;
- held elsewhere: not renewed for ``expiry_s`` by our clock → expired, take it over;
  otherwise watch it: a renewal seen means its holder lives → read-only; none seen
  during ``expiry_s`` of our own (monotonic) watching → expired, take it over. A live
  holder is recognised within one renewal whatever the clocks say; a dead one on another
  machine costs at most one expiry period of waiting. A lease object this version cannot
  read (a newer format?) is watched the same way, on our own terms.

Holding: a daemon thread renews it every ``renew_s``, conditionally on the version it
wrote last (``If-Match``). A refused renewal means that another writer took it over: the
lease is lost (logged as an error) and this job deletes nothing from then on.

Deleting: every deletion of the holder goes through :meth:`StoreLease.guard`'s backend,
which first re-reads the lease (our token still there, renewed recently). After taking
over an *expired* lease the new holder deletes nothing until it has held the lease for
one expiry period itself (had the old holder lived, its next renewal would have been
refused within that time and it stopped deleting), and leftovers go only once nothing
was written into them for ``expiry_s`` (``leftover_age_s``): the old holder's workers,
had they lived, would have written something.

Stores that do not honour conditions are found by a probe (a scratch object created
twice with ``If-None-Match: *`` and replaced with a wrong ``If-Match``: both must be
refused). There the lease is best-effort: plain writes, each read back after a settle
pause; two writers starting within that pause of each other may both write. It is
logged as a warning, and clean-up keeps the age rule of ``stale_after_s``.

Clocks: expiry judged from timestamps assumes the hosts' clocks agree to within
``expiry_s - renew_s`` (NTP); watching needs no clock agreement.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from quicksave.errors import CheckpointError, CheckpointNotFoundError
from quicksave.manager.lease_record import (
    LEASE_NAME,
    MAX_LEASE_BYTES,
    Holder,
    LeaseRecord,
    describe_holder,
    this_process,
)
from quicksave.storage import Location
from quicksave.storage.backend import Backend, join

__all__ = ["LEASE_NAME", "GuardedBackend", "Holder", "LeaseRecord", "StoreLease", "this_process"]

logger = logging.getLogger("quicksave")

SETTLE_S = 1.0  # best-effort mode: how long a write must stay ours before it counts
_MAX_CONTESTS = 20  # our conditional write lost to another writer this often: give up


class StoreLease:
    """The writer lease of an object-store folder; see the module docstring. Same
    interface as :class:`~quicksave.manager.lease.FolderLease`.

    Call order (the coordinator only): :meth:`try_acquire` once (it may watch a lease
    held elsewhere for up to ``lease_expiry_s``), then deletions only through
    :meth:`guard`'s backend, clean-up ages from :meth:`leftover_age_s` and
    :meth:`cleanup_due`, and :meth:`release` at the end (``close()``).

    Args:
        folder: the checkpoint folder; ``folder.options`` gives ``lease_expiry_s`` and
            ``lease_renew_s``.
        clock: POSIX seconds (the timestamps in the lease); monotonic: for watching and
            holding periods; sleep; me: the holder this process is. Injectable for tests.

    Attributes:
        enforced: whether the store honours conditional writes (known after
            :meth:`try_acquire`); False: best-effort.
        previous: how the previous holder left, once held: ``"none"`` (no lease object
            was there), ``"released"``, ``"gone"`` (a dead process of this machine) or
            ``"expired"``.
        renewals: renewals made by this holder.
    """

    def __init__(
        self,
        folder: Location,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        me: Holder | None = None,
    ) -> None:
        opts = folder.options
        self.expiry_s = float(opts.lease_expiry_s)
        self.renew_s = float(opts.lease_renew_s)
        if not (self.renew_s > 0 and self.expiry_s >= 2 * self.renew_s):
            raise CheckpointError(
                f"StorageOptions: lease_renew_s={self.renew_s:g} must be > 0 and at most half "
                f"of lease_expiry_s={self.expiry_s:g}",
                path=folder.url,
            )
        self.folder = folder.url
        self.path = folder.child(LEASE_NAME).url
        self.enforced = True
        self.previous: str | None = None
        self.renewals = 0
        self._location = folder
        self._key = join(folder.key, LEASE_NAME)
        self._clock, self._monotonic, self._sleep = clock, monotonic, sleep
        self._me = me if me is not None else this_process()
        self._token = secrets.token_hex(16)
        self._backend: Backend | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._record: LeaseRecord | None = None  # what we wrote last
        self._tag: str | None = None  # its version on the store
        self._acquired_at = 0.0  # monotonic
        self._last_ok = 0.0  # monotonic, last write of ours that the store took
        self._lost: LeaseRecord | str | None = None  # who took it from us
        self._other: LeaseRecord | None = None  # the live holder that refused us
        self._cleanup_pending = False
        self._waited = False

    # ------------------------------------------------------------------ taking

    @property
    def held(self) -> bool:
        return self._record is not None and self._lost is None

    @property
    def unenforced_why(self) -> str:
        return (
            "the store ignores conditional writes (If-None-Match/If-Match): the writer "
            "lease is best-effort there (two writers starting within about "
            f"{SETTLE_S:g} s of each other may both write)"
        )

    def try_acquire(self) -> bool:
        """Take the lease unless a live writer holds it (see the module docstring).

        Returns:
            True if this process holds it now; False if another live writer does
            (:meth:`holder` names it).

        Raises:
            CheckpointError: the store cannot be reached or refuses (named), or the
                lease keeps changing hands.
        """
        if self.held:
            return True
        if self._backend is None:
            # every request well within one expiry period: a renewal never hangs
            self._backend = self._location.bounded(self.expiry_s / 2).open()
        b = self._backend
        self.enforced = self._probe(b)
        seen: tuple[str, float] | None = None  # (version, monotonic) first watched
        contests = 0
        while contests < _MAX_CONTESTS:
            current = self._read(b)
            if current is None:
                if self._take(b, None, "none"):
                    return True
                contests += 1
                continue
            record, tag = current
            if record is not None and record.token == self._token:
                self._adopt(record, tag, self.previous or "none")  # our write's answer was lost
                return True
            if seen is not None and tag != seen[0] and not (record and record.released):
                self._other = record  # renewed (or taken) while we watched: it lives
                return False
            verdict = self._judge(record, tag, seen)
            if verdict == "live":
                self._other = record
                return False
            if verdict == "watch":
                renew_s, expiry_s = _terms(record, self)
                if seen is None:
                    seen = (tag, self._monotonic())
                    logger.info(
                        "quicksave: %s is held by %s; watching it for up to %g s for a renewal",
                        self.folder,
                        describe_holder(record),
                        expiry_s,
                    )
                self._sleep(min(max(renew_s / 2, 0.05), expiry_s))
                continue
            if self._take(b, tag, verdict):
                return True
            contests += 1
            seen = None
        raise CheckpointError("the folder's writer lease keeps changing hands", path=self.path)

    def _judge(self, record: LeaseRecord | None, tag: str, seen: tuple[str, float] | None) -> str:
        """``"live"``, ``"watch"``, or how the lease is free: ``"released"``,
        ``"gone"``, ``"expired"``."""
        if record is None:  # not a lease this version reads (a newer one's?): watch it
            if seen is not None and self._monotonic() - seen[1] >= self.expiry_s:
                return "expired"
            return "watch"
        if record.released:
            return "released"
        expired = self._clock() - record.renewed_at > record.expiry_s
        if self._me.same_machine(record.holder):
            if not record.holder.alive():
                return "gone"
            return "expired" if expired else "live"
        if expired:
            return "expired"
        if seen is not None and self._monotonic() - seen[1] >= record.expiry_s:
            return "expired"  # no renewal during a whole expiry period of our own watching
        return "watch"

    def _take(self, b: Backend, tag: str | None, previous: str) -> bool:
        """Write our lease over version ``tag`` (None: where there is none)."""
        now = self._clock()
        record = LeaseRecord(
            self._token, self._me, now, now, 0, self.expiry_s, self.renew_s, released=False
        )
        data = record.encode()
        if self.enforced:
            written = b.put_if(self._key, data, if_match=tag)
            if written is None:
                back = self._read(b)  # refused, or a retry of a write that landed?
                if back is None or back[0] is None or back[0].token != self._token:
                    return False
                record, written = back[0], back[1]
        else:
            b.put(self._key, memoryview(data))
            self._sleep(SETTLE_S)
            back = self._read(b)
            if back is None or back[0] is None or back[0].token != self._token:
                return False
            written = back[1]
        self._adopt(record, written, previous)
        return True

    def _adopt(self, record: LeaseRecord, tag: str, previous: str) -> None:
        self._record, self._tag, self.previous = record, tag, previous
        self._acquired_at = self._last_ok = self._monotonic()
        self._cleanup_pending = self.enforced and previous != "none"
        if previous != "none":
            logger.info("quicksave: took over the writer lease of %s (%s)", self.folder, previous)
        self._stop.clear()
        self._thread = threading.Thread(
            target=_heartbeat,
            args=(weakref.ref(self), self._stop, self.renew_s),
            name="quicksave-lease",
            daemon=True,
        )
        self._thread.start()

    def _probe(self, b: Backend) -> bool:
        """Whether the store honours ``If-None-Match: *`` and ``If-Match`` (a scratch
        object, deleted afterwards)."""
        key = join(self._location.key, f".quicksave-lease-probe-{secrets.token_hex(8)}")
        try:
            first = b.put_if(key, b"1", if_match=None)
            if first is None:
                return False  # a fresh key refused: conditions are not understood
            again = b.put_if(key, b"2", if_match=None)
            wrong = b.put_if(key, b"3", if_match='"0000000000000000"')
            return again is None and wrong is None
        except NotImplementedError:
            return False
        finally:
            try:
                b.delete([key])
            except CheckpointError as e:
                logger.warning("quicksave: could not delete the lease probe %s: %s", b.url(key), e)

    def _read(self, b: Backend) -> tuple[LeaseRecord | None, str] | None:
        """The lease there and its version (None: no lease object)."""
        try:
            got = b.get_tagged(self._key, MAX_LEASE_BYTES)
        except NotImplementedError:  # best-effort stores: the content is the version
            try:
                raw = b.get(self._key, MAX_LEASE_BYTES)
            except CheckpointNotFoundError:
                return None
            got = (raw, raw.hex())
        if got is None:
            return None
        return LeaseRecord.decode(got[0]), got[1]

    # ------------------------------------------------------------------ holding

    def _renew(self) -> bool:
        """One renewal; False when the lease turned out to be another writer's."""
        with self._lock:
            b, mine = self._backend, self._record
            if b is None or mine is None or self._lost is not None:
                return False
            record = dataclasses.replace(
                mine, renewed_at=self._clock(), renewals=mine.renewals + 1, released=False
            )
            if self.enforced:
                tag = b.put_if(self._key, record.encode(), if_match=self._tag)
                if tag is None:
                    back = self._read(b)
                    if back is None or back[0] is None or back[0].token != self._token:
                        self._lose(back[0] if back is not None else "nobody (deleted)")
                        return False
                    record, tag = back  # a write of ours landed; its answer was lost
            else:
                back = self._read(b)
                if back is None or back[0] is None or back[0].token != self._token:
                    self._lose(back[0] if back is not None else "nobody (deleted)")
                    return False
                b.put(self._key, memoryview(record.encode()))
                tag = None
            self._record, self._tag = record, tag
            self._last_ok = self._monotonic()
            self.renewals += 1
            return True

    def _lose(self, to: LeaseRecord | str | None) -> None:
        self._lost = to
        logger.error(
            "quicksave: lost the writer lease of %s to %s: another job writes this folder; "
            "this job deletes nothing there from now on (stop one of the two jobs)",
            self.folder,
            describe_holder(to),
        )

    def before_delete(self) -> None:
        """Called before every deletion of the holder: after a take-over of an expired
        lease, wait until it has been held for one expiry period; then check that it is
        still ours (re-read: our token) and was renewed recently.

        Raises:
            CheckpointError: it is not held, was lost, or could not be renewed lately
                (named; nothing may be deleted then).
        """
        if self._record is None:
            raise CheckpointError("deleting without the folder's writer lease", path=self.path)
        left = self._probation_left()
        if left > 0:
            if not self._waited:
                logger.info(
                    "quicksave: took over an expired writer lease of %s: waiting %.1f s more "
                    "before deleting anything the previous holder left",
                    self.folder,
                    left,
                )
                self._waited = True
            self._sleep(left)
        if self._lost is not None:
            raise CheckpointError(
                f"this job lost the folder's writer lease to {describe_holder(self._lost)}; it "
                "deletes nothing",
                path=self.path,
            )
        assert self._backend is not None
        back = self._read(self._backend)
        if back is None or back[0] is None or back[0].token != self._token:
            self._lose(back[0] if back is not None else "nobody (deleted)")
            raise CheckpointError(
                "the folder's writer lease is no longer this job's; nothing deleted",
                path=self.path,
            )
        stale = self._monotonic() - self._last_ok
        if stale > self.expiry_s - self.renew_s:
            raise CheckpointError(
                f"the folder's writer lease was last renewed {stale:.1f} s ago (the store "
                "did not take the renewals): it may be taken over any moment; nothing deleted",
                path=self.path,
            )

    def guard(self, backend: Backend | None) -> Backend | None:
        """``backend`` with every deletion preceded by :meth:`before_delete` (closing it
        closes ``backend``); None: the lease's own backend so guarded, usable while the
        lease is held (closing it closes nothing)."""
        if backend is not None:
            return GuardedBackend(backend, self.before_delete)
        if self._backend is None:
            raise CheckpointError("the folder's writer lease is not held", path=self.path)
        return GuardedBackend(self._backend, self.before_delete, owns=False)

    def _probation_left(self) -> float:
        if self.previous != "expired":
            return 0.0
        return max(0.0, self._acquired_at + self.expiry_s - self._monotonic())

    def leftover_age_s(self, stale_after_s: float) -> float | None:
        """How old a leftover of a crashed save must be for the clean-up to remove it
        now; None: not yet (probation after taking over an expired lease). Leftovers of
        unknown writers (no lease was there) and best-effort leases keep
        ``stale_after_s``."""
        if not self.enforced or self.previous in (None, "none"):
            return stale_after_s
        if self._probation_left() > 0:
            return None
        return min(stale_after_s, self.expiry_s)

    def cleanup_due(self, stale_after_s: float) -> float | None:
        """Once, when one expiry period has passed since taking over a lease from a
        known previous holder: the age for a second clean-up pass (what the first one
        had to leave, being too young); None otherwise."""
        if not self._cleanup_pending or self._lost is not None:
            return None
        if self._monotonic() - self._acquired_at < self.expiry_s:
            return None
        self._cleanup_pending = False
        return min(stale_after_s, self.expiry_s)

    def holder(self) -> str:
        """Who holds the lease (for messages): the live writer that refused us."""
        return describe_holder(self._other)

    def held_by_this_process(self) -> bool:
        """Whether the live writer that refused us is this very process (another
        manager in it renews the lease)."""
        if self._other is None:
            return False
        here = this_process()
        return self._other.holder.pid == here.pid and self._other.holder.same_machine(here)

    def release(self) -> None:
        """Stop renewing and mark the lease released (conditionally: never over another
        writer's), so that the next writer takes it at once. Logs, never raises: an
        unreleased lease expires by itself. Idempotent."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(self.expiry_s)
        b, self._backend = self._backend, None
        if b is None:
            return
        try:
            with self._lock:
                mine, self._record = self._record, None
                if mine is None or self._lost is not None:
                    return
                done = dataclasses.replace(mine, renewed_at=self._clock(), released=True)
                if self.enforced:
                    b.put_if(self._key, done.encode(), if_match=self._tag)
                else:
                    back = self._read(b)
                    if back is not None and back[0] is not None and back[0].token == self._token:
                        b.put(self._key, memoryview(done.encode()))
        except CheckpointError as e:
            logger.warning(
                "quicksave: could not release the writer lease %s (%s); it expires in %g s",
                self.path,
                e,
                self.expiry_s,
            )
        finally:
            b.close()


def _heartbeat(ref: Callable[[], StoreLease | None], stop: threading.Event, every: float) -> None:
    """The renewal thread: holds the lease only weakly, so that a lease nobody holds
    any more (a manager dropped without close()) stops renewing and expires."""
    failing = False
    while not stop.wait(every):
        lease = ref()
        if lease is None:
            return
        try:
            if not lease._renew():
                return
            if failing:
                logger.info("quicksave: renewed the writer lease of %s again", lease.folder)
            failing = False
        except Exception as e:  # noqa: BLE001 - the thread must outlive a bad moment
            if not failing:
                logger.warning(
                    "quicksave: could not renew the writer lease of %s: %s (retrying every "
                    "%g s; it expires %g s after the last renewal)",
                    lease.folder,
                    e,
                    every,
                    lease.expiry_s,
                )
            failing = True
        del lease


def _terms(record: LeaseRecord | None, mine: StoreLease) -> tuple[float, float]:
    """(renew_s, expiry_s) of a lease: its own, or ours for one we cannot read."""
    if record is None:
        return mine.renew_s, mine.expiry_s
    return record.renew_s, record.expiry_s


class GuardedBackend:
    """A backend whose deletions (``delete``, ``abort_uploads``) first call ``check``
    (the lease holder's :meth:`StoreLease.before_delete`); everything else is the inner
    backend's."""

    def __init__(self, inner: Backend, check: Callable[[], None], *, owns: bool = True) -> None:
        self._inner = inner
        self._check = check
        self._owns = owns

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def delete(self, keys: Iterable[str]) -> None:
        todo = list(keys)
        if todo:
            self._check()
            self._inner.delete(todo)

    def abort_uploads(self, prefix: str, older_than_s: float) -> int:
        self._check()
        return self._inner.abort_uploads(prefix, older_than_s)

    def close(self) -> None:
        if self._owns:
            self._inner.close()
