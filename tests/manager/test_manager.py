"""CheckpointManager end to end, on real files, with a tiny real training loop."""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn

import quicksave
from helpers.compare import assert_same, snapshot
from quicksave.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    IncompatibleStateError,
    NotCommittedError,
)
from quicksave.loading.verify import verify_checkpoint
from quicksave.manager import (
    CheckpointConfig,
    CheckpointManager,
    ModelState,
    OptimizerState,
    RNGState,
    TrainState,
)


class TinyLoader:
    """A resumable data loader: a fixed data set and a read position."""

    def __init__(self, n: int = 24, batch: int = 4) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 4, generator=g)
        self.y = torch.randn(n, 2, generator=g)
        self.batch = batch
        self.pos = 0
        self.epoch = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pos + self.batch > len(self.x):
            self.pos, self.epoch = 0, self.epoch + 1
        sl = slice(self.pos, self.pos + self.batch)
        self.pos += self.batch
        return self.x[sl], self.y[sl]

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos, "epoch": self.epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pos, self.epoch = state_dict["pos"], state_dict["epoch"]


class Job:
    """Model (one or two parts), one optimizer and one StepLR per part, loader, train state."""

    def __init__(self, seed: int, parts: int = 1) -> None:
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        full = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        # Slicing keeps the original names ("0.*", "2.*"), as a pipeline split does.
        self.parts = [full] if parts == 1 else [full[0:2], full[2:3]]
        self.full = full
        self.optims = [torch.optim.AdamW(p.parameters(), lr=0.05) for p in self.parts]
        self.scheds = [
            torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in self.optims
        ]
        self.loader = TinyLoader()
        self.train_state = TrainState()

    def states(self) -> dict[str, Any]:
        one = len(self.parts) == 1
        return {
            "model": ModelState(self.parts[0] if one else self.parts),
            "optimizer": OptimizerState(self.parts, self.optims),
            "lr_scheduler": self.scheds[0] if one else self.scheds,
            "dataloader": self.loader,
            "train_state": self.train_state,
            "rng": RNGState(),
        }

    def train_step(self) -> None:
        x, y = self.loader.next()
        # Draw from every global generator, so that a wrongly restored RNG changes the loss.
        noise = torch.randn_like(x) * 0.01
        scale = 1.0 + 0.01 * random.random() + 0.01 * float(np.random.rand())
        loss = ((self.full(x + noise) * scale - y) ** 2).mean()
        for o in self.optims:
            o.zero_grad()
        loss.backward()
        for o, s in zip(self.optims, self.scheds, strict=True):
            o.step()
            s.step()
        self.train_state.step += 1
        self.train_state.losses.append(loss.item())
        self.train_state.log_steps.append(self.train_state.step)


def perturb_rng() -> None:
    torch.manual_seed(999)
    random.seed(999)
    np.random.seed(999)


def manifest(path: Path | str) -> dict[str, Any]:
    return json.loads((Path(path) / "manifest.json").read_text())


def make(folder: Path, states: dict[str, Any], **config: Any) -> CheckpointManager:
    config = {"async_mode": "disabled", **config}
    return CheckpointManager(CheckpointConfig(folder=str(folder), **config), states)


# ---------------------------------------------------------------- lifecycle


def test_saves_at_intervals_and_load_restores_everything_exactly(tmp_path: Path) -> None:
    job = Job(seed=0)
    states = job.states()
    manager = make(tmp_path / "ckpt", states, interval=2)
    saved = []
    for _ in range(5):
        job.train_step()
        saved.append(manager.save(job.train_state.step))
        if job.train_state.step == 4:
            expected = snapshot(states)
    assert saved == [False, True, False, True, False]
    assert manager.committed_steps() == [2, 4]
    assert manager.latest_step() == 4
    assert [(r.step, r.kind) for r in manager.metrics] == [(2, "full"), (4, "full")]
    assert manager.metrics[1].path == str(tmp_path / "ckpt" / "step-4")
    params = sum(p.numel() * 4 for p in job.full.parameters())
    assert manager.metrics[1].bytes >= 3 * params  # weights + exp_avg + exp_avg_sq
    assert manifest(tmp_path / "ckpt" / "step-4")["step"] == 4
    manager.close()

    job.train_step()  # step 5: not saved; its changes must be undone by load
    perturb_rng()
    with make(tmp_path / "ckpt", states, interval=2) as resumed:
        assert resumed.load() == 4
    assert_same(snapshot(states), expected)
    assert job.train_state.step == 4 and len(job.train_state.losses) == 4


def test_load_returns_none_when_there_is_nothing(tmp_path: Path) -> None:
    manager = make(tmp_path / "new", Job(seed=0).states())
    assert os.path.isdir(tmp_path / "new")
    assert manager.load() is None
    assert manager.latest_step() is None and manager.committed_steps() == []


def test_resume_continues_bit_exactly_like_an_uninterrupted_run(tmp_path: Path) -> None:
    reference = Job(seed=0)
    for _ in range(10):
        reference.train_step()

    first = Job(seed=0)
    manager = make(tmp_path / "ckpt", first.states(), interval=3)
    for _ in range(7):  # saves at 3 and 6; step 7 is lost in the "crash"
        first.train_step()
        manager.save(first.train_state.step)
    manager.close()

    perturb_rng()
    second = Job(seed=42)  # different initial weights: everything must come from the checkpoint
    manager = make(tmp_path / "ckpt", second.states(), interval=3)
    assert manager.load() == 6
    while second.train_state.step < 10:
        second.train_step()
        manager.save(second.train_state.step)
    manager.close()

    assert second.train_state.losses == reference.train_state.losses
    assert second.train_state.log_steps == list(range(1, 11))
    for (name, a), b in zip(
        reference.full.state_dict().items(), second.full.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    assert_same(second.optims[0].state_dict(), reference.optims[0].state_dict())
    assert second.scheds[0].get_last_lr() == reference.scheds[0].get_last_lr()
    assert manager.committed_steps() == [3, 6, 9]


def test_multiple_model_parts_optimizers_and_schedulers(tmp_path: Path) -> None:
    job = Job(seed=0, parts=2)
    manager = make(tmp_path / "ckpt", job.states(), interval=1)
    states = manager.states  # the list of schedulers became one StatefulList
    for _ in range(2):
        job.train_step()
        manager.save(job.train_state.step)
    expected = snapshot(states)
    tensors = manifest(tmp_path / "ckpt" / "step-2")["tensors"]
    assert {
        "model.0.weight",
        "model.2.weight",
        "optimizer.state.0.weight.exp_avg",
        "optimizer.state.2.bias.exp_avg_sq",
    } <= set(tensors)
    objects = manifest(tmp_path / "ckpt" / "step-2")["objects"]
    assert {"lr_scheduler.0.last_epoch", "lr_scheduler.1.last_epoch"} <= set(objects)

    job.train_step()
    perturb_rng()
    assert make(tmp_path / "ckpt", job.states()).load() == 2
    assert_same(snapshot(states), expected)


def test_model_parts_with_colliding_names_are_refused_before_any_write(tmp_path: Path) -> None:
    parts = [nn.Linear(2, 2), nn.Linear(2, 2)]
    manager = make(tmp_path / "ckpt", {"model": ModelState(parts)}, interval=1)
    with pytest.raises(IncompatibleStateError) as info:
        manager.save(1)
    assert str(info.value) == (
        "ModelState: part 1 has a key that an earlier part also has; give the parts distinct "
        "parameter names (e.g. split one model, do not reuse one class at the top level) "
        "[fqn=weight]"
    )
    assert os.listdir(tmp_path / "ckpt") == [".quicksave-lock"]  # the writer lease only


# ---------------------------------------------------------------- retention and commit


def _leftovers(folder: Path) -> None:
    folder.mkdir(parents=True)
    tmp = folder / "step-100.tmp-abc123"
    tmp.mkdir()
    (tmp / "rank-00000-00.safetensors").write_bytes(b"x")
    torn = folder / "step-99"  # data without its manifest: a torn copy
    torn.mkdir()
    (torn / "rank-00000-00.safetensors").write_bytes(b"x")


def test_retention_counts_and_keeps_only_committed_checkpoints(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    _leftovers(folder)
    job = Job(seed=0)
    manager = make(folder, job.states(), interval=1, keep_latest_k=2)
    assert not (folder / "step-100.tmp-abc123").exists()  # stale temporary cleaned at start-up
    assert manager.committed_steps() == [] and manager.latest_step() is None
    assert manager.load() is None  # step-99 is never loaded
    for _ in range(5):
        job.train_step()
        manager.save(job.train_state.step)
    assert manager.committed_steps() == [4, 5]
    assert sorted(os.listdir(folder)) == [".quicksave-lock", "step-4", "step-5", "step-99"]


def test_keep_latest_k_zero_keeps_all(tmp_path: Path) -> None:
    job = Job(seed=0)
    manager = make(tmp_path / "ckpt", job.states(), interval=1, keep_latest_k=0)
    for _ in range(4):
        job.train_step()
        manager.save(job.train_state.step)
    assert manager.committed_steps() == [1, 2, 3, 4]


def test_a_misbehaving_retention_policy_cannot_delete_the_newest(tmp_path: Path) -> None:
    class DeleteEverything:
        def to_delete(self, committed_steps: list[int], in_flight: set[int]) -> list[int]:
            return list(committed_steps)

    job = Job(seed=0)
    manager = CheckpointManager(
        CheckpointConfig(folder=str(tmp_path / "ckpt"), interval=1, async_mode="disabled"),
        job.states(),
        retention=DeleteEverything(),
    )
    for _ in range(3):
        job.train_step()
        manager.save(job.train_state.step)
    assert manager.committed_steps() == [3]


def test_an_uncommitted_leftover_at_the_target_step_is_replaced(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    _leftovers(folder)
    job = Job(seed=0)
    manager = make(folder, job.states(), interval=1)
    with pytest.raises(NotCommittedError) as info:
        manager.load(99)
    assert str(info.value) == (
        "the checkpoint of step 99 was never committed (a save was interrupted or is still "
        f"running); it is never loaded [path={folder / 'step-99'}]"
    )
    assert manager.save(99)
    assert manager.committed_steps() == [99]
    assert manifest(folder / "step-99")["step"] == 99


def test_saving_a_committed_step_again_is_skipped(tmp_path: Path, caplog) -> None:
    job = Job(seed=0)
    manager = make(tmp_path / "ckpt", job.states(), interval=1)
    assert manager.save(1)
    with caplog.at_level(logging.INFO, logger="quicksave"):
        assert not manager.save(1)
    assert "step 1 already has a committed checkpoint" in caplog.text
    assert len(manager.metrics) == 1


# ---------------------------------------------------------------- seed and export


def test_step_zero_is_a_model_only_seed_checkpoint(tmp_path: Path) -> None:
    job = Job(seed=0)
    manager = make(tmp_path / "ckpt", job.states(), interval=5)
    assert manager.save(0)
    m = manifest(tmp_path / "ckpt" / "step-0")
    assert set(m["tensors"]) == {f"model.{k}" for k in job.full.state_dict()}
    assert m["objects"] == {}
    assert m["user_metadata"] == {"checkpoint_kind": "seed", "model_states": ["model"]}
    assert manager.metrics[0].kind == "seed"

    fresh = Job(seed=7)
    fresh_optim = copy.deepcopy(fresh.optims[0].state_dict())
    assert make(tmp_path / "ckpt", fresh.states()).load() == 0
    for a, b in zip(job.full.parameters(), fresh.full.parameters(), strict=True):
        assert torch.equal(a, b)
    assert_same(fresh.optims[0].state_dict(), fresh_optim)  # optimizer untouched
    assert fresh.train_state.step == 0


def test_seed_needs_a_model_state(tmp_path: Path) -> None:
    manager = make(tmp_path / "ckpt", {"train_state": TrainState()})
    with pytest.raises(IncompatibleStateError) as info:
        manager.save(0)
    assert str(info.value) == (
        "seed (step 0) and export checkpoints hold the model only, but no state is a "
        f"ModelState or named 'model' [path={tmp_path / 'ckpt'}]"
    )


def test_last_step_saves_and_exports_model_weights_in_export_dtype(tmp_path: Path) -> None:
    job = Job(seed=0)
    manager = make(
        tmp_path / "ckpt", job.states(), interval=3, last_step=4, export_dtype="bfloat16"
    )
    for _ in range(4):
        job.train_step()
        manager.save(job.train_state.step)
    assert manager.committed_steps() == [3, 4]  # 4 is saved although 4 % 3 != 0
    export = tmp_path / "ckpt" / "export-step-4"
    m = manifest(export)
    assert set(m["tensors"]) == {f"model.{k}" for k in job.full.state_dict()}
    assert {t["dtype"] for t in m["tensors"].values()} == {"bfloat16"}
    assert m["objects"] == {}
    assert m["user_metadata"] == {
        "checkpoint_kind": "export",
        "export_dtype": "bfloat16",
        "model_states": ["model"],
    }
    assert [r.kind for r in manager.metrics] == ["full", "full", "export"]

    dest = {
        "model": {
            k: torch.empty_like(v, dtype=torch.bfloat16) for k, v in job.full.state_dict().items()
        }
    }
    quicksave.load(dest, export)
    for k, v in job.full.state_dict().items():
        assert torch.equal(dest["model"][k], v.to(torch.bfloat16)), k
    assert manifest(tmp_path / "ckpt" / "step-4")["tensors"]["model.0.weight"]["dtype"] == "float32"


def test_seconds_interval_uses_the_injected_clock(tmp_path: Path) -> None:
    now = [100.0]
    job = Job(seed=0)
    manager = CheckpointManager(
        CheckpointConfig(
            folder=str(tmp_path / "ckpt"),
            interval=10,
            interval_type="seconds",
            async_mode="disabled",
        ),
        job.states(),
        clock=lambda: now[0],
    )
    decisions = {}
    for t in (100.0, 105.0, 110.0, 115.0, 119.9, 120.0, 121.0):
        now[0] = t
        job.train_step()
        decisions[job.train_state.step] = manager.save(job.train_state.step)
    assert [s for s, d in decisions.items() if d] == [3, 6]
    assert manager.committed_steps() == [3, 6]
    assert manager.save(7, force=True)


# ---------------------------------------------------------------- configuration and errors


def test_disabled_manager_does_nothing(tmp_path: Path) -> None:
    manager = make(tmp_path / "off", Job(seed=0).states(), interval=1, enabled=False)
    assert not manager.save(1, force=True)
    assert manager.load() is None
    assert not (tmp_path / "off").exists()


def test_close_is_idempotent_and_final(tmp_path: Path) -> None:
    manager = make(tmp_path / "ckpt", Job(seed=0).states(), interval=1)
    manager.close()
    manager.close()
    with pytest.raises(CheckpointError) as info:
        manager.save(1)
    assert str(info.value) == f"this CheckpointManager is closed [path={tmp_path / 'ckpt'}]"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"interval": 0}, "interval must be a positive number, got 0"),
        ({"interval": 2.5}, "interval must be a whole number of steps, got 2.5"),
        ({"interval_type": "epochs"}, "interval_type must be 'steps' or 'seconds', got 'epochs'"),
        ({"keep_latest_k": -1}, "keep_latest_k must be an integer >= 0, got -1"),
        ({"thread_count": 0}, "thread_count must be an integer >= 1, got 0"),
        ({"last_step": -3}, "last_step must be an integer >= 0, got -3"),
        (
            {"export_dtype": "int8"},
            "export_dtype must name a torch floating dtype (e.g. 'float32', 'bfloat16'), "
            "got 'int8'",
        ),
        ({"folder": ""}, "folder must be a non-empty path, got ''"),
    ],
)
def test_bad_config_values(tmp_path: Path, config: dict[str, Any], message: str) -> None:
    with pytest.raises(CheckpointError) as info:
        CheckpointConfig(**{"folder": str(tmp_path), **config})
    assert str(info.value) == message


def test_config_accepts_a_pathlike_folder_and_fractional_seconds(tmp_path: Path) -> None:
    config = CheckpointConfig(folder=tmp_path, interval=0.5, interval_type="seconds")  # type: ignore[arg-type]
    assert config.folder == str(tmp_path)


def test_unknown_async_mode_is_refused_before_any_io(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        make(tmp_path / "ckpt", {}, async_mode="async")
    assert str(info.value) == (
        "async_mode must be one of 'disabled', 'thread', 'process', got 'async'"
    )
    assert not (tmp_path / "ckpt").exists()  # checked before any I/O


def test_folder_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(CheckpointError) as info:
        make(tmp_path / "file", {})
    assert str(info.value) == (
        "checkpoint folder is a file, not a directory; choose another folder "
        f"[path={tmp_path / 'file'}]"
    )


def test_states_must_be_stateful(tmp_path: Path) -> None:
    with pytest.raises(IncompatibleStateError) as info:
        make(tmp_path / "ckpt", {"thing": object()})
    assert str(info.value) == (
        "state of type builtins.object has no state_dict()/load_state_dict(); wrap models in "
        "ModelState, optimizers in OptimizerState, or give the object those two methods [fqn=thing]"
    )
    model = nn.Linear(2, 2)
    with pytest.raises(IncompatibleStateError) as info:
        make(tmp_path / "ckpt", {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1)})
    assert str(info.value) == (
        "a bare torch.optim.Optimizer keys its state by parameter index, which collides across "
        "model parts and breaks resharding; pass OptimizerState(model, optimizer) instead "
        "[fqn=optimizer]"
    )
    with pytest.raises(IncompatibleStateError) as info:
        OptimizerState([model, model], torch.optim.SGD(model.parameters(), lr=0.1))
    assert str(info.value) == (
        "OptimizerState needs one optimizer per model part, got 2 part(s) and 1 optimizer(s)"
    )


def test_bad_steps(tmp_path: Path) -> None:
    job = Job(seed=0)
    manager = make(tmp_path / "ckpt", job.states(), interval=1)
    folder = tmp_path / "ckpt"
    with pytest.raises(CheckpointError) as info:
        manager.save(-1)
    assert str(info.value) == f"step must be an integer >= 0, got -1 [path={folder}]"
    manager.save(1)
    with pytest.raises(CheckpointNotFoundError) as info:
        manager.load(7)
    assert (
        str(info.value)
        == f"no checkpoint of step 7; committed steps: [1] [path={folder / 'step-7'}]"
    )


def test_stock_dcp_checkpoints_count_as_committed_and_load_when_allowed(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    job = Job(seed=0)
    for _ in range(2):
        job.train_step()
    states = job.states()
    expected = snapshot(states)
    folder = tmp_path / "ckpt"
    with warnings.catch_warnings():  # DCP warns that torch.distributed is not initialized
        warnings.simplefilter("ignore")
        dcp.save(states, checkpoint_id=str(folder / "step-2"))
    job.train_step()
    perturb_rng()
    refusing = make(folder, states, interval=1, read_only=True)  # default: not a checkpoint
    assert refusing.committed_steps() == [] and refusing.load() is None
    manager = make(folder, states, interval=1, allow_dcp=True)
    assert manager.committed_steps() == [2]
    assert manager.load() == 2
    assert_same(snapshot(states), expected)


# ---------------------------------------------------------------- several ranks


def _rank_train_save_resume(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    job = Job(seed=0)  # the same model on every rank, as with data parallelism
    manager = make(Path(folder), job.states(), interval=2, keep_latest_k=1)
    for _ in range(4):
        job.train_step()
        if job.train_state.step == 4:
            random.seed(rank)  # per-rank Python RNG: each rank's must come back as its own
        manager.save(job.train_state.step)
    manager.close()
    expected_random = random.random()
    params = [p.detach().clone() for p in job.full.parameters()]

    perturb_rng()
    fresh = Job(seed=100 + rank)
    resumed = make(Path(folder), fresh.states(), interval=2, keep_latest_k=1)
    step = resumed.load()
    same = all(torch.equal(a, b) for a, b in zip(params, fresh.full.parameters(), strict=True))
    return {
        "step": step,
        "committed": resumed.committed_steps(),
        "params_equal": same,
        "random_equal": random.random() == expected_random,
    }


@pytest.mark.slow
def test_two_ranks_save_retain_and_resume(tmp_path: Path) -> None:
    # The one multi-rank helper lives in tests/dist and is imported as a top-level module
    # there (its child processes unpickle their spec under that name).
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multirank"))
    from launcher import LaunchConfig, run_ranks

    folder = tmp_path / "ckpt"
    results = run_ranks(
        _rank_train_save_resume, 2, str(folder), config=LaunchConfig(timeout_s=120.0)
    )
    for r in results:
        assert r == {"step": 4, "committed": [4], "params_equal": True, "random_equal": True}
    # (the ranks exit without close(): their lease file stays, unlocked)
    assert sorted(n for n in os.listdir(folder) if n != ".quicksave-lock") == ["step-4"]
    objects = manifest(folder / "step-4")["objects"]
    assert {"rng.rank_0.python.gauss_next", "rng.rank_1.python.gauss_next"} <= set(objects)


def test_per_rank_state_without_an_entry_for_this_rank_is_left_alone(tmp_path: Path, caplog):
    from quicksave.manager.folder import stored_metadata
    from quicksave.manager.states import PerRankLoad

    manager = make(tmp_path / "ckpt", {"rng": RNGState()}, interval=1)
    manager.save(1)
    stored = stored_metadata(manager.step_path(1))
    # As if saved by rank 1 only (a job that ran on more ranks than this one).
    as_rank_1 = {k.replace("rng.rank_0.", "rng.rank_1."): v for k, v in stored.items()}
    loader = PerRankLoad("rng", RNGState(), as_rank_1)
    sd = loader.state_dict()
    assert set(sd) == {k.removeprefix("rng.") for k in as_rank_1}
    assert sd["rank_1.torch"].shape == torch.get_rng_state().shape
    before = torch.get_rng_state()
    with caplog.at_level(logging.WARNING, logger="quicksave"):
        loader.load_state_dict(sd)
    assert "holds no 'rng' entry for rank_0" in caplog.text
    assert torch.equal(torch.get_rng_state(), before)
    # No entry at all: this rank's own entry stays in, so a strict load reports it missing.
    assert set(PerRankLoad("rng", RNGState(), {}).state_dict()) == {"rank_0"}
    model = nn.Linear(2, 2)
    make(tmp_path / "other", {"model": ModelState(model)}, interval=1).save(1)
    with pytest.raises(IncompatibleStateError) as info:
        make(tmp_path / "other", {"model": ModelState(model), "rng": RNGState()}).load()
    assert info.value.message.startswith(
        "the checkpoint of step 1 (the newest committed one) holds the states 'model', and "
        "this manager loads 'model', 'rng' (not in the checkpoint: 'rng')"
    )
    cause = info.value.__cause__  # the keys
    assert str(cause).startswith(
        "state dict keys do not match the checkpoint (missing from checkpoint: "
        "rng.rank_0.numpy.algorithm, "
    )
    assert cause.fqn == "rng.rank_0.numpy.algorithm"


# ---------------------------------------------------------------- wait


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_wait_commits_saves_in_flight_without_closing(tmp_path: Path, mode: str) -> None:
    job = Job(5)
    m = make(tmp_path, job.states(), async_mode=mode, interval=1, keep_latest_k=0)
    try:
        job.train_step()
        m.save(1)
        m.wait()
        # Committed now, while the manager stays open: loadable, listed, verifiable.
        assert (tmp_path / "step-1" / "manifest.json").is_file()
        assert verify_checkpoint(str(tmp_path / "step-1")).ok
        assert 1 not in m.session.in_flight and m.metrics[-1].status == "committed"
        job.train_step()
        m.save(2)  # the manager goes on after wait()
        m.wait(timeout=120.0)
        assert (tmp_path / "step-2" / "manifest.json").is_file()
        m.wait()  # nothing in flight: returns at once
    finally:
        m.close()
    with pytest.raises(CheckpointError, match="closed"):
        m.wait()


@pytest.mark.parametrize("async_mode", ["thread", "process"])
def test_an_async_save_replaces_an_uncommitted_leftover_in_its_writer(
    tmp_path: Path, async_mode: str
) -> None:
    # the lease holder's writer removes it before writing (not the training thread)
    folder = tmp_path / "ckpt"
    _leftovers(folder)
    job = Job(seed=0)
    manager = make(folder, job.states(), interval=1, async_mode=async_mode)
    assert manager.save(99)
    manager.wait()
    assert manager.committed_steps() == [99]
    assert manifest(folder / "step-99")["step"] == 99
    manager.close()
