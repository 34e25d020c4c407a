"""Campaigns 2 and 8: SIGKILL of the trainer, its worker or both at random moments,
then resume; a SIGSTOPped (hung) worker."""

from __future__ import annotations

from pathlib import Path

import pytest
from campaign import check, scales
from forkserver import ForkServer

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("scale", scales())
def test_sigkill_trainer_worker_or_both(
    scale: float, tmp_path: Path, fork_server: ForkServer
) -> None:
    res = check("sigkill", scale, tmp_path, fork_server)
    kills = [v for k, v in res.size.items() if k.startswith("kills[")]
    assert len(kills) == 4 and min(kills) >= 1  # trainer, worker, both, restart_now
    # the worker of every trainer killed beside one was gone within 5 s (else a violation)
    exits = res.timings["worker_exit_after_trainer_s"]
    assert len(exits) >= res.size["trainer_kills_with_a_worker"] >= 1
    assert max(exits) <= 5.0


@pytest.mark.parametrize("scale", scales())
def test_hung_worker_is_an_error_within_10_s(scale: float, tmp_path: Path) -> None:
    res = check("hung_worker", scale, tmp_path)
    took = res.timings["time_to_error_s"]
    assert len(took) == res.size["trials"]
    assert max(took) <= 10.0
