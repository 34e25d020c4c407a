"""``CheckpointConfig``: everything the manager needs to decide when, where and what to save.

One frozen dataclass, validated when it is built, so a bad value fails before the
training loop starts (never at step 10,000).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from quicksave.commit import strategy_class
from quicksave.errors import CheckpointError
from quicksave.manager.records import MetricsHook
from quicksave.saving.config import EngineConfig, IncrementalConfig
from quicksave.saving.incremental import check_destination
from quicksave.storage import StorageOptions, parse_location
from quicksave.worker.config import WorkerConfig

INTERVAL_TYPES = ("steps", "seconds")
ASYNC_MODES = ("disabled", "thread", "process")
STAGING_MODES = ("overlap", "blocking")
BACKPRESSURE = ("wait", "skip")
ON_SAVE_ERROR = ("raise", "log")
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class MemoryTierConfig:
    """The node-memory tier: each rank's newest snapshots kept in the node's memory
    (a job-scoped tmpfs folder held by a per-node agent that outlives a crashed
    trainer, :mod:`quicksave.tiers.node_memory`), read back before the folder when
    they are newer.

    Attributes:
        every: a snapshot every ``every`` steps (steps the folder saves are not
            snapshotted again: the folder holds them).
        keep: snapshots kept per rank (the node holds ``keep`` × the rank's state
            bytes per rank, plus one being written).
        root: the tmpfs mount the job's folder is made under.
        job_id: names the job's memory (a restarted trainer of the same job finds it;
            another job cannot); None: from the launcher's environment
            (``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID``, ...), else from the folder.
        idle_timeout_s: with no live trainer attached this long, the agent frees the
            job's memory and exits (a restarted trainer must attach within it).
        replicas: copies of each rank's snapshot kept in the memory of ranks on other
            nodes (:mod:`quicksave.tiers.peer_replicas`): rank ``r``'s ``k``-th goes to
            rank ``(r + k * ranks_per_node) % world_size``; each node then holds
            ``keep`` × (1 + ``replicas``) snapshots per rank (and, while the copies lag,
            up to ``keep`` more that retention removed but are still being sent). Must be
            below the number of nodes; 0: none. The copies go in a background thread over
            a gloo group of their own; a peer that does not answer within
            ``commit_timeout_s`` stops the replication (logged), never the training.
        ranks_per_node: the ranks of one node (consecutive ranks share a node); None:
            the launcher's ``LOCAL_WORLD_SIZE``, else every rank on one node (so no
            replica can be placed).
    """

    every: int = 1
    keep: int = 2
    root: str = "/dev/shm"
    job_id: str | None = None
    idle_timeout_s: float = 300.0
    replicas: int = 0
    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        _check_int("memory.every", self.every, minimum=1)
        _check_int("memory.keep", self.keep, minimum=1)
        _check_int("memory.replicas", self.replicas, minimum=0)
        if self.ranks_per_node is not None:
            _check_int("memory.ranks_per_node", self.ranks_per_node, minimum=1)
        if not isinstance(self.root, str) or not os.path.isdir(self.root):
            raise CheckpointError(f"memory.root must be an existing folder, got {self.root!r}")
        if not (isinstance(self.idle_timeout_s, (int, float)) and self.idle_timeout_s > 0):
            raise CheckpointError(
                f"memory.idle_timeout_s must be a positive number, got {self.idle_timeout_s!r}"
            )


@dataclass(frozen=True)
class UploadTierConfig:
    """The object-store tier: checkpoints of the (local) folder copied to an object
    store in the background (:mod:`quicksave.tiers.upload`): every rank copies the files
    it wrote, from the committed local checkpoint (never from the trainer's tensors),
    and the checkpoint commits there by the store's rule (the manifest written last).

    Attributes:
        url: the store's folder (``s3://bucket/prefix``, ``msc://profile/path``):
            step ``N`` goes to ``<url>/step-<N>``.
        every: upload every ``every`` steps: a multiple of the folder's ``interval``
            (``interval_type="steps"``), so that each such step has a local checkpoint.
        keep: the newest ``keep`` uploads are kept on the store; 0 keeps all.
        storage: how to reach the store; None: ``CheckpointConfig.storage``.

    At most one upload runs per rank, and one more step waits; a newer due step replaces
    the waiting one (the store lags the folder by at most one upload and the step being
    copied is kept in the folder until it is done).
    """

    url: str
    every: int
    keep: int = 0
    storage: StorageOptions | None = None

    def __post_init__(self) -> None:
        _check_int("upload.every", self.every, minimum=1)
        _check_int("upload.keep", self.keep, minimum=0)
        if self.storage is not None and not isinstance(self.storage, StorageOptions):
            raise CheckpointError(
                f"upload.storage must be a StorageOptions or None, "
                f"got {type(self.storage).__name__}"
            )
        if not isinstance(self.url, str) or not self.url:
            raise CheckpointError(f"upload.url must be a non-empty URL, got {self.url!r}")

    def check(
        self, folder: str, interval: float, interval_type: str, storage: StorageOptions
    ) -> None:
        """Raise unless the tier can be fed by the folder ``folder`` saved every
        ``interval`` ``interval_type``."""
        target = parse_location(self.url, what="upload URL", options=self.storage or storage)
        source = parse_location(folder, what="checkpoint folder", options=storage)
        # read as files, committed on the store by the manifest written last: asked of
        # the locations' commit strategies (a rename means a filesystem)
        if strategy_class(source).writes_in_place or not strategy_class(target).writes_in_place:
            raise CheckpointError(
                f"the upload tier copies a local folder to an object store: folder "
                f"{source.url!r} must be a local path and upload.url {target.url!r} a store's "
                "URL (s3://, msc://)"
            )
        if interval_type != "steps" or self.every % interval:
            raise CheckpointError(
                f"upload.every ({self.every}) must be a multiple of the folder's interval "
                f"({interval:g} {interval_type}; interval_type must be 'steps'): only steps "
                "the folder saves can be uploaded"
            )


@dataclass(frozen=True)
class CheckpointConfig:
    """How a :class:`~quicksave.manager.CheckpointManager` checkpoints.

    Attributes:
        folder: the directory holding ``step-<N>`` checkpoints (created if missing): a
            path, or a ``file://``, ``s3://bucket/prefix`` or ``msc://profile/path`` URL.
        interval: save every ``interval`` steps (a whole number) or seconds.
        interval_type: ``"steps"`` or ``"seconds"``.
        interval_check_steps: several ranks with ``interval_type="seconds"``: the ranks
            vote on "a save is due" every this many steps (one asynchronous all-reduce,
            consumed at the next such step, so no step waits for it); a save comes at
            most twice this many steps after the interval ran out. Unused otherwise.
        keep_latest_k: keep only the newest ``k`` committed checkpoints; 0 keeps all.
        export_dtype: torch floating dtype name (``"float32"``, ``"bfloat16"``, ...) of
            the model-only export written at ``last_step``.
        last_step: the final training step. ``save(last_step)`` always saves (as if
            forced) and also writes ``<folder>/export-step-<N>``: the model weights only,
            floating tensors cast to ``export_dtype``.
        thread_count: writer threads (and data files) per rank.
        async_mode: ``"process"`` (default: a persistent worker process per rank writes
            in the background), ``"thread"`` (a background thread of the training
            process writes) or ``"disabled"`` (``save()`` returns once committed).
        staging: how the async modes copy tensors out of the training state.
            ``"overlap"`` (default): ``save()`` copies buffers, scalars and other small
            state at once and copies parameters and optimizer states in the background
            while the next forward/backward runs; the manager's optimizer step
            pre-hooks wait for that copy. ``"blocking"``: ``save()`` copies everything
            before it returns.
        backpressure: when the previous save still holds the staging memory, ``"wait"``
            for it (default) or ``"skip"`` this save (logged).
        max_in_flight: saves that may be in flight at once (one staging pool each).
        worker_timeout_s: a worker process whose heartbeat is older than this and that
            is not progressing is hung — stopped (SIGSTOP, a debugger), or asleep with
            no CPU time, no I/O and no thread runnable for half this long (read from
            /proc): the save fails with a ``CheckpointError`` and the next save starts a
            new worker. A worker starved of CPU on a busy node is slow, not hung. The
            heartbeat comes from a thread of its own, so a slow write is not a hang:
            that is ``save_timeout_s``.
        save_timeout_s: a save still being written after this long has failed.
        close_timeout_s: how long ``close()`` (and ``load()``, and a seed or export
            checkpoint) wait for saves in flight.
        commit_timeout_s: several ranks: how long the coordinator's writer waits for
            every rank's files before the save fails on every rank (a rank that never
            arrives); the others wait for the commit a little longer.
        enabled: if False the manager saves and loads nothing.
        read_only: a manager that only loads (an eval script, a notebook): it never
            takes the folder's writer lease, never creates, cleans or deletes anything,
            starts no worker, and ``save()`` raises. A writing manager built while
            another live process holds the lease becomes read-only by itself (logged).
        allow_dcp: also list and load stock ``torch.distributed.checkpoint`` folders
            (``step-<N>/`` with a ``.metadata`` and no manifest, e.g. torchtitan's).
            Their metadata is a pickle: it is read with a restricted unpickler that
            admits only DCP's metadata classes. Off by default: a folder planted with
            a pickle is never counted as a checkpoint, let alone unpickled.
        allow_dcp_pickle: with ``allow_dcp``, unpickle a DCP ``.metadata`` without
            restriction (runs any code it holds: only for folders you trust).
        storage: how to reach an object store (S3 endpoint and credentials override the
            standard AWS chain; ``msc_config``; ``stale_after_s``: how old a crashed
            save's leftovers must be before start-up clean-up removes them).
        worker_cpus: CPUs the worker process (``async_mode="process"``) runs on, e.g.
            the cores the training loop does not use, so that hashing and uploads never
            take its CPU time; ``None`` (default): wherever the trainer may run.
        write_rate_mbps: the async modes write local files at most this many MB/s
            per writer thread (``thread_count`` of them): a save's disk traffic is spread
            over more time, which helps where the disk's work slows the training steps
            (a VM's virtual disk shares the host with its CPUs); the time to durable grows
            to at least the bytes / (rate × threads). ``None`` (default): no limit. See
            docs/benchmarks.md for what it changes in the training benchmark.
        on_save_error: what a failed save (its write, upload or commit; a storage
            outage longer than ``storage.s3.retry_deadline_s``) does. ``"raise"``
            (default): its ``CheckpointError`` is raised, on every rank at the same call
            (the save's own ``save()`` call, or for a failure in the background the next
            ``save()`` that is due, ``wait()``, ``load()`` or ``close()``). ``"log"``: it
            is logged and counted (``failed_saves``), training goes on and the next
            saves are made as usual (a failed save leaves nothing visible: its uploads
            are aborted, its objects removed); after ``max_consecutive_failures``
            failed saves with no commit between them, it raises on every rank. An
            ``IncompatibleStateError`` (a state that cannot be saved) raises either way.
        max_consecutive_failures: with ``on_save_error="log"``, the failed saves in a
            row after which the next settling call raises (the job must not run on for
            long without checkpoints).
        log_level: ``None`` (default): quicksave leaves logging alone (warnings and
            errors reach stderr through Python's last-resort handler). ``"info"`` (or
            ``"debug"``, ``"warning"``, ``"error"``): the ``"quicksave"`` logger is set to
            that level and, if no handler would show its records, given one that writes
            to stderr (removed by ``close()``): the coordinator then logs one line per
            resume (``resumed from <path> step N in X s``) and per commit.
        on_metrics: called with each checkpoint's :class:`SaveRecord` once it is
            settled, committed or failed (``step``, ``bytes``, ``blocking_s``: the time
            in ``save()``, ``staging_s``, ``durable_s``, ``throughput_mbps``, ``status``
            and ``error``; ``record.scalars()`` gives them as a dict for a metrics
            logger), on every rank with that rank's record. It runs on the training
            thread, inside a manager call: a synchronous save (seed, export,
            ``async_mode="disabled"``) or a failed hand-off in the ``save()`` that wrote
            it; a background save in the first ``save()``, ``wait()``, ``load()``,
            ``export()`` or ``close()`` after it finished. A hook that raises is logged
            and ignored. ``None`` (default): no hook (``manager.metrics`` has the records
            either way).
        memory: a node-memory tier in front of the folder (:class:`MemoryTierConfig`):
            snapshots every few steps that a restarted trainer on the same node
            resumes from without reading the folder. None (default): the folder only.
        stream_load: True: a resume's ``load()`` returns once every state but the
            optimizers' is in place, and the optimizers' states (usually 2/3 of the bytes)
            load in the background while the first forward and backward run; each
            optimizer's ``step()``, ``state_dict()`` and ``load_state_dict()`` (and every
            manager call) wait for them, but code reading ``optimizer.state`` directly
            would see values still arriving. Only where the load needs no collective (one
            rank, or a rank's memory snapshot). False (default): ``load()`` returns with
            everything in place.
        upload: an object-store tier behind the folder (:class:`UploadTierConfig`):
            due steps copied from the local folder in the background; ``load()`` reads
            it when it holds a newer step than the folder. None (default): none.
        incremental: incremental saves (:class:`~quicksave.IncrementalConfig`): blocks
            unchanged since the last checkpoint are referred to, not written again
            (``async_mode`` ``"thread"`` or ``"process"``, any number of ranks;
            FORMAT.md §9; ``"disabled"`` is refused). The folder must be a
            filesystem's (an object store is refused here: no sparse objects);
            ``upload`` copies it to a store.
            Off by default.

    Raises:
        CheckpointError: on construction, for any invalid value (message names it).

    Example::

        config = CheckpointConfig(folder="ckpt", interval=100, keep_latest_k=3,
                                  last_step=10_000, export_dtype="bfloat16")
        # each checkpoint's figures to TensorBoard (writer: a SummaryWriter)
        config = CheckpointConfig(folder="ckpt", on_metrics=lambda r: [
            writer.add_scalar(k, v, r.step) for k, v in r.scalars().items()])
    """

    folder: str
    interval: float = 500
    interval_type: str = "steps"
    keep_latest_k: int = 0
    export_dtype: str = "float32"
    last_step: int | None = None
    thread_count: int = 2
    async_mode: str = "process"
    staging: str = "overlap"
    backpressure: str = "wait"
    max_in_flight: int = 1
    worker_timeout_s: float = 5.0
    save_timeout_s: float = 900.0
    close_timeout_s: float = 300.0
    commit_timeout_s: float = 120.0
    enabled: bool = True
    interval_check_steps: int = 10
    read_only: bool = False
    allow_dcp: bool = False
    allow_dcp_pickle: bool = False
    storage: StorageOptions = field(default_factory=StorageOptions)
    worker_cpus: tuple[int, ...] | None = None
    write_rate_mbps: float | None = None
    on_save_error: str = "raise"
    max_consecutive_failures: int = 3
    log_level: str | None = None
    on_metrics: MetricsHook | None = None
    memory: MemoryTierConfig | None = None
    stream_load: bool = False
    upload: UploadTierConfig | None = None
    incremental: IncrementalConfig = field(default_factory=IncrementalConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.incremental, IncrementalConfig):
            raise CheckpointError(
                f"incremental must be an IncrementalConfig, got {type(self.incremental).__name__}"
            )
        if self.memory is not None and not isinstance(self.memory, MemoryTierConfig):
            raise CheckpointError(
                f"memory must be a MemoryTierConfig or None, got {type(self.memory).__name__}"
            )
        if isinstance(self.folder, os.PathLike):
            object.__setattr__(self, "folder", os.fspath(self.folder))
        if not isinstance(self.folder, str) or not self.folder:
            raise CheckpointError(f"folder must be a non-empty path, got {self.folder!r}")
        if not isinstance(self.storage, StorageOptions):
            raise CheckpointError(
                f"storage must be a StorageOptions, got {type(self.storage).__name__}"
            )
        # a URL it cannot serve: now
        folder = parse_location(self.folder, what="checkpoint folder", options=self.storage)
        check_destination(self.incremental, folder, None)
        if self.interval_type not in INTERVAL_TYPES:
            raise CheckpointError(
                f"interval_type must be 'steps' or 'seconds', got {self.interval_type!r}"
            )
        if (
            isinstance(self.interval, bool)
            or not isinstance(self.interval, (int, float))
            or not math.isfinite(self.interval)
            or self.interval <= 0
        ):
            raise CheckpointError(f"interval must be a positive number, got {self.interval!r}")
        if self.interval_type == "steps" and self.interval != int(self.interval):
            raise CheckpointError(
                f"interval must be a whole number of steps, got {self.interval!r}"
            )
        _check_int("keep_latest_k", self.keep_latest_k, minimum=0)
        _check_int("thread_count", self.thread_count, minimum=1)
        if self.last_step is not None:
            _check_int("last_step", self.last_step, minimum=0)
        dtype = (
            getattr(torch, self.export_dtype, None) if isinstance(self.export_dtype, str) else None
        )
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise CheckpointError(
                f"export_dtype must name a torch floating dtype (e.g. 'float32', 'bfloat16'), "
                f"got {self.export_dtype!r}"
            )
        for name, allowed in (
            ("async_mode", ASYNC_MODES),
            ("staging", STAGING_MODES),
            ("backpressure", BACKPRESSURE),
            ("on_save_error", ON_SAVE_ERROR),
        ):
            value = getattr(self, name)
            if value not in allowed:
                choices = ", ".join(repr(a) for a in allowed)
                raise CheckpointError(f"{name} must be one of {choices}, got {value!r}")
        _check_int("max_in_flight", self.max_in_flight, minimum=1)
        _check_int("max_consecutive_failures", self.max_consecutive_failures, minimum=1)
        if self.log_level is not None and self.log_level not in LOG_LEVELS:
            choices = ", ".join(repr(a) for a in LOG_LEVELS)
            raise CheckpointError(
                f"log_level must be None or one of {choices}, got {self.log_level!r}"
            )
        _check_int("interval_check_steps", self.interval_check_steps, minimum=1)
        if self.on_metrics is not None and not callable(self.on_metrics):
            raise CheckpointError(
                f"on_metrics must be a callable taking a SaveRecord, or None, "
                f"got {self.on_metrics!r}"
            )
        for name in ("worker_timeout_s", "save_timeout_s", "close_timeout_s", "commit_timeout_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise CheckpointError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in ("enabled", "read_only", "allow_dcp", "allow_dcp_pickle"):
            if not isinstance(getattr(self, name), bool):
                raise CheckpointError(f"{name} must be True or False, got {getattr(self, name)!r}")
        rate = self.write_rate_mbps
        if rate is not None and (
            isinstance(rate, bool)
            or not isinstance(rate, (int, float))
            or not math.isfinite(rate)
            or rate <= 0
        ):
            raise CheckpointError(f"write_rate_mbps must be a positive number or None: {rate!r}")
        if self.upload is not None:
            if not isinstance(self.upload, UploadTierConfig):
                raise CheckpointError(
                    f"upload must be an UploadTierConfig or None, got {type(self.upload).__name__}"
                )
            self.upload.check(self.folder, self.interval, self.interval_type, self.storage)
        if self.worker_cpus is not None:
            object.__setattr__(self, "worker_cpus", _check_cpus(self.worker_cpus))
            if self.async_mode != "process":
                raise CheckpointError(
                    f"worker_cpus places the worker process: it needs async_mode='process', "
                    f"got {self.async_mode!r}"
                )
        if self.incremental.enabled and self.async_mode == "disabled":
            raise CheckpointError(
                "incremental saves are the async engine's: async_mode='disabled' writes "
                "every byte (quicksave.save); use async_mode='thread' or 'process'",
                path=self.folder,
            )

    @property
    def export_torch_dtype(self) -> torch.dtype:
        """``export_dtype`` as a ``torch.dtype``."""
        return getattr(torch, self.export_dtype)

    def engine_config(self) -> EngineConfig:
        """The :class:`~quicksave.saving.engine.EngineConfig` of the async modes, built from
        this config (the one source of truth for every knob).

        Raises:
            CheckpointError: ``async_mode`` is ``"disabled"`` (there is no engine).

        Example::

            CheckpointConfig(folder="ckpt", async_mode="thread").engine_config().mode
            # 'thread'
        """
        if self.async_mode == "disabled":
            raise CheckpointError("async_mode='disabled' saves synchronously: no engine")
        return EngineConfig(
            mode=self.async_mode,  # type: ignore[arg-type]
            staging=self.staging,  # type: ignore[arg-type]
            thread_count=self.thread_count,
            backpressure=self.backpressure,  # type: ignore[arg-type]
            max_in_flight=self.max_in_flight,
            worker=WorkerConfig(
                worker_timeout_s=float(self.worker_timeout_s),
                save_timeout_s=float(self.save_timeout_s),
                cpus=self.worker_cpus,
            ),
            close_timeout_s=float(self.close_timeout_s),
            storage=self.storage,
            write_rate_mbps=(None if self.write_rate_mbps is None else float(self.write_rate_mbps)),
            incremental=self.incremental,
        )


def _check_cpus(cpus: object) -> tuple[int, ...]:
    """``worker_cpus`` as a sorted tuple of CPUs of this machine."""
    try:
        values = sorted({c for c in cpus})  # type: ignore[attr-defined]
    except TypeError:
        values = None
    if not values or any(isinstance(c, bool) or not isinstance(c, int) for c in values):
        raise CheckpointError(f"worker_cpus must be a non-empty set of CPU numbers, got {cpus!r}")
    count = os.cpu_count() or 1  # not this process's affinity: the worker may go elsewhere
    outside = [c for c in values if not 0 <= c < count]
    if outside:
        raise CheckpointError(
            f"worker_cpus {outside} are not CPUs of this machine (it has {count}: 0..{count - 1})"
        )
    return tuple(values)


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CheckpointError(f"{name} must be an integer >= {minimum}, got {value!r}")
