"""Generic calls run by the persister: any picklable function and its arguments, run in
the worker process (or the thread persister) and answered with a ``CallResult``.

This is the generic mechanism the NVRx-compatible API (``quicksave.compat.nvrx``) uses
to run its ``async_fn`` in the background; it lives in ``worker/``, below ``compat/``,
because the worker process itself runs it, and knows nothing of NVRx.

Order: the trainer's ``AsyncCallsQueue`` (``quicksave.compat.nvrx``) hands a call to its
persister: ``ThreadPersister.submit_call`` runs it with ``run_call`` in a thread;
``ProcessPersister.submit_call`` pickles it here (``pickle_call``, through
``quicksave.worker.fnpickle``) and the worker process runs ``run_pickled_call``. Either
way a ``CallResult`` comes back. CPU tensors among the arguments travel as handles to
shared memory, never as bytes in the message.

A call may keep something for a later call of the same persister (the NVRx API's
``preload_fn`` result waits for its ``async_fn``): a function marked with
:func:`uses_held` gets, as its first argument, the persister's ``held`` dict, which the
worker's main loop (or the thread persister) owns; nothing lives at module level.

Torch-free at import: the worker process imports it, and imports torch only when the
first call arrives.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

from quicksave.errors import CheckpointError
from quicksave.worker import fnpickle


@dataclass(frozen=True)
class CallResult:
    """Outcome of a generic call run by the persister (an ``AsyncRequest.async_fn`` of the
    NVRx-compatible API)."""

    job_id: int
    ok: bool
    error: str = ""
    detail: str = ""
    value: Any = None


def uses_held(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` as taking the persister's ``held`` dict as its first argument."""
    fn.uses_held = True  # type: ignore[attr-defined]
    return fn


def run_call(
    job_id: int, fn: Callable[..., Any], args: tuple, kwargs: dict, held: dict[str, Any]
) -> CallResult:
    """Run ``fn(*args, **kwargs)`` (``fn(held, *args, **kwargs)`` for a :func:`uses_held`
    function); its failure is reported in the result, never raised."""
    try:
        if getattr(fn, "uses_held", False):
            fn(held, *args, **kwargs)
        else:
            fn(*args, **kwargs)
        return CallResult(job_id, True)
    except BaseException as e:  # noqa: BLE001 - reported to the trainer
        return CallResult(job_id, False, f"{type(e).__name__}: {e}", traceback.format_exc())


def pickle_call(job_id: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> bytes:
    """Pickle a generic call for the worker with ``fnpickle`` (a ``ForkingPickler``).

    With torch's reductions registered (``torch.multiprocessing``), a CPU tensor pickles as
    a handle to shared memory: its storage is moved to shared memory once (``is_shared()``
    is then true in the trainer too) and the worker maps the same pages; no tensor bytes
    are copied into the message. Functions the worker cannot import (those of the
    training script's ``__main__``, closures, lambdas) go by value; classes must be
    importable. Failures surface here, when the call is scheduled, not in the worker.
    """
    if "torch" in sys.modules:
        import torch.multiprocessing  # noqa: F401 - registers the tensor reductions
    try:
        return fnpickle.dumps((fn, args, kwargs))
    except CheckpointError as e:
        raise CheckpointError(
            f"call {job_id}: its function or arguments cannot be sent to the worker process "
            f"({e.message}); the arguments must pickle and classes must be importable (the "
            "worker does not run the training script)"
        ) from e


def run_pickled_call(
    job_id: int, payload: bytes, sys_path: list[str], held: dict[str, Any]
) -> CallResult:
    """Worker side of ``pickle_call``: adopt the trainer's import path, unpickle, run
    (``held``: the worker's, for :func:`uses_held` calls)."""
    for p in sys_path:
        if p not in sys.path:
            sys.path.append(p)
    try:
        import torch.multiprocessing  # noqa: F401 - tensors arrive as shared-memory handles

        fn, args, kwargs = ForkingPickler.loads(payload)
    except BaseException as e:  # noqa: BLE001 - reported to the trainer
        return CallResult(
            job_id,
            False,
            f"the worker cannot unpickle the call ({type(e).__name__}: {e})",
            traceback.format_exc(),
        )
    return run_call(job_id, fn, args, kwargs, held)
