"""Tensor-parallel training checkpointed by quicksave, and the checkpoint loaded without TP.

A residual MLP is split with tensor parallelism on a 1-D device mesh
(``parallelize_module``: every block's ``up`` projection ``ColwiseParallel``, its
``down`` projection ``RowwiseParallel``), so each rank holds a slice of every weight
(DTensors). AdamW, a warm-up + cosine learning-rate schedule and gradient clipping; a
:class:`quicksave.CheckpointManager` (asynchronous process mode) saves every
``--interval`` steps. Every run first loads the newest committed checkpoint in
``--folder``, so re-running a crashed command resumes it. Rank 0 ends with::

    final state digest: <hex>

a SHA-256 of the full (gathered) model and optimizer state.

Crash and resume, bit-exact (CPU, gloo)::

    torchrun --standalone --nproc-per-node 2 examples/tp_quicksave.py --folder /tmp/tp-a
    torchrun --standalone --nproc-per-node 2 examples/tp_quicksave.py --folder /tmp/tp-b \\
        --kill-at 4
    torchrun --standalone --nproc-per-node 2 examples/tp_quicksave.py --folder /tmp/tp-b

The tensor-parallel checkpoint in a plain process (no torchrun, no process group, no
DTensor): ``quicksave.load`` assembles each full tensor from the ranks' slices; the
digest printed equals the TP run's final digest::

    python examples/tp_quicksave.py --folder /tmp/tp-a --plain

Exit status: 0 on success, non-zero on any failure (and after ``--kill-at``).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.optim.lr_scheduler import LambdaLR

import quicksave
from quicksave import (
    CheckpointConfig,
    CheckpointManager,
    ModelState,
    OptimizerState,
    TrainState,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--folder", required=True, help="checkpoint folder (path or URL)")
    p.add_argument("--steps", type=int, default=8, help="train until this step")
    p.add_argument("--interval", type=int, default=4, help="checkpoint every N steps")
    p.add_argument(
        "--kill-at",
        type=int,
        default=None,
        metavar="STEP",
        help="SIGKILL every rank once the checkpoint of STEP has committed",
    )
    p.add_argument(
        "--plain",
        action="store_true",
        help="no training: load the newest checkpoint into a plain single-process model",
    )
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64, help="divisible by the world size")
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self, dim: int, hidden: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build_model(args: argparse.Namespace) -> Model:
    """The plain (unsharded) model, with the same initial weights on every rank."""
    torch.manual_seed(args.seed)
    return Model(args.dim, args.hidden, args.blocks)


def build_training(
    model: nn.Module, args: argparse.Namespace
) -> tuple[torch.optim.Optimizer, LambdaLR, TrainState]:
    """Optimizer, LR schedule and progress, over the model's parameters as they are now
    (after ``parallelize_module``, which replaces them by DTensors)."""
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    return optim, LambdaLR(optim, lr_lambda(args.warmup, args.steps)), TrainState()


def batch(step: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``, the same on every rank (tensor parallelism splits the
    weights, not the data): a pure function of the step, so a resumed run sees exactly
    the data the uninterrupted one saw."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    x = torch.randn(args.batch, args.dim, generator=g)
    return x, torch.sin(x.roll(1, dims=1)) * 0.5


def lr_lambda(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _leaves(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{prefix}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{prefix}.{i}")
    else:
        yield prefix, value


def digest(state: dict[str, Any]) -> str:
    """SHA-256 over every leaf of ``state`` (tensor bytes, dtype and shape; other values
    by ``repr``), in key order."""
    h = hashlib.sha256()
    for key, value in sorted(_leaves(state, "")):
        h.update(key.encode())
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(value).encode())
    return h.hexdigest()


def full_state_digest(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> str | None:
    """The digest of the full model and optimizer state (keys are parameter fqns, so a
    TP model and a plain one compare). Distributed: collective, gathers the full tensors
    onto rank 0 and returns the digest there (None on the other ranks)."""
    distributed = dist.is_initialized()
    model_sd, optim_sd = get_state_dict(
        model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=distributed)
    )
    if distributed and dist.get_rank() != 0:
        return None
    return digest({"model": model_sd, "optim": optim_sd, "step": step})


def states(model: nn.Module, optim: torch.optim.Optimizer, scheduler, train_state) -> dict:
    """What a checkpoint holds: the same names in the TP run and in the plain load."""
    return {
        "model": ModelState(model),
        "optim": OptimizerState(model, optim),
        "lr_scheduler": scheduler,
        "train": train_state,
    }


def load_plain(args: argparse.Namespace) -> int:
    """Load the newest checkpoint of the TP run into a plain model in this process."""
    model = build_model(args)
    optim, scheduler, train_state = build_training(model, args)
    # A read-only manager only lists (and could load): it never writes or cleans up,
    # and no worker starts.
    with CheckpointManager(CheckpointConfig(folder=args.folder, read_only=True), {}) as lister:
        step = lister.latest_step()
        if step is None:
            print(f"no committed checkpoint in {args.folder}", file=sys.stderr)
            return 1
        path = lister.step_path(step)
    quicksave.load(states(model, optim, scheduler, train_state), path)  # strict: every key
    assert train_state.step == step, (train_state.step, step)
    print(f"loaded step {step} into a plain {type(model).__name__} from {path}")
    print(f"plain state digest: {full_state_digest(model, optim, train_state.step)}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if args.plain:
        return load_plain(args)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build_model(args)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    for block in model.blocks:
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    optim, scheduler, train_state = build_training(model, args)

    manager = CheckpointManager(
        CheckpointConfig(
            folder=args.folder,
            interval=args.interval,
            keep_latest_k=2,
            last_step=args.steps,
            async_mode="process",
        ),
        states(model, optim, scheduler, train_state),
    )
    resumed = manager.load()
    if resumed is not None:
        loaded = full_state_digest(model, optim, train_state.step)
        if rank == 0:
            print(f"resumed from step {resumed}, state digest: {loaded}", flush=True)

    for step in range(train_state.step + 1, args.steps + 1):
        x, y = batch(step, args)
        loss = F.mse_loss(model(x), y)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        optim.step()  # waits, through the manager's hook, for the last save's copy
        scheduler.step()
        train_state.step = step
        train_state.losses.append(loss.item())
        train_state.log_steps.append(step)
        manager.save(step)
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
        if step == args.kill_at:
            manager.wait()  # the checkpoint of this step is committed ...
            dist.barrier()  # ... on every rank: now crash, as hard as a process can
            print(f"rank {rank}: SIGKILL after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    manager.close()  # waits for the last checkpoint
    final = full_state_digest(model, optim, train_state.step)
    if rank == 0:
        print(f"final state digest: {final}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without interpreter finalization. torch's gloo worker threads outlive
    # destroy_process_group() (the group stays referenced from C++), and one that is
    # still dropping the buffers of a finished collective when Python finalizes takes
    # the GIL and aborts the process ("terminate called without an active exception",
    # SIGABRT; pytorch/pytorch#190489). Everything is committed and printed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
