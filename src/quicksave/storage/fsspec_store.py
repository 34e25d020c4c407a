"""Any fsspec filesystem as a store: ``memory://``, ``gcs://``, ``hf://``, ``local://``...

Locations whose scheme quicksave does not serve itself (``file``, ``s3``, ``msc``) but
fsspec knows — registered and importable: ``fsspec.get_filesystem_class(protocol)``
succeeds — are reached through that filesystem (``fsspec.filesystem(protocol)``, with
fsspec's own configuration: its config files and environment variables). Lightning
accepts every such URL, so a ``QuicksaveCheckpointIO`` does too. A scheme fsspec does
not know, or whose package is missing (``gcs://`` without gcsfs), is an error that says
so (:func:`fsspec_protocol`): a destination quicksave does not understand is never a
guess.

The backend is a *store* (``atomic_rename = False``): checkpoints commit by writing
their manifest last (:mod:`quicksave.commit.manifest_last`), whatever the filesystem,
because fsspec promises no atomic rename of a directory. fsspec does not promise that a
write appears whole either (a local or SFTP filesystem writes in place), so :meth:`put`
writes each object under a temporary key beside it (``<key>.<token>.writing``) and then
moves it into place: a rename where the filesystem has one, a copy and a delete where it
does not (on such stores, quicksave's ``s3://`` and ``msc://`` backends are faster).

Keys are the filesystem's paths without its root marker (``memory://run/a`` has the key
``run/a``, the memory filesystem's path ``/run/a``, and is named ``memory:///run/a``).
``memory://`` lives in one process's memory:
:meth:`~quicksave.storage.location.Location.check_shared` refuses it where another
process would write (an async saver's worker process).

Torch-free; fsspec is imported only when such a location is parsed or opened.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import xxhash

from quicksave.checksum import hexdigest
from quicksave.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from quicksave.storage.backend import (
    AssembledWrites,
    ObjectInfo,
    Range,
    byte_view,
    check_ranges,
    get_checked_size,
    hash_ranges,
    scatter_by_copy,
)

# Filesystems that hold their files in this process's memory (another process sees
# other files under the same names).
PROCESS_LOCAL = frozenset({"memory"})


def fsspec_protocol(scheme: str, url: str) -> str:
    """``scheme`` if fsspec serves it here, for the URL ``url``.

    Raises:
        CheckpointError: fsspec is not installed, does not know ``scheme``, or needs a
            package for it that is not installed (named, with fsspec's own message).
    """
    try:
        import fsspec
    except ImportError:
        raise CheckpointError(
            f"unknown URL scheme {scheme!r}: quicksave serves paths, file://, s3:// and "
            "msc:// itself, and other schemes through fsspec, which is not installed "
            "(pip install fsspec)",
            path=url,
        ) from None
    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError:
        raise CheckpointError(
            f"unknown URL scheme {scheme!r}: neither quicksave (paths, file://, s3://, "
            "msc://) nor fsspec knows it",
            path=url,
        ) from None
    except ImportError as e:
        raise CheckpointError(
            f"the URL scheme {scheme!r} is served through fsspec, which needs a package "
            f"for it: {e}",
            path=url,
        ) from None
    return scheme


def fsspec_url(scheme: str, marker: str, key: str) -> str:
    """The URL of ``key`` on the fsspec filesystem of ``scheme`` whose root marker is
    ``marker`` (:func:`fsspec_key`'s): ``scheme://`` + the path, where the marker is the
    scheme itself (a filesystem whose paths are URLs: http) the path alone."""
    if marker.endswith("://"):
        return marker + key
    return f"{scheme}://{marker}{key}"


def fsspec_key(scheme: str, url: str) -> tuple[str, str]:
    """The root marker of the fsspec filesystem of ``scheme`` and the key of ``url``
    there: its path, as the filesystem reads the URL, without the root marker or a
    trailing ``/``."""
    import fsspec

    cls = fsspec.get_filesystem_class(scheme)
    path = cls._strip_protocol(url)
    marker = getattr(cls, "root_marker", "") or ""
    if path.startswith(f"{scheme}://"):  # a filesystem whose paths are URLs (http)
        marker = f"{scheme}://"
    if marker and path.startswith(marker):
        path = path[len(marker) :]
    return marker, path.strip("/")


class FsspecBackend(AssembledWrites):
    """One fsspec filesystem as a quicksave storage backend (see the module docstring).

    Args:
        protocol: the fsspec protocol (``memory``, ``gcs``, ...), checked by
            :func:`fsspec_protocol`.
    """

    atomic_rename = False

    def __init__(self, protocol: str) -> None:
        import fsspec

        self.scheme = protocol
        try:
            self._fs = fsspec.filesystem(protocol)
        except Exception as e:
            raise CheckpointError(
                f"cannot open the fsspec filesystem {protocol!r}: {type(e).__name__}: {e}",
                path=f"{protocol}://",
            ) from e
        self._marker = fsspec_key(protocol, f"{protocol}://quicksave")[0]  # as Location's

    # -- names ----------------------------------------------------------------------

    def url(self, key: str) -> str:
        return fsspec_url(self.scheme, self._marker, key)

    def _path(self, key: str) -> str:
        return self._marker + key.strip("/")

    def _key(self, path: str) -> str:
        path = self._fs._strip_protocol(path)
        if self._marker and path.startswith(self._marker):
            path = path[len(self._marker) :]
        return path.strip("/")

    def _failed(self, e: Exception, what: str, key: str) -> CheckpointError:
        if isinstance(e, FileNotFoundError):
            return CheckpointNotFoundError(f"{what} failed: no such object", path=self.url(key))
        return CheckpointError(f"{what} failed: {type(e).__name__}: {e}", path=self.url(key))

    # -- writing --------------------------------------------------------------------

    def put(self, key: str, data: memoryview, *, ranges: Sequence[Range] = ()) -> dict[str, str]:
        """Written under ``<key>.<token>.writing``, then moved to ``key``: the object
        appears whole or not at all (a failed write deletes the temporary)."""
        view = byte_view(data)
        check_ranges(ranges, len(view))
        digests = hash_ranges(view, ranges) if ranges else {}
        path = self._path(key)
        partial = f"{path}.{uuid.uuid4().hex[:12]}.writing"
        try:
            parent = path.rsplit("/", 1)[0] if "/" in path else ""
            if parent:
                self._fs.makedirs(parent, exist_ok=True)
            self._fs.pipe_file(partial, view.tobytes())
            self._fs.mv(partial, path)
        except Exception as e:
            try:
                self._fs.rm_file(partial)
            except Exception:
                pass  # never written, or the filesystem is gone: the lease holder's clean-up
            raise self._failed(e, "upload", key) from e
        return digests

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys``, then each folder they were in that is left empty (a
        filesystem keeps a directory, the memory filesystem a pseudo-directory, that
        would still show the removed checkpoint's name to a listing: Lightning's)."""
        parents = set()
        for key in dict.fromkeys(keys):
            try:
                self._fs.rm_file(self._path(key))
            except FileNotFoundError:
                continue
            except Exception as e:
                raise self._failed(e, "delete", key) from e
            if "/" in key.strip("/"):
                parents.add(key.strip("/").rsplit("/", 1)[0])
        for parent in sorted(parents, reverse=True):
            try:
                if not self._fs.ls(self._path(parent), detail=False):
                    self._fs.rmdir(self._path(parent))
            except Exception:  # not empty meanwhile, gone, or no directories at all
                continue

    def put_if(self, key: str, data: bytes, *, if_match: str | None = None) -> str | None:
        raise NotImplementedError("fsspec filesystems take no conditional writes")

    def abort_uploads(self, prefix: str, older_than_s: float) -> int:
        return 0

    # -- reading --------------------------------------------------------------------

    def read_into(self, key: str, offset: int, dest: memoryview) -> None:
        out = byte_view(dest, writable=True)
        if offset < 0:
            raise ValueError(f"negative offset {offset}")
        n = len(out)
        try:
            data = self._fs.cat_file(self._path(key), start=offset, end=offset + n)
        except Exception as e:
            raise self._failed(e, "read", key) from e
        if len(data) > n and len(data) >= offset + n:
            info = self.stat(key)  # a server that ignores ranges (a plain HTTP server)
            if info is not None and info.size == len(data):  # sent the whole object
                data = memoryview(data)[offset : offset + n]
        if len(data) != n:
            info = self.stat(key)
            have = f"{info.size} bytes long" if info is not None else "gone"
            raise CorruptCheckpointError(
                f"object is {have} but the read needs bytes [{offset}, {offset + n}) "
                f"({n} bytes): truncated or replaced",
                path=self.url(key),
            )
        out[:] = data

    def read_scatter(self, key: str, offset: int, dests: Sequence[memoryview]) -> None:
        scatter_by_copy(self, key, offset, dests)

    def get(self, key: str, max_bytes: int) -> bytes:
        get_checked_size(self, key, max_bytes)
        try:
            body = self._fs.cat_file(self._path(key))
        except Exception as e:
            raise self._failed(e, "read", key) from e
        if len(body) > max_bytes:
            raise CorruptCheckpointError(
                f"object is {len(body)} bytes, more than the {max_bytes} allowed for it",
                path=self.url(key),
            )
        return bytes(body)

    def get_tagged(self, key: str, max_bytes: int) -> tuple[bytes, str] | None:
        """The object and, as its version tag, its xxh3-64 (no store tag to ask for)."""
        try:
            data = self.get(key, max_bytes)
        except CheckpointNotFoundError:
            return None
        return data, hexdigest(xxhash.xxh3_64_intdigest(data))

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            info = self._fs.info(self._path(key))
        except FileNotFoundError:
            return None
        except Exception as e:
            raise self._failed(e, "stat", key) from e
        if info.get("type") != "file":
            return None
        return ObjectInfo(key, int(info.get("size") or 0), _mtime(info))

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``: the folder holding it is
        listed recursively and filtered."""
        folder = prefix if prefix.endswith("/") or not prefix else prefix.rpartition("/")[0]
        try:
            found = self._fs.find(self._path(folder), detail=True)
        except FileNotFoundError:
            return
        except Exception as e:
            raise self._failed(e, "list", prefix) from e
        for path, info in sorted(found.items()):
            key = self._key(path)
            if info.get("type") == "file" and key.startswith(prefix):
                yield ObjectInfo(key, int(info.get("size") or 0), _mtime(info))

    def children(self, prefix: str) -> list[str]:
        try:
            entries = self._fs.ls(self._path(prefix), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except Exception as e:
            raise self._failed(e, "list", prefix) from e
        base = prefix.strip("/")
        names = set()
        for path in entries:
            key = self._key(path)
            if key != base and key.startswith(base + "/" if base else ""):
                names.add(key[len(base) + 1 if base else 0 :].split("/", 1)[0])
        return sorted(names)

    def close(self) -> None:
        """Nothing: fsspec keeps one instance of a filesystem per process and arguments."""


def _mtime(info: dict[str, Any]) -> float:
    """The modification time fsspec reports, as POSIX seconds; now if it reports none
    (then a leftover never looks stale: a save still being written is never hit)."""
    for name in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(name)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        try:
            return float(value)
        except (TypeError, ValueError):
            continue
    return time.time()


def reserve_dir(scheme: str, marker: str, key: str) -> bool:
    """An empty directory at ``key`` of the fsspec filesystem of ``scheme`` where it has
    directories (``memory://``, ``local://``; a no-op on a store whose folders are only
    prefixes): True if one was made. Nothing is made where something is already."""
    import fsspec

    fs = fsspec.filesystem(scheme)
    path = marker + key
    try:
        if fs.exists(path):
            return False
        fs.makedirs(path, exist_ok=False)
        return bool(fs.isdir(path))
    except FileExistsError:  # the save's own writer got there first: nothing to hold
        return False
    except Exception as e:  # noqa: BLE001 - named, as every store failure
        raise CheckpointError(
            f"cannot reserve the checkpoint's name: {type(e).__name__}: {e}", path=path
        ) from e


def release_dir(scheme: str, marker: str, key: str) -> bool:
    """Remove :func:`reserve_dir`'s directory if it is still empty; True if removed."""
    import fsspec

    fs = fsspec.filesystem(scheme)
    path = marker + key
    try:
        if not fs.isdir(path) or fs.ls(path, detail=False):
            return False
        fs.rmdir(path)
    except Exception:  # noqa: BLE001 - gone, or not empty: left alone
        return False
    return True
