"""The one plan exchange (``ranks.exchange.central_round``) over real gloo groups, and the
NVRx-compatible API's planning through it and through the one plan cache.

Functions whose name starts with ``_rank_`` run inside the spawned ranks.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from launcher import LaunchConfig, run_ranks

from helpers.collectives import CollectiveLog
from quicksave.errors import CheckpointError
from quicksave.ranks.exchange import central_round
from quicksave.saving.plan_cache import PlanCache

pytestmark = pytest.mark.slow

LAUNCH = LaunchConfig(timeout_s=120.0, grace_s=10.0, collective_timeout_s=30.0)


def _outcome(fn: Any) -> dict[str, Any]:
    try:
        return {"value": fn()}
    except CheckpointError as e:
        return {"error": type(e).__name__, "message": e.message, "rank": e.rank, "fqn": e.fqn}


def _rank_rounds(rank: int, world_size: int) -> dict[str, Any]:
    log = CollectiveLog()
    out: dict[str, Any] = {}
    with log:

        def double(gathered: list[int]) -> list[int]:
            return [2 * g for g in gathered[::-1]]

        out["ok"] = _outcome(lambda: central_round(rank + 1, double, None, 1, rank))
        out["ok_collectives"] = log.names()

        def broken(gathered: list[int]) -> list[int]:
            raise ValueError(f"cannot plan {sorted(gathered)}")

        out["raises"] = _outcome(lambda: central_round(rank, broken, None, 0, rank))
        out["short"] = _outcome(lambda: central_round(rank, lambda g: g[:1], None, 0, rank))

        def refuse(gathered: list[int]) -> list[int]:
            raise CheckpointError("rank 1's plan is refused", rank=1)

        out["refused"] = _outcome(lambda: central_round(rank, refuse, None, 0, rank))
        out["not_a_list"] = _outcome(lambda: central_round(rank, _nothing, None, 0, rank))

        def interrupted(gathered: list[int]) -> list[int]:
            raise KeyboardInterrupt("stop")

        try:
            out["interrupt"] = _outcome(lambda: central_round(rank, interrupted, None, 0, rank))
        except KeyboardInterrupt:
            out["interrupt"] = "KeyboardInterrupt"
    return out


def _nothing(gathered: list[int]) -> None:
    return None


def test_central_round_replies_per_rank_and_raises_everywhere() -> None:
    got = run_ranks(_rank_rounds, 2, config=LAUNCH)
    # Coordinator 1 gathered [1, 2] and replied [4, 2] in rank order.
    assert [g["ok"] for g in got] == [{"value": 4}, {"value": 2}]
    for g in got:
        assert g["ok_collectives"] == ["gather_object", "scatter_object_list"]
        # A decide that raises: every rank raises, naming the coordinator and the cause.
        assert g["raises"]["error"] == "CheckpointError" and g["raises"]["rank"] == 0
        assert "ValueError: cannot plan [0, 1]" in g["raises"]["message"]
        assert "1 replies for 2 ranks" in g["short"]["message"]
        assert g["refused"]["rank"] == 1 and "refused" in g["refused"]["message"]
        assert "NoneType" in g["not_a_list"]["message"], g["not_a_list"]
    # An interrupt in the coordinator's decision: it stops there, the others hear of it.
    assert got[0]["interrupt"] == "KeyboardInterrupt"
    assert "interrupted (KeyboardInterrupt)" in got[1]["interrupt"]["message"]


def _refuse_all(gathered: list[int]) -> list[int]:
    raise ValueError("no")


def test_central_round_alone_has_the_same_outcomes() -> None:
    assert central_round(3, lambda g: [g[0] + 1], None, 0, 0, distributed=False) == 4
    with pytest.raises(CheckpointError, match="ValueError: no") as info:
        central_round(3, _refuse_all, None, 0, 0, distributed=False)
    assert info.value.rank == 0


def _rank_nvrx_planning_failure(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from quicksave.compat.nvrx import FileSystemWriterAsync, save_state_dict_async_plan

    sd: dict[str, Any] = {"w": torch.full((4,), float(rank)), "step": 3}
    if rank == 1:
        sd["bad"] = object()  # cannot be stored: rank 1's local planning fails
    path = os.path.join(root, "refused")
    result = _outcome(
        lambda: save_state_dict_async_plan(sd, FileSystemWriterAsync(path), None, 0) and "planned"
    )
    torch.distributed.barrier()
    result["left"] = sorted(os.listdir(root))
    return result


def test_nvrx_planning_failure_on_one_rank_is_raised_on_every_rank(tmp_path) -> None:
    got = run_ranks(_rank_nvrx_planning_failure, 2, str(tmp_path), config=LAUNCH)
    for g in got:
        assert g["error"] == "IncompatibleStateError", g
        assert g["rank"] == 1 and g["fqn"] == "bad", g
        assert g["left"] == [], g  # nothing written, nothing half-made


def test_plan_cache_reuses_only_the_same_key_under_the_same_context() -> None:
    cache: PlanCache[str] = PlanCache()
    assert cache.lookup("k", (2, 0)) is None
    cache.store("k", (2, 0), "share", local="local", plan="whole")
    assert cache.lookup("k", (2, 0)) == "share"
    assert cache.lookup("k", (4, 0)) is None  # another group size
    assert cache.lookup("other", (2, 0)) is None  # another state
    cache.seed = ("a", "b")
    cache.clear()
    assert (cache.share, cache.local, cache.plan, cache.seed) == (None, None, None, None)
    assert cache.lookup("k", (2, 0)) is None
