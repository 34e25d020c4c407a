"""The local filesystem behind the backend protocol.

Keys are absolute paths. Writes go through :func:`quicksave.persist.write_image`
(``O_DIRECT`` where the filesystem takes it, chunk checksums on the way, ``fsync``);
reads through :mod:`quicksave.safeio` (regular files only: no symbolic links, FIFOs or
devices, bounded by the file's size). A directory renames atomically, so local
checkpoints commit by renaming their temporary directory (:mod:`quicksave.commit`).

Torch-free: the worker process imports it.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable, Iterator, Sequence

from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..persist import write_image
from ..safeio import open_regular, read_regular
from .backend import ObjectInfo, Range, byte_view


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

    def put(self, key: str, data: memoryview, *, ranges: Sequence[Range] = ()) -> dict[str, str]:
        parent = os.path.dirname(key)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise CheckpointError(
                f"cannot create the directory: {e.strerror}", path=parent, rank=self.rank
            ) from e
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
        ``size`` (a staging pool's file image), so that ``O_DIRECT`` writes whole pages."""
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

    def close(self) -> None:
        pass
