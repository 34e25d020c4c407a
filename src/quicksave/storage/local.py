"""The local filesystem behind the backend protocol.

Keys are absolute paths. Writes go through :func:`quicksave.storage.posix_io.write_image`
(``O_DIRECT`` where the filesystem takes it, chunk checksums on the way, ``fsync``);
reads through :mod:`quicksave.storage.safeio` (regular files only: no symbolic links, FIFOs or
devices, bounded by the file's size). A directory renames atomically, so local
checkpoints commit by renaming their temporary directory (:mod:`quicksave.commit`).

Torch-free: the worker process imports it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
import time
from collections.abc import Iterable, Iterator, Sequence

import xxhash

from quicksave.checksum import hexdigest
from quicksave.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from quicksave.storage.backend import ObjectInfo, Range, byte_view
from quicksave.storage.posix_io import os_error, write_durable, write_image, write_pieces
from quicksave.storage.safeio import open_regular, read_regular

# errnos of a filesystem without flock or hard links: no conditional writes there
_UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM, errno.EXDEV}
_LOCK_WAIT_S = 5.0  # a replacer holds the lock for one check and one rename


def preadv_full(fd: int, views: Sequence[memoryview], offset: int) -> int:
    """Fill ``views`` in turn from ``fd`` at ``offset`` (``preadv`` until done); returns
    the bytes read, fewer only where the file ends."""
    views, got = list(views), 0
    while views:
        n = os.preadv(fd, views, offset + got)
        if n == 0:
            break
        got += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if views:
            views[0] = views[0][n:]
    return got


class LocalBackend:
    """Files under the local filesystem (keys are absolute paths).

    Args:
        fsync: make every written file durable before ``put`` returns.
        o_direct: write with ``O_DIRECT`` where the filesystem allows it.
        rank: named in errors.
        write_rate: bytes per second each ``put`` writes at most (None: no limit).
    """

    scheme = "file"
    atomic_rename = True

    def __init__(
        self,
        *,
        fsync: bool = True,
        o_direct: bool = True,
        rank: int = 0,
        write_rate: float | None = None,
    ) -> None:
        self.fsync = fsync
        self.o_direct = o_direct
        self.rank = rank
        self.write_rate = write_rate

    def url(self, key: str) -> str:
        return key

    def _make_parent(self, key: str) -> None:
        parent = os.path.dirname(key)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise os_error(e, parent, self.rank) from e

    def put(self, key: str, data: memoryview, *, ranges: Sequence[Range] = ()) -> dict[str, str]:
        self._make_parent(key)
        return write_image(
            key,
            data,
            len(data),
            list(ranges),
            rank=self.rank,
            fsync=self.fsync,
            o_direct=self.o_direct,
            rate=self.write_rate,
        )

    def put_padded(
        self, key: str, image: memoryview, size: int, ranges: Sequence[Range]
    ) -> dict[str, str]:
        """``put`` of ``image[:size]`` where ``image`` extends to a page boundary past
        ``size`` (a staging pool's file image), so that ``O_DIRECT`` writes whole pages.
        The directory must exist (the job's commit strategy prepared it): a writer late
        after a discard must not create it again."""
        return write_image(
            key,
            image,
            size,
            list(ranges),
            rank=self.rank,
            fsync=self.fsync,
            o_direct=self.o_direct,
            rate=self.write_rate,
        )

    def put_pieces(
        self, key: str, size: int, pieces: Iterable[tuple[str | None, int, memoryview]]
    ) -> dict[str, str]:
        self._make_parent(key)
        return write_pieces(
            key,
            size,
            pieces,
            rank=self.rank,
            fsync=self.fsync,
            o_direct=self.o_direct,
            rate=self.write_rate,
        )

    def read_into(self, key: str, offset: int, dest: memoryview) -> None:
        self.read_scatter(key, offset, [dest])

    def read_scatter(self, key: str, offset: int, dests: Sequence[memoryview]) -> None:
        views = [v for v in map(byte_view, dests) if len(v)]  # lengths in bytes
        try:
            f = open_regular(key, what="file", rank=self.rank)
        except FileNotFoundError:
            raise CheckpointNotFoundError("no such file", path=key, rank=self.rank) from None
        want = sum(len(v) for v in views)
        try:
            if preadv_full(f.fd, views, offset) < want:
                raise CorruptCheckpointError(
                    f"file ends at {f.size} bytes, before {offset + want}",
                    path=key,
                    rank=self.rank,
                )
        except OSError as e:
            raise CheckpointError(f"cannot read: {e.strerror}", path=key, rank=self.rank) from e
        finally:
            os.close(f.fd)

    def get(self, key: str, max_bytes: int) -> bytes:
        try:
            return read_regular(key, max_bytes, rank=self.rank)
        except FileNotFoundError:
            raise CheckpointNotFoundError("no such file", path=key, rank=self.rank) from None

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            st = os.lstat(key)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        top = prefix if os.path.isdir(prefix) else os.path.dirname(prefix)
        for root, dirs, files in os.walk(top):
            dirs.sort()
            for name in sorted(files):
                path = os.path.join(root, name)
                if path.startswith(prefix):
                    info = self.stat(path)
                    if info is not None:
                        yield info

    def children(self, prefix: str) -> list[str]:
        try:
            return sorted(os.listdir(prefix))
        except OSError:
            return []

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(key)

    def abort_uploads(self, prefix: str, older_than_s: float) -> int:
        return 0  # files are written in place: there are no pending uploads

    def get_tagged(self, key: str, max_bytes: int) -> tuple[bytes, str] | None:
        """The file and its version tag: the xxh3-64 of its content (a file is only ever
        replaced whole, by :meth:`put_if`'s rename)."""
        try:
            data = read_regular(key, max_bytes, rank=self.rank)
        except FileNotFoundError:
            return None
        return data, _content_tag(data)

    def put_if(self, key: str, data: bytes, *, if_match: str | None = None) -> str | None:
        """The new content goes to a file of its own beside ``key`` (fsynced), which is
        then hard-linked to ``key`` (create: ``link`` fails if ``key`` exists, as
        ``O_EXCL`` does) or renamed over it (replace) under an exclusive ``flock`` of the
        file it replaces, whose tag is checked under that lock: replacers of one version
        take turns, and the later one finds another file there."""
        body = bytes(byte_view(data))
        directory, name = os.path.split(key)
        spare = os.path.join(directory, f".{name}.put-{secrets.token_hex(8)}")
        try:
            write_durable(spare, body)
            if if_match is None:
                try:
                    os.link(spare, key)
                except FileExistsError:
                    return None
            elif not self._replace_if(key, spare, if_match):
                return None
            dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as e:
            if e.errno in _UNSUPPORTED:
                raise NotImplementedError(f"{key}: no hard links or locks here") from e
            raise CheckpointError(
                f"conditional write failed: {e.strerror}", path=key, rank=self.rank
            ) from e
        finally:
            with contextlib.suppress(OSError):
                os.unlink(spare)
        return _content_tag(body)

    def _replace_if(self, key: str, spare: str, tag: str) -> bool:
        """Rename ``spare`` over ``key`` if the file there has ``tag``; False if not."""
        try:
            fd = os.open(key, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return False
        try:
            if not lock_within(fd, time.monotonic() + _LOCK_WAIT_S):
                raise CheckpointError(
                    f"conditional write: the file stayed locked for {_LOCK_WAIT_S:g} s",
                    path=key,
                    rank=self.rank,
                )
            st = os.fstat(fd)
            try:
                now = os.lstat(key)
            except FileNotFoundError:
                return False
            if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
                return False  # replaced meanwhile: ours would overwrite a newer version
            if _content_tag(os.pread(fd, st.st_size, 0)) != tag:
                return False
            os.rename(spare, key)
            return True
        finally:
            os.close(fd)

    def close(self) -> None:
        pass


def _content_tag(data: bytes) -> str:
    return hexdigest(xxhash.xxh3_64_intdigest(data))


def dir_files(path: str) -> dict[str, int]:
    """Every file under ``path`` (relative name -> ``lstat`` size), without following
    symbolic links and without recursion (a hostile tree may nest deeply); entries that
    vanish or cannot be read while listing are skipped."""
    found: dict[str, int] = {}
    stack = [path]
    while stack:
        top = stack.pop()
        try:
            entries = list(os.scandir(top))
        except OSError:  # vanished (a stale temp being cleaned) or unreadable
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                else:
                    found[os.path.relpath(entry.path, path)] = entry.stat(
                        follow_symlinks=False
                    ).st_size
            except OSError:
                pass
    return found


def lock_within(fd: int, deadline: float) -> bool:
    """Take an exclusive ``flock`` on ``fd``, trying until ``deadline``
    (``time.monotonic()``); False if another holder kept it that long."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
