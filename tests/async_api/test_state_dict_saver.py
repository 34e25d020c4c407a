"""The seeds' planning API in one process: FileSystemWriterAsync, save_state_dict_async_plan
/ _finalize with AsyncRequest and AsyncCallsQueue, the metadata cache, commit from parts.

Multi-rank behaviour (agreement collectives, failures on one rank) is in
tests/multirank/test_seed_planning_api.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import quicksave
from quicksave.commit import CheckpointKind, classify
from quicksave.commit.manifest_reader import read_manifest
from quicksave.compat.nvrx import (
    AsyncCallsQueue,
    AsyncRequest,
    CheckpointMetadataCache,
    FileSystemWriterAsync,
    get_metadata_caching_status,
    init_checkpoint_metadata_cache,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from quicksave.compat.nvrx import state_dict_saver as saver
from quicksave.errors import CheckpointError
from quicksave.stage.pool import SparePool


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(32, 16, generator=g),
            "b": torch.randn(16, generator=g).to(torch.bfloat16),
        },
        "step": seed,
        "note": f"seed-{seed}",
    }


def _empty_like(sd: dict) -> dict:
    return {
        "model": {k: torch.zeros_like(v) for k, v in sd["model"].items()},
        "step": -1,
        "note": "",
    }


def _assert_same(a: dict, b: dict) -> None:
    for k in a["model"]:
        assert torch.equal(a["model"][k].view(torch.uint8), b["model"][k].view(torch.uint8)), k
    assert (a["step"], a["note"]) == (b["step"], b["note"])


def _save(sd, path, queue, **plan_kwargs):
    """The usage guide's flow: plan → AsyncRequest with finalize → queue."""
    writer = FileSystemWriterAsync(str(path), thread_count=2)
    ret = save_state_dict_async_plan(sd, writer, None, 0, **plan_kwargs)
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()

    def finalize_fn() -> None:
        save_state_dict_async_finalize(*ret)

    queue.schedule_async_request(
        AsyncRequest(save_fn, save_args, [finalize_fn], preload_fn=preload_fn)
    )
    return ret


@pytest.fixture
def thread_queue():
    q = AsyncCallsQueue(persistent=False)
    yield q
    q.close()


def test_usage_guide_flow_in_worker_process_loads_bit_exact(tmp_path: Path):
    sd = _state(1)
    queue = AsyncCallsQueue()  # persistent worker process, as the seeds default
    try:
        _save(sd, tmp_path / "iter-1", queue, planner=DefaultSavePlanner())
        # The staged copy is what gets written: mutating now must not change the checkpoint.
        expected = {
            "model": {k: v.clone() for k, v in sd["model"].items()},
            "step": 1,
            "note": "seed-1",
        }
        sd["model"]["w"].add_(100.0)
        assert queue.maybe_finalize_async_calls(blocking=True, no_dist=False) == [0]
    finally:
        queue.close()
    path = tmp_path / "iter-1"
    assert classify(str(path)) is CheckpointKind.QUICKSAVE
    # The DCP layout: DCP's own file set (thread_count=2: two files), manifest in .metadata.
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "__0_1.distcp"]
    assert read_manifest(path).layout == "dcp"
    out = _empty_like(expected)
    quicksave.load(out, path)
    _assert_same(expected, out)
    out2 = _empty_like(expected)
    dcp.load(out2, storage_reader=quicksave.StorageReader(path))
    _assert_same(expected, out2)
    # One rank: the manifest omits "plans" (the rank's plan is the manifest itself).
    assert read_manifest(path).plans is None


def test_msc_path_needs_use_msc(tmp_path: Path, monkeypatch):
    # msc:// paths are written through MSC only with the seed's use_msc=True (the flow
    # itself: tests/storage/test_msc_flow.py); without it, an error before any I/O.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError) as e:
        FileSystemWriterAsync("msc://profile/iter-1")
    assert "use_msc=True" in e.value.message
    assert e.value.path == "msc://profile/iter-1"
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CheckpointError, match="unknown arguments"):
        FileSystemWriterAsync(str(tmp_path / "x"), bogus=1)


def test_cache_reuses_plan_on_second_save(tmp_path: Path, thread_queue, monkeypatch):
    cache = CheckpointMetadataCache()
    _save(_state(1), tmp_path / "a", thread_queue, enable_cache=True, metadata_cache=cache)
    thread_queue.maybe_finalize_async_calls(blocking=True)
    assert cache.get_metadata_caching_status() == (False, False)
    calls = []
    real = saver._plan_centrally
    monkeypatch.setattr(saver, "_plan_centrally", lambda *a: calls.append(1) or real(*a))
    sd2 = _state(2)
    _save(sd2, tmp_path / "b", thread_queue, enable_cache=True, metadata_cache=cache)
    thread_queue.maybe_finalize_async_calls(blocking=True)
    assert calls == [] and cache.get_metadata_caching_status() == (True, False)
    out = _empty_like(sd2)
    quicksave.load(out, tmp_path / "b")
    _assert_same(sd2, out)
    # A changed plan (a new tensor) is noticed: planning runs again.
    sd3 = _state(3)
    sd3["model"]["extra"] = torch.ones(3)
    _save(sd3, tmp_path / "c", thread_queue, enable_cache=True, metadata_cache=cache)
    thread_queue.maybe_finalize_async_calls(blocking=True)
    assert calls == [1] and "model.extra" in read_manifest(tmp_path / "c").tensors


def test_cache_is_not_reused_for_another_file_layout(tmp_path: Path, thread_queue, monkeypatch):
    # The cached central plan holds every rank's files: a writer with another
    # thread_count plans again (and its checkpoint has the files it asked for).
    cache = CheckpointMetadataCache()
    sd = _state(1)
    _save(sd, tmp_path / "a", thread_queue, enable_cache=True, metadata_cache=cache)
    thread_queue.maybe_finalize_async_calls(blocking=True)
    assert (cache.plans.hits, cache.plans.misses) == (0, 1)
    _save(sd, tmp_path / "b", thread_queue, enable_cache=True, metadata_cache=cache)
    thread_queue.maybe_finalize_async_calls(blocking=True)
    assert (cache.plans.hits, cache.plans.misses) == (1, 1)
    calls = []
    real = saver._plan_centrally
    monkeypatch.setattr(saver, "_plan_centrally", lambda *a: calls.append(1) or real(*a))
    writer = FileSystemWriterAsync(str(tmp_path / "c"), thread_count=1)
    ret = save_state_dict_async_plan(sd, writer, None, 0, enable_cache=True, metadata_cache=cache)
    save_fn, _, save_args = writer.get_save_function_and_args()
    save_fn(*save_args)
    save_state_dict_async_finalize(*ret)
    assert calls == [1] and (cache.plans.hits, cache.plans.misses) == (1, 2)
    assert len(read_manifest(tmp_path / "c").files) == 1  # the cached plan had 2
    out = _empty_like(sd)
    quicksave.load(out, tmp_path / "c")
    _assert_same(sd, out)


def test_restart_reuses_loaded_plans(tmp_path: Path, thread_queue, monkeypatch):
    _save(_state(1), tmp_path / "a", thread_queue)
    thread_queue.maybe_finalize_async_calls(blocking=True)
    md = quicksave.StorageReader(tmp_path / "a").read_metadata()
    assert [len(p.items) for p in md.all_local_plans] == [4]
    cache = init_checkpoint_metadata_cache(md)
    monkeypatch.setattr(saver, "_plan_centrally", lambda *a: pytest.fail("planned again"))
    sd = _state(5)
    _save(sd, tmp_path / "b", thread_queue, enable_cache=True, metadata_cache=cache)
    thread_queue.maybe_finalize_async_calls(blocking=True)
    assert cache.get_metadata_caching_status() == (False, True)
    out = _empty_like(sd)
    quicksave.load(out, tmp_path / "b")
    _assert_same(sd, out)


def test_init_cache_fills_the_given_cache_or_the_process_default(tmp_path: Path, thread_queue):
    _save(_state(1), tmp_path / "a", thread_queue)
    thread_queue.maybe_finalize_async_calls(blocking=True)
    md = quicksave.StorageReader(tmp_path / "a").read_metadata()
    mine = CheckpointMetadataCache()
    assert init_checkpoint_metadata_cache(md, metadata_cache=mine) is mine
    assert mine.cached_global_metadata is md and mine.loaded_all_plans is md.all_local_plans
    assert get_metadata_caching_status(metadata_cache=mine) == (False, False)
    # As NVRx: without a cache, the process default (one object, kept in process_state).
    default = init_checkpoint_metadata_cache(md)
    assert default is saver.PROCESS.metadata_cache is init_checkpoint_metadata_cache()
    assert default is not mine and default.cached_global_metadata is md
    assert get_metadata_caching_status() == default.get_metadata_caching_status()


def test_enable_cache_without_a_cache_uses_the_process_default(
    tmp_path: Path, thread_queue, monkeypatch
):
    monkeypatch.setattr(saver.PROCESS, "metadata_cache", None)  # this test's own default
    _save(_state(1), tmp_path / "a", thread_queue, enable_cache=True)
    thread_queue.maybe_finalize_async_calls(blocking=True)
    default = saver.PROCESS.metadata_cache
    assert default is not None and default.save_count == 1
    calls = []
    real = saver._plan_centrally
    monkeypatch.setattr(saver, "_plan_centrally", lambda *a: calls.append(1) or real(*a))
    sd = _state(2)
    _save(sd, tmp_path / "b", thread_queue, enable_cache=True)
    thread_queue.maybe_finalize_async_calls(blocking=True)
    assert calls == [] and get_metadata_caching_status() == (True, False)
    out = _empty_like(sd)
    quicksave.load(out, tmp_path / "b")
    _assert_same(sd, out)


def test_missing_part_commits_nothing_and_names_the_rank(tmp_path: Path):
    sd = _state(1)
    writer = FileSystemWriterAsync(str(tmp_path / "x"))
    ret = save_state_dict_async_plan(sd, writer)
    # save_fn never ran: no part file.
    os.makedirs(writer.draft)
    with pytest.raises(CheckpointError) as e:
        save_state_dict_async_finalize(*ret)
    assert e.value.rank == 0 and "left no part" in e.value.message
    assert not os.path.exists(writer.draft)
    assert classify(str(tmp_path / "x")) is CheckpointKind.MISSING


def test_failed_write_leaves_an_error_part_named_at_finalize(tmp_path: Path):
    from torch.distributed.checkpoint import CheckpointException

    sd = _state(1)
    writer = FileSystemWriterAsync(str(tmp_path / "x"), thread_count=1)
    ret = save_state_dict_async_plan(sd, writer)
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()
    os.makedirs(os.path.join(writer.draft, "__0_0.distcp", "blocker"))
    # As NVRx's writer: the failure is recorded, and reported at finalize (every rank).
    save_fn(save_args[0], preload_fn())
    with pytest.raises(CheckpointException) as e:
        save_state_dict_async_finalize(*ret)
    assert isinstance(e.value, CheckpointError) and e.value.rank == 0
    assert "rank 0: Worker failure: IsADirectoryError" in e.value.message
    assert list(e.value.failures) == [0]
    assert not os.path.exists(writer.draft)
    assert classify(str(tmp_path / "x")) is CheckpointKind.MISSING


def test_staging_buffers_are_reused_after_finalize_and_hold_the_new_values(
    tmp_path: Path, monkeypatch
):
    monkeypatch.setattr(saver.PROCESS, "spare_pool", SparePool())  # this test's own
    queue = AsyncCallsQueue()  # the worker maps the shared-memory buffers
    try:
        sd = _state(1)
        _save(sd, tmp_path / "a", queue)
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
        free = saver.PROCESS.spare_pool.waiting
        assert free is not None  # one shared-memory pool holds every tensor of the rank
        sd2 = _state(2)  # same shapes, new values
        second = _save(sd2, tmp_path / "b", queue)[0]
        assert second._pool is free  # the same pool again
        assert second._pool.buffer.data_ptr() == free.buffer.data_ptr()
        assert os.readlink(f"/proc/self/fd/{free.fd}").startswith("/memfd:")  # shared
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    for path, expected in ((tmp_path / "a", sd), (tmp_path / "b", sd2)):
        out = _empty_like(expected)
        quicksave.load(out, path)
        _assert_same(expected, out)


@pytest.mark.parametrize("dcp_layout", [False, True])
def test_finish_with_write_results_commits_also_a_cached_plan(tmp_path: Path, dcp_layout: bool):
    """NVRx's own finalize (``retrieve_write_results``, gather, ``finish``) commits with
    either file layout, also the second save, whose writer reused the cached plan and so
    never planned itself."""
    g = torch.Generator().manual_seed(0)
    sd = {"model": {"w": torch.randn(32, 16, generator=g)}, "step": 3}
    cache = CheckpointMetadataCache()
    for i in range(2):
        path = tmp_path / f"s{i}"
        w = FileSystemWriterAsync(path, thread_count=2)
        w.dcp_layout = dcp_layout
        _, md, _ = saver.save_state_dict_async_plan(
            sd, w, None, 0, enable_cache=True, metadata_cache=cache
        )
        fn, preload, args = w.get_save_function_and_args()
        fn(args[0], preload())
        w.finish(md, [w.retrieve_write_results()])
        out = {"model": {"w": torch.zeros(32, 16)}, "step": 0}
        quicksave.load(out, path)
        assert torch.equal(out["model"]["w"], sd["model"]["w"]) and out["step"] == 3
    assert cache.plans.hits >= 1
