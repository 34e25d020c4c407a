"""Reading the members of one checkpoint directory, on any backend.

Everything that reads a checkpoint (load, verify, inspect, ls, convert) goes through
:class:`CheckpointDir`: the names it holds, a small member read whole (the manifest,
``.metadata``, a part), and data files opened for ranged reads. On the local filesystem
members are opened through :mod:`quicksave.storage.safeio` (regular files only, never followed
out of the directory); on object stores a member is an object under the checkpoint's
prefix, and a name from a checkpoint is still checked to be a plain name.

Torch-free: the worker process imports it.
"""

from __future__ import annotations

import os
import stat
from typing import Protocol

from quicksave.errors import CheckpointNotFoundError, CorruptCheckpointError
from quicksave.storage.backend import Backend
from quicksave.storage.cold_read import ColdReader, Seen
from quicksave.storage.local import dir_files, preadv_full
from quicksave.storage.location import Location, parse_location
from quicksave.storage.safeio import member_path, open_regular, read_regular


class Member(Protocol):
    """An opened file of a checkpoint: its size and positional reads."""

    size: int

    def pread_into(self, view: memoryview, offset: int) -> int:
        """Read up to ``len(view)`` bytes at ``offset``; 0 at the end."""
        ...

    def read_scatter(self, views: list[memoryview], offset: int) -> int:
        """Fill ``views`` in turn from ``offset`` on (on a store: one request); returns
        the bytes read, fewer only where the file ends."""
        ...

    def read_into(self, view: memoryview, offset: int, seen: Seen | None = None) -> int:
        """Fill ``view`` from ``offset``, handing each piece to ``seen`` (a checksum's
        ``update``) in order as it lands; returns the bytes read, fewer only where the
        file ends. A local file's bytes not in the page cache come with ``O_DIRECT``
        (:mod:`~quicksave.storage.cold_read`)."""
        ...

    def close(self) -> None: ...


class _LocalMember:
    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self._cold = ColdReader(fd, size)

    def pread_into(self, view: memoryview, offset: int) -> int:
        return os.preadv(self.fd, [view], offset)

    def read_into(self, view: memoryview, offset: int, seen: Seen | None = None) -> int:
        got = 0
        if not self._cold.resident(offset, len(view)):
            got = self._cold.read_into(view, offset, seen)  # short: O_DIRECT refused, or EOF
        return got + fill(self, view[got:], offset + got, seen)

    def read_scatter(self, views: list[memoryview], offset: int) -> int:
        return preadv_full(self.fd, views, offset)

    def close(self) -> None:
        self._cold.close()
        os.close(self.fd)


class _StoreMember:
    def __init__(self, backend: Backend, key: str, size: int) -> None:
        self.backend, self.key, self.size = backend, key, size

    def pread_into(self, view: memoryview, offset: int) -> int:
        n = max(0, min(len(view), self.size - offset))
        if n:
            self.backend.read_into(self.key, offset, view[:n])
        return n

    def read_scatter(self, views: list[memoryview], offset: int) -> int:
        want = sum(len(v) for v in views)
        if offset + want > self.size:  # only what the object holds
            views = _first(views, max(0, self.size - offset))
        self.backend.read_scatter(self.key, offset, views)
        return min(want, max(0, self.size - offset))

    def read_into(self, view: memoryview, offset: int, seen: Seen | None = None) -> int:
        return fill(self, view, offset, seen)

    def close(self) -> None:
        pass


def fill(f: Member, view: memoryview, offset: int, seen: Seen | None = None) -> int:
    """:meth:`Member.read_into` through ``f.pread_into``: ``view`` filled from
    ``offset`` (fewer bytes only where the file ends), then handed to ``seen`` whole."""
    got = 0
    while got < len(view):
        n = f.pread_into(view[got:], offset + got)
        if n == 0:
            break
        got += n
    if got and seen is not None:
        seen(view[:got])
    return got


def read_range(
    f: Member,
    offset: int,
    length: int,
    *,
    path: str,
    what: str = "file",
    fqn: str | None = None,
    rank: int | None = None,
    exact: bool = True,
) -> bytes:
    """Exactly ``length`` bytes of the opened member ``f`` from ``offset`` (on a store:
    one ranged request), checked against its size before anything is allocated; with
    ``exact=False`` up to ``length`` (fewer where the member ends: a verifier reading
    what is there).

    Raises:
        CorruptCheckpointError: the range ends beyond the member (``exact``), or a read
            fails.
    """
    if not exact:
        length = max(0, min(length, f.size - offset))
    if offset < 0 or length < 0 or offset + length > f.size:
        raise CorruptCheckpointError(
            f"{what}: bytes {offset}..{offset + length} lie beyond the {f.size} bytes of the "
            "file (truncated?)",
            path=path,
            fqn=fqn,
            rank=rank,
        )
    buf = bytearray(length)
    view = memoryview(buf)
    got = 0
    try:
        while got < length:
            n = f.pread_into(view[got:], offset + got)
            if n == 0 and not exact:
                break
            if n == 0:
                raise CorruptCheckpointError(
                    f"{what}: the file ends at byte {offset + got}, before byte "
                    f"{offset + length} (truncated while read?)",
                    path=path,
                    fqn=fqn,
                    rank=rank,
                )
            got += n
    except OSError as e:
        raise CorruptCheckpointError(
            f"cannot read {what}: {e.strerror or e}", path=path, fqn=fqn, rank=rank
        ) from None
    finally:
        view.release()
    del buf[got:]
    return bytes(buf)


def _first(views: list[memoryview], n: int) -> list[memoryview]:
    """The first ``n`` bytes of ``views`` (taken in turn)."""
    out = []
    for v in views:
        if n <= 0:
            break
        out.append(v[:n])
        n -= len(out[-1])
    return out


class CheckpointDir:
    """One checkpoint directory (or prefix) to read from.

    Args:
        location: a path, URL or :class:`Location`.
        backend: an open backend serving ``location`` (shared, not closed here);
            default: one is opened and closed by :meth:`close`.
        rank: named in errors.
    """

    def __init__(
        self,
        location: str | os.PathLike[str] | Location,
        backend: Backend | None = None,
        *,
        rank: int | None = None,
    ) -> None:
        self.location = parse_location(location)
        self._owns = backend is None
        self.backend = backend if backend is not None else self.location.open()
        self.rank = rank

    @property
    def url(self) -> str:
        return self.location.url

    @property
    def is_local(self) -> bool:
        return self.location.is_local

    @property
    def reads_in_runs(self) -> bool:
        """Whether adjacent chunks are best read in one request each run (an object
        store: every request is a round trip), not one by one (a file)."""
        return not self.is_local

    def read_threads(self, wanted: int) -> int:
        """Threads to read members with: ``wanted`` from files; at least 8 from a store,
        whose requests mostly wait on the network."""
        return wanted if self.is_local else max(wanted, 8)

    def size_of(self, name: str) -> int | None:
        """The size of the member ``name`` if it is a regular file (an object), else
        None."""
        info = self.backend.stat(self._key(name, None))
        return None if info is None else info.size

    def describe(self, name: str) -> str:
        """What the member ``name`` is, for a report: "directory", "file" or "object"."""
        if not self.is_local:
            return "object"
        try:
            is_dir = stat.S_ISDIR(os.lstat(self._key(name, None)).st_mode)
        except OSError:
            is_dir = False
        return "directory" if is_dir else "file"

    def __enter__(self) -> CheckpointDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._owns:
            self.backend.close()

    def member_url(self, name: str) -> str:
        return self.backend.url(self._key(name, None))

    def member_key(self, name: str) -> str:
        """The backend's key of the member ``name`` (a plain name: checked)."""
        return self._key(name, None)

    def _key(self, name: str, fqn: str | None) -> str:
        if self.is_local:
            return member_path(self.location.key, name, fqn=fqn)
        member_path(self.location.key, name, fqn=fqn)  # the same plain-name check
        return f"{self.location.key}/{name}" if self.location.key else name

    def names(self) -> set[str]:
        """The names directly in the directory.

        Raises:
            FileNotFoundError: nothing is there (a store: no object under the prefix).
            NotADirectoryError: a local file is there.
        """
        if self.is_local:
            return set(os.listdir(self.location.key))
        names = self.backend.children(self.location.key)
        if not names:
            raise FileNotFoundError(self.url)
        return set(names)

    def read(
        self,
        name: str,
        max_bytes: int,
        *,
        what: str = "file",
        too_large: str | None = None,
        fqn: str | None = None,
        rank: int | None = None,
    ) -> bytes:
        """The whole member ``name``, refused unread past ``max_bytes``.

        Raises:
            FileNotFoundError: no such member.
            CorruptCheckpointError: not a regular file, too large, unreadable.
        """
        key = self._key(name, fqn)
        rank = self.rank if rank is None else rank
        if self.is_local:
            return read_regular(key, max_bytes, what=what, too_large=too_large, fqn=fqn, rank=rank)
        url = self.backend.url(key)
        try:  # one request: get refuses an object over max_bytes before reading it
            return self.backend.get(key, max_bytes)
        except CheckpointNotFoundError:
            raise FileNotFoundError(url) from None
        except CorruptCheckpointError as e:  # the protocol's one refusal of get: too large
            raise CorruptCheckpointError(
                too_large or f"{what}: {e.message}", path=url, fqn=fqn, rank=rank
            ) from None

    def open(
        self, name: str, *, what: str = "file", fqn: str | None = None, rank: int | None = None
    ) -> Member:
        """Open the member ``name`` for positional reads; the caller closes it.

        Raises:
            FileNotFoundError: no such member.
            CorruptCheckpointError: not a regular file (local).
        """
        key = self._key(name, fqn)
        rank = self.rank if rank is None else rank
        if self.is_local:
            f = open_regular(key, what=what, fqn=fqn, rank=rank)
            return _LocalMember(f.fd, f.size)
        info = self.backend.stat(key)
        if info is None:
            raise FileNotFoundError(self.backend.url(key))
        return _StoreMember(self.backend, key, info.size)

    def sizes(self) -> dict[str, int]:
        """Every object under the directory (recursive: ``sub/name``) and its size."""
        if self.is_local:
            return dir_files(self.location.key)
        prefix = self.location.key + "/" if self.location.key else ""
        return {o.key[len(prefix) :]: o.size for o in self.backend.list(prefix)}
