"""The seeds' planning API on 2 real gloo ranks: the usage guide's flow, the plan cache
(collectives counted), reuse of a loaded checkpoint's plans after a "restart", per-rank
plans in the manifest, and a write failure on one rank.

Functions whose name starts with ``_rank_`` run inside the spawned ranks.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from launcher import LaunchConfig, run_ranks

import quicksave
from helpers.collectives import CollectiveLog
from quicksave.commit import CheckpointKind, classify
from quicksave.commit.manifest_reader import read_manifest

pytestmark = pytest.mark.slow

LAUNCH = LaunchConfig(timeout_s=90.0, grace_s=10.0, collective_timeout_s=30.0)


def _state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    shared = torch.Generator().manual_seed(step)
    return {
        "model": {
            "shared": torch.randn(64, 8, generator=shared),  # replicated: written once
            f"rank{rank}.local": torch.randn(33, generator=g).to(torch.bfloat16),
        },
        "train": {"step": step, "name": "seed-api"},
    }


def _zeros_like(sd: dict) -> dict:
    return {
        "model": {k: torch.zeros_like(v) for k, v in sd["model"].items()},
        "train": {"step": -1, "name": ""},
    }


def _same(a: dict, b: dict) -> bool:
    return (
        all(
            torch.equal(a["model"][k].view(torch.uint8), b["model"][k].view(torch.uint8))
            for k in a["model"]
        )
        and a["train"] == b["train"]
    )


def _plan_and_schedule(sd, path, queue, **kwargs):
    """The usage guide's async_save_checkpoint (without MSC); returns the planning's
    collectives."""
    from quicksave.compat.nvrx import (
        AsyncRequest,
        FileSystemWriterAsync,
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
    )

    writer = FileSystemWriterAsync(path, thread_count=2)
    with CollectiveLog() as log:
        ret = save_state_dict_async_plan(sd, writer, None, 0, **kwargs)
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()

    def finalize_fn() -> None:
        save_state_dict_async_finalize(*ret)
        if dist.is_initialized():
            dist.barrier()

    request = AsyncRequest(save_fn, save_args, [finalize_fn], preload_fn=preload_fn)
    return writer, request, log.names()


def _load_both_ways(expected: dict, path: str) -> None:
    out = _zeros_like(expected)
    # Each rank's own "rank<r>.local" is in the checkpoint next to the other rank's.
    quicksave.load(out, path, strict=False)
    assert _same(expected, out)
    out = _zeros_like(expected)
    dcp.load(out, storage_reader=quicksave.StorageReader(path))
    assert _same(expected, out)


def _rank_usage_guide_and_cache(rank: int, world_size: int, root: str) -> dict:
    from quicksave.compat.nvrx import (
        AsyncCallsQueue,
        CheckpointMetadataCache,
        get_metadata_caching_status,
    )

    queue = AsyncCallsQueue()
    out: dict = {"plan_calls": []}
    # quicksave keeps no process-wide default cache: the caller holds it.
    run_cache = CheckpointMetadataCache()
    try:
        for step in (1, 2):
            sd = _state(rank, step)
            path = os.path.join(root, f"iter-{step}")
            _, request, calls = _plan_and_schedule(
                sd, path, queue, enable_cache=True, metadata_cache=run_cache
            )
            out["plan_calls"].append(calls)
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
            _load_both_ways(sd, path)
        out["status"] = list(get_metadata_caching_status(metadata_cache=run_cache))
        out["no_cache_status"] = get_metadata_caching_status()

        # "Restart": a fresh cache from the loaded checkpoint's metadata.
        cache = CheckpointMetadataCache()
        md = quicksave.StorageReader(os.path.join(root, "iter-2")).read_metadata()
        cache.set_cached_global_metadata(md)
        sd = _state(rank, 3)
        path = os.path.join(root, "iter-3")
        _, request, calls = _plan_and_schedule(
            sd, path, queue, enable_cache=True, metadata_cache=cache
        )
        out["plan_calls"].append(calls)
        out["restart_status"] = list(cache.get_metadata_caching_status())
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
        _load_both_ways(sd, path)

        # quicksave.save (DCP's StorageWriter) records both ranks' plans too.
        quicksave.save(_state(rank, 4), os.path.join(root, "func"), step=4)
    finally:
        queue.close()
    return out


def test_usage_guide_flow_cache_and_restart_reuse(tmp_path: Path):
    results = run_ranks(_rank_usage_guide_and_cache, 2, str(tmp_path), config=LAUNCH)
    for r in results:
        first, second, restart = r["plan_calls"]
        # First save: gather + scatter of plans; later: one all_reduce of one integer.
        assert "gather_object" in first and "scatter_object_list" in first
        assert second == ["all_reduce"]
        assert restart == ["all_reduce"]
        assert r["status"] == [True, False]
        assert r["no_cache_status"] is None
        assert r["restart_status"] == [False, True]
    for name in ("iter-1", "iter-2", "iter-3", "func"):
        path = tmp_path / name
        assert classify(str(path)) is CheckpointKind.QUICKSAVE
        assert not any(n.startswith(("part-", "error-")) for n in os.listdir(path))
        m = read_manifest(path)
        assert m.world_size == 2 and m.plans is not None and len(m.plans) == 2
        for rank, plan in enumerate(m.plans):
            fqns = {c.fqn for c in plan.tensors}
            # Each rank's plan is what it held before deduplication.
            assert fqns == {"model.shared", f"model.rank{rank}.local"}
            assert set(plan.objects) == {"train.step", "train.name"}
            local = next(c for c in plan.tensors if c.fqn.endswith("local"))
            assert (local.shape, local.dtype) == ((33,), "bfloat16")
        # The replicated tensor was written once.
        assert len(m.tensors["model.shared"].chunks) == 1
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def _rank_failure_on_rank_1(rank: int, world_size: int, root: str) -> dict:
    from quicksave.compat.nvrx import AsyncCallsQueue
    from quicksave.errors import CheckpointError

    queue = AsyncCallsQueue()
    try:
        good = _state(rank, 1)
        _, request, _ = _plan_and_schedule(good, os.path.join(root, "iter-1"), queue)
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True, no_dist=False)

        writer, request, _ = _plan_and_schedule(
            _state(rank, 2), os.path.join(root, "iter-2"), queue
        )
        if rank == 1:  # a path trick: rank 1's data file name is taken by a directory
            name = f"__{rank}_0.distcp"  # the DCP layout's first data file
            os.makedirs(os.path.join(writer.draft, name, "blocker"))
        queue.schedule_async_request(request)
        try:
            queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
        except CheckpointError as e:
            error = {"message": e.message, "rank": e.rank}
        else:
            error = None
        _load_both_ways(good, os.path.join(root, "iter-1"))
        return {"error": error}
    finally:
        queue.close()


def test_write_failure_on_one_rank_commits_nothing(tmp_path: Path):
    results = run_ranks(_rank_failure_on_rank_1, 2, str(tmp_path), config=LAUNCH)
    for rank, r in enumerate(results):
        assert r["error"] is not None, rank
        assert "rank 1" in r["error"]["message"]
        assert r["error"]["rank"] == rank
    # Reported at finalize on every rank (a CheckpointException), with the cause.
    assert "rank 1: Worker failure: IsADirectoryError" in results[0]["error"]["message"]
    assert "rank 1 could not write its data (IsADirectoryError" in results[1]["error"]["message"]
    assert classify(str(tmp_path / "iter-2")) is CheckpointKind.MISSING
    assert classify(str(tmp_path / "iter-1")) is CheckpointKind.QUICKSAVE
