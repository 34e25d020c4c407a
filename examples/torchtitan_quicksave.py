"""torchtitan-style training that checkpoints through quicksave, stopped and resumed.

Run on the CPU (gloo), two ranks, FSDP2::

    torchrun --nproc-per-node 2 examples/torchtitan_quicksave.py --dump-folder /tmp/tt-demo

It builds what torchtitan's trainer builds (an ``OptimizersContainer``, an
``LRSchedulersContainer``, a ``ParallelAwareDataloader``, the checkpointer from its
``Config``) around a tiny language model sharded with ``fully_shard``, and runs
torchtitan's step order: forward/backward, ``checkpointer.maybe_wait_for_staging()``,
``optimizers.step()``, ``lr_schedulers.step()``, ``checkpointer.save(step, last_step)``.

1. a reference run trains ``--steps`` steps without checkpoints;
2. a run with ``QuicksaveCheckpointManager`` (async, overlapped staging) stops after
   step ``--stop-at``;
3. new objects resume from its latest checkpoint, train to ``--steps`` and compare every
   parameter, optimizer state, the LR schedule, the train state and the next batch with
   the reference: ``bit-exact: True``.

In a real torchtitan job only the config changes: put the backend's Config in your
config registry function, e.g. ``Trainer.Config(..., checkpoint=
QuicksaveCheckpointManager.Config(enable=True, interval=500, keep_latest_k=3,
async_mode="async_with_pinned_mem"))``; every field is then a ``--checkpoint.*`` flag.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _common import exit_without_finalizing
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import IterableDataset
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

from quicksave.integrations.torchtitan import QuicksaveCheckpointManager

VOCAB, DIM, SEQ, BATCH = 97, 32, 16, 4
ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")  # torchtitan's names


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, 4 * DIM)
        self.w2 = nn.Linear(4 * DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.w2(F.gelu(self.w1(self.norm(h))))


class TinyLM(nn.Module):
    """torchtitan's module names: tok_embeddings, layers.<i>, norm, output."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


class Tokens(IterableDataset):
    """Synthetic token sequences per data-parallel rank; the position is its state."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank, self.pos = dp_rank, 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(7919 * self.dp_rank + self.pos)
            self.pos += 1
            seq = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            yield seq[:-1], seq[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pos = int(state_dict["pos"])


class TrainState:
    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


class Job:
    """What torchtitan's trainer builds, with the checkpointer from ``checkpoint``."""

    def __init__(self, checkpoint: Any, dump_folder: str, steps: int) -> None:
        torch.manual_seed(0)
        rank, world = dist.get_rank(), dist.get_world_size()
        self.model = TinyLM()
        mesh = init_device_mesh("cpu", (world,))
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        optimizer_config = default_adamw(lr=3e-3)
        optimizer_config.implementation = "foreach"
        self.optimizers = optimizer_config.build(model_parts=[self.model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=steps
        )
        self.dataloader = ParallelAwareDataloader(
            Tokens(rank), dp_rank=rank, dp_world_size=world, batch_size=BATCH
        )
        self.train_state = TrainState()
        self.steps = steps
        self.checkpointer = checkpoint.build(
            dataloader=self.dataloader,
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            sd_adapter=None,
            base_folder=dump_folder,
        )
        self.batches: Any = None  # after load(): a data loader restores at iter()

    def train(self, until: int) -> None:
        if self.batches is None:
            self.batches = iter(self.dataloader)
        while self.train_state.step < until:
            self.train_state.step += 1
            tokens, labels = next(self.batches)
            loss = F.cross_entropy(self.model(tokens).flatten(0, 1), labels.flatten())
            loss.backward()
            self.checkpointer.maybe_wait_for_staging()
            self.optimizers.step()
            self.lr_schedulers.step()
            self.optimizers.zero_grad()
            self.train_state.ntokens_seen += tokens.numel()
            step = self.train_state.step
            self.checkpointer.save(step, last_step=step == self.steps)
            if dist.get_rank() == 0:
                print(f"step {step}: loss {loss.item():.4f}", flush=True)

    def fingerprint(self) -> str:
        """sha256 over full parameters, optimizer state, LR, train state, next batch."""
        h = hashlib.sha256()
        values = list(self.model.state_dict().items()) + list(self.optimizers.state_dict().items())
        for name, value in values:
            h.update(name.encode())
            if isinstance(value, torch.Tensor):
                full = value.full_tensor() if hasattr(value, "full_tensor") else value
                h.update(full.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            else:
                h.update(repr(value).encode())
        h.update(repr(self.lr_schedulers.state_dict()).encode())
        h.update(repr(self.train_state.state_dict()).encode())
        tokens, _ = next(self.batches)
        h.update(tokens.numpy().tobytes())
        return h.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump-folder", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--stop-at", type=int, default=4)
    parser.add_argument("--interval", type=int, default=2)
    parser.add_argument("--async-mode", default="async_with_pinned_mem", choices=ASYNC_MODES)
    args = parser.parse_args()
    existing = os.path.join(args.dump_folder, "checkpoint")
    if os.path.isdir(existing) and os.listdir(existing):
        raise SystemExit(
            f"{existing} holds checkpoints of an earlier run (its last step is a model-only "
            "checkpoint, which training cannot resume from): pass a new --dump-folder"
        )
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    reference = Job(CheckpointManager.Config(enable=False), args.dump_folder, args.steps)
    reference.train(args.steps)
    expected = reference.fingerprint()

    def checkpoint() -> QuicksaveCheckpointManager.Config:
        return QuicksaveCheckpointManager.Config(
            enable=True,
            folder="checkpoint",
            interval=args.interval,
            keep_latest_k=2,
            async_mode=args.async_mode,
            last_save_model_only=True,  # torchtitan's default: the last step, model only
        )

    first = Job(checkpoint(), args.dump_folder, args.steps)
    first.checkpointer.load()
    first.train(args.stop_at)
    first.checkpointer.close()  # the job stops here (its saves are committed first)

    resumed = Job(checkpoint(), args.dump_folder, args.steps)
    resumed.checkpointer.load()
    if rank == 0:
        print(f"resumed at step {resumed.train_state.step}", flush=True)
    resumed.train(args.steps)
    same = resumed.fingerprint() == expected
    folder = resumed.checkpointer.folder
    resumed.checkpointer.close()
    agreed = torch.tensor([int(same)])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"checkpoints in {folder}: {sorted(os.listdir(folder))}")
        print(f"bit-exact: {bool(agreed.item())}", flush=True)
    dist.destroy_process_group()
    return 0 if agreed.item() else 1


if __name__ == "__main__":
    # Both checkpoints are committed and the verdict printed by now.
    exit_without_finalizing(main())  # skips interpreter finalization (see _common)
