"""What a directory or prefix is, from the names in it: committed, being written,
quarantined, a stock DCP checkpoint or nothing of ours. Pure: no I/O here (the one
question that needs a read, whether a ``.metadata`` claims the DCP layout, is asked
through a callable the caller passes).

Naming (docs/FORMAT.md, "Commit"): ``.quicksave.<encoded name>.tmp-<token>`` is a save
being written (or a crashed one's), or a checkpoint being deleted;
``.quicksave.<encoded name>.replaced-<token>`` one being replaced where directories cannot
be exchanged; ``<name>.corrupt-<token>`` a checkpoint that failed its checks and was
moved aside. None of them is ever listed, loaded, counted as latest or kept by retention.

The temporaries are hidden and hold the checkpoint's name encoded (every character but
an ASCII letter, digit or ``-`` as ``%XX`` of its UTF-8 bytes): a leftover of a save that was
interrupted never looks like a checkpoint to a scan of the folder by name — Lightning's
``*.ckpt`` and its ``hpc_ckpt_<N>`` version scan, which would read the digits of
``hpc_ckpt_2.ckpt.tmp-355f6ce9e4fe`` as version 2355694. Temporaries named
``<name>.tmp-<token>`` beside the checkpoint (written by older quicksave) are recognized
(:func:`is_temp_name`, :func:`final_name`) and cleaned up the same way.
"""

from __future__ import annotations

import enum
import os
import uuid
from collections.abc import Callable
from urllib.parse import unquote

from quicksave.format import DCP_METADATA_NAME, MANIFEST_NAME

TMP_MARK = ".tmp-"
# The hidden prefix of a temporary's name; the checkpoint's name follows, encoded.
HIDDEN_PREFIX = ".quicksave."
# At most this many bytes of encoded name, so that a temporary's name stays within the
# 255 bytes of a file name (prefix, mark and a 15-character token take the rest).
_ENCODED_MAX = 255 - len(HIDDEN_PREFIX) - len(".replaced-") - 15
QUARANTINE_MARK = ".corrupt-"
# A checkpoint being replaced where the filesystem cannot exchange two directories
# (``publish(replace=True)``): moved here first, deleted once the new one is in place.
REPLACED_MARK = ".replaced-"


class CheckpointKind(enum.Enum):
    QUICKSAVE = "quicksave"  # committed quicksave checkpoint (either layout)
    DCP = "dcp"  # committed stock torch.distributed.checkpoint directory
    UNCOMMITTED = "uncommitted"  # temporary or partial: never loaded
    MISSING = "missing"
    NOT_CHECKPOINT = "not-checkpoint"


COMMITTED = (CheckpointKind.QUICKSAVE, CheckpointKind.DCP)


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def is_temp_name(name: str) -> bool:
    return TMP_MARK in os.path.basename(os.path.normpath(name))


def hidden_name(name: str, mark: str, token: str) -> str:
    """The name of a temporary standing for the checkpoint ``name`` (a base name):
    ``.quicksave.<encoded name><mark><token>``, e.g. ``temp_name("hpc_ckpt_2.ckpt",
    "ab12")`` is ``.quicksave.hpc%5Fckpt%5F2%2Eckpt.tmp-ab12``. The encoded name holds
    letters, digits, ``-`` and ``%`` only (so never a mark, a ``.ckpt`` suffix or
    ``ckpt_``, while ``step-5`` stays legible in messages that name a temporary); past
    :data:`_ENCODED_MAX` bytes only its first whole characters are kept."""
    pieces, size = [], 0
    for c in name:
        plain = c == "-" or (c.isascii() and c.isalnum())
        piece = c if plain else "".join(f"%{b:02X}" for b in _utf8(c))
        size += len(piece)
        if size > _ENCODED_MAX:
            break  # whole characters only: the kept beginning decodes to a prefix
        pieces.append(piece)
    return f"{HIDDEN_PREFIX}{''.join(pieces)}{mark}{token}"


def temp_name(name: str, token: str) -> str:
    """The temporary of a save (or a deletion) of the checkpoint ``name``."""
    return hidden_name(name, TMP_MARK, token)


def _utf8(c: str) -> bytes:
    return c.encode("utf-8", "surrogateescape")


def final_name(name: str) -> str:
    """The checkpoint name a directory name stands for: ``step-5`` for ``step-5``, for
    its temporaries ``.quicksave.step-5.tmp-<token>`` and (earlier versions)
    ``step-5.tmp-<token>`` (a base name, not a path)."""
    head = name.split(TMP_MARK, 1)[0]
    if head.startswith(HIDDEN_PREFIX) and head != name:
        return unquote(head[len(HIDDEN_PREFIX) :], errors="surrogateescape")
    return head


def kind_of(base: str, names: set[str], footer: Callable[[], bool]) -> CheckpointKind:
    """The kind of a directory named ``base`` holding ``names`` (not empty).

    Args:
        footer: says whether its ``.metadata`` claims the DCP layout; called only for a
            directory that would otherwise be a stock DCP one (usually
            ``lambda: metadata_has_footer(path, backend)``).
    """
    has_quicksave_data = any(
        (n.startswith("rank-") and n.endswith(".safetensors")) or n.startswith("part-rank-")
        for n in names
    )
    if TMP_MARK in base or QUARANTINE_MARK in base or REPLACED_MARK in base:
        return CheckpointKind.UNCOMMITTED
    if MANIFEST_NAME in names:
        return CheckpointKind.QUICKSAVE
    if has_quicksave_data:
        return CheckpointKind.UNCOMMITTED
    if DCP_METADATA_NAME in names:
        return CheckpointKind.QUICKSAVE if footer() else CheckpointKind.DCP
    return CheckpointKind.NOT_CHECKPOINT
