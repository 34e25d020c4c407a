"""What each checkpoint written by the manager cost: ``SaveRecord``, its log line, and
the ``on_metrics`` hook that receives it.

A record is created when ``save()`` returns. In the async modes it says
``status="in_flight"`` and carries only ``blocking_s`` until the save is durable; the
manager then replaces it (records are frozen) with the engine's numbers. Once a record
is settled — committed or failed — it goes to ``CheckpointConfig.on_metrics``
(:func:`report`), once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from quicksave.trace import Span

logger = logging.getLogger("quicksave")

STATUSES = ("in_flight", "committed", "failed")


@dataclass(frozen=True)
class SaveRecord:
    """What one checkpoint written by the manager cost. Times are wall seconds from the
    start of the ``save()`` call that wrote it.

    Attributes:
        step: the training step.
        kind: ``"full"``, ``"seed"`` (step 0, model only) or ``"export"``.
        path: the checkpoint directory (committed once ``status == "committed"``).
        bytes: bytes of this rank: the tensor payload while in flight; once committed in
            an async mode, the bytes of the data files written.
        blocking_s: how long ``save()`` held the training loop for it.
        staging_s: until every tensor was copied out of the training state (synchronous
            saves: ``blocking_s``). None until known.
        durable_s: until the checkpoint was committed (files, manifest and rename
            fsynced). None until committed.
        write_s: the writer's time for the data files (synchronous saves: the whole
            ``quicksave.save``). None until committed.
        commit_s: the writer's time for ``.metadata`` + manifest + rename (None for
            synchronous saves, where it is part of ``write_s``).
        status: ``"in_flight"``, ``"committed"``, ``"failed"`` or ``"skipped"`` (the
            writer found a committed checkpoint of the step already there).
        mode: the ``async_mode`` that wrote it (``"disabled"`` for synchronous writes).
        trainer_cpu_s: CPU seconds the save cost the training process: ``save()`` on its
            thread plus the background staging thread (synchronous saves: the whole
            process while ``save()`` ran). None until known.
        worker_cpu_s: CPU seconds of the writer (the worker process's job and writer
            threads, or the writer thread in thread mode); 0 for synchronous saves.
        bytes_copied: tensor bytes copied into the staging pool (0: written from the
            tensors' own memory).
        bytes_hashed: bytes checksummed (xxh3-64), by the staging thread while copying
            and by the writer.
        bytes_referred: bytes of the chunks an incremental save refers to in earlier
            checkpoints instead of writing them (``IncrementalConfig``; 0: none, the
            checkpoint holds every byte itself). None until committed.
        error: why the save failed (``status == "failed"``), else None.
        spans: the writer's phases of an async save (``quicksave.save.persist``,
            ``quicksave.save.commit``) as it timed them, in epoch seconds
            (:class:`quicksave.trace.Span`; ``quicksave.trace.add_writer_spans`` puts
            them into a profiler trace). Empty for synchronous saves, whose phases are
            profiler ranges of the training thread, and for failed ones.
    """

    step: int
    kind: str
    path: str
    bytes: int
    blocking_s: float
    staging_s: float | None = None
    durable_s: float | None = None
    write_s: float | None = None
    commit_s: float | None = None
    status: str = "committed"
    mode: str = "disabled"
    trainer_cpu_s: float | None = None
    worker_cpu_s: float | None = None
    bytes_copied: int | None = None
    bytes_hashed: int | None = None
    bytes_referred: int | None = None
    error: str | None = None
    spans: tuple[Span, ...] = ()

    @classmethod
    def synchronous(
        cls,
        step: int,
        kind: str,
        path: str,
        nbytes: int,
        begin: float,
        written: float,
        now: float,
        **costs: float | int,
    ) -> SaveRecord:
        """The record of a checkpoint written whole by the calling thread: ``save()``
        began at ``begin`` (``time.monotonic()``), started writing at ``written`` and
        committed at ``now``; ``costs``: the CPU and byte fields known (it refers to
        nothing: ``bytes_referred`` 0)."""
        took = now - begin
        return cls(
            step, kind, path, nbytes, took, took, took, now - written, bytes_referred=0, **costs
        )

    @property
    def throughput_mbps(self) -> float | None:
        """Megabytes (10^6 bytes) per second from the ``save()`` call to durable:
        ``bytes / durable_s``; None until committed."""
        if self.status != "committed" or not self.durable_s:
            return None
        return self.bytes / self.durable_s / 1e6

    def scalars(self, prefix: str = "quicksave/") -> dict[str, float]:
        """The record's numbers, for a metrics logger: ``step``, ``bytes``,
        ``blocking_s`` (time in ``save()``), ``staging_s``, ``durable_s``,
        ``throughput_mbps`` and ``failed`` (1.0 or 0.0), each name after ``prefix``;
        the ones not known (a failed save's ``durable_s``) are left out.

        Example::

            on_metrics=lambda r: wandb.log(r.scalars())
        """
        values = {
            "step": self.step,
            "bytes": self.bytes,
            "blocking_s": self.blocking_s,
            "staging_s": self.staging_s,
            "durable_s": self.durable_s,
            "throughput_mbps": self.throughput_mbps,
            "failed": 1.0 if self.status == "failed" else 0.0,
        }
        return {prefix + k: float(v) for k, v in values.items() if v is not None}


# ``CheckpointConfig.on_metrics``: called with each settled record
MetricsHook = Callable[[SaveRecord], None]


def report(record: SaveRecord, hook: MetricsHook | None) -> None:
    """Hand a settled record (committed or failed) to ``hook``. A hook that raises is
    logged and ignored: metrics never fail a save or stop training."""
    if hook is None:
        return
    try:
        hook(record)
    except Exception:  # noqa: BLE001 - the user's hook: logged, never raised
        logger.exception(
            "quicksave: the on_metrics hook raised for the %s checkpoint of step %d; ignored",
            record.kind,
            record.step,
        )


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} s"


def log_committed(record: SaveRecord, level: int = logging.INFO) -> None:
    """The one log line of a committed checkpoint, with its costs (at ``level``: the
    manager's coordinator logs it at INFO, the other ranks at DEBUG)."""
    logger.log(
        level,
        "quicksave: committed %s checkpoint of step %d to %s (%s): %d bytes, blocking %s, "
        "staging %s, durable %s (write %s, commit %s), CPU %s trainer + %s writer%s",
        record.kind,
        record.step,
        record.path,
        record.mode,
        record.bytes,
        _s(record.blocking_s),
        _s(record.staging_s),
        _s(record.durable_s),
        _s(record.write_s),
        _s(record.commit_s),
        _s(record.trainer_cpu_s),
        _s(record.worker_cpu_s),
        f", {record.bytes_referred} bytes referred to" if record.bytes_referred else "",
    )
