"""Campaigns 5 and 6: an eval script beside a writing job, a second writer refused,
and readers racing a writer whose retention deletes a checkpoint at every commit."""

from __future__ import annotations

from pathlib import Path

import pytest
from campaign import check, scales
from forkserver import ForkServer

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("scale", scales())
def test_eval_script_beside_a_job(scale: float, tmp_path: Path, fork_server: ForkServer) -> None:
    res = check("two_jobs", scale, tmp_path, fork_server)
    assert res.outcomes["eval_load_ok"] > 0
    assert res.size["quicksave_ls_runs"] > 0
    assert res.outcomes.get("saves_failed", 0) == 0  # the eval never harmed the job


@pytest.mark.parametrize("scale", scales())
def test_second_writer_is_refused(scale: float, tmp_path: Path, fork_server: ForkServer) -> None:
    res = check("second_writer", scale, tmp_path, fork_server)
    # each attempt, the read_only manager, and the loser of each simultaneous start
    assert res.outcomes["refused"] == 2 * res.size["attempts"] + 1
    assert res.size["simultaneous_starts"] == res.size["attempts"]


@pytest.mark.parametrize("keep", [1, 2])
@pytest.mark.parametrize("scale", scales())
def test_readers_race_retention(
    scale: float, keep: int, tmp_path: Path, fork_server: ForkServer
) -> None:
    res = check(f"readers_keep{keep}", scale, tmp_path, fork_server)
    assert res.outcomes["load_ok"] > 0
    assert res.size["verifications"] > 0
