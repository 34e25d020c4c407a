"""A training child for the SIGKILL tests: trains a small model and checkpoints every
step to an object-store folder through a CheckpointManager (async, worker process),
printing ``saved <step>`` as each save is submitted. Killed with SIGKILL by the test.

Usage: python s3_trainer.py FOLDER START_STEP STEPS (S3 settings from the environment).
"""

from __future__ import annotations

import sys

import torch

from quicksave.manager import CheckpointConfig, CheckpointManager, OptimizerState


def main(folder: str, steps: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = CheckpointConfig(folder=folder, interval=1, keep_latest_k=3)
    with CheckpointManager(config, {"model": model, "optim": OptimizerState(model, opt)}) as m:
        start = (m.load() or 0) + 1
        print(f"resumed {start - 1}", flush=True)
        for step in range(start, start + steps):
            model(torch.randn(8, 256)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            m.save(step)
            print(f"saved {step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
