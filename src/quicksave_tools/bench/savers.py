"""The checkpoint methods the training-loop benchmark compares (one class each), as the
benchmark's child process uses them: ``save(step)`` returns once the loop may go on,
``finish()`` waits until every checkpoint is durable, ``restore(step)`` loads the
checkpoint of ``step`` back into the live state, ``restore_fresh(step, states)`` into
the states of a fresh job (its optimizer without state), as a resumed job does.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import quicksave.api as quicksave_api
from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState
from quicksave.saving.config import IncrementalConfig

QUICKSAVE_MODES = {  # method -> CheckpointConfig arguments
    "quicksave-sync": {"async_mode": "disabled"},
    "quicksave-thread": {"async_mode": "thread", "staging": "overlap"},
    "quicksave-process": {"async_mode": "process", "staging": "overlap"},
    "quicksave-process-blocking": {"async_mode": "process", "staging": "blocking"},
    # the default with its writes paced (write_rate_mbps per writer thread, 2 threads)
    "quicksave-process-paced": {
        "async_mode": "process",
        "staging": "overlap",
        "write_rate_mbps": 300,
    },
}
# Run when asked for (``--methods``): incremental saves (``lora``, ``embedding``; with
# ``-counters``, trusting unmoved version counters, checked in the background; with
# ``-hashed``, without the kernel's write tracking: every block hashed), and the
# default's save of the trainable state alone (the model's parameters that require a
# gradient, and the optimizer), what an incremental save of a partly frozen model is
# measured against.
INCREMENTAL = "quicksave-incremental"
TRAINABLE = "quicksave-trainable"
EXTRA_QUICKSAVE_MODES = {
    INCREMENTAL: {
        "async_mode": "process",
        "staging": "overlap",
        "incremental": IncrementalConfig(enabled=True),
    },
    TRAINABLE: {"async_mode": "process", "staging": "overlap"},
    INCREMENTAL + "-counters": {
        "async_mode": "process",
        "staging": "overlap",
        "incremental": IncrementalConfig(enabled=True, trust_counters=True),
    },
    INCREMENTAL + "-hashed": {
        "async_mode": "process",
        "staging": "overlap",
        "incremental": IncrementalConfig(enabled=True, watch_writes=False),
    },
}
DCP_ASYNC = {"dcp.async_save-thread": "THREAD", "dcp.async_save-process": "PROCESS"}
TORCH_CHECKPOINTING = "torch_checkpointing"  # its CheckpointManager, async (the default)


class Unavailable(Exception):
    """The method cannot run in this installation (reported, not a failure)."""


class Saver:
    """Checkpoint of the loop's state every ``interval`` steps; subclasses say how.

    ``save`` returns once the loop may go on; ``finish`` waits until every checkpoint
    is durable. ``durable`` maps a step to the seconds from its ``save`` call to its
    durable commit, where known.
    """

    suffix = ""
    # whether a restore gives back the whole state (the loop then times restores)
    restorable = True

    def __init__(self, folder: str, states: dict[str, Any]) -> None:
        self.folder, self.states = folder, states
        self.durable: dict[int, float] = {}
        self.started: dict[int, float] = {}

    def path(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}{self.suffix}")

    def state_dict(self) -> dict[str, Any]:
        return {name: s.state_dict() for name, s in self.states.items()}

    def save(self, step: int) -> float:
        """Save ``step``; return the seconds spent waiting for the previous save (0 where
        that wait cannot be told apart from the rest of the call)."""
        raise NotImplementedError

    def finish(self) -> None:
        pass

    def step_guard(self) -> contextlib.AbstractContextManager[Any]:
        """What ``optimizer.step()`` runs inside (a lock, for a method that needs one)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Free what is left once the restores are done (after ``finish``)."""

    def restore(self, step: int, states: dict[str, Any] | None = None) -> None:
        """Load the checkpoint of ``step`` into ``states`` (default: the loop's)."""
        quicksave_api.load(self.states if states is None else states, self.path(step))

    def restore_fresh(self, step: int, states: dict[str, Any]) -> dict[str, float]:
        """Load the checkpoint of ``step`` into a fresh job's ``states`` as its users
        resume; returns ``load_s`` (and ``setup_s``: building a loader, if any)."""
        t0 = time.perf_counter()
        self.restore(step, states)
        return {"load_s": time.perf_counter() - t0}

    def records(self) -> list[dict[str, Any]] | None:
        """The saving library's own per-save metrics (None: it keeps none)."""
        return None

    def staging_bytes(self) -> int:
        """Host memory the method holds for staging between saves (0: none, or unknown)."""
        return 0


class _TorchSaver(Saver):
    suffix = ".pt"

    def save(self, step: int) -> float:
        t0 = self.started[step] = time.perf_counter()
        with open(self.path(step), "wb") as f:
            torch.save(self.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        self.durable[step] = time.perf_counter() - t0
        return 0.0

    def restore(self, step: int, states: dict[str, Any] | None = None) -> None:
        sd = torch.load(self.path(step), weights_only=True, mmap=False)
        for name, state in (self.states if states is None else states).items():
            state.load_state_dict(sd[name])


class _DcpSaver(Saver):
    def save(self, step: int) -> float:
        t0 = self.started[step] = time.perf_counter()
        dcp.save(self.state_dict(), checkpoint_id=self.path(step))
        self.durable[step] = time.perf_counter() - t0
        return 0.0

    def restore(self, step: int, states: dict[str, Any] | None = None) -> None:
        dcp.load(self.states if states is None else states, checkpoint_id=self.path(step))


class _DcpAsyncSaver(_DcpSaver):
    """``dcp.async_save``; the previous save is waited for before the next one starts.

    The process executor gets one ``DefaultStager`` with shared memory, created once
    and reused (its storage cache makes later saves copy into the same buffers); the
    thread executor gets DCP's default (a fresh private stager per call).
    """

    def __init__(self, folder: str, states: dict[str, Any], kind: str) -> None:
        super().__init__(folder, states)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.kind = getattr(AsyncCheckpointerType, kind)
        self.stager = None
        if kind == "PROCESS":
            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=torch.cuda.is_available(),
                    use_shared_memory=True,
                    use_async_staging=False,
                    use_non_blocking_copy=False,
                )
            )
        self.pending: Any = None

    def _wait(self) -> None:
        if self.pending is not None:
            future = getattr(self.pending, "upload_completion", self.pending)
            self.pending = None
            future.result()

    def save(self, step: int) -> float:
        t0 = time.perf_counter()
        self._wait()  # backpressure: counted in this save's blocking time
        waited = time.perf_counter() - t0
        self.started[step] = t0
        pending = dcp.async_save(
            self.state_dict(),
            checkpoint_id=self.path(step),
            async_checkpointer_type=self.kind,
            async_stager=self.stager,
        )
        future = getattr(pending, "upload_completion", pending)
        future.add_done_callback(
            lambda _f, s=step: self.durable.__setitem__(s, time.perf_counter() - t0)
        )
        self.pending = pending
        return waited

    def finish(self) -> None:
        self._wait()
        if self.stager is not None:
            self.stager.close()


class _TorchCheckpointingSaver(Saver):
    """torch_checkpointing's ``CheckpointManager`` with its default asynchronous saver
    (staging in a background thread into shared memory, a writer subprocess), as its
    guide shows it: ``optimizer.step()`` inside ``manager.lock()``; the previous save is
    waited for before the next one starts. Its files are written without ``O_DIRECT``
    (its default opens them with ``O_DIRECT`` and then writes unaligned records, which
    fails with EINVAL on ext4); it does not fsync them."""

    def __init__(self, folder: str, states: dict[str, Any]) -> None:
        super().__init__(folder, states)
        self.manager = self._manager()
        self.pending: Any = None

    @staticmethod
    def _manager() -> Any:
        try:
            from torch_checkpointing import CheckpointManager as TcManager
            from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
        except ImportError as e:
            raise Unavailable(f"torch_checkpointing is not installed: {e}") from e
        storage = LocalFileSystemStorageConfig(use_direct_io=False)
        return TcManager(TcManager.Config(storage_config=storage))

    def step_guard(self) -> contextlib.AbstractContextManager[Any]:
        return self.manager.lock()

    def _wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def save(self, step: int) -> float:
        t0 = time.perf_counter()
        self._wait()
        waited = time.perf_counter() - t0
        self.started[step] = t0
        future = self.manager.save(self.path(step), self.state_dict())
        future.add_done_callback(
            lambda _f, s=step: self.durable.__setitem__(s, time.perf_counter() - t0)
        )
        self.pending = future
        return waited

    def finish(self) -> None:
        self._wait()

    def restore(self, step: int, states: dict[str, Any] | None = None) -> None:
        states = self.states if states is None else states
        into = {name: s.state_dict() for name, s in states.items()}
        loaded = self.manager.load(self.path(step), into=into)
        for name, state in states.items():
            state.load_state_dict(loaded[name])

    def restore_fresh(self, step: int, states: dict[str, Any]) -> dict[str, float]:
        t0 = time.perf_counter()
        saver, self.manager = self.manager, self._manager()
        setup = time.perf_counter() - t0
        try:
            times = super().restore_fresh(step, states)
        finally:
            self.manager.close()
            self.manager = saver
        return {**times, "setup_s": setup}

    def close(self) -> None:
        self.manager.close()


class _CommitWatcher:
    """Notes when ``<folder>/step-N`` appears: quicksave publishes a checkpoint with one
    rename, so its appearance is the commit (an independent check of the manager's
    own metrics). Polls every 5 ms."""

    def __init__(self, saver: Saver) -> None:
        self.saver = saver
        self.todo: dict[int, float] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="commit-watcher", daemon=True)
        self.thread.start()

    def add(self, step: int, t0: float) -> None:
        with self.lock:
            self.todo[step] = t0

    def _run(self) -> None:
        while not self.stop.wait(0.005):
            with self.lock:
                items = list(self.todo.items())
            for step, t0 in items:
                if os.path.isfile(os.path.join(self.saver.path(step), "manifest.json")):
                    self.committed(step, t0)

    def committed(self, step: int, t0: float) -> None:
        """``step`` is seen committed (``save()`` may have seen it first: it is done)."""
        with self.lock:
            if self.todo.pop(step, None) is not None:
                self.saver.durable[step] = time.perf_counter() - t0

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


class _QuicksaveSaver(Saver):
    def __init__(self, folder: str, states: dict[str, Any], interval: int, mode: dict) -> None:
        super().__init__(folder, states)
        try:
            config = CheckpointConfig(folder=folder, interval=interval, **mode)
            self.manager = CheckpointManager(config, states)
        except Exception as e:  # an async mode the engine does not have yet
            raise Unavailable(f"{type(e).__name__}: {e}") from e
        self.watcher = _CommitWatcher(self)

    def save(self, step: int) -> float:
        t0 = self.started[step] = time.perf_counter()
        self.watcher.add(step, t0)
        self.manager.save(step)
        if os.path.isfile(os.path.join(self.path(step), "manifest.json")):
            # committed before save() returned (synchronous mode): exact, no poll delay
            self.watcher.committed(step, t0)
        return 0.0  # the manager's own backpressure wait is inside save()

    def finish(self) -> None:
        self.manager.close()
        deadline = time.monotonic() + 5  # the last rename is seen within one poll
        while self.watcher.todo and time.monotonic() < deadline:
            time.sleep(0.005)
        self.watcher.close()

    def restore_fresh(self, step: int, states: dict[str, Any]) -> dict[str, float]:
        """A resumed job: a new manager of the same configuration, then ``load()``."""
        t0 = time.perf_counter()
        manager = CheckpointManager(self.manager.config, states)
        setup = time.perf_counter() - t0
        try:
            t0 = time.perf_counter()
            loaded = manager.load(step)
            load_s = time.perf_counter() - t0
        finally:
            manager.close()
        if loaded != step:
            raise RuntimeError(f"the fresh manager loaded step {loaded}, not {step}")
        return {"load_s": load_s, "setup_s": setup}

    def staging_bytes(self) -> int:
        return self.manager.staging_bytes

    def records(self) -> list[dict[str, Any]]:
        """The manager's own per-save metrics (whichever fields it has)."""
        keys = (
            "step",
            "kind",
            "bytes",
            "blocking_s",
            "staging_s",
            "commit_s",
            "durable_s",
            "trainer_cpu_s",
            "worker_cpu_s",
            "bytes_copied",
            "bytes_hashed",
            "bytes_referred",
        )
        return [
            {k: getattr(r, k) for k in keys if getattr(r, k, None) is not None}
            for r in getattr(self.manager, "metrics", [])
        ]


class _Trainable:
    """A model's trainable state (the parameters that require a gradient), as a
    ``Stateful``: what a fine-tune of a frozen base must keep besides the base."""

    def __init__(self, model: ModelState) -> None:
        self.model = model

    def _params(self) -> dict[str, torch.Tensor]:
        return {
            name: p
            for part in self.model.parts
            for name, p in part.named_parameters()
            if p.requires_grad
        }

    def state_dict(self) -> dict[str, Any]:
        return {name: p.detach() for name, p in self._params().items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, p in self._params().items():
                p.copy_(state_dict[name])


def make_saver(
    method: str,
    folder: str,
    states: dict[str, Any],
    interval: int,
    block_bytes: int | None = None,
) -> Saver:
    """The saver of one benchmark method (``none`` saves nothing); ``block_bytes``: the
    incremental methods' ``IncrementalConfig.block_bytes`` (None: its default)."""
    if method == "none":
        return Saver(folder, states)
    if method == "torch.save":
        return _TorchSaver(folder, states)
    if method == "dcp.save":
        return _DcpSaver(folder, states)
    if method in DCP_ASYNC:
        return _DcpAsyncSaver(folder, states, DCP_ASYNC[method])
    if method in QUICKSAVE_MODES:
        return _QuicksaveSaver(folder, states, interval, QUICKSAVE_MODES[method])
    if method in EXTRA_QUICKSAVE_MODES:
        if method == TRAINABLE:
            states = {**states, "model": _Trainable(states["model"])}
        mode = EXTRA_QUICKSAVE_MODES[method]
        if block_bytes is not None and "incremental" in mode:
            mode = {**mode, "incremental": replace(mode["incremental"], block_bytes=block_bytes)}
        saver = _QuicksaveSaver(folder, states, interval, mode)
        saver.restorable = method != TRAINABLE  # (the frozen base is not in it)
        return saver
    if method == TORCH_CHECKPOINTING:
        return _TorchCheckpointingSaver(folder, states)
    raise ValueError(f"unknown method {method!r}")
