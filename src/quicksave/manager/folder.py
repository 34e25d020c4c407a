"""The checkpoint folder: which steps it holds committed, and how entries leave it.

Plain functions over a folder path (no manager state), used by the manager::

    <folder>/step-<N>/         committed (manifest.json; a DCP-layout .metadata, FORMAT.md
                               §8; or a stock DCP .metadata)
    <folder>/step-<N>.tmp-*/   being written, or left by a crash
    <folder>/step-<N>.corrupt-*/  failed its checks at load; moved aside, kept
    <folder>/.quicksave-lock   the writer lease (lease.py; on a store
                               .quicksave-lease.json, store_lease.py)
    <folder>/export-step-<N>/  model export

Only committed directories count: ``committed_steps`` is what "latest", ``load()`` and
retention see.

On an object store the same names are key prefixes (``<folder>/step-<N>/...``); a
prefix is committed when its ``manifest.json`` object exists (in the DCP layout: its
``.metadata`` with the layout's footer). There is no rename: a deletion removes the
commit first (``manifest.json``, then ``.metadata``: the checkpoint is gone at once),
then the data; a quarantine keeps the commit object under
``step-<N>.corrupt-<token>/`` and removes the original's. Leftovers of crashed saves are
removed only when older than ``StorageOptions.stale_after_s`` (docs/ARCHITECTURE.md,
"Object stores").
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Callable, Collection, Iterator
from typing import Any

from quicksave.adapters.dcp_reader import StorageReader
from quicksave.commit import (
    QUARANTINE_MARK,
    CheckpointKind,
    classify,
    clean_stale_temporaries,
    kind_of,
    metadata_has_footer,
    new_token,
    quarantine_path,
    remove_tree,
)
from quicksave.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NotCommittedError,
)
from quicksave.format import DCP_METADATA_NAME, MANIFEST_NAME
from quicksave.loading.dcp_stock import DCPReader
from quicksave.loading.manifest_reader import read_manifest
from quicksave.manager.policies import RetentionPolicy
from quicksave.storage import Location, parse_location
from quicksave.storage.backend import Backend, join
from quicksave.storage.checkpoint_dir import CheckpointDir

logger = logging.getLogger("quicksave")

STEP_DIR = re.compile(r"step-(0|[1-9][0-9]*)")
MAX_STEP_NAME = 5 + 20  # "step-" and at most 20 digits: a step beyond int64 is no step
COMMITTED = (CheckpointKind.QUICKSAVE, CheckpointKind.DCP)


def committed_steps(
    folder: str | Location, *, allow_dcp: bool = True, backend: Backend | None = None
) -> list[int]:
    """Steps with a committed checkpoint in ``folder``, ascending: quicksave ones, and
    stock DCP ones if ``allow_dcp``. Temporaries, quarantined checkpoints and
    directories without their commit are not listed; a directory that vanishes while
    the folder is listed (retention, clean-up) is simply not listed."""
    loc = parse_location(folder)
    kinds = COMMITTED if allow_dcp else (CheckpointKind.QUICKSAVE,)
    if not loc.is_local:
        steps = []
        with opened(loc, backend) as b:
            for name, names in store_groups(loc, b).items():
                m = STEP_DIR.fullmatch(name)
                if not m or len(name) > MAX_STEP_NAME:
                    continue
                top = {k for k in names if "/" not in k}
                probe = _footer_probe(loc.child(name), b)
                if top and kind_of(name, top, probe) in kinds:
                    steps.append(int(m.group(1)))
        return sorted(steps)
    folder = loc.key
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    steps = []
    for name in names:
        m = STEP_DIR.fullmatch(name)
        if m and len(name) <= MAX_STEP_NAME and classify(os.path.join(folder, name)) in kinds:
            steps.append(int(m.group(1)))
    return sorted(steps)


def _footer_probe(loc: Location, backend: Backend) -> Callable[[], bool]:
    """``kind_of``'s question for the prefix ``loc``: does its ``.metadata`` claim the
    DCP layout (one small ranged read, only asked of a DCP-looking prefix)."""
    return lambda: metadata_has_footer(loc, backend)


@contextlib.contextmanager
def opened(loc: Location, backend: Backend | None = None) -> Iterator[Backend]:
    """``backend`` if given (a caller's, kept open), else a new one for ``loc`` closed
    on exit. Opening an S3 backend costs a client (~0.3 s here): callers that run in the
    training loop pass theirs."""
    if backend is not None:
        yield backend
        return
    b = loc.open()
    try:
        yield b
    finally:
        b.close()


def store_groups(folder: Location, backend: Backend | None = None) -> dict[str, dict[str, Any]]:
    """An object-store folder in one listing: first key component (``step-10``) ->
    {the rest of the key: ObjectInfo}."""
    with opened(folder, backend) as b:
        base = folder.key + "/" if folder.key else ""
        groups: dict[str, dict[str, Any]] = {}
        for o in b.list(base):
            head, sep, tail = o.key[len(base) :].partition("/")
            if sep:
                groups.setdefault(head, {})[tail] = o
        return groups


def create_folder(folder: str | Location, rank: int | None) -> None:
    """Create ``folder`` (and its parents) if missing. On an object store nothing needs
    creating; the store is asked for the folder's listing at once, so that a missing
    bucket, bad credentials or an unreachable endpoint fail here, not at the first save.

    Raises:
        CheckpointError: ``folder`` is a file or cannot be created; the store refuses.
    """
    loc = parse_location(folder)
    if not loc.is_local:
        b = loc.open(rank=rank or 0)
        try:
            b.children(loc.key)
        finally:
            b.close()
        return
    folder = loc.key
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise CheckpointError(
            "checkpoint folder is a file, not a directory; choose another folder",
            path=folder,
            rank=rank,
        )
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"cannot create checkpoint folder: {e.strerror}", path=folder, rank=rank
        ) from e


def clean_leftovers(
    folder: str | Location,
    stale_after_s: float = 3600.0,
    *,
    keep: Collection[str] = (),
    backend: Backend | None = None,
) -> None:
    """Remove the temporaries of crashed saves. Only the holder of the folder's writer
    lease calls this (then no live job saves here; see lease.py).

    On an object store only what is older than ``stale_after_s`` goes (the lease says
    how old: ``lease.clean_folder``), so that a save still being written is never hit:
    prefixes holding quicksave objects but no manifest, objects of a committed
    checkpoint that its manifest does not list (parts, a crashed earlier attempt's
    files), and incomplete multipart uploads; never the names in ``keep`` (saves in
    flight). Deletions go through ``backend`` if given (the lease holder's guarded one)."""
    loc = parse_location(folder)
    if not loc.is_local:
        _clean_store(loc, stale_after_s, keep, backend)
        return
    folder = loc.key
    for name in clean_stale_temporaries(folder):
        logger.info("quicksave: removed stale temporary %s", os.path.join(folder, name))


def _clean_store(
    folder: Location, stale_after_s: float, keep: Collection[str], backend: Backend | None
) -> None:
    with opened(folder, backend) as b:
        try:
            cutoff = time.time() - stale_after_s
            base = folder.key + "/" if folder.key else ""
            for name, objs in store_groups(folder, b).items():
                top = {k for k in objs if "/" not in k}
                if not top or name in keep:
                    continue
                kind = kind_of(name, top, _footer_probe(folder.child(name), b))
                if kind in (CheckpointKind.QUICKSAVE, CheckpointKind.DCP):
                    if kind is CheckpointKind.DCP or QUARANTINE_MARK in name:
                        continue  # nothing of ours to tell apart; quarantine is kept
                    listed = _listed_names(folder.child(name), b)
                    doomed = [k for k, o in objs.items() if k not in listed and o.mtime < cutoff]
                elif kind is CheckpointKind.UNCOMMITTED and QUARANTINE_MARK not in name:
                    if max(o.mtime for o in objs.values()) >= cutoff:
                        continue  # possibly a save still being written: not ours to judge yet
                    if b.stat(base + name + "/" + MANIFEST_NAME) is not None:
                        continue  # committed meanwhile
                    doomed = list(objs)
                else:
                    continue
                if doomed:
                    b.delete(base + name + "/" + k for k in doomed)
                    logger.info(
                        "quicksave: removed %d stale object(s) of crashed saves under %s",
                        len(doomed),
                        folder.child(name).url,
                    )
            aborted = b.abort_uploads(base, stale_after_s)
            if aborted:
                logger.info(
                    "quicksave: aborted %d stale multipart upload(s) under %s", aborted, folder.url
                )
        except CheckpointError as e:
            logger.warning("quicksave: clean-up of %s failed: %s", folder.url, e)


def _listed_names(loc: Location, backend: Backend) -> set[str]:
    """The names a committed checkpoint's manifest accounts for (everything else under
    its prefix is a leftover); all of them if the manifest cannot be read."""
    try:
        m = read_manifest(CheckpointDir(loc, backend))
    except CheckpointError:
        return set(backend.children(loc.key)) | {""}  # keep everything
    return set(m.files) | {MANIFEST_NAME, DCP_METADATA_NAME}


def delete_checkpoint(path: str | Location, backend: Backend | None = None) -> None:
    """Delete a checkpoint directory (logs, never raises). It is moved to a temporary
    name first, so it is never half-deleted while still looking committed; a crash
    mid-delete leaves a temporary, removed at the next start-up. On an object store its
    commit is deleted first (it is no checkpoint from then on): ``manifest.json``, then
    ``.metadata`` (the commit of the DCP layout, and of a stock DCP checkpoint), each
    alone; then its other objects."""
    loc = parse_location(path)
    if not loc.is_local:
        try:
            with opened(loc, backend) as b:
                base = loc.key + "/"
                b.delete([base + MANIFEST_NAME])
                b.delete([base + DCP_METADATA_NAME])
                b.delete([o.key for o in b.list(base)])
            logger.info("quicksave: deleted old checkpoint %s", loc.url)
        except CheckpointError as e:
            logger.warning("quicksave: could not delete old checkpoint %s: %s", loc.url, e)
        return
    path = loc.key
    if remove_tree(path):
        logger.info("quicksave: deleted old checkpoint %s", path)
    else:
        logger.warning("quicksave: could not delete old checkpoint %s", path)


LOAD_ROUNDS = 3  # listings load_newest tries before it gives up


def load_newest(
    list_steps: Callable[[], list[int]],
    load_step: Callable[[int], None],
    on_corrupt: Callable[[int, str], None] | None,
    folder: str,
    rank: int | None,
) -> int | None:
    """Load the newest committed step that passes its checks, newest first.

    A step that turns out corrupt (``on_corrupt(step, why)`` is called: a writer
    quarantines it), vanished or uncommitted meanwhile is logged and skipped, and the
    next older one is tried. Not an ``IncompatibleStateError``: an older checkpoint
    would not fit either. After a round of failures the folder is listed again (up to
    ``LOAD_ROUNDS`` times): a checkpoint that vanished meanwhile (another job's
    retention, seen from a read-only reader) is no reason to give up while a newer one
    has been committed since.

    Returns:
        The step loaded, or None if there is no committed step at all.

    Raises:
        CorruptCheckpointError: no committed step passes its checks (each is named).
    """
    skipped: dict[int, str] = {}
    for _ in range(LOAD_ROUNDS):
        candidates = [s for s in reversed(list_steps()) if s not in skipped]
        if not candidates:
            break
        for candidate in candidates:
            try:
                load_step(candidate)
            except (CorruptCheckpointError, CheckpointNotFoundError, NotCommittedError) as e:
                logger.error(
                    "quicksave: the checkpoint of step %d cannot be loaded, trying an "
                    "older one: %s",
                    candidate,
                    e,
                )
                skipped[candidate] = e.message
                if isinstance(e, CorruptCheckpointError) and on_corrupt is not None:
                    on_corrupt(candidate, e.message)
                continue
            return candidate
    if not skipped:
        return None
    why = "; ".join(f"step {s}: {m}" for s, m in skipped.items())
    raise CorruptCheckpointError(
        f"no committed checkpoint in this folder passes its checks ({why}); "
        "nothing was loaded consistently: restore the folder or start elsewhere",
        path=folder,
        rank=rank,
    )


def quarantine(path: str | Location, why: str, backend: Backend | None = None) -> str | None:
    """Move a committed checkpoint that failed its checks out of the way, to
    ``<name>.corrupt-<token>`` beside it: no longer listed, loaded or counted as the
    latest, never deleted by quicksave (kept for a person to look at), and its step can
    be saved again. Returns the new path, or None if it could not be moved (logged).

    On an object store (no rename) the commit object (``manifest.json``, or the
    ``.metadata`` of the DCP layout) and the reason are kept under
    ``<name>.corrupt-<token>/`` and the original commit object is deleted: the data left
    under ``<name>/`` is then an uncommitted leftover (cleaned up when stale)."""
    loc = parse_location(path)
    if not loc.is_local:
        return _quarantine_on_store(loc, why, backend)
    path = loc.key
    moved = quarantine_path(path)
    try:
        os.rename(path, moved)
    except OSError as e:
        logger.error("quicksave: could not quarantine %s (%s): %s", path, why, e.strerror)
        return None
    logger.error("quicksave: quarantined %s as %s: %s", path, moved, why)
    return moved


def _quarantine_on_store(loc: Location, why: str, backend: Backend | None) -> str | None:
    moved = loc.parent().child(f"{loc.name}{QUARANTINE_MARK}{new_token()}")
    try:
        with opened(loc, backend) as b:
            commit = MANIFEST_NAME
            key = join(loc.key, commit)
            info = b.stat(key)
            if info is None and metadata_has_footer(loc, b):
                commit = DCP_METADATA_NAME
                key = join(loc.key, commit)
                info = b.stat(key)
            if info is not None:
                data = b.get(key, max(info.size, 1))
                b.put(join(moved.key, commit), memoryview(data))
            b.put(join(moved.key, "REASON.txt"), memoryview(why.encode("utf-8", "replace")))
            b.delete([key])
    except CheckpointError as e:
        logger.error("quicksave: could not quarantine %s (%s): %s", loc.url, why, e)
        return None
    logger.error("quicksave: quarantined %s (manifest kept at %s): %s", loc.url, moved.url, why)
    return moved.url


def apply_retention(
    folder: str | Location,
    retention: RetentionPolicy,
    keep: set[int],
    *,
    allow_dcp: bool = True,
    backend: Backend | None = None,
) -> None:
    """Delete the committed checkpoints ``retention`` chooses, except the newest one and
    the steps in ``keep`` (in flight, just written, the last one known good): those are
    refused even if the policy picks them. Call on the lease holder only."""
    committed = committed_steps(folder, allow_dcp=allow_dcp, backend=backend)
    if not committed:
        return
    for step in retention.to_delete(committed, set(keep)):
        if step in keep or step == committed[-1] or step not in committed:
            # A policy must never pick these; refuse rather than lose a checkpoint.
            logger.warning("quicksave: retention chose step %d, which must be kept; ignored", step)
            continue
        delete_checkpoint(parse_location(folder).child(f"step-{step}"), backend)


def replace_uncommitted(path: str | Location, backend: Backend | None = None) -> None:
    """A ``step-<N>`` directory with quicksave data but no manifest can never be loaded
    (a non-atomic copy, a damaged disk, a crashed save on an object store); it would
    block the commit: delete it. Call on the lease holder only."""
    loc = parse_location(path)
    if classify(loc, backend) is CheckpointKind.UNCOMMITTED:
        logger.warning("quicksave: replacing uncommitted leftover %s", loc.url)
        delete_checkpoint(loc, backend)


def require_committed(
    folder: str | Location,
    path: str | Location,
    step: int,
    rank: int | None,
    *,
    allow_dcp: bool = True,
) -> None:
    """Raise unless ``path`` (the checkpoint of ``step`` in ``folder``) is committed
    (a stock DCP one only if ``allow_dcp``).

    Raises:
        CheckpointNotFoundError: nothing there, or not a checkpoint, or a stock DCP
            checkpoint without ``allow_dcp``.
        NotCommittedError: a checkpoint that was never committed.
    """
    loc = parse_location(path)
    kind = classify(loc)
    path = loc.url
    if kind is CheckpointKind.QUICKSAVE or (allow_dcp and kind is CheckpointKind.DCP):
        return
    if kind is CheckpointKind.DCP:
        raise CheckpointNotFoundError(
            f"the checkpoint of step {step} is a stock torch.distributed.checkpoint folder, "
            "whose metadata is a pickle; pass CheckpointConfig(allow_dcp=True) to load it",
            path=path,
            rank=rank,
        )
    if kind is CheckpointKind.MISSING:
        raise CheckpointNotFoundError(
            f"no checkpoint of step {step}; committed steps: "
            f"{committed_steps(folder, allow_dcp=allow_dcp)}",
            path=path,
            rank=rank,
        )
    if kind is CheckpointKind.UNCOMMITTED:
        raise NotCommittedError(
            f"the checkpoint of step {step} was never committed (a save was interrupted); "
            "it cannot be loaded",
            path=path,
            rank=rank,
        )
    raise CheckpointNotFoundError(
        f"not a checkpoint (no manifest.json) for step {step}", path=path, rank=rank
    )


def stored_metadata(path: str | Location, *, allow_dcp_pickle: bool = False) -> dict[str, Any]:
    """Names and storage metadata of what a committed checkpoint holds (from its
    manifest, or from DCP's .metadata for a stock DCP directory: through the
    restricted unpickler unless ``allow_dcp_pickle``)."""
    if classify(path) is CheckpointKind.DCP:
        reader: Any = DCPReader(path, allow_pickle=allow_dcp_pickle)
    else:
        reader = StorageReader(path)
    return dict(reader.read_metadata().state_dict_metadata)


def check_step(step: object, folder: str) -> None:
    """Raise CheckpointError unless ``step`` is an int >= 0."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be an integer >= 0, got {step!r}", path=folder)
