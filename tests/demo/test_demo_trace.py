"""Acceptance of issue 27 part 3: a profiler trace of a demo run shows every phase of its
saves and of its resume, each on the thread (or process) that ran it."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

from quicksave.trace import Span, add_writer_spans
from quicksave_tools.demo.train import TrainConfig, train

SAVE = ("state_dict", "collect", "plan", "stage", "wait_staging", "submit", "persist", "commit")
LOAD = ("metadata", "plan", "read", "verify", "restore")
ON_TRAINING_THREAD = {f"quicksave.save.{p}" for p in SAVE[:6] if p != "stage"} | {
    f"quicksave.load.{p}" for p in LOAD if p != "verify"
}
# the writer's spans and the profiler's ranges come from two clocks turned into one
# time base: ordering is checked with this much slack (µs), far below the gaps checked
SLACK_US = 1000.0


def test_a_profiler_trace_of_the_demo_shows_every_phase(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    trace = tmp_path / "trace.json"
    # The demo's training loop (quicksave demo runs it as a child): async process mode,
    # overlapped staging; a run that checkpoints at 5, 10 and 12 (last: + export), then
    # a resume of step 12 that trains to 14.
    with profile(
        activities=[ProfilerActivity.CPU],
        experimental_config=_ExperimentalConfig(profile_all_threads=True),
    ) as prof:
        first = train(TrainConfig(steps=12, interval=5, warmup=2, folder=str(folder)))
        second = train(TrainConfig(steps=14, interval=5, warmup=2, folder=str(folder), resume=True))
    assert second["resumed_from"] == 12
    prof.export_chrome_trace(str(trace))

    # The worker's phases, from the records the manager kept (the demo writes them as
    # JSON), into the trace.
    records = [
        SimpleNamespace(step=r["step"], spans=tuple(Span(**s) for s in r["spans"]))
        for r in first["checkpoints"] + second["checkpoints"]
    ]
    full = [r for r in records if r.spans]
    assert [r.step for r in full] == [5, 10, 12, 14]  # the async saves; exports are sync
    assert add_writer_spans(trace, records) == 2 * len(full)

    events = [
        e
        for e in json.loads(trace.read_text())["traceEvents"]
        if e.get("ph") == "X" and e.get("name", "").startswith("quicksave.")
    ]
    names = Counter(e["name"] for e in events)
    for p in SAVE:
        assert names[f"quicksave.save.{p}"] > 0, p
    for p in LOAD:
        assert names[f"quicksave.load.{p}"] > 0, p

    me = os.getpid()  # the training thread is the main thread: its tid is the pid
    for e in events:
        if e["name"] in ON_TRAINING_THREAD:
            assert (e["pid"], e["tid"]) == (me, me), e
    stage_threads = {e["tid"] for e in events if e["name"] == "quicksave.save.stage"}
    assert me in stage_threads and len(stage_threads) > 1  # and the background copy's
    worker = [e for e in events if e["pid"] != me]
    assert Counter(e["name"] for e in worker) == {
        "quicksave.save.persist": 4,
        "quicksave.save.commit": 4,
    }
    # the exports (steps 12 and 14) persist and commit on the training thread
    for name in ("quicksave.save.persist", "quicksave.save.commit"):
        assert sum(e["pid"] == me == e["tid"] for e in events if e["name"] == name) == 2

    # On one time line: each async save is handed over, then persisted, then committed,
    # before the next one is handed over (one save in flight at a time).
    submits = sorted(e["ts"] for e in events if e["name"] == "quicksave.save.submit")
    assert len(submits) == 4
    persists = sorted(
        (e for e in worker if e["name"] == "quicksave.save.persist"), key=lambda e: e["ts"]
    )
    commits = sorted(
        (e for e in worker if e["name"] == "quicksave.save.commit"), key=lambda e: e["ts"]
    )
    for i, (submit, persist, commit) in enumerate(zip(submits, persists, commits, strict=True)):
        assert persist["args"]["step"] == commit["args"]["step"] == full[i].step
        assert submit <= persist["ts"] + SLACK_US
        assert persist["ts"] + persist["dur"] <= commit["ts"] + SLACK_US
        if i + 1 < len(submits):
            assert commit["ts"] + commit["dur"] <= submits[i + 1] + SLACK_US
