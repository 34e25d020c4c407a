"""A restore into a fresh job (a new model and an optimizer that has never stepped)
creates the optimizer's state from the checkpoint, without an optimizer step: every
tensor, param group and type comes back exactly, the optimizer's ``step`` is never
called, and training continues bit-exactly like the uninterrupted run.

(The FSDP2 / DTensor cases on 1 and 2 ranks: tests/multirank/test_restore_fresh_dist.py.)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from tests.helpers.compare import assert_same

import quicksave
from quicksave.errors import CorruptCheckpointError, IncompatibleStateError
from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState, OptimizerState

OPTIMIZERS: dict[str, Callable[[list[dict[str, Any]]], torch.optim.Optimizer]] = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1),
    "adam-amsgrad": lambda groups: torch.optim.Adam(groups, lr=0.01, amsgrad=True),
    "sgd-momentum": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True),
    # no table of optimizers: whatever state the checkpoint holds is created
    "rmsprop-centered": lambda groups: torch.optim.RMSprop(
        groups, lr=0.01, momentum=0.5, centered=True
    ),
    "nadam": lambda groups: torch.optim.NAdam(groups, lr=0.01),
    "rprop": lambda groups: torch.optim.Rprop(groups, lr=0.01),
}

# whose state keys come back in the optimizer's own order (the others: same values)
IN_ORDER = ("adamw", "adam-amsgrad", "sgd-momentum", "rprop")


class Net(nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 3)
        if unused:  # never in the forward: no gradient, so no optimizer state
            self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _job(
    kind: str, seed: int, lr_scale: float = 1.0, unused: bool = False
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and its optimizer: two param groups with their own hyperparameters."""
    torch.manual_seed(seed)
    model = Net(unused)
    groups = [
        {"params": [p for name, p in model.named_parameters() if not name.startswith("head")]},
        {"params": list(model.head.parameters()), "lr": 0.002 * lr_scale},
    ]
    optim = OPTIMIZERS[kind](groups)
    for g in optim.param_groups:
        g["lr"] *= lr_scale
    return model, optim


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
    optim.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    optim.step()


def _states(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}


def _count_steps(optim: torch.optim.Optimizer) -> list[int]:
    calls = [0]
    optim.register_step_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _everything(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's tensors and the optimizer's own state dict (by parameter index:
    state tensors, scalars and param groups as the optimizer holds them)."""
    return {"model": dict(model.state_dict()), "optim": optim.state_dict()}


def _assert_exact(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert_same(got, want)
    for index, entries in want["optim"]["state"].items():
        for key, value in entries.items():
            other = got["optim"]["state"][index][key]
            assert type(other) is type(value), (index, key)
            if isinstance(value, torch.Tensor):
                assert other.shape == value.shape and other.device == value.device, (index, key)
                assert other.stride() == value.stride(), (index, key)


def _trained(
    kind: str, folder: str, steps: int, more: int, unused: bool = False
) -> tuple[dict, list[dict]]:
    """Train ``steps`` steps, save them, then ``more`` steps: the state saved and the
    uninterrupted run's model and optimizer after each later step."""
    model, optim = _job(kind, seed=0, unused=unused)
    with CheckpointManager(
        CheckpointConfig(folder=folder, interval=steps, async_mode="disabled"),
        _states(model, optim),
    ) as manager:
        for step in range(1, steps + 1):
            _step(model, optim, step)
            manager.save(step)
    saved = _plain(_everything(model, optim))
    later = []
    for step in range(steps + 1, steps + more + 1):
        _step(model, optim, step)
        later.append(_plain(_everything(model, optim)))
    return saved, later


def _plain(value: Any) -> Any:
    """A deep copy (tensors cloned) of a nested state."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_a_fresh_job_restores_exactly_without_an_optimizer_step(tmp_path: Path, kind: str) -> None:
    folder = str(tmp_path / "ckpt")
    saved, later = _trained(kind, folder, steps=3, more=2)

    # the fresh job: other weights, other learning rates, no optimizer state
    model, optim = _job(kind, seed=1, lr_scale=3.0)
    calls = _count_steps(optim)
    assert not optim.state
    with CheckpointManager(
        CheckpointConfig(folder=folder, interval=3, async_mode="disabled"), _states(model, optim)
    ) as manager:
        assert manager.load() == 3
    assert calls[0] == 0, "the restore ran an optimizer step"
    _assert_exact(_everything(model, optim), saved)
    if kind in IN_ORDER:  # laid out as the optimizer itself creates its state
        state, want = optim.state_dict()["state"], saved["optim"]["state"]
        assert [(i, list(state[i])) for i in state] == [(i, list(want[i])) for i in want]

    for step, want in enumerate(later, start=4):  # training goes on as if never stopped
        _step(model, optim, step)
        _assert_exact(_everything(model, optim), want)


def test_quicksave_load_of_a_stock_dcp_checkpoint_runs_no_step(tmp_path: Path) -> None:
    model, optim = _job("adamw", seed=0)
    for step in (1, 2):
        _step(model, optim, step)
    saved = _plain(_everything(model, optim))
    states = _states(model, optim)
    dcp.save({k: v.state_dict() for k, v in states.items()}, checkpoint_id=str(tmp_path / "dcp"))

    model, optim = _job("adamw", seed=1, lr_scale=2.0)
    calls = _count_steps(optim)
    quicksave.load(_states(model, optim), str(tmp_path / "dcp"))
    assert calls[0] == 0
    _assert_exact(_everything(model, optim), saved)


def test_an_optimizer_with_state_is_loaded_in_place(tmp_path: Path) -> None:
    """A load into an optimizer that has stepped (an older step, mid-run) fills its
    own tensors: nothing is allocated."""
    folder = str(tmp_path / "ckpt")
    saved, _ = _trained("adamw", folder, steps=2, more=0)
    model, optim = _job("adamw", seed=1)
    _step(model, optim, 7)
    before = {id(t) for s in optim.state.values() for t in s.values()}
    quicksave.load(_states(model, optim), os.path.join(folder, "step-2"))
    assert {id(t) for s in optim.state.values() for t in s.values()} == before
    _assert_exact(_everything(model, optim), saved)


def test_a_failed_restore_leaves_no_uninitialised_state(tmp_path: Path) -> None:
    folder = str(tmp_path / "ckpt")
    _trained("adamw", folder, steps=2, more=0)
    step_dir = os.path.join(folder, "step-2")
    data = sorted(f for f in os.listdir(step_dir) if f.endswith(".safetensors"))[-1]
    with open(os.path.join(step_dir, data), "r+b") as f:  # flip the last byte
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))

    model, optim = _job("adamw", seed=1)
    with pytest.raises(CorruptCheckpointError):
        quicksave.load(_states(model, optim), step_dir)
    assert not optim.state  # never trained with uninitialised moments


def test_a_parameter_without_state_is_restored_without_state(tmp_path: Path) -> None:
    """A parameter that never had a gradient has no optimizer state in the checkpoint;
    the restore creates none for it (a zero-gradient step would, and a strict load
    would then miss it in the checkpoint), and training goes on exactly."""
    folder = str(tmp_path / "ckpt")
    saved, later = _trained("adamw", folder, steps=2, more=1, unused=True)
    model, optim = _job("adamw", seed=1, unused=True)
    with CheckpointManager(
        CheckpointConfig(folder=folder, interval=2, async_mode="disabled"), _states(model, optim)
    ) as manager:
        assert manager.load() == 2
    assert all(p not in optim.state for p in model.unused.parameters())
    _assert_exact(_everything(model, optim), saved)
    _step(model, optim, 3)
    _assert_exact(_everything(model, optim), later[0])


def test_the_optimizer_holds_the_tensors_the_checkpoint_was_read_into(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No second copy: the tensors allocated before the read are the optimizer's state
    after ``load_state_dict``."""
    import quicksave.manager.states as states_module

    folder = str(tmp_path / "ckpt")
    _trained("adam-amsgrad", folder, steps=2, more=0)
    allocated: dict[int, torch.Tensor] = {}
    allocate = states_module.allocate_optimizer_state

    def spy(model, optimizer, stored, prefix, local=False):  # type: ignore[no-untyped-def]
        undo = allocate(model, optimizer, stored, prefix, local)
        for entry in optimizer.state.values():
            allocated.update({id(v): v for v in entry.values() if isinstance(v, torch.Tensor)})
        return undo

    monkeypatch.setattr(states_module, "allocate_optimizer_state", spy)
    model, optim = _job("adam-amsgrad", seed=1)
    quicksave.load(_states(model, optim), os.path.join(folder, "step-2"))
    held = [v for entry in optim.state.values() for v in entry.values()]
    # step, exp_avg, exp_avg_sq, max_exp_avg_sq of every parameter
    assert len(held) == 4 * len(list(model.parameters()))
    assert all(id(v) in allocated for v in held)


def test_a_per_rank_state_refusing_the_checkpoint_takes_the_allocated_state_back(
    tmp_path: Path,
) -> None:
    """The checkpoint's per-rank entries were saved by 2 ranks; a 1-rank job with
    ``PerRank(on_resize="error")`` refuses it before any read, after the optimizer
    (earlier in the states) was given state: that state is taken back."""

    class Position:
        def __init__(self) -> None:
            self.batches = 0

        def state_dict(self) -> dict[str, Any]:
            return {"batches": self.batches}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.batches = int(state_dict["batches"])

    model, optim = _job("adamw", seed=0)
    _step(model, optim, 1)
    saved = {k: v.state_dict() for k, v in _states(model, optim).items()}
    saved["dataloader"] = {"rank_0": {"batches": 3}, "rank_1": {"batches": 4}}
    quicksave.save(saved, str(tmp_path / "ckpt" / "step-1"))

    model, optim = _job("adamw", seed=1)
    states = {**_states(model, optim), "dataloader": quicksave.PerRank(Position())}
    config = CheckpointConfig(folder=str(tmp_path / "ckpt"), async_mode="disabled")
    with CheckpointManager(config, states) as manager:
        with pytest.raises(IncompatibleStateError, match="saved by 2 ranks"):
            manager.load(1)
    assert not optim.state


def test_a_load_reads_the_manifest_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-rank states (the RNG) learn the checkpoint's entries from the metadata the
    load reads anyway: one read and parse of the manifest per load (it was two)."""
    import quicksave.loading.reader as reader_module
    from quicksave.manager import RNGState

    folder = str(tmp_path / "ckpt")
    model, optim = _job("adamw", seed=0)
    _step(model, optim, 1)
    config = CheckpointConfig(folder=folder, async_mode="disabled")
    with CheckpointManager(config, {**_states(model, optim), "rng": RNGState()}) as manager:
        manager.save(1, force=True)

    reads = [0]
    read = reader_module.read_manifest

    def counting(*args: Any, **kwargs: Any) -> Any:
        reads[0] += 1
        return read(*args, **kwargs)

    monkeypatch.setattr(reader_module, "read_manifest", counting)
    model, optim = _job("adamw", seed=1)
    with CheckpointManager(config, {**_states(model, optim), "rng": RNGState()}) as manager:
        reads[0] = 0
        assert manager.load() == 1
    assert reads[0] == 1


def test_a_large_moment_is_page_aligned_memory_of_its_own(tmp_path: Path) -> None:
    """A moment of a megabyte or more is allocated on a page (a cold load reads it
    straight in with O_DIRECT): a plain tensor, its storage exactly its bytes, holding
    the saved values; the job trains on exactly like the one that saved."""
    from quicksave.storage.cold_read import ALIGN

    torch.manual_seed(0)
    model = nn.Linear(1024, 512)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    x = torch.randn(2, 1024)
    model(x).square().sum().backward()
    optim.step()
    quicksave.save(_states(model, optim), tmp_path / "ck")
    fresh = nn.Linear(1024, 512)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    quicksave.load(_states(fresh, fresh_optim), tmp_path / "ck")
    _assert_exact(_everything(fresh, fresh_optim), _everything(model, optim))
    for key in ("exp_avg", "exp_avg_sq"):
        t = fresh_optim.state[fresh.weight][key]
        assert type(t) is torch.Tensor and t._base is None, key
        assert t.data_ptr() % ALIGN == 0 and t.storage_offset() == 0, key
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), key
    for m, o in ((model, optim), (fresh, fresh_optim)):
        o.zero_grad()
        m(x).square().sum().backward()
        o.step()
    _assert_exact(_everything(fresh, fresh_optim), _everything(model, optim))
