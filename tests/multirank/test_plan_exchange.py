"""``plan_save`` over real gloo groups: collectives per save, delta exchange, restart
seeding, the go flag and planning failures.

Each rank's state dict is a function of (rank, variant), so the parent process can
compute the uncached global plan for the same inputs and compare it with what the
ranks got. Functions whose name starts with ``_rank_`` run inside the spawned ranks.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
from launcher import LaunchConfig, run_ranks
from tests.helpers.manifests import committed_json

from helpers.collectives import CollectiveLog
from quicksave.format.manifest import to_json_bytes
from quicksave.saving.rank_plans import global_plan, local_plan

pytestmark = pytest.mark.slow

LAUNCH = LaunchConfig(timeout_s=120.0, grace_s=10.0, collective_timeout_s=30.0)
THREADS = 2


def _state(rank: int, variant: int) -> dict[str, Any]:
    """Replicated tensors (every rank), one tensor per rank, shared and per-rank values;
    variant 1 gives rank 1 an extra tensor (its plan changes, the others' do not)."""
    sd: dict[str, Any] = {
        "model": {
            "w": torch.arange(64, dtype=torch.float32).reshape(8, 8),
            "b": torch.arange(1000, dtype=torch.float32),
            "e": torch.ones(300, dtype=torch.bfloat16),
        },
        "own": {f"r{rank}": torch.full((5,), float(rank))},
        "step": 7,
        f"note{rank}": f"rank {rank}",
    }
    if variant == 1 and rank == 1:
        sd["extra"] = torch.zeros(17, dtype=torch.int16)
    return sd


def _digest(value: object) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()


def _summary(planned: Any, log: CollectiveLog, before: int) -> dict[str, Any]:
    if planned is None:
        return {"none": True, "counted": len(log) - before}
    return {
        "none": False,
        "counted": len(log) - before,
        "collectives": planned.collectives,
        "token": planned.token,
        "key": planned.key,
        "layout": _digest(planned.layout),
        "objects": list(planned.objects),
        "skeleton": None if planned.skeleton is None else to_json_bytes(planned.skeleton),
    }


def _rank_plan_saves(rank: int, world_size: int, seed_manifest: bytes) -> dict[str, Any]:
    from quicksave.errors import CheckpointError, IncompatibleStateError
    from quicksave.format.manifest_parse import from_json_bytes
    from quicksave.saving.plan_cache import PlanCache
    from quicksave.saving.plan_vote import plan_save
    from quicksave.saving.rank_plans import seeded_cache

    log = CollectiveLog().install()
    out: dict[str, Any] = {}

    def step(name: str, sd: dict[str, Any], cache: PlanCache, go: bool = True) -> None:
        before = len(log)
        planned = plan_save(sd, cache, None, 0, rank, world_size, THREADS, go=go)
        out[name] = _summary(planned, log, before)

    cache = PlanCache()
    step("first", _state(rank, 0), cache)
    step("steady1", _state(rank, 0), cache)
    step("steady2", _state(rank, 0), cache)
    step("changed", _state(rank, 1), cache)
    step("after_change", _state(rank, 1), cache)
    step("no_go", _state(rank, 1), cache, go=rank != 1)

    bad = _state(rank, 1)
    if rank == 1:
        bad["handle"] = object()  # not storable: rank 1 refuses before any exchange
    before = len(log)
    try:
        plan_save(bad, cache, None, 0, rank, world_size, THREADS)
        out["refused"] = {"error": None}
    except IncompatibleStateError as e:
        out["refused"] = {"error": "incompatible", "message": str(e), "counted": len(log) - before}
    except CheckpointError as e:
        out["refused"] = {"error": "checkpoint", "message": str(e), "counted": len(log) - before}
    step("after_refusal", _state(rank, 1), cache)

    seeded = seeded_cache(from_json_bytes(seed_manifest))
    step("restart", _state(rank, 1), seeded)
    step("restart_steady", _state(rank, 1), seeded)
    reseeded = seeded_cache(from_json_bytes(seed_manifest))
    step("restart_changed", _state(rank, 0), reseeded)
    return out


def _expected(variant: int, world_size: int) -> Any:
    return global_plan([local_plan(_state(r, variant), r) for r in range(world_size)], THREADS)


def test_plan_save_collectives_delta_restart() -> None:
    world = 2
    exp0, exp1 = _expected(0, world), _expected(1, world)
    got = run_ranks(_rank_plan_saves, world, committed_json(exp1.skeleton), config=LAUNCH)

    def check(name: str, exp: Any, collectives: int) -> None:
        tokens = {got[r][name]["token"] for r in range(world)}
        assert len(tokens) == 1, f"{name}: ranks got different tokens {tokens}"
        for r in range(world):
            s = got[r][name]
            assert s["collectives"] == collectives, (name, r, s["collectives"])
            assert s["counted"] == collectives, (name, r, s["counted"])
            assert s["key"] == exp.key
            assert s["layout"] == _digest(exp.layouts[r]), (name, r)
            assert s["objects"] == list(exp.objects[r])
            if r == 0:
                assert s["skeleton"] == to_json_bytes(exp.skeleton), name
            else:
                assert s["skeleton"] is None

    # First save: vote + one gather/scatter round. Then one all-reduce per save.
    check("first", exp0, 3)
    check("steady1", exp0, 1)
    check("steady2", exp0, 1)
    # Rank 1's plan changes: it alone sends a plan; the result equals uncached planning.
    check("changed", exp1, 3)
    check("after_change", exp1, 1)
    all_tokens = [
        got[0][n]["token"]
        for n in ("first", "steady1", "steady2", "changed", "after_change", "after_refusal")
    ]
    assert len(set(all_tokens)) == len(all_tokens), "a token was reused across saves"

    # One rank cannot save: every rank skips, after the single all-reduce.
    for r in range(world):
        assert got[r]["no_go"] == {"none": True, "counted": 1}

    # Rank 1 refuses its input: it raises its own error, rank 0 learns who failed.
    assert got[1]["refused"]["error"] == "incompatible"
    assert "[fqn=handle, rank=1]" in got[1]["refused"]["message"]
    assert got[0]["refused"]["error"] == "checkpoint"
    assert "rank 1 could not plan" in got[0]["refused"]["message"]
    assert "rank=1]" in got[0]["refused"]["message"]
    assert got[0]["refused"]["counted"] == got[1]["refused"]["counted"] == 1
    check("after_refusal", exp1, 1)

    # Restart from a manifest holding every rank's plan: no exchange at all.
    check("restart", exp1, 1)
    check("restart_steady", exp1, 1)
    # Restart where rank 1's plan differs: the coordinator has the others from the
    # manifest, so only rank 1 sends a plan (one gather/scatter round).
    check("restart_changed", exp0, 3)


# ------------------------------------------------------------ DTensor / ShardedTensor
DT_WORLD = 4
DT_LAUNCH = LaunchConfig(
    timeout_s=150.0, grace_s=15.0, collective_timeout_s=60.0, preload=("torch._dynamo",)
)


def _full(fqn: str, shape: tuple[int, ...]) -> torch.Tensor:
    seed = sum(map(ord, fqn))
    numel = 1
    for s in shape:
        numel *= s
    return (torch.arange(numel, dtype=torch.float32) * 3 + seed).reshape(shape)


DT_SHAPES = {
    "dt.rows": (10, 7),  # Shard(0) over 4 ranks: uneven
    "dt.repl": (6, 6),  # Replicate: one chunk held by all 4 ranks
    "dt.half": (9, 5),  # 2x2 mesh, [Replicate, Shard(0)]: each chunk held by 2 ranks
    "dt.grid": (8, 6),  # 2x2 mesh, [Shard(0), Shard(1)]
    "st.rows": (10, 3),  # ShardedTensor, chunked along dim 0
    "plain.big": (4000,),  # plain replicated tensors of several sizes: balanced
    "plain.mid": (3000,),
    "plain.small": (100,),
}


def _rank_dtensor_plans(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed._shard.sharded_tensor import Shard as STShard
    from torch.distributed._shard.sharded_tensor import ShardMetadata, init_from_local_shards
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from quicksave.saving.plan_cache import PlanCache
    from quicksave.saving.plan_vote import plan_save
    from quicksave.saving.rank_plans import collect_local

    flat = init_device_mesh("cpu", (world_size,))
    grid = init_device_mesh("cpu", (2, world_size // 2))
    full = {fqn: _full(fqn, shape) for fqn, shape in DT_SHAPES.items()}
    pieces = torch.chunk(full["st.rows"], world_size, dim=0)
    start = sum(p.shape[0] for p in pieces[:rank])
    shard = STShard(
        pieces[rank].clone(),
        ShardMetadata([start, 0], list(pieces[rank].shape), f"rank:{rank}/cpu"),
    )
    sd = {
        "dt": {
            "rows": distribute_tensor(full["dt.rows"], flat, [Shard(0)]),
            "repl": distribute_tensor(full["dt.repl"], flat, [Replicate()]),
            "half": distribute_tensor(full["dt.half"], grid, [Replicate(), Shard(0)]),
            "grid": distribute_tensor(full["dt.grid"], grid, [Shard(0), Shard(1)]),
        },
        "st": {"rows": init_from_local_shards([shard], *full["st.rows"].shape)},
        "plain": {k.split(".")[1]: full[k] for k in DT_SHAPES if k.startswith("plain.")},
        "step": 3,
    }
    state = collect_local(sd, rank)
    lp, tensors = state.plan, state.tensors
    assert sorted(tensors) == sorted(it.key for it in lp.items)
    for it in lp.items:  # every local tensor holds exactly its chunk's values
        box = tuple(slice(o, o + s) for o, s in zip(it.offsets, it.sizes, strict=True))
        assert torch.equal(tensors[it.key], full[it.fqn][box]), it.key
    planned = plan_save(sd, PlanCache(), None, 0, rank, world_size, 2)
    assert planned is not None
    return {
        "items": [
            (it.fqn, it.offsets, it.sizes, it.global_shape, it.dtype, it.nbytes) for it in lp.items
        ],
        "objects": list(lp.objects),
        "paths": [(f, list(p)) for f, p in lp.paths],
        "key": lp.key,
        "written": sorted(e.item.key for f in planned.layout.files for e in f.entries),
        "layout": _digest(planned.layout),
    }


def test_dtensor_and_sharded_tensor_chunks_dedup_and_balance() -> None:
    from quicksave.layout.plan import ItemSpec
    from quicksave.saving.rank_plans import LocalPlan

    got = run_ranks(_rank_dtensor_plans, DT_WORLD, config=DT_LAUNCH)
    plans = [
        LocalPlan(
            r,
            tuple(ItemSpec(*it) for it in g["items"]),
            tuple(g["objects"]),
            tuple((f, tuple(p)) for f, p in g["paths"]),
            g["key"],
        )
        for r, g in enumerate(got)
    ]
    gp = global_plan(plans, 2)
    held: dict[str, list[int]] = {}
    for p in plans:
        for it in p.items:
            held.setdefault(it.key, []).append(p.rank)
    assert len(held["dt.repl"]) == DT_WORLD  # replicated DTensor: the same chunk everywhere
    assert all(len(held[k]) == 2 for k in held if k.startswith("dt.half"))
    assert all(len(held[k]) == 1 for k in held if k.startswith(("dt.rows", "dt.grid", "st.")))

    writers: dict[str, list[int]] = {}
    for r, g in enumerate(got):
        assert g["layout"] == _digest(gp.layouts[r])  # the ranks got the uncached result
        for key in g["written"]:
            writers.setdefault(key, []).append(r)
    assert sorted(writers) == sorted(held)  # every chunk of the checkpoint is written...
    for key, ranks in writers.items():
        assert len(ranks) == 1, f"{key} written by {ranks}"  # ...exactly once
        assert ranks[0] in held[key]  # by a rank that holds it
    # Every tensor's chunks tile it exactly (the skeleton checks coverage).
    for fqn, shape in DT_SHAPES.items():
        assert gp.skeleton.tensors[fqn].shape == shape
    # Balanced: no rank writes more than the least loaded one plus the largest shared chunk.
    loads = [sum(it.nbytes for it in a) for a in gp.assigned]
    largest_shared = max(it.nbytes for p in plans for it in p.items if len(held[it.key]) > 1)
    assert max(loads) - min(loads) <= largest_shared, loads
    assert gp.objects[0] == ("step",) and all(o == () for o in gp.objects[1:])
