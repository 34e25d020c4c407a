"""The writer lease of a checkpoint folder: one job writes a folder at a time.

Why a lease: anything that deletes in a folder (start-up clean-up of temporaries left by
crashes, retention, quarantine of a bad checkpoint) must know that no live job is
writing there, or it tears that job's checkpoints (an eval script that builds a manager
on the folder of a running job would otherwise delete the job's in-flight temporaries).

The lease is an exclusive ``flock`` on ``<folder>/.quicksave-lock``, taken by the
coordinator of a writing :class:`~quicksave.manager.CheckpointManager` when it is built
and held until ``close()``. The kernel releases it when the holder dies, even by
SIGKILL, so "the lease is free" proves that the previous writer is gone: no heartbeat,
no clock, no guessing from ages. ``flock`` works across the machines of an NFSv4 mount
(Linux emulates it with POSIX locks there). On a filesystem without locks (e.g. Lustre
mounted without ``-o flock``) ownership cannot be enforced: the manager says so in a
warning and writes without a lease.

The file also holds a line naming the holder (host, pid, start time), only to make the
error of a refused writer useful; it is never trusted for anything else.

Object stores have no locks: their lease is an object with a heartbeat and an expiry
(:class:`~quicksave.manager.store_lease.StoreLease`), behind the same interface
(:class:`WriterLease`). Which one a folder gets is its scheme's (``Scheme.lease``: a
name looked up in the folder's ``StorageOptions.leases``, then in :data:`LEASES`).
:func:`take_writer_lease` and :func:`clean_folder` are the one way the manager and the
torchtitan integration take a folder and clean it up.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
import weakref
from collections.abc import Callable, Collection
from typing import Protocol

from quicksave.errors import CheckpointError
from quicksave.manager.folder import clean_leftovers
from quicksave.manager.store_lease import StoreLease
from quicksave.storage import Location
from quicksave.storage.backend import Backend
from quicksave.storage.registry import Registry

logger = logging.getLogger("quicksave")

LEASE_NAME = ".quicksave-lock"
_MAX_HOLDER_BYTES = 4096
# errnos of a filesystem that has no working flock: ownership cannot be enforced there
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


class FolderLease:
    """The writer lease of ``folder``; see the module docstring.

    Call order: :meth:`try_acquire` (once; True if this process now holds the lease),
    then :meth:`release` when done (``close()`` of the manager), which also removes the
    file. A lease that is never released is released when the object is
    garbage-collected or the process exits (the file then stays, unlocked: harmless).

    Attributes:
        folder: the checkpoint folder (absolute).
        path: the lock file.
        enforced: False when the filesystem has no locks (then every writer "holds" it).
    """

    unenforced_why = "no working file locks here"

    def __init__(self, folder: str) -> None:
        self.folder = os.path.abspath(folder)
        self.path = os.path.join(self.folder, LEASE_NAME)
        self.enforced = True
        self._fd: int | None = None
        self._finalizer: weakref.finalize | None = None

    @classmethod
    def at(cls, folder: Location) -> FolderLease:
        """The lease of the local folder ``folder`` (its registry entry, ``"flock"``)."""
        return cls(folder.key)

    # The kernel proves the previous holder gone: nothing to wait for, nothing to re-check.
    def guard(self, backend: Backend | None) -> Backend | None:
        return backend

    def leftover_age_s(self, stale_after_s: float) -> float | None:
        return 0.0

    def cleanup_due(self, stale_after_s: float) -> float | None:
        return None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self) -> bool:
        """Take the lease if no live process holds it.

        Returns:
            True if this process holds it now; False if another live process does.

        Raises:
            CheckpointError: the lock file cannot be created or opened (read-only or
                foreign folder, a symlink planted in its place, ...), naming it.
        """
        if self._fd is not None:
            return True
        for _ in range(100):  # retried only while holders come and go meanwhile
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            except OSError as e:
                if e.errno not in _NO_LOCKS:
                    os.close(fd)
                    raise CheckpointError(
                        f"cannot lock the folder's writer lease: {e.strerror}", path=self.path
                    ) from e
                self.enforced = False
            if not self._is_current(fd):
                # The holder released it and removed the file after we opened it: our
                # lock is on a dead inode. Try again on the file that is there now.
                os.close(fd)
                continue
            self._fd = fd
            self._finalizer = weakref.finalize(self, os.close, fd)
            self._write_holder(fd)
            return True
        raise CheckpointError("the folder's writer lease keeps changing hands", path=self.path)

    def release(self) -> None:
        """Give the lease up: remove the lock file (while still holding it, so that
        nobody can lock a file that is about to vanish) and close it. Idempotent."""
        if self._fd is not None and self._is_current(self._fd):
            try:
                os.unlink(self.path)
            except OSError:  # a read-only folder: the file stays, unlocked
                pass
        if self._finalizer is not None:
            self._finalizer()  # closes the fd once, which releases the lock
        self._fd = None
        self._finalizer = None

    def _open(self) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            return os.open(self.path, flags, 0o644)
        except OSError as e:
            raise CheckpointError(
                f"cannot open the folder's writer lease: {e.strerror}", path=self.path
            ) from e

    def _is_current(self, fd: int) -> bool:
        """Whether ``fd`` is the file now at ``path``."""
        try:
            st, now = os.fstat(fd), os.lstat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)

    def holder(self) -> str:
        """Who holds the lease, as the holder wrote it (for messages only)."""
        info = self._holder_line()
        try:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"])))
            return f"pid {int(info['pid'])} on host {str(info['host'])[:255]!r} since {since}"
        except (ValueError, KeyError, TypeError, OverflowError):
            return "an unknown process"

    def held_by_this_process(self) -> bool:
        """Whether the holder that refused us is this very process (another manager
        in it holds the lock: ``flock`` refuses a second open file of one process)."""
        info = self._holder_line()
        return info.get("pid") == os.getpid() and info.get("host") == socket.gethostname()

    def _holder_line(self) -> dict:
        """The holder's line in the lock file, parsed ({} if it cannot be read)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return {}
        try:
            raw = os.read(fd, _MAX_HOLDER_BYTES)
        except OSError:
            return {}
        finally:
            os.close(fd)
        try:
            info = json.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            return {}
        return info if isinstance(info, dict) else {}

    def _write_holder(self, fd: int) -> None:
        line = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()})
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (line + "\n").encode(), 0)
        except OSError:  # informative only: the lock is what counts
            pass


class WriterLease(Protocol):
    """What the manager asks of a folder's writer lease (:class:`FolderLease`,
    :class:`~quicksave.manager.store_lease.StoreLease`, or a user's, registered in
    ``StorageOptions.leases``). Called by the coordinator of a writing manager only:
    :meth:`try_acquire` once, then :meth:`guard` for the backend deletions go through,
    :meth:`leftover_age_s` / :meth:`cleanup_due` for what clean-up may remove, and
    :meth:`release` at ``close()``.

    Attributes:
        enforced: whether another writer is really kept out (False: a filesystem
            without locks, a store without conditional writes; the manager warns).
        unenforced_why: why not, for that warning.
    """

    enforced: bool
    unenforced_why: str

    @property
    def held(self) -> bool: ...

    def try_acquire(self) -> bool:
        """True if this process holds the lease now; False if a live writer does."""
        ...

    def release(self) -> None:
        """Give the lease up (idempotent)."""
        ...

    def holder(self) -> str:
        """Who holds it, for messages."""
        ...

    def held_by_this_process(self) -> bool: ...

    def guard(self, backend: Backend | None) -> Backend | None:
        """The backend deletions go through: one that refuses to delete once the lease
        is lost, where losing it is possible."""
        ...

    def leftover_age_s(self, stale_after_s: float) -> float | None:
        """How old a crashed save's leftover must be for start-up clean-up to remove
        it; None: none may go yet."""
        ...

    def cleanup_due(self, stale_after_s: float) -> float | None:
        """The age for a deferred clean-up after a save, once one is due; else None."""
        ...


# The built-in leases (name -> the lease of a folder); ``StorageOptions.leases`` adds to
# them, and a scheme's entry names one (``Scheme.lease``).
LEASES: Registry[Callable[[Location], WriterLease]] = Registry(
    {"flock": FolderLease.at, "store": StoreLease}
)


def lease_kind(folder: Location) -> Callable[[Location], WriterLease]:
    """What makes the writer lease of ``folder``: the entry its scheme names
    (``Scheme.lease``) in ``folder.options.leases``, else in :data:`LEASES`.

    Raises:
        CheckpointError: the scheme names a lease no registry holds (named).
    """
    leases: Registry[Callable[[Location], WriterLease]] = folder.options.leases.over(LEASES)
    return leases.require(folder.entry.lease, "writer lease", path=folder.url)


def lease_for(folder: Location) -> WriterLease:
    """A new (not yet acquired) writer lease of ``folder``, of :func:`lease_kind`."""
    return lease_kind(folder)(folder)


def take_writer_lease(
    folder: Location, hint: str, make: Callable[[Location], WriterLease] | None = None
) -> tuple[WriterLease | None, str | None]:
    """Take ``folder``'s writer lease (the coordinator of a writing manager, once), made
    by ``make`` (default: :func:`lease_kind`'s).

    Returns:
        ``(lease, None)`` when held (a warning is logged where it is not enforced), or
        ``(None, why)``: why this writer must be read-only (the live holder, named; or
        the lease could not be taken). ``hint`` ends the first message (what to do).

    Raises:
        CheckpointError: the folder's scheme names a lease no registry holds.
    """
    lease = (make or lease_kind(folder))(folder)
    try:
        got = lease.try_acquire()
    except CheckpointError as e:
        lease.release()
        return None, f"cannot take the folder's writer lease ({e.message}: {e.path})"
    if not got:
        here = lease.held_by_this_process()
        who = lease.holder()
        lease.release()  # holds nothing: closes its connections
        if here:
            return None, (
                f"this process ({who}) holds the folder's writer lease already: another "
                "manager in this process writes to this folder; close() that one first, "
                "use another folder, or build this one read-only to only load"
            )
        return None, (
            f"another live process holds the folder's writer lease ({who}); "
            f"two jobs must not write one folder: {hint}"
        )
    if not lease.enforced:
        logger.warning(
            "quicksave: %s: %s; one job per folder is not enforced here",
            folder.url,
            lease.unenforced_why,
        )
    return lease, None


def clean_folder(
    lease: WriterLease,
    folder: Location,
    stale_after_s: float,
    *,
    backend: Backend | None = None,
    keep: Collection[str] = (),
    deferred: bool = False,
) -> None:
    """The lease holder's clean-up of what crashed saves left in ``folder``: at start-up
    (``deferred=False``: what the lease allows now) and, called after each save with
    ``deferred=True``, once more when the lease says that the previous holder's younger
    leftovers may go too. ``keep``: names never touched (saves in flight). Deletions go
    through ``backend``, which should be ``lease.guard``-ed."""
    age = lease.cleanup_due(stale_after_s) if deferred else lease.leftover_age_s(stale_after_s)
    if age is None:
        return
    clean_leftovers(folder, age, keep=keep, backend=backend)
