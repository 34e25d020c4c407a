"""FSDP2 (DTensor parameters and moments) on a process group of one rank: a debug run of
FSDP2 code, or a two-rank checkpoint resumed on one rank. Every async mode saves, the
checkpoint loads back bit-exactly, and a two-rank checkpoint resumes on one rank and
keeps saving.

Functions whose name starts with ``_rank_`` run inside the spawned ranks.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import pytest
import torch
import torch.nn as nn
from launcher import LaunchConfig, run_ranks

pytestmark = pytest.mark.slow

LAUNCH = LaunchConfig(timeout_s=180.0, collective_timeout_s=60.0)


def _job(world_size: int, root: str, mode: str, interval: int = 2) -> tuple[Any, ...]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from quicksave.manager import (
        CheckpointConfig,
        CheckpointManager,
        ModelState,
        OptimizerState,
        TrainState,
    )

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 4))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_state = TrainState()
    states = {
        "model": ModelState(model),
        "optimizer": OptimizerState(model, optim),
        "train_state": train_state,
    }
    config = CheckpointConfig(folder=os.path.join(root, "ckpt"), interval=interval, async_mode=mode)
    return model, optim, train_state, states, CheckpointManager(config, states)


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 16, generator=g)
    optim.zero_grad()
    model(x).square().mean().backward()
    optim.step()


def _digest(states: dict[str, Any]) -> str:
    """sha256 over every tensor of the full (unsharded) model and optimizer state."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = states["model"].parts[0]
    optim = states["optimizer"].optimizers[0]
    options = StateDictOptions(full_state_dict=True)
    h = hashlib.sha256()

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            h.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                h.update(str(k).encode())
                walk(value[k])
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        else:
            h.update(repr(value).encode())

    walk(get_model_state_dict(model, options=options))
    walk(get_optimizer_state_dict(model, optim, options=options))
    return h.hexdigest()


def _rank_train(rank: int, world_size: int, root: str, mode: str, steps: int) -> dict:
    """Train ``steps`` steps with a checkpoint every 2; digests at each save."""
    model, optim, train_state, states, manager = _job(world_size, root, mode)
    digests: dict[int, str] = {}
    with manager:
        for step in range(1, steps + 1):
            _step(model, optim, step)
            train_state.step = step
            if manager.save(step):
                digests[step] = _digest(states)
        manager.wait()
        committed = manager.committed_steps()
    return {"digests": digests, "committed": committed}


def _rank_resume(
    rank: int, world_size: int, root: str, mode: str, then_steps: int
) -> dict[str, Any]:
    """Load the newest checkpoint, report its digest, train ``then_steps`` more."""
    model, optim, train_state, states, manager = _job(world_size, root, mode)
    out: dict[str, Any] = {"digests": {}}
    with manager:
        step = manager.load()
        out["loaded"] = step
        out["loaded_digest"] = _digest(states)
        assert step is not None and train_state.step == step
        for s in range(step + 1, step + then_steps + 1):
            _step(model, optim, s)
            train_state.step = s
            if manager.save(s):
                out["digests"][s] = _digest(states)
        manager.wait()
        out["committed"] = manager.committed_steps()
    return out


@pytest.mark.parametrize("mode", ["process", "thread", "disabled"])
def test_fsdp2_on_one_rank_saves_and_loads_bit_exactly(tmp_path, mode: str) -> None:
    root = str(tmp_path)
    [trained] = run_ranks(_rank_train, 1, root, mode, 4, config=LAUNCH)
    assert trained["committed"] == [2, 4]
    [resumed] = run_ranks(_rank_resume, 1, root, mode, 2, config=LAUNCH)
    assert resumed["loaded"] == 4
    assert resumed["loaded_digest"] == trained["digests"][4]
    assert resumed["committed"] == [2, 4, 6]


def test_a_two_rank_fsdp2_checkpoint_resumes_and_keeps_saving_on_one_rank(tmp_path) -> None:
    root = str(tmp_path)
    trained = run_ranks(_rank_train, 2, root, "process", 4, config=LAUNCH)
    assert all(t["committed"] == [2, 4] for t in trained)
    assert trained[0]["digests"][4] == trained[1]["digests"][4]  # the full state
    [resumed] = run_ranks(_rank_resume, 1, root, "process", 2, config=LAUNCH)
    assert resumed["loaded"] == 4
    assert resumed["loaded_digest"] == trained[0]["digests"][4]
    assert resumed["committed"] == [2, 4, 6]
    # and back on two ranks, from the one-rank checkpoint
    again = run_ranks(_rank_resume, 2, root, "process", 0, config=LAUNCH)
    assert [a["loaded"] for a in again] == [6, 6]
    assert again[0]["loaded_digest"] == resumed["digests"][6]


def _rank_dcp_path(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """FSDP2's DTensor parameters take DCP's path (plain_state_dict.py): the states'
    dicts are DCP's own."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from quicksave.manager.plain_state_dict import (
        FLAT,
        plain_model_state_dict,
        plain_optimizer_state_dict,
    )

    model, optim, _, states, manager = _job(world_size, root, "disabled")
    with manager:
        _step(model, optim, 1)
        ours = {k: states[k].state_dict() for k in ("model", "optimizer")}
        dcp = {
            "model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, optim, options=FLAT),
        }
        same = {
            name: list(ours[name]) == list(dcp[name])
            and all(_same_value(v, dcp[name][k]) for k, v in ours[name].items())
            for name in ours
        }
        return {
            "plain": [plain_model_state_dict(model), plain_optimizer_state_dict(model, optim)],
            "same": same,
        }


def _same_value(a: Any, b: Any) -> bool:
    """The same type and value; a tensor (a DTensor's local shard) in the same memory."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        a, b = (t.to_local() if hasattr(t, "to_local") else t for t in (a, b))
        return a.data_ptr() == b.data_ptr() and torch.equal(a, b)
    return a == b


def test_fsdp2_state_dicts_take_dcp_s_path(tmp_path) -> None:
    [out] = run_ranks(_rank_dcp_path, 1, str(tmp_path), config=LAUNCH)
    assert out["plain"] == [None, None]
    assert out["same"] == {"model": True, "optimizer": True}
