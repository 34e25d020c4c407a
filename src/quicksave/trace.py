"""Where a save's and a load's time goes, seen by ``torch.profiler``: one range per phase.

Each phase runs inside :func:`phase`, a ``torch.profiler`` range (a ``RecordFunction``,
like ``torch.profiler.record_function``) on the thread that runs it, named
``quicksave.<path>.<phase>``:

=============================== ====================== ====================================
range                           thread                 what
=============================== ====================== ====================================
``quicksave.save.state_dict``   training               the manager calls ``state_dict()``
``quicksave.save.collect``      training               flatten and check the state dict
``quicksave.save.plan``         training               the layout (several ranks: the
                                                       vote and the plan exchange, with
                                                       ``collect`` inside)
``quicksave.save.stage``        training; the          copy tensors into the staging pool
                                ``quicksave-stage``    (overlap mode: the deferred ones
                                thread                 on the background thread)
``quicksave.save.wait_staging`` training               wait for the background copy and
                                                       check its tensors did not move
``quicksave.save.submit``       training               hand the save to the writer
``quicksave.save.persist``      writer                 write the files, xxh3, fsync
``quicksave.save.commit``       writer                 manifest, rename (several ranks:
                                                       the coordinator's wait and merge)
``quicksave.load.metadata``     calling                read and check the manifest
``quicksave.load.plan``         calling                the reads of every rank (exchange)
``quicksave.load.read``         calling                this rank's reads, and the round
                                                       in which every rank hears of them
``quicksave.load.verify``       reading threads        xxh3 check of a chunk just read
                                                       (one range per chunk; a chunk
                                                       read piece by piece is hashed
                                                       as the pieces land, inside the
                                                       read, and only compared here)
``quicksave.load.restore``      calling                ``load_state_dict`` of each state
=============================== ====================== ====================================

``quicksave.save`` (synchronous) has ``collect``, ``plan``, ``persist`` and ``commit`` on
the calling thread. The writer's phases (``persist``, ``commit``) run in the worker
process (``async_mode="process"``), which never imports torch: ``torch.profiler`` can
neither see them nor take events timed elsewhere. The writer times them itself and the
save's record carries them as :class:`Span` s (``SaveResult.spans``,
``SaveRecord.spans``); :func:`add_writer_spans` writes them into a Chrome trace exported
by the profiler, on a track of the worker's process. With ``async_mode="thread"`` the
writer is a thread of the training process and its phases are ranges there too.

Threads other than the one that started the profiler (the background copy, reading
threads, a thread-mode writer) are in the trace only when the profiler records every
thread: ``torch.profiler.profile(experimental_config=
torch.profiler._ExperimentalConfig(profile_all_threads=True))``.

A range costs next to nothing with the profiler off (``_RecordFunctionFast`` where
torch has it; else ``torch.profiler.record_function``, dearer, still small next to a
save's work): a few per save, one per chunk read.

Example::

    with torch.profiler.profile(experimental_config=_ExperimentalConfig(
            profile_all_threads=True)) as prof:
        train()  # manager.save(step) every step
    prof.export_chrome_trace("trace.json")
    add_writer_spans("trace.json", manager.metrics)  # the worker's persist and commit
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

_FAST = getattr(getattr(torch._C, "_profiler", None), "_RecordFunctionFast", None)

PERSIST = "quicksave.save.persist"
COMMIT = "quicksave.save.commit"


def phase(name: str) -> AbstractContextManager[Any]:
    """A ``torch.profiler`` range ``quicksave.<name>`` (e.g. ``phase("save.plan")``)
    around one phase, on the calling thread."""
    full = "quicksave." + name
    if _FAST is not None:
        return _FAST(full)
    return torch.profiler.record_function(full)


@dataclass(frozen=True)
class Span:
    """A phase timed by the writer: ``name`` (``quicksave.save.persist`` or
    ``quicksave.save.commit``) from ``start`` to ``end`` (seconds since the epoch, as
    ``time.time()``), in process ``pid`` (the worker process; the training process in
    ``async_mode="thread"``)."""

    name: str
    start: float
    end: float
    pid: int


def writer_spans(started: float, written: float, finished: float, pid: int) -> tuple[Span, ...]:
    """The writer's ``persist`` (``started`` → ``written``) and ``commit`` (→
    ``finished``) spans, from ``time.monotonic()`` readings of this machine (the clock
    every process shares) turned into epoch seconds."""
    if not started:
        return ()
    shift = time.time() - time.monotonic()
    return (
        Span(PERSIST, started + shift, written + shift, pid),
        Span(COMMIT, written + shift, finished + shift, pid),
    )


def add_writer_spans(trace_path: str | os.PathLike[str], records: Iterable[Any]) -> int:
    """Add the writer's phases of ``records`` to a Chrome trace that
    ``torch.profiler`` exported (``prof.export_chrome_trace(path)``): complete events
    (``"ph": "X"``) on a track named ``quicksave writer`` of each worker process, in the
    trace's time base. Spans of a process the trace already covers (a thread-mode
    writer, whose ranges the profiler records itself) are left out.

    Args:
        trace_path: the JSON trace, rewritten in place (atomically).
        records: anything with ``spans`` (``SaveRecord``, ``SaveResult``), e.g.
            ``manager.metrics``, or the records the ``on_metrics`` hook received.

    Returns:
        the number of events added.

    Example::

        prof.export_chrome_trace("trace.json")
        add_writer_spans("trace.json", manager.metrics)
    """
    path = os.fspath(trace_path)
    with open(path, encoding="utf-8") as f:
        trace = json.load(f)
    events = trace.setdefault("traceEvents", [])
    traced = {e.get("pid") for e in events if e.get("ph") != "M"}
    # kineto writes timestamps in µs after baseTimeNanoseconds (older versions: since
    # the epoch, and no base)
    base_us = trace.get("baseTimeNanoseconds", 0) / 1000.0
    added = 0
    named: set[int] = set()
    for record in records:
        for span in getattr(record, "spans", ()) or ():
            if span.pid in traced:
                continue
            if span.pid not in named:
                named.add(span.pid)
                events += [
                    {"ph": "M", "name": "process_name", "pid": span.pid, "tid": 0,
                     "args": {"name": f"quicksave worker (pid {span.pid})"}},
                    {"ph": "M", "name": "thread_name", "pid": span.pid, "tid": 0,
                     "args": {"name": "quicksave writer"}},
                ]  # fmt: skip
            events.append(
                {
                    "ph": "X",
                    "cat": "user_annotation",
                    "name": span.name,
                    "pid": span.pid,
                    "tid": 0,
                    "ts": span.start * 1e6 - base_us,
                    "dur": max(0.0, span.end - span.start) * 1e6,
                    "args": {"step": getattr(record, "step", None)},
                }
            )
            added += 1
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(trace, f)
    os.replace(tmp, path)
    return added
