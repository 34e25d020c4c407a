"""Checkpoint locations: a plain path, or a URL with a scheme.

Every entry point turns what the user gave into a :class:`Location` here, before any
I/O, so a destination quicksave does not understand is an error, never a guess:
``s3://b/run`` is a bucket, never a local directory ``s3:``, and ``s3:/b/run`` (one
slash missing) is refused, never a local ``./s3:/b/run``.

Served: plain paths and ``file:`` URLs (the local filesystem), ``s3://bucket/prefix``
(extra ``quicksave[s3]``) and ``msc://profile/path`` (extra ``quicksave[msc]``); the
schemes registered in ``StorageOptions.schemes`` (:mod:`quicksave.storage.schemes`: an
S3-compatible server under a scheme of its own...); any other ``scheme://`` that fsspec
knows and can import here (``memory://``, ``gcs://`` with gcsfs, ``hf://``...:
:mod:`quicksave.storage.fsspec_store`). Any other scheme is refused.

The rule for what is a URL (Linux paths only: ``C:`` is no drive letter here):

- ``scheme://...``: a URL; a scheme neither quicksave nor fsspec knows is an error.
- ``file:/abs``, ``file:///abs`` and ``file://localhost/abs`` (RFC 8089) all mean the
  local path ``/abs``; ``file:relative``, a ``file://host/...`` and a ``?`` or ``#`` in
  a ``file:`` URL (percent-encode them: ``%3F``, ``%23``) are errors.
- Anything else whose first component looks like a URL scheme
  (``^[A-Za-z][A-Za-z0-9+.-]*:``, e.g. ``s3:/bucket/run``, ``s3:bucket``, ``S3:/b``,
  ``gs:bucket``, ``run:2024/x``) is an error that suggests the URL meant
  (``s3://bucket/run``): a missing ``//`` must not send a job's checkpoints to local
  disk. A local name with a colon in its first component is written ``./run:2024/x``
  (or as an absolute path); colons further on (``runs/a:b``) need nothing.
- Everything else is a local path, relative to the working directory.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from dataclasses import dataclass, field

from quicksave.errors import CheckpointError
from quicksave.storage.backend import Backend, StorageOptions, join
from quicksave.storage.retry import StoreHealth
from quicksave.storage.schemes import SCHEMES, Opening, Scheme, scheme_entry

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_SCHEME_LIKE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


@dataclass(frozen=True)
class Location:
    """Where a checkpoint (or a folder of them) lives: cheap to build and to pass, even
    to a worker process; :meth:`open` builds the live backend (clients, threads).

    Attributes:
        scheme: ``"file"``, ``"s3"``, ``"msc"``, a scheme of ``options.schemes``, or an
            fsspec protocol (``"memory"``...).
        container: the bucket (s3) or profile (msc); ``""`` for files; for an fsspec
            filesystem its root marker (``"/"`` for ``memory://``, ``""`` for ``gcs://``).
        key: the absolute path (file), or the key prefix inside the container (fsspec:
            the filesystem's path without its root marker), without a leading or
            trailing ``/`` (``""``: the container's root).
        options: how to reach the store (credentials come from the environment's
            standard chain unless set there; never printed).
    """

    scheme: str
    container: str
    key: str
    options: StorageOptions = field(default_factory=StorageOptions, compare=False, repr=False)

    @property
    def is_local(self) -> bool:
        return self.scheme == "file"

    @property
    def entry(self) -> Scheme:
        """The rules of this location's scheme (:mod:`quicksave.storage.schemes`): from
        ``options.schemes``, else the built-in ones."""
        return scheme_entry(self.scheme, self.options)

    @property
    def url(self) -> str:
        """The user-facing name: the path for files, the URL otherwise."""
        return self.entry.url(self.scheme, self.container, self.key)

    @property
    def name(self) -> str:
        """The last component (``step-10``)."""
        return self.key.rstrip("/").rsplit("/", 1)[-1]

    def local_file(self) -> str | None:
        """The path of the regular file at this location if it is one on the local
        filesystem (a single-file output: ``convert --to safetensors``); else None."""
        if self.is_local and os.path.isfile(self.key):
            return self.key
        return None

    def check_msc_opt_in(self, use_msc: bool) -> None:
        """Refuse an ``msc://`` location unless the caller opted in to the Multi-Storage
        Client (NVRx's writer takes one only with ``use_msc=True``), and say what is
        missing when its package is not installed. Other locations pass.

        Raises:
            CheckpointError: naming the location.
        """
        if self.scheme != "msc":
            return
        if not use_msc:
            raise CheckpointError(
                "an msc:// path is a Multi-Storage Client location: pass use_msc=True "
                "(FileSystemWriterAsync(path, use_msc=True), as NVRx requires)",
                path=self.url,
            )
        if importlib.util.find_spec("multistorageclient") is None:
            raise CheckpointError(
                "use_msc=True needs the Multi-Storage Client package "
                "(pip install 'quicksave[msc]')",
                path=self.url,
            )

    @property
    def process_local(self) -> bool:
        """Whether this location lives in this process's memory (``memory://``): only
        this process (and its threads) can write it."""
        return self.entry.process_local(self.scheme)

    def check_shared(self, what: str) -> None:
        """Refuse a location that lives in this process's memory (``memory://``) where
        another process would write it (an async saver's worker process): its writes
        would land in that process's memory, and this one would never see them.

        Raises:
            CheckpointError: naming the location and ``what`` to do instead.
        """
        if self.process_local:
            raise CheckpointError(
                f"{self.scheme}:// is this process's memory, and a worker process would "
                f"write the checkpoint into its own: {what}",
                path=self.url,
            )

    def child(self, name: str) -> Location:
        return Location(self.scheme, self.container, join(self.key, name), self.options)

    def parent(self) -> Location:
        if self.is_local:
            return Location(self.scheme, "", os.path.dirname(self.key), self.options)
        head = self.key.rstrip("/").rsplit("/", 1)
        return Location(
            self.scheme, self.container, head[0] if len(head) == 2 else "", self.options
        )

    def bounded(self, seconds: float) -> Location:
        """This location with its S3 timeouts capped so that one request, retries
        included, ends within about ``seconds`` (half for each attempt's read, half for
        starting retries): for the store calls a training thread makes itself, which
        ``save_timeout_s`` must bound too (the worker's are bounded by its kill)."""
        s3 = self.options.s3
        half = max(0.5, seconds / 2)
        capped = dataclasses.replace(
            s3,
            read_timeout_s=min(s3.read_timeout_s, half),
            connect_timeout_s=min(s3.connect_timeout_s, half),
            retry_deadline_s=min(s3.retry_deadline_s, half),
        )
        if capped == s3:
            return self
        opts = dataclasses.replace(self.options, s3=capped)
        return Location(self.scheme, self.container, self.key, opts)

    def backend_id(self) -> tuple:
        """Equal for locations one backend serves (used to share a backend)."""
        return (self.scheme, self.container, self.options)

    def open(
        self,
        *,
        fsync: bool = True,
        o_direct: bool = True,
        rank: int = 0,
        write_rate: float | None = None,
        health: StoreHealth | None = None,
    ) -> Backend:
        """A new backend for this location's container; the caller closes it. ``fsync``,
        ``o_direct`` and ``write_rate`` (bytes per second per write, a test's throttle)
        are the local filesystem's; a store's writes are durable when acknowledged.
        ``health``: where an S3 backend's retry loop says whether the store answers.

        Raises:
            CheckpointError: the extra for the scheme is not installed (named).
        """
        how = Opening(self.url, fsync, o_direct, rank, write_rate, health)
        return self.entry.open(self.scheme, self.container, self.options, how)


def parse_location(
    location: str | os.PathLike[str] | Location,
    *,
    what: str = "checkpoint",
    options: StorageOptions | None = None,
) -> Location:
    """Turn a path or URL into a :class:`Location`, before any I/O.

    Args:
        location: a path (``str`` or ``os.PathLike``), a ``file://``, ``s3://bucket/key``
            or ``msc://profile/path`` URL, or a Location (returned as is).
        what: how errors call it (``"checkpoint"``, ``"checkpoint folder"`` ...).
        options: how to reach object stores (default: the environment's chain).

    Raises:
        CheckpointError: an unknown scheme, a malformed URL (no bucket, ``..`` in the
            key), a ``file://`` URL naming a remote host, ``file:relative``, a path
            beginning like a URL scheme without ``//`` (``s3:/b/run``, ``run:2/x``: see
            the module's rule; the message suggests the URL or ``./run:2/x``); the
            message names the location.

    Example::

        parse_location("s3://ckpts/run-7/step-10").key  # 'run-7/step-10'
        parse_location("file:/data/ckpt").key  # '/data/ckpt'
        parse_location("./run:2024/x").key  # '<cwd>/run:2024/x'
    """
    if isinstance(location, Location):
        return location
    opts = options if options is not None else StorageOptions()
    try:
        raw = os.fspath(location)
    except TypeError:
        raise CheckpointError(
            f"a {what} location must be a path or a URL, got {type(location).__name__}"
        ) from None
    if isinstance(raw, bytes):
        raw = os.fsdecode(raw)
    if not raw:
        raise CheckpointError(f"a {what} location must not be empty")
    match = _SCHEME.match(raw.lstrip())
    if match is None:
        if raw.lower().startswith("file:"):
            return _from_url("file", raw, what, opts)
        _refuse_scheme_like(raw, what, isinstance(location, os.PathLike), opts)
        return Location("file", "", os.path.abspath(raw), opts)
    if raw != raw.strip():
        raise CheckpointError(
            f"a {what} URL must not begin or end with white space: {raw!r}", path=raw
        )
    return _from_url(match.group(1).lower(), raw, what, opts)


def _from_url(scheme: str, raw: str, what: str, opts: StorageOptions) -> Location:
    """The Location of the URL ``raw`` of ``scheme``, split by the scheme's entry."""
    container, key = scheme_entry(scheme, opts).split(scheme, raw, what)
    return Location(scheme, container, key, opts)


def _refuse_scheme_like(raw: str, what: str, pathlike: bool, opts: StorageOptions) -> None:
    """Raise if ``raw`` (not a ``scheme://`` URL) begins like a URL scheme (``s3:``,
    ``gs:``, ``run:``): a URL with its ``//`` missing, never taken as a local path."""
    stripped = raw.lstrip()
    match = _SCHEME_LIKE.match(stripped)
    if match is None:
        return
    scheme = match.group(1).lower()
    rest = stripped[match.end() :].lstrip("/")
    why = " (a pathlib.Path collapses '//' into '/': pass a URL as a str)" if pathlike else ""
    entry = opts.schemes.over(SCHEMES).get(scheme)
    if entry is not None and entry.container:  # a scheme served here: its URL is meant
        rest = rest or f"<{entry.container}>/<path>"
        raise CheckpointError(
            f"{raw!r} is not a {what} location: an {scheme}: URL needs '//' after the "
            f"scheme{why}; did you mean '{scheme}://{rest}'? quicksave never takes "
            f"'{match.group(1)}:...' as a local path",
            path=raw,
        )
    raise CheckpointError(
        f"{raw!r} begins like a URL scheme ({match.group(1)}:) without '//'{why}; "
        f"quicksave does not guess: for a local {what} write './{raw}' (or an absolute "
        "path), for an object store a URL (s3://bucket/path, msc://profile/path)",
        path=raw,
    )


def local_path(location: str | os.PathLike[str], *, what: str = "checkpoint") -> str:
    """The absolute local path of ``location``, for what only the local filesystem
    serves (``torch.save`` targets, ``quicksave demo`` folders).

    Raises:
        CheckpointError: not a local path or ``file://`` URL; names the location.

    Example::

        local_path("file:///data/ckpt/step-10")  # '/data/ckpt/step-10'
    """
    loc = parse_location(location, what=what)
    if not loc.is_local:
        raise CheckpointError(
            f"a {what} must be a local path here, not a {loc.scheme}:// URL", path=loc.url
        )
    return loc.key
