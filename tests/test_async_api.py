"""The seeds' async API: AsyncRequest, AsyncCallsQueue, TorchAsyncCheckpoint, async_save.

Calls run in real worker processes (and threads for ``persistent=False``). Functions whose
name starts with ``_w_`` run in the worker (they are pickled by reference: module level);
those starting with ``_rank_`` run in the ranks of a 2-process gloo group.

No test depends on timing: a "slow" call waits for a gate file that the test creates when
it wants the call to finish (with a long deadline, so nothing can hang for ever).
"""

from __future__ import annotations

import copy
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import quicksave
from quicksave.compat.nvrx import AsyncCallsQueue, AsyncRequest, TorchAsyncCheckpoint
from quicksave.errors import CheckpointError, IncompatibleStateError, WorkerFailedError
from quicksave.saving.async_save import async_save
from quicksave.saving.config import EngineConfig
from quicksave.saving.engine import AsyncSaver
from quicksave.worker.config import WorkerConfig

GATE_DEADLINE_S = 120.0


# ------------------------------------------------------------------ run in the worker
def _w_gated(gate: str, out: str, value: Any) -> None:
    """Wait for ``gate`` to exist, then append ``value`` to ``out``."""
    deadline = time.monotonic() + GATE_DEADLINE_S
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.01)
    with open(out, "a") as f:
        f.write(f"{value}\n")


def _w_boom(message: str) -> None:
    raise ValueError(message)


def _w_report_tensor(gate: str, t: torch.Tensor, out: str) -> None:
    _w_gated(gate, out + ".ignored", 0)
    with open(out, "w") as f:
        f.write(f"{t.is_shared()} {t.sum().item()}")


def _w_save(rank: int, state: dict[str, torch.Tensor], path: str) -> None:
    torch.save({"rank": rank, **state}, path)


def _w_clone_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


# --------------------------------------------------------------------------- helpers
def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + GATE_DEADLINE_S
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def _lines(path: Path) -> list[str]:
    return path.read_text().split()


def _assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.fixture(scope="module")
def queue() -> Iterator[AsyncCallsQueue]:
    """One worker process shared by the tests that leave it healthy (spawning costs ~3 s)."""
    q = AsyncCallsQueue()
    yield q
    q.close()


# ----------------------------------------------------------------- AsyncRequest
def test_request_freeze_and_add_finalize_fn() -> None:
    fns: list[Any] = []
    req = AsyncRequest(None, (), fns)
    req.add_finalize_fn(print)
    frozen = req.freeze()
    assert frozen.is_frozen and not req.is_frozen and frozen.finalize_fns == [print]
    assert frozen.async_fn_kwargs is None and frozen.preload_fn is None  # NVRx defaults
    with pytest.raises(CheckpointError, match="cannot add a finalize function to a frozen"):
        frozen.add_finalize_fn(print)
    frozen.finalize_fns.append(len)
    assert req.finalize_fns == [print]  # the frozen copy has its own list


def test_malformed_requests_are_refused(queue: AsyncCallsQueue) -> None:
    with pytest.raises(CheckpointError, match="preload_fn's result replaces async_fn_args"):
        queue.schedule_async_request(AsyncRequest(print, ("x",), [], preload_fn=dict))
    with pytest.raises(CheckpointError, match="async_fn must be callable or None"):
        queue.schedule_async_request(AsyncRequest("nope", (), []))  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="cannot be sent to the worker process"):
        queue.schedule_async_request(AsyncRequest(print, (threading.Lock(),), []))
    assert queue.get_num_unfinalized_calls() == 0


# -------------------------------------------------------------- AsyncCallsQueue
def test_ids_blocking_and_fifo_finalize(queue: AsyncCallsQueue, tmp_path: Path) -> None:
    gate, out = tmp_path / "gate", tmp_path / "out"
    finalized: list[int] = []
    ids = [
        queue.schedule_async_request(
            AsyncRequest(
                _w_gated, (str(gate), str(out), i), [functools.partial(finalized.append, i)]
            )
        )
        for i in range(3)
    ]
    assert ids == [ids[0], ids[0] + 1, ids[0] + 2]
    # Not done (the gate is closed): a non-blocking call finalizes nothing and returns.
    assert queue.maybe_finalize_async_calls(blocking=False) == []
    assert queue.get_num_unfinalized_calls() == 3 and finalized == []
    gate.touch()
    assert queue.maybe_finalize_async_calls(blocking=True) == ids
    assert finalized == [0, 1, 2] and _lines(out) == ["0", "1", "2"]
    assert queue.get_num_unfinalized_calls() == 0
    assert queue.maybe_finalize_async_calls(blocking=True) == []


def test_non_blocking_finalizes_a_call_once_it_is_done(
    queue: AsyncCallsQueue, tmp_path: Path
) -> None:
    gate, out = tmp_path / "gate", tmp_path / "out"
    gate.touch()
    ran: list[str] = []
    call = queue.schedule_async_request(
        AsyncRequest(_w_gated, (str(gate), str(out), "v"), [lambda: ran.append("a")])
    )
    _wait_for(out)
    got: list[int] = []
    deadline = time.monotonic() + GATE_DEADLINE_S
    while not got and time.monotonic() < deadline:  # the result may still be on its way
        got = queue.maybe_finalize_async_calls(blocking=False)
    assert got == [call] and ran == ["a"]


def test_thread_mode_finalizes_in_order_when_a_later_call_finishes_first(tmp_path: Path) -> None:
    q = AsyncCallsQueue(persistent=False)
    gate, slow, fast = tmp_path / "gate", tmp_path / "slow", tmp_path / "fast"
    (tmp_path / "open").touch()
    order: list[str] = []
    first = q.schedule_async_request(
        AsyncRequest(_w_gated, (str(gate), str(slow), 1), [lambda: order.append("first")])
    )
    second = q.schedule_async_request(
        AsyncRequest(
            _w_gated, (str(tmp_path / "open"), str(fast), 2), [lambda: order.append("second")]
        )
    )
    _wait_for(fast)  # the second call is done, the first is not
    assert q.maybe_finalize_async_calls(blocking=False) == []
    assert order == []
    gate.touch()
    assert q.maybe_finalize_async_calls(blocking=True) == [first, second]
    assert order == ["first", "second"]
    q.close()


def test_failing_async_fn_raises_checkpoint_error_once(
    queue: AsyncCallsQueue, tmp_path: Path
) -> None:
    ran: list[int] = []
    bad = queue.schedule_async_request(
        AsyncRequest(_w_boom, ("disk on fire",), [lambda: ran.append(1)])
    )
    (tmp_path / "gate").touch()
    good = queue.schedule_async_request(
        AsyncRequest(_w_gated, (str(tmp_path / "gate"), str(tmp_path / "out"), 1), [])
    )
    with pytest.raises(CheckpointError) as info:
        queue.maybe_finalize_async_calls(blocking=True)
    assert info.value.message == (
        f"async call {bad} (_w_boom): its async_fn failed: ValueError: disk on fire"
    )
    assert ran == []  # a failed call is never finalized
    assert queue.maybe_finalize_async_calls(blocking=True) == [good]  # the queue goes on


def test_cpu_tensor_args_travel_through_shared_memory(
    queue: AsyncCallsQueue, tmp_path: Path
) -> None:
    gate, out = tmp_path / "gate", tmp_path / "out"
    t = torch.zeros(1000)
    queue.schedule_async_request(AsyncRequest(_w_report_tensor, (str(gate), t, str(out)), []))
    # Pickling moved the storage to shared memory; the worker maps the same pages, so it
    # sees a write made after the request was sent (a copy through the pipe would not).
    assert t.is_shared()
    t.fill_(2.0)
    gate.touch()
    queue.maybe_finalize_async_calls(blocking=True)
    assert out.read_text() == "True 2000.0"


@pytest.mark.parametrize("persistent", [True, False])
def test_preload_fn_replaces_the_state_before_schedule_returns(
    persistent: bool, queue: AsyncCallsQueue, tmp_path: Path
) -> None:
    q = queue if persistent else AsyncCallsQueue(persistent=False)
    state = {"w": torch.ones(16)}
    path = tmp_path / "state.pt"
    q.schedule_async_request(
        AsyncRequest(
            _w_save, (3, None, str(path)), [], preload_fn=functools.partial(_w_clone_state, state)
        )
    )
    state["w"].fill_(5.0)  # preloading is done: the saved values are unaffected
    q.maybe_finalize_async_calls(blocking=True)
    saved = torch.load(path)
    assert saved["rank"] == 3 and torch.equal(saved["w"], torch.ones(16))
    if not persistent:
        q.close()


def test_failing_preload_fn_fails_its_call(queue: AsyncCallsQueue, tmp_path: Path) -> None:
    bad = queue.schedule_async_request(
        AsyncRequest(
            _w_save,
            (0, None, str(tmp_path / "x.pt")),
            [],
            preload_fn=functools.partial(_w_boom, "no device"),
        )
    )
    with pytest.raises(CheckpointError, match=rf"async call {bad} \(_w_save\): its preload_fn "):
        queue.maybe_finalize_async_calls(blocking=True)
    assert not (tmp_path / "x.pt").exists()


def test_killed_worker_fails_calls_and_the_next_request_starts_a_new_one(tmp_path: Path) -> None:
    q = AsyncCallsQueue(worker=WorkerConfig(worker_timeout_s=10.0))
    gate, out = tmp_path / "gate", tmp_path / "out"
    call = q.schedule_async_request(AsyncRequest(_w_gated, (str(gate), str(out), 1), []))
    pid = q.worker_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerFailedError, match=rf"async call {call}: checkpoint worker .* died"):
        q.maybe_finalize_async_calls(blocking=True)
    gate.touch()
    again = q.schedule_async_request(AsyncRequest(_w_gated, (str(gate), str(out), 2), []))
    assert q.worker_pid not in (None, pid)
    assert q.maybe_finalize_async_calls(blocking=True) == [again]
    assert _lines(out) == ["2"]
    q.close()


def test_close_abort_does_not_wait_for_calls_in_flight(tmp_path: Path) -> None:
    q = AsyncCallsQueue()
    ran: list[int] = []
    q.schedule_async_request(
        AsyncRequest(
            _w_gated, (str(tmp_path / "never"), str(tmp_path / "o"), 1), [lambda: ran.append(1)]
        )
    )
    pid = q.worker_pid
    assert pid is not None
    q.close(abort=True)  # the gate never opens: only an abort can return
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the worker is gone (killed and reaped)
    assert ran == [] and q.get_num_unfinalized_calls() == 0
    assert q._get_async_caller() is None  # no worker until the next request (NVRx)
    # The queue is usable again: the next request starts a new worker.
    assert q.schedule_async_request(AsyncRequest(os.getpid, (), [lambda: ran.append(2)])) == 0
    assert q.worker_pid not in (None, pid)
    assert q.maybe_finalize_async_calls(blocking=True) == [0] and ran == [2]
    q.close()


def test_no_op_request_is_finalized_without_a_worker() -> None:
    q = AsyncCallsQueue(persistent=False)
    ran: list[int] = []
    assert q.schedule_async_request(AsyncRequest(None, (), [lambda: ran.append(1)])) == 0
    assert q.maybe_finalize_async_calls() == [0] and ran == [1]
    q.close()


# ------------------------------------------------------------- TorchAsyncCheckpoint
def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "w": torch.randn(64, 32),
        "b": torch.arange(10, dtype=torch.int32),
        "nested": {"lst": [torch.randn(3), 7], "tup": (torch.ones(2, dtype=torch.bfloat16), "x")},
        "step": 3,
    }


def _mutate(state: dict[str, Any]) -> None:
    state["w"].add_(1)
    state["b"].mul_(3)
    state["nested"]["lst"][0].zero_()
    state["nested"]["lst"].append(8)
    state["nested"]["tup"][0].fill_(9)


@pytest.mark.parametrize("persistent", [True, False])
def test_torch_async_checkpoint_round_trip(persistent: bool, tmp_path: Path) -> None:
    ckpt = TorchAsyncCheckpoint(persistent_queue=persistent)
    state = _state()
    expected = copy.deepcopy(state)
    path = tmp_path / "model.pt"
    first = ckpt.async_save(state, path)
    _mutate(state)  # right after async_save returns: the file still holds the old values
    after = copy.deepcopy(state)
    assert ckpt.finalize_async_save(blocking=True) == [first]
    _assert_same(torch.load(path), expected)
    # Again, over the same file (atomic replace), reusing the staging buffers.
    second = ckpt.async_save(state, str(path), pickle_protocol=2)
    state["w"].zero_()
    assert ckpt.finalize_async_save(blocking=True, terminate=True) == [second]
    _assert_same(torch.load(path), after)
    assert os.listdir(tmp_path) == ["model.pt"]  # no temporary file left behind
    # Closed (terminate=True), not dead: the next save starts a new worker (NVRx).
    third = ckpt.async_save(state, path)
    assert ckpt.finalize_async_save(blocking=True, terminate=True) == [third]
    _assert_same(torch.load(path), state)


def _pool_mappings() -> int:
    """Staging pools mapped in this process (memfds named after quicksave's pools)."""
    with open("/proc/self/maps") as f:
        return len({line.split()[4] for line in f if "quicksave-pool" in line})  # inodes


def test_torch_async_checkpoint_stages_in_one_reused_pool_and_keeps_what_torch_saves(
    tmp_path: Path,
) -> None:
    # The worker process gets one pool; what it saves keeps parameters, shared tensors
    # (saved once) and any layout; saving again and again leaks no descriptor.
    weight = torch.nn.Parameter(torch.randn(6, 4))
    frozen = torch.nn.Parameter(torch.randn(3), requires_grad=False)
    state = {
        "w": weight,
        "tied": {"again": weight},  # the same tensor twice
        "frozen": frozen,
        "t": torch.arange(24, dtype=torch.float64).reshape(4, 6).t(),  # not contiguous
        "empty": torch.zeros(0, 5),
        "steps": [torch.tensor(3), 7],
    }
    fds: list[int] = []
    pools: list[int] = []
    before = _pool_mappings()  # other tests' pools (e.g. the NVRx writer's spare)
    with TorchAsyncCheckpoint() as ckpt:
        for i in range(6):
            with torch.no_grad():
                weight.add_(1)
            expected = copy.deepcopy(state)
            ckpt.async_save(state, tmp_path / "m.pt")
            ckpt.finalize_async_save(blocking=True)
            fds.append(len(os.listdir("/proc/self/fd")))
            loaded = torch.load(tmp_path / "m.pt")
            assert isinstance(loaded["w"], torch.nn.Parameter) and loaded["w"].requires_grad
            assert isinstance(loaded["frozen"], torch.nn.Parameter)
            assert not loaded["frozen"].requires_grad
            assert loaded["tied"]["again"] is loaded["w"], i  # one tensor, saved once
            assert loaded["t"].shape == (6, 4) and loaded["empty"].shape == (0, 5)
            assert loaded["steps"][1] == 7 and torch.equal(loaded["steps"][0], torch.tensor(3))
            for key in ("w", "frozen", "t", "empty"):
                assert torch.equal(loaded[key], expected[key]), (i, key)
            pools.append(_pool_mappings())
    # No descriptor per save stays behind (a leak adds 4 over the last saves; the
    # resource sharer may still hold one briefly).
    assert fds[-1] <= fds[1] + 1, fds
    assert pools[0] == pools[-1] == before + 1, pools  # one pool, reused (mapped once)
    assert _pool_mappings() == before  # close() finalized and freed it


def test_torch_async_checkpoint_module_state_dict_loads_back(tmp_path: Path) -> None:
    with TorchAsyncCheckpoint(persistent_queue=False) as ckpt:
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        ckpt.async_save(model.state_dict(), f=tmp_path / "m.pt")
        ckpt.finalize_async_save(blocking=True)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    loaded = torch.load(tmp_path / "m.pt")
    assert hasattr(loaded, "_metadata")  # kept: load_state_dict uses it for versioning
    fresh.load_state_dict(loaded)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_torch_async_checkpoint_errors(tmp_path: Path) -> None:
    ckpt = TorchAsyncCheckpoint(persistent_queue=False)
    missing = tmp_path / "nope" / "m.pt"
    with pytest.raises(CheckpointError, match="the directory to save into does not exist") as e:
        ckpt.async_save({}, missing)
    assert e.value.path == str(missing)
    with pytest.raises(CheckpointError, match="writes to a path .* not a BytesIO"):
        import io

        ckpt.async_save({}, io.BytesIO())
    with pytest.raises(IncompatibleStateError, match="cannot stage a Tensor") as e2:
        ckpt.async_save({"a": {"s": torch.eye(2).to_sparse()}}, tmp_path / "s.pt")
    assert e2.value.fqn == "a.s"
    # A failure in the background names the call, the path and the cause.
    target = tmp_path / "bad.pt"
    ckpt.async_save({"f": lambda: 1}, target)
    with pytest.raises(CheckpointError, match=r"_save_atomically\): its async_fn failed: ") as e3:
        ckpt.finalize_async_save(blocking=True)
    assert e3.value.path == str(target)
    assert os.listdir(tmp_path) == []  # neither the file nor its temporary
    ckpt.close()


# ----------------------------------------------------------------------- async_save
def test_async_save_one_shot_round_trip(tmp_path: Path) -> None:
    state = {"w": torch.randn(128, 16), "b": torch.arange(5), "epoch": 2}
    expected = copy.deepcopy(state)
    handle = async_save(state, tmp_path / "step-5", step=5)
    assert handle is not None
    state["w"].add_(1)  # staged already
    result = handle.wait(timeout=GATE_DEADLINE_S)
    assert handle.done() and result.step == 5 and result.bytes > 0
    target = {"w": torch.zeros(128, 16), "b": torch.zeros(5, dtype=torch.int64), "epoch": 0}
    quicksave.load(target, tmp_path / "step-5")
    _assert_same(target, expected)
    saver = handle._saver  # the one-shot saver closes itself once the save is done
    deadline = time.monotonic() + GATE_DEADLINE_S
    while saver is not None and not saver._closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert saver is not None and saver._closed


def test_async_save_with_a_held_saver(tmp_path: Path) -> None:
    saver = AsyncSaver(EngineConfig(mode="thread"))
    state = {"w": torch.ones(8)}
    handles = []
    for step in (1, 2):
        handles.append(async_save(state, tmp_path / f"step-{step}", step=step, saver=saver))
        state["w"].add_(1)
    for step, h in zip((1, 2), handles, strict=True):
        assert h is not None and h.wait(timeout=GATE_DEADLINE_S).step == step
        target = {"w": torch.zeros(8)}
        quicksave.load(target, tmp_path / f"step-{step}")
        assert torch.equal(target["w"], torch.full((8,), float(step)))
    taken = async_save(state, tmp_path / "step-1", saver=saver)  # its writer checks
    with pytest.raises(CheckpointError, match="a committed checkpoint already exists"):
        assert taken is not None
        taken.wait(timeout=GATE_DEADLINE_S)
    saver.close()


# --------------------------------------------------------------------- two ranks
def _launcher() -> Any:
    sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
    import launcher

    return launcher


def _rank_usage_guide(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """The usage guide's shape: plan-less request with a preload_fn and a finalize_fn."""
    import torch.distributed as dist

    state = {"w": torch.full((8,), float(rank))}
    path = os.path.join(root, f"rank-{rank}.pt")
    finalized: list[int] = []

    def finalize_fn() -> None:
        finalized.append(rank)
        dist.barrier()

    async_queue = AsyncCallsQueue()
    save_fn, save_args = _w_save, (rank, None, path)
    preload_fn = functools.partial(_w_clone_state, state)
    async_request = AsyncRequest(save_fn, save_args, [finalize_fn], preload_fn=preload_fn)
    async_queue.schedule_async_request(async_request)
    state["w"].fill_(-1.0)
    ids = async_queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    async_queue.close()
    saved = torch.load(path)
    return {"ids": ids, "finalized": finalized, "rank": saved["rank"], "w": saved["w"].tolist()}


def _rank_agree(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    q = AsyncCallsQueue()
    out = os.path.join(root, f"out-{rank}")
    gate = os.path.join(root, "gate") if rank == 1 else os.path.join(root, "open")
    if rank == 0:
        Path(gate).touch()
    dist.barrier()
    q.schedule_async_request(AsyncRequest(_w_gated, (gate, out, rank), []))
    if rank == 0:
        _wait_for(Path(out))  # done here; rank 1's call waits for its gate
    dist.barrier()
    before = q.maybe_finalize_async_calls(blocking=False, no_dist=False)
    dist.barrier()
    if rank == 1:
        Path(gate).touch()
    after = q.maybe_finalize_async_calls(blocking=True, no_dist=False)
    # Rank 1's call fails: both ranks raise, neither runs the finalize function.
    ran: list[int] = []
    fn = (_w_boom, ("rank one broke",)) if rank == 1 else (_w_gated, (gate, out, "ok"))
    q.schedule_async_request(AsyncRequest(fn[0], fn[1], [lambda: ran.append(1)]))
    from torch.distributed.checkpoint import CheckpointException

    error, torch_type, failed = "", False, []
    try:
        q.maybe_finalize_async_calls(blocking=True, no_dist=False)
    except CheckpointError as e:
        error = e.message
        torch_type = isinstance(e, CheckpointException)
        failed = sorted(e.failures)
    q.close()
    return {
        "before": before,
        "after": after,
        "ran": ran,
        "error": error,
        "torch_type": torch_type,
        "failed": failed,
    }


@pytest.mark.slow
def test_two_ranks_usage_guide_shape(tmp_path: Path) -> None:
    launcher = _launcher()
    config = launcher.LaunchConfig(timeout_s=240.0)
    results = launcher.run_ranks(_rank_usage_guide, 2, str(tmp_path), config=config)
    for rank, r in enumerate(results):
        assert r == {"ids": [0], "finalized": [rank], "rank": rank, "w": [float(rank)] * 8}


@pytest.mark.slow
def test_two_ranks_agree_before_finalizing(tmp_path: Path) -> None:
    launcher = _launcher()
    config = launcher.LaunchConfig(timeout_s=240.0)
    results = launcher.run_ranks(_rank_agree, 2, str(tmp_path), config=config)
    assert [r["before"] for r in results] == [[], []]  # rank 0 done, rank 1 not: nobody
    assert [r["after"] for r in results] == [[0], [0]]
    assert [r["ran"] for r in results] == [[], []]
    # Every rank names the failed rank and its cause, as torch's CheckpointException.
    expected = (
        "async call 1 (_w_gated) failed on 1 rank(s), so it was not finalized on any rank: "
        "rank 1: async call 1 (_w_boom): its async_fn failed: ValueError: rank one broke"
    )
    assert results[0]["error"] == expected
    assert results[1]["error"] == expected.replace("(_w_gated)", "(_w_boom)")
    assert [(r["torch_type"], r["failed"]) for r in results] == [(True, [1]), (True, [1])]
