"""``quicksave.load`` with ``Stateful`` values, as the README's function example resumes a
new job: ``ModelState`` / ``OptimizerState`` give a freshly built optimizer its whole
state (moments, step, param-group hyperparameters) and plain values come back in the
dict passed in; a checkpoint of torch's own ``optimizer.state_dict()`` loaded into an
``OptimizerState`` says what it is and how to load it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

import quicksave
from quicksave import ModelState, OptimizerState
from quicksave.errors import IncompatibleStateError


def _job(seed: int, lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def _step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
    optim.zero_grad()
    model(x).square().mean().backward()
    optim.step()


def test_a_fresh_optimizer_gets_its_whole_state_and_plain_values_come_back_in_the_dict(
    tmp_path: Path,
) -> None:
    model, optim = _job(0, lr=1e-2)
    for seed in range(3):
        _step(model, optim, seed)
    optim.param_groups[0]["lr"] = 3e-3  # a schedule changed it: the checkpoint has it
    path = tmp_path / "step-3"
    quicksave.save(
        {"model": ModelState(model), "optim": OptimizerState(model, optim), "epoch": 7},
        path,
        step=3,
    )

    fresh_model, fresh_optim = _job(1, lr=0.5)  # another init, another lr, no state
    assert not fresh_optim.state
    state = {
        "model": ModelState(fresh_model),
        "optim": OptimizerState(fresh_model, fresh_optim),
        "epoch": None,
    }
    quicksave.load(state, path)

    assert state["epoch"] == 7
    assert fresh_optim.param_groups[0]["lr"] == 3e-3
    saved, loaded = optim.state_dict(), fresh_optim.state_dict()
    assert loaded["param_groups"] == saved["param_groups"]
    assert loaded["state"].keys() == saved["state"].keys()
    for index, entry in saved["state"].items():
        assert loaded["state"][index].keys() == entry.keys()
        for key, value in entry.items():
            assert torch.equal(loaded["state"][index][key], value), (index, key)
    # Both go on alike, bit for bit.
    _step(model, optim, 10)
    _step(fresh_model, fresh_optim, 10)
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_checkpoint_of_torchs_optimizer_state_dict_names_its_layout_and_the_way_to_load_it(
    tmp_path: Path,
) -> None:
    model, optim = _job(0, lr=1e-2)
    _step(model, optim, 0)
    path = tmp_path / "step-1"
    quicksave.save({"model": model.state_dict(), "optim": optim.state_dict()}, path, step=1)

    fresh_model, fresh_optim = _job(1, lr=0.5)
    with pytest.raises(IncompatibleStateError) as e:
        quicksave.load(
            {"model": ModelState(fresh_model), "optim": OptimizerState(fresh_model, fresh_optim)},
            path,
        )
    assert str(e.value) == (
        "the checkpoint holds 'optim' as torch's optimizer.state_dict() saves it (state keyed "
        "by parameter index), and OptimizerState loads its own layout (keyed by parameter "
        "name); load this one as it was saved, e.g. "
        "optim.load_state_dict(quicksave.load_state(path)['optim']), and save with "
        "OptimizerState(model, optim) to resume with quicksave.load or a CheckpointManager "
        f"[path={path}, fqn=optim]"
    )
    assert not fresh_optim.state  # nothing allocated, nothing loaded

    # The way the message names works.
    saved = quicksave.load_state(path)
    fresh_optim.load_state_dict(saved["optim"])
    fresh_model.load_state_dict(saved["model"])
    assert fresh_optim.param_groups[0]["lr"] == 1e-2
    for p, q in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(optim.state[p]["exp_avg"], fresh_optim.state[q]["exp_avg"])
