"""A manager built before the optimizer's first step (as real loops do) builds its
staging pool at construction from the state that first step will create, and the first
save finds it ready (issue 20, point 9). Checked by counting pool builds, never by timing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import quicksave.saving.in_flight as in_flight
from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState, OptimizerState
from quicksave.manager.optimizer_layout import first_step_state, matches, stand_ins
from quicksave.stage.pool import StagingPool

OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "adamw-two-groups": lambda ps: torch.optim.AdamW(
        [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}], lr=1e-2
    ),
}


class _Net(nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 8))
        self.spare = nn.Linear(8, 8) if unused else None  # never used: never a gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _job(name: str, unused: bool = False):
    torch.manual_seed(0)
    model = _Net(unused)
    optim = OPTIMIZERS[name](list(model.parameters()))
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))

    def step() -> None:
        optim.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optim.step()

    return model, optim, step


class _Counting(StagingPool):
    built = 0

    def __init__(self, *args, **kwargs) -> None:
        type(self).built += 1
        super().__init__(*args, **kwargs)


@pytest.fixture
def pools(monkeypatch: pytest.MonkeyPatch) -> type[_Counting]:
    counting = type("Counting", (_Counting,), {"built": 0})
    monkeypatch.setattr(in_flight, "StagingPool", counting)
    return counting


def _manager(folder: Path, model: nn.Module, optim, mode: str = "thread") -> CheckpointManager:
    states = {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}
    config = CheckpointConfig(folder=str(folder), interval=2, async_mode=mode, staging="overlap")
    return CheckpointManager(config, states)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_predicted_first_step_state_is_the_real_one(name: str) -> None:
    _, optim, step = _job(name)
    predicted = first_step_state(optim)
    assert predicted is not None
    assert not optim.state  # predicting creates nothing
    step()
    assert matches([optim], [predicted])
    for (p, specs), (q, values) in zip(predicted, optim.state.items(), strict=True):
        assert p is q
        assert [s.key for s in specs] == list(values)
        assert [(s.shape, s.dtype) for s in specs] == [
            (tuple(v.shape), v.dtype) for v in values.values()
        ]


def test_unknown_optimizers_and_stateless_sgd_are_not_predicted() -> None:
    model = nn.Linear(4, 4)

    class MyAdam(torch.optim.AdamW):  # a subclass may create other state
        pass

    assert first_step_state(torch.optim.RMSprop(model.parameters())) is None
    assert first_step_state(MyAdam(model.parameters())) is None
    assert first_step_state(torch.optim.SGD(model.parameters(), lr=0.1)) is None  # no state
    _, optim, step = _job("adamw")
    step()
    assert first_step_state(optim) is None  # it holds state already


def test_stand_ins_leave_the_optimizer_as_it_was_even_on_error() -> None:
    _, optim, _ = _job("adamw")
    with pytest.raises(RuntimeError, match="boom"):
        with stand_ins([optim]) as predicted:
            assert predicted is not None and len(optim.state) == 6  # 3 layers × (w, b)
            sizes = [
                v.untyped_storage().nbytes() for st in optim.state.values() for v in st.values()
            ]
            assert max(sizes) <= 8  # zero-stride views of one zero: no memory per tensor
            raise RuntimeError("boom")
    assert not optim.state and type(optim.state).__name__ == "defaultdict"
    with stand_ins([optim, torch.optim.RMSprop(nn.Linear(2, 2).parameters())]) as predicted:
        assert predicted is None and not optim.state  # one unknown: nothing lent


def test_a_wrong_guess_is_caught_by_matches() -> None:
    _, optim, step = _job("adamw", unused=True)
    predicted = first_step_state(optim)
    step()  # the spare layer gets no gradient, hence no state
    assert predicted is not None and not matches([optim], [predicted])


@pytest.mark.parametrize("name", ["adamw", "adam-amsgrad", "sgd-momentum", "adamw-two-groups"])
@pytest.mark.parametrize("mode", ["thread", "process"])
def test_the_first_save_uses_the_pool_built_at_construction(
    tmp_path: Path, pools: type[_Counting], name: str, mode: str
) -> None:
    model, optim, step = _job(name)
    manager = _manager(tmp_path, model, optim, mode)
    try:
        assert pools.built == 1  # at construction, before any optimizer step
        assert not optim.state  # the stand-ins are gone
        pool = manager.session.writer.saver._slots[0].pool
        for i in range(1, 7):
            step()
            manager.save(i)
            if i == 2:
                expected = {k: v.clone() for k, v in _flat(model, optim).items()}
        manager.wait(60)
        assert pools.built == 1  # no save built another one
        assert manager.session.writer.saver._slots[0].pool is pool
        assert [r.status for r in manager.metrics] == ["committed"] * 3
    finally:
        manager.close()
    model2, optim2, _ = _job(name)
    fresh = CheckpointManager(
        CheckpointConfig(folder=str(tmp_path), async_mode="disabled"),
        {"model": ModelState(model2), "optimizer": OptimizerState(model2, optim2)},
    )
    try:
        assert fresh.load(2) == 2
    finally:
        fresh.close()
    restored = _flat(model2, optim2)
    assert list(restored) == list(expected)
    for k, v in expected.items():
        assert torch.equal(restored[k], v), k


def test_a_wrong_guess_is_planned_again_after_the_first_step(
    tmp_path: Path, pools: type[_Counting]
) -> None:
    model, optim, step = _job("adamw", unused=True)
    manager = _manager(tmp_path, model, optim)
    try:
        assert pools.built == 1
        step()  # the spare layer has no state: planned again, in the background
        manager.session.writer.saver.wait_prepared()
        assert pools.built == 2
        step()
        manager.save(2)
        manager.wait(60)
        assert pools.built == 2  # the first save found the right pool
        assert manager.metrics[0].status == "committed"
    finally:
        manager.close()


def test_an_unknown_optimizer_prepares_after_its_first_step(
    tmp_path: Path, pools: type[_Counting]
) -> None:
    torch.manual_seed(0)
    model = nn.Linear(32, 8)
    optim = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    manager = _manager(tmp_path, model, optim)
    try:
        assert pools.built == 0
        model(torch.randn(4, 32)).sum().backward()
        optim.step()
        manager.session.writer.saver.wait_prepared()
        assert pools.built == 1
        manager.save(2)
        manager.wait(60)
        assert pools.built == 1
    finally:
        manager.close()


def test_training_is_the_same_with_a_manager_built_before_the_first_step(
    tmp_path: Path,
) -> None:
    reference, ref_optim, ref_step = _job("adamw")
    for _ in range(3):
        ref_step()
    model, optim, step = _job("adamw")
    manager = _manager(tmp_path, model, optim)
    try:
        for i in range(1, 4):
            step()
            manager.save(i)
    finally:
        manager.close()
    got, want = _flat(model, optim), _flat(reference, ref_optim)
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _flat(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach() for k, v in model.state_dict().items()}
    names = {p: n for n, p in model.named_parameters()}
    for p, st in optim.state.items():
        for key, v in st.items():
            out[f"optimizer.{names[p]}.{key}"] = v
    return out


def test_a_resumed_job_keeps_the_pool_built_at_construction(
    tmp_path: Path, pools: type[_Counting]
) -> None:
    model, optim, step = _job("adamw")
    manager = _manager(tmp_path, model, optim)
    try:
        for i in range(1, 3):
            step()
            manager.save(i)
    finally:
        manager.close()
    built = pools.built
    # A resumed job: the pool is planned from the prediction at construction; the load
    # fills the optimizer state with the predicted tensors
    model2, optim2, step2 = _job("adamw")
    resumed = _manager(tmp_path, model2, optim2)
    try:
        assert pools.built == built + 1
        assert resumed.load() == 2
        step2()
        resumed.save(4, force=True)
        resumed.wait(60)
        assert pools.built == built + 1  # neither the load nor the first save built one
        assert resumed.metrics[-1].status == "committed"
    finally:
        resumed.close()
