"""Copies of what several ranks save under one name (``quicksave.ranks.replicas``): the
rule for what is compared, the error, and ``plan_save``'s vote on 3 gloo ranks (equal
copies cost nothing extra; different ones fail every rank on a miss, on a hit and on a
hit of plans seeded from a checkpoint; ranks that share different sets of entries still
save).

Functions whose name starts with ``_rank_`` run inside the spawned ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from launcher import LaunchConfig, run_ranks

from helpers.collectives import CollectiveLog
from quicksave.errors import IncompatibleStateError
from quicksave.ranks import replicas
from quicksave.saving.rank_plans import (
    collect_local,
    global_plan,
    local_copies,
    local_plan,
    shared_keys,
)

LAUNCH = LaunchConfig(timeout_s=120.0, grace_s=10.0, collective_timeout_s=30.0)


def _copies(sd: dict[str, Any], rank: int = 0) -> dict[str, replicas.Copy]:
    return local_copies(collect_local(sd, rank))


# ------------------------------------------------------------------- the rule


def test_values_are_compared_bit_for_bit() -> None:
    a = _copies({"pos": 100, "lr": 0.0, "name": "x", "order": [1, 2]})
    b = _copies({"pos": 100, "lr": -0.0, "name": "x", "order": [1, 2]})
    assert a.keys() == b.keys() == {"v:pos", "v:lr", "v:name", "v:order"}
    assert a["v:pos"] == b["v:pos"] and a["v:order"] == b["v:order"]
    assert a["v:lr"].digest != b["v:lr"].digest  # -0.0 is not 0.0
    assert a["v:pos"].summary == "100" and a["v:name"].summary == '"x"'


def test_small_cpu_tensors_are_compared_and_big_ones_are_not() -> None:
    small = torch.arange(replicas.CHECK_BYTES // 8, dtype=torch.int64)
    big = torch.zeros(replicas.CHECK_BYTES // 4 + 1, dtype=torch.float32)
    c = _copies({"small": small, "big": big, "scalar": torch.tensor(3.5)})
    assert set(c) == {"t:small", "t:scalar"}
    assert c["t:scalar"].summary == "float32[] 3.5"
    assert c["t:small"].summary == "int64[8192] [0, 1, 2, 3, 4, 5]…"
    assert replicas.tensor_copy("big", big) is None
    # off the CPU (an accelerator; "meta" stands in for one here): not compared
    assert replicas.tensor_copy("gpu", torch.empty(3, device="meta")) is None
    changed = small.clone()
    changed[-1] += 1  # past the summary's preview: the digest still sees it
    assert _copies({"small": changed})["t:small"].digest != c["t:small"].digest


def test_the_error_names_the_name_the_ranks_their_values_and_the_wrapper() -> None:
    ranks = [
        _copies({"loader": {"pos": p}, "step": 7, "lr": lr})
        for p, lr in [(100, 0.1), (101, 0.1), (100, 0.2)]
    ]
    error = replicas.divergence(ranks)
    assert isinstance(error, IncompatibleStateError)
    assert error.fqn == "loader.pos" and error.rank == 1
    assert "(ranks 0, 2: 100; rank 1: 101)" in error.message
    assert "{'loader': quicksave.PerRank(obj)}" in error.message
    assert error.message.endswith("nothing was saved (also different across ranks: lr)")
    assert replicas.divergence([ranks[0], _copies({"loader": {"pos": 100}})]) is None


def test_entries_one_rank_holds_are_never_compared() -> None:
    # per-rank names (PerRank's rank_<r> entries) differ by name, not by value
    a = _copies({"loader": {"rank_0": {"pos": 100}}, "step": 7})
    b = _copies({"loader": {"rank_1": {"pos": 101}}, "step": 7})
    assert replicas.divergence([a, b]) is None
    plans = [local_plan({"loader": {f"rank_{r}": {"pos": r}}, "step": 7}, r) for r in range(2)]
    assert shared_keys(plans) == [("v:step",), ("v:step",)]


def test_fingerprints_are_equal_iff_the_shared_copies_are() -> None:
    a = _copies({"pos": 100, "w": torch.ones(3)})
    assert replicas.fingerprint(a) == replicas.fingerprint(
        _copies({"pos": 100, "w": torch.ones(3)})
    )
    assert replicas.fingerprint(a) != replicas.fingerprint(
        _copies({"pos": 100, "w": torch.zeros(3)})
    )
    assert replicas.fingerprint({}) is None
    assert 0 <= replicas.fingerprint(a) < 2**replicas.FINGERPRINT_BITS < replicas.NEUTRAL


# ------------------------------------------------------------ plan_save, 3 ranks


def _state(rank: int, pos: int) -> dict[str, Any]:
    """Replicated weights and step; ``pos`` under a plain name; "pair" entries that
    ranks 0 and 1 share (``a``) and ranks 1 and 2 share (``b``): different sets."""
    sd: dict[str, Any] = {
        "w": torch.arange(12, dtype=torch.float32),
        "step": 5,
        "loader": {"pos": pos},
    }
    if rank in (0, 1):
        sd["a"] = torch.ones(2)
    if rank in (1, 2):
        sd["b"] = 9
    return sd


def _rank_vote(rank: int, world_size: int, seed_manifest: bytes) -> dict[str, Any]:
    from quicksave.format.manifest_parse import from_json_bytes
    from quicksave.saving.plan_cache import PlanCache
    from quicksave.saving.plan_vote import plan_save
    from quicksave.saving.rank_plans import seeded_cache

    log = CollectiveLog().install()
    out: dict[str, Any] = {}

    def save(name: str, pos: int, cache: PlanCache) -> None:
        before = len(log)
        try:
            plan_save(_state(rank, pos), cache, None, 0, rank, world_size, 2)
            out[name] = {"error": None, "collectives": len(log) - before}
        except IncompatibleStateError as e:
            out[name] = {"error": str(e), "collectives": len(log) - before}

    cache = PlanCache()
    save("first", 10, cache)  # a miss: plans and copies go to the coordinator
    save("equal", 11, cache)  # a hit, copies changed but equal: the vote only
    save("differ", 20 + rank, cache)  # a hit whose copies differ: named by the exchange
    save("after", 12, cache)  # the error cleared the cache: a miss, then fine
    save("again", 13, cache)
    save("miss_differ", 30 + rank, PlanCache())  # a miss whose copies differ
    seeded = seeded_cache(from_json_bytes(seed_manifest))
    save("seeded_differ", 40 + rank, seeded)  # a hit on the checkpoint's plans
    return out


@pytest.mark.slow
def test_plan_save_compares_shared_copies_without_an_extra_collective() -> None:
    from tests.helpers.manifests import committed_json

    world = 3
    seed = global_plan([local_plan(_state(r, 0), r) for r in range(world)], 2)
    got = run_ranks(_rank_vote, world, committed_json(seed.skeleton), config=LAUNCH)
    for rank, r in enumerate(got):
        assert r["first"] == {"error": None, "collectives": 3}, rank
        # Ranks 0 and 2 share different sets of entries than rank 1: their fingerprints
        # differ although nothing does, so the hit takes the exchange and saves.
        assert r["equal"]["error"] is None, (rank, r["equal"])
        assert r["after"]["error"] is None and r["again"]["error"] is None, rank
        for name in ("differ", "miss_differ", "seeded_differ"):
            message = r[name]["error"]
            assert message is not None and message == got[0][name]["error"], (rank, name)
            assert "fqn=loader.pos" in message and "rank=1" in message, message
            assert "quicksave.PerRank" in message
        assert "rank 0: 20; rank 1: 21; rank 2: 22" in r["differ"]["error"]
        assert "rank 0: 40; rank 1: 41; rank 2: 42" in r["seeded_differ"]["error"]


def _uniform(rank: int, pos: int) -> dict[str, Any]:
    return {"w": torch.arange(12, dtype=torch.float32), "step": 5, "loader": {"pos": pos}}


def _rank_uniform(rank: int, world_size: int) -> list[int]:
    from quicksave.saving.plan_cache import PlanCache
    from quicksave.saving.plan_vote import plan_save

    log = CollectiveLog().install()
    cache = PlanCache()
    counts = []
    for pos in range(4):  # equal on every rank, changing every save
        before = len(log)
        plan_save(_uniform(rank, pos), cache, None, 0, rank, world_size, 2)
        counts.append(len(log) - before)
    return counts


@pytest.mark.slow
def test_equal_changing_copies_cost_one_all_reduce_per_save() -> None:
    assert run_ranks(_rank_uniform, 3, config=LAUNCH) == [[3, 1, 1, 1]] * 3
