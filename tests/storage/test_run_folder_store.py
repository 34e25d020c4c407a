"""A load pointed at a run folder on S3 names the checkpoints under it, as on a disk
(``quicksave/loading/run_folder.py``)."""

from __future__ import annotations

import pytest
import torch

import quicksave
from quicksave.errors import CheckpointNotFoundError


def test_a_run_prefix_names_its_checkpoints(s3_server, s3_bucket, monkeypatch) -> None:
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    run = f"s3://{s3_bucket}/run-7"
    for step in (10, 20):
        quicksave.save({"w": torch.full((2,), float(step))}, f"{run}/step-{step}")
    with pytest.raises(CheckpointNotFoundError) as info:
        quicksave.load({"w": torch.zeros(2)}, run)
    assert str(info.value) == (
        "not a checkpoint (no manifest.json): a folder of 2 checkpoints (step-10, step-20); "
        f"load one by its path, e.g. {run}/step-20 (the newest), or let a CheckpointManager "
        f"on this folder resume from the newest (manager.load()) [path={run}]"
    )
