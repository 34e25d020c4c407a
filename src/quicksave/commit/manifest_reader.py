"""Reading a checkpoint's manifest from its folder or prefix, on any backend: the
``manifest.json`` of layout ``quicksave``, or the manifest inside ``.metadata`` of layout
``dcp``. Parsing and validation are :mod:`quicksave.format.manifest`'s (no I/O there)."""

from __future__ import annotations

from typing import Any

from quicksave.errors import CorruptCheckpointError
from quicksave.format import DCP_METADATA_NAME, MANIFEST_NAME
from quicksave.format.dcp_layout import FOOTER_SIZE, PROBE_SIZE, has_footer, parse_footer
from quicksave.format.manifest import (
    LAYOUT_DCP,
    LAYOUT_QUICKSAVE,
    MAX_MANIFEST_BYTES,
    Manifest,
)
from quicksave.format.manifest_parse import from_json_bytes
from quicksave.storage.checkpoint_dir import CheckpointDir, read_range


def read_manifest(checkpoint: Any) -> Manifest:
    """Read and validate the manifest of a checkpoint: ``<checkpoint>/manifest.json``
    (layout ``quicksave``) or, when there is none and ``.metadata`` ends with the DCP
    layout's footer, the manifest inside ``.metadata`` (layout ``dcp``, FORMAT.md §8:
    the footer is read first, then only the manifest's bytes; the pickle before them is
    never read). A regular file inside the directory (not a symbolic link, FIFO or
    device) or an object under the checkpoint's prefix; at most 1 GiB of manifest, read
    up to its recorded size.

    Args:
        checkpoint: a path, URL, Location or an open ``CheckpointDir``.

    Raises:
        CorruptCheckpointError: missing, not a regular file, too large, unreadable, or
            invalid; names the manifest's path or URL (``<checkpoint>/.metadata`` for
            layout ``dcp``).
    """

    d = checkpoint if isinstance(checkpoint, CheckpointDir) else CheckpointDir(checkpoint)
    try:
        path = d.member_url(MANIFEST_NAME)
        try:
            data = manifest_bytes(d)
        except FileNotFoundError:
            found = _read_dcp_layout_manifest(d)
            if found is None:
                raise CorruptCheckpointError("manifest.json is missing", path=path) from None
            return found
        return from_json_bytes(data, path, layout=LAYOUT_QUICKSAVE)
    finally:
        if d is not checkpoint:
            d.close()


def manifest_bytes(d: CheckpointDir) -> bytes:
    """The bytes of ``d``'s ``manifest.json`` (layout ``quicksave``), at most 1 GiB.

    Raises:
        FileNotFoundError: there is none.
        CorruptCheckpointError: not a regular file, too large, unreadable.
    """
    return d.read(
        MANIFEST_NAME, MAX_MANIFEST_BYTES, what="manifest", too_large="manifest larger than 1 GiB"
    )


def _read_dcp_layout_manifest(d: Any) -> Manifest | None:
    """The manifest ``M`` of ``.metadata`` in a DCP-layout checkpoint, or None when
    there is no ``.metadata`` or it does not claim the layout (a stock DCP checkpoint)."""

    path = d.member_url(DCP_METADATA_NAME)
    try:
        f = d.open(DCP_METADATA_NAME, what="DCP metadata")
    except FileNotFoundError:
        return None
    try:
        n = min(PROBE_SIZE, f.size)
        tail = read_range(f, f.size - n, n, path=path, what="DCP metadata")
        if not has_footer(tail):
            return None
        footer = parse_footer(tail[-FOOTER_SIZE:], f.size, path)
        data = read_range(
            f, footer.pickle_length, footer.manifest_length, path=path, what="manifest"
        )
    finally:
        f.close()
    return from_json_bytes(data, path, layout=LAYOUT_DCP)
