"""The job the trainer sends the persister for one save of one rank, and what comes back.

The trainer builds a ``PersistJob`` at plan time (``quicksave.saving.engine``, every rank
for its own files) and hands it to its persister (``quicksave.worker.persisters``); the
writer runs it (``quicksave.worker.execute``) and answers with a ``JobResult``. A job is a
small control message: pool offsets and sizes of the staged file images, the manifest
skeleton, the pickled ``.metadata``; tensor bytes never travel in it (the worker reads
them from the staging pool it mapped). The messages only go trainer → writer, and the
result back: the writer never asks the trainer anything.

``Usage``, ``Phase``, ``done``, ``failure`` and ``not_committed`` are the writer's side: they build
the result of a job (its cost, or its error in a form that pickles and is raised again in
the trainer by ``JobResult.error``).

Torch-free: the worker process imports it.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import pickle
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from quicksave import errors
from quicksave.commit.rank_records import StoreAddress
from quicksave.errors import CheckpointError
from quicksave.format.manifest import Manifest
from quicksave.storage.location import Location


class PickledOnce(dict):
    """A dict that a plan shares between its saves' jobs (e.g. the manifest's thousands
    of tensor entries), never changed once made: it pickles as the bytes it pickled to
    the first time, so that each later job sends them at the cost of a copy. It arrives
    as a PickledOnce holding those bytes (:attr:`blob`): the same bytes are the same
    content, by which the writer keeps what it derives from it from job to job
    (``execute.Templates``)."""

    _blob: bytes | None = None

    @property
    def blob(self) -> bytes | None:
        """The bytes it pickles as (None: not pickled yet)."""
        return self._blob

    def __reduce__(self) -> tuple[Callable[[bytes], Any], tuple[bytes]]:
        if self._blob is None:
            self._blob = pickle.dumps(dict(self), protocol=pickle.HIGHEST_PROTOCOL)
        return _arrived, (self._blob,)


def _arrived(blob: bytes) -> PickledOnce:
    """A :class:`PickledOnce` unpickled, holding the bytes it came as."""
    out = PickledOnce(pickle.loads(blob))
    out._blob = blob
    return out


class Arrivals:
    """The :class:`PickledOnce` dicts a writer received lately, kept by their bytes: a
    message that brings the same bytes again (a plan's manifest skeleton and chunk keys,
    in every job of the plan: thousands of entries) gets the same dict back without
    unpickling them again. The dicts are never changed once made, so jobs may share
    them. The ``keep`` used latest are kept. One thread unpickles (the writer's loop)."""

    def __init__(self, keep: int = 6) -> None:
        self.keep = keep
        self._kept: list[tuple[bytes, PickledOnce]] = []  # the latest used first

    def loads(self, data: bytes | memoryview) -> Any:
        """``pickle.loads`` of a message, its PickledOnce dicts kept or taken from here."""
        return _Unpickler(io.BytesIO(data), self).load()

    def arrived(self, blob: bytes) -> PickledOnce:
        """The dict of ``blob``: kept, or unpickled now (and kept)."""
        for i, (kept, out) in enumerate(self._kept):
            if kept == blob:
                if i:
                    self._kept.insert(0, self._kept.pop(i))
                return out
        out = _arrived(blob)
        self._kept = [(blob, out), *self._kept][: self.keep]
        return out


class _Unpickler(pickle.Unpickler):
    """An unpickler whose PickledOnce dicts come from :class:`Arrivals`."""

    def __init__(self, file: io.BytesIO, arrivals: Arrivals) -> None:
        super().__init__(file)
        self._arrivals = arrivals

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == "_arrived":
            return self._arrivals.arrived
        return super().find_class(module, name)


@dataclass(frozen=True)
class FileJob:
    """One data file of the rank: its staged image in the pool and its chunks."""

    name: str
    base: int  # pool offset of the file image
    size: int
    entries: tuple[tuple[str, int, int], ...]  # (safetensors key, file offset, length)


@dataclass(frozen=True)
class PersistJob:
    """Everything the worker needs for one save of one rank (no tensor bytes)."""

    job_id: int
    pool_id: int
    step: int | None
    rank: int
    final_path: str
    draft: str
    files: tuple[FileJob, ...]
    manifest: Manifest | None  # checksums still empty; multi-rank: the coordinator's only
    chunk_keys: dict[str, tuple[str, int]]  # safetensors key -> (fqn, chunk index)
    dcp_metadata: bytes  # the pickled .metadata (built by the trainer at plan time)
    fsync: bool = True
    o_direct: bool = True
    thread_count: int = 2
    dist: DistCommit | None = None  # multi-rank: commit through parts and store records
    # The checkpoint's location (``final_path`` is its URL); its commit strategy says
    # what ``draft`` is: a temporary directory renamed at commit, or (an object store)
    # the checkpoint's own prefix, committed by the manifest written last.
    location: Location | None = None
    # Replace a committed checkpoint at ``final_path`` atomically (local, single rank).
    replace: bool = False
    # The folder's lease holder saves: an uncommitted leftover at ``final_path`` (a
    # crashed save's; never loadable) is removed before writing instead of failing it.
    clear_uncommitted: bool = False
    # Chunk digests the trainer computed while staging (chunk key -> xxh3-64 hex): the
    # writer hashes only the chunks missing here.
    digests: dict[str, str] = field(default_factory=dict)
    # Bytes per second each writer thread writes at most (local files; None: no limit).
    write_rate: float | None = None
    # In place (a memory tier's snapshot): the pool is this file, holding the job's one
    # data file whole; the file is hard-linked into the draft instead of written.
    linked: str | None = None
    # Chunk references (FORMAT.md §9): safetensors key -> the earlier step of the same
    # run folder that holds its bytes (their digest in ``digests``). The writer leaves
    # their ranges of the file unwritten (holes: zeros) and the manifest names the step.
    bases: dict[str, int] = field(default_factory=dict)
    # Send the checksum of every chunk back in the result (``JobResult.digests``), but
    # those of ``bases`` (the base's, which the saver holds): an incremental saver
    # compares the next save's blocks with them.
    report_digests: bool = False

    def referenced_bytes(self) -> int:
        """Bytes of the chunks this job refers to instead of writing."""
        bases = self.bases
        if not bases:
            return 0
        return sum(e[2] for f in self.files for e in f.entries if e[0] in bases)


@dataclass(frozen=True)
class DistCommit:
    """The multi-rank half of a PersistJob (protocol: ``quicksave.commit.rank_records``).

    Every rank writes its files and its part, then posts its rank record; the
    coordinator's writer waits for all records and commits (its job's ``manifest`` is the
    skeleton and ``chunk_keys`` cover every rank); the others wait for the commit record.
    """

    token: str  # names this save's records; agreed by all ranks at plan time
    world_size: int
    coordinator: int
    store: StoreAddress
    objects: dict[str, Any]  # typed JSON values of the objects this rank owns
    timeout_s: float  # the coordinator's wait for every rank; others wait a bit longer


@dataclass(frozen=True)
class JobResult:
    """A job's outcome, sent back to the trainer: its cost, or its error (as fields that
    pickle; ``error()`` rebuilds the exception)."""

    job_id: int
    step: int | None
    ok: bool
    bytes_written: int = 0
    bytes_referred: int = 0  # of the chunks it refers to instead (``PersistJob.bases``)
    write_s: float = 0.0
    commit_s: float = 0.0
    finished_at: float = 0.0  # time.monotonic() when durable (comparable across processes)
    started_at: float = 0.0  # time.monotonic() when the writer started on it (0: failed)
    pid: int = 0  # the writer's process
    cpu_s: float = 0.0  # CPU seconds of the job's thread and its writer threads
    bytes_hashed: int = 0  # chunk bytes the writer hashed (not given by the trainer)
    # job.report_digests: every chunk's, but those the job refers to (``job.bases``)
    digests: dict[str, str] = field(default_factory=dict)
    error_type: str = ""
    error_message: str = ""
    error_path: str | None = None
    error_fqn: str | None = None
    error_rank: int | None = None
    detail: str = ""

    def error(self) -> CheckpointError:
        """The failure as the ``CheckpointError`` subclass the writer raised."""
        cls = getattr(errors, self.error_type, None)
        if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
            cls = CheckpointError
        return cls(
            self.error_message, path=self.error_path, fqn=self.error_fqn, rank=self.error_rank
        )


@dataclass
class Usage:
    """What one job cost the persister: CPU seconds of its thread (from ``cpu0``, its
    ``time.thread_time()`` at the start) and of its writer threads, chunk bytes hashed."""

    cpu0: float
    helpers_cpu_s: float = 0.0
    bytes_hashed: int = 0

    def cpu_s(self) -> float:
        return time.thread_time() - self.cpu0 + self.helpers_cpu_s


# ``phase(name)`` wraps one phase of a job (``"save.persist"``, ``"save.commit"``): a
# thread-mode writer is given ``quicksave.trace.phase`` (a profiler range in the training
# process); the worker process, which has no torch, runs ``untraced``.
Phase = Callable[[str], AbstractContextManager[Any]]


def untraced(name: str) -> AbstractContextManager[Any]:
    """The phase of a writer no profiler sees: nothing."""
    return contextlib.nullcontext()


def done(
    job: PersistJob,
    began: float,
    written: float,
    committed: float,
    usage: Usage,
    digests: dict[str, str] | None = None,
) -> JobResult:
    """A job's success: its files written at ``written``, committed at ``committed``
    (``digests``: every chunk's, sent back where the job asks for them, but those it
    refers to: a lora save's result then stays small enough for one write of the pipe,
    which a reader otherwise waits on between the header and the body)."""
    referred = job.referenced_bytes()
    return JobResult(
        job.job_id,
        job.step,
        True,
        bytes_written=sum(f.size for f in job.files) - referred,
        bytes_referred=referred,
        write_s=written - began,
        commit_s=committed - written,
        finished_at=committed,
        started_at=began,
        pid=os.getpid(),
        cpu_s=usage.cpu_s(),
        bytes_hashed=usage.bytes_hashed,
        digests=(
            {k: d for k, d in digests.items() if k not in job.bases}
            if digests is not None and job.report_digests
            else {}
        ),
    )


def not_committed(job: PersistJob, reason: str, failed_rank: int | None) -> JobResult:
    """A multi-rank save that was not committed, because of ``failed_rank`` (None: this
    rank) for ``reason``."""
    return JobResult(
        job.job_id,
        job.step,
        False,
        error_type="CheckpointError",
        error_message=f"the checkpoint was not committed: {reason}",
        error_path=job.final_path,
        error_rank=failed_rank if failed_rank is not None else job.rank,
    )


def failure(job: PersistJob, e: BaseException) -> JobResult:
    """A job's failure from the exception ``e``: a ``CheckpointError`` as it is, an
    ``OSError`` named by its errno, anything else with its traceback."""
    if isinstance(e, CheckpointError):
        return JobResult(
            job.job_id,
            job.step,
            False,
            error_type=type(e).__name__,
            error_message=e.message,
            error_path=e.path or job.final_path,
            error_fqn=e.fqn,
            error_rank=job.rank,
        )
    if isinstance(e, OSError):  # e.g. creating the temporary directory
        name = errno.errorcode.get(e.errno or 0, type(e).__name__)
        return JobResult(
            job.job_id,
            job.step,
            False,
            error_type="CheckpointError",
            error_message=f"writing the checkpoint failed: {name} ({e.strerror})",
            error_path=os.fspath(e.filename) if e.filename else job.final_path,
            error_rank=job.rank,
        )
    return JobResult(
        job.job_id,
        job.step,
        False,
        error_type="CheckpointError",
        error_message=f"{type(e).__name__}: {e}",
        error_path=job.final_path,
        error_rank=job.rank,
        detail=traceback.format_exc(),
    )
