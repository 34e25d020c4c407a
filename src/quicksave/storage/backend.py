"""The storage seam: what every backend (local disk, S3, Multi-Storage Client) provides.

A backend stores *objects* under string *keys*. Keys are ``/``-separated; for the local
backend a key is an absolute path, for S3 it is the object key inside one bucket, for MSC
the path inside one profile. Everything quicksave reads or writes goes through these few
operations, so the format, the commit protocol and the multi-rank protocol are the same
over every backend; only how a checkpoint becomes visible differs:

- ``atomic_rename`` backends (local) write under a temporary directory and rename it;
- the others (object stores) write data objects and per-rank parts first and the
  manifest last: the manifest's presence is the commit (docs/ARCHITECTURE.md, "Object
  stores").

Torch-free: the worker process imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import xxhash

from quicksave.checksum import hexdigest
from quicksave.storage.registry import Registry

Range = tuple[str, int, int]  # (name, offset, length) of a byte range to hash on the way


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: its key, size in bytes and last-modified time (POSIX seconds)."""

    key: str
    size: int
    mtime: float


@dataclass(frozen=True)
class S3Options:
    """S3 settings that override the standard AWS chain (environment variables
    ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
    ``AWS_SESSION_TOKEN``, ``AWS_REGION``/``AWS_DEFAULT_REGION``, ``AWS_PROFILE``, the
    shared config and credentials files). ``None`` leaves a setting to the chain.

    Attributes:
        endpoint_url: an S3-compatible server (``http://127.0.0.1:8333``).
        region: the signing region.
        profile: a named profile of the shared AWS config.
        access_key_id, secret_access_key, session_token: explicit credentials (never
            printed: not in ``repr``, logs, errors or manifests).
        addressing_style: ``"path"``, ``"virtual"`` or ``None`` (path style when an
            endpoint is given, botocore's choice otherwise).
        part_size: bytes per multipart part (objects up to this size are one PUT).
        max_concurrency: parts (or ranged GETs) in flight at once per object stream.
        retry_deadline_s: a request that fails transiently (throttling, 5xx, a refused,
            reset or timed-out connection) is tried again, with jittered exponential
            backoff (at most 5 s per pause), until this long after its first try: a
            store that is down for less than this is ridden out. Other failures
            (access denied, no such bucket) raise at once.
        max_attempts: also stop after this many tries per request; None (default): as
            many as ``retry_deadline_s`` allows.
        connect_timeout_s, read_timeout_s: per-connection timeouts.
    """

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    addressing_style: str | None = None
    part_size: int = 32 << 20
    max_concurrency: int = 8
    max_attempts: int | None = None
    retry_deadline_s: float = 60.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0


@dataclass(frozen=True)
class StorageOptions:
    """How quicksave reaches a storage location; passed to every entry point that takes
    a location (``storage=``) and to ``CheckpointConfig(storage=...)``.

    Attributes:
        s3: settings for ``s3://`` locations.
        msc_config: path of a Multi-Storage Client config file for ``msc://`` locations;
            ``None`` uses MSC's own search (``MSC_CONFIG``, then its default paths).
        stale_after_s: a manager's start-up clean-up removes leftovers of crashed saves
            (objects with no manifest, incomplete multipart uploads) only when older
            than this, so that a save still being written elsewhere is never hit.
            Where the folder's writer lease proves who wrote last (manager/store_lease.py),
            leftovers of that writer go once ``lease_expiry_s`` old (or this, if shorter).
        lease_expiry_s: object stores: a writer lease not renewed for this long is
            expired (its holder counts as dead) and may be taken over.
        lease_renew_s: object stores: how often the holder renews its lease (in the
            background); well below ``lease_expiry_s``.
        schemes: URL schemes of the user's (name -> ``quicksave.storage.schemes.Scheme``),
            added to the built-in ones (``file``, ``s3``, ``msc``), replacing one of the
            same name: e.g. an S3-compatible server as ``S3Scheme(endpoint_url=...)``.
        commits: commit strategies of the user's (name -> a ``CommitStrategy`` class),
            added to ``quicksave.commit.choose.STRATEGIES``; a scheme's entry names its
            strategy.
        leases: writer leases of the user's (name -> a callable that takes the folder's
            Location and returns a lease), added to ``quicksave.manager.lease.LEASES``;
            a scheme's entry names its lease.
    """

    s3: S3Options = field(default_factory=S3Options)
    msc_config: str | None = None
    stale_after_s: float = 3600.0
    lease_expiry_s: float = 30.0
    lease_renew_s: float = 5.0
    schemes: Registry[Any] = field(default_factory=Registry)
    commits: Registry[Any] = field(default_factory=Registry)
    leases: Registry[Any] = field(default_factory=Registry)


# The alignment of O_DIRECT writes: a staging pool's file images extend to a multiple.
PAGE = 4096


@runtime_checkable
class Backend(Protocol):
    """One storage backend (a local filesystem, one S3 bucket, one MSC profile).

    Errors: every operation raises :class:`~quicksave.errors.CheckpointError` naming
    ``self.url(key)`` (never a credential); a missing object is
    :class:`~quicksave.errors.CheckpointNotFoundError`. Transient failures (throttling,
    5xx, connection resets) are retried inside the backend with jittered backoff,
    bounded in count and time.
    """

    scheme: str  # "file", "s3", "msc"
    atomic_rename: bool  # True: a directory can be renamed atomically (local only)

    def url(self, key: str) -> str:
        """The user-facing URL (or path) of ``key``, for messages."""
        ...

    def put(self, key: str, data: memoryview, *, ranges: Sequence[Range] = ()) -> dict[str, str]:
        """Store ``data`` as the object ``key``, whole or not at all (a failed upload
        leaves nothing: a multipart upload is aborted). Large objects are uploaded in
        parts that are slices of ``data`` (no copy), several in flight. Returns the
        xxh3-64 (16 hex digits) of every ``(name, offset, length)`` of ``ranges``,
        computed from ``data`` on the way."""
        ...

    def put_padded(
        self, key: str, image: memoryview, size: int, ranges: Sequence[Range]
    ) -> dict[str, str]:
        """``put`` of ``image[:size]``, where ``image`` extends past ``size`` to a
        multiple of :data:`PAGE` (a staging pool's file image): a filesystem writes whole
        pages with ``O_DIRECT``, a store sends ``size`` bytes."""
        ...

    def put_pieces(
        self, key: str, size: int, pieces: Iterable[tuple[str | None, int, memoryview]]
    ) -> dict[str, str]:
        """Store an object of ``size`` bytes made of ``(name, offset, bytes)`` pieces
        (zeros between them), whole or not at all; return the xxh3-64 of every named
        piece. A filesystem writes each piece where it goes, straight from the caller's
        memory; a store assembles the object first (see :func:`assemble`). ``pieces`` may
        produce each piece only when asked for it."""
        ...

    def read_into(self, key: str, offset: int, dest: memoryview) -> None:
        """Fill ``dest`` with the bytes of ``key`` at ``[offset, offset + len(dest))``.
        Large reads are split into parallel ranged reads. Raises if the object ends
        first (naming both lengths)."""
        ...

    def read_scatter(self, key: str, offset: int, dests: Sequence[memoryview]) -> None:
        """Fill each of ``dests`` in turn with the bytes of ``key`` from ``offset`` on (a
        scatter read: on a store one request whose body lands straight in every view,
        e.g. neighbouring chunks in their destination tensors). Raises as ``read_into``."""
        ...

    def get(self, key: str, max_bytes: int) -> bytes:
        """The whole object ``key``; refuses (CorruptCheckpointError) one larger than
        ``max_bytes`` without reading it."""
        ...

    def stat(self, key: str) -> ObjectInfo | None:
        """The object ``key``, or None if there is none."""
        ...

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (recursive, any order)."""
        ...

    def children(self, prefix: str) -> list[str]:
        """The names directly under the "directory" ``prefix`` (objects and common
        prefixes, without the trailing ``/``), sorted."""
        ...

    def delete(self, keys: Iterable[str]) -> None:
        """Delete the objects ``keys`` (missing ones are no error)."""
        ...

    def put_if(self, key: str, data: bytes, *, if_match: str | None = None) -> str | None:
        """Store the small object ``key`` only if a condition holds, checked by the store
        atomically with the write: no object ``key`` exists (``if_match`` None; S3's
        ``If-None-Match: *``), or the version tag of the one there is ``if_match`` (S3's
        ``If-Match``). For a compare-and-swap such as the writer lease's.

        Returns:
            The version tag of the object written (compare it with :meth:`get_tagged`'s),
            or None when the condition did not hold (another writer came first).

        Raises:
            NotImplementedError: the store (or this client of it) cannot be asked for
                conditions; a store that silently ignores them is found by probing
                (``manager/store_lease.py``).
            CheckpointError: as ``put``.
        """
        ...

    def get_tagged(self, key: str, max_bytes: int) -> tuple[bytes, str] | None:
        """The whole small object ``key`` and its version tag (what :meth:`put_if`
        compares), or None if there is none. Refuses one larger than ``max_bytes`` as
        ``get`` does."""
        ...

    def abort_uploads(self, prefix: str, older_than_s: float) -> int:
        """Abort incomplete multipart uploads under ``prefix`` started more than
        ``older_than_s`` seconds ago; returns how many. 0 where there are none."""
        ...

    def close(self) -> None:
        """Release connections and threads."""
        ...


def join(key: str, name: str) -> str:
    """``key/name`` (no doubled separator; an empty key is the root)."""
    if not key:
        return name
    return key.rstrip("/") + "/" + name


def byte_view(data: Any, *, writable: bool = False) -> memoryview:
    """``data`` (a buffer a backend transfers from or into) as a flat unsigned-byte
    memoryview, without a copy."""
    mv = data if isinstance(data, memoryview) else memoryview(data)
    if writable and mv.readonly:
        raise ValueError("read_into needs a writable buffer")
    if not mv.c_contiguous:
        raise ValueError("transfers need a C-contiguous buffer")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def scatter_by_copy(backend: Backend, key: str, offset: int, dests: Sequence[memoryview]) -> None:
    """``read_scatter`` for a store whose reads hand back ``bytes``: the range is read
    once (``read_into``) and copied out to ``dests`` in order."""
    views = [byte_view(d, writable=True) for d in dests]
    buf = memoryview(bytearray(sum(len(v) for v in views)))
    backend.read_into(key, offset, buf)
    pos = 0
    for v in views:
        v[:] = buf[pos : pos + len(v)]
        pos += len(v)


def get_checked_size(backend: Backend, key: str, max_bytes: int) -> None:
    """Before ``get`` reads an object: raise ``CheckpointNotFoundError`` if it is missing,
    ``CorruptCheckpointError`` if it is larger than ``max_bytes`` (refused unread)."""
    from quicksave.errors import CheckpointNotFoundError, CorruptCheckpointError

    info = backend.stat(key)
    if info is None:
        raise CheckpointNotFoundError("read failed: no such object", path=backend.url(key))
    if info.size > max_bytes:
        raise CorruptCheckpointError(
            f"object is {info.size} bytes, more than the {max_bytes} allowed for it",
            path=backend.url(key),
        )


def hash_ranges(view: memoryview, ranges: Sequence[Range]) -> dict[str, str]:
    """The xxh3-64 (16 hex digits) of every ``(name, offset, length)`` of ``view``."""
    return {  # in file order: one pass forward through memory
        name: hexdigest(xxhash.xxh3_64_intdigest(view[off : off + length]))
        for name, off, length in sorted(ranges, key=lambda r: r[1])
    }


def check_ranges(ranges: Sequence[Range], size: int) -> None:
    """Raise ValueError unless every ``(name, offset, length)`` lies within ``size`` bytes."""
    for name, off, length in ranges:
        if off < 0 or length < 0 or off + length > size:
            raise ValueError(f"range {name!r} [{off}, {off + length}) is outside the {size} bytes")


def assemble(
    size: int, pieces: Iterable[tuple[str | None, int, memoryview]]
) -> tuple[memoryview, list[Range]]:
    """An object's image of ``size`` bytes from ``put_pieces``' pieces (zeros between
    them), and the ranges of the named ones: what a store's ``put_pieces`` uploads."""
    image = memoryview(bytearray(size))
    ranges: list[Range] = []
    for name, offset, view in pieces:
        image[offset : offset + len(view)] = view
        if name is not None:
            ranges.append((name, offset, len(view)))
    return image, ranges


class AssembledWrites:
    """``put_padded`` and ``put_pieces`` of a store, through its own ``put``: the object
    is sent from the image's first ``size`` bytes, or assembled in memory first
    (:func:`assemble`). A store backend derives from it and defines ``put``."""

    def put(self, key: str, data: memoryview, *, ranges: Sequence[Range] = ()) -> dict[str, str]:
        raise NotImplementedError

    def put_padded(
        self, key: str, image: memoryview, size: int, ranges: Sequence[Range]
    ) -> dict[str, str]:
        return self.put(key, image[:size], ranges=ranges)

    def put_pieces(
        self, key: str, size: int, pieces: Iterable[tuple[str | None, int, memoryview]]
    ) -> dict[str, str]:
        image, ranges = assemble(size, pieces)
        return self.put(key, image, ranges=ranges)
