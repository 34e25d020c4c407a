"""The usage guide's "Using Multi-Storage Client with Async Checkpointing" flow, written
as the guide writes it, on quicksave's NVRx-compatible API, against a real S3 server
(SeaweedFS, the ``s3_server`` / ``s3_bucket`` fixtures) through an MSC profile.

``FileSystemWriterAsync("msc://profile/path", use_msc=True)`` → ``save_state_dict_async_plan``
→ ``AsyncRequest`` → ``AsyncCallsQueue`` → ``maybe_finalize_async_calls(blocking=True,
no_dist=False)`` writes a quicksave checkpoint under the profile's prefix (data objects,
per-rank parts, ``manifest.json`` last) and nothing on the local filesystem. It loads
bit-exact with ``quicksave.load`` and with ``dcp.load`` through ``quicksave.StorageReader``.

The guide's ``load_checkpoint`` (DCP's ``load`` with MSC's ``MultiStorageFileSystemReader``,
which is DCP's stock ``FileSystemReader``) reads it bit-exact too: ``FileSystemWriterAsync``
lays files out with ``dcp_compat`` (each chunk preceded by its torch legacy-serialization
prefix, objects as ``torch.save`` bytes after ``.metadata``'s pickle; docs/FORMAT.md §3, §5).

Stock DCP checkpoints written by ``dcp.save`` with MSC's ``MultiStorageFileSystemWriter``
load with ``quicksave.load("msc://...")``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import multistorageclient as msc
import pytest
import torch
import torch.distributed.checkpoint as dcp
from msc_config import msc_config_for, msc_profile
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    load,
)

import quicksave
from quicksave.compat.nvrx.core import AsyncCallsQueue, AsyncRequest
from quicksave.compat.nvrx.filesystem_async import FileSystemWriterAsync
from quicksave.compat.nvrx.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from quicksave.errors import CheckpointError, CheckpointExistsError
from quicksave.loading.verify import verify_checkpoint
from quicksave.storage import StorageOptions

PROFILE = "model-checkpoints"


# -- the usage guide's code, as written (quicksave's modules in place of NVRx's) ------------


def async_save_checkpoint(checkpoint_path, state_dict, thread_count=2):
    """
    Save checkpoint asynchronously to MSC storage.
    """
    # Create async queue
    async_queue = AsyncCallsQueue()

    # Create writer with MSC enabled
    writer = FileSystemWriterAsync(checkpoint_path, thread_count=thread_count, use_msc=True)

    coordinator_rank = 0
    planner = DefaultSavePlanner()

    # Plan the save operation
    save_state_dict_ret = save_state_dict_async_plan(
        state_dict, writer, None, coordinator_rank, planner=planner
    )

    # Create async request with finalization
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()

    def finalize_fn():
        """Finalizes async checkpointing and synchronizes processes."""
        save_state_dict_async_finalize(*save_state_dict_ret)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    async_request = AsyncRequest(save_fn, save_args, [finalize_fn], preload_fn=preload_fn)

    # Schedule the request and return the queue for later checking
    async_queue.schedule_async_request(async_request)
    return async_queue


def load_checkpoint(checkpoint_path, state_dict):
    """
    Load checkpoint from MSC storage into the state_dict.
    """
    # Create reader with MSC path
    reader = msc.torch.MultiStorageFileSystemReader(checkpoint_path, thread_count=2)

    # Load the checkpoint into the state_dict
    load(
        state_dict=state_dict,
        storage_reader=reader,
        planner=DefaultLoadPlanner(),
    )
    return state_dict


# -- helpers --------------------------------------------------------------------------------


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(33, 7, generator=g),
            "b16": torch.randn(129, generator=g).to(torch.bfloat16),
            "h": torch.randn(5, 3, generator=g).to(torch.float16),
            "nested": {"ids": torch.randint(-(2**62), 2**62, (17,), generator=g)},
        },
        "mask": torch.rand(41, generator=g) > 0.5,
        "f64": torch.randn(3, 3, generator=g, dtype=torch.float64),
        "step": 1234 + seed,
    }


def _empty_like(sd: dict) -> dict:
    out: dict = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = _empty_like(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = -1
    return out


def _assert_same(expected: dict, got: dict) -> None:
    assert expected.keys() == got.keys()
    for k, v in expected.items():
        if isinstance(v, dict):
            _assert_same(v, got[k])
        elif isinstance(v, torch.Tensor):
            g = got[k]
            assert g.dtype == v.dtype and g.shape == v.shape, k
            assert torch.equal(v.view(-1).view(torch.uint8), g.view(-1).view(torch.uint8)), k
        else:
            assert got[k] == v, k


def _keys(s3_server, bucket: str, prefix: str) -> dict[str, int]:
    client = s3_server.client()
    try:
        out = {}
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix.rstrip("/") + "/"
        ):
            for o in page.get("Contents", []):
                out[o["Key"][len(prefix.rstrip("/")) + 1 :]] = o["Size"]
        return out
    finally:
        client.close()


def _finalize(queue: AsyncCallsQueue) -> None:
    """The guide's finalization; the queue (a worker process) is closed afterwards."""
    try:
        queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    finally:
        queue.close()


def _schedule(
    path: str,
    sd: dict,
    *,
    before_finalize=None,
    persistent: bool = False,
    storage: StorageOptions | None = None,
    use_msc: bool = True,
    thread_count: int = 2,
) -> AsyncCallsQueue:
    """The guide's ``async_save_checkpoint`` with knobs: a thread queue by default (no
    worker process to start: faster), ``before_finalize`` run first in the finalize fn."""
    writer = FileSystemWriterAsync(
        path, thread_count=thread_count, use_msc=use_msc, storage=storage
    )
    ret = save_state_dict_async_plan(sd, writer, None, 0, planner=DefaultSavePlanner())
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()

    def finalize_fn():
        if before_finalize is not None:
            before_finalize()
        save_state_dict_async_finalize(*ret)

    queue = AsyncCallsQueue(persistent=persistent)
    queue.schedule_async_request(
        AsyncRequest(save_fn, save_args, [finalize_fn], preload_fn=preload_fn)
    )
    return queue


@pytest.fixture
def bucket(s3_server, s3_bucket) -> str:
    return s3_bucket


@pytest.fixture
def msc_env(s3_server, bucket, tmp_path: Path, monkeypatch) -> Path:
    """MSC_CONFIG with the guide's profile on the test bucket; the working directory is a
    fresh empty one, returned, so that a local ``msc:`` directory would show."""
    config = msc_config_for(s3_server, bucket, tmp_path / "config", profile=PROFILE)
    monkeypatch.setenv("MSC_CONFIG", config)
    # MSC's own shortcuts (its DCP reader and writer) keep one client per profile name for
    # the whole process: start each test with none, so the profile means this bucket.
    monkeypatch.setattr(msc.shortcuts, "_STORAGE_CLIENT_CACHE", {})
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


# -- the guide's flow -----------------------------------------------------------------------


def test_guide_flow_saves_to_msc_and_loads_bit_exact(s3_server, bucket, msc_env: Path):
    checkpoint_path = f"msc://{PROFILE}/run-1/iteration-0010"
    state_dict = _state()
    async_queue = async_save_checkpoint(checkpoint_path, state_dict)
    _finalize(async_queue)

    # Nothing local: no "msc:" directory, no temporary anywhere under the cwd.
    assert list(msc_env.iterdir()) == []

    # The objects: data files, .metadata, manifest.json; the parts were merged away.
    names = _keys(s3_server, bucket, "run-1/iteration-0010")
    assert "manifest.json" in names and ".metadata" in names
    data = {n for n in names if n.endswith(".safetensors")}
    assert data and names.keys() == data | {"manifest.json", ".metadata"}
    assert verify_checkpoint(checkpoint_path).ok

    out = _empty_like(state_dict)
    quicksave.load(out, checkpoint_path)
    _assert_same(state_dict, out)

    out = _empty_like(state_dict)
    dcp.load(out, storage_reader=quicksave.StorageReader(checkpoint_path))
    _assert_same(state_dict, out)
    assert list(msc_env.iterdir()) == []


def test_guide_load_checkpoint_with_msc_reader(msc_env: Path):
    checkpoint_path = f"msc://{PROFILE}/iteration-0010"
    state_dict = _state()
    _finalize(_schedule(checkpoint_path, state_dict))
    loaded_state_dict = load_checkpoint(checkpoint_path, _empty_like(state_dict))
    _assert_same(state_dict, loaded_state_dict)
    # the torch legacy prefixes that make this possible are checked by verify
    assert verify_checkpoint(checkpoint_path).ok


def test_async_save_is_invisible_until_finalize(s3_server, bucket, msc_env: Path):
    """Before finalize the prefix holds the data objects and the rank's part, no
    manifest: not a checkpoint. Finalize deletes the part and writes the manifest."""
    path = f"msc://{PROFILE}/iteration-0020"
    sd = _state(2)
    seen: dict = {}

    def look():
        seen["before"] = _keys(s3_server, bucket, "iteration-0020")
        with pytest.raises(CheckpointError):
            quicksave.load(_empty_like(sd), path)

    _finalize(_schedule(path, sd, before_finalize=look, thread_count=3))
    before = seen["before"]
    assert "part-rank-00000.json" in before
    assert "manifest.json" not in before and ".metadata" not in before
    assert len([n for n in before if n.endswith(".safetensors")]) == 3
    after = _keys(s3_server, bucket, "iteration-0020")
    assert "part-rank-00000.json" not in after and "manifest.json" in after
    out = _empty_like(sd)
    quicksave.load(out, path)
    _assert_same(sd, out)
    assert list(msc_env.iterdir()) == []


# -- stock DCP written by MSC's writer ------------------------------------------------------


def test_dcp_save_with_msc_writer_loads_with_quicksave(msc_env: Path):
    path = f"msc://{PROFILE}/dcp/step-5"
    sd = _state(5)
    dcp.save(sd, storage_writer=msc.torch.MultiStorageFileSystemWriter(path, thread_count=2))
    out = _empty_like(sd)
    quicksave.load(out, path)
    _assert_same(sd, out)
    assert list(msc_env.iterdir()) == []


# -- use_msc --------------------------------------------------------------------------------


def test_msc_path_without_use_msc_is_an_error_before_any_io(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MSC_CONFIG", str(tmp_path / "absent.yaml"))
    with pytest.raises(CheckpointError) as e:
        FileSystemWriterAsync("msc://model-checkpoints/iteration-0010", thread_count=2)
    assert "use_msc=True" in e.value.message
    assert e.value.path == "msc://model-checkpoints/iteration-0010"
    assert list(tmp_path.iterdir()) == []


def test_use_msc_with_a_local_path_writes_locally(tmp_path: Path):
    path = tmp_path / "iteration-0001"
    sd = _state(1)
    _finalize(_schedule(str(path), sd))
    # A local path: the DCP layout (FORMAT.md §8), DCP's own files (thread_count=2).
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "__0_1.distcp"]
    out = _empty_like(sd)
    quicksave.load(out, str(path))
    _assert_same(sd, out)
    # The guide's load step: DCP's load with MSC's reader (MSC serves plain paths).
    out2 = load_checkpoint(str(path), _empty_like(sd))
    _assert_same(sd, out2)
    assert verify_checkpoint(str(path)).ok


def test_s3_url_through_the_guide_api(s3_server, bucket, tmp_path: Path, monkeypatch):
    """``s3://`` works with either use_msc value, through quicksave's own S3 backend."""
    monkeypatch.chdir(tmp_path)
    storage = s3_server.storage_options()
    for use_msc in (False, True):
        path = f"s3://{bucket}/s3-run/iteration-{int(use_msc)}"
        sd = _state(10 + use_msc)
        _finalize(_schedule(path, sd, storage=storage, use_msc=use_msc))
        out = _empty_like(sd)
        quicksave.load(out, path, storage=storage)
        _assert_same(sd, out)
    assert list(tmp_path.iterdir()) == []


# -- failures -------------------------------------------------------------------------------


def test_bucket_deleted_before_finalize_fails_naming_the_url(s3_server, bucket, msc_env: Path):
    path = f"msc://{PROFILE}/iteration-0030"

    def delete_bucket():
        client = s3_server.client()
        try:
            client.delete_bucket(Bucket=bucket)
        finally:
            client.close()

    queue = _schedule(path, _state(3), before_finalize=delete_bucket)
    t0 = time.monotonic()
    with pytest.raises(CheckpointError) as e:
        _finalize(queue)
    assert time.monotonic() - t0 < 60
    assert path in str(e.value)
    assert list(msc_env.iterdir()) == []


def _bad_creds_config(s3_server, bucket: str, directory: Path) -> str:
    """A config whose profiles ``PROFILE`` and ``bad-creds`` sign with a wrong secret."""
    bad = msc_profile(
        endpoint_url=s3_server.endpoint_url,
        bucket=bucket,
        access_key=s3_server.access_key_id,
        secret_key="not-the-secret-key",
        region=s3_server.region or "us-east-1",
    )
    return msc_config_for(
        s3_server,
        bucket,
        directory,
        profile=PROFILE,
        secret_key="not-the-secret-key",
        extra_profiles={"bad-creds": bad},
    )


def test_write_failure_in_the_worker_fails_naming_the_url(
    s3_server, bucket, msc_env: Path, tmp_path: Path, monkeypatch
):
    """The worker process's uploads are refused (its MSC config, taken from the
    environment when the queue starts, has a wrong secret): ``maybe_finalize_async_calls``
    raises the rank's error naming the URL, the finalize function never runs, nothing
    hangs and no secret is shown."""
    path = f"msc://{PROFILE}/iteration-0040"
    sd = _state(4)
    writer = FileSystemWriterAsync(path, thread_count=2, use_msc=True)
    ret = save_state_dict_async_plan(sd, writer, None, 0, planner=DefaultSavePlanner())
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()
    monkeypatch.setenv("MSC_CONFIG", _bad_creds_config(s3_server, bucket, tmp_path / "bad"))
    finalized = []
    queue = AsyncCallsQueue()  # its worker process starts with the bad config
    queue.schedule_async_request(
        AsyncRequest(
            save_fn,
            save_args,
            [lambda: finalized.append(save_state_dict_async_finalize(*ret))],
            preload_fn=preload_fn,
        )
    )
    t0 = time.monotonic()
    with pytest.raises(CheckpointError) as e:
        _finalize(queue)
    assert time.monotonic() - t0 < 120
    assert path in str(e.value) and "rank 0" in str(e.value)
    assert "not-the-secret-key" not in str(e.value)
    assert finalized == []
    assert _keys(s3_server, bucket, "iteration-0040") == {}
    assert list(msc_env.iterdir()) == []


def test_bad_credentials_fail_at_planning_naming_the_url(
    s3_server, bucket, tmp_path: Path, monkeypatch
):
    """The coordinator checks the prefix while planning: a profile whose credentials are
    refused fails there, before anything is scheduled, naming the URL (not the secret)."""
    monkeypatch.setenv("MSC_CONFIG", _bad_creds_config(s3_server, bucket, tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    path = "msc://bad-creds/iteration-0050"
    writer = FileSystemWriterAsync(path, thread_count=2, use_msc=True)
    t0 = time.monotonic()
    with pytest.raises(CheckpointError) as e:
        save_state_dict_async_plan(_state(5), writer, None, 0, planner=DefaultSavePlanner())
    assert time.monotonic() - t0 < 120
    assert path in str(e.value)
    assert "not-the-secret-key" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config"]


def test_a_rank_error_part_fails_finalize_and_is_cleaned_up(s3_server, bucket, msc_env: Path):
    """A rank whose write fails leaves an error part object naming the cause; the
    coordinator's finalize raises it (naming the rank and the URL), commits nothing and
    deletes the save's objects."""
    path = f"msc://{PROFILE}/iteration-0055"
    sd = _state(55)
    writer = FileSystemWriterAsync(path, thread_count=2, use_msc=True)
    ret = save_state_dict_async_plan(sd, writer, None, 0, planner=DefaultSavePlanner())
    save_fn, _, (job, pool) = writer.get_save_function_and_args()
    staged = pool.tensors()  # chunk key -> tensor (views of the staging pool)
    first = next(iter(staged))
    with pytest.raises(CheckpointError) as e:
        save_fn(job, {k: v for k, v in staged.items() if k != first})  # one tensor lost
    assert e.value.path == path and e.value.rank == 0
    assert "error-rank-00000.json" in _keys(s3_server, bucket, "iteration-0055")
    with pytest.raises(CheckpointError) as e:
        save_state_dict_async_finalize(*ret)
    assert "rank 0 failed to write" in e.value.message and first in e.value.message
    assert path in str(e.value)
    assert _keys(s3_server, bucket, "iteration-0055") == {}
    assert list(msc_env.iterdir()) == []


def test_never_overwrites_a_committed_checkpoint(s3_server, bucket, msc_env: Path):
    """A second save to the same URL fails at planning, before any rank writes: the
    committed checkpoint stays whole."""
    path = f"msc://{PROFILE}/iteration-0060"
    first = _state(6)
    _finalize(_schedule(path, first))
    objects = _keys(s3_server, bucket, "iteration-0060")
    writer = FileSystemWriterAsync(path, thread_count=2, use_msc=True)
    with pytest.raises(CheckpointExistsError) as e:
        save_state_dict_async_plan(_state(7), writer, None, 0, planner=DefaultSavePlanner())
    assert e.value.path == path
    assert _keys(s3_server, bucket, "iteration-0060") == objects
    out = _empty_like(first)
    quicksave.load(out, path)
    _assert_same(first, out)


# -- two ranks ------------------------------------------------------------------------------


def _rank_guide_flow(rank: int, world_size: int, path: str) -> bool:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(rank)
    sd = {
        "shared": torch.arange(64, dtype=torch.float32),  # replicated: written once
        f"rank{rank}": torch.randn(19, generator=g).to(torch.bfloat16),
        "step": 7,
    }
    _finalize(async_save_checkpoint(path, sd))
    dist.barrier()
    out = {"shared": torch.zeros(64), f"rank{rank}": torch.zeros(19, dtype=torch.bfloat16)}
    out["step"] = -1
    quicksave.load(out, path)  # strict: each rank loads its own key, and some rank each key
    # and the guide's load_checkpoint (MSC's reader, DCP's planner), on every rank
    stock = {"shared": torch.zeros(64), f"rank{rank}": torch.zeros(19, dtype=torch.bfloat16)}
    load_checkpoint(path, stock)
    assert torch.equal(stock[f"rank{rank}"].view(torch.int16), sd[f"rank{rank}"].view(torch.int16))
    return (
        torch.equal(out["shared"], sd["shared"])
        and torch.equal(out[f"rank{rank}"].view(torch.int16), sd[f"rank{rank}"].view(torch.int16))
        and out["step"] == 7
    )


@pytest.mark.slow
def test_guide_flow_on_two_ranks(s3_server, bucket, msc_env: Path):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "multirank"))
    try:
        from launcher import LaunchConfig, run_ranks
    finally:
        sys.path.pop(0)
    path = f"msc://{PROFILE}/two/iteration-0070"
    config = LaunchConfig(timeout_s=120.0, grace_s=10.0, collective_timeout_s=60.0)
    assert run_ranks(_rank_guide_flow, 2, path, config=config) == [True, True]
    names = _keys(s3_server, bucket, "two/iteration-0070")
    assert not any(n.startswith("part-rank-") for n in names)
    assert {n for n in names if n.endswith(".safetensors")} and "manifest.json" in names
    assert list(msc_env.iterdir()) == []
