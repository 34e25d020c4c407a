"""Each checkpoint's figures in Weights & Biases.

A small MLP trains with AdamW; a :class:`quicksave.CheckpointManager` (asynchronous
process mode) saves every ``--interval`` steps. The manager's ``on_metrics`` hook gets one
:class:`quicksave.SaveRecord` per checkpoint once it is committed (or failed), on the
training thread, and one line sends its figures to W&B::

    on_metrics=lambda r: wandb.log(r.scalars())

A record settles after its save was made (at a later ``save()``, or ``close()``), so its
figures are plotted against their own step, ``quicksave/step`` (``wandb.define_metric``),
not against the training loop's W&B step. The figures: ``quicksave/blocking_s`` (the time
in ``save()``), ``staging_s``, ``durable_s``, ``throughput_mbps``, ``bytes``, ``failed``.

The run is offline by default (``--mode offline``: nothing is sent; ``wandb sync <run>``
uploads it later); ``--mode online`` logs to your W&B account. Prints::

    logged 4 checkpoints to W&B run <id> (offline, <dir>)

Run it (CPU, a few seconds; ``pip install 'quicksave[wandb]'``)::

    python examples/wandb_metrics.py --folder /tmp/wandb-ckpt --dir /tmp/wandb-runs

Exit status: 0 on success, non-zero on any failure.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import wandb

from quicksave import CheckpointConfig, CheckpointManager, ModelState, OptimizerState, TrainState


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--folder", required=True, help="checkpoint folder")
    p.add_argument("--dir", required=True, help="where W&B keeps the run")
    p.add_argument("--mode", default="offline", choices=("offline", "online", "disabled"))
    p.add_argument("--project", default="quicksave-example")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--interval", type=int, default=2)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = wandb.init(project=args.project, dir=args.dir, mode=args.mode)
    wandb.define_metric("quicksave/step")
    wandb.define_metric("quicksave/*", step_metric="quicksave/step")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_state = TrainState()
    manager = CheckpointManager(
        CheckpointConfig(
            folder=args.folder,
            interval=args.interval,
            on_metrics=lambda r: wandb.log(r.scalars()),
        ),
        {"model": ModelState(model), "optim": OptimizerState(model, optim), "train": train_state},
    )
    for step in range(train_state.step + 1, args.steps + 1):
        x = torch.randn(32, 64)
        loss = F.mse_loss(model(x), x[:, :8])
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()  # waits, through the manager's hook, for the last save's copy
        train_state.step = step
        wandb.log({"train/loss": loss.item()})
        manager.save(step)
    manager.close()  # the last checkpoint commits; its record reaches the hook
    run.finish()
    print(f"logged {len(manager.metrics)} checkpoints to W&B run {run.id} ({args.mode}, {run.dir})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
