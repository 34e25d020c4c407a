"""The CUDA staging path: a pinned pool, device-to-host copies on a side stream that
first waits for the kernels the training thread queued before ``save()``, and the
overlap guard on GPU tensors. Skipped without a GPU (CI has none); run on one with
``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from helpers.skip_policy import GPU_SKIP
from quicksave.errors import CheckpointError
from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState, OptimizerState

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason=GPU_SKIP),
]


class Job:
    """Wide layers on the GPU, so that an optimizer step is still queued on the stream
    when ``save()`` is called."""

    def __init__(self, layers: int = 8, dim: int = 4096) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)]).cuda()
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=True)
        self.x = torch.randn(64, dim, device="cuda")

    def states(self) -> dict[str, Any]:
        return {
            "model": ModelState(self.model),
            "optimizer": OptimizerState(self.model, self.optim),
        }

    def step(self) -> None:
        self.optim.zero_grad()
        self.model(self.x).square().mean().backward()
        self.optim.step()  # queued: the host does not wait for it


def cpu_state(states: dict[str, Any]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in states["model"].state_dict().items():
        out[f"model.{k}"] = v.detach().cpu()
    return out


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_overlapped_gpu_staging_saves_the_state_of_the_moment_of_save(
    tmp_path: Path, mode: str
) -> None:
    job = Job()
    states = job.states()
    config = CheckpointConfig(folder=str(tmp_path / "ckpt"), interval=3, async_mode=mode)
    with CheckpointManager(config, states) as manager:
        for _ in range(3):
            job.step()
        assert manager.save(3)  # the step's kernels are still queued: the copy waits
        expected = cpu_state(states)  # the default stream: after those kernels
        saver = manager.session.writer.saver
        assert any(s.pool is not None and s.pool.pinned for s in saver._slots)
        for step in range(4, 6):
            job.step()  # pre-hook: waits for the background copy
            manager.save(step)
    fresh = Job()
    fresh_states = fresh.states()
    fresh.step()
    reader = CheckpointConfig(folder=str(tmp_path / "ckpt"), async_mode="disabled")
    with CheckpointManager(reader, fresh_states) as m:
        assert m.load(3) == 3
    got = cpu_state(fresh_states)
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []


def test_a_gpu_tensor_written_during_its_copy_fails_the_save(tmp_path: Path) -> None:
    job = Job()
    states = job.states()
    config = CheckpointConfig(folder=str(tmp_path / "ckpt"), interval=3, async_mode="process")
    errors: list[CheckpointError] = []
    with CheckpointManager(config, states) as manager:
        for step in range(1, 7):
            job.step()
            try:
                manager.save(step)
            except CheckpointError as e:
                errors.append(e)
            if step == 3:
                with torch.no_grad():
                    for p in job.model.parameters():
                        p.mul_(0.5)
    committed = manager.committed_steps()  # after close(): step 6 is durable
    assert 3 not in committed and 6 in committed
    assert len(errors) == 1 and "step 3 was not committed" in str(errors[0])
