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
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _common import (
    example_parser,
    exit_without_finalizing,
    full_state_digest,
    lr_lambda,
    print0,
    setup_cpu,
    sigkill_once_committed,
    synthetic_batch,
)
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
    p = example_parser(__doc__.splitlines()[0])  # --folder, --steps, --interval, --kill-at, ...
    p.add_argument(
        "--plain",
        action="store_true",
        help="no training: load the newest checkpoint into a plain single-process model",
    )
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64, help="divisible by the world size")
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
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
    _, world = setup_cpu(distributed=not args.plain)
    if args.plain:
        return load_plain(args)

    model = build_model(args)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
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
        print0(f"resumed from step {resumed}, state digest: {loaded}")

    for step in range(train_state.step + 1, args.steps + 1):
        # The same batch on every rank: tensor parallelism splits the weights, not the data.
        x, y = synthetic_batch(args.seed, step, args.batch, args.dim)
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
        print0(f"step {step} loss {loss.item():.6f}")
        if step == args.kill_at:
            sigkill_once_committed(manager, step)  # every rank, once the save is committed

    manager.close()  # waits for the last checkpoint
    final = full_state_digest(model, optim, train_state.step)
    print0(f"final state digest: {final}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_finalizing(main())  # skips interpreter finalization (see _common)
