"""CheckpointManager in its async modes (thread and process), with overlapped staging.

Ordering is made deterministic with gates, never with sleeps or timing assertions:
``stage_gate`` holds the background staging thread before each copy, ``write_gates``
hold the thread-mode writer before it writes a given step.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from helpers.compare import assert_same, snapshot
from quicksave.errors import CheckpointError
from quicksave.manager import (
    CheckpointConfig,
    CheckpointManager,
    ModelState,
    OptimizerState,
    RNGState,
    SaveRecord,
    TrainState,
)
from quicksave.stage.pool import StagingPool
from quicksave.worker import persisters
from quicksave.worker.job import JobResult, PersistJob

GATE_TIMEOUT_S = 60.0


class Counter:
    """A resumable data position (a plain ``Stateful``)."""

    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pos = state_dict["pos"]


class Job:
    """A small model with BatchNorm (buffers change in forward), AdamW, a scheduler."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        random.seed(seed)
        self.model = nn.Sequential(
            nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)
        )
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=0.05)
        self.sched = torch.optim.lr_scheduler.StepLR(self.optim, step_size=2, gamma=0.7)
        self.data = Counter()
        self.train_state = TrainState()
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(64, 6, generator=g)
        self.y = torch.randn(64, 3, generator=g)

    def states(self) -> dict[str, Any]:
        return {
            "model": ModelState(self.model),
            "optimizer": OptimizerState(self.model, self.optim),
            "lr_scheduler": self.sched,
            "dataloader": self.data,
            "train_state": self.train_state,
            "rng": RNGState(),
        }

    def forward_backward(self) -> float:
        i = (self.data.pos * 8) % 64
        self.data.pos += 1
        x = self.x[i : i + 8] + 0.01 * torch.randn(8, 6)  # draws from the RNG
        loss = ((self.model(x) - self.y[i : i + 8]) ** 2).mean()
        self.optim.zero_grad()
        loss.backward()
        return loss.item()

    def step(self, loss: float) -> None:
        self.optim.step()
        self.sched.step()
        self.train_state.step += 1
        self.train_state.losses.append(loss)
        self.train_state.log_steps.append(self.train_state.step)

    def train_step(self) -> None:
        self.step(self.forward_backward())


def make(folder: Path, states: dict[str, Any], **config: Any) -> CheckpointManager:
    config = {"async_mode": "thread", **config}
    return CheckpointManager(CheckpointConfig(folder=str(folder), **config), states)


def deferred_ptrs(job: Job) -> set[int]:
    ptrs = {p.data_ptr() for p in job.model.parameters()}
    for state in job.optim.state.values():
        ptrs.update(v.data_ptr() for v in state.values() if isinstance(v, torch.Tensor))
    return ptrs


class StageGate:
    """Holds the background staging thread before each copy until ``release()``."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.calls: list[tuple[str, int]] = []  # (thread name, source data_ptr)
        self.lock = threading.Lock()

    def release(self) -> None:
        self.opened.set()

    def background(self) -> set[int]:
        with self.lock:
            return {ptr for name, ptr in self.calls if name == "quicksave-stage"}


@pytest.fixture
def stage_gate(monkeypatch: pytest.MonkeyPatch) -> StageGate:
    gate = StageGate()
    original = StagingPool.stage_many  # every copy into a pool goes through it or copy_views

    def stage_many(self: StagingPool, items, digests=None, *, non_blocking=False):  # noqa: ANN001
        name = threading.current_thread().name
        if name == "quicksave-stage":
            assert gate.opened.wait(GATE_TIMEOUT_S)
        later = original(self, items, digests, non_blocking=non_blocking)
        with gate.lock:
            gate.calls += [(name, src.data_ptr()) for *_, src in items]
        return later

    copy_views = StagingPool.copy_views  # the copies without hashing (steady saves)

    def copy_views_gated(self: StagingPool, views, sources, *, non_blocking=False):  # noqa: ANN001
        name = threading.current_thread().name
        if name == "quicksave-stage":
            assert gate.opened.wait(GATE_TIMEOUT_S)
        copy_views(self, views, sources, non_blocking=non_blocking)
        with gate.lock:
            gate.calls += [(name, src.data_ptr()) for src in sources]

    monkeypatch.setattr(StagingPool, "stage_many", stage_many)
    monkeypatch.setattr(StagingPool, "copy_views", copy_views_gated)
    return gate


@pytest.fixture
def write_gates(monkeypatch: pytest.MonkeyPatch) -> dict[int, threading.Event]:
    """Thread mode: the writer of step N waits until ``write_gates[N]`` is set."""
    gates: dict[int, threading.Event] = defaultdict(threading.Event)
    original = persisters.execute_job

    def gated(job: PersistJob, pool: memoryview, *rest: object) -> JobResult:
        assert gates[job.step].wait(GATE_TIMEOUT_S)
        return original(job, pool, *rest)

    monkeypatch.setattr(persisters, "execute_job", gated)
    return gates


def release_later(event: threading.Event, delay: float = 0.2) -> threading.Timer:
    timer = threading.Timer(delay, event.set)
    timer.start()
    return timer


@pytest.fixture
def closing() -> Iterator[list[CheckpointManager]]:
    """Managers appended here are closed at the end even if the test fails."""
    managers: list[CheckpointManager] = []
    yield managers
    for m in managers:
        try:
            m.close()
        except CheckpointError:
            pass


# ---------------------------------------------------------------- overlapped staging


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_overlap_writes_the_values_of_the_moment_of_save_while_training_goes_on(
    tmp_path: Path, mode: str, stage_gate: StageGate, closing: list
) -> None:
    job = Job(seed=0)
    states = job.states()
    manager = make(tmp_path / "ckpt", states, interval=3, async_mode=mode)
    closing.append(manager)
    for _ in range(3):
        job.train_step()
    deferred = deferred_ptrs(job)
    assert manager.save(3)  # returns at once: the background copy is held by the gate
    expected = snapshot(states)
    assert stage_gate.background() == set()
    buffers = {b.data_ptr() for b in job.model.buffers()}
    assert buffers <= {ptr for _, ptr in stage_gate.calls}  # copied in save() itself
    bn_mean = job.model[1].running_mean.clone()

    loss = job.forward_backward()  # mutates BatchNorm statistics: they were copied in save()
    assert not torch.equal(job.model[1].running_mean, bn_mean)
    stage_gate.release()
    job.step(loss)  # the pre-hook waits for the copy of parameters and moments
    assert stage_gate.background() == deferred  # parameters and moments, nothing else
    for _ in range(4):
        job.train_step()
        manager.save(job.train_state.step)
    manager.close()
    assert manager.committed_steps() == [3, 6]
    assert not torch.equal(job.model[0].weight, expected["model"]["0.weight"])  # trained on

    fresh = Job(seed=7)
    fresh_states = fresh.states()
    with make(tmp_path / "ckpt", fresh_states, async_mode="disabled") as reader:
        assert reader.load(3) == 3
    assert_same(snapshot(fresh_states), expected)


def test_the_optimizer_pre_hook_waits_for_the_background_copy(
    tmp_path: Path, stage_gate: StageGate, closing: list
) -> None:
    job = Job(seed=0)
    manager = make(tmp_path / "ckpt", job.states(), interval=1)
    closing.append(manager)
    for _ in range(2):  # a whole interval between steps: parameters and moments proven
        job.train_step()
    deferred = deferred_ptrs(job)
    manager.save(2)
    saver = manager.session.writer.saver
    waiting = threading.Event()
    wait_for_staging = saver.maybe_wait_for_staging

    def entered_then_wait() -> None:
        waiting.set()
        wait_for_staging()

    saver.maybe_wait_for_staging = entered_then_wait  # what the manager's hook calls
    # The copy may proceed only once the optimizer step is inside the manager's hook.
    opener = threading.Thread(target=lambda: waiting.wait(GATE_TIMEOUT_S) and stage_gate.release())
    opener.start()
    seen_by_step: list[set[int]] = []
    # Registered after the manager's hook, so it runs after it, just before the update.
    job.optim.register_step_pre_hook(lambda *_: seen_by_step.append(stage_gate.background()))
    loss = job.forward_backward()
    assert stage_gate.background() == set()
    job.step(loss)  # blocks in the manager's pre-hook until the gate opens and copies finish
    opener.join()
    assert seen_by_step == [deferred]
    manager.close()
    assert manager.metrics[0].status == "committed"


def test_maybe_wait_for_staging_is_there_for_custom_loops(
    tmp_path: Path, stage_gate: StageGate, closing: list
) -> None:
    job = Job(seed=0)
    manager = make(tmp_path / "ckpt", job.states(), interval=1)
    closing.append(manager)
    for _ in range(2):
        job.train_step()
    deferred = deferred_ptrs(job)
    manager.save(2)
    assert stage_gate.background() == set()
    timer = release_later(stage_gate.opened)
    manager.maybe_wait_for_staging()
    timer.join()
    assert stage_gate.background() == deferred
    with torch.no_grad():  # safe now: the copy is done
        job.model[0].weight.zero_()
    manager.close()
    fresh = Job(seed=3)
    with make(tmp_path / "ckpt", fresh.states()) as reader:
        assert reader.load() == 2
    assert fresh.model[0].weight.abs().sum() > 0


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_blocking_staging_copies_everything_before_save_returns(
    tmp_path: Path, mode: str, stage_gate: StageGate, closing: list
) -> None:
    job = Job(seed=0)
    states = job.states()
    manager = make(tmp_path / "ckpt", states, interval=2, staging="blocking", async_mode=mode)
    closing.append(manager)
    for _ in range(2):
        job.train_step()
    manager.save(2)
    expected = snapshot(states)
    names = {name for name, _ in stage_gate.calls}
    assert names == {threading.current_thread().name}  # no background copy at all
    assert deferred_ptrs(job) <= {ptr for _, ptr in stage_gate.calls}
    with torch.no_grad():  # nothing waits for a hook: the values are already staged
        for p in job.model.parameters():
            p.add_(1.0)
    manager.close()
    fresh = Job(seed=5)
    fresh_states = fresh.states()
    with make(tmp_path / "ckpt", fresh_states, async_mode="disabled") as reader:
        assert reader.load() == 2
    assert_same(snapshot(fresh_states), expected)


# ---------------------------------------------------------------- modes and metrics


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_each_save_reports_its_costs(
    tmp_path: Path, mode: str, caplog: pytest.LogCaptureFixture, closing: list
) -> None:
    job = Job(seed=0)
    manager = make(tmp_path / "ckpt", job.states(), interval=2, async_mode=mode)
    closing.append(manager)
    saver = manager.session.writer.saver
    if mode == "process":
        assert saver.worker_pid is not None and saver.worker_pid != os.getpid()
    with caplog.at_level(logging.INFO, logger="quicksave"):
        for _ in range(4):
            job.train_step()
            manager.save(job.train_state.step)
        assert all(isinstance(r, SaveRecord) for r in manager.metrics)
        assert [r.step for r in manager.metrics] == [2, 4]
        manager.close()
    assert manager.committed_steps() == [2, 4]
    for r in manager.metrics:
        assert r.status == "committed" and r.mode == mode and r.kind == "full"
        assert r.path == str(tmp_path / "ckpt" / f"step-{r.step}")
        data = [f for f in os.listdir(r.path) if f.endswith(".safetensors")]
        assert r.bytes == sum(os.path.getsize(os.path.join(r.path, f)) for f in data)
        assert 0 < r.blocking_s <= r.durable_s
        assert r.staging_s is not None and r.staging_s <= r.durable_s
        assert r.write_s is not None and r.write_s > 0
        assert r.commit_s is not None and r.commit_s > 0
        assert (
            f"committed full checkpoint of step {r.step} to {r.path} ({mode}): {r.bytes} bytes, "
            f"blocking {r.blocking_s:.3f} s, staging {r.staging_s:.3f} s, durable "
            f"{r.durable_s:.3f} s (write {r.write_s:.3f} s, commit {r.commit_s:.3f} s)"
        ) in caplog.text


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_the_staging_pool_is_built_before_the_first_save(
    tmp_path: Path, mode: str, closing: list
) -> None:
    job = Job(seed=0)
    manager = make(tmp_path / "ckpt", job.states(), interval=3, async_mode=mode)
    closing.append(manager)
    saver = manager.session.writer.saver
    # AdamW's state does not exist yet, but its first step's layout is known: the pool
    # is built at construction from it (an unknown optimizer's first step post-hook
    # prepares instead: tests/manager/test_first_save_pool.py)
    slot = saver._slots[0]
    pool = slot.pool
    assert pool is not None and slot.pool_id in saver._worker.mapped  # built, and in the worker
    job.train_step()  # the first optimizer step: the real state is the predicted one
    saver.wait_prepared()
    assert slot.pool is pool
    assert pool.nbytes >= sum(p.numel() * 4 * 3 for p in job.model.parameters())
    job.train_step()
    job.train_step()
    manager.save(3)  # the first save stages into the pool built ahead: no allocation
    assert slot.pool is pool and slot.busy is not None
    job.train_step()
    manager.close()
    assert manager.metrics[0].status == "committed"


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_complete_state_gets_its_pool_at_start_up(
    tmp_path: Path, mode: str, closing: list
) -> None:
    # Optimizer state exists when the manager is built (a step was taken): the pool is
    # built before the constructor returns, so no training step pays for it.
    job = Job(seed=0)
    job.train_step()
    manager = make(tmp_path / "ckpt", job.states(), interval=2, async_mode=mode)
    closing.append(manager)
    saver = manager.session.writer.saver
    assert saver._preparer.thread is None  # nothing left running in the background
    slot = saver._slots[0]
    assert slot.pool is not None and slot.pool_id in saver._worker.mapped
    pool = slot.pool
    job.train_step()
    assert manager.save(2)
    assert slot.pool is pool
    manager.close()
    # A resumed job: no optimizer state yet, but AdamW's is known: the pool is built at
    # construction; load() fills the state with that layout, and the pool is kept.
    job2 = Job(seed=1)
    resumed = make(tmp_path / "ckpt", job2.states(), interval=2, async_mode=mode)
    closing.append(resumed)
    built = resumed.session.writer.saver._slots[0].pool
    assert built is not None
    assert resumed.load() == 2
    assert resumed.session.writer.saver._slots[0].pool is built


def test_without_optimizers_the_pool_is_built_at_start_up(tmp_path: Path, closing: list) -> None:
    model = nn.Linear(8, 8)
    manager = make(tmp_path / "ckpt", {"model": ModelState(model)}, interval=2)
    closing.append(manager)
    saver = manager.session.writer.saver
    pool = saver._slots[0].pool
    assert pool is not None
    assert not manager.save(1)
    assert manager.save(2)
    assert saver._slots[0].pool is pool
    manager.close()
    assert manager.committed_steps() == [2]


# ---------------------------------------------------------------- retention, close, load


def test_retention_never_deletes_a_save_in_flight(
    tmp_path: Path, write_gates: dict[int, threading.Event], closing: list
) -> None:
    folder = tmp_path / "ckpt"
    job = Job(seed=0)
    manager = make(folder, job.states(), interval=100, keep_latest_k=1, max_in_flight=2)
    closing.append(manager)
    for step in (1, 2):
        job.train_step()
        assert manager.save(step, force=True)
    assert manager.session.in_flight == {1, 2}
    assert [r.status for r in manager.metrics] == ["in_flight", "in_flight"]
    assert manager.committed_steps() == [] and manager.latest_step() is None

    write_gates[1].set()
    while 1 in manager.session.in_flight:  # each save() call finalizes without waiting
        manager.save(3)
    manager.session.housekeep(wait=True)  # (retention runs in the housekeeping thread)
    assert manager.committed_steps() == [1] and manager.session.in_flight == {2}

    write_gates[2].set()
    while manager.session.in_flight:  # each save() call finalizes without waiting
        manager.save(4)
    manager.session.housekeep(wait=True)
    assert manager.committed_steps() == [2]  # the newer commit let retention drop step 1
    assert [r.status for r in manager.metrics] == ["committed", "committed"]


def test_a_published_step_not_yet_finalized_counts_as_in_flight(
    tmp_path: Path, write_gates: dict[int, threading.Event], closing: list
) -> None:
    class DeleteEverything:
        def to_delete(self, committed_steps: list[int], in_flight: set[int]) -> list[int]:
            return list(committed_steps)

    folder = tmp_path / "ckpt"
    job = Job(seed=0)
    manager = CheckpointManager(
        CheckpointConfig(folder=str(folder), interval=100, async_mode="thread", max_in_flight=2),
        job.states(),
        retention=DeleteEverything(),
    )
    closing.append(manager)
    job.train_step()
    write_gates[10].set()
    manager.save(10, force=True)
    while manager.session.in_flight:
        manager.save(11)
    manager.save(2, force=True)  # held
    write_gates[1].set()
    manager.save(1, force=True)  # written and published, but not finalized yet
    while not (folder / "step-1").exists():
        threading.Event().wait(0.01)
    assert manager.session.in_flight == {1, 2}
    manager.session.retain(protect=set())  # the policy asks for everything; in flight stays
    assert sorted(os.listdir(folder)) == [".quicksave-lock", "step-1", "step-10"]
    write_gates[2].set()
    manager.close()  # both commit; now the policy may have steps 1 and 2, never the newest
    assert sorted(os.listdir(folder)) == ["step-10"]


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_close_waits_for_saves_in_flight(
    tmp_path: Path, mode: str, write_gates: dict[int, threading.Event]
) -> None:
    job = Job(seed=0)
    manager = make(tmp_path / "ckpt", job.states(), interval=1, async_mode=mode)
    job.train_step()
    write_gates[1].clear()  # thread mode: held until the timer; process mode: not gated
    assert manager.save(1)
    assert manager.metrics[0].status == "in_flight"
    timer = release_later(write_gates[1])
    manager.close()
    timer.join()
    assert manager.committed_steps() == [1]
    assert manager.metrics[0].status == "committed"
    with pytest.raises(CheckpointError, match="this CheckpointManager is closed"):
        manager.save(2)


def test_load_waits_for_saves_in_flight_and_sees_only_committed(
    tmp_path: Path, write_gates: dict[int, threading.Event], closing: list
) -> None:
    job = Job(seed=0)
    states = job.states()
    manager = make(tmp_path / "ckpt", states, interval=2)
    closing.append(manager)
    for _ in range(2):
        job.train_step()
    manager.save(2)
    expected = snapshot(states)
    assert manager.latest_step() is None  # in flight is not committed
    job.train_step()
    timer = release_later(write_gates[2])
    assert manager.load() == 2  # waited for step 2, then restored it
    timer.join()
    assert_same(snapshot(states), expected)


def test_seed_and_export_are_written_after_the_saves_in_flight(
    tmp_path: Path, write_gates: dict[int, threading.Event], closing: list
) -> None:
    folder = tmp_path / "ckpt"
    job = Job(seed=0)
    manager = make(folder, job.states(), interval=2, last_step=4, export_dtype="bfloat16")
    closing.append(manager)
    assert manager.save(0)  # seed: synchronous
    assert manager.committed_steps() == [0] and manager.metrics[0].mode == "disabled"
    for _ in range(2):
        job.train_step()
    manager.save(2)
    for _ in range(2):
        job.train_step()
    timers = [release_later(write_gates[2]), release_later(write_gates[4], 0.4)]
    assert manager.save(4)  # full (async), then the export, after both full saves commit
    for t in timers:
        t.join()
    assert manager.committed_steps() == [0, 2, 4]
    assert (folder / "export-step-4" / "manifest.json").exists()
    assert [(r.step, r.kind, r.status) for r in manager.metrics] == [
        (0, "seed", "committed"),
        (2, "full", "committed"),
        (4, "full", "committed"),
        (4, "export", "committed"),
    ]


def test_backpressure_skip_skips_while_the_previous_save_is_in_flight(
    tmp_path: Path,
    write_gates: dict[int, threading.Event],
    caplog: pytest.LogCaptureFixture,
    closing: list,
) -> None:
    job = Job(seed=0)
    manager = make(tmp_path / "ckpt", job.states(), interval=100, backpressure="skip")
    closing.append(manager)
    job.train_step()
    assert manager.save(1, force=True)
    job.train_step()
    with caplog.at_level(logging.WARNING, logger="quicksave"):
        assert not manager.save(2, force=True)
    assert "skipped the save of step 2" in caplog.text
    write_gates[1].set()
    write_gates[3].set()
    job.train_step()
    while manager.session.in_flight:  # each save() call finalizes without waiting
        manager.save(50)
    assert manager.save(3, force=True)
    manager.close()
    assert manager.committed_steps() == [1, 3]
    assert [r.step for r in manager.metrics] == [1, 3]


# ---------------------------------------------------------------- failures


def _break_folder(folder: Path) -> Path:
    """Replace the checkpoint folder by a file: the writer cannot create anything."""
    aside = folder.with_name("aside")
    os.rename(folder, aside)
    folder.write_text("not a folder")
    return aside


def _repair_folder(folder: Path, aside: Path) -> None:
    folder.unlink()
    os.rename(aside, folder)


def test_a_failed_save_surfaces_at_a_later_save_and_the_next_save_works(
    tmp_path: Path, closing: list
) -> None:
    folder = tmp_path / "ckpt"
    job = Job(seed=0)
    manager = make(folder, job.states(), interval=100)
    closing.append(manager)
    job.train_step()
    aside = _break_folder(folder)
    assert manager.save(1, force=True)  # staged and handed over; the writer fails later
    with pytest.raises(CheckpointError) as info:
        for _ in range(1000):  # a few calls at most: each one finalizes without waiting
            manager.save(2)
            threading.Event().wait(0.01)
    assert "Not a directory" in str(info.value)
    assert str(folder / "step-1") in str(info.value) and info.value.rank == 0
    assert manager.metrics[0].status == "failed"
    _repair_folder(folder, aside)
    assert not manager.save(2)  # reported once: this call is quiet again
    job.train_step()
    assert manager.save(3, force=True)
    manager.close()
    assert manager.committed_steps() == [3]
    assert [r.status for r in manager.metrics] == ["failed", "committed"]


def test_a_failed_save_surfaces_at_close_in_process_mode(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    job = Job(seed=0)
    manager = make(folder, job.states(), interval=100, async_mode="process")
    job.train_step()
    aside = _break_folder(folder)
    assert manager.save(1, force=True)
    with pytest.raises(CheckpointError) as info:
        manager.close()
    assert "Not a directory" in str(info.value) and info.value.rank == 0
    assert manager.metrics[0].status == "failed"
    _repair_folder(folder, aside)
    # nothing half-written became visible (the lease file was away when it was released)
    assert os.listdir(folder) == [".quicksave-lock"]


# ---------------------------------------------------------------- resume


def test_resume_with_process_mode_continues_bit_exactly(tmp_path: Path) -> None:
    reference = Job(seed=0)
    for _ in range(10):
        reference.train_step()

    first = Job(seed=0)
    manager = make(tmp_path / "ckpt", first.states(), interval=3, async_mode="process")
    for _ in range(7):  # saves at 3 and 6 in the background; step 7 is lost
        first.train_step()
        manager.save(first.train_state.step)
    manager.close()

    second = Job(seed=42)  # other weights: everything must come from the checkpoint
    torch.manual_seed(999)
    manager = make(tmp_path / "ckpt", second.states(), interval=3, async_mode="process")
    assert manager.load() == 6
    while second.train_state.step < 10:
        second.train_step()
        manager.save(second.train_state.step)
    manager.close()

    assert second.train_state.losses == reference.train_state.losses
    assert_same(second.model.state_dict(), reference.model.state_dict())
    assert_same(second.optim.state_dict(), reference.optim.state_dict())
    assert second.sched.state_dict() == reference.sched.state_dict()
    assert manager.committed_steps() == [3, 6, 9]


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"async_mode": "async"}, "async_mode must be one of 'disabled', 'thread', 'process', "
         "got 'async'"),
        ({"staging": "lazy"}, "staging must be one of 'overlap', 'blocking', got 'lazy'"),
        ({"backpressure": "drop"}, "backpressure must be one of 'wait', 'skip', got 'drop'"),
        ({"max_in_flight": 0}, "max_in_flight must be an integer >= 1, got 0"),
        ({"worker_timeout_s": 0}, "worker_timeout_s must be a positive number of seconds, got 0"),
        ({"close_timeout_s": float("inf")},
         "close_timeout_s must be a positive number of seconds, got inf"),
    ],
)  # fmt: skip
def test_bad_async_config_values(tmp_path: Path, config: dict[str, Any], message: str) -> None:
    with pytest.raises(CheckpointError) as info:
        CheckpointConfig(folder=str(tmp_path), **config)
    assert str(info.value) == message


def test_the_engine_config_is_built_from_the_manager_config(tmp_path: Path) -> None:
    config = CheckpointConfig(
        folder=str(tmp_path),
        thread_count=3,
        backpressure="skip",
        max_in_flight=2,
        worker_timeout_s=7,
        save_timeout_s=60,
        close_timeout_s=9,
    )
    assert (config.async_mode, config.staging) == ("process", "overlap")  # the defaults
    engine = config.engine_config()
    assert (engine.mode, engine.staging, engine.thread_count) == ("process", "overlap", 3)
    assert (engine.backpressure, engine.max_in_flight, engine.close_timeout_s) == ("skip", 2, 9)
    assert (engine.worker.worker_timeout_s, engine.worker.save_timeout_s) == (7, 60)
    with pytest.raises(CheckpointError, match="saves synchronously: no engine"):
        CheckpointConfig(folder=str(tmp_path), async_mode="disabled").engine_config()
