"""``AsyncRequest``: one background call, its preload and its finalize functions.

Also the worker side of preloading (``preload_in_worker`` / ``run_preloaded``): how
``AsyncCallsQueue`` runs ``preload_fn`` in the worker process before ``async_fn``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from quicksave.errors import CheckpointError, FrozenRequestError
from quicksave.ranks import collectives as talk
from quicksave.worker.calls import uses_held


class AsyncRequest(NamedTuple):
    """One asynchronous call and what to do once it is done on every rank (a
    ``NamedTuple``, as NVRx's: ``_replace``, ``_asdict`` and unpacking work).

    Attributes:
        async_fn: run in the background (worker process or thread); ``None`` is a no-op
            whose finalize functions still run at the next finalization. In the worker
            process it may be a function of the training script (``__main__``), a closure
            or a lambda: those travel by value (``quicksave.worker.fnpickle``).
        async_fn_args: positional arguments of ``async_fn``.
        finalize_fns: run in the trainer, in order, once ``async_fn`` is done (on every
            rank, with ``no_dist=False``).
        async_fn_kwargs: keyword arguments of ``async_fn`` (None: none).
        preload_fn: called with no arguments (bind its state dict with
            ``functools.partial``) where ``async_fn`` runs, before it; it returns the state
            dict to write (e.g. device tensors copied to host), which replaces
            ``async_fn_args[1]``. ``schedule_async_request`` returns only once it is done,
            so the trainer may then mutate the tensors it read.
        is_frozen: set by ``freeze()``; a frozen request takes no more finalize functions.
        call_idx: the id ``schedule_async_request`` gave it (set by the queue).
    """

    async_fn: Callable[..., Any] | None
    async_fn_args: tuple
    finalize_fns: list[Callable[[], Any]]
    async_fn_kwargs: dict[str, Any] | None = None
    preload_fn: Callable[[], Any] | None = None
    is_frozen: bool = False
    call_idx: int = 0

    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        """Append ``fn`` to the finalize functions (run after those already there).

        Raises:
            FrozenRequestError: (a ``RuntimeError`` too) the request is frozen.
        """
        if self.is_frozen:
            raise FrozenRequestError("cannot add a finalize function to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def freeze(self) -> AsyncRequest:
        """A frozen copy (its own list of finalize functions); this request is unchanged."""
        return self._replace(finalize_fns=list(self.finalize_fns), is_frozen=True)

    def execute_sync(self) -> None:
        """Run the request in this thread: preload, ``async_fn``, a barrier when
        ``torch.distributed`` is initialized, then the finalize functions."""
        if self.async_fn is not None:
            self.async_fn(*preloaded_args(self), **(self.async_fn_kwargs or {}))
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            talk.barrier()
        self.execute_finalize_fns(validate_matching_call_idx=False)

    def execute_finalize_fns(self, validate_matching_call_idx: bool = True) -> int:
        """Run the finalize functions in order; then, with ``validate_matching_call_idx``
        and ``torch.distributed`` initialized, check with one all-reduce MAX that every
        rank finalized the same call.

        Returns:
            ``call_idx``.

        Raises:
            CheckpointError: ranks finalized different calls.
        """
        for fn in self.finalize_fns:
            fn()
        dist = torch.distributed
        if validate_matching_call_idx and dist.is_available() and dist.is_initialized():
            (highest,) = talk.all_reduce_ints([self.call_idx], "max")
            if highest != self.call_idx:
                raise CheckpointError(
                    f"ranks finalized different async calls ({self.call_idx} here, "
                    f"{highest} elsewhere): not every rank takes part in finalization",
                    rank=dist.get_rank(),
                )
        return self.call_idx


def preloaded_args(req: AsyncRequest) -> tuple:
    if req.preload_fn is None:
        return tuple(req.async_fn_args)
    args = list(req.async_fn_args)
    args[1] = req.preload_fn()
    return tuple(args)


# Worker side of preloading: a preloaded state dict waits in the worker's ``held`` dict
# (``quicksave.worker.calls.uses_held``) between the preload call and the async_fn call
# that consumes it; calls run one at a time, in order.


@uses_held
def preload_in_worker(held: dict[str, Any], key: str, preload_fn: Callable[[], Any]) -> None:
    held[key] = preload_fn()


@uses_held
def run_preloaded(
    held: dict[str, Any], key: str, async_fn: Callable[..., Any], args: tuple, kwargs: dict
) -> None:
    if key not in held:
        raise CheckpointError("preload_fn failed, so async_fn did not run")
    args = list(args)
    args[1] = held.pop(key)
    async_fn(*args, **kwargs)


@uses_held
def drop_preloaded(held: dict[str, Any], key: str) -> None:
    held.pop(key, None)


def check_request(req: AsyncRequest, path: str | None, rank: int | None) -> None:
    if req.async_fn is not None and not callable(req.async_fn):
        raise CheckpointError(
            "AsyncRequest.async_fn must be callable or None", path=path, rank=rank
        )
    if req.preload_fn is not None:
        if not callable(req.preload_fn):
            raise CheckpointError("AsyncRequest.preload_fn must be callable", path=path, rank=rank)
        if len(req.async_fn_args) < 2:
            raise CheckpointError(
                "AsyncRequest.preload_fn's result replaces async_fn_args[1], but async_fn_args "
                f"has {len(req.async_fn_args)} item(s)",
                path=path,
                rank=rank,
            )
