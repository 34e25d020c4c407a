"""A resume that lets training start before the last byte: the model's states load
first, and the optimizers' states (AdamW's two moments: about 2/3 of the bytes) stream
in behind, in a background thread, while the first forward and backward run.

Opt-in (``CheckpointConfig(stream_load=True)``): code that reads ``optimizer.state``
directly right after ``load()`` would see values still arriving. Each optimizer's step
waits (a step pre-hook) for what it has not yet received, so no optimizer step ever runs
on partial state; so do its ``state_dict()`` and
``load_state_dict()``, and every manager call that reads or writes the states
(``save``, ``wait``, ``load``, ``export``, ``close``). A failure of the background load
is raised there, on the training thread, once. Used only where the load needs no
collective (one rank, or a rank's own memory snapshot): a background thread must not
run collectives beside the training thread's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from torch.utils.hooks import RemovableHandle

from quicksave.commit import CheckpointKind
from quicksave.errors import CheckpointError, IncompatibleStateError
from quicksave.layout.dcp_metadata import manifest_to_metadata
from quicksave.loading.checkpoint import Checkpoint
from quicksave.loading.reader import CheckpointReader
from quicksave.manager.states import OptimizerState

Load = Callable[[Mapping[str, Any], tuple[str, ...]], None]  # (states, names left to another load)


class OptimizerStream:
    """The optimizers' states loading in a background thread (see the module docstring).

    Call order (training thread): :func:`load_streamed` starts it → an optimizer's step,
    or :meth:`wait`, joins it (``on_done()`` then runs on that thread) → its error, if
    any, is raised there once.
    """

    def __init__(
        self,
        load: Callable[[], None],
        optimizers: list[Any],
        on_done: Callable[[], None],
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._on_done = on_done
        self._on_error = on_error
        self._error: BaseException | None = None
        self._joined = False
        self.restored_at: float | None = None  # time.perf_counter() when it finished
        self._thread = threading.Thread(
            target=self._run, args=(load,), name="quicksave-optimizer-load", daemon=True
        )
        self._hooks: list[RemovableHandle] = []
        for o in optimizers:  # its step, and reading or replacing its state, wait
            self._hooks.append(o.register_step_pre_hook(lambda *_: self._join()))
            self._hooks.append(o.register_state_dict_pre_hook(lambda *_: self._join()))
            self._hooks.append(o.register_load_state_dict_pre_hook(lambda *_: self._join()))
        self._thread.start()

    def _run(self, load: Callable[[], None]) -> None:
        try:
            load()
        except BaseException as e:  # noqa: BLE001 - raised on the training thread
            self._error = e
        self.restored_at = time.perf_counter()

    @property
    def done(self) -> bool:
        return self._joined

    def wait(self) -> None:
        """Block until the optimizers' states are loaded; raise the load's error (once).
        Takes the optimizers' hooks away (a hook joins without: torch is iterating its
        hooks while one runs, and one taken away then breaks that iteration; until a
        ``wait()``, a joined stream's hooks do nothing).

        Raises:
            CheckpointError: the background load failed (the optimizers' states are not
                the checkpoint's: resume again).
        """
        try:
            self._join()
        finally:
            if threading.current_thread() is not self._thread:
                for hook in self._hooks:
                    hook.remove()
                self._hooks = []

    def _join(self) -> None:
        if self._joined or threading.current_thread() is self._thread:
            return  # (the load itself reads and sets the optimizers' states)
        self._thread.join()
        self._joined = True
        error, self._error = self._error, None
        if error is None:
            self._on_done()
            return
        if self._on_error is not None:  # e.g. move the torn checkpoint aside
            self._on_error(error)
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(f"loading the optimizer states failed: {error!r}") from error


def load_streamed(
    states: Mapping[str, Any],
    load: Load,
    checkpoint: Checkpoint,
    *,
    stream: bool,
    on_done: Callable[[], None],
    on_error: Callable[[BaseException], None] | None = None,
    on_stream_end: Callable[[], None] | None = None,
) -> OptimizerStream | None:
    """Load ``states`` from ``checkpoint`` with ``load``: all at once (``stream``
    False, or nothing to stream; ``on_done()`` runs before it returns and None is
    returned), or the non-optimizer states now and the ``OptimizerState`` ones in the
    background (the returned stream; ``on_done()`` runs when it is joined, or
    ``on_error(error)`` before its error is raised, on the training thread).

    Before the first load, an optimizer without state gets its state tensors allocated
    here, from the checkpoint's manifest: nothing that looks at ``optimizer.state``
    meanwhile finds it empty (DCP's state-dict functions would then run an optimizer
    step to create it). Their memory is faulted in on a thread of its own
    (``optim_restore.Prefault``) while the first load reads the model's states, so that
    the stream, running beside the first forward and backward, only copies bytes. Where the
    state cannot be allocated from a manifest (a stock DCP checkpoint), the optimizers'
    states load now too. ``on_stream_end()``: runs on the stream's thread once its load
    ended, either way (the last read of the checkpoint is done: a peer serving it may
    stop)."""
    later = {k: v for k, v in states.items() if isinstance(v, OptimizerState)}
    if not stream or not later or len(later) == len(states):
        load(states, ())
        on_done()
        return None
    first = {k: v for k, v in states.items() if k not in later}
    manifest = _manifest(checkpoint)
    if manifest is None:
        load(states, ())
        on_done()
        return None
    stored = manifest_to_metadata(manifest, checkpoint.url).state_dict_metadata
    undos: list[Callable[[], None]] = []

    def undo_all() -> None:
        for undo in undos:  # uninitialised state: never trained with
            undo()
        undos.clear()

    try:
        for n, s in later.items():  # (their memory faulted in while the model's load reads)
            if (undo := s.prepare_load(stored, f"{n}.")) is not None:
                undos.append(undo)
        load(first, tuple(later))
    except IncompatibleStateError:
        undo_all()
        load(states, ())  # the states do not fit: the whole load's error names all of it
        raise
    except BaseException:
        undo_all()
        raise

    def failed(error: BaseException) -> None:
        undo_all()
        if on_error is not None:
            on_error(error)

    def rest() -> None:
        try:
            load(later, tuple(first))
        finally:
            if on_stream_end is not None:
                on_stream_end()

    optimizers = [o for state in later.values() for o in state.optimizers]
    return OptimizerStream(rest, optimizers, on_done, failed)


def _manifest(checkpoint: Checkpoint) -> Any:
    """The manifest of a quicksave checkpoint (read once: the loads that follow reuse
    it), or None for a stock DCP one."""
    if checkpoint.kind is not CheckpointKind.QUICKSAVE:
        return None
    return CheckpointReader(checkpoint).read_manifest()
