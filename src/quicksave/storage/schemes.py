"""URL schemes: how the locations of one scheme are named, reached, committed and leased.

Each scheme is one :class:`Scheme` entry in a :class:`~quicksave.storage.registry.
Registry`: the built-in ones are :data:`SCHEMES` (``file``: the local filesystem;
``s3``; ``msc``); any other scheme that fsspec knows is served through fsspec
(:class:`FsspecScheme`). A new store is its backend (a folder under ``storage/``) plus
one entry, passed in ``StorageOptions(schemes=...)``; an S3-compatible server needs no
new code at all, only an :class:`S3Scheme` naming its endpoint::

    opts = StorageOptions(schemes=Registry({"minio": S3Scheme(endpoint_url=URL)}))
    quicksave.save(state, "minio://bucket/run/step-10", storage=opts)

An entry names its commit strategy (``commit``, a name in
:data:`quicksave.commit.choose.STRATEGIES`) and its folder writer lease (``lease``, a
name in :data:`quicksave.manager.lease.LEASES`) rather than holding them: those live in
the layers above storage, and their registries travel in the same options.

Who calls what: :func:`~quicksave.storage.location.parse_location` calls :meth:`split`
once per URL; a :class:`~quicksave.storage.location.Location` calls :meth:`url`,
:meth:`open`, :meth:`process_local`; the commit layer :meth:`reserve` / :meth:`release`.

Torch-free: the worker process imports it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable
from urllib.parse import unquote, urlsplit

from quicksave.errors import CheckpointError
from quicksave.storage import fsspec_store
from quicksave.storage.backend import Backend, S3Options, StorageOptions
from quicksave.storage.registry import Registry
from quicksave.storage.retry import StoreHealth

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class Opening:
    """How a backend is opened (the local filesystem's settings; a store's writes are
    durable when acknowledged): see :meth:`~quicksave.storage.location.Location.open`;
    ``url``: the location's, for messages."""

    url: str
    fsync: bool = True
    o_direct: bool = True
    rank: int = 0
    write_rate: float | None = None
    health: StoreHealth | None = None


@runtime_checkable
class Scheme(Protocol):
    """One URL scheme's rules (see the module docstring).

    Attributes:
        container: what a URL's first component names (``"bucket"``, ``"profile"``),
            for messages; ``""`` where there is none.
        commit: the name of the commit strategy of its locations.
        lease: the name of the writer lease of its checkpoint folders.
    """

    container: str
    commit: str
    lease: str

    def split(self, scheme: str, url: str, what: str) -> tuple[str, str]:
        """The container and the key of ``url`` (``scheme://...``), checked before any
        I/O.

        Raises:
            CheckpointError: a malformed URL, naming it (``what``: how to call it).
        """
        ...

    def url(self, scheme: str, container: str, key: str) -> str:
        """The user-facing name of a location of this scheme."""
        ...

    def open(self, scheme: str, container: str, options: StorageOptions, how: Opening) -> Backend:
        """A new backend for ``container``; the caller closes it.

        Raises:
            CheckpointError: its package is not installed, the container is unknown.
        """
        ...

    def process_local(self, scheme: str) -> bool:
        """Whether its locations live in this process's memory (only this process and
        its threads can write them)."""
        ...

    def reserve(self, scheme: str, container: str, key: str) -> bool:
        """Make the name ``key`` look taken (an empty directory where the store has
        directories); True if something was made (see ``CommitStrategy.reserve``)."""
        ...

    def release(self, scheme: str, container: str, key: str) -> bool:
        """Remove :meth:`reserve`'s placeholder if it is still empty."""
        ...


class _NoPlaceholder:
    """Schemes whose folders are only key prefixes: a name cannot look taken."""

    def reserve(self, scheme: str, container: str, key: str) -> bool:
        return False

    def release(self, scheme: str, container: str, key: str) -> bool:
        return False

    def process_local(self, scheme: str) -> bool:
        return False


@dataclass(frozen=True)
class LocalScheme(_NoPlaceholder):
    """The local filesystem: plain paths and ``file:`` URLs (RFC 8089: ``file:/abs``,
    ``file:///abs``, ``file://localhost/abs``). Committed by a rename of a directory,
    leased by ``flock`` (placeholders are the rename strategy's own)."""

    container: str = ""
    commit: str = "rename"
    lease: str = "flock"

    def split(self, scheme: str, url: str, what: str) -> tuple[str, str]:
        parts = urlsplit(url)
        if "?" in url or "#" in url:
            raise CheckpointError(
                f"a file: URL for a {what} must not hold '?' or '#' (they would start a "
                "query or fragment and be dropped): percent-encode them (%3F, %23), or "
                "give the path without 'file:'",
                path=url,
            )
        if parts.netloc not in ("", "localhost"):
            raise CheckpointError(
                f"file:// URL names the host {parts.netloc!r}; only local files are "
                f"served: did you mean 'file:///{url[len('file://') :]}'?",
                path=url,
            )
        if not parts.path.startswith("/"):
            raise CheckpointError(
                f"a file: URL for a {what} must name an absolute path (file:/abs/path or "
                "file:///abs/path); for a path relative to the working directory, drop "
                "'file:'",
                path=url,
            )
        return "", os.path.abspath(unquote(parts.path))

    def url(self, scheme: str, container: str, key: str) -> str:
        return key

    def open(self, scheme: str, container: str, options: StorageOptions, how: Opening) -> Backend:
        from quicksave.storage.local import LocalBackend

        return LocalBackend(
            fsync=how.fsync, o_direct=how.o_direct, rank=how.rank, write_rate=how.write_rate
        )


class _ObjectStore(_NoPlaceholder):
    """``scheme://<container>/<key>``: a bucket or profile, then a key prefix."""

    container: str
    commit: str
    lease: str

    def split(self, scheme: str, url: str, what: str) -> tuple[str, str]:
        container, _, key = url[len(scheme) + 3 :].partition("/")
        key = key.strip("/")
        if not container:
            raise CheckpointError(
                f"a {what} URL needs a {self.container}: {scheme}://<{self.container}>/<path>",
                path=url,
            )
        self.check_container(container, url)
        parts = key.split("/") if key else []
        if any(p in ("", ".", "..") for p in parts) or "\x00" in key:
            raise CheckpointError(
                f"a {what} URL must not hold empty, '.' or '..' components", path=url
            )
        return container, key

    def check_container(self, container: str, url: str) -> None:
        return

    def url(self, scheme: str, container: str, key: str) -> str:
        return f"{scheme}://{container}/{key}".rstrip("/")


@dataclass(frozen=True)
class S3Scheme(_ObjectStore):
    """An S3 API: Amazon S3 (``s3://``, the built-in entry: everything from
    ``StorageOptions.s3`` and the AWS chain) or any S3-compatible server registered
    under a scheme of its own with where it is and who to be there. Each field set here
    replaces that of ``StorageOptions.s3`` for this scheme's locations (part sizes,
    retries and timeouts stay the options').

    Example::

        S3Scheme(endpoint_url="http://minio:9000", access_key_id=..., secret_access_key=...)
    """

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    addressing_style: str | None = None
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    container: str = "bucket"
    commit: str = "manifest-last"
    lease: str = "store"

    def check_container(self, container: str, url: str) -> None:
        if not _BUCKET.match(container):
            raise CheckpointError(f"{container!r} is not a valid S3 bucket name", path=url)

    def settings(self, base: S3Options) -> S3Options:
        """``base`` with this entry's fields that are set."""
        mine = {
            f: getattr(self, f)
            for f in (
                "endpoint_url",
                "region",
                "profile",
                "addressing_style",
                "access_key_id",
                "secret_access_key",
                "session_token",
            )
            if getattr(self, f) is not None
        }
        return dataclasses.replace(base, **mine) if mine else base

    def open(self, scheme: str, container: str, options: StorageOptions, how: Opening) -> Backend:
        from quicksave.storage.s3 import S3Backend

        return S3Backend(container, self.settings(options.s3), health=how.health, scheme=scheme)


@dataclass(frozen=True)
class MscScheme(_ObjectStore):
    """NVIDIA's Multi-Storage Client (``msc://<profile>/<path>``, extra
    ``quicksave[msc]``); its config file is ``StorageOptions.msc_config``."""

    container: str = "profile"
    commit: str = "manifest-last"
    lease: str = "store"

    def open(self, scheme: str, container: str, options: StorageOptions, how: Opening) -> Backend:
        from quicksave.storage.msc import MscBackend

        try:
            return MscBackend(container, options)
        except CheckpointError as e:  # an unknown profile, a bad config: name the URL
            raise type(e)(e.message, path=how.url, fqn=e.fqn, rank=e.rank) from e


@dataclass(frozen=True)
class FsspecScheme:
    """Any scheme fsspec knows and can import here (``memory://``, ``gcs://`` with
    gcsfs, ``hf://``...: :mod:`quicksave.storage.fsspec_store`), with fsspec's own
    configuration; what serves a scheme no registry names. The container of its
    locations is the filesystem's root marker (``"/"`` for ``memory://``)."""

    container: str = ""
    commit: str = "manifest-last"
    lease: str = "store"

    def split(self, scheme: str, url: str, what: str) -> tuple[str, str]:
        fsspec_store.fsspec_protocol(scheme, url)  # raises for a scheme fsspec cannot serve
        marker, key = fsspec_store.fsspec_key(scheme, f"{scheme}://{url[len(scheme) + 3 :]}")
        if any(p in (".", "..") for p in key.split("/")) or "\x00" in key:
            raise CheckpointError(f"a {what} URL must not hold '.' or '..' components", path=url)
        return marker, key

    def url(self, scheme: str, container: str, key: str) -> str:
        return fsspec_store.fsspec_url(scheme, container, key)

    def open(self, scheme: str, container: str, options: StorageOptions, how: Opening) -> Backend:
        return fsspec_store.FsspecBackend(scheme)

    def process_local(self, scheme: str) -> bool:
        return scheme in fsspec_store.PROCESS_LOCAL

    def reserve(self, scheme: str, container: str, key: str) -> bool:
        return fsspec_store.reserve_dir(scheme, container, key)

    def release(self, scheme: str, container: str, key: str) -> bool:
        return fsspec_store.release_dir(scheme, container, key)


# The built-in schemes; ``StorageOptions.schemes`` adds to them (and may replace them).
SCHEMES: Registry[Scheme] = Registry({"file": LocalScheme(), "s3": S3Scheme(), "msc": MscScheme()})


def scheme_entry(scheme: str, options: StorageOptions) -> Scheme:
    """The entry serving ``scheme``: the options' registry, then :data:`SCHEMES`, then
    fsspec (which refuses, naming the URL, a scheme it does not know)."""
    entry = options.schemes.get(scheme) or SCHEMES.get(scheme)
    return entry if entry is not None else FsspecScheme()
