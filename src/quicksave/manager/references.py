"""Which checkpoints of a run folder its kept checkpoints refer to (chunk references,
FORMAT.md §9): retention never deletes those.

A checkpoint's references are the ``base`` steps of its manifest's chunks. The steps to
protect are closed over references: a base that is kept must stay loadable too, so its
own bases are protected, and so on. A manifest is immutable once committed, so its bases
are cached by the step and the identity (size, modification time) of the file holding
the manifest: a step saved again (after a quarantine) is read again. Most manifests have
no references, and say so in their first bytes (``"format_version":1``, which may hold
none; the DCP layout holds none either): only those are read whole.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from quicksave.commit import CheckpointKind
from quicksave.commit.manifest_reader import manifest_bytes
from quicksave.errors import CheckpointError, CorruptCheckpointError
from quicksave.format import DCP_METADATA_NAME, MANIFEST_NAME
from quicksave.format.manifest_parse import bases_in
from quicksave.storage import Location
from quicksave.storage.backend import Backend
from quicksave.storage.checkpoint_dir import CheckpointDir, read_range

logger = logging.getLogger("quicksave")

UNKNOWN = None  # the bases of a checkpoint whose manifest cannot be read
# How quicksave's writers begin a manifest without references (deterministic layout).
_PLAIN = b'{"format":"quicksave","format_version":1,'


class BaseCache:
    """The bases of each checkpoint read so far, by step and manifest identity. Held by
    the one that applies retention to a folder (its tier), used by one thread at a time.
    """

    def __init__(self) -> None:
        self._bases: dict[int, tuple[tuple, frozenset[int]]] = {}

    def bases(self, folder: Location, step: int, backend: Backend | None) -> frozenset[int] | None:
        """The steps that chunks of ``step``'s checkpoint in ``folder`` refer to; None when
        its manifest cannot be read (then any older step may be one)."""
        with CheckpointDir(folder.child(f"step-{step}"), backend) as d:
            identity = _identity(d)
            cached = self._bases.get(step)
            if identity is not None and cached is not None and cached[0] == identity:
                return cached[1]
            try:
                found = _bases(d, identity)
            except (CheckpointError, OSError) as e:  # damaged, or vanished meanwhile
                logger.warning(
                    "quicksave: retention cannot read the manifest of %s (%s); keeping every "
                    "older checkpoint it might refer to",
                    d.url,
                    e,
                )
                return UNKNOWN
        if identity is not None:
            self._bases[step] = (identity, found)
        return found

    def forget_except(self, steps: Iterable[int]) -> None:
        """Drop what is cached of steps not in ``steps`` (no longer committed)."""
        keep = set(steps)
        for step in [s for s in self._bases if s not in keep]:
            del self._bases[step]


def _bases(d: CheckpointDir, identity: tuple | None) -> frozenset[int]:
    if identity is not None and identity[0] == DCP_METADATA_NAME:
        return frozenset()  # the DCP layout has no references (FORMAT.md §9)
    if identity is not None and identity[1] >= len(_PLAIN):
        f = d.open(MANIFEST_NAME, what="manifest")
        try:
            head = read_range(f, 0, len(_PLAIN), path=d.member_url(MANIFEST_NAME))
        finally:
            f.close()
        if head == _PLAIN:
            return frozenset()
    path = d.member_url(MANIFEST_NAME)
    try:  # (only the references: a whole parse costs ~3x on a manifest of 600 chunks)
        data = manifest_bytes(d)
    except FileNotFoundError:
        raise CorruptCheckpointError("manifest.json is missing", path=path) from None
    return bases_in(data, path)


def _identity(d: CheckpointDir) -> tuple | None:
    for name in (MANIFEST_NAME, DCP_METADATA_NAME):
        info = d.backend.stat(d.member_key(name))
        if info is not None:
            return (name, info.size, info.mtime)
    return None


def referenced(
    folder: Location,
    kinds: Mapping[int, CheckpointKind],
    kept: Iterable[int],
    backend: Backend | None,
    cache: BaseCache | None = None,
) -> set[int]:
    """The committed steps (``kinds``: step -> kind, from one listing of ``folder``) that
    the checkpoints of ``kept`` refer to, directly or through other referenced ones.
    A checkpoint whose manifest cannot be read protects every committed step below it.
    ``cache`` (default: a fresh one) keeps the bases read."""
    cache = cache if cache is not None else BaseCache()
    cache.forget_except(kinds)
    protected: set[int] = set()
    todo = [s for s in kept if s in kinds]
    seen = set(todo)
    while todo:
        step = todo.pop()
        if kinds[step] is CheckpointKind.DCP:  # a stock DCP checkpoint refers to nothing
            continue
        bases = cache.bases(folder, step, backend)
        if bases is UNKNOWN:
            bases = frozenset(s for s in kinds if s < step)
        for base in bases:
            protected.add(base)
            if base in kinds and base not in seen:
                seen.add(base)
                todo.append(base)
    return protected
