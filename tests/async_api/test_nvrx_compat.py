"""quicksave.compat.nvrx as a drop-in for NVRx 0.7's ``nvidia_resiliency_ext.checkpointing.
async_ckpt``: its names and signatures, collective finalize, failures reported on every
rank, restart after close/abort, functions of a training script's ``__main__``, the DCP
file layout, NVRx's setup checks and its process-wide metadata cache.

The expected signatures are written here from NVRx v0.7's sources (``core.py``,
``torch_ckpt.py``, ``state_dict_saver.py``, ``filesystem_async.py``).

Functions whose name starts with ``_w_`` run in the checkpoint worker process (module
level: the worker imports this module by name); those starting with ``_rank_`` run in
the ranks of a 2-process gloo group (tests/multirank/launcher.py), once for every two-rank
test (the ``two_ranks`` fixture). No test depends on timing: a "slow" write waits for a
gate file that the other rank creates once it is inside finalize.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib
import inspect
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import quicksave
from quicksave.cli.main import main as cli_main
from quicksave.compat.nvrx import (
    AsyncCallsQueue,
    AsyncRequest,
    FileSystemWriterAsync,
    TorchAsyncCheckpoint,
    get_metadata_caching_status,
    init_checkpoint_metadata_cache,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from quicksave.compat.nvrx import state_dict_saver as saver
from quicksave.compat.nvrx.core import abort_nvrx_checkpoint
from quicksave.errors import CheckpointError, CheckpointExistsError
from quicksave.loading.verify import verify_checkpoint

GATE_DEADLINE_S = 120.0
SCRIPT_TIMEOUT_S = 180.0
METADATA = ".metadata"


# ============================================================== 1. names and signatures
# (module, name, kind, NVRx 0.7's parameters). ``kind`` is how the class holds it.
NVRX_SIGNATURES: list[tuple[str, str, str, str]] = [
    ("core", "AsyncRequest.add_finalize_fn", "method", "self, fn"),
    ("core", "AsyncRequest.execute_sync", "method", "self"),
    ("core", "AsyncRequest.freeze", "method", "self"),
    (
        "core",
        "AsyncRequest.execute_finalize_fns",
        "method",
        "self, validate_matching_call_idx=True",
    ),
    (
        "core",
        "AsyncCallsQueue.__init__",
        "method",
        "self, persistent=True, is_daemon=True, cpu_priority=10, io_priority=None, "
        "sigterm_timeout=30.0, cpu_shm_mode=False",
    ),
    ("core", "AsyncCallsQueue._get_async_caller", "method", "self"),
    (
        "core",
        "AsyncCallsQueue.warmup_persistent_caller",
        "classmethod",
        "cls, rank, is_daemon=True, cpu_priority=10, io_priority=None, sigterm_timeout=30.0, "
        "cpu_shm_mode=False",
    ),
    ("core", "AsyncCallsQueue.schedule_async_request", "method", "self, async_request"),
    (
        "core",
        "AsyncCallsQueue.maybe_finalize_async_calls",
        "method",
        "self, blocking=False, no_dist=False",
    ),
    ("core", "AsyncCallsQueue.get_num_unfinalized_calls", "method", "self"),
    ("core", "AsyncCallsQueue.close", "method", "self, abort=False"),
    ("core", "abort_nvrx_checkpoint", "function", ""),
    ("torch_ckpt", "TorchAsyncCheckpoint.__init__", "method", "self, persistent_queue=True"),
    (
        "torch_ckpt",
        "TorchAsyncCheckpoint.async_save",
        "method",
        "self, state_dict, *args, **kwargs",
    ),
    (
        "torch_ckpt",
        "TorchAsyncCheckpoint.finalize_async_save",
        "method",
        "self, blocking=False, no_dist=True, terminate=False",
    ),
    ("torch_ckpt", "TorchAsyncCheckpoint._get_async_calls_queue", "method", "self"),
    ("torch_ckpt", "TorchAsyncCheckpoint.close", "method", "self, abort=False"),
    ("state_dict_saver", "CheckpointMetadataCache.__init__", "method", "self"),
    (
        "state_dict_saver",
        "CheckpointMetadataCache.set_cached_global_metadata",
        "method",
        "self, cached_global_metadata",
    ),
    (
        "state_dict_saver",
        "CheckpointMetadataCache.set_cache_metadata",
        "method",
        "self, central_plan, local_plan, global_md_verify_reuse",
    ),
    (
        "state_dict_saver",
        "CheckpointMetadataCache.prepare_save_state_dict_ret",
        "method",
        "self, rank, coordinator, save_state_dict_ret",
    ),
    ("state_dict_saver", "CheckpointMetadataCache.get_cache_metadata", "method", "self"),
    ("state_dict_saver", "CheckpointMetadataCache.get_metadata_caching_status", "method", "self"),
    (
        "state_dict_saver",
        "init_checkpoint_metadata_cache",
        "function",
        "cached_global_metadata=None",
    ),
    ("state_dict_saver", "get_metadata_caching_status", "function", ""),
    (
        "state_dict_saver",
        "save_state_dict_async_plan",
        "function",
        "state_dict, storage_writer, process_group=None, coordinator_rank=0, planner=None, "
        "enable_cache=False, metadata_cache=None",
    ),
    (
        "state_dict_saver",
        "verify_global_md_reuse",
        "function",
        "loaded_all_plans, local_plan, rank, dist_wrapper",
    ),
    (
        "state_dict_saver",
        "save_state_dict_async_finalize",
        "function",
        "storage_writer, global_metadata, dist_wrapper",
    ),
    (
        "filesystem_async",
        "FileSystemWriterAsync.__init__",
        "method",
        "self, path, *args, separation_hint=None, use_msc=False, is_multiproc_io=False, "
        "use_cached_data_structure=False, use_cpu_shm_for_gpu_tensors=False, **kwargs",
    ),
    (
        "filesystem_async",
        "FileSystemWriterAsync.prepare_write_data",
        "method",
        "self, plan, planner",
    ),
    ("filesystem_async", "FileSystemWriterAsync.cleanup_tensor_caches", "classmethod", "cls"),
    (
        "filesystem_async",
        "FileSystemWriterAsync.register_shm_drain_callback",
        "classmethod",
        "cls, fn",
    ),
    ("filesystem_async", "FileSystemWriterAsync.get_save_function_and_args", "method", "self"),
    ("filesystem_async", "FileSystemWriterAsync.write_data", "method", "self, plan, planner"),
    ("filesystem_async", "FileSystemWriterAsync.retrieve_write_results", "method", "self"),
    ("filesystem_async", "FileSystemWriterAsync.finish", "method", "self, metadata, results"),
    ("filesystem_async", "FileSystemWriterAsync.prepare_local_plan", "method", "self, plan"),
    ("filesystem_async", "FileSystemWriterAsync.checkpoint_id", "property", "self"),
    (
        "filesystem_async",
        "FileSystemWriterAsync.validate_checkpoint_id",
        "classmethod",
        "cls, checkpoint_id",
    ),
    (
        "filesystem_async",
        "FileSystemWriterAsync.preload_tensors",
        "staticmethod",
        "resolved_plan_data, non_blocking=True",
    ),
    (
        "filesystem_async",
        "FileSystemWriterAsync.write_preloaded_data_multiproc",
        "staticmethod",
        "transform_list, use_msc, open_file, rank, write_buckets, global_results_queue",
    ),
    (
        "filesystem_async",
        "FileSystemWriterAsync.write_preloaded_data_proc",
        "staticmethod",
        "transform_list, open_file, local_proc_idx, write_bucket, results_queue, count_queue, "
        "use_fsync, **kwargs",
    ),
    (
        "filesystem_async",
        "FileSystemWriterAsync.write_preloaded_data_multithread",
        "staticmethod",
        "transform_list, use_msc, open_file, rank, write_buckets, global_results_queue",
    ),
    (
        "filesystem_async",
        "FileSystemWriterAsync.write_preloaded_data",
        "staticmethod",
        "transform_list, open_file, local_thread_idx, write_bucket, results_queue, count_queue, "
        "use_fsync, **kwargs",
    ),
    (
        "filesystem_async",
        "FileSystemWriterAsync.prepare_decentralized_global_plan",
        "method",
        "self, local_plan",
    ),
]

# NVRx's module-level classes and functions (``logger`` aside: a logging.Logger, no API).
NVRX_PUBLIC_NAMES: list[tuple[str, str]] = [
    ("core", "AsyncRequest"),
    ("core", "AsyncCallsQueue"),
    ("core", "abort_nvrx_checkpoint"),
    ("core", "ObjectTracker"),
    ("core", "AsyncCaller"),
    ("core", "TemporalAsyncCaller"),
    ("core", "PersistentAsyncCaller"),
    ("torch_ckpt", "TorchAsyncCheckpoint"),
    ("state_dict_saver", "CheckpointMetadataCache"),
    ("state_dict_saver", "init_checkpoint_metadata_cache"),
    ("state_dict_saver", "get_metadata_caching_status"),
    ("state_dict_saver", "save_state_dict_async_plan"),
    ("state_dict_saver", "verify_global_md_reuse"),
    ("state_dict_saver", "save_state_dict_async_finalize"),
    ("filesystem_async", "FileSystemWriterAsync"),
    ("filesystem_async", "ConsistentDataIdentifier"),
    ("filesystem_async", "get_write_results_queue"),
    ("filesystem_async", "WriteBucket"),
]

# Where quicksave does not (yet) keep the promise: strict xfail, so a fix turns them
# into failures that say to drop the mark. (None left.)
MISSING: dict[str, str] = {}
SIGNATURE_GAPS: dict[str, str] = {}


def _with_gaps(rows: list[tuple[Any, ...]], gaps: dict[str, str]) -> list[Any]:
    """``rows`` as pytest params (id: module.name), the known ``gaps`` marked strict xfail."""
    out = []
    for row in rows:
        name = row[1]
        marks = [pytest.mark.xfail(strict=True, reason=gaps[name])] if name in gaps else []
        out.append(pytest.param(*row, id=f"{row[0]}.{name}", marks=marks))
    return out


def _nvrx_signature(params: str) -> inspect.Signature:
    namespace: dict[str, Any] = {}
    exec(f"def f({params}): pass", namespace)  # the data above, nothing else
    return inspect.signature(namespace["f"])


def _lookup(module: str, name: str) -> tuple[Any, str]:
    """The function behind ``module.name`` (a method's raw function) and how it is held."""
    obj: Any = importlib.import_module(f"quicksave.compat.nvrx.{module}")
    *owners, last = name.split(".")
    for part in owners:
        obj = getattr(obj, part)
    if not owners:
        return getattr(obj, last), "function"
    held = inspect.getattr_static(obj, last)
    if isinstance(held, classmethod):
        return held.__func__, "classmethod"
    if isinstance(held, staticmethod):
        return held.__func__, "staticmethod"
    if isinstance(held, property):
        return held.fget, "property"
    return held, "method"


@pytest.mark.parametrize(("module", "name"), _with_gaps(NVRX_PUBLIC_NAMES, MISSING))
def test_every_public_name_of_nvrx_exists(module: str, name: str) -> None:
    mod = importlib.import_module(f"quicksave.compat.nvrx.{module}")
    assert hasattr(mod, name), f"quicksave.compat.nvrx.{module} has no {name}"


@pytest.mark.parametrize(
    ("module", "name", "kind", "params"), _with_gaps(NVRX_SIGNATURES, SIGNATURE_GAPS)
)
def test_signature_matches_nvrx(module: str, name: str, kind: str, params: str) -> None:
    fn, held = _lookup(module, name)
    assert held == kind
    expected = [(p.name, p.kind, p.default) for p in _nvrx_signature(params).parameters.values()]
    actual = list(inspect.signature(fn).parameters.values())
    names = {n for n, _, _ in expected}
    # NVRx's parameters: same names, order, kinds and defaults.
    assert [(p.name, p.kind, p.default) for p in actual if p.name in names] == expected
    # Anything more: keyword-only, with a default, after NVRx's (so NVRx's calls still bind).
    last = max(
        (i for i, p in enumerate(actual) if p.name in names and p.kind is not p.VAR_KEYWORD),
        default=-1,
    )
    for i, p in enumerate(actual):
        if p.name not in names:
            assert p.kind is p.KEYWORD_ONLY and p.default is not p.empty, p
            assert i > last, p


def test_async_request_is_nvrx_named_tuple() -> None:
    assert issubclass(AsyncRequest, tuple)
    assert AsyncRequest._fields == (
        "async_fn",
        "async_fn_args",
        "finalize_fns",
        "async_fn_kwargs",
        "preload_fn",
        "is_frozen",
        "call_idx",
    )
    assert AsyncRequest._field_defaults == {
        "async_fn_kwargs": None,
        "preload_fn": None,
        "is_frozen": False,
        "call_idx": 0,
    }
    fn, args, fns, kwargs, preload, frozen, idx = AsyncRequest(print, (1,), [])
    assert (fn, args, fns, kwargs, preload, frozen, idx) == (print, (1,), [], None, None, False, 0)


def test_class_attributes_nvrx_tests_touch() -> None:
    # NVRx's own tests clear the writer's class-level caches and read async_fn.
    FileSystemWriterAsync._cached_identifiers.clear()
    FileSystemWriterAsync._shm_tensor_cache.clear()
    assert hasattr(TorchAsyncCheckpoint, "async_fn")


def _filesystem_writer_defaults() -> dict[str, Any]:
    """DCP ``FileSystemWriter``'s parameters after the path, with their defaults, in order."""
    params = list(inspect.signature(FileSystemWriter.__init__).parameters.values())[2:]
    assert all(p.default is not p.empty for p in params)
    return {p.name: p.default for p in params}


NVRX_WRITER_DEFAULTS = {
    "separation_hint": None,
    "use_msc": False,
    "is_multiproc_io": False,
    "use_cached_data_structure": False,
    "use_cpu_shm_for_gpu_tensors": False,
}


def test_filesystem_writer_async_takes_nvrx_and_dcp_arguments(tmp_path: Path) -> None:
    dcp_defaults = _filesystem_writer_defaults()
    assert list(dcp_defaults)[:3] == ["single_file_per_rank", "sync_files", "thread_count"]
    plain = FileSystemWriterAsync(tmp_path / "a")
    assert plain.thread_count == 1  # DCP's default
    assert (plain.fsync, plain.overwrite, plain.single_file_per_rank) == (True, True, True)
    by_name = FileSystemWriterAsync(tmp_path / "b", **dcp_defaults, **NVRX_WRITER_DEFAULTS)
    by_position = FileSystemWriterAsync(
        tmp_path / "c", *dcp_defaults.values(), **NVRX_WRITER_DEFAULTS
    )
    got = [
        (w.thread_count, w.fsync, w.overwrite, w.single_file_per_rank)
        for w in (by_name, by_position)
    ]
    assert got == [(1, True, True, True)] * 2
    # Positions map to FileSystemWriter's parameters: single_file_per_rank, sync_files,
    # thread_count, ...
    w = FileSystemWriterAsync(tmp_path / "d", True, False, 3)
    assert (w.single_file_per_rank, w.fsync, w.thread_count) == (True, False, 3)
    assert not any(tmp_path.iterdir())  # building a writer writes nothing


# ========================================================================== helpers
def _state(seed: int, rank: int = 0) -> dict[str, Any]:
    """Replicated tensors (same on every rank), one of this rank's own, and objects."""
    g = torch.Generator().manual_seed(seed)
    own = torch.Generator().manual_seed(1000 * seed + rank + 1)
    return {
        "model": {
            "w": torch.randn(12, 5, generator=g),
            "b16": torch.randn(33, generator=g).to(torch.bfloat16),
            "ids": torch.randint(-(2**62), 2**62, (9,), generator=g, dtype=torch.int64),
            f"rank{rank}": torch.randn(7, 3, generator=own),
        },
        "step": seed,
        "name": f"run-{seed}",
    }


def _zeros_like(sd: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {k: torch.zeros_like(v) for k, v in sd["model"].items()},
        "step": -1,
        "name": "",
    }


def _mismatches(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """Keys whose value is not bit-for-bit the expected one (dtype and shape included)."""
    bad = []
    for k, a in expected["model"].items():
        b = got["model"][k]
        same = a.dtype == b.dtype and a.shape == b.shape
        if same:
            same = bytes(a.reshape(-1).view(torch.uint8)) == bytes(b.reshape(-1).view(torch.uint8))
        if not same:
            bad.append(f"model.{k}")
    for k in ("step", "name"):
        if expected[k] != got[k] or type(expected[k]) is not type(got[k]):
            bad.append(k)
    return bad


def _load_every_way(expected: dict[str, Any], path: str, strict: bool = True) -> dict[str, Any]:
    """Mismatching keys per reader: stock DCP, MSC's reader (None: MSC not installed),
    quicksave.load."""
    out: dict[str, Any] = {}
    got = _zeros_like(expected)
    dcp.load(got, storage_reader=FileSystemReader(path))
    out["dcp"] = _mismatches(expected, got)
    try:
        from multistorageclient.contrib.torch import MultiStorageFileSystemReader
    except ImportError:
        out["msc"] = None
    else:
        got = _zeros_like(expected)
        dcp.load(got, storage_reader=MultiStorageFileSystemReader(path, thread_count=2))
        out["msc"] = _mismatches(expected, got)
    got = _zeros_like(expected)
    quicksave.load(got, path, strict=strict)
    out["quicksave"] = _mismatches(expected, got)
    return out


def _assert_loads_every_way(loaded: dict[str, Any]) -> None:
    assert loaded["dcp"] == [] and loaded["quicksave"] == []
    if loaded["msc"] is None:
        pytest.importorskip("multistorageclient")  # only skips where MSC is absent
    assert loaded["msc"] == []


def _schedule_save(
    queue: AsyncCallsQueue,
    sd: dict[str, Any],
    path: str | Path,
    *,
    planner: Any = None,
    enable_cache: bool = False,
    finalized: list[str] | None = None,
    **writer_kwargs: Any,
) -> int:
    """NVRx's documented flow: plan, then a request whose finalize function commits."""
    writer = FileSystemWriterAsync(str(path), **writer_kwargs)
    ret = save_state_dict_async_plan(
        sd, writer, None, 0, planner=planner, enable_cache=enable_cache
    )
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()
    fns: list[Any] = [functools.partial(save_state_dict_async_finalize, *ret)]
    if finalized is not None:
        fns.append(functools.partial(finalized.append, str(path)))
    return queue.schedule_async_request(
        AsyncRequest(save_fn, save_args, fns, preload_fn=preload_fn)
    )


def _temporaries(root: str | Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if ".tmp-" in n)


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + GATE_DEADLINE_S
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _describe(e: BaseException) -> dict[str, Any]:
    return {
        "type": type(e).__name__,
        "checkpoint_exception": isinstance(e, CheckpointException),
        "checkpoint_error": isinstance(e, CheckpointError),
        "message": str(e),
        "rank": getattr(e, "rank", None),
        "failed_ranks": sorted(getattr(e, "failures", {})),
    }


# ------------------------------------------------------------------ run in the worker
def _w_open_after_gate(gate: str, final: str, record: str, path: str, mode: str) -> Any:
    """``open_file`` of a slow rank: wait for ``gate``, note whether the checkpoint was
    already committed (it must not be: this rank has not written yet), then open."""
    _wait_for(Path(gate))
    committed = os.path.exists(os.path.join(final, METADATA))
    Path(record).write_text(json.dumps({"committed_before_write": committed}))
    return open(path, mode)


def _w_open_failing(cause: str, path: str, mode: str) -> Any:
    raise OSError(errno.ENOSPC, cause)


def _w_open_never(gate: str, path: str, mode: str) -> Any:
    _wait_for(Path(gate))  # nobody opens it: only an abort ends this write
    return open(path, mode)


def _w_boom(message: str) -> None:
    raise ValueError(message)


def _w_noop() -> None:
    pass


# ============================================================================ fixtures
@pytest.fixture(scope="module")
def queue() -> Iterator[AsyncCallsQueue]:
    """One persistent worker (NVRx's defaults: daemon) for the tests that leave it healthy."""
    q = AsyncCallsQueue()
    yield q
    q.close(abort=True)


# ==================================================================== 2-3, 6, 8: 2 ranks
def _launcher() -> Any:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "multirank"))
    import launcher

    return launcher


@contextlib.contextmanager
def _gate_opened_at_first_collective(gate: str) -> Iterator[None]:
    """Create ``gate`` when this rank's training thread makes its first collective call
    (it is then inside finalize, its own write done), or at the latest when the block
    ends (so that a rank returning too early fails the test instead of hanging it)."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in ("all_reduce", "barrier")}

    def spy(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            Path(gate).touch()
            return fn(*args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(dist, name, spy(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        Path(gate).touch()


def _rank_finalize_case(
    queue: AsyncCallsQueue, rank: int, root: str, no_dist: bool, slow_rank: int
) -> dict[str, Any]:
    name = f"finalize-{'no_dist' if no_dist else 'dist'}-slow{slow_rank}"
    path, gate, record = (os.path.join(root, name + s) for s in ("", ".gate", ".record"))
    sd = _state(3, rank)
    kwargs = {}
    if rank == slow_rank:
        kwargs["open_file"] = functools.partial(_w_open_after_gate, gate, path, record)
    _schedule_save(queue, sd, path, **kwargs)
    if rank == slow_rank:
        ids = queue.maybe_finalize_async_calls(blocking=True, no_dist=no_dist)
        committed_on_return = os.path.exists(os.path.join(path, METADATA))
    else:
        with _gate_opened_at_first_collective(gate):
            ids = queue.maybe_finalize_async_calls(blocking=True, no_dist=no_dist)
            committed_on_return = os.path.exists(os.path.join(path, METADATA))
    got = _zeros_like(sd)
    quicksave.load(got, path, strict=False)
    out = {"ids": ids, "committed_on_return": committed_on_return, "load": _mismatches(sd, got)}
    if rank == slow_rank:
        out.update(json.loads(Path(record).read_text()))
    return out


def _rank_write_failure_case(
    queue: AsyncCallsQueue, rank: int, world_size: int, root: str
) -> dict[str, Any]:
    import torch.distributed as dist

    path = os.path.join(root, "write-failure")
    kwargs = {}
    if rank == world_size - 1:  # NVRx's test: the last rank, so any world size works
        kwargs["open_file"] = functools.partial(_w_open_failing, "injected: disk full")
    _schedule_save(queue, _state(4, rank), path, **kwargs)
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except Exception as e:  # noqa: BLE001 - described for the test
        error = _describe(e)
    else:
        error = None
    dist.barrier()  # every rank has its outcome before the directory is looked at
    out = {"error": error, "committed": os.path.exists(path), "temporaries": _temporaries(root)}
    # The queue goes on: the same save again, without the fault, commits.
    sd = _state(5, rank)
    _schedule_save(queue, sd, path)
    out["retry_ids"] = queue.maybe_finalize_async_calls(blocking=True)
    got = _zeros_like(sd)
    quicksave.load(got, path, strict=False)
    out["retry_load"] = _mismatches(sd, got)
    return out


def _rank_async_fn_failure_case(queue: AsyncCallsQueue, rank: int) -> dict[str, Any]:
    ran: list[int] = []
    fn, args = (_w_boom, ("rank one's disk broke",)) if rank == 1 else (_w_noop, ())
    queue.schedule_async_request(AsyncRequest(fn, args, [functools.partial(ran.append, 1)]))
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except Exception as e:  # noqa: BLE001 - described for the test
        error = _describe(e)
    else:
        error = None
    return {"error": error, "finalize_ran": ran, "unfinalized": queue.get_num_unfinalized_calls()}


def _rank_format_case(queue: AsyncCallsQueue, rank: int, root: str, tc: int) -> dict[str, Any]:
    sd = _state(6 + tc, rank)
    ref, ours = os.path.join(root, f"dcp-tc{tc}"), os.path.join(root, f"fswa-tc{tc}")
    dcp.save(
        sd, storage_writer=FileSystemWriter(ref, thread_count=tc), planner=DefaultSavePlanner()
    )
    _schedule_save(queue, sd, ours, planner=DefaultSavePlanner(), thread_count=tc)
    queue.maybe_finalize_async_calls(blocking=True)
    return _load_every_way(sd, ours, strict=False)


def _rank_default_cache_case(queue: AsyncCallsQueue, rank: int, root: str) -> dict[str, Any]:
    # A forked rank: the process default cache and the patch die with it.
    exchanges: list[int] = []
    real = saver._plan_centrally

    def counted(*args: Any) -> Any:
        exchanges.append(1)
        return real(*args)

    saver._plan_centrally = counted
    out: dict[str, Any] = {"before": get_metadata_caching_status(), "saves": []}
    try:
        for step in (1, 2):
            sd = _state(10 + step, rank)
            path = os.path.join(root, f"cached-{step}")
            before = len(exchanges)
            _schedule_save(queue, sd, path, enable_cache=True)
            queue.maybe_finalize_async_calls(blocking=True)
            got = _zeros_like(sd)
            quicksave.load(got, path, strict=False)
            out["saves"].append(
                {
                    "exchanges": len(exchanges) - before,
                    "status": get_metadata_caching_status(),
                    "load": _mismatches(sd, got),
                }
            )
    finally:
        saver._plan_centrally = real
    return out


def _rank_nvrx_semantics(rank: int, world_size: int, root: str) -> dict[str, Any]:
    queue = AsyncCallsQueue()
    try:
        return {
            "finalize": {
                f"{no_dist}-{slow}": _rank_finalize_case(queue, rank, root, no_dist, slow)
                for no_dist in (False, True)
                for slow in (1, 0)
            },
            "write_failure": _rank_write_failure_case(queue, rank, world_size, root),
            "async_fn_failure": _rank_async_fn_failure_case(queue, rank),
            "format": {tc: _rank_format_case(queue, rank, root, tc) for tc in (1, 2)},
            "default_cache": _rank_default_cache_case(queue, rank, root),
        }
    finally:
        queue.close()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Run every two-rank case once (one gloo group, one queue per rank); the root
    directory and each rank's results."""
    launcher = _launcher()
    root = tmp_path_factory.mktemp("nvrx-2ranks")
    config = launcher.LaunchConfig(timeout_s=240.0, grace_s=10.0, collective_timeout_s=90.0)
    return root, launcher.run_ranks(_rank_nvrx_semantics, 2, str(root), config=config)


@pytest.mark.parametrize("no_dist", [False, True], ids=["no_dist=False", "no_dist=True"])
@pytest.mark.parametrize("slow_rank", [1, 0], ids=["slow=rank1", "slow=coordinator"])
def test_two_ranks_finalize_returns_only_after_the_commit(
    two_ranks: tuple[Path, list[dict[str, Any]]], no_dist: bool, slow_rank: int
) -> None:
    """The fast rank waits in finalize for the slow rank's write and the coordinator's
    commit; nothing is committed before the slow rank has written (NVRx's issue: a
    coordinator committing early under no_dist=True)."""
    _, results = two_ranks
    cases = [r["finalize"][f"{no_dist}-{slow_rank}"] for r in results]
    for c in cases:
        assert c["committed_on_return"] is True
        assert c["load"] == []
    assert cases[0]["ids"] == cases[1]["ids"] and len(cases[0]["ids"]) == 1
    assert cases[slow_rank]["committed_before_write"] is False


def test_two_ranks_write_failure_on_the_last_rank_raises_everywhere(
    two_ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, results = two_ranks
    errors = [r["write_failure"]["error"] for r in results]
    for rank, e in enumerate(errors):
        assert e is not None, f"rank {rank} did not raise"
        assert e["checkpoint_exception"] and e["checkpoint_error"], e
        assert e["rank"] == rank and e["failed_ranks"] == [1]
        assert (
            "rank 1" in e["message"] and "OSError: [Errno 28] injected: disk full" in e["message"]
        )
    # As NVRx: the coordinator reports the worker failure, the other ranks the outcome.
    assert "Worker failure" in errors[0]["message"]
    assert "Worker failure" not in errors[1]["message"]
    for r in results:
        assert r["write_failure"]["committed"] is False
        assert r["write_failure"]["temporaries"] == []
        assert len(r["write_failure"]["retry_ids"]) == 1 and r["write_failure"]["retry_load"] == []
    assert _temporaries(root) == []


def test_two_ranks_async_fn_failure_raises_everywhere(
    two_ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = two_ranks
    for rank, r in enumerate(results):
        case = r["async_fn_failure"]
        e = case["error"]
        assert e is not None, f"rank {rank} did not raise"
        assert e["checkpoint_exception"] and e["checkpoint_error"], e
        assert e["rank"] == rank and e["failed_ranks"] == [1]
        assert "rank 1" in e["message"] and "ValueError: rank one's disk broke" in e["message"]
        assert case["finalize_ran"] == [] and case["unfinalized"] == 0


@pytest.mark.parametrize("tc", [1, 2], ids=["thread_count=1", "thread_count=2"])
def test_two_ranks_layout_is_dcp_byte_for_byte_and_loads_every_way(
    two_ranks: tuple[Path, list[dict[str, Any]]], tc: int
) -> None:
    root, results = two_ranks
    _assert_same_files_as_dcp(root / f"dcp-tc{tc}", root / f"fswa-tc{tc}", ranks=2)
    for r in results:
        _assert_loads_every_way(r["format"][tc])
    assert verify_checkpoint(root / f"fswa-tc{tc}").ok


def test_two_ranks_default_metadata_cache_reuses_the_plan(
    two_ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = two_ranks
    for r in results:
        case = r["default_cache"]
        assert case["before"] is None  # no default cache until enable_cache=True used it
        first, second = case["saves"]
        assert (first["exchanges"], tuple(first["status"])) == (1, (False, False))
        assert (second["exchanges"], tuple(second["status"])) == (0, (True, False))
        assert first["load"] == [] and second["load"] == []


def _assert_same_files_as_dcp(ref: Path, ours: Path, ranks: int) -> None:
    names = sorted(os.listdir(ref))
    assert sorted(os.listdir(ours)) == names
    data = [n for n in names if n.endswith(".distcp")]
    assert {n.split("_")[2] for n in data} == {str(r) for r in range(ranks)}
    assert data and names == sorted([METADATA, *data])
    for n in data:
        assert (ours / n).read_bytes() == (ref / n).read_bytes(), n


# ======================================================================= 6. one rank
@pytest.mark.parametrize("tc", [1, 2], ids=["thread_count=1", "thread_count=2"])
def test_layout_is_dcp_byte_for_byte_and_loads_every_way(
    queue: AsyncCallsQueue, tmp_path: Path, tc: int, capsys: pytest.CaptureFixture[str]
) -> None:
    sd = _state(2)
    ref, ours = tmp_path / "dcp", tmp_path / "fswa"
    dcp.save(
        sd,
        storage_writer=FileSystemWriter(ref, thread_count=tc),
        planner=DefaultSavePlanner(),
        no_dist=True,
    )
    _schedule_save(queue, sd, ours, planner=DefaultSavePlanner(), thread_count=tc)
    assert len(queue.maybe_finalize_async_calls(blocking=True)) == 1
    _assert_same_files_as_dcp(ref, ours, ranks=1)
    _assert_loads_every_way(_load_every_way(sd, str(ours)))
    # quicksave verify: intact; then one flipped byte in a data file is found.
    assert verify_checkpoint(ours).ok
    assert cli_main(["verify", str(ours)]) == 0
    victim = ours / "__0_0.distcp"
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    victim.write_bytes(bytes(raw))
    report = verify_checkpoint(ours)
    assert not report.ok and {p.file for p in report.problems} == {"__0_0.distcp"}
    capsys.readouterr()
    assert cli_main(["verify", str(ours)]) == 1
    assert "__0_0.distcp" in capsys.readouterr().out


def test_saving_again_replaces_and_overwrite_false_refuses(
    queue: AsyncCallsQueue, tmp_path: Path
) -> None:
    path = tmp_path / "ckpt"
    for seed in (1, 2):  # DCP's default overwrite=True: the second save replaces the first
        _schedule_save(queue, _state(seed), path)
        queue.maybe_finalize_async_calls(blocking=True)
    got = _zeros_like(_state(2))
    quicksave.load(got, path)
    assert _mismatches(_state(2), got) == []
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # neither the old one nor a temporary
    before = {n: (path / n).read_bytes() for n in os.listdir(path)}
    with pytest.raises(CheckpointExistsError) as e:
        _schedule_save(queue, _state(3), path, overwrite=False)
    assert e.value.path == str(path)
    assert {n: (path / n).read_bytes() for n in os.listdir(path)} == before
    assert queue.get_num_unfinalized_calls() == 0 and sorted(os.listdir(tmp_path)) == ["ckpt"]


# ====================================================================== 3. one rank
def test_write_failure_raises_both_exception_types_and_commits_nothing(
    queue: AsyncCallsQueue, tmp_path: Path
) -> None:
    path = tmp_path / "ckpt"
    finalized: list[str] = []
    _schedule_save(
        queue,
        _state(1),
        path,
        finalized=finalized,
        open_file=functools.partial(_w_open_failing, "injected: disk full"),
    )
    with pytest.raises(CheckpointException) as info:
        queue.maybe_finalize_async_calls(blocking=True)
    e = info.value
    assert isinstance(e, CheckpointError) and e.rank == 0 and list(e.failures) == [0]
    assert "rank 0: Worker failure: OSError: [Errno 28] injected: disk full" in e.message
    assert finalized == [] and os.listdir(tmp_path) == []  # no checkpoint, no temporary
    # The queue goes on.
    sd = _state(2)
    _schedule_save(queue, sd, path, finalized=finalized)
    assert len(queue.maybe_finalize_async_calls(blocking=True)) == 1
    assert finalized == [str(path)]
    got = _zeros_like(sd)
    quicksave.load(got, path)
    assert _mismatches(sd, got) == []


# =================================================================== 7. setup checks
def test_daemon_worker_with_multiproc_io_is_an_invalid_setup(
    queue: AsyncCallsQueue, tmp_path: Path
) -> None:
    assert queue.is_daemon  # NVRx's default
    _schedule_save(queue, _state(1), tmp_path / "bad", is_multiproc_io=True)
    with pytest.raises(CheckpointException, match="Invalid Setup!"):
        queue.maybe_finalize_async_calls(blocking=True)
    assert os.listdir(tmp_path) == []
    # is_daemon=False: the same writer saves.
    q = AsyncCallsQueue(is_daemon=False)
    try:
        sd = _state(2)
        _schedule_save(q, sd, tmp_path / "good", is_multiproc_io=True)
        assert len(q.maybe_finalize_async_calls(blocking=True)) == 1
    finally:
        q.close()
    got = _zeros_like(sd)
    quicksave.load(got, tmp_path / "good")
    assert _mismatches(sd, got) == []


# ============================================================ 8. default metadata cache
def test_default_metadata_cache_after_a_restart_and_then_reused(
    queue: AsyncCallsQueue, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(saver.PROCESS, "metadata_cache", None)  # this test's own default
    assert get_metadata_caching_status() is None
    _schedule_save(queue, _state(1), tmp_path / "a")
    queue.maybe_finalize_async_calls(blocking=True)
    assert saver.PROCESS.metadata_cache is None  # enable_cache=False never makes one
    # "Restart": fill the process default from the loaded checkpoint's metadata.
    md = quicksave.StorageReader(tmp_path / "a").read_metadata()
    cache = init_checkpoint_metadata_cache(md)
    assert cache is saver.PROCESS.metadata_cache and cache.cached_global_metadata is md
    assert get_metadata_caching_status() == (False, False)
    monkeypatch.setattr(saver, "_plan_centrally", lambda *a: pytest.fail("planned again"))
    for name, seed, status in (("b", 2, (False, True)), ("c", 3, (True, False))):
        sd = _state(seed)
        _schedule_save(queue, sd, tmp_path / name, enable_cache=True)  # no metadata_cache
        queue.maybe_finalize_async_calls(blocking=True)
        assert get_metadata_caching_status() == status
        got = _zeros_like(sd)
        quicksave.load(got, tmp_path / name)
        assert _mismatches(sd, got) == []


# ==================================================== 5. functions of a script's __main__
SCRIPT = """
import functools, json, os, sys
import torch
import torch.distributed as dist
from quicksave.compat.nvrx import AsyncCallsQueue, AsyncRequest
from quicksave.errors import CheckpointError

OUT = sys.argv[1]
SCALE = 3.0
RANK = int(os.environ.get("RANK", "0"))
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    dist.init_process_group("gloo")


def out(name):
    return os.path.join(OUT, f"rank{RANK}-{name}")


def record(path, **what):
    with open(path, "w") as f:
        json.dump({"pid": os.getpid(), **what}, f)


def preload(state):  # preload_fn: its result replaces async_fn_args[1]
    return {k: v * SCALE for k, v in state.items()}, os.getpid()


def save(path, staged, tag):  # async_fn
    sd, preload_pid = staged
    torch.save(sd, path)
    record(path + ".json", tag=tag, preload_pid=preload_pid)


def closure(tag):
    def write(path):
        record(path, tag=tag)

    return write


class Note:
    pass


queue = AsyncCallsQueue()
state = {"w": torch.arange(4.0)}
finalized = []
queue.schedule_async_request(
    AsyncRequest(save, (out("main.pt"), None, "main"), [lambda: finalized.append("main")],
                 preload_fn=functools.partial(preload, state))
)
state["w"].fill_(-1.0)  # preloading is done when schedule_async_request returns
queue.schedule_async_request(AsyncRequest(closure("closure"), (out("closure.json"),), []))
queue.schedule_async_request(
    AsyncRequest(lambda path: record(path, tag="lambda"), (out("lambda.json"),), [])
)
queue.schedule_async_request(
    AsyncRequest(functools.partial(record, tag="partial"), (out("partial.json"),), [])
)
before = queue.get_num_unfinalized_calls()
refused = None
try:
    queue.schedule_async_request(AsyncRequest(record, (out("note.json"),), [], {"n": Note()}))
except CheckpointError as e:
    refused = {"message": str(e), "checkpoint_error": True}
ids = queue.maybe_finalize_async_calls(blocking=True)
print(json.dumps({
    "trainer": os.getpid(), "worker": queue.worker_pid, "refused": refused,
    "unfinalized_after_refusal": before, "ids": ids, "finalized": finalized,
}))
queue.close()
if dist.is_initialized():
    dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_script(tmp_path: Path, world_size: int) -> list[dict[str, Any]]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if world_size > 1:  # what torchrun sets
        env.update(
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
            GLOO_SOCKET_IFNAME="lo",
        )
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path)],
            cwd=tmp_path,
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)) if world_size > 1 else env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(world_size)
    ]
    outputs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=SCRIPT_TIMEOUT_S)
            assert p.returncode == 0, stdout + stderr
            outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return outputs


def _check_script_results(tmp_path: Path, rank: int, result: dict[str, Any]) -> None:
    trainer, worker = result["trainer"], result["worker"]
    assert worker is not None and worker != trainer
    # The class of __main__ was refused when scheduled, naming it; nothing was queued.
    refused = result["refused"]
    assert refused is not None and "__main__.Note" in refused["message"], refused
    assert result["unfinalized_after_refusal"] == 4
    assert result["ids"] == [0, 1, 2, 3] and result["finalized"] == ["main"]
    # async_fn and preload_fn of __main__ ran in the worker, on the state at scheduling.
    main = json.loads((tmp_path / f"rank{rank}-main.pt.json").read_text())
    assert main == {"pid": worker, "tag": "main", "preload_pid": worker}
    saved = torch.load(tmp_path / f"rank{rank}-main.pt")
    assert torch.equal(saved["w"], torch.arange(4.0) * 3.0)
    for tag in ("closure", "lambda", "partial"):
        got = json.loads((tmp_path / f"rank{rank}-{tag}.json").read_text())
        assert got == {"pid": worker, "tag": tag}
    assert not (tmp_path / f"rank{rank}-note.json").exists()


def test_functions_of_a_training_script_run_in_the_worker(tmp_path: Path) -> None:
    (result,) = _run_script(tmp_path, 1)
    _check_script_results(tmp_path, 0, result)


@pytest.mark.slow
def test_functions_of_a_training_script_run_in_the_worker_on_two_ranks(tmp_path: Path) -> None:
    results = _run_script(tmp_path, 2)
    for rank, result in enumerate(results):
        _check_script_results(tmp_path, rank, result)


# ================================================= 4. restart after close and abort
# (last in the module: abort_nvrx_checkpoint stops every queue of this process)
def test_close_finalizes_stops_the_worker_and_the_next_request_restarts_it(
    tmp_path: Path,
) -> None:
    q = AsyncCallsQueue()
    try:
        finalized: list[str] = []
        _schedule_save(q, _state(1), tmp_path / "a", finalized=finalized)
        caller = q._get_async_caller()
        assert caller is not None and caller._debug_is_async_process_running()
        pid = q.worker_pid
        assert pid is not None
        q.close()
        assert finalized == [str(tmp_path / "a")]  # close() finalizes first
        assert q._get_async_caller() is None and _pid_gone(pid)
        sd = _state(2)
        _schedule_save(q, sd, tmp_path / "b", finalized=finalized)
        caller = q._get_async_caller()
        assert caller is not None and caller._debug_is_async_process_running()
        assert q.worker_pid not in (None, pid)
        assert q.maybe_finalize_async_calls(blocking=True) == [0]
        got = _zeros_like(sd)
        quicksave.load(got, tmp_path / "b")
        assert _mismatches(sd, got) == []
    finally:
        q.close(abort=True)


def test_abort_nvrx_checkpoint_stops_every_queue_and_drops_their_calls(
    queue: AsyncCallsQueue, tmp_path: Path
) -> None:
    ckpt = TorchAsyncCheckpoint()  # its own queue and worker
    threads = AsyncCallsQueue(persistent=False)
    finalized: list[str] = []
    never = functools.partial(_w_open_never, str(tmp_path / "never-opened"))
    _schedule_save(queue, _state(1), tmp_path / "dropped", finalized=finalized, open_file=never)
    threads.schedule_async_request(AsyncRequest(None, (), [lambda: finalized.append("noop")]))
    ckpt_queue = ckpt._get_async_calls_queue()
    pids = [queue.worker_pid, ckpt_queue.worker_pid]
    assert None not in pids
    abort_nvrx_checkpoint()
    for q in (queue, ckpt_queue, threads):
        assert q._get_async_caller() is None and q.get_num_unfinalized_calls() == 0
    assert all(_pid_gone(pid) for pid in pids)
    assert finalized == []  # dropped, never finalized
    assert not (tmp_path / "dropped").exists()
    # The next request starts a new worker, which completes a save.
    sd = _state(2)
    _schedule_save(queue, sd, tmp_path / "after", finalized=finalized)
    assert queue.worker_pid not in (None, *pids)
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    assert finalized == [str(tmp_path / "after")]
    got = _zeros_like(sd)
    quicksave.load(got, tmp_path / "after")
    assert _mismatches(sd, got) == []
    ckpt.close()
    threads.close()


def test_nvrx_write_helpers_write_dcp_items_that_torch_loads(tmp_path: Path) -> None:
    """NVRx's static write helpers (``write_preloaded_data*``): a bucket per file, results
    per bucket on the queue; each item is a torch.save archive at its recorded bytes."""
    import io
    import queue as queue_mod

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    from quicksave.compat.nvrx.filesystem_async import FileSystemWriterAsync as W

    sd = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16), "n": 7}
    planner = DefaultSavePlanner()
    planner.set_up_planner(sd, is_coordinator=True)
    plan = planner.create_local_plan()
    byte_items = [
        (i, planner.resolve_data(i)) for i in plan.items if i.type == WriteItemType.BYTE_IO
    ]
    tensors = [(i, planner.resolve_data(i)) for i in plan.items if i.type != WriteItemType.BYTE_IO]
    buckets = [
        (str(tmp_path / "__0_0.distcp"), "__0_0.distcp", (byte_items, tensors[:1])),
        (str(tmp_path / "__0_1.distcp"), "__0_1.distcp", ([], tensors[1:])),
    ]
    q: queue_mod.Queue = queue_mod.Queue()
    W.write_preloaded_data_multithread([], False, open, 0, buckets, q)
    results = q.get_nowait()
    assert sorted(results) == [0, 1]
    by_fqn = {r.index.fqn: r for rs in results.values() for r in rs}
    assert sorted(by_fqn) == ["a", "b", "n"]
    for fqn in ("a", "b"):
        info = by_fqn[fqn].storage_data
        data = (tmp_path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        assert torch.equal(torch.load(io.BytesIO(data), weights_only=True), sd[fqn])
    info = by_fqn["n"].storage_data
    data = (tmp_path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
    assert torch.load(io.BytesIO(data), weights_only=True) == 7
    # A failure is put on the queue, not raised (NVRx's protocol).
    W.write_preloaded_data_multithread(
        [], False, open, 0, [(str(tmp_path / "no" / "x"), "x", ([], tensors[:1]))], q
    )
    assert isinstance(q.get_nowait(), FileNotFoundError)


def test_default_planner_records_key_types_and_keeps_the_pickle_dcp_only(
    queue: AsyncCallsQueue, tmp_path: Path
) -> None:
    """quicksave's default planner records int keys and empty dicts for load_state
    (FORMAT.md §2.1) in the manifest only: ``.metadata``'s pickle stays DCP's own
    (no quicksave class, no non-fqn keys), so stock DCP still loads it."""
    sd = {"optim": {"state": {0: {"m": torch.arange(3.0)}}, "empty": {}}, "step": 4}
    path = tmp_path / "ckpt"
    _schedule_save(queue, sd, path)
    queue.maybe_finalize_async_calls(blocking=True)
    got = quicksave.load_state(path)
    assert list(got["optim"]["state"]) == [0] and got["optim"]["empty"] == {}
    assert torch.equal(got["optim"]["state"][0]["m"], torch.arange(3.0))
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)  # stops at the pickle's end (FORMAT.md §8)
    assert md.planner_data == {"optim.state.0.m": ("optim", "state", "0", "m"), "step": ("step",)}
    assert all(type(e) in (str, int) for p in md.planner_data.values() for e in p)
    stock = {"optim": {"state": {0: {"m": torch.zeros(3)}}}, "step": 0}
    dcp.load(stock, checkpoint_id=str(path), no_dist=True)
    assert torch.equal(stock["optim"]["state"][0]["m"], torch.arange(3.0)) and stock["step"] == 4


def test_metadata_cache_sees_key_types_and_empty_dicts(
    queue: AsyncCallsQueue, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cached plan is reused only when the structure the manifest records (key
    types, empty dicts) is unchanged too, and a plan loaded from a checkpoint carries
    its empty dicts (FORMAT.md §2.1)."""
    monkeypatch.setattr(saver.PROCESS, "metadata_cache", None)
    first = {"state": {0: {"m": torch.ones(2)}}, "loop": {}}
    _schedule_save(queue, first, tmp_path / "a", enable_cache=True)
    queue.maybe_finalize_async_calls(blocking=True)
    # Same items, other structure: int key 0 -> "0", loop gains an empty dict.
    second = {"state": {"0": {"m": torch.ones(2)}}, "loop": {"x": {}}}
    _schedule_save(queue, second, tmp_path / "b", enable_cache=True)
    queue.maybe_finalize_async_calls(blocking=True)
    got = quicksave.load_state(tmp_path / "b")
    assert list(got["state"]) == ["0"] and got["loop"] == {"x": {}}
    # "Restart" from the first checkpoint: its plans carry its empty dicts.
    monkeypatch.setattr(saver.PROCESS, "metadata_cache", None)
    init_checkpoint_metadata_cache(quicksave.StorageReader(tmp_path / "a").read_metadata())
    monkeypatch.setattr(saver, "_plan_centrally", lambda *a: pytest.fail("planned again"))
    _schedule_save(queue, first, tmp_path / "c", enable_cache=True)
    queue.maybe_finalize_async_calls(blocking=True)
    got = quicksave.load_state(tmp_path / "c")
    assert list(got["state"]) == [0] and got["loop"] == {}
