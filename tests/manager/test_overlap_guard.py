"""The default overlapped staging never commits a state that did not exist.

Training loops that write weights outside the optimizers the manager was given: SGD by
hand, a second optimizer, in-place edits (clipping, weight syncs, EMA swaps) right after
``save()``. Each save ends either committed with exactly the values of the moment of
``save()`` or failed with a clear error — never committed with other values.

No timing: the ``held_copies`` fixture holds every background copy until the training
thread next waits for it (``maybe_wait_for_staging``: an optimizer pre-hook, the next
``save()``, ``wait()``, ``close()``), so the writes under test always land before the
copy — the worst case, made certain.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from helpers.compare import snapshot
from quicksave.errors import CheckpointError
from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState, OptimizerState
from quicksave.saving.config import EngineConfig
from quicksave.saving.engine import AsyncSaver
from quicksave.stage.pool import StagingPool

LAYERS = 8
SAVE_AT = 4
GATE_TIMEOUT_S = 60.0  # a copy is never held longer (the test then fails, never hangs)


@pytest.fixture(autouse=True)
def held_copies(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Background copies wait until the training thread asks for them."""
    asked = threading.Event()
    wait_for_staging = AsyncSaver.maybe_wait_for_staging

    def asking(self: AsyncSaver) -> None:
        asked.set()
        try:
            wait_for_staging(self)
        finally:
            asked.clear()

    def held(copy: Callable) -> Callable:
        def copy_when_asked(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread().name == "quicksave-stage":
                asked.wait(GATE_TIMEOUT_S)
            return copy(*args, **kwargs)

        return copy_when_asked

    monkeypatch.setattr(AsyncSaver, "maybe_wait_for_staging", asking)
    monkeypatch.setattr(StagingPool, "stage_many", held(StagingPool.stage_many))
    return asked


class Loop:
    """``LAYERS`` Linear layers; ``registered`` optimizers are the manager's,
    ``others`` step too but the manager does not know them."""

    def __init__(self, kind: str) -> None:
        torch.manual_seed(0)
        random.seed(0)
        self.kind = kind
        self.model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(LAYERS)])
        params = list(self.model.parameters())
        half = len(params) // 2
        self.registered: list[torch.optim.Optimizer] = []
        self.others: list[torch.optim.Optimizer] = []
        if kind in ("inplace_edit", "edit_every_step", "data_write"):
            self.registered = [torch.optim.AdamW(params, lr=0.01)]
        elif kind == "second_optimizer":
            self.registered = [torch.optim.AdamW(params[:half], lr=0.01)]
            self.others = [torch.optim.AdamW(params[half:], lr=0.01)]
        elif kind == "second_fused_optimizer":  # fused kernels bump no version counter
            self.registered = [torch.optim.AdamW(params[:half], lr=0.01)]
            self.others = [torch.optim.AdamW(params[half:], lr=0.01, fused=True)]
        self.x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))

    def states(self) -> dict[str, Any]:
        states: dict[str, Any] = {"model": ModelState(self.model)}
        if self.registered:
            states["optimizer"] = OptimizerState(self.model, self.registered)
        return states

    def step(self) -> None:
        for o in self.registered + self.others:
            o.zero_grad()
        self.model.zero_grad()
        self.model(self.x).square().mean().backward()
        if self.kind == "by_hand":  # SGD written by hand: no torch.optim at all
            with torch.no_grad():
                for p in self.model.parameters():
                    p.sub_(0.01 * p.grad)
            return
        if self.kind == "edit_every_step":  # e.g. a decay applied by hand before each step
            with torch.no_grad():
                for p in self.model.parameters():
                    p.mul_(0.999)
        for o in self.others + self.registered:  # the unknown writer first
            o.step()

    def right_after_save(self) -> None:
        if self.kind == "inplace_edit":
            with torch.no_grad():
                for p in self.model.parameters():
                    p.mul_(0.5)


def differing(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """Names of the tensors (model and optimizer) whose values differ."""
    out: list[str] = []

    def walk(a: Any, b: Any, where: str) -> None:
        if isinstance(a, torch.Tensor):
            if not (isinstance(b, torch.Tensor) and torch.equal(a, b)):
                out.append(where)
        elif isinstance(a, dict):
            for k in a:
                walk(a[k], b.get(k) if isinstance(b, dict) else None, f"{where}.{k}")
        elif isinstance(a, (list, tuple)):
            for i, x in enumerate(a):
                walk(
                    x,
                    b[i] if isinstance(b, (list, tuple)) and i < len(b) else None,
                    f"{where}[{i}]",
                )

    walk(expected, got, "")
    return out


def loaded(folder: Path, kind: str, step: int) -> dict[str, Any]:
    """The states of a fresh ``Loop(kind)`` after loading ``step`` from ``folder``."""
    fresh = Loop(kind)
    fresh_states = fresh.states()
    if fresh.registered:  # optimizer state to load into
        fresh.step()
    config = CheckpointConfig(folder=str(folder), async_mode="disabled")
    with CheckpointManager(config, fresh_states) as reader:
        assert reader.load(step) == step
    return snapshot(fresh_states)


def run(tmp_path: Path, kind: str, mode: str, steps: int = SAVE_AT + 4) -> dict[str, Any]:
    """Train ``steps`` steps with a save every ``SAVE_AT``; the write under test comes
    right after ``save(SAVE_AT)`` returns. Returns what each save's step ended as."""
    loop = Loop(kind)
    states = loop.states()
    config = CheckpointConfig(folder=str(tmp_path / "ckpt"), interval=SAVE_AT, async_mode=mode)
    manager = CheckpointManager(config, states)
    assert config.staging == "overlap"  # the default is what is tested
    expected: dict[int, dict[str, Any]] = {}
    errors: list[CheckpointError] = []
    try:
        for step in range(1, steps + 1):
            loop.step()
            try:
                saved = manager.save(step)
            except CheckpointError as e:
                errors.append(e)
                saved = False
            if step % SAVE_AT == 0:
                assert saved or errors
                expected[step] = snapshot(states)
                loop.right_after_save()
    finally:
        try:
            manager.close()
        except CheckpointError as e:
            errors.append(e)
    committed = manager.committed_steps()
    torn: dict[int, list[str]] = {}
    for step in committed:
        if step not in expected:
            continue
        torn[step] = differing(expected[step], loaded(tmp_path / "ckpt", kind, step))
    return {"committed": committed, "torn": torn, "errors": errors, "expected": set(expected)}


MODES = ["thread", "process"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "kind", ["by_hand", "second_optimizer", "second_fused_optimizer", "edit_every_step"]
)
def test_writers_the_manager_does_not_know_never_land_in_a_checkpoint(
    tmp_path: Path, kind: str, mode: str
) -> None:
    out = run(tmp_path, kind, mode)
    assert out["errors"] == []
    assert out["committed"] == [SAVE_AT, 2 * SAVE_AT]
    assert out["torn"] == {SAVE_AT: [], 2 * SAVE_AT: []}


@pytest.mark.parametrize("mode", MODES)
def test_an_in_place_edit_right_after_save_fails_that_save_and_never_commits_it(
    tmp_path: Path, mode: str
) -> None:
    out = run(tmp_path, "inplace_edit", mode, steps=3 * SAVE_AT)
    # Every parameter was proven written by the optimizer alone (three clean intervals),
    # so step 4 was overlapped; the edit after save() moved their counters: step 4
    # fails, loudly, naming a parameter and the way out.
    assert SAVE_AT not in out["committed"]
    assert len(out["errors"]) == 1
    message = str(out["errors"][0])
    assert f"step {SAVE_AT} was not committed" in message
    assert "model.0.weight" in message and "maybe_wait_for_staging()" in message
    # From then on those tensors are copied inside save(): later saves commit, exact.
    assert out["committed"] == [2 * SAVE_AT, 3 * SAVE_AT]
    assert out["torn"] == {2 * SAVE_AT: [], 3 * SAVE_AT: []}


def test_writes_through_data_are_not_seen_by_the_counters_so_wait_first(tmp_path: Path) -> None:
    """The documented limit: ``p.data`` has a version counter of its own. A loop that
    writes through it must call ``maybe_wait_for_staging()`` first; then the checkpoint
    holds the values of the moment of ``save()``."""
    p = nn.Parameter(torch.ones(4))
    before = p._version
    p.data.mul_(2.0)
    assert p._version == before  # invisible to the guard: hence the rule

    loop = Loop("data_write")
    states = loop.states()
    config = CheckpointConfig(folder=str(tmp_path / "ckpt"), interval=SAVE_AT)
    with CheckpointManager(config, states) as manager:
        for step in range(1, SAVE_AT + 1):
            loop.step()
            manager.save(step)
        expected = snapshot(states)
        manager.maybe_wait_for_staging()
        for q in loop.model.parameters():
            q.data.mul_(0.5)
    assert differing(expected, loaded(tmp_path / "ckpt", "data_write", SAVE_AT)) == []


@pytest.mark.parametrize("mode", MODES)
def test_the_engine_fails_a_save_whose_deferred_tensor_moved(tmp_path: Path, mode: str) -> None:
    """Without the manager: every tensor deferred, one written after save() returned."""
    weights = {f"w{i}": torch.randn(256, 256) for i in range(4)}
    config = EngineConfig(mode=mode, staging="overlap")
    with AsyncSaver(config) as saver:
        handle = saver.save(weights, tmp_path / "a", step=1, deferred=lambda fqn, t: True)
        weights["w2"].add_(1.0)
        with pytest.raises(CheckpointError, match=r"w2.*maybe_wait_for_staging"):
            handle.wait()
        assert not (tmp_path / "a").exists()
        # w2 is copied inside save() from now on; the rest still overlap
        expected = {k: v.clone() for k, v in weights.items()}
        handle = saver.save(weights, tmp_path / "b", step=2, deferred=lambda fqn, t: True)
        weights["w2"].add_(1.0)
        handle.wait()
    from quicksave import load_state

    got = load_state(str(tmp_path / "b"))
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_tensor_written_between_the_step_and_save_is_copied_in_save(tmp_path: Path) -> None:
    """An EMA-style swap after the optimizer step and before ``save()``: the counters
    show it, the moved tensor is copied inside ``save()``, the others still overlap, and
    the save commits the values of its moment."""
    loop = Loop("inplace_edit")
    states = loop.states()
    config = CheckpointConfig(folder=str(tmp_path / "ckpt"), interval=SAVE_AT)
    with CheckpointManager(config, states) as manager:
        for step in range(1, SAVE_AT + 1):
            loop.step()
            if step == SAVE_AT:
                with torch.no_grad():
                    loop.model[0].weight.add_(1.0)  # the swap, outside any step
                deferred = manager.session.writer.deferred()
                assert not deferred("", loop.model[0].weight.detach())
                assert deferred("", loop.model[1].weight.detach())
            manager.save(step)
        expected = snapshot(states)
        loop.step()  # the next step waits for the background copy
    assert manager.committed_steps() == [SAVE_AT]
    assert differing(expected, loaded(tmp_path / "ckpt", "inplace_edit", SAVE_AT)) == []
