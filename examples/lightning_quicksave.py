"""Lightning training checkpointed by quicksave: ModelCheckpoint, a resume, bit for bit.

A small MLP (a LightningModule with AdamW and a step LR schedule) learns a fixed random
regression task. ``QuicksaveCheckpointIO`` is the Trainer's checkpoint plugin, so every
checkpoint ``ModelCheckpoint`` writes (the two best on ``val_loss``, and ``last.ckpt``
every epoch) is a quicksave checkpoint directory: raw tensor bytes and typed JSON,
committed atomically, never pickled; ``last.ckpt`` is replaced atomically each epoch.

The script runs three trainings in one process:

1. a first job trains ``--first-epochs`` epochs and stops (as a job ends at its time
   limit);
2. a second job, a new Trainer and a freshly initialised module, resumes with
   ``trainer.fit(model, ckpt_path="last")`` and trains to ``--epochs``;
3. an uninterrupted run of ``--epochs`` epochs, without checkpoints.

It then checks that the resumed run ends with the same parameters and optimizer state
(AdamW's moments and step counts) as the uninterrupted one, bit for bit, and rebuilds
the best model with ``quicksave.integrations.lightning.load_from_checkpoint``. It prints::

    resumed from <root>/checkpoints/last.ckpt at epoch 2
    final parameters and optimizer state match the uninterrupted run: yes

Run it (CPU, a few seconds; ``pip install -e '.[lightning]'``)::

    python examples/lightning_quicksave.py --root /tmp/lightning-qs
    python examples/lightning_quicksave.py --root /tmp/lightning-qs-async --async
    python examples/lightning_quicksave.py --root /tmp/lq --first-epochs 1 --epochs 2

``--async`` saves through quicksave's async engine: ``save_checkpoint`` returns once the
tensors are copied into a staging pool and a worker process writes the checkpoint while
training goes on. ``--root`` must not hold checkpoints of an earlier run (``fit`` would
resume from them). Exit status: 0 if the resumed run matches, 1 if not.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from quicksave.integrations.lightning import QuicksaveCheckpointIO, load_from_checkpoint


class Regressor(L.LightningModule):
    """A two-layer MLP; its hyper-parameters go into every checkpoint."""

    def __init__(self, hidden: int = 32, lr: float = 0.01, gamma: float = 0.8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=self.hparams.gamma)
        return {"optimizer": opt, "lr_scheduler": sched}


def loaders(samples: int, batch_size: int):
    """A fixed task: y = tanh(x . w / 3) + noise, the same in every run (no shuffling)."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    y = torch.tanh(x @ w / 3) + 0.05 * torch.randn(samples, 1, generator=g)
    n = samples * 3 // 4

    def loader(a, b):
        data = torch.utils.data.TensorDataset(x[a:b], y[a:b])
        return torch.utils.data.DataLoader(data, batch_size=batch_size)

    return loader(0, n), loader(n, samples)


class ReportResume(Callback):
    """Prints where training starts: the checkpoint and epoch a resume restored."""

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.ckpt_path:
            print(f"resumed from {trainer.ckpt_path} at epoch {trainer.current_epoch}")


def trainer_for(root: str, epochs: int, plugin: QuicksaveCheckpointIO | None) -> L.Trainer:
    checkpointing = plugin is not None
    callbacks: list[Callback] = [ReportResume()]
    if checkpointing:
        callbacks.append(
            ModelCheckpoint(
                dirpath=os.path.join(root, "checkpoints"),
                monitor="val_loss",
                save_top_k=2,
                save_last=True,
                every_n_epochs=1,
            )
        )
    return L.Trainer(
        default_root_dir=root,
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=checkpointing,
        deterministic=True,
        num_sanity_val_steps=0,
        plugins=[plugin] if plugin is not None else None,
        callbacks=callbacks,
    )


def same_state(a: L.Trainer, b: L.Trainer) -> bool:
    """Parameters, then the optimizer state (moments, steps, groups), bit for bit."""
    pa, pb = a.lightning_module.state_dict(), b.lightning_module.state_dict()
    if pa.keys() != pb.keys() or not all(torch.equal(pa[k], pb[k]) for k in pa):
        return False
    oa, ob = a.optimizers[0].state_dict(), b.optimizers[0].state_dict()
    if oa["param_groups"] != ob["param_groups"] or oa["state"].keys() != ob["state"].keys():
        return False
    return all(
        oa["state"][i].keys() == ob["state"][i].keys()
        and all(torch.equal(oa["state"][i][k], ob["state"][i][k]) for k in oa["state"][i])
        for i in oa["state"]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", help="run directory (default: a new temporary directory)")
    p.add_argument("--epochs", type=int, default=4, help="epochs in all")
    p.add_argument("--first-epochs", type=int, default=2, help="epochs of the first job")
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--async", dest="async_save", action="store_true", help="async saves")
    args = p.parse_args(argv)
    if not 0 < args.first_epochs < args.epochs:
        p.error("need 0 < --first-epochs < --epochs")
    root = args.root or tempfile.mkdtemp(prefix="lightning-quicksave-")
    warnings.filterwarnings("ignore", module="lightning")  # tips and notices
    train, val = loaders(args.samples, args.batch_size)

    def plugin() -> QuicksaveCheckpointIO:
        return QuicksaveCheckpointIO(async_save=args.async_save)

    # 1. the first job
    torch.manual_seed(0)
    trainer_for(root, args.first_epochs, plugin()).fit(Regressor(), train, val)
    # 2. a new job resumes from last.ckpt (the module's own init is overwritten by it)
    torch.manual_seed(99)
    resumed = trainer_for(root, args.epochs, plugin())
    resumed.fit(Regressor(), train, val, ckpt_path="last")
    # 3. the uninterrupted run
    torch.manual_seed(0)
    straight = trainer_for(os.path.join(root, "uninterrupted"), args.epochs, None)
    straight.fit(Regressor(), train, val)

    folder = os.path.join(root, "checkpoints")
    for name in sorted(os.listdir(folder)):
        files = sorted(os.listdir(os.path.join(folder, name)))
        print(f"checkpoint {name}/: {', '.join(files)}")
    best = resumed.checkpoint_callback.best_model_path
    model = load_from_checkpoint(Regressor, best)
    print(
        f"load_from_checkpoint({os.path.basename(best)}): hparams {dict(model.hparams)}, "
        f"best val_loss {float(resumed.checkpoint_callback.best_model_score):.6f}"
    )
    ok = same_state(resumed, straight)
    print(
        f"final parameters and optimizer state match the uninterrupted run: {'yes' if ok else 'no'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
