"""Strict loads are strict across the group, not per rank.

Each rank of a pipeline-parallel job holds only its own layers and its own optimizer; a
job with per-rank entries holds only its own. A strict load must accept that (a key is
unexpected only if no rank loads it) and still refuse a key that no rank loads, or a
key one rank asks for that the checkpoint lacks, naming that rank.

The pipeline-parallel case saves on 4 ranks (2 layers each, AdamW per stage, optimizer
state flattened to parameter fqns by ``get_state_dict``), resumes on 4 ranks and
continues bit-exactly as an uninterrupted run does, and loads on 2 ranks (4 layers
each: a different split) with every value equal to what was saved.

Functions whose name starts with ``_rank_`` run inside the spawned ranks.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from launcher import LaunchConfig, run_ranks

import quicksave
from quicksave.errors import IncompatibleStateError

pytestmark = pytest.mark.slow

LAYERS = 8
WIDTH = 16
CONFIG = LaunchConfig(timeout_s=180.0, grace_s=10.0, collective_timeout_s=60.0)


# -- per-rank entries ------------------------------------------------------------------------


def _rank_per_rank_keys(rank: int, world_size: int, root: str) -> dict[str, Any]:
    path = f"{root}/ckpt"
    own = torch.arange(5, dtype=torch.float32) + 100 * rank
    quicksave.save({"shared": torch.ones(3), f"r{rank}": {"own": own}, "step": 9}, path)
    out: dict[str, Any] = {}

    # Each rank loads the shared entries and its own: strict, and it works.
    dest = {"shared": torch.zeros(3), f"r{rank}": {"own": torch.zeros(5)}, "step": 0}
    quicksave.load(dest, path)
    out["own_equal"] = torch.equal(dest[f"r{rank}"]["own"], own)
    out["step"] = dest["step"]

    # No rank loads r1.own: unexpected, every rank raises the same error.
    dest = {"shared": torch.zeros(3), "step": 0}
    if rank != 1:
        dest[f"r{rank}"] = {"own": torch.zeros(5)}
    try:
        quicksave.load(dest, path)
    except IncompatibleStateError as e:
        out["unexpected"] = str(e)
    dist.barrier()

    # Rank 1 asks for a key the checkpoint lacks: every rank fails, rank 1 is named.
    dest = {"shared": torch.zeros(3), f"r{rank}": {"own": torch.zeros(5)}, "step": 0}
    if rank == 1:
        dest["extra"] = torch.zeros(2)
    try:
        quicksave.load(dest, path)
    except IncompatibleStateError as e:
        out["missing"] = str(e)
    dist.barrier()

    # Not strict: the intersection, no error.
    dest = {"shared": torch.zeros(3)}
    quicksave.load(dest, path, strict=False)
    out["shared_equal"] = torch.equal(dest["shared"], torch.ones(3))
    return out


def test_per_rank_keys_load_strictly_across_ranks(tmp_path):
    results = run_ranks(_rank_per_rank_keys, 2, str(tmp_path), config=CONFIG)
    for rank, r in enumerate(results):
        assert r["own_equal"] and r["shared_equal"] and r["step"] == 9, (rank, r)
        assert (
            "in the checkpoint but not in the state dict of any rank: r1.own" in (r["unexpected"])
        ), r
        assert "r0.own" not in r["unexpected"]
        assert "missing from checkpoint: extra" in r["missing"], r
        assert r["missing"].endswith("fqn=extra, rank=1]"), r


# -- pipeline parallel ---------------------------------------------------------------------


class Stage(torch.nn.Module):
    """The layers ``owned`` of an ``LAYERS``-layer MLP, under their global names."""

    def __init__(self, owned: range) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(WIDTH, WIDTH) for i in owned})
        for i, layer in self.layers.items():  # a value independent of the split
            g = torch.Generator().manual_seed(int(i))
            with torch.no_grad():
                layer.weight.copy_(torch.randn(WIDTH, WIDTH, generator=g) / WIDTH**0.5)
                layer.bias.copy_(torch.randn(WIDTH, generator=g) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return x


def _owned(rank: int, world_size: int) -> range:
    per = LAYERS // world_size
    return range(rank * per, (rank + 1) * per)


def _build(rank: int, world_size: int) -> tuple[Stage, torch.optim.Optimizer]:
    torch.manual_seed(0)
    stage = Stage(_owned(rank, world_size))
    optim = torch.optim.AdamW(stage.parameters(), lr=1e-2, weight_decay=0.1)
    return stage, optim


def _train(stage: Stage, optim: torch.optim.Optimizer, rank: int, steps: range) -> None:
    """A real pipeline: activations go forward rank to rank, gradients come back."""
    world = dist.get_world_size()
    for step in steps:
        g = torch.Generator().manual_seed(1000 + step)
        batch = torch.randn(4, WIDTH, generator=g)
        target = torch.randn(4, WIDTH, generator=g)
        if rank == 0:
            x = batch
        else:
            x = torch.empty(4, WIDTH)
            dist.recv(x, rank - 1)
            x.requires_grad_(True)
        y = stage(x)
        if rank == world - 1:
            torch.nn.functional.mse_loss(y, target).backward()
        else:
            dist.send(y.detach(), rank + 1)
            grad = torch.empty_like(y)
            dist.recv(grad, rank + 1)
            y.backward(grad)
        if rank > 0:
            dist.send(x.grad, rank - 1)
        optim.step()
        optim.zero_grad()


def _state(stage: Stage, optim: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(
        stage, optim, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    return {"model": model_sd, "optim": optim_sd}


def _restore(stage: Stage, optim: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(
        stage,
        optim,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=StateDictOptions(flatten_optimizer_state_dict=True),
    )


def _digests(state: dict[str, Any]) -> dict[str, str]:
    """fqn -> digest of the value (tensor bytes, or repr of a plain value)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    out = {}
    for fqn, v in flat.items():
        if isinstance(v, torch.Tensor):
            t = v.detach().contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
            out[fqn] = f"{t.dtype}{list(t.shape)}:{hashlib.sha256(raw).hexdigest()}"
        else:
            out[fqn] = repr(v)
    return out


def _rank_pp_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    stage, optim = _build(rank, world_size)
    _train(stage, optim, rank, range(0, 3))
    quicksave.save(_state(stage, optim), f"{root}/step-3", step=3)
    saved = _digests(_state(stage, optim))
    _train(stage, optim, rank, range(3, 5))  # the uninterrupted run goes on
    return {"saved": saved, "final": _digests(_state(stage, optim))}


def _rank_pp_resume(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Fresh processes, fresh stages: load (strict, the default), go on training."""
    torch.manual_seed(123)  # different from the saving run: only the checkpoint counts
    stage = Stage(_owned(rank, world_size))
    for p in stage.parameters():
        torch.nn.init.zeros_(p)
    optim = torch.optim.AdamW(stage.parameters(), lr=1e-2, weight_decay=0.1)
    state = _state(stage, optim)  # the template: every key this stage holds
    quicksave.load(state, f"{root}/step-3")
    _restore(stage, optim, state)
    loaded = _digests(_state(stage, optim))
    if world_size == LAYERS // 2:  # the saving split: training goes on
        _train(stage, optim, rank, range(3, 5))
    return {"loaded": loaded, "final": _digests(_state(stage, optim))}


def test_pipeline_parallel_resumes_and_reshards(tmp_path):
    root = str(tmp_path)
    saved = run_ranks(_rank_pp_save, 4, root, config=CONFIG)
    # Every fqn is owned by exactly one stage (the flattened optimizer state included).
    all_saved: dict[str, str] = {}
    for r in saved:
        assert not set(r["saved"]) & set(all_saved)
        all_saved.update(r["saved"])
    assert any(k.startswith("optim.state.layers.7.") for k in all_saved)

    resumed = run_ranks(_rank_pp_resume, 4, root, config=CONFIG)
    for rank in range(4):
        assert resumed[rank]["loaded"] == saved[rank]["saved"], rank
        assert resumed[rank]["final"] == saved[rank]["final"], rank  # bit-exact resume

    # A different split: 2 stages of 4 layers each load the same checkpoint strictly.
    two = run_ranks(_rank_pp_resume, 2, root, config=CONFIG)
    loaded: dict[str, str] = {}
    for r in two:
        loaded.update(r["loaded"])
    assert loaded == all_saved
