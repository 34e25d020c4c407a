"""QuicksaveCheckpointIO behaves as Lightning's own TorchCheckpointIO where Lightning's
checkpoint tests found it did not (issue 27): names ModelCheckpoint versions while an
async save is in flight, a missing ckpt_path, the HPC resume scan beside an interrupted
save's leftover, OmegaConf hyper-parameters, a load of a checkpoint another plugin is
still writing. Real Trainers, tiny models, the CPU.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from typing import Any

import lightning as L  # pinned in the dev extra: a missing one fails
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.connectors.checkpoint_connector import (
    _CheckpointConnector,
)
from omegaconf import DictConfig, ListConfig, OmegaConf  # pinned in the dev extra
from torch import nn

import quicksave
from quicksave.commit import files as commit
from quicksave.errors import CheckpointError, CheckpointNotFoundError
from quicksave.integrations.lightning import (
    QuicksaveCheckpointIO,
    load_from_checkpoint,
    read_checkpoint,
)
from quicksave.saving.config import EngineConfig
from quicksave.saving.handle import SaveHandle
from quicksave.worker import execute

warnings.filterwarnings("ignore", module="lightning")
# Several saves in flight at once, in this process (so a test can hold their writes).
MANY = EngineConfig(mode="thread", max_in_flight=8)


class Tiny(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8
    )


def _trainer(root: Path, plugins: list, epochs: int, callbacks: list[Callback]) -> L.Trainer:
    return L.Trainer(
        default_root_dir=root,
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        plugins=plugins,
        callbacks=callbacks,
    )


class _Gate:
    """Holds the writes of every save of quicksave's engine (thread mode: in this
    process) until opened, so that the saves are still in flight when Lightning looks."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()
        real = execute.write_files

        def held(*args: Any, **kwargs: Any) -> Any:
            self.entered.set()
            assert self.open.wait(120)
            return real(*args, **kwargs)

        monkeypatch.setattr(execute, "write_files", held)


class OpenAtTrainEnd(Callback):
    def __init__(self, gate: _Gate) -> None:
        self.gate = gate

    def on_train_end(self, trainer, pl_module) -> None:  # before the plugin's teardown
        self.gate.open.set()


# ------------------------------------------------------------------ 1. versioned names
def _versioned_run(root: Path, plugins: list, extra: list[Callback]) -> dict[str, Any]:
    torch.manual_seed(0)
    ckpt = ModelCheckpoint(dirpath=root, filename="test", monitor="val_loss", save_top_k=-1)
    _trainer(root, plugins, 4, [ckpt, *extra]).fit(Tiny(), _loader(), _loader())
    return {
        "kept": sorted(n for n in os.listdir(root) if n.endswith(".ckpt")),
        "best": {os.path.basename(p): float(s) for p, s in ckpt.best_k_models.items()},
    }


def _epoch_of(path: Path, io: Any) -> int:
    return int(io.load_checkpoint(path)["epoch"])


def test_async_saves_version_a_repeated_name_as_stock_does(tmp_path, monkeypatch):
    """filename="test", every epoch kept: test.ckpt, test-v1.ckpt, ... — while the
    earlier saves are still in flight (held until training ends), as with torch.save."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    stock = _versioned_run(tmp_path / "stock", [TorchCheckpointIO()], [])
    assert stock["kept"] == ["test-v1.ckpt", "test-v2.ckpt", "test-v3.ckpt", "test.ckpt"]
    gate = _Gate(monkeypatch)
    io = QuicksaveCheckpointIO(async_save=True, engine=MANY)
    got = _versioned_run(tmp_path / "async", [io], [OpenAtTrainEnd(gate)])
    assert gate.entered.is_set()  # the saves really were held in flight
    assert got == stock
    reader = QuicksaveCheckpointIO()
    for name in stock["kept"]:  # each path holds its own epoch, nothing was replaced
        want = _epoch_of(tmp_path / "stock" / name, TorchCheckpointIO())
        assert _epoch_of(tmp_path / "async" / name, reader) == want


def test_an_async_saves_name_is_held_until_it_commits_and_freed_if_it_fails(tmp_path, monkeypatch):
    gate = _Gate(monkeypatch)
    io = QuicksaveCheckpointIO(async_save=True, engine=MANY)
    p = tmp_path / "a.ckpt"
    io.save_checkpoint({"w": torch.ones(4)}, p)
    assert p.is_dir() and os.listdir(p) == []  # the placeholder: fs.exists sees it
    gate.open.set()
    io.teardown()
    assert torch.equal(read_checkpoint(p)["w"], torch.ones(4))

    def damaged(tmp, expected, final):
        raise CheckpointError("cannot commit: a file is gone", path=final)

    monkeypatch.setattr(commit, "check_whole", damaged)
    q = tmp_path / "b.ckpt"
    io.save_checkpoint({"w": torch.ones(4)}, q)
    with pytest.raises(CheckpointError, match="a file is gone"):
        io.teardown()
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt"]  # b.ckpt's placeholder went too


def test_remove_checkpoint_takes_a_dead_saves_placeholder(tmp_path):
    (tmp_path / "c.ckpt").mkdir()  # what a process killed mid async save leaves
    QuicksaveCheckpointIO().remove_checkpoint(tmp_path / "c.ckpt")
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ 2. missing ckpt_path
def test_a_missing_ckpt_path_is_a_file_not_found_error(tmp_path):
    trainer = _trainer(tmp_path, [QuicksaveCheckpointIO()], 1, [])
    missing = tmp_path / "missing.ckpt"
    with pytest.raises(FileNotFoundError) as e:
        trainer.fit(Tiny(), _loader(), _loader(), ckpt_path=missing)
    assert isinstance(e.value, CheckpointNotFoundError) and e.value.filename == str(missing)


# ------------------------------------------------------------------ 3. HPC resume scan
def test_hpc_resume_scan_ignores_an_interrupted_saves_leftover(tmp_path, monkeypatch):
    io = QuicksaveCheckpointIO()
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "hpc_ckpt_1.ckpt")
    with monkeypatch.context() as m:
        m.setattr(commit, "publish", lambda *args, **kwargs: None)  # dies before the rename
        io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "hpc_ckpt_2.ckpt")
    names = os.listdir(tmp_path)
    assert len(names) == 2  # the committed one and the leftover
    leftover = next(n for n in names if n != "hpc_ckpt_1.ckpt")
    assert "ckpt_" not in leftover and not leftover.endswith(".ckpt")
    scan = _CheckpointConnector._CheckpointConnector__max_ckpt_version_in_folder
    assert scan(tmp_path, "hpc_ckpt_") == 1  # Lightning's own scan (was 2355694-like)
    assert scan(tmp_path) == 1


# ------------------------------------------------------------------ 4. fsspec roots
def _fsspec_run(dirpath: str, io: QuicksaveCheckpointIO) -> tuple[ModelCheckpoint, L.Trainer]:
    torch.manual_seed(0)
    ckpt = ModelCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=2)
    trainer = _trainer(Path("."), [io], 3, [ckpt])
    trainer.fit(Tiny(), _loader(), _loader())
    return ckpt, trainer


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("root", ["memory", "local"])
def test_fsspec_roots_save_load_and_resume(tmp_path, root, async_save):
    """Lightning accepts any fsspec URL as dirpath; quicksave writes there through
    fsspec (manifest-last commit), keeps the top-k and resumes from it."""
    import fsspec

    base = f"memory://{tmp_path.name}/ckpt" if root == "memory" else f"local://{tmp_path}/ckpt"
    fs, _ = fsspec.core.url_to_fs(base)
    engine = EngineConfig(mode="thread") if async_save else None
    ckpt, trainer = _fsspec_run(base, QuicksaveCheckpointIO(async_save=async_save, engine=engine))
    kept = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(base, detail=False))
    assert kept == sorted(p.rsplit("/", 1)[-1] for p in ckpt.best_k_models) and len(kept) == 2
    best = ckpt.best_model_path
    assert best.startswith(f"{root}://")
    got = read_checkpoint(best)
    weights = trainer.lightning_module.net.weight
    assert got["epoch"] in (0, 1, 2) and got["state_dict"]["net.weight"].shape == weights.shape
    if root == "local":  # the same files, seen as a path
        assert quicksave.load_state(best[len("local://") :])["epoch"] == got["epoch"]
    resumed = _trainer(tmp_path, [QuicksaveCheckpointIO()], 4, [])
    resumed.fit(Tiny(), _loader(), _loader(), ckpt_path=best)
    assert resumed.current_epoch == 4


def test_memory_root_with_a_worker_process_is_refused_clearly(tmp_path):
    from quicksave.saving.engine import AsyncSaver

    saver = AsyncSaver(EngineConfig())  # the default engine: a worker process
    url = f"memory://{tmp_path.name}/a.ckpt"
    try:
        with pytest.raises(CheckpointError, match=r"mode='thread'") as e:
            saver.save({"w": torch.ones(2)}, url)
        assert e.value.path == f"memory:///{tmp_path.name}/a.ckpt"  # named in full
    finally:
        saver.close()


def test_an_unknown_scheme_is_refused_naming_it(tmp_path):
    with pytest.raises(CheckpointError, match="unknown URL scheme 'nosuch'"):
        QuicksaveCheckpointIO().save_checkpoint({"w": torch.ones(2)}, "nosuch://x/a.ckpt")


# ------------------------------------------------------------------ 5. OmegaConf


class WithConfig(Tiny):
    def __init__(self, cfg: DictConfig, layers: ListConfig) -> None:
        super().__init__(lr=cfg.optim.lr)
        self.save_hyperparameters()


class WholeConfig(Tiny):
    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(lr=cfg.optim.lr)
        self.save_hyperparameters(cfg)  # replaces Tiny's: the hparams are cfg itself

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.optim.lr)


def _cfg() -> DictConfig:
    return OmegaConf.create({"optim": {"lr": 0.05, "name": "sgd"}, "copy_of_lr": "${optim.lr}"})


@pytest.mark.parametrize("async_save", [False, True])
def test_omegaconf_hyper_parameters_come_back_as_configs(tmp_path, async_save):
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    layers = OmegaConf.create([8, {"width": 4}])
    ios = {"stock": TorchCheckpointIO(), "qs": QuicksaveCheckpointIO(async_save=async_save)}
    for sub, io in ios.items():
        trainer = _trainer(tmp_path / sub, [io], 1, [])
        trainer.fit(WithConfig(_cfg(), layers), _loader(), _loader())
        trainer.save_checkpoint(tmp_path / sub / "m.ckpt")
        trainer.strategy.checkpoint_io.teardown()
    stock = WithConfig.load_from_checkpoint(tmp_path / "stock" / "m.ckpt", weights_only=False)
    for got in (
        load_from_checkpoint(WithConfig, tmp_path / "qs" / "m.ckpt"),
        read_checkpoint(tmp_path / "qs" / "m.ckpt"),
    ):
        hp = got.hparams if isinstance(got, L.LightningModule) else got["hyper_parameters"]
        ref = stock.hparams
        assert type(hp["cfg"]) is DictConfig and type(hp["layers"]) is ListConfig
        assert hp["cfg"].optim.lr == 0.05 and hp["cfg"].copy_of_lr == 0.05
        assert OmegaConf.to_container(hp["cfg"])["copy_of_lr"] == "${optim.lr}"  # kept
        assert OmegaConf.to_container(hp["cfg"]) == OmegaConf.to_container(ref["cfg"])
        assert OmegaConf.to_container(hp["layers"]) == OmegaConf.to_container(ref["layers"])


def test_a_whole_omegaconf_hparams_comes_back_with_its_type(tmp_path):
    trainer = _trainer(tmp_path, [QuicksaveCheckpointIO()], 1, [])
    trainer.fit(WholeConfig(_cfg()), _loader(), _loader())
    trainer.save_checkpoint(tmp_path / "w.ckpt")
    checkpoint = read_checkpoint(tmp_path / "w.ckpt")
    assert checkpoint["hparams_type"] is DictConfig
    assert "quicksave_omegaconf" not in checkpoint
    model = load_from_checkpoint(WholeConfig, tmp_path / "w.ckpt")
    assert type(model.hparams) is DictConfig and model.hparams.optim.lr == 0.05
    # and a resume through a new Trainer restores from it
    _trainer(tmp_path, [QuicksaveCheckpointIO()], 2, []).fit(
        WholeConfig(_cfg()), _loader(), _loader(), ckpt_path=tmp_path / "w.ckpt"
    )


# ------------------------------------------------------------------ 6. another plugin loads
def test_a_load_waits_for_a_save_in_flight_by_another_plugin(tmp_path, monkeypatch):
    """trainer.save_checkpoint(p) (async, held in flight), then a new Trainer with its
    own plugin resumes from p: its load waits for that save. The held save goes on
    only once someone waits for it, so a load that did not wait would find nothing."""
    gate = _Gate(monkeypatch)
    real_wait = SaveHandle.wait

    def wait(handle: SaveHandle, timeout: float | None = None) -> Any:
        gate.open.set()
        return real_wait(handle, timeout)

    torch.manual_seed(0)
    saver_io = QuicksaveCheckpointIO(async_save=True, engine=MANY)
    trainer = _trainer(tmp_path, [saver_io], 1, [OpenAtTrainEnd(gate)])
    trainer.fit(Tiny(), _loader(), _loader())
    gate.open.clear()
    monkeypatch.setattr(SaveHandle, "wait", wait)
    p = tmp_path / "after-fit.ckpt"
    trainer.save_checkpoint(p)  # held in flight: nothing committed at p yet
    assert gate.entered.wait(60) and not gate.open.is_set()
    other = _trainer(tmp_path, [QuicksaveCheckpointIO()], 2, [])
    other.fit(Tiny(), _loader(), _loader(), ckpt_path=p)
    assert other.current_epoch == 2  # resumed at epoch 1 from p, trained one more
    assert gate.open.is_set()
    model = load_from_checkpoint(Tiny, p)  # the reading helpers wait alike
    assert torch.equal(model.net.weight, trainer.lightning_module.net.weight)
    saver_io.teardown()


def test_a_load_of_a_save_that_failed_elsewhere_says_so(tmp_path, monkeypatch):
    def damaged(tmp, expected, final):
        raise CheckpointError("cannot commit: a file is gone", path=final)

    monkeypatch.setattr(commit, "check_whole", damaged)
    saver_io = QuicksaveCheckpointIO(async_save=True, engine=MANY)
    p = tmp_path / "x.ckpt"
    saver_io.save_checkpoint({"w": torch.ones(2)}, p)
    with pytest.raises(CheckpointError, match="never committed.*a file is gone"):
        QuicksaveCheckpointIO().load_checkpoint(p)
    with pytest.raises(CheckpointError, match="a file is gone"):  # still its owner's to report
        saver_io.teardown()
    assert os.listdir(tmp_path) == []


# ------------------------------------------------- Lightning's wording, hparams_file, memory
def test_a_missing_ckpt_path_is_worded_as_lightnings(tmp_path: Path) -> None:
    missing = str(tmp_path / "non_existing.ckpt")
    trainer = _trainer(tmp_path, [QuicksaveCheckpointIO()], 1, [])
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found: ") as info:
        trainer.fit(Tiny(), _loader(), _loader(), ckpt_path=missing)
    assert isinstance(info.value, CheckpointNotFoundError) and missing in str(info.value)


def test_hparams_file_replaces_the_stored_hyper_parameters(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, [QuicksaveCheckpointIO()], 1, [])
    trainer.fit(Tiny(lr=0.05), _loader(), _loader())
    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    (tmp_path / "hp.yaml").write_text("lr: 0.25\n")
    assert load_from_checkpoint(Tiny, path).hparams.lr == 0.05
    assert load_from_checkpoint(Tiny, path, hparams_file=tmp_path / "hp.yaml").hparams.lr == 0.25
    with pytest.raises(CheckpointError, match="hparams_file must be a .csv, .yml or .yaml"):
        load_from_checkpoint(Tiny, path, hparams_file=tmp_path / "hp.json")


def test_async_saves_to_memory_are_written_by_a_thread_of_this_process() -> None:
    # the default engine is a worker process, which would write into its own memory
    root = f"memory://qs-{os.getpid()}-{threading.get_ident()}"
    io = QuicksaveCheckpointIO(async_save=True)
    assert io.engine.mode == "process"
    ckpt = ModelCheckpoint(dirpath=root, filename="m-{epoch}", save_top_k=-1)
    torch.manual_seed(0)
    model = Tiny()
    _trainer(Path("."), [io], 2, [ckpt]).fit(model, _loader(), _loader())
    back = read_checkpoint(f"{root}/m-epoch=1.ckpt")
    assert torch.equal(back["state_dict"]["net.weight"], model.net.weight.detach())


def test_dicts_come_back_in_the_order_they_were_saved(tmp_path: Path) -> None:
    # typed storage gives entries back in name order; Lightning's dicts keep theirs
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    model.add_module("a_last", nn.Linear(1, 1))  # a name that sorts first
    checkpoint = {
        "state_dict": model.state_dict(),
        "epoch": 1,
        "optimizer_states": [{"state": {1: {"m": torch.ones(1)}, 0: {}}, "param_groups": []}],
        "callbacks": {"z": 1, "b": {"y": torch.zeros(1), "x": 2}},
    }
    path = tmp_path / "ordered.ckpt"
    QuicksaveCheckpointIO().save_checkpoint(checkpoint, path)
    back = read_checkpoint(path)
    assert list(back) == list(checkpoint)
    assert list(back["state_dict"]) == list(model.state_dict())
    assert list(back["optimizer_states"][0]["state"]) == [1, 0]
    assert list(back["callbacks"]) == ["z", "b"] and list(back["callbacks"]["b"]) == ["y", "x"]
    assert torch.equal(back["state_dict"]["a_last.weight"], model.a_last.weight.detach())


def test_a_memory_name_is_held_while_its_save_is_in_flight() -> None:
    # ModelCheckpoint and the HPC scan see names through fsspec: on memory:// the name of
    # a save in flight is an empty directory until the save's objects make it whole
    import fsspec

    from quicksave.commit import strategy_class
    from quicksave.storage import parse_location

    url = f"memory://held-{os.getpid()}/a.ckpt"
    loc = parse_location(url)
    strategy = strategy_class(loc)
    fs = fsspec.filesystem("memory")
    assert strategy.reserve(loc) and fs.exists(url)
    assert not strategy.reserve(loc)  # taken
    io = QuicksaveCheckpointIO()
    io.save_checkpoint({"w": torch.ones(2)}, url)  # the save writes over the placeholder
    assert not strategy.release(loc)  # a checkpoint now: left alone
    assert torch.equal(read_checkpoint(url)["w"], torch.ones(2))
    other = parse_location(f"memory://held-{os.getpid()}/b.ckpt")
    assert strategy.reserve(other) and strategy.release(other)  # a failed save's goes
    assert not fs.exists(other.url)


def test_a_load_under_another_name_waits_for_the_saves_in_flight(tmp_path, monkeypatch):
    # the folder served over HTTP while its save is still in flight in this process
    import functools
    import http.server

    gate = _Gate(monkeypatch)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a, **k: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    io = QuicksaveCheckpointIO(async_save=True, engine=MANY)
    try:
        io.save_checkpoint({"w": torch.arange(3.0)}, tmp_path / "a.ckpt")
        assert gate.entered.wait(60)  # held in flight
        threading.Timer(0.5, gate.open.set).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/a.ckpt"
        assert torch.equal(read_checkpoint(url)["w"], torch.arange(3.0))
        with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
            read_checkpoint(f"http://127.0.0.1:{server.server_address[1]}/none.ckpt")
    finally:
        gate.open.set()
        io.teardown()
        server.shutdown()
