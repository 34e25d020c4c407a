"""The saves of Lightning checkpoints in flight in this process, kept in one object.

quicksave keeps no module-level mutable state (STYLE.md point 8): a saver and its saves
belong to the object the user holds. Lightning, though, builds a new ``CheckpointIO``
for each ``Trainer`` and hands a path from one to the next: ``trainer.save_checkpoint(p)``
with one Trainer, then ``fit(ckpt_path=p)`` or ``load_from_checkpoint(p)`` with another.
A load of ``p`` must wait for a save of ``p`` still in flight, whichever
:class:`~quicksave.integrations.lightning.QuicksaveCheckpointIO` started it, so the
saves in flight are the process's: they live here, in :data:`PROCESS`, and nowhere
else (as NVRx's process-wide state lives in ``compat/nvrx/process_state.PROCESS``).

Each save is registered by the plugin that started it (its *owner*) and stays its
owner's to report: a failure is raised by the owner (at its next save, a re-save of
the path, ``teardown()``); another plugin that waits for it learns that the checkpoint
was never committed.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

from quicksave.errors import CheckpointError
from quicksave.saving.handle import SaveHandle


class SavesInFlight:
    """Saves to Lightning checkpoint paths under way in this process, by path (the
    location's URL): asynchronous ones by their handle and owner, synchronous ones
    running in some thread (Lightning's ``AsyncCheckpointIO`` saves from its own) by
    count. A finished save that succeeded is dropped at the next registration; a failed
    one stays until its owner reports it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running: Counter[str] = Counter()
        self._handles: dict[str, tuple[Any, SaveHandle]] = {}  # path -> (owner, handle)

    @contextlib.contextmanager
    def running(self, target: str) -> Iterator[None]:
        """A synchronous save to ``target`` runs for the ``with`` block."""
        with self._cond:
            self._running[target] += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= Counter({target: 1})  # drops the path at zero
                self._cond.notify_all()

    def add(self, owner: Any, target: str, handle: SaveHandle) -> None:
        """``owner`` started the asynchronous save ``handle`` to ``target`` (after
        :meth:`settle` of ``target``: one save per path at a time)."""
        with self._cond:
            for path, (_, h) in list(self._handles.items()):
                if h.exception() is None and h.done():  # committed: nothing to report
                    del self._handles[path]
            self._handles[target] = (owner, handle)

    def settle(self, owner: Any, target: str) -> None:
        """Wait until no save to ``target`` is under way in this process.

        Raises:
            CheckpointError: ``owner``'s own save to ``target`` failed (then it is
                forgotten: reported here); or another plugin's save to ``target``
                failed (it stays that plugin's to report as well).
        """
        with self._cond:
            self._cond.wait_for(lambda: target not in self._running)
            entry = self._handles.get(target)
            mine = entry is not None and entry[0] is owner
            if mine:
                del self._handles[target]
        if entry is None:
            return
        handle = entry[1]
        if mine:
            handle.wait()
            return
        try:
            handle.wait()
        except CheckpointError as e:
            raise CheckpointError(
                "the checkpoint was never committed: its save (by another "
                f"QuicksaveCheckpointIO of this process) failed: {e}",
                path=target,
                rank=e.rank,
            ) from e

    def wait_all(self) -> bool:
        """Wait until no save is under way in this process, whatever its path (a
        failure stays its owner's to report); True if there was one to wait for."""
        with self._cond:
            self._cond.wait_for(lambda: not self._running)
            pending = [h for _, h in self._handles.values() if not h.done()]
        for handle in pending:
            with contextlib.suppress(CheckpointError):
                handle.wait()
        return bool(pending)

    def owned(self, owner: Any) -> list[tuple[str, SaveHandle]]:
        """``owner``'s saves still registered, by path."""
        with self._cond:
            return [(t, h) for t, (o, h) in self._handles.items() if o is owner]

    def forget(self, owner: Any, target: str) -> None:
        """Drop ``owner``'s save to ``target`` (it finished and was reported)."""
        with self._cond:
            entry = self._handles.get(target)
            if entry is not None and entry[0] is owner:
                del self._handles[target]


class LightningProcessState:
    """What the Lightning integration shares across a process (see the module docstring).

    Attributes:
        saves: the saves of Lightning checkpoints in flight.
    """

    def __init__(self) -> None:
        self.saves = SavesInFlight()


PROCESS = LightningProcessState()
"""This process's Lightning state (the only instance)."""
