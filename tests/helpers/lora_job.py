"""A small LoRA-style job for the incremental saves' tests: a frozen Linear base with a
trainable low-rank adapter beside it, AdamW on the adapter, one training step."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from quicksave.manager import ModelState, OptimizerState

ROWS, COLS = 512, 256  # the frozen weight: 512 KiB of float32, 8 blocks of 64 rows


class Lora(nn.Module):
    """A frozen Linear base with a trainable low-rank adapter beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(COLS, ROWS)
        self.base.requires_grad_(False)
        self.down = nn.Linear(COLS, 16, bias=False)
        self.up = nn.Linear(16, ROWS, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


class Job:
    """The LoRA model, AdamW on its adapters, a training step."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = Lora()
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optim = torch.optim.AdamW(trainable, lr=1e-2)
        self.x = torch.randn(4, COLS)

    def states(self) -> dict[str, Any]:
        return {
            "model": ModelState(self.model),
            "optimizer": OptimizerState(self.model, self.optim),
        }

    def step(self) -> None:
        self.model(self.x).pow(2).mean().backward()
        self.optim.step()
        self.optim.zero_grad()

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}
