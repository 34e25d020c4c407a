"""A manager meeting what other runs and writers left in its folder
(``manager/folder_checks.py``):

- ``load()`` of a checkpoint that holds other states (one written by ``quicksave.save``
  into the manager's folder) names the checkpoint, the states it holds and the
  manager's, and suggests ``load(step=...)``; the key error is its cause;
- a writing manager that has not called ``load()`` refuses to save a step below the
  newest committed one (a new run in an old run's folder), on every rank alike, and
  writes nothing; once it has loaded, or at or above the newest step, it saves.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from launcher import LaunchConfig, run_ranks

import quicksave
from quicksave.errors import CheckpointError, IncompatibleStateError
from quicksave.manager import (
    CheckpointConfig,
    CheckpointManager,
    ModelState,
    OptimizerState,
    TrainState,
)
from quicksave.manager.folder_checks import states_mismatch, stored_state_names


class _Job:
    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = nn.Linear(4, 3)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.train = TrainState()

    def states(self) -> dict[str, Any]:
        return {
            "model": ModelState(self.model),
            "optim": OptimizerState(self.model, self.optim),
            "train": self.train,
        }

    def step(self) -> None:
        self.optim.zero_grad()
        self.model(torch.ones(2, 4)).square().mean().backward()
        self.optim.step()
        self.train.step += 1


def _manager(folder: Path, states: dict[str, Any], **config: Any) -> CheckpointManager:
    config = {"async_mode": "disabled", "interval": 10, **config}
    return CheckpointManager(CheckpointConfig(folder=str(folder), **config), states)


# ---------------------------------------------------------------- load: other states


def test_load_of_a_checkpoint_with_other_states_names_them_and_suggests_a_step(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "ckpt"
    job = _Job()
    job.step()
    with _manager(folder, job.states()) as manager:
        assert manager.save(10)
    # The README's function example, run into the manager's folder.
    plain = {"model": job.model.state_dict(), "optim": job.optim.state_dict()}
    quicksave.save(plain, folder / "step-100", step=100)

    fresh = _Job(seed=1)
    with _manager(folder, fresh.states()) as manager:
        with pytest.raises(IncompatibleStateError) as info:
            manager.load()
        assert str(info.value) == (
            "the checkpoint of step 100 (the newest committed one) holds the states 'model', "
            "'optim', and this manager loads 'model', 'optim', 'train' (not in the "
            "checkpoint: 'train'): it was written by something else (quicksave.save, "
            "another program). Load one this manager wrote with load(step=N) (other "
            "committed steps: 10), keep other checkpoints out of the manager's folder, or "
            f"load(strict=False) to load the states both have [path={folder / 'step-100'}]"
        )
        assert isinstance(info.value.__cause__, IncompatibleStateError)  # the keys
        assert not fresh.optim.state  # nothing was loaded: no uninitialised state kept
        assert manager.load(step=10) == 10  # as the message says
    assert torch.equal(fresh.model.weight, job.model.weight)
    assert fresh.train.step == 1


def test_the_same_states_with_other_keys_keep_the_loads_own_error(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    job = _Job()
    job.step()
    quicksave.save(
        {"model": job.model.state_dict(), "optim": job.optim.state_dict(), "train": {"step": 1}},
        folder / "step-5",
        step=5,
    )
    with _manager(folder, _Job(seed=1).states()) as manager:
        with pytest.raises(IncompatibleStateError) as info:
            manager.load()
    # The names match: what differs is inside 'optim', and that error says so.
    assert info.value.message.startswith(
        "the checkpoint holds 'optim' as torch's optimizer.state_dict() saves it"
    )


def test_state_names_of_a_checkpoint_allow_dots_in_the_manager_names() -> None:
    fqns = ["model.w", "model.b", "opt.v1.state.w.exp_avg", "extra", "rng.rank_0.torch"]
    assert stored_state_names(fqns, ["model", "opt.v1"]) == {"model", "opt.v1", "extra", "rng"}
    error = IncompatibleStateError("keys", path="/ckpt/step-3", rank=1)
    same = states_mismatch(error, step=3, fqns=["a.x", "b"], wanted=["a", "b"], committed=[3])
    assert same is None
    other = states_mismatch(error, step=3, fqns=["a.x"], wanted=["b"], committed=[3])
    assert other is not None and (other.path, other.rank) == ("/ckpt/step-3", 1)
    assert other.message == (
        "the checkpoint of step 3 (the newest committed one) holds the states 'a', and this "
        "manager loads 'b' (not in the checkpoint: 'b'; not this manager's: 'a'): it was "
        "written by something else (quicksave.save, another program). Keep other "
        "checkpoints out of the manager's folder, or load(strict=False) to load the states "
        "both have"
    )
    many = states_mismatch(error, step=3, fqns=["a"], wanted=["b"], committed=list(range(12)))
    assert many is not None and "(other committed steps: …, 4, 5, 6, 7, 8, 9, 10, 11)" in str(many)


# ---------------------------------------------------------------- save: below the newest


def _old_run(folder: Path) -> _Job:
    job = _Job()
    with _manager(folder, job.states()) as manager:
        for step in (1, 2, 3, 4, 5):
            job.step()
            manager.save(step * 10)
    return job


def test_a_new_run_in_an_old_runs_folder_is_refused_until_it_loads(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    _old_run(folder)
    job = _Job(seed=1)
    with _manager(folder, job.states(), keep_latest_k=3) as manager:
        assert manager.committed_steps() == [10, 20, 30, 40, 50]
        job.step()
        assert not manager.save(1)  # not due: nothing is looked at, nothing raised
        for _ in range(2):  # refused again: catching it does not make it go through
            with pytest.raises(CheckpointError) as info:
                manager.save(10)
            assert str(info.value) == (
                "step 10 is below the newest committed checkpoint in this folder (step 50) "
                "and this manager has not called load(): saved, step 50 would stay the one a "
                "resume loads, and retention (which keeps the highest steps) would delete "
                "this run's checkpoints first. Call load() before training to resume from "
                f"step 50, or give a new run a new folder; nothing was written [path={folder}]"
            )
        assert manager.committed_steps() == [10, 20, 30, 40, 50]  # nothing written, deleted
        entries = sorted(n for n in os.listdir(folder) if n != ".quicksave-lock")
        assert entries == sorted(f"step-{s}" for s in (10, 20, 30, 40, 50))
        assert manager.load() == 50
        assert manager.save(60)
        assert manager.committed_steps() == [40, 50, 60]


def test_an_explicit_load_of_an_older_step_lets_the_run_go_on_from_there(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    _old_run(folder)
    job = _Job(seed=1)
    with _manager(folder, job.states(), keep_latest_k=0) as manager:
        assert manager.load(step=20) == 20  # e.g. back to before a loss spike
        assert manager.save(30, force=True) is False  # committed already: skipped
        assert manager.save(25, force=True)
        assert manager.committed_steps() == [10, 20, 25, 30, 40, 50]


def test_a_first_save_at_or_above_the_newest_step_goes_through_without_load(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "ckpt"
    _old_run(folder)
    with _manager(folder, _Job(seed=1).states(), keep_latest_k=0) as manager:
        assert manager.save(50) is False  # committed already: skipped, as before
        assert manager.save(40) is False  # checked once: this manager writes at the top
        assert manager.save(60)
        assert manager.committed_steps() == [10, 20, 30, 40, 50, 60]


def _rank_new_run_in_old_folder(rank: int, world_size: int, root: str) -> dict[str, Any]:
    folder = Path(root) / "ckpt"
    job = _Job()
    errors = []
    with _manager(folder, job.states(), async_mode="process") as manager:
        for step in (10, 20):
            try:
                manager.save(step)
            except CheckpointError as e:
                errors.append(e.message)
        loaded = manager.load()
        manager.save(40)
        manager.wait()
        committed = manager.committed_steps()
    return {"errors": errors, "loaded": loaded, "committed": committed}


@pytest.mark.slow
def test_every_rank_refuses_alike_and_nobody_waits(tmp_path: Path) -> None:
    quicksave.save(
        {k: v.state_dict() for k, v in _Job().states().items()}, tmp_path / "ckpt" / "step-30"
    )
    config = LaunchConfig(timeout_s=150.0, collective_timeout_s=60.0)
    results = run_ranks(_rank_new_run_in_old_folder, 2, str(tmp_path), config=config)
    for r in results:
        assert [m.split(" is below")[0] for m in r["errors"]] == ["step 10", "step 20"], r
        assert r["loaded"] == 30 and r["committed"] == [30, 40], r


def test_a_folder_that_cannot_be_listed_leaves_the_check_to_the_next_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "ckpt"
    _old_run(folder)
    job = _Job(seed=1)
    with _manager(folder, job.states(), keep_latest_k=0) as manager:
        listing = manager.session.committed_steps

        def store_down(**kw: Any) -> list[int]:  # as a listing on a store that is down
            raise CheckpointError("the store did not answer", path=str(folder))

        monkeypatch.setattr(manager.session, "committed_steps", store_down)
        with caplog.at_level("WARNING", logger="quicksave"):
            assert manager.save(15, force=True)  # not compared: the save goes on, commits
        assert f"could not list {folder} to compare step 15 with its checkpoints" in caplog.text
        monkeypatch.setattr(manager.session, "committed_steps", listing)
        with pytest.raises(CheckpointError, match=r"^step 20 is below the newest committed"):
            manager.save(20)  # listed now: compared, refused
