"""The function layer: ``quicksave.save`` and ``quicksave.load``.

``save`` runs the engine's planner and pipeline without staging
(``saving/sync_save.py``); ``load`` runs DCP's load planner (resharded reads into
DTensor / ShardedTensor / plain destinations, any world size) step by step over
quicksave's reader (``adapters/dcp_steps.py``). Both talk to other ranks through
quicksave's one plan exchange, so a failure on any rank is raised on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.utils import _DistWrapper

from quicksave.adapters import dcp_steps as steps
from quicksave.adapters.dcp_reader import StorageReader, require_committed
from quicksave.commit import CheckpointKind, classify, strategy_class
from quicksave.errors import (
    CheckpointError,
    IncompatibleStateError,
    rank_of_this_process,
)
from quicksave.format.dtypes import dtype_name
from quicksave.loading.dcp_stock import DCPReader, RestrictedObjectsMixin
from quicksave.ranks.exchange import sendable
from quicksave.saving.sync_save import SyncSave, save_sync
from quicksave.storage import StorageOptions, parse_location
from quicksave.trace import phase


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _engine_call() -> Iterator[None]:
    """Around one save or load (the DCP planner's steps):

    - silence DCP's warning on single-process calls (quicksave's normal case);
    - pause the cyclic garbage collector. A save or load allocates tens of thousands of
      short-lived planning objects; with torch imported (~250k tracked objects) the full
      collections they trigger measured 0.1-0.5 s per call here. Everything allocated is
      freed by reference counting; collection resumes when the call returns.
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


def _real_path(root: Any, path: tuple) -> tuple:
    """``path`` with each string key replaced by the destination's own key whose ``str``
    it is (e.g. an optimizer's int parameter ids), so values land where they came from."""
    out = []
    node = root
    for key in path:
        if isinstance(node, Mapping) and key not in node:
            key = next((k for k in node if str(k) == key), key)
        out.append(key)
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            node = None
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class _LoadedKeys:
    """The fqns one rank loads, sent to the coordinator in its local plan."""

    fqns: tuple[str, ...]


def _some(fqns: list[str], limit: int = 20) -> str:
    return ", ".join(fqns[:limit]) + (f" … ({len(fqns)} in all)" if len(fqns) > limit else "")


class LoadPlanner(RestrictedObjectsMixin, DefaultLoadPlanner):
    """DCP's default load planner plus quicksave's checks and object hand-off.

    Before any read it compares the destination with the checkpoint and raises
    IncompatibleStateError, naming the offending fqns, for shape or dtype mismatches
    and (when strict) for missing or unexpected keys.

    Strictness is a property of the whole group, not of one rank: in a pipeline-
    parallel job, or with per-rank entries, each rank loads only its own keys.

    - missing: a key this rank asks for that the checkpoint lacks, raised by that rank
      in DCP's local planning step (every failing rank is named);
    - unexpected: a key of the checkpoint that *no* rank asks for, found by the
      coordinator in DCP's global planning step from the key sets the ranks' local
      plans carry (``planner_data``). That rides on the plan exchange DCP makes anyway:
      no extra collective.
    """

    def __init__(self, *, strict: bool = True, path: str = "", allow_pickle: bool = False) -> None:
        super().__init__(allow_partial_load=not strict)
        self.strict = strict
        self.path = path
        self.allow_pickle = allow_pickle  # stock DCP objects (RestrictedObjectsMixin)

    def set_up_planner(
        self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        assert metadata is not None
        if self.mappings:  # DCP stringifies dict keys in paths: map back to the real keys
            self.mappings = {
                fqn: _real_path(self.original_state_dict, p) for fqn, p in self.mappings.items()
            }
        self._check(metadata)

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        if not self.strict:
            return plan
        loaded = sorted(set(self.state_dict) & set(self.metadata.state_dict_metadata))
        return dataclasses.replace(plan, planner_data=_LoadedKeys(tuple(loaded)))

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        if self.strict:
            loaded: set[str] = set()
            for plan in global_plan:
                if isinstance(plan.planner_data, _LoadedKeys):
                    loaded.update(plan.planner_data.fqns)
            unexpected = sorted(set(self.metadata.state_dict_metadata) - loaded)
            if unexpected:
                who = "this process" if len(global_plan) == 1 else "any rank"
                raise IncompatibleStateError(
                    f"state dict keys do not match the checkpoint (in the checkpoint but "
                    f"not in the state dict of {who}: {_some(unexpected)}); "
                    "pass strict=False to load the intersection",
                    path=self.path,
                    fqn=unexpected[0],
                )
            # Only the coordinator needs the key sets: do not send them back.
            global_plan = [dataclasses.replace(p, planner_data=None) for p in global_plan]
        return super().create_global_plan(global_plan)

    def _check(self, metadata: Metadata) -> None:
        rank = rank_of_this_process()
        stored = metadata.state_dict_metadata
        dest_keys = set(self.state_dict)
        missing = sorted(dest_keys - set(stored))
        if self.strict and missing:
            raise IncompatibleStateError(
                f"state dict keys do not match the checkpoint (missing from checkpoint: "
                f"{_some(missing)}); pass strict=False to load the intersection",
                path=self.path,
                fqn=missing[0],
                rank=rank,
            )
        for fqn in sorted(dest_keys & set(stored)):
            md, value = stored[fqn], self.state_dict[fqn]
            is_tensor = (
                hasattr(value, "size") and hasattr(value, "dtype") and not isinstance(value, type)
            )
            if isinstance(md, TensorStorageMetadata):
                if not is_tensor:
                    raise IncompatibleStateError(
                        "checkpoint holds a tensor here but the state dict has a value of type "
                        f"{type(value).__name__}",
                        path=self.path,
                        fqn=fqn,
                        rank=rank,
                    )
                if tuple(value.size()) != tuple(md.size):
                    raise IncompatibleStateError(
                        f"shape mismatch: checkpoint {list(md.size)}, "
                        f"state dict {list(value.size())}",
                        path=self.path,
                        fqn=fqn,
                        rank=rank,
                    )
                if value.dtype != md.properties.dtype:
                    raise IncompatibleStateError(
                        f"dtype mismatch: checkpoint {dtype_name(md.properties.dtype)}, "
                        f"state dict {dtype_name(value.dtype)}",
                        path=self.path,
                        fqn=fqn,
                        rank=rank,
                    )
            elif (
                isinstance(md, BytesStorageMetadata)
                and is_tensor
                and isinstance(value, torch.Tensor)
            ):
                raise IncompatibleStateError(
                    "checkpoint holds a non-tensor value here but the state dict has a tensor",
                    path=self.path,
                    fqn=fqn,
                    rank=rank,
                )

    def load_value(self, read_item, value: Any) -> None:
        """Take a value ``StorageReader`` decoded from JSON (no ``torch.save`` round trip)."""
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], value)
        else:
            self.state_dict[fqn] = value


def load(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    process_group: dist.ProcessGroup | None = None,
    thread_count: int = 4,
    allow_dcp_pickle: bool = False,
    storage: StorageOptions | None = None,
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
            ``msc://`` URL.
        strict: if True (default) the key sets must match across the group: every key
            a rank asks for is in the checkpoint (else that rank is named), and every
            key of the checkpoint is asked for by some rank (each rank may load a
            subset: pipeline stages, per-rank entries). If False, the keys present in
            both are loaded and the others are left untouched.

    Raises:
        CheckpointNotFoundError, NotCommittedError, CorruptCheckpointError,
        IncompatibleStateError (all CheckpointError), naming path, fqn and rank.
        On CorruptCheckpointError some destination tensors may already hold new bytes.

    Example::

        quicksave.load({"model": model.state_dict()}, "ckpt/step-10")
        state = {"model": ModelState(model), "optim": OptimizerState(model, optim), "epoch": 0}
        quicksave.load(state, "ckpt/step-10")  # then epoch = state["epoch"]
    """
    distributed = _dist_on()
    group = _DistWrapper(process_group, distributed, 0)
    where = os.fspath(path)  # named in errors until the location is known
    planner: LoadPlanner | None = None
    reader: Any = None
    backend: Any = None
    undos: list[Callable[[], None]] = []
    try:
        with _engine_call():  # the manifest's thousands of objects too (see there)
            try:
                loc = parse_location(path, options=storage)
                where = loc.url
                planner = LoadPlanner(strict=strict, path=where, allow_pickle=allow_dcp_pickle)
                backend = loc.open()  # one client for the whole load
                reader = _reader_for(loc, backend, thread_count, allow_dcp_pickle)
                # a refused pickle or a bad manifest fails here, before any planning
                with phase("load.metadata"):
                    metadata = reader.read_metadata()
                undos = _prepare_destinations(state_dict, metadata, where)
                plain = _plain_state_dict(state_dict)
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
            _hand_back(state_dict, plain)
    except BaseException:
        for undo in undos:
            undo()
        raise


def _plain_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """What the planner loads into: each ``Stateful`` value's ``state_dict()`` in its
    place (as ``dcp.load``), the other values as they are."""
    return {
        key: value.state_dict() if isinstance(value, Stateful) else value
        for key, value in state_dict.items()
    }


def _hand_back(state_dict: Mapping[str, Any], plain: dict[str, Any]) -> None:
    """After every read: each ``Stateful`` gets ``load_state_dict`` of what was loaded
    for it, and the other top-level values are replaced by the loaded ones."""
    for key, value in list(state_dict.items()):
        if isinstance(value, Stateful):
            value.load_state_dict(plain[key])
        else:
            state_dict[key] = plain[key]  # type: ignore[index]


def _reader_for(loc: Any, backend: Any, thread_count: int, allow_dcp_pickle: bool) -> Any:
    """The reader of the checkpoint at ``loc``: DCP's (restricted unpickling) for a stock
    DCP checkpoint, else quicksave's, once the checkpoint is known to be committed."""
    if classify(loc, backend) is CheckpointKind.DCP:
        return DCPReader(loc, allow_pickle=allow_dcp_pickle, backend=backend)
    require_committed(loc, backend=backend)
    return StorageReader(loc, thread_count=thread_count, backend=backend)


def _prepare_destinations(
    state_dict: Mapping[str, Any], metadata: Metadata, path: str
) -> list[Callable[[], None]]:
    """Let each top-level value with a ``prepare_load(stored, prefix)`` method shape its
    destinations from the checkpoint's metadata before DCP asks for its state dict (an
    ``OptimizerState`` whose optimizer has no state yet allocates it, instead of
    torch's zero-gradient step). Returns the functions that undo it, for a failed load;
    an error it raises is given ``path`` (the checkpoint) if it names none."""
    undos = []
    try:
        for key, value in state_dict.items():
            if not callable(getattr(value, "prepare_load", None)):
                continue
            undo = value.prepare_load(metadata.state_dict_metadata, f"{key}.")
            if undo is not None:
                undos.append(undo)
    except BaseException as e:  # e.g. a per-rank state refusing the checkpoint
        for undo in undos:
            undo()
        if isinstance(e, CheckpointError) and e.path is None:
            e.path = path
        raise
    return undos
