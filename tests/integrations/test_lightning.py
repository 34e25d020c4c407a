"""quicksave.integrations.lightning: QuicksaveCheckpointIO in real Lightning Trainers.

The reference for every mode is the same run with Lightning's own TorchCheckpointIO:
train 2 epochs (ModelCheckpoint: top-2 on val_loss, last.ckpt every epoch), then a new
Trainer resumes with ``fit(ckpt_path="last")`` to 4 epochs. With quicksave (sync, the
native async engine, and wrapped in Lightning's AsyncCheckpointIO) the final parameters
and optimizer state must be bit-identical, the same checkpoints must be kept, and the
optimizer state right after the restore must be the saved one. A control run whose
optimizer int keys come back as strings (optimizer state silently not restored) must
differ, so the comparison can tell.
"""

from __future__ import annotations

import copy
import math
import os
import re
import subprocess
import sys
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import lightning as L  # an optional dependency of quicksave, pinned in the dev extra
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from torch import nn

import quicksave
from quicksave.commit import CheckpointKind, classify
from quicksave.commit import files as commit
from quicksave.errors import CheckpointError, CheckpointExistsError, IncompatibleStateError
from quicksave.integrations._lightning_process import PROCESS
from quicksave.integrations.lightning import (
    QuicksaveCheckpointIO,
    load_from_checkpoint,
    read_checkpoint,
)
from quicksave.saving.config import EngineConfig

REPO = Path(__file__).resolve().parents[2]
EPOCHS_FIRST, EPOCHS_TOTAL = 2, 4
THREAD_ENGINE = EngineConfig(mode="thread", max_in_flight=2)

warnings.filterwarnings("ignore", module="lightning")  # tips, "dir not empty", ...


# ------------------------------------------------------------------ model and runs
class MLP(L.LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.02, note: str = "mlp") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.7)}


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = (x**2).sum(1, keepdim=True)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


class OptimizerAtStart(Callback):
    """Records the optimizer state when training starts (after a resume's restore)."""

    def __init__(self) -> None:
        self.state: dict | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.state = copy.deepcopy(trainer.optimizers[0].state_dict())


def _trainer(
    root: Path, plugins, epochs: int, *callbacks: Callback, checkpoints: bool = True, **ckpt: Any
) -> L.Trainer:
    ckpt = {"monitor": "val_loss", "save_top_k": 2, "save_last": True, **ckpt}
    if checkpoints:
        callbacks = (ModelCheckpoint(dirpath=root / "ckpt", every_n_epochs=1, **ckpt), *callbacks)
    return L.Trainer(
        default_root_dir=root,
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        num_sanity_val_steps=0,
        plugins=plugins,
        enable_checkpointing=checkpoints,
        callbacks=list(callbacks),
    )


def _train_and_resume(root: Path, make_plugins) -> dict[str, Any]:
    """2 epochs, then a new Trainer (and a differently initialised module) resumes from
    last.ckpt to 4 epochs. Returns what the comparisons need."""
    torch.manual_seed(0)
    _trainer(root, make_plugins(), EPOCHS_FIRST).fit(MLP(), _loader(), _loader())
    torch.manual_seed(1)  # the restore, not the init, must decide the outcome
    model = MLP()
    at_start = OptimizerAtStart()
    trainer = _trainer(root, make_plugins(), EPOCHS_TOTAL, at_start)
    trainer.fit(model, _loader(), _loader(), ckpt_path="last")
    return {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optim": copy.deepcopy(trainer.optimizers[0].state_dict()),
        "optim_at_restore": at_start.state,
        "kept": sorted(os.listdir(root / "ckpt")),
        "best": trainer.checkpoint_callback.best_model_path,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "model": model,
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Any]:
    """The run with Lightning's own TorchCheckpointIO (torch.save files)."""
    root = tmp_path_factory.mktemp("torch")
    out = _train_and_resume(root, lambda: [TorchCheckpointIO()])
    out["root"] = root
    return out


def _assert_bit_identical(got: dict, ref: dict) -> None:
    assert got["params"].keys() == ref["params"].keys()
    for k, v in ref["params"].items():
        assert torch.equal(got["params"][k], v), k
    _assert_same_optimizer_state(got["optim"], ref["optim"])
    assert got["lr"] == ref["lr"]


def _assert_same_optimizer_state(got: dict, ref: dict) -> None:
    assert list(got["state"]) == list(ref["state"]) == [0, 1, 2, 3]
    for pid, moments in ref["state"].items():
        assert set(got["state"][pid]) == {"step", "exp_avg", "exp_avg_sq"}
        for name, t in moments.items():
            assert torch.equal(got["state"][pid][name], t), (pid, name)
    assert got["param_groups"] == ref["param_groups"]


MODES = {
    "sync": lambda: [QuicksaveCheckpointIO()],
    "native-async": lambda: [QuicksaveCheckpointIO(async_save=True, engine=THREAD_ENGINE)],
    "lightning-async-wrapper": lambda: [AsyncCheckpointIO(QuicksaveCheckpointIO())],
}


@pytest.mark.parametrize("mode", list(MODES))
def test_resume_is_bit_identical_to_torch_checkpoint_io(mode, reference, tmp_path, monkeypatch):
    removed: list[tuple[str, CheckpointKind, CheckpointKind]] = []
    real_remove = QuicksaveCheckpointIO.remove_checkpoint

    def remove(self, path):
        before = classify(str(path))
        real_remove(self, path)
        removed.append((os.path.basename(path), before, classify(str(path))))

    monkeypatch.setattr(QuicksaveCheckpointIO, "remove_checkpoint", remove)
    got = _train_and_resume(tmp_path, MODES[mode])
    _assert_bit_identical(got, reference)
    # The optimizer moments were restored: right after the restore they are what the
    # reference run restored from its torch.save last.ckpt (2 epochs x 4 steps).
    _assert_same_optimizer_state(got["optim_at_restore"], reference["optim_at_restore"])
    assert got["optim_at_restore"]["state"][0]["step"] == torch.tensor(8.0)
    # The same checkpoints were kept (top-2 + last), each a committed quicksave directory;
    # the other two top-k checkpoints were removed; no temporaries are left.
    kept = ["epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt", "last.ckpt"]
    assert got["kept"] == reference["kept"] == kept
    for name in got["kept"]:
        assert classify(str(tmp_path / "ckpt" / name)) is CheckpointKind.QUICKSAVE, name
        assert os.path.isfile(reference["root"] / "ckpt" / name)
    gone = (CheckpointKind.QUICKSAVE, CheckpointKind.MISSING)
    assert removed == [("epoch=0-step=4.ckpt", *gone), ("epoch=1-step=8.ckpt", *gone)]


def test_a_resume_without_the_optimizer_moments_would_differ(reference, tmp_path):
    """The control: the optimizer's int keys as strings (quicksave before load_state)
    make torch's Optimizer.load_state_dict keep the moments under keys no parameter
    uses, i.e. they are silently not restored. The bit-exact comparison must see it."""

    class StringKeys(QuicksaveCheckpointIO):
        def load_checkpoint(self, path, map_location=None, weights_only=None):
            ck = super().load_checkpoint(path, map_location, weights_only)
            for opt in ck["optimizer_states"]:
                opt["state"] = {str(k): v for k, v in opt["state"].items()}
            return ck

    torch.manual_seed(0)
    _trainer(tmp_path, MODES["sync"](), EPOCHS_FIRST).fit(MLP(), _loader(), _loader())
    torch.manual_seed(1)
    model = MLP()
    at_start = OptimizerAtStart()
    # No checkpoints in this run: a state dict holding both 0 and "0" keys cannot be
    # saved (DCP's flattening names both "...state.0").
    trainer = _trainer(tmp_path, [StringKeys()], EPOCHS_TOTAL, at_start, checkpoints=False)
    trainer.fit(model, _loader(), _loader(), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert at_start.state["state"].keys() == {"0", "1", "2", "3"}
    assert not all(torch.equal(model.state_dict()[k], v) for k, v in reference["params"].items())


def test_optimizer_state_right_after_restore_is_the_saved_one(tmp_path):
    torch.manual_seed(0)
    _trainer(tmp_path, [QuicksaveCheckpointIO()], EPOCHS_FIRST).fit(MLP(), _loader(), _loader())
    saved = read_checkpoint(tmp_path / "ckpt" / "last.ckpt")["optimizer_states"][0]
    at_start = OptimizerAtStart()
    torch.manual_seed(1)
    trainer = _trainer(tmp_path, [QuicksaveCheckpointIO()], EPOCHS_FIRST + 1, at_start)
    trainer.fit(MLP(), _loader(), _loader(), ckpt_path="last")
    _assert_same_optimizer_state(at_start.state, saved)
    assert saved["state"][0]["step"] == torch.tensor(8.0)  # 2 epochs x 4 batches


# ------------------------------------------------------------------ what is stored
def _normalized(value: Any, root: str) -> Any:
    """``value`` with the run's directory replaced by ``<root>`` in every string."""
    if isinstance(value, str):
        return value.replace(root, "<root>")
    if isinstance(value, dict):
        return type(value)((_normalized(k, root), _normalized(v, root)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_normalized(v, root) for v in value)
    return value


def _assert_same_tree(got: Any, ref: Any, where: str = "") -> None:
    if isinstance(ref, OrderedDict):  # documented: an OrderedDict comes back as a dict
        assert type(got) is dict, where
    else:
        assert type(got) is type(ref), (where, type(got), type(ref))
    if isinstance(ref, dict):
        typed = {(type(k), k) for k in got}  # int keys stay ints, str keys strs
        assert typed == {(type(k), k) for k in ref}, (where, typed ^ {(type(k), k) for k in ref})
        for k in ref:
            _assert_same_tree(got[k], ref[k], f"{where}.{k}")
    elif isinstance(ref, (list, tuple)):
        assert len(got) == len(ref), where
        for i, (g, r) in enumerate(zip(got, ref, strict=True)):
            _assert_same_tree(g, r, f"{where}[{i}]")
    elif isinstance(ref, torch.Tensor):
        assert got.dtype == ref.dtype and torch.equal(got, ref), where
    elif isinstance(ref, float) and math.isnan(ref):
        assert math.isnan(got), where
    else:
        assert got == ref, where


def test_load_checkpoint_returns_what_torch_checkpoint_io_would(reference, tmp_path):
    """Every key, type and value of a quicksave last.ckpt equals the torch.save one of
    the reference run (paths aside): int keys as ints, tuples as tuples, empty dicts."""
    _train_and_resume(tmp_path, MODES["sync"])
    got = QuicksaveCheckpointIO().load_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    ref = torch.load(reference["root"] / "ckpt" / "last.ckpt", weights_only=False)
    got = _normalized(got, str(tmp_path))
    ref = _normalized(ref, str(reference["root"]))
    _assert_same_tree(got, ref)
    assert list(got["optimizer_states"][0]["state"]) == [0, 1, 2, 3]
    assert type(got["optimizer_states"][0]["param_groups"][0]["betas"]) is tuple
    assert got["loops"]["fit_loop"]["state_dict"] == {}


def test_map_location_moves_every_tensor(tmp_path):
    io = QuicksaveCheckpointIO()
    ck = {
        "state_dict": {"w": torch.ones(3)},
        "optimizer_states": [{"state": {0: {"s": torch.ones(1)}}}],
    }
    io.save_checkpoint(ck, tmp_path / "a.ckpt")

    def devices(c):
        return {
            c["state_dict"]["w"].device.type,
            c["optimizer_states"][0]["state"][0]["s"].device.type,
        }

    assert devices(io.load_checkpoint(tmp_path / "a.ckpt")) == {"cpu"}
    for where in ("meta", torch.device("meta"), {"cpu": "meta"}):
        assert devices(io.load_checkpoint(tmp_path / "a.ckpt", map_location=where)) == {"meta"}
    keep = io.load_checkpoint(tmp_path / "a.ckpt", map_location=lambda storage, loc: storage)
    assert devices(keep) == {"cpu"} and torch.equal(keep["state_dict"]["w"], torch.ones(3))
    with pytest.raises(TypeError, match="map_location"):
        io.load_checkpoint(tmp_path / "a.ckpt", map_location=3)


def test_unstorable_hyper_parameter_is_refused_naming_key_and_path(tmp_path):
    class WithPath(MLP):
        def __init__(self, data_dir: Path = Path("/data"), **kw):
            super().__init__(**kw)

    trainer = _trainer(tmp_path, [QuicksaveCheckpointIO()], 1)
    with pytest.raises(IncompatibleStateError) as e:
        trainer.fit(WithPath(), _loader(), _loader())
    err = e.value
    assert err.fqn == "hyper_parameters.data_dir"
    assert err.path == str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt")
    assert "PosixPath cannot be stored without pickle" in err.message
    assert "save_hyperparameters(ignore=[...])" in err.message
    assert not (tmp_path / "ckpt").exists()  # refused before any I/O


# ------------------------------------------------------------- last.ckpt replacement
class PoisonLastAtEpoch(QuicksaveCheckpointIO):
    """Puts an un-encodable value into the last.ckpt saved at ``epoch``."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        if os.path.basename(path) == "last.ckpt" and checkpoint["epoch"] == self.epoch:
            checkpoint = {**checkpoint, "poison": object()}
        super().save_checkpoint(checkpoint, path, storage_options)


def test_last_ckpt_is_replaced_atomically_and_kept_whole_when_the_save_fails(tmp_path, monkeypatch):
    last = tmp_path / "ckpt" / "last.ckpt"
    seen: list[str] = []
    exchanges: list[tuple[str, bool]] = []
    real_rename, real_rmtree = os.rename, commit.shutil.rmtree
    real_exchange = commit._rename_exchange

    def committed(what: str) -> None:
        # Once last.ckpt exists, it is a whole checkpoint before and after every rename
        # and every deletion: never deleted (or moved away) and then written.
        if seen or last.exists():
            seen.append(what)
            assert classify(str(last)) is CheckpointKind.QUICKSAVE, what

    def exchange(a, b):
        committed("before exchange")
        done = real_exchange(a, b)
        exchanges.append((os.path.basename(b), done))
        committed("after exchange")
        return done

    def rename(a, b):
        committed("before rename")
        real_rename(a, b)
        committed("after rename")

    def rmtree(p, *a, **kw):
        committed("before rmtree")
        real_rmtree(p, *a, **kw)
        committed("after rmtree")

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(commit.shutil, "rmtree", rmtree)
    monkeypatch.setattr(commit, "_rename_exchange", exchange)
    torch.manual_seed(0)
    trainer = _trainer(tmp_path, [PoisonLastAtEpoch(2)], 3)
    with pytest.raises(IncompatibleStateError) as e:
        trainer.fit(MLP(), _loader(), _loader())
    monkeypatch.undo()
    assert e.value.fqn == "poison" and e.value.path == str(last)
    # epochs 0 and 1 wrote last.ckpt (the second replaced the first in one exchange,
    # then the old one was deleted); epoch 2's save failed and left epoch 1's whole.
    assert exchanges == [("last.ckpt", True)]
    assert "after rmtree" in seen
    ck = read_checkpoint(last)
    assert ck["epoch"] == 1 and ck["global_step"] == 8
    assert sorted(os.listdir(tmp_path / "ckpt")) == [
        "epoch=1-step=8.ckpt",
        "epoch=2-step=12.ckpt",
        "last.ckpt",
    ]


def test_a_failed_write_of_last_ckpt_keeps_the_old_one(tmp_path, monkeypatch):
    io = QuicksaveCheckpointIO()
    last = tmp_path / "last.ckpt"
    io.save_checkpoint({"epoch": 1, "w": torch.ones(8)}, last)

    def damaged(tmp, expected, final):
        raise CheckpointError("cannot commit: a file is gone", path=final)

    monkeypatch.setattr(commit, "check_whole", damaged)
    with pytest.raises(CheckpointError, match="a file is gone"):
        io.save_checkpoint({"epoch": 2, "w": torch.zeros(8)}, last)
    monkeypatch.undo()
    ck = io.load_checkpoint(last)
    assert ck["epoch"] == 1 and torch.equal(ck["w"], torch.ones(8))
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_save_refuses_to_replace_what_is_not_a_quicksave_checkpoint(tmp_path):
    f = tmp_path / "last.ckpt"
    torch.save({"epoch": 0}, f)
    with pytest.raises(CheckpointExistsError, match="a file is in the way"):
        QuicksaveCheckpointIO().save_checkpoint({"epoch": 1}, f)
    assert torch.load(f) == {"epoch": 0}
    with pytest.raises(CheckpointError, match="TorchCheckpointIO"):
        QuicksaveCheckpointIO().load_checkpoint(f)


# ------------------------------------------------------------------ removal
def test_remove_checkpoint_removes_only_quicksave_checkpoints(tmp_path):
    io = QuicksaveCheckpointIO()
    ck = tmp_path / "epoch=0-step=4.ckpt"
    io.save_checkpoint({"w": torch.ones(2)}, ck)
    link = tmp_path / "last.ckpt"
    link.symlink_to(ck.name)  # ModelCheckpoint(save_last="link")
    io.remove_checkpoint(link)
    assert not link.exists() and not link.is_symlink() and ck.is_dir()
    io.remove_checkpoint(ck)
    assert not ck.exists()
    io.remove_checkpoint(ck)  # nothing there: nothing to do
    assert os.listdir(tmp_path) == []

    f = tmp_path / "model.ckpt"
    f.write_bytes(b"torch.save bytes")
    d = tmp_path / "data"
    d.mkdir()
    (d / "train.csv").write_text("1,2\n")
    for path in (f, d):
        with pytest.raises(CheckpointError, match="refusing to delete") as e:
            io.remove_checkpoint(path)
        assert e.value.path == str(path)
    assert f.read_bytes() == b"torch.save bytes" and (d / "train.csv").exists()


# ------------------------------------------------------------------ native async
def test_native_async_waits_for_a_save_before_reusing_its_path(tmp_path):
    io = QuicksaveCheckpointIO(async_save=True, engine=THREAD_ENGINE)
    p = tmp_path / "last.ckpt"
    io.save_checkpoint({"v": torch.full((1024,), 1.0)}, p)
    io.save_checkpoint({"v": torch.full((1024,), 2.0)}, p)  # waits, then replaces
    assert torch.equal(io.load_checkpoint(p)["v"], torch.full((1024,), 2.0))
    q = tmp_path / "epoch=0-step=4.ckpt"
    io.save_checkpoint({"v": torch.ones(1024)}, q)
    io.remove_checkpoint(q)  # waits for the save, then removes: nothing comes back
    io.teardown()
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_native_async_failures_surface_at_reuse_and_teardown(tmp_path, monkeypatch):
    io = QuicksaveCheckpointIO(async_save=True, engine=THREAD_ENGINE)
    p = tmp_path / "last.ckpt"
    io.save_checkpoint({"v": torch.ones(4)}, p)
    io.teardown()

    def damaged(tmp, expected, final):
        raise CheckpointError("cannot commit: a file is gone", path=final)

    monkeypatch.setattr(commit, "check_whole", damaged)
    io.save_checkpoint({"v": torch.zeros(4)}, p)  # returns once staged
    with pytest.raises(CheckpointError, match="a file is gone") as e:
        io.save_checkpoint({"v": torch.zeros(4)}, p)  # the one in flight failed
    assert e.value.path == str(p)
    io.save_checkpoint({"v": torch.zeros(4)}, tmp_path / "other.ckpt")
    with pytest.raises(CheckpointError, match="a file is gone"):
        io.teardown()
    monkeypatch.undo()
    assert torch.equal(io.load_checkpoint(p)["v"], torch.ones(4))  # the old one, whole
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]
    io.teardown()  # nothing left to report


def test_native_async_refuses_unstorable_values_before_staging(tmp_path):
    io = QuicksaveCheckpointIO(async_save=True, engine=THREAD_ENGINE)
    with pytest.raises(IncompatibleStateError) as e:
        io.save_checkpoint({"callbacks": {"Timer": {"t": object()}}}, tmp_path / "a.ckpt")
    assert e.value.fqn == "callbacks.Timer.t" and "callback's state_dict()" in e.value.message
    assert e.value.path == str(tmp_path / "a.ckpt")
    io.teardown()
    assert os.listdir(tmp_path) == []


def test_remove_waits_for_a_save_running_in_another_thread(tmp_path, monkeypatch):
    """Under Lightning's AsyncCheckpointIO the save runs in its thread while the
    training thread may remove the same path: the removal waits, nothing comes back."""
    import threading

    io = QuicksaveCheckpointIO()
    p = tmp_path / "epoch=0-step=4.ckpt"
    entered, go = threading.Event(), threading.Event()
    real_write = quicksave.worker.persist.write_file

    def held(*args, **kwargs):
        entered.set()
        assert go.wait(60)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(quicksave.worker.persist, "write_file", held)
    saver = threading.Thread(target=io.save_checkpoint, args=({"w": torch.ones(4)}, p))
    saver.start()
    assert entered.wait(60)
    remover = threading.Thread(target=io.remove_checkpoint, args=(p,))
    remover.start()
    remover.join(0.2)
    assert remover.is_alive()  # blocked behind the save (it cannot have finished)
    go.set()
    saver.join(60)
    remover.join(60)
    assert not saver.is_alive() and not remover.is_alive()
    assert os.listdir(tmp_path) == []


def test_object_store_resave_error_says_why(monkeypatch):
    url = "s3://bucket/run/last.ckpt"

    def exists(*args, **kwargs):
        raise CheckpointExistsError("a committed checkpoint already exists here", path=url)

    monkeypatch.setattr(quicksave, "save", exists)
    with pytest.raises(CheckpointExistsError, match=r"save_last=True\) saves last.ckpt again"):
        QuicksaveCheckpointIO().save_checkpoint({"epoch": 1}, url)


def test_pickles_its_configuration_only(tmp_path):
    """strategy="ddp_spawn" pickles the Trainer, and so the plugin, to its processes."""
    import pickle

    io = QuicksaveCheckpointIO(async_save=True, engine=THREAD_ENGINE, thread_count=3)
    io.save_checkpoint({"w": torch.ones(4)}, tmp_path / "a.ckpt")
    copy_ = pickle.loads(pickle.dumps(io))
    assert (copy_.async_save, copy_.engine, copy_.thread_count) == (True, THREAD_ENGINE, 3)
    assert copy_._savers == {} and PROCESS.saves.owned(copy_) == []
    io.teardown()
    assert torch.equal(copy_.load_checkpoint(tmp_path / "a.ckpt")["w"], torch.ones(4))


def test_storage_options_must_be_quicksave_storage_options(tmp_path):
    with pytest.raises(TypeError, match="StorageOptions"):
        QuicksaveCheckpointIO().save_checkpoint({}, tmp_path / "a.ckpt", storage_options={})


def test_object_store_resave_is_refused_naming_the_url():
    with pytest.raises(CheckpointError, match="not supported on an object store") as e:
        quicksave.save({"w": torch.ones(1)}, "s3://bucket/run/last.ckpt", overwrite=True)
    assert e.value.path == "s3://bucket/run/last.ckpt"


# ------------------------------------------------------------------ load_from_checkpoint
def test_load_from_checkpoint_rebuilds_the_trained_module(tmp_path):
    torch.manual_seed(0)
    model = MLP(hidden=8, lr=0.05, note="trained")
    _trainer(tmp_path, [QuicksaveCheckpointIO()], 2).fit(model, _loader(), _loader())
    path = tmp_path / "ckpt" / "last.ckpt"
    loaded = load_from_checkpoint(MLP, path)
    assert type(loaded) is MLP
    assert dict(loaded.hparams) == {"hidden": 8, "lr": 0.05, "note": "trained"}
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    over = load_from_checkpoint(MLP, path, note="override", map_location="cpu")
    assert over.hparams.note == "override" and over.hparams.hidden == 8
    # Lightning's own classmethod reads files with torch.load: it cannot open a directory.
    with pytest.raises((IsADirectoryError, PermissionError)):
        MLP.load_from_checkpoint(path)
    with pytest.raises(TypeError, match="LightningModule"):
        load_from_checkpoint(nn.Linear, path)


# ------------------------------------------------------------------ pytorch_lightning
def test_also_a_pytorch_lightning_checkpoint_io(tmp_path):
    import pytorch_lightning as pl  # installed with lightning (its dependency)
    from lightning_fabric.plugins import CheckpointIO as FabricCheckpointIO

    assert isinstance(QuicksaveCheckpointIO(), FabricCheckpointIO)

    class Tiny(pl.LightningModule):
        def __init__(self, hidden: int = 4) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[QuicksaveCheckpointIO()],
    )
    model = Tiny()
    trainer.fit(model, _loader())
    [saved] = (tmp_path / "checkpoints").iterdir()
    assert classify(str(saved)) is CheckpointKind.QUICKSAVE
    loaded = load_from_checkpoint(Tiny, saved)
    assert torch.equal(loaded.net.weight, model.net.weight)


# ------------------------------------------------------------------ several ranks
def _rank_saves_on_rank_zero_only(rank: int, world_size: int, root: str, async_save: bool):
    import torch.distributed as dist

    io = QuicksaveCheckpointIO(async_save=async_save, engine=THREAD_ENGINE)
    path = os.path.join(root, f"last-{async_save}.ckpt")
    if rank == 0:  # as Lightning's strategies do: no collective may start here
        io.save_checkpoint({"global_step": 1, "w": torch.ones(16)}, path)
        io.save_checkpoint({"global_step": 2, "w": torch.full((16,), 2.0)}, path)
        io.teardown()
    dist.barrier()
    ck = io.load_checkpoint(path)  # every rank reads, alone
    return [ck["global_step"], float(ck["w"].sum())]


@pytest.mark.slow
def test_rank_zero_saves_without_a_collective(tmp_path):
    sys.path.insert(0, str(REPO / "tests" / "multirank"))
    from launcher import LaunchConfig, run_ranks

    config = LaunchConfig(timeout_s=120.0, collective_timeout_s=30.0)
    for async_save in (False, True):
        got = run_ranks(_rank_saves_on_rank_zero_only, 2, str(tmp_path), async_save, config=config)
        assert got == [[2, 32.0], [2, 32.0]]


def test_import_quicksave_does_not_import_lightning():
    code = (
        "import sys, quicksave, quicksave.integrations; "
        "assert not any(m.split('.')[0] in ('lightning', 'pytorch_lightning', 'torchtitan') "
        "for m in sys.modules), sorted(sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


# ------------------------------------------------------------------ the example
def test_example_script_resumes_bit_exactly(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "lightning_quicksave.py"),
            "--root",
            str(tmp_path),
            "--first-epochs",
            "1",
            "--epochs",
            "2",
            "--async",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"resumed from .*last\.ckpt at epoch 1", out.stdout), out.stdout
    assert "final parameters and optimizer state match the uninterrupted run: yes" in out.stdout
    assert "load_from_checkpoint" in out.stdout
    kept = sorted(os.listdir(tmp_path / "checkpoints"))
    assert "last.ckpt" in kept and all(
        classify(str(tmp_path / "checkpoints" / k)) is CheckpointKind.QUICKSAVE for k in kept
    )
