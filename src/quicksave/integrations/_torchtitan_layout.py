"""torchtitan's checkpoint layout: what the torchtitan backend saves and loads.

Pure functions over the checkpointer's states (no I/O but reading a checkpoint's
metadata, no collectives); the wiring is in :mod:`.torchtitan`.

torchtitan's layout (kept so that checkpoints convert both ways with stock torchtitan):
the model's keys at the top level (``tok_embeddings.weight``, ``layers.0....``) beside
``optimizer`` (flat, keyed by parameter fqn), ``lr_scheduler``, ``dataloader`` (one
``dp_rank_<r>`` entry per data-parallel rank, and ``world_size``) and ``train_state``.
Model-only checkpoints (the seed at step 0, a last step with ``last_save_model_only``)
hold the model's keys only. The kind is recorded in the manifest's ``user_metadata``
under ``checkpoint_kind`` (``full``, ``seed`` or ``export``), as the manager records it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torchtitan.components.checkpointer import DATALOADER, MODEL

from quicksave.commit import CheckpointKind
from quicksave.errors import CheckpointError, IncompatibleStateError
from quicksave.loading.checkpoint import Checkpoint
from quicksave.loading.dcp_stock import DCPReader
from quicksave.loading.reader import CheckpointReader
from quicksave.manager.states import OptimizerState
from quicksave.storage import parse_location

logger = logging.getLogger("quicksave")

KIND_KEY = "checkpoint_kind"  # in the manifest's user_metadata: full, seed or export
MODEL_ONLY_KINDS = ("seed", "export")
_MAX_NAMED = 20  # keys named in one error message


def full_state(states: dict[str, Any], path: str, rank: int | None) -> dict[str, Any]:
    """What a full checkpoint holds: every state's ``state_dict()`` by name, and the
    model's keys at the top level (torchtitan's layout).

    Raises:
        IncompatibleStateError: a model key has the name of a state (one would be lost).
    """
    state: dict[str, Any] = {}
    for name, value in states.items():
        if name != MODEL:
            state[name] = value.state_dict() if is_stateful(value) else value
    model = states[MODEL].state_dict()
    clash = sorted(set(model) & set(state))
    if clash:
        raise IncompatibleStateError(
            f"model keys {clash} collide with checkpoint states of the same names; rename "
            "the module or the state",
            path=path,
            fqn=clash[0],
            rank=rank,
        )
    state.update(model)
    return state


def model_state(states: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """What a model-only checkpoint holds: the model's keys, floating tensors in
    ``dtype`` (torchtitan's ``export_dtype``)."""
    return {
        k: v.to(dtype)
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != dtype
        else v
        for k, v in states[MODEL].state_dict().items()
    }


def read_stored(checkpoint: Checkpoint, *, allow_dcp_pickle: bool) -> tuple[set[str], str | None]:
    """The fqns a committed checkpoint holds, and its kind (``full``, ``seed``,
    ``export``; None for a stock DCP checkpoint or one that records none).

    Raises:
        CheckpointError: the checkpoint cannot be read (corrupt, missing, refused pickle).
    """
    if checkpoint.kind is CheckpointKind.DCP:
        md = DCPReader(checkpoint.location, allow_pickle=allow_dcp_pickle).read_metadata()
        return set(md.state_dict_metadata), None
    reader = CheckpointReader(checkpoint)
    kind = reader.read_manifest().user_metadata.get(KIND_KEY)
    return set(reader.read_metadata().state_dict_metadata), kind


def load_destination(
    states: dict[str, Any],
    stored: set[str],
    kind: str | None,
    *,
    model_only: bool,
    excluded: list[str],
    path: str,
    rank: int | None,
) -> dict[str, Any]:
    """What to load from a checkpoint holding ``stored`` (of ``kind``): the model's
    keys at the top level and, unless ``model_only``, the other states but
    ``excluded``, checked against ``stored`` (:func:`check_keys`).

    Raises:
        CheckpointError: a model-only checkpoint as a training state, or ``excluded``
            names no state.
        IncompatibleStateError: the keys do not fit (named).
    """
    if kind in MODEL_ONLY_KINDS and not model_only:
        raise CheckpointError(
            f"this checkpoint holds the model only ({kind} checkpoint, written at the last "
            "step with last_save_model_only=True), no optimizer or train state: training "
            "cannot resume from it. Load an earlier step (--checkpoint.load_step), or start "
            "a new run from its weights with --checkpoint.initial_load_path and "
            "initial_load_model_only",
            path=path,
            rank=rank,
        )
    model = states[MODEL]
    if model_only:
        dest = model.state_dict()
    else:
        unknown = [k for k in excluded if k not in states]
        if unknown:
            raise CheckpointError(
                f"checkpoint.exclude_from_loading names {unknown}, which are not checkpoint "
                f"states (states: {sorted(states)})",
                path=path,
                rank=rank,
            )
        dest = {k: v for k, v in states.items() if k != MODEL and k not in excluded}
        dest.update(model.state_dict())
    check_keys(dest, stored, states, path=path, rank=rank)
    return dest


def check_keys(
    dest: dict[str, Any],
    stored: set[str],
    states: dict[str, Any],
    *,
    path: str,
    rank: int | None,
) -> None:
    """Every key of ``dest`` must be in the checkpoint. Keys the checkpoint has beyond
    them are fine under the other states' names (other data-parallel ranks' data loader
    entries, excluded states, the rest of a full step 0), logged under names no state
    has, and an error where they look like model keys (a module this model lacks).

    Raises:
        IncompatibleStateError: missing keys, or unexpected model keys (named, with what
            to do for a data loader saved by another number of data-parallel ranks).
    """
    flat, _ = flatten_state_dict(
        {k: v.state_dict() if is_stateful(v) else v for k, v in dest.items()}
    )
    missing = sorted(set(flat) - stored)
    if missing:
        hint = ""
        if any(k.startswith(f"{DATALOADER}.dp_rank_") for k in missing):
            hint = (
                "; the data loader's state is saved per data-parallel rank and torchtitan "
                "cannot reshard it: to resume on another number of data-parallel ranks, add "
                "'dataloader' to checkpoint.exclude_from_loading"
            )
        raise IncompatibleStateError(
            f"the checkpoint lacks {len(missing)} key(s) to load: {_names(missing)}{hint}",
            path=path,
            fqn=missing[0],
            rank=rank,
        )
    model_tops = {k.split(".", 1)[0] for k in states[MODEL].state_dict()}
    extra = sorted(stored - set(flat))
    unexpected = [k for k in extra if k.split(".", 1)[0] in model_tops]
    if unexpected:
        raise IncompatibleStateError(
            f"the checkpoint holds {len(unexpected)} model key(s) this model does not "
            f"have: {_names(unexpected)}",
            path=path,
            fqn=unexpected[0],
            rank=rank,
        )
    unknown = sorted({k.split(".", 1)[0] for k in extra} - set(states))
    if unknown:
        logger.warning(
            "quicksave: %s holds entries no state of this trainer has, not loaded: %s",
            path,
            ", ".join(unknown),
        )


class OptimizerHooks(OptimizerState):
    """Tells the async writer which torch optimizers change the parameters (for its
    step pre-hooks and what overlapped staging may copy late). Never saved: the
    optimizer state comes from torchtitan's container. torchtitan may build several
    optimizers per model part, which ``OptimizerState``'s own constructor refuses."""

    def __init__(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        self.parts = list(parts)
        self.optimizers = list(optimizers)


def torch_optimizers(optimizers: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside torchtitan's container (its ``optimizers`` list), or
    the optimizer itself."""
    inner = getattr(optimizers, "optimizers", None)
    if isinstance(inner, (list, tuple)) and all(
        isinstance(o, torch.optim.Optimizer) for o in inner
    ):
        return list(inner)
    return [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else []


def is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def join_folder(base_folder: str, folder: str) -> str:
    """``folder`` under torchtitan's dump folder, unless it is absolute or a URL."""
    parse_location(folder, what="checkpoint folder")  # 's3:/b/x' must not land under base
    if not base_folder or "://" in folder or os.path.isabs(folder):
        return folder
    if "://" in base_folder:
        return base_folder.rstrip("/") + "/" + folder
    return os.path.join(base_folder, folder)


def _names(keys: list[str]) -> str:
    shown = ", ".join(keys[:_MAX_NAMED])
    return shown + (f" … ({len(keys) - _MAX_NAMED} more)" if len(keys) > _MAX_NAMED else "")
