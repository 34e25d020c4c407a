"""The function layer: ``quicksave.save`` and ``quicksave.load``.

``save`` runs the engine's planner and pipeline without staging
(``saving/sync_save.py``); ``load`` classifies the checkpoint once
(``loading/checkpoint.py``) and runs the load engine: DCP's load planner with
quicksave's checks (``loading/planner.py``; resharded reads into DTensor /
ShardedTensor / plain destinations, any world size), step by step
(``loading/steps.py``) over quicksave's reader (``loading/reader.py``). Both talk to
other ranks through quicksave's one plan exchange, so a failure on any rank is raised on
every rank.
"""

from __future__ import annotations

import contextlib
import gc
import os
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.utils import _DistWrapper

from quicksave.commit import strategy_class
from quicksave.errors import CheckpointError, rank_of_this_process
from quicksave.loading import steps
from quicksave.loading.checkpoint import Checkpoint, require_committed
from quicksave.loading.planner import (
    LoadPlanner,
    hand_back,
    plain_state_dict,
    prepare_destinations,
)
from quicksave.loading.reader import reader_for
from quicksave.ranks.exchange import sendable
from quicksave.saving.sync_save import SyncSave, save_sync
from quicksave.storage import Location, StorageOptions, parse_location
from quicksave.trace import phase


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _engine_call() -> Iterator[None]:
    """Around one save or load (the DCP planner's steps):

    - silence DCP's warning on single-process calls (quicksave's normal case);
    - pause the cyclic garbage collector. A save or load allocates tens of thousands of
      short-lived planning objects, enough to trigger collections, and with torch
      imported (~250k tracked objects) each full collection walks every tracked object,
      on every save and load (docs/benchmarks.md, "Where quicksave's time goes", has
      the cost). Everything allocated is freed by reference counting; collection
      resumes when the call returns.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    finally:
        if was_enabled:
            gc.enable()


def _collective_failed(
    e: RuntimeError, path: str, rank: int | None, consequence: str
) -> CheckpointError:
    """Failures inside a save's or a load's steps arrive as CheckpointError; a
    RuntimeError out of them in a group is a collective that broke (a peer died or
    timed out)."""
    cause = str(e).splitlines()[0] if str(e) else type(e).__name__
    return CheckpointError(
        "a collective with the other ranks failed (did a rank crash or time out? see its "
        f"log); {consequence}: {cause}",
        path=path,
        rank=rank,
    )


def save(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    process_group: dist.ProcessGroup | None = None,
    thread_count: int = 2,
    user_metadata: dict[str, Any] | None = None,
    storage: StorageOptions | None = None,
    overwrite: bool = False,
    no_dist: bool = False,
) -> None:
    """Save ``state_dict`` to the directory ``path`` and commit it atomically.

    Every rank of ``process_group`` (default: the world, or no group if torch.distributed
    is not initialized) must call it with the same ``path``, unless ``no_dist``.

    Args:
        state_dict: names to tensors (incl. DTensor / ShardedTensor), ``Stateful``
            objects, nested dicts/lists and plain values.
        path: the checkpoint directory to create (a path, or a ``file://``, ``s3://`` or
            ``msc://`` URL); must not hold a committed checkpoint (unless ``overwrite``).
        step: recorded in the manifest.
        thread_count: data files and writer threads per rank.
        user_metadata: JSON-serializable dict stored in the manifest.
        storage: how to reach an object store (default: the environment's AWS chain,
            ``MSC_CONFIG``).
        overwrite: replace a committed checkpoint at ``path`` atomically: the new one is
            written beside it and the two directories are exchanged in one rename at the
            commit, so ``path`` always holds a whole checkpoint, the old one if the save
            fails. Local paths only.
        no_dist: save from this process alone, with no collective, even when
            torch.distributed is initialized (e.g. a full state dict that only rank 0
            saves, as Lightning's strategies do); ``process_group`` is then ignored.

    Raises:
        IncompatibleStateError: a value cannot be stored (checked before any I/O).
        CheckpointExistsError: ``path`` already holds a committed checkpoint (and not
            ``overwrite``), or something that is not a checkpoint.
        CheckpointError: writing failed on some rank (named); nothing became visible;
            ``overwrite`` on an object store (before any I/O).

    Example::

        quicksave.save({"model": model.state_dict(), "step": 10}, "ckpt/step-10")
    """
    loc = parse_location(path, options=storage)
    distributed = _dist_on() and not no_dist
    group = None if no_dist else process_group
    rank = dist.get_rank(group) if distributed else 0
    if overwrite:  # refused before any I/O where the location has no atomic replace
        strategy_class(loc).check_replace(loc)
    options = SyncSave(
        step=step, thread_count=thread_count, user_metadata=user_metadata, overwrite=overwrite
    )
    try:
        with _engine_call():
            save_sync(state_dict, loc, options, group=group, rank=rank, distributed=distributed)
    except RuntimeError as e:
        if not distributed or isinstance(e, CheckpointError):
            raise
        raise _collective_failed(e, loc.url, rank_of_this_process(), "nothing was committed") from e


def load(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike[str] | Location | Checkpoint,
    *,
    strict: bool = True,
    process_group: dist.ProcessGroup | None = None,
    thread_count: int = 4,
    allow_dcp_pickle: bool = False,
    storage: StorageOptions | None = None,
    no_dist: bool = False,
    leave: Collection[str] = (),
) -> None:
    """Load the checkpoint at ``path`` into ``state_dict`` in place.

    Tensors are filled in place (resharding to the caller's layout: any world size);
    ``Stateful`` values get ``load_state_dict``; plain values are replaced in the dict
    (read them back from it). To resume a new job, pass ``ModelState`` /
    ``OptimizerState`` (as saved): an optimizer without state yet gets the state the
    checkpoint holds allocated from its metadata, with no optimizer step; a plain
    ``optim.state_dict()`` is a copy, and loading into it leaves the optimizer as it is.
    A quicksave checkpoint is read from its JSON manifest and raw bytes, never
    unpickled. A stock ``torch.distributed.checkpoint`` directory (e.g. from
    torchtitan) is read with DCP's reader; its ``.metadata`` is a pickle by DCP's
    design, unpickled by a restricted unpickler that admits only DCP's metadata classes
    (like ``torch.load``'s ``weights_only``), so that no code in it runs. Pass
    ``allow_dcp_pickle=True`` to unpickle it without restriction (metadata with custom
    planner classes; only for checkpoints you trust).

    Args:
        state_dict: the destination (same structure as saved).
        path: a committed checkpoint directory: a path, or a ``file://``, ``s3://`` or
            ``msc://`` URL; or a :class:`~quicksave.loading.checkpoint.Checkpoint` that
            ``require_committed`` returned (it is not classified again).
        strict: if True (default) the key sets must match across the group: every key
            a rank asks for is in the checkpoint (else that rank is named), and every
            key of the checkpoint is asked for by some rank (each rank may load a
            subset: pipeline stages, per-rank entries). If False, the keys present in
            both are loaded and the others are left untouched.
        no_dist: load in this process alone, with no collective, even when
            torch.distributed is initialized (a rank's own checkpoint, e.g. its memory
            tier snapshot); ``process_group`` is then ignored.
        leave: top-level names of the checkpoint that another load reads (e.g. the
            optimizer's, streamed in after the model's): with ``strict``, their keys
            are not unexpected here.

    Raises:
        CheckpointNotFoundError, NotCommittedError, CorruptCheckpointError,
        IncompatibleStateError (all CheckpointError), naming path, fqn and rank.
        On CorruptCheckpointError some destination tensors may already hold new bytes.

    Example::

        quicksave.load({"model": model.state_dict()}, "ckpt/step-10")
        state = {"model": ModelState(model), "optim": OptimizerState(model, optim), "epoch": 0}
        quicksave.load(state, "ckpt/step-10")  # then epoch = state["epoch"]
    """
    distributed = _dist_on() and not no_dist
    group = _DistWrapper(None if no_dist else process_group, distributed, 0)
    where = path.url if isinstance(path, (Location, Checkpoint)) else os.fspath(path)
    planner: LoadPlanner | None = None
    reader: Any = None
    backend: Any = None
    undos: list[Callable[[], None]] = []
    try:
        with _engine_call():  # the manifest's thousands of objects too (see there)
            try:
                loc = (
                    path.location
                    if isinstance(path, Checkpoint)
                    else parse_location(path, options=storage)
                )
                where = loc.url
                planner = LoadPlanner(
                    strict=strict, path=where, allow_pickle=allow_dcp_pickle, leave=tuple(leave)
                )
                backend = loc.open()  # one client for the whole load
                checkpoint = require_committed(
                    path, allow_dcp=True, backend=backend, storage=storage
                )
                reader = reader_for(
                    checkpoint,
                    backend,
                    thread_count=thread_count,
                    allow_dcp_pickle=allow_dcp_pickle,
                )
                # a refused pickle or a bad manifest fails here, before any planning
                with phase("load.metadata"):
                    metadata = reader.read_metadata()
                undos = prepare_destinations(state_dict, metadata, where)
                plain = plain_state_dict(state_dict)
                with phase("load.plan"):
                    local = steps.load_local_plan(plain, metadata, planner, reader, group)
            except BaseException as e:  # noqa: BLE001 - in a group: raised on every rank
                if not distributed:
                    raise
                local = sendable(e, group.get_rank())
            with phase("load.plan"):
                central = steps.exchange_load_plans(local, planner, reader, group, where)
            with phase("load.read"):  # quicksave's reader checks each chunk's xxh3 (verify)
                steps.read_all(central, planner, reader, group, where)
    except BaseException as e:
        for undo in undos:  # e.g. uninitialised optimizer state: never trained with
            undo()
        if distributed and isinstance(e, RuntimeError) and not isinstance(e, CheckpointError):
            raise _collective_failed(
                e, where, rank_of_this_process(), "the state dict may be partly loaded"
            ) from e
        raise
    finally:
        if backend is not None:
            backend.close()
    try:  # after the last collective: a failure here is this rank's own
        with phase("load.restore"):
            hand_back(state_dict, plain)
    except BaseException:
        for undo in undos:
            undo()
        raise
