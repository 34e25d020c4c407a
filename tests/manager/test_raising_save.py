"""Whether the ``save()`` that raises an earlier (background) failure saves its own step,
as ``CheckpointManager.save`` documents it: with one rank it does not (the failure is
raised before the call writes; ``save(step)`` again saves it), with several it does
(every rank writes its step first, then all raise alike, so that none leaves the others
in the save's collectives), and that step commits in the background.

Writes fail for real: the folder is swapped for a file (one rank), or one rank's
worker fails its part (two ranks).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from launcher import LaunchConfig, run_ranks

from quicksave.errors import CheckpointError
from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState, OptimizerState
from quicksave.worker import multirank
from quicksave.worker.job import PersistJob


def _states(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    return {"model": ModelState(model), "optim": OptimizerState(model, optim)}


def test_one_rank_raises_before_writing_its_step_and_saving_it_again_works(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "ckpt"
    m = CheckpointManager(
        CheckpointConfig(folder=str(folder), interval=1, async_mode="thread"), _states()
    )
    try:
        assert m.save(1)
        m.wait()
        aside = folder.with_name("ckpt.aside")
        os.rename(folder, aside)
        folder.write_text("not a folder")  # every write under it fails
        assert m.save(2)  # handed to the writer; fails in the background
        m.session.drain()  # the failure is seen (noted, not raised: nothing settles here)
        folder.unlink()
        os.rename(aside, folder)
        with pytest.raises(CheckpointError) as info:
            m.save(3)
        assert "step-2" in str(info.value)
        assert m.session.in_flight == set() and m.committed_steps() == [1]  # 3 not written
        assert m.save(3)  # the same step again: saved now
        m.wait()
        assert m.committed_steps() == [1, 3]
    finally:
        m.close()


_ORIGINAL_WRITE = multirank.write_files


def _fail_rank_1_at_step_2(
    job: PersistJob, pool: memoryview, backend: Any, usage: Any
) -> dict[str, str]:
    if job.rank == 1 and job.step == 2:
        raise OSError(errno.EIO, "Input/output error", os.path.join(job.draft, "x"))
    return _ORIGINAL_WRITE(job, pool, backend, usage)


def _rank_raising_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    multirank.write_files = _fail_rank_1_at_step_2
    config = CheckpointConfig(
        folder=os.path.join(root, "ckpt"), interval=2, async_mode="thread", commit_timeout_s=20
    )
    m = CheckpointManager(config, _states())
    try:
        assert m.save(2)
        m.session.drain()  # each rank sees step 2 fail (noted only)
        try:
            m.save(4)
            raised = None
        except CheckpointError as e:
            raised = str(e)
        in_flight_after = sorted(m.session.in_flight)
        m.wait()
        return {"raised": raised, "written": 4 in in_flight_after or 4 in m.committed_steps(),
                "committed": m.committed_steps()}  # fmt: skip
    finally:
        m.close()


@pytest.mark.slow
def test_several_ranks_write_their_step_then_raise_the_earlier_failure(tmp_path: Path) -> None:
    config = LaunchConfig(timeout_s=150.0, collective_timeout_s=60.0)
    results = run_ranks(_rank_raising_save, 2, str(tmp_path), config=config)
    for rank, r in enumerate(results):
        assert r["raised"] is not None and "step-2" in r["raised"], (rank, r)
        assert r["written"] and r["committed"] == [4], (rank, r)
