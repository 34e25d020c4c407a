"""Checkpoint locations: a plain path, or a URL with a scheme.

Every entry point turns what the user gave into a location here, before any I/O, so a
destination quicksave does not understand is an error, never a guess: ``s3://b/run``
used to be taken as a relative path and silently became a local directory ``s3:``.

Today only the local filesystem is served (plain paths and ``file://`` URLs); object
stores (``s3://``, ``msc://``) are refused with a clear error until their backends
exist.
"""

from __future__ import annotations

import os
import re
from urllib.parse import unquote, urlsplit

from ..errors import CheckpointError

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_OBJECT_STORES = {"s3": "quicksave[s3]", "msc": "quicksave[msc]"}


def local_path(location: str | os.PathLike[str], *, what: str = "checkpoint") -> str:
    """The absolute local path of ``location``.

    Args:
        location: a path (``str`` or ``os.PathLike``), or a ``file://`` URL.
        what: how errors call it (``"checkpoint"``, ``"checkpoint folder"`` ...).

    Returns:
        An absolute, normalized path.

    Raises:
        CheckpointError: a URL of another scheme (object stores are not served yet,
            unknown schemes never will be), a ``file://`` URL naming a remote host,
            or not a path at all; the message names the location.

    Example::

        local_path("file:///data/ckpt/step-10")  # '/data/ckpt/step-10'
    """
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
    match = _SCHEME.match(raw)
    if match is None:
        return os.path.abspath(raw)
    scheme = match.group(1).lower()
    if scheme == "file":
        parts = urlsplit(raw)
        if parts.netloc not in ("", "localhost"):
            raise CheckpointError(
                f"file:// URL names the host {parts.netloc!r}; only local files are "
                "served (file:///absolute/path)",
                path=raw,
            )
        return os.path.abspath(unquote(parts.path))
    if scheme in _OBJECT_STORES:
        raise CheckpointError(
            f"{scheme}:// {what} locations are not supported by this version of quicksave "
            f"(object stores come with the storage backends, extra {_OBJECT_STORES[scheme]}); "
            f"refusing rather than writing a local directory named '{scheme}:'",
            path=raw,
        )
    raise CheckpointError(
        f"unknown URL scheme {scheme!r} for a {what}: use a path, file://, s3:// or msc://",
        path=raw,
    )
