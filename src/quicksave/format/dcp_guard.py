"""What stock DCP readers find in a quicksave checkpoint's ``.metadata`` (FORMAT.md §5).

In the quicksave layout without ``dcp_compat`` the data files hold raw tensor bytes, not
the ``torch.save`` items DCP's ``FileSystemReader`` reads, and objects live in the
manifest only: a stock reader cannot load such a checkpoint. Its ``.metadata`` therefore
gives DCP's ``Metadata.storage_data`` as a :class:`QuicksaveStorageData`: an empty
mapping whose every lookup raises a :class:`~quicksave.errors.CheckpointError` saying
what the directory is and how to read it, instead of a bare ``KeyError:
MetadataIndex(...)`` or a ``torch.load`` of raw bytes. Without quicksave installed the
unpickler fails on the class itself ("No module named 'quicksave'"), which names the
format too.

Torch-free: the class is looked up by ``pickle.load`` in whatever process reads the
file, and importing this module must cost nothing.
"""

from __future__ import annotations

import sys
from typing import Any

from quicksave.errors import CheckpointError, rank_of_this_process

_FRAMES = 8  # how far up the stack a reader holding the checkpoint's path is looked for


def stock_reader_message() -> str:
    """What to tell a stock DCP reader that meets a quicksave checkpoint."""
    return (
        "this is a quicksave checkpoint (format v1: its index is manifest.json, its data "
        "files hold raw tensor bytes), which torch.distributed.checkpoint's stock readers "
        "(FileSystemReader, dcp.load, stock torchtitan) cannot load. Load it with "
        "quicksave.load(state_dict, path) or dcp.load(state_dict, "
        "storage_reader=quicksave.StorageReader(path)), or convert it once: "
        "quicksave convert --to dcp CKPT OUT"
    )


class QuicksaveStorageData(dict):
    """``Metadata.storage_data`` of a quicksave-layout ``.metadata``: holds nothing;
    looking anything up raises :class:`~quicksave.errors.CheckpointError` naming the
    format, the key and (when the reader holds it) the checkpoint's path.

    Pickled by reference to this class with no items, so the bytes depend on nothing
    but the class's name (``.metadata`` stays a function of the manifest)."""

    __slots__ = ()

    def __missing__(self, key: Any) -> Any:
        raise CheckpointError(
            stock_reader_message(),
            path=_reader_path(),
            fqn=getattr(key, "fqn", None),
            rank=rank_of_this_process(),
        )


def _reader_path() -> str | None:
    """The checkpoint path of the reader asking (DCP's ``FileSystemReader.read_data``
    calls the lookup with ``self`` holding ``path``), for the error message only."""
    frame = sys._getframe(2)
    for _ in range(_FRAMES):
        if frame is None:
            break
        reader = frame.f_locals.get("self")
        path = getattr(reader, "path", None)
        if isinstance(path, str) or hasattr(path, "__fspath__"):
            return str(path)
        frame = frame.f_back
    return None
