"""Collect: the ``Stateful`` wrappers the manager saves and restores.

Every wrapper returns only tensors and plain values (ints, floats, strings, lists,
dicts) from ``state_dict()``, so a checkpoint is read back without unpickling anything.

- :class:`ModelState`: one or many model parts (e.g. pipeline stages), merged into one
  flat state dict through ``torch.distributed.checkpoint.state_dict`` (so FSDP/DTensor
  models give sharded tensors).
- :class:`OptimizerState`: one optimizer per model part, each *flattened* (state keyed by
  parameter fqn, not by index) so that the parts' entries do not collide.
- :class:`TrainState`: the step and the loss history.
- :class:`RNGState`: torch (CPU and CUDA), Python ``random`` and NumPy global generators.
- :class:`StatefulList`: several ``Stateful`` objects (e.g. one LR scheduler per part)
  under one name.
- :class:`PerRank`: any ``Stateful`` whose state differs per rank (a stateful data
  loader's position), saved and restored per rank.
- :class:`PerRankState` (a protocol: ``PerRank``, ``RNGState``): each rank saves its own
  entry; :class:`PerRankLoad` restores only this rank's entry while keeping the load
  strict.

Anything else with ``state_dict()`` and ``load_state_dict()`` (LR schedulers, user
objects) is saved as it is, under one name for all ranks: every rank must hold the same
value there (a save whose ranks' values differ fails, ``ranks/replicas.py``).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from quicksave.errors import IncompatibleStateError, rank_of_this_process
from quicksave.manager.optim_restore import allocate_optimizer_state, check_flattened
from quicksave.manager.plain_state_dict import FLAT, model_state_dict, optimizer_state_dict

logger = logging.getLogger("quicksave")


def is_stateful(obj: Any) -> bool:
    """True if ``obj`` has callable ``state_dict`` and ``load_state_dict`` (DCP's protocol)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _as_list(value: Any, kind: type, what: str) -> list[Any]:
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise IncompatibleStateError(f"{what}: expected at least one {kind.__name__}, got none")
    for i, item in enumerate(items):
        if not isinstance(item, kind):
            raise IncompatibleStateError(
                f"{what}: item {i} is a {type(item).__module__}.{type(item).__qualname__}, "
                f"not a {kind.__module__}.{kind.__qualname__}"
            )
    return items


def _merge(parts: Iterable[dict[str, Any]], what: str) -> dict[str, Any]:
    """Merge per-part state dicts; a key in two parts would silently lose one of them."""
    merged: dict[str, Any] = {}
    for i, sd in enumerate(parts):
        if merged and not merged.keys().isdisjoint(sd):  # (whole dicts: no loop per key)
            raise IncompatibleStateError(
                f"{what}: part {i} has a key that an earlier part also has; give the parts "
                "distinct parameter names (e.g. split one model, do not reuse one class "
                "at the top level)",
                fqn=next(key for key in sd if key in merged),
                rank=rank_of_this_process(),
            )
        merged.update(sd)
    return merged


class ModelState:
    """The model (one module, or several parts) as one ``Stateful``.

    Args:
        model: an ``nn.Module`` or a list of them whose parameter names do not overlap.

    Raises:
        IncompatibleStateError: ``model`` is not a module or a non-empty list of them;
            (at ``state_dict()``) two parts have the same key.

    Example::

        states = {"model": ModelState([stage0, stage1])}
    """

    def __init__(self, model: nn.Module | Sequence[nn.Module]) -> None:
        self.parts: list[nn.Module] = _as_list(model, nn.Module, "ModelState")

    def state_dict(self) -> dict[str, Any]:
        return _merge((model_state_dict(p) for p in self.parts), "ModelState")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Each part takes its own keys out of the merged dict; strict=False because the
        # other parts' keys are (rightly) unexpected for it. The key set as a whole was
        # already checked against the checkpoint by the loader.
        for part in self.parts:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=False))


class OptimizerState:
    """One optimizer per model part, flattened and merged into one ``Stateful``.

    Args:
        model: the model part(s), in the same order as ``optimizer``.
        optimizer: a ``torch.optim.Optimizer`` or a list of them, one per part.

    Raises:
        IncompatibleStateError: wrong types, or not one optimizer per model part.

    Example::

        states = {"optimizer": OptimizerState([stage0, stage1], [opt0, opt1])}
    """

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    ) -> None:
        self.parts: list[nn.Module] = _as_list(model, nn.Module, "OptimizerState model")
        self.optimizers: list[torch.optim.Optimizer] = _as_list(
            optimizer, torch.optim.Optimizer, "OptimizerState optimizer"
        )
        if len(self.parts) != len(self.optimizers):
            raise IncompatibleStateError(
                f"OptimizerState needs one optimizer per model part, got {len(self.parts)} "
                f"part(s) and {len(self.optimizers)} optimizer(s)"
            )

    def state_dict(self) -> dict[str, Any]:
        return _merge(
            (optimizer_state_dict(p, o) for p, o in zip(self.parts, self.optimizers, strict=True)),
            "OptimizerState",
        )

    def prepare_load(
        self, stored: Mapping[str, Any], prefix: str, local: bool = False
    ) -> Callable[[], None] | None:
        """Before a load (the loader calls it): each optimizer without state gets the
        state tensors the checkpoint holds for it, allocated from the checkpoint's
        metadata, so that the load reads into them and no optimizer step is run to
        create them (``optim_restore.py``).

        Args:
            stored: the checkpoint's fqns mapped to their DCP storage metadata.
            prefix: this state's name in the checkpoint plus a dot.
            local: the checkpoint holds this rank's local shards of DTensors (a memory
                tier's snapshot).

        Returns:
            A function that takes the allocated state back (the load failed), or None
            when nothing was allocated.

        Raises:
            IncompatibleStateError: the checkpoint holds this state as torch's
                ``optimizer.state_dict()`` (keyed by parameter index), not flattened.
        """
        check_flattened(stored, prefix)
        undos = [
            undo
            for part, optim in zip(self.parts, self.optimizers, strict=True)
            if (undo := allocate_optimizer_state(part, optim, stored, prefix, local)) is not None
        ]
        if not undos:
            return None

        def undo_all() -> None:
            for undo in undos:
                undo()

        return undo_all

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part, optim in zip(self.parts, self.optimizers, strict=True):
            set_optimizer_state_dict(part, optim, state_dict, options=FLAT)
            # DCP gives every parameter an entry, {} where the checkpoint holds none (a
            # parameter that never had a gradient); a flattened checkpoint cannot hold
            # an empty entry, so none is state: drop them, as the saved optimizer had.
            for param in [p for p, entry in optim.state.items() if not entry]:
                del optim.state[param]


@dataclass
class TrainState:
    """Training progress: the step and the loss history, as plain numbers.

    Saved under one name for all ranks, so every rank must hold the same values: log
    the loss of the global batch (averaged over the ranks), not each rank's own, or the
    save fails naming ``losses`` and each rank's values.

    Attributes:
        step: the last completed training step.
        losses: the loss logged at each entry of ``log_steps``.
        log_steps: the steps at which ``losses`` were logged.

    Example::

        train_state = TrainState()
        train_state.step += 1
        train_state.losses.append(loss.item()); train_state.log_steps.append(train_state.step)
    """

    step: int = 0
    losses: list[float] = field(default_factory=list)
    log_steps: list[int] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": int(self.step),
            "losses": [float(x) for x in self.losses],
            "log_steps": [int(x) for x in self.log_steps],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.losses = [float(x) for x in state_dict["losses"]]
        self.log_steps = [int(x) for x in state_dict["log_steps"]]


def rank_entry() -> str:
    """The name of this rank's entry in a per-rank state: ``rank_<r>`` (global rank)."""
    return f"rank_{rank_of_this_process() or 0}"


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


RESIZE_POLICIES = ("error", "keep")


class PerRank:
    """Any ``Stateful`` whose state differs between ranks, saved once per rank: each
    rank saves its own entry and gets it back.

    Use it for a stateful data loader (each rank reads its own shard, so each has its
    own position), per-rank counters or generators. Under a plain name a checkpoint keeps
    one copy for all ranks, so a save whose ranks hold different values there fails,
    naming this wrapper. Stored as ``<name>.rank_<r>.<key>``, one entry per global rank.

    Resuming on another number of ranks, the entries no longer match the ranks:

    - ``on_resize="error"`` (default): the manager's ``load()`` raises
      ``IncompatibleStateError`` on every rank before anything is read, naming the state
      and how many ranks saved it;
    - ``on_resize="keep"``: a rank with an entry of its own (the same rank number) loads
      it; a rank without one keeps its current state and logs a warning (a data loader
      then starts its shard over); entries of ranks that are gone are ignored.

    ``quicksave.load`` (without the manager) loads each rank's own entry on the same
    number of ranks; on another, a strict load names the missing or unexpected entries.

    Args:
        state: the per-rank ``Stateful`` (``state_dict()`` / ``load_state_dict()``).
        on_resize: ``"error"`` or ``"keep"``, see above.

    Raises:
        IncompatibleStateError: ``state`` is not ``Stateful``; an unknown ``on_resize``.

    Example::

        states = {"model": ModelState(model), "dataloader": quicksave.PerRank(loader)}
    """

    def __init__(self, state: Any, *, on_resize: str = "error") -> None:
        if not is_stateful(state):
            raise IncompatibleStateError(
                f"PerRank: {type(state).__module__}.{type(state).__qualname__} has no "
                "state_dict()/load_state_dict()"
            )
        if on_resize not in RESIZE_POLICIES:
            raise IncompatibleStateError(
                f"PerRank: on_resize must be one of {RESIZE_POLICIES}, got {on_resize!r}"
            )
        self.state = state
        self.on_resize = on_resize

    def rank_key(self) -> str:
        """The name of this rank's entry: ``rank_<r>``."""
        return rank_entry()

    def state_dict(self) -> dict[str, Any]:
        return {self.rank_key(): self.state.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state.load_state_dict(state_dict[self.rank_key()])

    def __repr__(self) -> str:
        return f"PerRank({self.state!r}, on_resize={self.on_resize!r})"


@runtime_checkable
class PerRankState(Protocol):
    """A ``Stateful`` whose ``state_dict()`` is ``{rank_key(): this rank's state}``:
    every rank saves its own entry (one shared name would keep only one rank's).

    It may have an ``on_resize`` attribute (``PerRank``): ``"error"`` refuses a load
    whose entries are not exactly one per rank of this job; without it, ``"keep"``."""

    def rank_key(self) -> str: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class PerRankLoad:
    """Stands in for a :class:`PerRankState` while a checkpoint is loaded.

    The loader checks keys strictly, and the checkpoint holds every saving rank's entry,
    so the other ranks' entries get throwaway destinations built from the checkpoint's
    metadata; only this rank's entry reaches the real state. A rank without an entry of
    its own (the job was saved by fewer ranks) keeps its state and logs a warning; a
    state with no entry at all in the checkpoint is reported missing by the loader.

    Args:
        name: the state's name in the manager's states.
        state: the per-rank state.
        stored: the checkpoint's fqns mapped to their DCP storage metadata; without
            it, ``quicksave.load`` gives them through :meth:`prepare_load` (from the
            metadata it reads anyway: no second read of the manifest).

    Raises:
        IncompatibleStateError: the state's ``on_resize`` is ``"error"`` and the
            checkpoint's entries are not one per rank of this job. Every rank raises
            it, before any read: all see the same checkpoint and world size.
    """

    def __init__(
        self, name: str, state: PerRankState, stored: Mapping[str, Any] | None = None
    ) -> None:
        self.name = name
        self.state = state
        self.others: dict[str, Any] = {}
        self.load_own = True
        if stored is not None:
            self.prepare_load(stored, f"{name}.")

    def prepare_load(self, stored: Mapping[str, Any], prefix: str) -> None:
        """Learn the checkpoint's entries of this state (the loader calls it before it
        asks for the state dict); raises as the class says."""
        own = f"{self.state.rank_key()}."
        if getattr(self.state, "on_resize", "keep") == "error":
            entries = {
                fqn[len(prefix) :].split(".", 1)[0] for fqn in stored if fqn.startswith(prefix)
            }
            _check_entries(self.name, entries, _world_size())
        self.others = {
            fqn[len(prefix) :]: _placeholder(md)
            for fqn, md in stored.items()
            if fqn.startswith(prefix) and not fqn[len(prefix) :].startswith(own)
        }
        has_own = any(fqn.startswith(prefix + own) for fqn in stored)
        # Without any entry the own state stays in, so that the loader reports it missing.
        self.load_own = has_own or not self.others

    def state_dict(self) -> dict[str, Any]:
        # DCP flattens "rank_1.torch" under "rng" to the stored fqn "rng.rank_1.torch".
        own = self.state.state_dict() if self.load_own else {}
        return {**self.others, **own}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        key = self.state.rank_key()
        if self.load_own:
            self.state.load_state_dict({key: state_dict[key]})
        else:
            logger.warning(
                "quicksave: the checkpoint holds no %r entry for %s (it was saved by other "
                "ranks); left as it is",
                self.name,
                key,
            )


def _check_entries(name: str, entries: set[str], world: int) -> None:
    """Refuse per-rank entries that are not ``rank_0`` … ``rank_<world-1>`` (a
    ``PerRank(on_resize="error")`` resumed on another number of ranks)."""
    if not entries or entries == {f"rank_{r}" for r in range(world)}:
        return  # no entry at all: the loader reports the state missing
    saved = sorted(int(e[5:]) for e in entries if e.startswith("rank_") and e[5:].isdigit())
    n = len(entries)
    if world < n:
        what = f"the entries of {_ranks(saved[world:])} would be lost"
    elif world > n:
        new = list(range(n, world))
        what = f"{_ranks(new)} {'has no entry' if len(new) == 1 else 'have no entries'}"
    else:
        what = f"its entries ({', '.join(sorted(entries))}) are not one per rank"
    raise IncompatibleStateError(
        f"this per-rank state was saved by {n} ranks and this job has {world}: {what}. "
        f"Resume on {n} ranks, or build it as quicksave.PerRank(obj, on_resize='keep') "
        "to load the entries of ranks that have one and keep the current state on the "
        "others (a data loader there starts its shard over); nothing was loaded",
        fqn=name,
        rank=rank_of_this_process(),
    )


def _ranks(ranks: list[int]) -> str:
    """``rank 2``, ``ranks 2, 3``, ``ranks 2-7``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def _placeholder(md: Any) -> Any:
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(tuple(md.size), dtype=md.properties.dtype)
    return None  # objects are replaced whole by the loader


class RNGState:
    """The global random generators of this process, restored exactly.

    Saved per rank (under ``rank_<r>``): ranks usually hold different generator states,
    and one shared name would keep only one rank's (a :class:`PerRankState`). A rank
    whose entry is missing at load (the job was saved by fewer ranks) keeps its
    generators as they are and logs a warning.

    Example::

        states = {"rng": RNGState()}
    """

    def rank_key(self) -> str:
        """The name of this rank's entry: ``rank_<r>``."""
        return rank_entry()

    def state_dict(self) -> dict[str, Any]:
        version, py_state, gauss_next = random.getstate()
        algorithm, np_key, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": {
                "version": int(version),
                "state": torch.tensor(py_state, dtype=torch.int64),
                "gauss_next": gauss_next,
            },
            "numpy": {
                "algorithm": str(algorithm),
                "key": torch.from_numpy(np.asarray(np_key, dtype=np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
        }
        if torch.cuda.is_available():
            state["cuda"] = {str(i): s for i, s in enumerate(torch.cuda.get_rng_state_all())}
        return {self.rank_key(): state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict[self.rank_key()]
        torch.set_rng_state(state["torch"].cpu())
        py = state["python"]
        random.setstate(
            (py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss_next"])
        )
        npy = state["numpy"]
        np.random.set_state(
            (
                npy["algorithm"],
                npy["key"].numpy().astype(np.uint32),
                npy["pos"],
                npy["has_gauss"],
                npy["cached_gaussian"],
            )
        )
        if "cuda" in state and torch.cuda.is_available():
            cuda = state["cuda"]
            torch.cuda.set_rng_state_all([cuda[str(i)].cpu() for i in range(len(cuda))])


class StatefulList:
    """Several ``Stateful`` objects (e.g. one LR scheduler per model part) as one,
    stored under ``"0"``, ``"1"``, ...

    Raises:
        IncompatibleStateError: an item lacks ``state_dict`` / ``load_state_dict``.

    Example::

        states = {"lr_scheduler": StatefulList([sched0, sched1])}
    """

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = list(items)
        for i, item in enumerate(self.items):
            if not is_stateful(item):
                raise IncompatibleStateError(
                    f"StatefulList: item {i} ({type(item).__module__}.{type(item).__qualname__}) "
                    "has no state_dict()/load_state_dict()"
                )

    def state_dict(self) -> dict[str, Any]:
        return {str(i): item.state_dict() for i, item in enumerate(self.items)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for i, item in enumerate(self.items):
            item.load_state_dict(state_dict[str(i)])


def check_states(states: Mapping[str, Any]) -> dict[str, Any]:
    """Check the manager's states before any I/O; lists and tuples become a StatefulList.

    Raises:
        IncompatibleStateError: a name is not a non-empty string, or a value is not
            ``Stateful`` (a bare optimizer included); names the state as fqn.
    """
    if not isinstance(states, Mapping):
        raise IncompatibleStateError(
            f"states must be a mapping of names to Stateful objects, got {type(states).__name__}"
        )
    checked: dict[str, Any] = {}
    for name, value in states.items():
        if not isinstance(name, str) or not name:
            raise IncompatibleStateError(f"state names must be non-empty strings, got {name!r}")
        if isinstance(value, torch.optim.Optimizer):
            raise IncompatibleStateError(
                "a bare torch.optim.Optimizer keys its state by parameter index, which "
                "collides across model parts and breaks resharding; pass "
                "OptimizerState(model, optimizer) instead",
                fqn=name,
            )
        if isinstance(value, (list, tuple)) and not isinstance(value, nn.Module):
            value = StatefulList(value)
        if not is_stateful(value):
            raise IncompatibleStateError(
                f"state of type {type(value).__module__}.{type(value).__qualname__} has no "
                "state_dict()/load_state_dict(); wrap models in ModelState, optimizers in "
                "OptimizerState, or give the object those two methods",
                fqn=name,
            )
        checked[name] = value
    return checked


def payload_bytes(state_dict: Mapping[str, Any]) -> int:
    """Bytes of the tensors of this rank in ``state_dict`` (local shards of DTensors).

    One call per container, not per leaf: a mapping's or list's values are summed with
    ``map`` (the leaves DCP's flattening would yield; a list without tensors adds 0)."""
    return sum(map(_leaf_bytes, state_dict.values()))


def _leaf_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and hasattr(value, "to_local"):  # DTensor
            value = value.to_local()
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        value = value.values()
    elif not isinstance(value, list):
        return 0
    return sum(map(_leaf_bytes, [v for v in value if type(v) not in _SCALARS]))


_SCALARS = frozenset({int, float, str, bool, type(None)})  # no bytes to count
