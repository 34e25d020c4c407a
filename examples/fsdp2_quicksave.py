"""FSDP2 training checkpointed by quicksave: asynchronous saves, a crash, a bit-exact resume.

A small residual MLP is sharded with FSDP2 (``fully_shard`` on every block, then on the
root) and trained with AdamW, a warm-up + cosine learning-rate schedule and gradient
clipping. A :class:`quicksave.CheckpointManager` in its default asynchronous process mode
saves model, optimizer, scheduler, step and RNG every ``--interval`` steps; ``save()``
returns at once and a worker process per rank writes the checkpoint in the background.

Every run starts by loading the newest committed checkpoint in ``--folder`` (if any), so
re-running the same command after a crash resumes. At the end, rank 0 prints a SHA-256
digest of the full (gathered) model and optimizer state::

    final state digest: <hex>

Crash and resume, bit-exact (CPU, gloo)::

    # uninterrupted
    torchrun --standalone --nproc-per-node 2 examples/fsdp2_quicksave.py --folder /tmp/qs-a
    # killed with SIGKILL (every rank) right after the checkpoint of step 4 committed ...
    torchrun --standalone --nproc-per-node 2 examples/fsdp2_quicksave.py --folder /tmp/qs-b \\
        --kill-at 4
    # ... and resumed: the same final digest as the uninterrupted run
    torchrun --standalone --nproc-per-node 2 examples/fsdp2_quicksave.py --folder /tmp/qs-b

Resume on another world size (the checkpoint is resharded on load; the digest printed
after loading equals the one the 2-rank run printed for that step)::

    torchrun --standalone --nproc-per-node 3 examples/fsdp2_quicksave.py --folder /tmp/qs-a \\
        --steps 10

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
from torch.distributed.fsdp import fully_shard
from torch.optim.lr_scheduler import LambdaLR

from quicksave import (
    CheckpointConfig,
    CheckpointManager,
    ModelState,
    OptimizerState,
    RNGState,
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
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=12, help="split across the ranks")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, dim: int, hidden: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(blocks))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(step: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of ``step``: a pure function of the step,
    so a resumed run sees exactly the data the uninterrupted one saw."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    x = torch.randn(args.global_batch, args.dim, generator=g)
    y = torch.sin(x.roll(1, dims=1)) * 0.5
    rank, world = dist.get_rank(), dist.get_world_size()
    return x[rank::world], y[rank::world]


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
    """Collective (every rank calls it): gathers the full, unsharded model and optimizer
    state onto rank 0 and returns its digest there (None on the other ranks)."""
    model_sd, optim_sd = get_state_dict(
        model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() != 0:
        return None
    return digest({"model": model_sd, "optim": optim_sd, "step": step})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    # The same initial weights on every rank and for every world size.
    torch.manual_seed(args.seed)
    model = Model(args.dim, args.hidden, args.blocks)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = LambdaLR(optim, lr_lambda(args.warmup, args.steps))
    train_state = TrainState()

    manager = CheckpointManager(
        CheckpointConfig(
            folder=args.folder,
            interval=args.interval,
            keep_latest_k=2,
            last_step=args.steps,
            async_mode="process",
        ),
        {
            "model": ModelState(model),
            "optim": OptimizerState(model, optim),
            "lr_scheduler": scheduler,
            "train": train_state,
            "rng": RNGState(),
        },
    )
    resumed = manager.load()
    if resumed is not None:
        loaded = full_state_digest(model, optim, train_state.step)
        if rank == 0:
            print(
                f"resumed from step {resumed} on {dist.get_world_size()} ranks, "
                f"state digest: {loaded}",
                flush=True,
            )

    model.train()
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
