"""Pipeline-parallel training checkpointed by quicksave, resumed on another split.

A stack of ``--layers`` residual layers (plus an input projection ``embed`` and an
output ``head``) is cut into one contiguous stage per rank, torchtitan-style: each rank
builds only the layers it owns, under their *global* names (``layers.5.fc.weight`` is
``layers.5.fc.weight`` on whichever rank holds layer 5), each initialised from its own
seed so the weights do not depend on the split. Each rank has its own AdamW and LR
schedule over its own parameters. The schedule is GPipe: the microbatches' activations
go forward rank to rank with ``send``/``recv``, then their gradients come back; every
stage accumulates in a fixed order, so a run is deterministic. Gradients are clipped by
their global norm (one all-reduce).

Checkpoints go through :class:`quicksave.CheckpointManager` (asynchronous process mode).
``ModelState`` / ``OptimizerState`` hold each rank's model and optimizer state as DCP's
``get_model_state_dict`` / ``get_optimizer_state_dict(...,
StateDictOptions(flatten_optimizer_state_dict=True))`` give them: keys are parameter
fqns (``optim.state.layers.5.fc.weight.exp_avg``), unique across the ranks, so the
checkpoint is one global dictionary and any split of the layers can load it. Every rank
loads only its own keys, with the default strict load: a checkpoint key that no rank
loads would be an error.

Every run first loads the newest committed checkpoint in ``--folder`` (if any). Rank 0
prints the losses and ends with a SHA-256 digest of the whole model and optimizer state
(each rank's ``get_state_dict`` hashed per key, the hashes gathered)::

    final state digest: <hex>

Crash and resume on 4 stages, bit-exact; then the same checkpoint on 2 stages (CPU,
gloo)::

    torchrun --standalone --nproc-per-node 4 examples/pp_quicksave.py --folder /tmp/pp-a
    torchrun --standalone --nproc-per-node 4 examples/pp_quicksave.py --folder /tmp/pp-b \\
        --kill-at 4
    torchrun --standalone --nproc-per-node 4 examples/pp_quicksave.py --folder /tmp/pp-b
    # 2 stages of 4 layers: the digest printed after loading equals the 4-stage one
    torchrun --standalone --nproc-per-node 2 examples/pp_quicksave.py --folder /tmp/pp-a \\
        --steps 10

Exit status: 0 on success, non-zero on any failure (and after ``--kill-at``).
"""

from __future__ import annotations

import argparse
import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _common import (
    example_parser,
    exit_without_finalizing,
    leaf_hash,
    leaves,
    lr_lambda,
    print0,
    setup_cpu,
    sigkill_once_committed,
    synthetic_batch,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.optim.lr_scheduler import LambdaLR

from quicksave import (
    CheckpointConfig,
    CheckpointManager,
    ModelState,
    OptimizerState,
    TrainState,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = example_parser(__doc__.splitlines()[0])  # --folder, --steps, --interval, --kill-at, ...
    p.add_argument("--layers", type=int, default=8, help="divisible by the world size")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=2, help="divides --batch")
    return p.parse_args(argv)


class Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.fc(self.norm(x)))


class Stage(nn.Module):
    """The layers ``first .. last - 1`` of the full model, under their global names;
    ``embed`` on the first stage and ``head`` on the last.

    Each module is initialised from a seed of its own (its global index), so a layer's
    initial weights are the same whichever rank builds it.
    """

    def __init__(self, args: argparse.Namespace, first: int, last: int) -> None:
        super().__init__()
        self.is_first, self.is_last = first == 0, last == args.layers
        if self.is_first:
            torch.manual_seed(args.seed * 1000 + 999)
            self.embed = nn.Linear(args.dim, args.dim)
        self.layers = nn.ModuleDict()
        for i in range(first, last):
            torch.manual_seed(args.seed * 1000 + i)
            self.layers[str(i)] = Layer(args.dim)
        if self.is_last:
            torch.manual_seed(args.seed * 1000 + 998)
            self.head = nn.Linear(args.dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x) if self.is_last else x


def train_step(stage: Stage, step: int, args: argparse.Namespace) -> float:
    """Forward and backward of one batch through the pipeline (GPipe: every
    microbatch forward, then every microbatch backward); gradients accumulate in
    ``stage``. Returns the batch's mean loss on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # The whole batch on every rank: the first stage uses the inputs, the last the targets.
    x, y = synthetic_batch(args.seed, step, args.batch, args.dim)
    xs, ys = x.chunk(args.microbatches), y.chunk(args.microbatches)
    inputs, outputs = [], []
    loss_sum = torch.zeros(())
    for mb in range(args.microbatches):
        if stage.is_first:
            inp = xs[mb]
        else:
            inp = torch.empty_like(xs[mb])
            dist.recv(inp, src=rank - 1)
            inp.requires_grad_(True)
        out = stage(inp)
        if stage.is_last:
            out = F.mse_loss(out, ys[mb]) / args.microbatches
            loss_sum += out.detach()
        else:
            dist.send(out.detach(), dst=rank + 1)
        inputs.append(inp)
        outputs.append(out)
    for mb in range(args.microbatches):
        if stage.is_last:
            outputs[mb].backward()
        else:
            grad = torch.empty_like(outputs[mb])
            dist.recv(grad, src=rank + 1)
            outputs[mb].backward(grad)
        if not stage.is_first:
            dist.send(inputs[mb].grad, dst=rank - 1)
    dist.broadcast(loss_sum, src=world - 1)  # every rank logs the same loss
    return float(loss_sum)


def clip_grad_norm(stage: Stage, max_norm: float) -> None:
    """Clip by the norm of all stages' gradients together (one all-reduce)."""
    grads = [p.grad for p in stage.parameters() if p.grad is not None]
    squares = torch.stack([g.pow(2).sum() for g in grads]).sum()
    dist.all_reduce(squares)
    scale = torch.clamp(max_norm / (squares.sqrt() + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale)


def full_state_digest(stage: Stage, optim: torch.optim.Optimizer, step: int) -> str | None:
    """Collective: the digest of the whole model and optimizer state, whatever the split.

    Each rank hashes its own entries, keyed by global fqn (the flattened optimizer
    state is keyed by fqn too); rank 0 gathers them, checks that no key is on two ranks,
    and hashes them in key order. Returns the digest on rank 0, None elsewhere.
    """
    model_sd, optim_sd = get_state_dict(
        stage, optim, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    mine = {k: leaf_hash(v) for k, v in leaves({"model": model_sd, "optim": optim_sd})}
    gathered: list[dict[str, str]] | None = (
        [{} for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    )
    dist.gather_object(mine, gathered, dst=0)
    if gathered is None:
        return None
    merged: dict[str, str] = {}
    for rank, hashes in enumerate(gathered):
        twice = merged.keys() & hashes.keys()
        if twice:
            raise RuntimeError(f"rank {rank} holds keys another rank holds too: {sorted(twice)}")
        merged.update(hashes)
    h = hashlib.sha256(f"step={step}".encode())
    for key in sorted(merged):
        h.update(f"{key}={merged[key]}".encode())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = setup_cpu()
    if args.layers % world or args.batch % args.microbatches:
        raise SystemExit(
            f"--layers ({args.layers}) must divide by the world size ({world}) and --batch "
            f"({args.batch}) by --microbatches ({args.microbatches})"
        )
    per_stage = args.layers // world
    stage = Stage(args, rank * per_stage, (rank + 1) * per_stage)
    optim = torch.optim.AdamW(stage.parameters(), lr=args.lr, weight_decay=0.01)
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
            "model": ModelState(stage),  # this rank's layers, under their global fqns
            "optim": OptimizerState(stage, optim),  # flattened: keyed by fqn
            "lr_scheduler": scheduler,  # the same on every rank
            "train": train_state,  # the same on every rank
        },
    )
    resumed = manager.load()  # strict: every key of the checkpoint is loaded by some rank
    if resumed is not None:
        loaded = full_state_digest(stage, optim, train_state.step)
        print0(
            f"resumed from step {resumed} on {world} stages of {per_stage} layers, "
            f"state digest: {loaded}"
        )

    for step in range(train_state.step + 1, args.steps + 1):
        optim.zero_grad(set_to_none=True)
        loss = train_step(stage, step, args)
        clip_grad_norm(stage, args.max_norm)
        optim.step()  # waits, through the manager's hook, for the last save's copy
        scheduler.step()
        train_state.step = step
        train_state.losses.append(loss)
        train_state.log_steps.append(step)
        manager.save(step)
        print0(f"step {step} loss {loss:.6f}")
        if step == args.kill_at:
            sigkill_once_committed(manager, step)  # every rank, once the save is committed

    manager.close()  # waits for the last checkpoint
    final = full_state_digest(stage, optim, train_state.step)
    print0(f"final state digest: {final}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_finalizing(main())  # skips interpreter finalization (see _common)
