"""The Multi-Storage Client backend: :class:`MscBackend`, the
:class:`~quicksave.storage.backend.Backend` of one MSC profile (``msc://<profile>/<key>``),
driven through MSC's public ``StorageClient`` (and, for conditional writes and tagged
reads, the profile's storage provider). How bytes move is in the package docstring
(:mod:`quicksave.storage.msc`).

Made by ``Location.open`` (any rank, and the worker process): it imports MSC, finds the
config (:mod:`~quicksave.storage.msc.config`), makes the client, and translates every
failure through :class:`~quicksave.storage.msc.errors.MscErrors`. Torch-free.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xxhash

from quicksave.checksum import hexdigest
from quicksave.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from quicksave.storage.backend import (
    AssembledWrites,
    ObjectInfo,
    Range,
    StorageOptions,
    byte_view,
    check_ranges,
    get_checked_size,
    hash_ranges,
    scatter_by_copy,
)
from quicksave.storage.msc.config import build_client, import_msc, locate_config
from quicksave.storage.msc.errors import MscErrors, profile_url
from quicksave.storage.transfer_pool import TransferPool

READ_PIECE = 32 << 20  # bytes per ranged GET of a large read_into
MAX_CONCURRENCY = 8  # ranged GETs in flight per read_into (and the pool's size)


class _ViewReader(io.RawIOBase):
    """A read-only, seekable binary file over a memoryview, for MSC's ``upload_file``.

    ``read`` returns ``bytes`` (a copy of the piece asked for: botocore refuses a
    memoryview body); ``readinto`` copies straight into the caller's buffer; ``getvalue``
    is the view itself (MSC's POSIX provider asks for it to learn the size).
    """

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = len(self._view) + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if pos < 0:
            raise ValueError(f"negative seek position {pos}")
        self._pos = pos
        return pos

    def read(self, size: int | None = -1) -> bytes:
        start = min(self._pos, len(self._view))
        stop = len(self._view) if size is None or size < 0 else min(start + size, len(self._view))
        self._pos = stop
        return self._view[start:stop].tobytes()

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, b: Any) -> int:
        dest = memoryview(b).cast("B")
        start = min(self._pos, len(self._view))
        n = min(len(dest), len(self._view) - start)
        dest[:n] = self._view[start : start + n]
        self._pos = start + n
        return n

    def getvalue(self) -> memoryview:
        return self._view

    def __len__(self) -> int:
        return len(self._view)


class MscBackend(AssembledWrites):
    """One MSC profile as a quicksave storage backend (see the module docstring).

    Args:
        profile: the MSC profile name (``msc://<profile>/...``).
        options: ``options.msc_config`` names the MSC config file; ``None`` uses MSC's
            own search (``$MSC_CONFIG``, then MSC's default paths).
        read_piece: bytes per ranged GET when ``read_into`` splits a large read.
        max_concurrency: ranged GETs in flight per ``read_into`` (upload parallelism is
            the profile's ``max_concurrency`` option, read by MSC's S3 provider).

    Retries: MSC's ``retry`` config (default 3 attempts with backoff) over the provider's
    own (botocore "standard" mode for S3); both are bounded in count and time.
    """

    scheme = "msc"
    atomic_rename = False

    def __init__(
        self,
        profile: str,
        options: StorageOptions | None = None,
        *,
        read_piece: int = READ_PIECE,
        max_concurrency: int = MAX_CONCURRENCY,
    ) -> None:
        if not profile or "/" in profile:
            raise CheckpointError(f"invalid MSC profile name {profile!r}")
        self.profile = profile
        self._options = options if options is not None else StorageOptions()
        self._read_piece = max(1, int(read_piece))
        self._max_concurrency = max(1, int(max_concurrency))
        self._lock = threading.Lock()
        self._closed = False
        msc = import_msc()
        self._msc_types = msc.types
        self.config_file, secrets = locate_config(msc, profile, self._options, self.url(""))
        retryable = getattr(msc.types, "RetryableError", None)
        self._errors = MscErrors(profile, self.config_file, secrets, retryable)
        self._client = build_client(msc, self._options, self._errors)
        self._pool = TransferPool(self._max_concurrency, "quicksave-msc")
        self._hasher = ThreadPoolExecutor(2, thread_name_prefix="quicksave-msc-hash")

    def _live(self) -> Any:
        client = self._client
        if self._closed or client is None:
            raise CheckpointError("the MSC backend is closed", path=self.url(""))
        return client

    # -- the Backend protocol ----------------------------------------------------------

    def url(self, key: str) -> str:
        return profile_url(self.profile, key)

    def put(self, key: str, data: memoryview, *, ranges: Sequence[Range] = ()) -> dict[str, str]:
        """Store ``data`` as ``key`` (whole or not at all) and return the xxh3-64 of every
        ``(name, offset, length)`` range, hashed on another thread while uploading.

        Small objects are one PUT (MSC reads them into one ``bytes``: a copy of the
        object); large ones are multipart uploads driven by MSC's provider, which reads
        each part into its own buffer (a copy per part, a bounded few at a time) and aborts
        the upload if any part fails.
        """
        client = self._live()
        view = byte_view(data)
        n = len(view)
        check_ranges(ranges, n)
        hashed: Future[dict[str, str]] | None = (
            self._hasher.submit(hash_ranges, view, tuple(ranges)) if ranges else None
        )
        try:
            client.upload_file(key, _ViewReader(view))
        except BaseException as e:
            if hashed is not None:
                hashed.cancel()
            if isinstance(e, Exception):
                self._errors.raise_(e, "upload", key)
            raise
        return hashed.result() if hashed is not None else {}

    def read_into(self, key: str, offset: int, dest: memoryview) -> None:
        """Fill ``dest`` with ``key[offset : offset + len(dest)]``: one ranged read, or
        ``read_piece``-sized ranged reads in parallel for a large range. Each piece comes
        back from MSC as ``bytes`` and is copied into ``dest``."""
        client = self._live()
        out = byte_view(dest, writable=True)
        n = len(out)
        if offset < 0:
            raise ValueError(f"negative offset {offset}")
        if n == 0:
            if self.stat(key) is None:
                raise CheckpointNotFoundError("read failed: no such object", path=self.url(key))
            return
        pieces = [(p, min(self._read_piece, n - p)) for p in range(0, n, self._read_piece)]
        short = False
        try:
            if len(pieces) == 1:
                short = not self._read_piece_into(client, key, offset, out)
            else:
                done = self._pool.run(
                    [
                        (
                            lambda stop, p=p, size=size: self._read_piece_into(
                                client, key, offset + p, out[p : p + size]
                            )
                        )
                        for p, size in pieces
                    ]
                )  # none still writes into dest once this returns or raises
                short = not all(done)
        except CheckpointNotFoundError:
            raise
        except Exception as e:
            info = self._stat_quiet(key)
            if info is not None and info.size < offset + n:
                raise self._short(key, info.size, offset, n) from None
            self._errors.raise_(e, "read", key)
        if short:
            info = self._stat_quiet(key)
            raise self._short(key, info.size if info else None, offset, n)

    def _read_piece_into(self, client: Any, key: str, offset: int, out: memoryview) -> bool:
        """Read ``len(out)`` bytes at ``offset`` into ``out``; False if the object ended."""
        try:
            data = client.read(key, byte_range=self._msc_types.Range(offset, len(out)))
        except Exception as e:
            if isinstance(e, FileNotFoundError):
                self._errors.raise_(e, "read", key)
            raise
        got = memoryview(data).cast("B")
        if len(got) != len(out):
            k = min(len(got), len(out))
            out[:k] = got[:k]
            return False
        out[:] = got
        return True

    def _short(self, key: str, size: int | None, offset: int, n: int) -> CorruptCheckpointError:
        have = f"{size} bytes long" if size is not None else "of unknown length"
        return CorruptCheckpointError(
            f"object is {have} but the read needs bytes [{offset}, {offset + n}) "
            f"({n} bytes): truncated or replaced",
            path=self.url(key),
        )

    def _stat_quiet(self, key: str) -> ObjectInfo | None:
        try:
            return self.stat(key)
        except CheckpointError:
            return None

    def read_scatter(self, key: str, offset: int, dests: Sequence[memoryview]) -> None:
        """MSC hands back ``bytes``, so the range is read once and copied out."""
        scatter_by_copy(self, key, offset, dests)

    def get(self, key: str, max_bytes: int) -> bytes:
        """The whole object; one larger than ``max_bytes`` is refused before reading it."""
        get_checked_size(self, key, max_bytes)
        client = self._live()
        try:
            data = client.read(key)
        except Exception as e:
            self._errors.raise_(e, "read", key)
        body = data if isinstance(data, bytes) else bytes(memoryview(data))
        if len(body) > max_bytes:
            raise CorruptCheckpointError(
                f"object is {len(body)} bytes, more than the {max_bytes} allowed for it",
                path=self.url(key),
            )
        return body

    def stat(self, key: str) -> ObjectInfo | None:
        """The object ``key`` (a "directory" is not an object: None)."""
        client = self._live()
        try:
            meta = client.info(key, strict=False)
        except FileNotFoundError:
            return None
        except Exception as e:
            self._errors.raise_(e, "stat", key)
        if meta.type != "file":
            return None
        return ObjectInfo(key, int(meta.content_length), _mtime(meta))

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``. MSC lists directories, not raw
        prefixes: the directory holding ``prefix`` is listed (recursively) and filtered."""
        client = self._live()
        directory = prefix if prefix.endswith("/") or not prefix else prefix.rpartition("/")[0]
        if directory and not directory.endswith("/"):
            directory += "/"
        try:
            for meta in client.list(path=directory, include_directories=False):
                if meta.type == "file" and meta.key.startswith(prefix):
                    yield ObjectInfo(meta.key, int(meta.content_length), _mtime(meta))
        except FileNotFoundError:
            return
        except Exception as e:
            self._errors.raise_(e, "list", prefix)

    def children(self, prefix: str) -> list[str]:
        """The names directly under the directory ``prefix``, sorted."""
        client = self._live()
        directory = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        names: set[str] = set()
        try:
            for meta in client.list(path=directory, include_directories=True):
                if not meta.key.startswith(directory):
                    continue
                name = meta.key[len(directory) :].strip("/")
                if name:
                    names.add(name.split("/", 1)[0])
        except FileNotFoundError:
            return []
        except Exception as e:
            self._errors.raise_(e, "list", directory)
        return sorted(names)

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` (missing ones are no error), in batches where the provider has
        a bulk delete (S3: 1000 keys a request)."""
        client = self._live()
        todo = list(dict.fromkeys(keys))
        if not todo:
            return
        try:
            client.delete_many(todo)
        except FileNotFoundError:
            pass
        except Exception as e:
            self._errors.raise_(
                e, "delete", todo[0] if len(todo) == 1 else os.path.commonprefix(todo)
            )

    def _provider(self) -> Any:
        """The profile's storage provider, for what MSC's ``StorageClient`` does not
        offer: conditional writes (its ``write`` takes no condition, though every
        provider's ``put_object`` does) and reads that no cache answers. None where a
        metadata provider or replicas sit between a key and the object the provider
        writes, or this MSC has no such attribute: then there are no conditional writes."""
        client = self._live()
        single = getattr(client, "_delegate", client)
        if getattr(single, "_metadata_provider", None) or getattr(single, "_replica_manager", None):
            return None
        provider = getattr(single, "_storage_provider", None)
        return provider if hasattr(provider, "put_object") else None

    def put_if(self, key: str, data: bytes, *, if_match: str | None = None) -> str | None:
        """Through the profile's provider (S3: ``If-None-Match: *`` / ``If-Match``).
        Providers that take no condition (POSIX) write anyway: the writer lease finds
        that out by probing and says it is best-effort there."""
        provider = self._provider()
        if provider is None:
            raise NotImplementedError(f"{self.url(key)}: no conditional writes through MSC here")
        body = bytes(byte_view(data))
        condition = {"if_none_match": "*"} if if_match is None else {"if_match": if_match}
        try:
            provider.put_object(key, body, **condition)
        except self._msc_types.PreconditionFailedError:
            return None
        except FileNotFoundError:  # If-Match on a missing object (AWS: 404)
            return None
        except NotImplementedError:
            raise
        except Exception as e:
            self._errors.raise_(e, "conditional write", key)
        got = self.get_tagged(key, len(body))
        if got is None or got[0] != body:
            return None  # replaced at once by another writer: its version, not ours
        return got[1]

    def get_tagged(self, key: str, max_bytes: int) -> tuple[bytes, str] | None:
        """Read past any cache, the version tag being the provider's ETag (the
        content's xxh3-64 where it has none); the object's metadata is read before and
        after it, and again if they differ, so the tag is the content's."""
        provider = self._provider()
        if provider is None:
            raise NotImplementedError(f"{self.url(key)}: no tagged reads through MSC here")
        try:
            for _ in range(5):
                before = provider.get_object_metadata(key)
                if int(before.content_length) > max_bytes:
                    raise CorruptCheckpointError(
                        f"object is {before.content_length} bytes, more than the "
                        f"{max_bytes} allowed for it",
                        path=self.url(key),
                    )
                body = bytes(provider.get_object(key))
                after = provider.get_object_metadata(key)
                if before.etag == after.etag and len(body) <= max_bytes:
                    tag = after.etag or hexdigest(xxhash.xxh3_64_intdigest(body))
                    return body, str(tag)
        except FileNotFoundError:
            return None
        except CheckpointError:
            raise
        except Exception as e:
            self._errors.raise_(e, "read", key)
        raise CheckpointError("the object keeps changing while read", path=self.url(key))

    def abort_uploads(self, prefix: str, older_than_s: float) -> int:
        """Always 0: MSC's API has no listing of incomplete multipart uploads. A failed
        upload is aborted by MSC's provider when it fails; what a killed process leaves
        behind needs a bucket lifecycle rule (AbortIncompleteMultipartUpload) or the
        ``s3://`` backend's clean-up on the same bucket."""
        self._live()
        return 0

    def close(self) -> None:
        """Stop the backend's threads and drop the MSC client (its connections go with
        it; MSC has no explicit close)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.close()
        self._hasher.shutdown(wait=True, cancel_futures=True)
        self._client = None

    def __enter__(self) -> MscBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MscBackend(profile={self.profile!r}, config={self.config_file!r})"

    def __reduce__(self) -> tuple[Any, ...]:  # rebuilt from the profile and options
        return (_rebuild, (self.profile, self._options, self._read_piece, self._max_concurrency))


def _rebuild(profile: str, options: StorageOptions, read_piece: int, max_concurrency: int):
    return MscBackend(profile, options, read_piece=read_piece, max_concurrency=max_concurrency)


def _mtime(meta: Any) -> float:
    last = getattr(meta, "last_modified", None)
    try:
        return float(last.timestamp()) if last is not None else 0.0
    except (OverflowError, OSError, ValueError):  # MSC's "unknown" is datetime.min
        return 0.0
