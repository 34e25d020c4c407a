"""Helpers of the multi-node simulations (node memory, peers, the object-store tier):
a small FSDP2 job on a 1-D CPU mesh, its step, fingerprints of what each rank holds,
and the clean-up of a node's agents and memory.

"Nodes" are groups of gloo ranks on one machine, each with its own tmpfs root (its own
agent); a node is lost by killing its ranks and agents and removing its root.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn as nn


def fsdp_job(seed: int, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A 4-layer MLP sharded with FSDP2 over ``world`` CPU ranks, and AdamW on it.
    ``Linear(32, 3)``: 3 rows over 4 ranks, an uneven shard (one rank holds none)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 3))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    """One step on a batch drawn from ``step`` (the same on every run)."""
    g = torch.Generator().manual_seed(step)
    optim.zero_grad(set_to_none=True)
    model(torch.randn(8, 16, generator=g)).square().mean().backward()
    optim.step()


def digest(t: torch.Tensor) -> str:
    """dtype, shape and sha256 of a tensor's bytes as this rank holds it (its shard)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    local = local.detach().contiguous()
    return (
        f"{local.dtype}{list(local.shape)}:" + hashlib.sha256(local.numpy().tobytes()).hexdigest()
    )


def fingerprints(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, str]:
    """This rank's parameters and optimizer state as it holds them (its local shards)."""
    names = {p: n for n, p in model.named_parameters()}
    out = {f"param.{n}": digest(p) for p, n in names.items()}
    for param, entry in optim.state.items():
        for key, value in entry.items():
            out[f"state.{names[param]}.{key}"] = digest(torch.as_tensor(value))
    return out


def kill_agents(where: Path) -> None:
    """SIGKILL every node agent whose record lies under ``where``."""
    for record in where.rglob("agent.json"):
        try:
            os.kill(int(json.loads(record.read_text())["pid"]), signal.SIGKILL)
        except (OSError, ValueError, KeyError):
            pass


def gone(path: str, within_s: float = 60.0) -> bool:
    """Whether ``path`` disappears within ``within_s`` (an agent frees it by itself)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not os.path.exists(path):
            return True
        time.sleep(0.1)
    return False


@contextlib.contextmanager
def node_roots(prefix: str, nodes: int) -> Iterator[Path]:
    """A fresh folder on ``/dev/shm`` with ``node-<i>`` in it for each of ``nodes`` nodes
    (each node's tmpfs root); afterwards every agent under it killed and it removed. A
    machine without ``/dev/shm`` skips the test (a tmpfs is what the tier needs)."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm (tmpfs) on this machine")
    base = shm / f"{prefix}-{uuid.uuid4().hex[:12]}"
    for node in range(nodes):
        (base / f"node-{node}").mkdir(parents=True)
    try:
        yield base
    finally:
        kill_agents(base)
        shutil.rmtree(base, ignore_errors=True)
