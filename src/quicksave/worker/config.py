"""The worker process's settings: how it runs and when the trainer gives up on it.

Built by the saver's configuration (``quicksave.saving.engine.EngineConfig.worker``, from
``quicksave.manager.config``) or by the NVRx-compatible queue, on every rank; read by
``quicksave.worker.persisters.ProcessPersister`` (the timeouts, on the trainer's side) and
passed to the worker process on its command line (``quicksave.worker.main``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerConfig:
    """How the worker process runs and when the trainer gives up on it.

    Hung means not progressing, not unscheduled. The worker beats a heartbeat from a
    thread of its own every ``heartbeat_s`` (so a slow write keeps beating). A heartbeat
    older than ``worker_timeout_s`` alone is not a failure: the trainer then reads the
    worker's progress in /proc (``quicksave.worker.liveness``) and fails its saves
    (``WorkerFailedError``) only if it is stopped (SIGSTOP, a debugger), or if it has
    also been seen making no progress — no thread runnable, no CPU time, no bytes read
    or written — for half of ``worker_timeout_s`` (a deadlock). A starved worker (runnable
    but not scheduled on a busy node, or progressing slowly) is never failed for it,
    however long: ``save_timeout_s`` is the absolute bound on each save.
    """

    worker_timeout_s: float = 5.0
    save_timeout_s: float = 900.0  # a job running longer than this: failed
    start_timeout_s: float = 120.0  # process start + imports on a busy machine
    nice: int = 10  # CPU priority increment of the worker
    # CPUs the worker process runs on (None: the trainer's); e.g. keep it and the
    # uploads off the cores that feed the training loop
    cpus: tuple[int, ...] | None = None
    heartbeat_s: float = 0.2
    # Linux I/O scheduling class of the worker (ionice -c: 1 realtime, 2 best-effort,
    # 3 idle; None: the trainer's)
    io_priority: int | None = None
    # The worker behaves as a daemonic process: it may not start processes of its own
    # (NVRx's is_daemon; multiprocessing refuses children there)
    daemon: bool = False
