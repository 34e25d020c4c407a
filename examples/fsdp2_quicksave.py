"""FSDP2 training checkpointed by quicksave: asynchronous saves, a crash, a bit-exact resume.

A small residual MLP is sharded with FSDP2 (``fully_shard`` on every block, then on the
root) and trained with AdamW, a warm-up + cosine learning-rate schedule and gradient
clipping. A :class:`quicksave.CheckpointManager` in its default asynchronous process mode
saves model, optimizer, scheduler, step, RNG and each rank's data loader every
``--interval`` steps; ``save()`` returns at once and a worker process per rank writes the
checkpoint in the background.

The data loader's state differs per rank (each rank adds noise to its slice of the batch
from a generator of its own, as a per-rank augmentation would), so it is registered as
``quicksave.PerRank(loader)``: each rank saves and gets back its own entry. Under a plain
name the save would fail, naming the name and the ranks' values. The step and the logged
loss (averaged over the ranks) are the same on every rank: a plain name is right there.

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
after loading equals the one the 2-rank run printed for that step; ranks 0 and 1 get
their data loader entries back, rank 2 starts a fresh one: ``on_resize="keep"``)::

    torchrun --standalone --nproc-per-node 3 examples/fsdp2_quicksave.py --folder /tmp/qs-a \\
        --steps 10

A rank dies, torchrun restarts the job, and it resumes from node memory: with
``--memory-every N`` each rank also snapshots its state into the node's memory every N
steps (a tmpfs folder kept by a per-node agent that outlives the trainer); with
``--kill-rank-at STEP`` the last rank SIGKILLs itself once the snapshot of STEP is in
every rank's memory (first attempt only). torchrun stops the other ranks and starts the
job again, whose ``load()`` finds the step in node memory (newer than the folder's) and
resumes from it without reading the folder; the final digest is the uninterrupted run's::

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/fsdp2_quicksave.py \
        --folder /tmp/qs-c --memory-every 1 --kill-rank-at 6

Exit status: 0 on success, non-zero on any failure (and after ``--kill-at``).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _common import (
    add_memory_options,
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
from torch.distributed.fsdp import fully_shard
from torch.optim.lr_scheduler import LambdaLR

from quicksave import (
    CheckpointConfig,
    CheckpointManager,
    MemoryTierConfig,
    ModelState,
    OptimizerState,
    PerRank,
    RNGState,
    TrainState,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = example_parser(__doc__.splitlines()[0])  # --folder, --steps, --interval, --kill-at, ...
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=12, help="split across the ranks")
    add_memory_options(p)
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


class ShardLoader:
    """This rank's data: its slice of each global batch (a pure function of the step, so
    the same data whatever the world size) plus noise from a generator of its own.

    ``Stateful``; its state (the generator) differs per rank: register it as
    ``quicksave.PerRank(loader)``."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int) -> None:
        self.args, self.rank, self.world = args, rank, world
        self.noise = torch.Generator().manual_seed(args.seed * 7919 + rank)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.args
        x, y = synthetic_batch(a.seed, step, a.global_batch, a.dim)
        x, y = x[self.rank :: self.world], y[self.rank :: self.world]
        return x + 0.01 * torch.randn(x.shape, generator=self.noise), y

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"noise": self.noise.get_state()}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.noise.set_state(state_dict["noise"])


def mean_over_ranks(loss: torch.Tensor, world: int) -> float:
    """The loss of the global batch: every rank logs the same number."""
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = setup_cpu()

    # The same initial weights on every rank and for every world size.
    torch.manual_seed(args.seed)
    model = Model(args.dim, args.hidden, args.blocks)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = LambdaLR(optim, lr_lambda(args.warmup, args.steps))
    train_state = TrainState()
    loader = ShardLoader(args, rank, world)

    manager = CheckpointManager(
        CheckpointConfig(
            folder=args.folder,
            interval=args.interval,
            keep_latest_k=2,
            last_step=args.steps,
            async_mode="process",
            memory=None
            if args.memory_every is None
            else MemoryTierConfig(every=args.memory_every, root=args.memory_root),
        ),
        {
            "model": ModelState(model),
            "optim": OptimizerState(model, optim),
            "lr_scheduler": scheduler,
            "train": train_state,  # step and logged loss: the same on every rank
            "rng": RNGState(),
            # Each rank's own entry. On another world size a rank with an entry loads
            # it and a new rank keeps its fresh generator ("keep"); the default,
            # on_resize="error", refuses such a resume.
            "dataloader": PerRank(loader, on_resize="keep"),
        },
    )
    resumed = manager.load()
    if resumed is not None:
        loaded = full_state_digest(model, optim, train_state.step)
        tier = manager.last_load.tier  # "memory": node memory, "folder": the folder
        print0(f"resumed from step {resumed} on {world} ranks ({tier}), state digest: {loaded}")

    model.train()
    for step in range(train_state.step + 1, args.steps + 1):
        x, y = loader.batch(step)
        loss = F.mse_loss(model(x), y)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        optim.step()  # waits, through the manager's hook, for the last save's copy
        scheduler.step()
        train_state.step = step
        train_state.losses.append(mean_over_ranks(loss, world))
        train_state.log_steps.append(step)
        manager.save(step)
        print0(f"step {step} loss {train_state.losses[-1]:.6f}")
        if step == args.kill_at:
            sigkill_once_committed(manager, step)  # every rank, once the save is committed
        if step == args.kill_rank_at and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            sigkill_once_committed(manager, step, ranks=[world - 1])  # one rank dies

    manager.close()  # waits for the last checkpoint
    final = full_state_digest(model, optim, train_state.step)
    print0(f"final state digest: {final}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_finalizing(main())  # skips interpreter finalization (see _common)
