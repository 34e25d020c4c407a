"""QuicksaveCheckpointIO with incremental saves (``EngineConfig.incremental``, FORMAT.md
§9) in a real Lightning Trainer: ``ModelCheckpoint``'s top-k removals never delete a
checkpoint that a kept one refers to (put off until nothing does, then removed), and
every checkpoint left verifies and loads bit-exactly."""

from __future__ import annotations

import json
import os
import threading
import warnings
from pathlib import Path

import lightning as L  # an optional dependency of quicksave, pinned in the dev extra
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

import quicksave
from quicksave.errors import CheckpointError
from quicksave.format import MANIFEST_NAME
from quicksave.integrations.lightning import QuicksaveCheckpointIO, read_checkpoint
from quicksave.loading.run_folder import committed_steps
from quicksave.loading.verify import verify_checkpoint
from quicksave.saving.config import EngineConfig
from quicksave.worker import persisters

warnings.filterwarnings("ignore", module="lightning")


class Lora(L.LightningModule):
    """A frozen 512 KiB base (8 blocks of 64 KiB) and a trainable adapter beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(256, 512)
        self.base.requires_grad_(False)
        self.down = nn.Linear(256, 4, bias=False)
        self.up = nn.Linear(4, 512, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))

    def training_step(self, batch, batch_idx):
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=1e-2)


def _loader() -> torch.utils.data.DataLoader:
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=8)


def _engine(full_every: int) -> EngineConfig:
    incremental = quicksave.IncrementalConfig(
        enabled=True, block_bytes=64 << 10, min_bytes=1024, full_every=full_every
    )
    return EngineConfig(mode="thread", max_in_flight=2, incremental=incremental)


def _trainer(root: Path, io: QuicksaveCheckpointIO, epochs: int, top_k: int = 2) -> L.Trainer:
    ckpt = ModelCheckpoint(
        dirpath=root,
        filename="step-{step}",
        auto_insert_metric_name=False,
        monitor="step",
        mode="max",
        save_top_k=top_k,
        every_n_epochs=1,
        # (its own state, best_k_models keyed by checkpoint path, changes the layout of
        # a full checkpoint at every save, and a save with a new layout is full)
        save_weights_only=True,
    )
    ckpt.FILE_EXTENSION = ""  # step-<N>: the names references can name
    return L.Trainer(
        default_root_dir=root,
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        plugins=[io],
        callbacks=[ckpt],
    )


def _settle_earlier(io: QuicksaveCheckpointIO, saved: list[str]) -> None:
    """Wait for the earlier async saves' commits, so that the next save may refer to
    them whatever the machine's load (a save while another is in flight is full)."""
    for target in saved:
        io._settle(target)
    saved.clear()


def _bases(checkpoint: Path) -> set[int]:
    doc = json.loads((checkpoint / MANIFEST_NAME).read_bytes())
    return {c["base"] for t in doc["tensors"].values() for c in t["chunks"] if "base" in c}


def test_top_k_never_removes_a_checkpoint_a_kept_one_refers_to(tmp_path, monkeypatch) -> None:
    root = tmp_path / "ckpt"
    seen: list[tuple[str, list[int], dict[int, set[int]]]] = []
    weights: dict[int, dict[str, torch.Tensor]] = {}
    real_remove = QuicksaveCheckpointIO.remove_checkpoint
    real_save = QuicksaveCheckpointIO.save_checkpoint
    saved: list[str] = []

    def save(self, checkpoint, path, storage_options=None):
        weights[checkpoint["global_step"]] = {
            k: v.clone() for k, v in checkpoint["state_dict"].items()
        }
        _settle_earlier(self, saved)
        real_save(self, checkpoint, path, storage_options)
        saved.append(os.fspath(path))

    def remove(self, path):
        real_remove(self, path)
        steps = committed_steps(root)
        seen.append((os.path.basename(path), steps, {s: _bases(root / f"step-{s}") for s in steps}))
        for s in steps:  # every checkpoint left is whole, its bases included
            assert verify_checkpoint(root / f"step-{s}").ok, (path, s)

    monkeypatch.setattr(QuicksaveCheckpointIO, "save_checkpoint", save)
    monkeypatch.setattr(QuicksaveCheckpointIO, "remove_checkpoint", remove)
    torch.manual_seed(0)
    # 4 batches an epoch: saves at steps 4 (full), 8 (refers to 4), 12 (full: every
    # 2nd of a chain), 16 (refers to 12); top-2 removes 4 after 12, and 8 after 16
    _trainer(root, QuicksaveCheckpointIO(async_save=True, engine=_engine(2)), 4).fit(
        Lora(), _loader()
    )
    assert [name for name, _, _ in seen] == ["step-4", "step-8"]
    # step-4 outlived its removal: step-8, kept, refers to it (step-12, just saved, may
    # still be in flight: a save returns once staged)
    assert seen[0][1][:2] == [4, 8] and seen[0][2][8] == {4}, seen[0]
    # once step-8 went, nothing referred to step-4: it went too
    assert seen[1][1][0] == 12 and 4 not in seen[1][1], seen[1]
    assert committed_steps(root) == [12, 16]
    assert _bases(root / "step-12") == set() and _bases(root / "step-16") == {12}
    for step in (12, 16):
        got = read_checkpoint(root / f"step-{step}")["state_dict"]
        assert got.keys() == weights[step].keys()
        for k, v in weights[step].items():
            assert torch.equal(got[k], v), (step, k)


def test_a_checkpoint_a_save_in_flight_may_refer_to_is_kept(tmp_path, monkeypatch) -> None:
    """Top-1: Lightning removes step-4 right after starting the save of step-8, which
    refers to it; that save's writer is held until the removal returned, so step-4
    must outlive it (its referrer's manifest is not written yet), and go once nothing
    refers to it."""
    root = tmp_path / "ckpt"
    gate = threading.Event()
    original = persisters.execute_job

    def gated(job, pool, *rest):
        if job.step == 8:
            assert gate.wait(60)
        return original(job, pool, *rest)

    real_remove = QuicksaveCheckpointIO.remove_checkpoint
    real_save = QuicksaveCheckpointIO.save_checkpoint
    left: list[tuple[str, list[int]]] = []
    saved: list[str] = []

    def save(self, checkpoint, path, storage_options=None):
        _settle_earlier(self, saved)
        real_save(self, checkpoint, path, storage_options)
        saved.append(os.fspath(path))

    def remove(self, path):
        real_remove(self, path)
        left.append((os.path.basename(path), committed_steps(root)))
        gate.set()  # step-8's writer goes on

    monkeypatch.setattr(persisters, "execute_job", gated)
    monkeypatch.setattr(QuicksaveCheckpointIO, "save_checkpoint", save)
    monkeypatch.setattr(QuicksaveCheckpointIO, "remove_checkpoint", remove)
    torch.manual_seed(0)
    io = QuicksaveCheckpointIO(async_save=True, engine=_engine(8))
    _trainer(root, io, 3, top_k=1).fit(Lora(), _loader())  # saves 4, 8 (-> 4), 12 (-> 4)
    assert left[0] == ("step-4", [4])  # put off: step-8, in flight, refers to it
    assert [name for name, _ in left] == ["step-4", "step-8"]
    assert committed_steps(root) == [4, 12]  # step-12 refers to step-4 too
    assert _bases(root / "step-12") == {4}
    for step in (4, 12):
        assert verify_checkpoint(root / f"step-{step}").ok, step


def test_incremental_needs_the_async_engine() -> None:
    with pytest.raises(CheckpointError, match="use async_save=True"):
        QuicksaveCheckpointIO(engine=_engine(8))
