"""A load pointed at a run folder (a folder of ``step-<N>`` checkpoints) instead of one
checkpoint: every reader (``quicksave.load``, ``load_state``, ``export_hf``,
``verify_checkpoint``) names the checkpoints in it, the newest one's path, and the
manager, instead of only "no manifest.json"."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import quicksave
from quicksave.errors import CheckpointNotFoundError
from quicksave.loading.run_folder import checkpoints_in
from quicksave.storage import parse_location


def _run_folder(root: Path, steps: list[int]) -> Path:
    for step in steps:
        quicksave.save({"model": {"w": torch.full((2,), float(step))}}, root / f"step-{step}")
    return root


@pytest.mark.parametrize(
    "read",
    [
        lambda p: quicksave.load({"model": {"w": torch.zeros(2)}}, p),
        quicksave.load_state,
        lambda p: quicksave.export_hf(p, p.parent / "hf"),
        quicksave.verify_checkpoint,
    ],
    ids=["load", "load_state", "export_hf", "verify_checkpoint"],
)
def test_each_reader_names_the_checkpoints_of_a_run_folder(tmp_path: Path, read) -> None:
    root = _run_folder(tmp_path / "run", [5, 10, 100])
    with pytest.raises(CheckpointNotFoundError) as info:
        read(root)
    assert str(info.value) == (
        "not a checkpoint (no manifest.json): a folder of 3 checkpoints (step-5, step-10, "
        f"step-100); load one by its path, e.g. {root / 'step-100'} (the newest), or let a "
        "CheckpointManager on this folder resume from the newest (manager.load()) "
        f"[path={root}]"
    )


def test_many_checkpoints_are_counted_and_only_committed_ones_listed(tmp_path: Path) -> None:
    root = _run_folder(tmp_path / "run", [1, 2, 3, 20, 100, 7])
    quicksave.save({"w": torch.zeros(1)}, root / "export-step-100")
    (root / "step-200.tmp-0123456789ab").mkdir()  # being written: no checkpoint
    (root / "notes").mkdir()
    assert checkpoints_in(parse_location(root)) == [
        "export-step-100", "step-1", "step-2", "step-3", "step-7", "step-20", "step-100",
    ]  # fmt: skip
    with pytest.raises(CheckpointNotFoundError) as info:
        quicksave.load_state(root)
    assert info.value.message.startswith(
        "not a checkpoint (no manifest.json): a folder of 7 checkpoints "
        f"(…, step-3, step-7, step-20, step-100); load one by its path, e.g. "
        f"{root / 'step-100'} (the newest)"
    )


def test_a_folder_of_other_checkpoints_names_one_without_calling_it_the_newest(
    tmp_path: Path,
) -> None:
    quicksave.save({"w": torch.zeros(1)}, tmp_path / "best")
    with pytest.raises(CheckpointNotFoundError) as info:
        quicksave.load_state(tmp_path)
    assert info.value.message == (
        "not a checkpoint (no manifest.json): a folder of 1 checkpoint (best); load one by "
        f"its path, e.g. {tmp_path / 'best'}, or let a CheckpointManager on this folder "
        "resume from the newest (manager.load())"
    )
