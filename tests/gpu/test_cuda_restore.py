"""A restore into a fresh job on the GPU: the optimizer state is allocated on the
parameters' device from the checkpoint (no optimizer step), read through a host
buffer, and comes back bit-exact, the ``step`` scalar where the optimizer keeps it
(on the GPU for ``fused`` and ``capturable``); training goes on exactly. Skipped
without a GPU (CI has none); run on one with ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from helpers.skip_policy import GPU_SKIP
from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState, OptimizerState

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason=GPU_SKIP),
]

OPTIMIZERS = {
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
    "adam-fused": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True),
    "adamw-capturable-amsgrad": lambda p: torch.optim.AdamW(
        p, lr=1e-3, capturable=True, amsgrad=True
    ),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
}


def _job(kind: str, seed: int, device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 64)).to(device)
    return model, OPTIMIZERS[kind](model.parameters())


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int, device: str) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 256, generator=g).to(device)
    optim.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    optim.step()


def _snapshot(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    sd = optim.state_dict()
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "state": {
            i: {k: (v.clone(), v.device) for k, v in entry.items()}
            for i, entry in sd["state"].items()
        },
        "groups": sd["param_groups"],
    }


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["groups"] == want["groups"]
    assert list(got["model"]) == list(want["model"])
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert list(got["state"]) == list(want["state"])
    for i, entry in want["state"].items():
        assert list(got["state"][i]) == list(entry), i
        for k, (v, device) in entry.items():
            other, other_device = got["state"][i][k]
            assert other_device == device and other.dtype == v.dtype, (i, k)
            assert torch.equal(other, v), (i, k)


def run_restore(kind: str, folder: str, device: str = "cuda") -> None:
    """Train 2 steps and save; a fresh job restores with no optimizer step; both then
    take the same third step."""
    model, optim = _job(kind, 0, device)
    config = CheckpointConfig(folder=folder, interval=2, async_mode="disabled")
    with CheckpointManager(
        config, {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}
    ) as manager:
        for step in (1, 2):
            _step(model, optim, step, device)
            manager.save(step)
    saved = _snapshot(model, optim)
    _step(model, optim, 3, device)
    after = _snapshot(model, optim)

    model, optim = _job(kind, 1, device)
    calls = [0]
    optim.register_step_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    with CheckpointManager(
        config, {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}
    ) as manager:
        assert manager.load() == 2
    assert calls[0] == 0, "the restore ran an optimizer step"
    _assert_same(_snapshot(model, optim), saved)
    _step(model, optim, 3, device)
    _assert_same(_snapshot(model, optim), after)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_a_fresh_gpu_job_restores_exactly_without_an_optimizer_step(
    tmp_path: Path, kind: str
) -> None:
    run_restore(kind, str(tmp_path / "ckpt"))
