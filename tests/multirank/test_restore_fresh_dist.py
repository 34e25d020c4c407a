"""A restore into a fresh FSDP2 job (DTensor parameters, an optimizer that has never
stepped) on 1 and 2 gloo ranks: every rank allocates only its local shards of the
optimizer state, runs no optimizer step, and gets every tensor (bit-exact, as a DTensor
with its parameter's placements where the saved one was), the scalars and the param
groups back; training then continues exactly like the uninterrupted run. AdamW,
Adam(amsgrad) and SGD with momentum; one layer's rows do not split evenly over 2 ranks.

Functions whose name starts with ``_rank_`` run inside the spawned ranks.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn as nn
from launcher import LaunchConfig, run_ranks

pytestmark = pytest.mark.slow

LAUNCH = LaunchConfig(timeout_s=240.0, collective_timeout_s=60.0, preload=("torch._dynamo",))
KINDS = ("adamw", "adam-amsgrad", "sgd-momentum")


def _optimizer(kind: str, model: nn.Module, lr_scale: float) -> torch.optim.Optimizer:
    head = list(model[-1].parameters())
    groups = [
        {"params": [p for p in model.parameters() if all(p is not h for h in head)]},
        {"params": head, "lr": 0.003 * lr_scale},
    ]
    if kind == "adamw":
        optim: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1)
    elif kind == "adam-amsgrad":
        optim = torch.optim.Adam(groups, lr=0.01, amsgrad=True)
    else:
        optim = torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    optim.param_groups[0]["lr"] *= lr_scale
    return optim


def _job(world_size: int, kind: str, seed: int, lr_scale: float = 1.0) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    # Linear(32, 3): 3 rows over 2 ranks, an uneven shard
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 3))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, _optimizer(kind, model, lr_scale)


def _manager(folder: str, model: nn.Module, optim: torch.optim.Optimizer) -> Any:
    from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState, OptimizerState

    states = {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}
    config = CheckpointConfig(folder=folder, interval=3, async_mode="disabled")
    return CheckpointManager(config, states)


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 16, generator=g)
    optim.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    optim.step()


def _count_steps(optim: torch.optim.Optimizer) -> list[int]:
    calls = [0]
    optim.register_step_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _local(value: Any) -> Any:
    """A value as this rank holds it: (kind, placements, local tensor) for tensors."""
    if isinstance(value, torch.Tensor):
        if hasattr(value, "to_local"):
            local = value.to_local()
            return ("dtensor", tuple(map(str, value.placements)), tuple(value.shape), local)
        return ("tensor", (), tuple(value.shape), value)
    return (type(value).__name__, (), (), value)


def _snapshot(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's parameters and optimizer state, cloned, keyed by parameter name."""
    names = {p: n for n, p in model.named_parameters()}
    out: dict[str, Any] = {f"param.{n}": _local(p.detach()) for p, n in names.items()}
    for param, entry in optim.state.items():
        for key, value in entry.items():
            out[f"state.{names[param]}.{key}"] = _local(value)
    out = {
        k: (kind, pl, shape, t.clone() if isinstance(t, torch.Tensor) else t)
        for k, (kind, pl, shape, t) in out.items()
    }
    groups = optim.state_dict()["param_groups"]
    out["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    return out


def _assert_same(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    assert set(got) == set(want), f"{where}: keys {sorted(set(got) ^ set(want))}"
    assert got["param_groups"] == want["param_groups"], where
    for key in want:
        if key == "param_groups":
            continue
        (k1, p1, s1, a), (k2, p2, s2, b) = got[key], want[key]
        assert (k1, p1, s1) == (k2, p2, s2), f"{where} {key}: {(k1, p1, s1)} != {(k2, p2, s2)}"
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, f"{where} {key}"
            assert torch.equal(a, b), f"{where} {key}: values differ"
        else:
            assert type(a) is type(b) and a == b, f"{where} {key}"


def _rank_restore(rank: int, world_size: int, root: str) -> dict[str, int]:
    steps: dict[str, int] = {}
    for kind in KINDS:
        folder = os.path.join(root, kind)
        model, optim = _job(world_size, kind, seed=0)
        with _manager(folder, model, optim) as manager:
            for step in (1, 2, 3):
                _step(model, optim, step)
                manager.save(step)
        saved = _snapshot(model, optim)
        later = []
        for step in (4, 5):
            _step(model, optim, step)
            later.append(_snapshot(model, optim))

        model, optim = _job(world_size, kind, seed=1, lr_scale=3.0)  # the fresh job
        calls = _count_steps(optim)
        assert not optim.state
        with _manager(folder, model, optim) as manager:
            assert manager.load() == 3
        assert calls[0] == 0, f"{kind}: the restore ran an optimizer step"
        steps[kind] = calls[0]
        _assert_same(_snapshot(model, optim), saved, f"{kind} rank {rank} restored")
        for step, want in zip((4, 5), later, strict=True):
            _step(model, optim, step)
            _assert_same(_snapshot(model, optim), want, f"{kind} rank {rank} step {step}")
    return steps


@pytest.mark.parametrize("world_size", [1, 2])
def test_fsdp2_fresh_job_restores_local_shards_without_a_step(tmp_path, world_size) -> None:
    results = run_ranks(_rank_restore, world_size, str(tmp_path), config=LAUNCH)
    assert results == [dict.fromkeys(KINDS, 0)] * world_size
