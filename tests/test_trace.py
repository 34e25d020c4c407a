"""``quicksave.trace``: the phases as profiler ranges, the writer's spans, and their place
in an exported Chrome trace."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.profiler import _ExperimentalConfig, profile

import quicksave
from quicksave.saving.config import EngineConfig
from quicksave.saving.engine import AsyncSaver
from quicksave.trace import COMMIT, PERSIST, Span, add_writer_spans, phase, writer_spans

ALL_THREADS = _ExperimentalConfig(profile_all_threads=True)


def _ranges(prof: profile) -> list[tuple[str, int]]:
    return [(e.name, e.thread) for e in prof.events() if e.name.startswith("quicksave.")]


def test_a_phase_is_a_range_on_the_thread_that_runs_it() -> None:
    def other() -> None:
        with phase("load.verify"):
            pass

    with profile(experimental_config=ALL_THREADS) as prof:
        with phase("save.plan"):
            t = threading.Thread(target=other)
            t.start()
            t.join()
    ranges = _ranges(prof)
    assert sorted(n for n, _ in ranges) == ["quicksave.load.verify", "quicksave.save.plan"]
    threads = dict(ranges)
    assert threads["quicksave.load.verify"] != threads["quicksave.save.plan"]


def test_a_phase_that_raises_ends_its_range() -> None:
    with profile() as prof:
        try:
            with phase("save.stage"):
                raise ValueError("boom")
        except ValueError:
            pass
        with phase("save.submit"):
            pass
    events = [e for e in prof.events() if e.name.startswith("quicksave.")]
    assert [e.name for e in events] == ["quicksave.save.stage", "quicksave.save.submit"]
    # not nested: the first range ended where its exception left it
    assert events[1].cpu_parent is None


def test_writer_spans_turn_the_shared_monotonic_clock_into_epoch_seconds() -> None:
    before = time.time()
    started = time.monotonic()
    spans = writer_spans(started, started + 2.0, started + 2.5, 4242)
    after = time.time()
    persist, commit = spans
    assert (persist.name, commit.name) == (PERSIST, COMMIT)
    assert persist.pid == commit.pid == 4242
    # the same instant on the epoch clock (both clocks tick alike over a few µs)
    assert before - 1e-3 <= persist.start <= after
    assert abs((persist.end - persist.start) - 2.0) < 1e-6
    assert persist.end == commit.start and abs((commit.end - commit.start) - 0.5) < 1e-6
    assert writer_spans(0.0, 0.0, 0.0, 1) == ()  # a failed job reports no times


def _trace(path: Path, pid: int, base_ns: int) -> None:
    path.write_text(
        json.dumps(
            {
                "baseTimeNanoseconds": base_ns,
                "traceEvents": [
                    {"ph": "M", "name": "thread_name", "pid": pid, "tid": pid, "args": {}},
                    {"ph": "X", "name": "quicksave.save.submit", "pid": pid, "tid": pid,
                     "ts": 10.0, "dur": 5.0},
                ],
            }
        )
    )  # fmt: skip


def test_add_writer_spans_puts_the_worker_on_its_own_track_in_the_trace_time_base(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "trace.json"
    _trace(trace, pid=100, base_ns=1_700_000_000_000_000_000)
    worker = [Span(PERSIST, 1_700_000_001.0, 1_700_000_001.5, 200), Span(COMMIT, 1_700_000_001.5,
              1_700_000_001.75, 200)]  # fmt: skip
    in_process = [Span(PERSIST, 1_700_000_002.0, 1_700_000_003.0, 100)]  # a thread-mode writer
    records = [
        SimpleNamespace(step=5, spans=tuple(worker)),
        SimpleNamespace(step=6, spans=tuple(in_process)),
        SimpleNamespace(step=7, spans=()),  # a failed save
    ]
    assert add_writer_spans(trace, records) == 2
    events = json.loads(trace.read_text())["traceEvents"]
    added = [e for e in events if e.get("ph") == "X" and e["pid"] == 200]
    assert [(e["name"], e["args"]["step"]) for e in added] == [(PERSIST, 5), (COMMIT, 5)]
    # 1 s after the base: 1e6 µs in the trace's time base; durations in µs
    assert abs(added[0]["ts"] - 1_000_000.0) < 1.0 and abs(added[0]["dur"] - 500_000.0) < 1.0
    assert abs(added[1]["ts"] - 1_500_000.0) < 1.0 and abs(added[1]["dur"] - 250_000.0) < 1.0
    names = {e["name"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["pid"] == 200}
    assert names == {
        "process_name": "quicksave worker (pid 200)",
        "thread_name": "quicksave writer",
    }
    # the traced process's own writer spans are its ranges already: not added twice
    assert not [e for e in events if e.get("ph") == "X" and e["pid"] == 100 and e["ts"] > 100]
    assert sorted(os.listdir(tmp_path)) == ["trace.json"]  # rewritten in place


def test_an_engine_save_is_seen_phase_by_phase(tmp_path: Path) -> None:
    # The engine alone (no manager): its SaveResult carries the worker's spans, which
    # follow the hand-off on the same clock.
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 3}
    with profile(experimental_config=ALL_THREADS) as prof:
        saver = AsyncSaver(EngineConfig(mode="process"))
        try:
            submitted = time.time()
            result = saver.save(state, tmp_path / "ckpt", step=3).wait()
        finally:
            saver.close()
    names = {n for n, _ in _ranges(prof)}
    assert {
        "quicksave.save.collect",
        "quicksave.save.plan",
        "quicksave.save.stage",
        "quicksave.save.submit",
    } <= names
    persist, commit = result.spans
    assert (persist.name, commit.name) == (PERSIST, COMMIT)
    assert persist.pid not in (0, os.getpid())  # the worker process
    # (1 ms: the two clocks may be slewed apart a little while the save runs)
    assert submitted - 1e-3 <= persist.start <= persist.end <= commit.start <= commit.end
    assert quicksave.verify_checkpoint(str(tmp_path / "ckpt")).ok
