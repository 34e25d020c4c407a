"""Load: an optimizer's state allocated from the checkpoint, without an optimizer step.

A fresh job's optimizer has no state until its first ``step()``. Loading into it the
way ``torch.distributed.checkpoint.state_dict`` does (``get_optimizer_state_dict``)
first runs a step on zero gradients to create state that the load then overwrites: a
pass over every parameter, fresh moments (two per parameter for AdamW), a square root,
before a byte is read (docs/benchmarks.md, "Restore into a fresh job", has the cost).

Here the checkpoint says what to create: its metadata names every optimizer tensor
(``<name>.state.<param fqn>.<key>``, the flattened layout of :class:`OptimizerState`)
with its dtype and global shape. Each becomes an uninitialised tensor in the
optimizer's own ``state``, laid out as the optimizer would lay it out — shaped like
its parameter (``empty_like``: a DTensor parameter gives a DTensor with the same
placements, so each rank allocates only its local shard), or a plain tensor for
anything else (AdamW's 0-dim ``step``). The loader then reads the checkpoint straight
into those tensors, and ``set_optimizer_state_dict`` hands the same tensors to
``optimizer.load_state_dict``: no step, no second copy. The new memory is faulted in
meanwhile by a thread of its own (:class:`Prefault`), so that neither the load's reads
nor, in a streamed resume, the first training step take its page faults.
Driven by the checkpoint, not by a table of optimizers, so any ``torch.optim``
optimizer whose flattened state the checkpoint holds is covered.

Where the layout cannot be known exactly (FSDP1's flat parameters, a non-scalar state
tensor of a DTensor parameter that is not shaped like it), nothing is allocated and the
load takes torch's own way (the zero-gradient step): slower, equally exact.
"""

from __future__ import annotations

import logging
import math
import mmap
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from quicksave.errors import IncompatibleStateError, rank_of_this_process
from quicksave.storage.cold_read import COLD_MIN
from quicksave.storage.pages import Libc, libc

logger = logging.getLogger("quicksave")

_PREFAULT_PIECE = 8 << 20  # memory faulted in per madvise call
STATE = "state"  # the flattened optimizer state dict's sections (DCP's names)
GROUPS = "param_groups"


def _param_fqns(model: nn.Module) -> dict[torch.nn.Parameter, str] | None:
    """Each parameter of ``model`` mapped to the fqn its flattened optimizer state is
    keyed by (DCP's canonical names: wrapper prefixes removed), or None under FSDP1,
    whose flat parameters stand for several fqns."""
    from torch.distributed.checkpoint.state_dict import _get_fqns
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return None
    out: dict[torch.nn.Parameter, str] = {}
    for name, param in model.named_parameters():
        fqns = _get_fqns(model, name)
        if len(fqns) != 1:
            return None
        out[param] = next(iter(fqns))
    return out


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "placements") and hasattr(t, "to_local")


def _allocate(
    param: torch.Tensor, md: TensorStorageMetadata, local: bool = False
) -> torch.Tensor | None:
    """An uninitialised tensor for one stored state tensor of ``param``, where the
    optimizer would have it; None when its layout cannot be known. ``local``: the
    checkpoint holds this rank's local shards (a memory tier's snapshot), so a DTensor
    parameter's state is recognised by its local shape."""
    dtype, shape = md.properties.dtype, tuple(md.size)
    like = param.to_local() if local and _is_dtensor(param) else param
    if shape == tuple(like.shape):  # a moment, a momentum buffer: like the parameter
        if type(param) is torch.Tensor and param.device.type == "cpu" and param.is_contiguous():
            return _page_aligned(shape, dtype)
        return torch.empty_like(param, dtype=dtype, memory_format=torch.preserve_format)
    if not shape:
        # A scalar (``step``): optimizers keep it on the CPU unless capturable or
        # fused, and then ``Optimizer.load_state_dict`` moves it where it belongs.
        return torch.empty((), dtype=dtype)
    if _is_dtensor(param):
        return None  # a sharded parameter's odd-shaped state: its placement is unknown
    return torch.empty(shape, dtype=dtype, device=param.device)


def _page_aligned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory starts on a page (``ALIGN``), as a
    checkpoint's chunks do in their files: a cold load then reads each one straight
    into it with ``O_DIRECT`` (:mod:`quicksave.storage.cold_read`), with no copy through
    a buffer. The memory is a private anonymous mapping owned by the tensor's storage
    (freed with it); a small tensor gets ordinary memory."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < COLD_MIN:
        return torch.empty(shape, dtype=dtype)
    # Not MADV_HUGEPAGE: fewer faults, but where memory is fragmented the kernel
    # compacts it first, which costs far more than the faults saved (docs/benchmarks.md).
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # as malloc's: not shared
    pages = torch.frombuffer(memory, dtype=torch.uint8)  # page-aligned
    return torch.empty(0, dtype=dtype).set_(pages.untyped_storage(), 0, shape)


def _in_creation_order(entries: dict[str, Any]) -> dict[str, Any]:
    """A parameter's state keys as torch's optimizers create them, as far as the
    checkpoint tells: the stored order (a quicksave manifest sorts it, a DCP
    ``.metadata`` keeps it) with ``step`` first. That is the optimizer's own order for
    Adam, AdamW, SGD, RAdam, Adamax, Rprop, so the state, and the staging plan of the
    next save, are laid out exactly as before the restart; elsewhere only the order of
    the keys differs, never a value."""
    return {k: entries[k] for k in sorted(entries, key=lambda k: k != "step")}


def _nest(entries: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": v}`` → ``{"a": {"b": v}}``: the nested state some optimizers keep,
    flattened by DCP into dotted keys."""
    out: dict[str, Any] = {}
    for key, value in entries.items():
        *heads, last = key.split(".")
        node = out
        for head in heads:
            node = node.setdefault(head, {})
        node[last] = value
    return out


def _stored_by_param(
    stored: Mapping[str, Any], head: str, names: set[str]
) -> dict[str, dict[str, Any]]:
    """The stored entries under ``head`` (``<name>.state.``) grouped by parameter fqn:
    ``{fqn: {key: metadata}}``. The fqn is the shortest dotted prefix that names a
    parameter (a parameter's name never continues into another's: its owner would be
    a parameter and a module at once)."""
    out: dict[str, dict[str, Any]] = {}
    for key, md in stored.items():
        if not key.startswith(head):
            continue
        rest = key[len(head) :]
        dot = rest.find(".")
        while dot != -1 and rest[:dot] not in names:
            dot = rest.find(".", dot + 1)
        if dot != -1:
            out.setdefault(rest[:dot], {})[rest[dot + 1 :]] = md
    return out


def check_flattened(stored: Mapping[str, Any], prefix: str) -> None:
    """Raise if the checkpoint holds the optimizer under ``prefix`` as torch's own
    ``optimizer.state_dict()`` (state keyed by parameter index, each param group with
    its ``params`` list) rather than :class:`OptimizerState`'s flattened layout (keyed
    by parameter fqn): the keys would not match, and the plain key-mismatch error
    would list dozens of ``param_groups`` entries without saying why.

    Raises:
        IncompatibleStateError: the index-keyed layout, naming the state and how to
            load it.
    """
    if f"{prefix}{GROUPS}.0.params" not in stored:
        return
    name = prefix[:-1]
    raise IncompatibleStateError(
        f"the checkpoint holds {name!r} as torch's optimizer.state_dict() saves it (state "
        "keyed by parameter index), and OptimizerState loads its own layout (keyed by "
        "parameter name); load this one as it was saved, e.g. "
        f"optim.load_state_dict(quicksave.load_state(path)[{name!r}]), and save with "
        "OptimizerState(model, optim) to resume with quicksave.load or a CheckpointManager",
        fqn=name,
        rank=rank_of_this_process(),
    )


def allocate_optimizer_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    stored: Mapping[str, Any],
    prefix: str,
    local: bool = False,
) -> Callable[[], None] | None:
    """Give ``optimizer`` (without state) the state tensors the checkpoint holds for
    it, uninitialised, so that a load fills them in place (``local``: the checkpoint
    holds this rank's local shards, see :func:`_allocate`).

    Args:
        model: the model part ``optimizer`` optimizes.
        optimizer: a ``torch.optim.Optimizer``; one that has state already is left
            alone (the load overwrites that state in place).
        stored: the checkpoint's fqns mapped to their DCP storage metadata.
        prefix: the fqn prefix of this optimizer's flattened state in the checkpoint
            (``"<state name>."``).

    Returns:
        A function that empties the state again (for a load that fails: uninitialised
        memory must not be trained with), or None when nothing was allocated: the
        optimizer has state, the checkpoint holds none for it, or its layout cannot be
        known exactly (then the load creates the state the way torch does).
    """
    if optimizer.state:
        return None
    fqns = _param_fqns(model)
    if fqns is None:
        return None
    held = _stored_by_param(stored, f"{prefix}{STATE}.", set(fqns.values()))
    state: dict[torch.Tensor, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            fqn = fqns.get(param)
            entries: dict[str, Any] = {}
            for key, md in held.get(fqn, {}).items() if fqn is not None else ():
                if isinstance(md, TensorStorageMetadata):
                    value = _allocate(param.detach(), md, local)
                    if value is None:
                        logger.debug(
                            "quicksave: %s%s.%s has no known layout; the optimizer state "
                            "is created by a zero-gradient step",
                            prefix,
                            fqn,
                            key,
                        )
                        return None
                    entries[key] = value
                else:
                    entries[key] = 0  # a number or object: replaced whole by the load
            if entries:
                state[param] = _nest(_in_creation_order(entries))
    if not state:
        return None
    optimizer.state.update(state)
    prefault = Prefault([t for entries in state.values() for t in _fresh(entries)])

    def undo() -> None:
        prefault.stop()
        for param in state:
            optimizer.state.pop(param, None)

    return undo


def _fresh(entries: Mapping[str, Any]) -> list[torch.Tensor]:
    """The CPU tensors of ``COLD_MIN`` bytes or more among one parameter's allocated
    state (nested dicts: some optimizers'): new memory worth faulting in ahead."""
    out: list[torch.Tensor] = []
    for v in entries.values():
        if isinstance(v, Mapping):
            out += _fresh(v)
        elif (
            type(v) is torch.Tensor
            and v.device.type == "cpu"
            and v.numel() * v.element_size() >= COLD_MIN
        ):
            out.append(v)
    return out


class Prefault:
    """Fresh state tensors' memory faulted in, in the optimizer's order (the order the
    load reads them in), on a thread of its own (``madvise``, without the GIL:
    :meth:`quicksave.storage.pages.Libc.populate`). A first touch of new memory costs
    the kernel a fault per page; taken here, it is not taken by the load's reads (an
    ``O_DIRECT`` read into unfaulted memory is much slower), nor, in a streamed resume,
    beside the first forward and backward. Contents are kept, so the load may write a
    tensor while it is faulted in; the tensors are held until it is done (memory taken
    back meanwhile is not unmapped under it). Where the kernel cannot (before Linux
    5.14) it stops at once, and the load's writes fault the pages in as before.

    It runs at the trainer's priority, not lower: ``madvise`` holds the process's
    memory-map lock while it faults a piece in, and a thread at nice 19 preempted there
    on busy cores stalled everything that maps memory behind it (a thread's start, a
    large allocation). In a peer restore, which keeps both of this machine's cores
    busy, the streamed optimizer load then started 0.2 s late and the restore took
    1.47-3.40x its floor, against 1.13-1.24x at the trainer's priority (2026-12-02,
    docs/benchmarks.md)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._stopped = threading.Event()
        lib = libc() if tensors else None
        if lib is not None:
            threading.Thread(
                target=self._run, args=(lib, tensors), name="quicksave-prefault", daemon=True
            ).start()

    def _run(self, lib: Libc, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            start, size = storage.data_ptr(), storage.nbytes()
            for at in range(0, size, _PREFAULT_PIECE):  # short holds of the mm's lock
                if self._stopped.is_set() or not lib.populate(
                    start + at, min(_PREFAULT_PIECE, size - at)
                ):
                    return

    def stop(self) -> None:
        """Fault no more in (a failed load takes the memory back)."""
        self._stopped.set()
