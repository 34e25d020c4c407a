"""Count the ``torch.distributed`` collectives a rank makes, for "every collective is
visible" tests.

:class:`CollectiveLog` replaces each collective function of ``torch.distributed`` (and
of ``torch.distributed.distributed_c10d``, where the same function lives) with a wrapper
that records the call, then calls the original. Only the outermost call is recorded: a
collective implemented with another one (``all_gather_object`` runs ``all_gather``)
counts once. Each record carries the collective's name, its ``async_op`` flag, its
``group`` argument and the log's current ``step`` label, which the test sets.

Install it inside a rank (``tests/multirank/launcher.py`` forks the ranks with the test's
``sys.path``, so ``from helpers.collectives import CollectiveLog`` works there as in the
test module). Code that imported a collective by name (``from torch.distributed import
all_reduce``) before :meth:`CollectiveLog.install` keeps the original and is not seen.

Example::

    log = CollectiveLog(thread=threading.main_thread())  # the training thread only
    with log:  # install() ... uninstall()
        for step in range(1, 9):
            log.step = step
            manager.save(step)
    assert log.at(3) == [] and log.at(4) == [("all_reduce", True)]
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

# Every collective of torch.distributed (point-to-point send/recv are not collectives).
COLLECTIVES: tuple[str, ...] = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
)


@dataclass(frozen=True)
class Call:
    """One recorded collective call.

    Attributes:
        step: the log's ``step`` label when the call was made.
        name: the collective's name in ``torch.distributed`` (e.g. ``"all_reduce"``).
        async_op: whether it was called with ``async_op=True``.
        group: its ``group`` argument (``None``: the default group).
        thread: the name of the thread that made the call.
    """

    step: Any
    name: str
    async_op: bool
    group: Any
    thread: str


class CollectiveLog:
    """Records the outermost ``torch.distributed`` collective calls, by step label.

    Set :attr:`step` before the code under test runs; every call made after that is
    recorded with it. Use :meth:`install` / :meth:`uninstall` or the log as a context
    manager.

    Args:
        thread: count only the calls made from this thread (e.g.
            ``threading.main_thread()``, the training thread); ``None`` counts the calls
            of every thread (a background saver's included).
        names: the collective functions to wrap; all of :data:`COLLECTIVES` by default.
            A name that this torch does not have is skipped.

    Example::

        log = CollectiveLog()
        log.install()
        log.step = 1
        dist.all_reduce(torch.ones(1))
        assert log.at(1) == [("all_reduce", False)] and log.names() == ["all_reduce"]
    """

    def __init__(
        self, thread: threading.Thread | None = None, names: Iterable[str] = COLLECTIVES
    ) -> None:
        self.step: Any = 0
        self.calls: list[Call] = []
        self._thread = thread
        self._names = tuple(names)
        self._depth = threading.local()  # nesting depth of wrapped calls, per thread
        # (module, name, original) for every attribute replaced by install()
        self._replaced: list[tuple[Any, str, Callable[..., Any]]] = []

    # ------------------------------------------------------------------ installing
    def install(self) -> CollectiveLog:
        """Wrap the collectives in ``torch.distributed``; returns the log.

        Raises:
            RuntimeError: if this log is already installed.
        """
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        if self._replaced:
            raise RuntimeError("CollectiveLog is already installed")
        for name in self._names:
            original = getattr(distributed_c10d, name, None) or getattr(dist, name, None)
            if original is None:
                continue
            wrapped = self._wrap(name, original)
            for module in (dist, distributed_c10d):
                # Only where it is the same function: an earlier wrapper stays in place.
                if getattr(module, name, None) is original:
                    setattr(module, name, wrapped)
                    self._replaced.append((module, name, original))
        return self

    def uninstall(self) -> None:
        """Put the original functions back (the records stay)."""
        for module, name, original in reversed(self._replaced):
            setattr(module, name, original)
        self._replaced.clear()

    def __enter__(self) -> CollectiveLog:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        try:
            signature: inspect.Signature | None = inspect.signature(original)
        except (TypeError, ValueError):
            signature = None

        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "value", 0)
            if depth == 0:
                self._record(name, signature, args, kwargs)
            self._depth.value = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth.value = depth

        counted.__name__ = counted.__qualname__ = name
        counted.__wrapped__ = original  # type: ignore[attr-defined]
        return counted

    def _record(
        self,
        name: str,
        signature: inspect.Signature | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        current = threading.current_thread()
        if self._thread is not None and current is not self._thread:
            return
        arguments = kwargs
        if signature is not None:
            try:  # group / async_op may be passed by position
                arguments = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:
                pass  # the original raises the real error
        self.calls.append(
            Call(
                step=self.step,
                name=name,
                async_op=bool(arguments.get("async_op", False)),
                group=arguments.get("group"),
                thread=current.name,
            )
        )

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return len(self.calls)

    def at(self, step: Any) -> list[tuple[str, bool]]:
        """``(name, async_op)`` of each call recorded with step label ``step``, in order."""
        return [(c.name, c.async_op) for c in self.calls if c.step == step]

    def names(self, start: int = 0) -> list[str]:
        """The names of the calls from index ``start`` on (``start=len(log)`` taken
        before some code gives the collectives that code made)."""
        return [c.name for c in self.calls[start:]]
