"""The checkpoint folder: which steps it holds committed, and how entries leave it.

Plain functions over a folder path (no manager state), used by the manager::

    <folder>/step-<N>/         committed (manifest.json; a DCP-layout .metadata, FORMAT.md
                               §8; or a stock DCP .metadata)
    <folder>/.quicksave.step-<N>.tmp-*/   being written, or left by a crash
    <folder>/step-<N>.corrupt-*/  failed its checks at load; moved aside, kept
    <folder>/.quicksave-lock   the writer lease (lease.py; on a store
                               .quicksave-lease.json, store_lease.py)
    <folder>/export-step-<N>/  model export

Only committed directories count: ``committed_steps`` is what "latest", ``load()`` and
retention see.

On an object store the same names are key prefixes (``<folder>/step-<N>/...``). How a
checkpoint commits, is deleted, quarantined or cleaned up is its location's commit
strategy's (:mod:`quicksave.commit`): these functions open it and log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any

from quicksave.commit import CheckpointKind, classify, open_strategy
from quicksave.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NotCommittedError,
)
from quicksave.loading.checkpoint import require_committed
from quicksave.loading.reader import reader_for
from quicksave.loading.run_folder import committed_kinds, committed_steps  # noqa: F401 (re-exported)
from quicksave.manager.policies import RetentionPolicy
from quicksave.manager.references import BaseCache, referenced
from quicksave.storage import Location, parse_location
from quicksave.storage.backend import Backend

logger = logging.getLogger("quicksave")


def create_folder(folder: str | Location, rank: int | None) -> None:
    """Create ``folder`` (and its parents) if missing; on an object store the folder is
    listed at once, so that a missing bucket, bad credentials or an unreachable endpoint
    fail here, not at the first save (:meth:`CommitStrategy.create_folder`).

    Raises:
        CheckpointError: ``folder`` is a file or cannot be created; the store refuses.
    """
    with open_strategy(folder, rank=rank or 0) as s:
        s.create_folder(parse_location(folder), rank)


def clean_leftovers(
    folder: str | Location,
    stale_after_s: float = 3600.0,
    *,
    keep: Collection[str] = (),
    backend: Backend | None = None,
) -> None:
    """Remove what crashed saves left (:meth:`CommitStrategy.clean_leftovers`; on an
    object store only what is older than ``stale_after_s``, never the names in ``keep``:
    saves in flight). Only the holder of the folder's writer lease calls this (then no
    live job saves here; see lease.py); deletions go through ``backend`` if given (the
    lease holder's guarded one). Logs, never raises."""
    loc = parse_location(folder)
    try:
        with open_strategy(loc, backend) as s:
            removed = s.clean_leftovers(loc, stale_after_s, keep)
    except CheckpointError as e:
        logger.warning("quicksave: clean-up of %s failed: %s", loc.url, e)
        return
    for what in removed:
        logger.info("quicksave: removed what a crashed save left: %s", what)


def delete_checkpoint(path: str | Location, backend: Backend | None = None) -> None:
    """Delete a checkpoint (logs, never raises) so that it never looks committed while
    half deleted (:meth:`CommitStrategy.remove`: renamed away first; on an object store
    its commit object first)."""
    loc = parse_location(path)
    try:
        with open_strategy(loc, backend) as s:
            removed = s.remove(loc)
    except CheckpointError as e:
        logger.warning("quicksave: could not delete old checkpoint %s: %s", loc.url, e)
        return
    if removed:
        logger.info("quicksave: deleted old checkpoint %s", loc.url)
    else:
        logger.warning("quicksave: could not delete old checkpoint %s", loc.url)


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
    be saved again (:meth:`CommitStrategy.quarantine`; on an object store the commit
    object and the reason are kept there, and the data left under ``<name>/`` is an
    uncommitted leftover). Returns the new path or URL, or None if it could not be moved
    (logged)."""
    loc = parse_location(path)
    try:
        with open_strategy(loc, backend) as s:
            moved = s.quarantine(loc, why)
    except CheckpointError as e:
        logger.error("quicksave: could not quarantine %s (%s): %s", loc.url, why, e)
        return None
    logger.error("quicksave: quarantined %s as %s: %s", loc.url, moved, why)
    return moved


def apply_retention(
    folder: str | Location,
    retention: RetentionPolicy,
    keep: set[int],
    *,
    allow_dcp: bool = True,
    backend: Backend | None = None,
    bases: BaseCache | None = None,
) -> None:
    """Delete the committed checkpoints ``retention`` chooses, except the newest one and
    the steps in ``keep`` (in flight, just written, the last one known good): those are
    refused even if the policy picks them; and except those that a checkpoint left in
    the folder refers to (chunk references, closed over: :mod:`.references`; ``bases``
    caches what their manifests say). Newest first, so that no checkpoint still listed
    ever refers to one already deleted (a crash between two deletions included). Call on
    the lease holder only."""
    kinds = committed_kinds(folder, allow_dcp=allow_dcp, backend=backend)
    committed = sorted(kinds)
    if not committed:
        return
    doomed = []
    for step in retention.to_delete(committed, set(keep)):
        if step in keep or step == committed[-1] or step not in kinds:
            # A policy must never pick these; refuse rather than lose a checkpoint.
            logger.warning("quicksave: retention chose step %d, which must be kept; ignored", step)
            continue
        doomed.append(step)
    if not doomed:
        return
    loc = parse_location(folder)
    held = referenced(loc, kinds, set(committed) - set(doomed), backend, bases)
    for step in sorted(doomed, reverse=True):
        if step in held:
            logger.info("quicksave: kept step %d: a kept checkpoint refers to it", step)
            continue
        delete_checkpoint(loc.child(f"step-{step}"), backend)


def replace_uncommitted(path: str | Location, backend: Backend | None = None) -> None:
    """A ``step-<N>`` directory with quicksave data but no manifest can never be loaded
    (a non-atomic copy, a damaged disk, a crashed save on an object store); it would
    block the commit: delete it. Call on the lease holder only."""
    loc = parse_location(path)
    if classify(loc, backend) is CheckpointKind.UNCOMMITTED:
        logger.warning("quicksave: replacing uncommitted leftover %s", loc.url)
        delete_checkpoint(loc, backend)


def stored_metadata(path: str | Location, *, allow_dcp_pickle: bool = False) -> dict[str, Any]:
    """Names and storage metadata of what a committed checkpoint holds (from its
    manifest, or from DCP's .metadata for a stock DCP directory: through the
    restricted unpickler unless ``allow_dcp_pickle``)."""
    checkpoint = require_committed(path, allow_dcp=True)
    reader = reader_for(checkpoint, None, allow_dcp_pickle=allow_dcp_pickle)
    return dict(reader.read_metadata().state_dict_metadata)


def check_step(step: object, folder: str) -> None:
    """Raise CheckpointError unless ``step`` is an int >= 0."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be an integer >= 0, got {step!r}", path=folder)
