"""A small torchtitan-style training job on the CPU, for the torchtitan backend's tests.

The pieces are torchtitan's own (``OptimizersContainer``, ``LRSchedulersContainer``,
``ParallelAwareDataloader``, the checkpoint manager built from its ``Config``); the model
is a tiny language model sharded with FSDP2 (``fully_shard``) when a process group of
several ranks is up. ``train`` mirrors torchtitan's ``Trainer.train``: per step
forward/backward, ``maybe_wait_for_staging()``, ``optimizers.step()``,
``lr_schedulers.step()``, then ``checkpointer.save(step, last_step=...)``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

VOCAB = 61
DIM = 16
SEQ = 8
BATCH = 2


class TinyLM(nn.Module):
    """Embedding, two residual MLP blocks, norm, output: torchtitan's module names."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


class Block(nn.Module):
    """A residual MLP block (one FSDP2 unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, 2 * DIM)
        self.w2 = nn.Linear(2 * DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.w2(F.gelu(self.w1(self.norm(h))))


class TokenStream(IterableDataset):
    """Deterministic token sequences, a different stream per data-parallel rank; its
    position is its state (so the data loader resumes exactly)."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank
        self.pos = 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(1000 * self.dp_rank + self.pos)
            self.pos += 1
            seq = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            yield seq[:-1], seq[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pos = int(state_dict["pos"])


class TrainState:
    """torchtitan's trainer is this Stateful (``{"step", "ntokens_seen"}``)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.ntokens_seen = int(state_dict["ntokens_seen"])


@dataclass
class Job:
    model: nn.Module
    optimizers: Any
    lr_schedulers: Any
    dataloader: ParallelAwareDataloader
    train_state: TrainState
    checkpointer: Any
    steps: int
    data: Any = None


def disabled_checkpoint() -> Any:
    """torchtitan's stock checkpoint config, disabled (a job that saves nothing)."""
    from torchtitan.components.checkpointer import CheckpointManager

    return CheckpointManager.Config(enable=False)


def build(checkpoint_config: Any, base_folder: str, steps: int = 6, layers: int = 2) -> Job:
    """Build the job on this rank (FSDP2 over the world when it has several ranks) and
    its checkpointer from ``checkpoint_config`` (any torchtitan checkpoint Config)."""
    torch.manual_seed(0)
    model = TinyLM(layers)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizers = default_adamw(lr=0.01, weight_decay=0.01)
    optimizers.implementation = "for-loop"
    optimizers = optimizers.build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=steps
    )
    dataloader = ParallelAwareDataloader(
        TokenStream(rank), dp_rank=rank, dp_world_size=world, batch_size=BATCH
    )
    train_state = TrainState()
    checkpointer = checkpoint_config.build(
        dataloader=dataloader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=base_folder,
    )
    return Job(model, optimizers, lr_schedulers, dataloader, train_state, checkpointer, steps)


def train(job: Job, until: int | None = None) -> list[float]:
    """torchtitan's loop from ``job.train_state.step`` to ``until`` (default: the
    job's last step); returns the losses."""
    until = job.steps if until is None else until
    if job.data is None:
        job.data = iter(job.dataloader)
    losses = []
    while job.train_state.step < until:
        job.train_state.step += 1
        tokens, labels = next(job.data)
        logits = job.model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        job.checkpointer.maybe_wait_for_staging()
        job.optimizers.step()
        job.lr_schedulers.step()
        job.optimizers.zero_grad()
        job.train_state.ntokens_seen += tokens.numel()
        losses.append(float(loss.detach()))
        job.checkpointer.save(job.train_state.step, last_step=job.train_state.step == job.steps)
    return losses


def digest(t: torch.Tensor) -> str:
    """dtype, shape and sha256 of a tensor's full value (a DTensor is gathered)."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    full = full.detach().contiguous().cpu()
    raw = full.reshape(-1).view(torch.uint8)
    h = hashlib.sha256(raw.numpy().tobytes()).hexdigest()
    return f"{full.dtype}{list(full.shape)}:{h}"


def fingerprint(job: Job) -> dict[str, Any]:
    """Everything a resume must restore, as plain data (full tensors by digest):
    parameters, optimizer state, LR scheduler, train state, this rank's data position."""
    out: dict[str, Any] = {}
    for name, p in job.model.state_dict().items():
        out[f"model.{name}"] = digest(p)
    for name, v in job.optimizers.state_dict().items():
        out[f"optimizer.{name}"] = digest(v) if isinstance(v, torch.Tensor) else repr(v)
    out["lr_scheduler"] = repr(job.lr_schedulers.state_dict())
    out["lrs"] = repr([s.get_last_lr() for s in job.lr_schedulers])
    out["train_state"] = repr(job.train_state.state_dict())
    out["data_pos"] = job.dataloader.dataset.pos
    return out


def next_batch_digest(job: Job) -> str:
    """The next batch this rank would train on (the data loader's position, observed)."""
    if job.data is None:
        job.data = iter(job.dataloader)
    tokens, labels = next(job.data)
    return digest(tokens) + digest(labels)
