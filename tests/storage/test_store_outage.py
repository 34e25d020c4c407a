"""Storage outages (issue 20, point 6): the S3 server stops and comes back.

* Retries honour ``retry_deadline_s`` for connection errors, however many tries it
  takes (the loop used to give up after 6 tries in ~2 s): through a fault proxy that
  resets the next N connections, and against a server killed and restarted while a
  request retries.
* A 2-rank ``CheckpointManager`` saving every 2 steps to ``s3://`` while the server is
  killed after step 6 and restarted after step 12: with ``on_save_error="log"`` training
  never raises (not at step 7 either, where retention's LIST after step 6's commit meets
  the outage), the saves of the outage fail on both ranks alike, the later ones commit,
  nothing half-written is visible, and a restarted job resumes from the newest commit;
  with ``"raise"`` both ranks raise the same CheckpointError at the same save.

The server is private to this module (it is killed): ``SeaweedServer.kill`` /
``restart`` keep its data and ports. The ranks and the test process meet through
marker files: rank 0 asks for the kill and the restart, every rank waits for the news.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.s3_server import seaweed_server
from quicksave.errors import CheckpointError
from quicksave.storage.backend import S3Options
from quicksave.storage.s3 import S3Backend
from quicksave_tools.testing.faultproxy import FaultProxy
from quicksave_tools.testing.seaweed import SeaweedServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multirank"))
from launcher import LaunchConfig, run_ranks  # noqa: E402

pytestmark = pytest.mark.slow

LAUNCH = LaunchConfig(
    timeout_s=300.0, grace_s=30.0, collective_timeout_s=120.0, preload=("torch._dynamo",)
)
STEPS = 20
DOWN_AFTER, UP_AFTER = 6, 12  # the server is down for the saves of steps 8, 10, 12
DEADLINE_S = 2.0  # the ranks' retry_deadline_s: a save during the outage fails, fast
MARK_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def server() -> Iterator[SeaweedServer]:
    with seaweed_server() as s:
        yield s


@pytest.fixture
def bucket(server: SeaweedServer) -> str:
    if not server.running:
        server.restart()
    return server.create_bucket(f"outage-{os.urandom(6).hex()}")


def _options(server: SeaweedServer, **kw: Any) -> S3Options:
    return S3Options(
        endpoint_url=kw.pop("endpoint_url", server.endpoint_url),
        region=server.region,
        access_key_id=server.access_key_id,
        secret_access_key=server.secret_access_key,
        **kw,
    )


# --------------------------------------------------------------------------- retries


def test_the_deadline_rides_out_more_refused_connections_than_the_old_cap(server, bucket):
    short_pauses = {"sleep": lambda s: time.sleep(min(s, 0.02))}  # the clock stays real
    with FaultProxy("127.0.0.1", server.ports["s3"]) as proxy:
        url = proxy.endpoint_url
        with S3Backend(bucket, _options(server, endpoint_url=url), **short_pauses) as b:
            proxy.fail_next(12, "drop")  # the old loop gave up at 6 tries
            b.put("through-an-outage", memoryview(b"made it"))
            assert proxy.stats["dropped"] == 12
            assert b.get("through-an-outage", 100) == b"made it"
        capped = _options(server, endpoint_url=url, max_attempts=6)
        with S3Backend(bucket, capped, **short_pauses) as b:
            proxy.fail_next(12, "drop")
            with pytest.raises(CheckpointError, match=r"failed after 6 attempt\(s\)"):
                b.put("capped", memoryview(b"x"))
            proxy.fail_next(0, "drop")


def test_a_request_retrying_while_the_server_restarts_succeeds(server, bucket):
    with S3Backend(bucket, _options(server, retry_deadline_s=120.0)) as b:
        b.put("k", memoryview(b"before the outage"))
        server.kill()
        try:
            with pytest.raises(CheckpointError, match="cannot reach endpoint"):
                with S3Backend(bucket, _options(server, retry_deadline_s=0.5)) as quick:
                    quick.stat("k")  # the server is down indeed
            restarter = threading.Timer(1.0, server.restart)
            restarter.start()
            # refused until the server is back (seconds), far inside the deadline
            assert b.get("k", 100) == b"before the outage"
            restarter.join()
        finally:
            if not server.running:
                server.restart()


# --------------------------------------------------------------------------- campaign


def _mark(ctl: str, name: str) -> None:
    with open(os.path.join(ctl, name), "w"):
        pass


def _await(ctl: str, name: str) -> None:
    deadline = time.monotonic() + MARK_TIMEOUT_S
    while not os.path.exists(os.path.join(ctl, name)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {name!r} from the test process")
        time.sleep(0.05)


class _Operator:
    """The test process's side: kills and restarts the server when rank 0 asks (or,
    with ``outage_s``, restarts it by itself that long after the kill)."""

    def __init__(self, server: SeaweedServer, ctl: str, outage_s: float | None = None) -> None:
        self.server, self.ctl, self.outage_s = server, ctl, outage_s
        self.done = threading.Event()
        self.times: dict[str, float] = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for ask, act, news in (("kill", self.server.kill, "down"), ("restart", None, "up")):
                if ask == "restart" and self.outage_s is not None:
                    if self.done.wait(self.outage_s):
                        return
                while ask != "restart" or self.outage_s is None:
                    if os.path.exists(os.path.join(self.ctl, ask)):
                        break
                    if self.done.wait(0.05):
                        return
                (act or self.server.restart)()
                self.times[news] = time.monotonic()
                _mark(self.ctl, news)
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self.error = e

    def stop(self) -> None:
        self.done.set()
        self.thread.join(30)
        if not self.server.running:
            self.server.restart()
        if self.error is not None:
            raise self.error


class _Job:
    def __init__(self) -> None:
        from quicksave.manager import TrainState

        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.train_state = TrainState()
        self.x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))

    def states(self) -> dict[str, Any]:
        from quicksave.manager import ModelState, OptimizerState

        return {
            "model": ModelState(self.model),
            "optim": OptimizerState(self.model, self.optim),
            "train_state": self.train_state,
        }

    def step(self) -> None:
        self.optim.zero_grad()
        self.model(self.x).square().mean().backward()
        self.optim.step()
        self.train_state.step += 1

    def digest(self) -> str:
        h = hashlib.sha256()
        for v in self.model.state_dict().values():
            h.update(v.numpy().tobytes())
        return h.hexdigest()


def _config(folder: str, policy: str) -> Any:
    from quicksave.manager import CheckpointConfig
    from quicksave.storage import StorageOptions

    if policy == "defaults":  # retry_deadline_s=60, on_save_error="raise"
        return CheckpointConfig(folder=folder, interval=2, keep_latest_k=2)
    s3 = S3Options(retry_deadline_s=DEADLINE_S, connect_timeout_s=1.0, read_timeout_s=10.0)
    return CheckpointConfig(
        folder=folder,
        interval=2,
        keep_latest_k=2,
        on_save_error=policy,
        max_consecutive_failures=4,
        commit_timeout_s=60.0,
        storage=StorageOptions(s3=s3),
    )


def _rank_outage(
    rank: int, world: int, folder: str, env: dict[str, str], ctl: str, policy: str
) -> dict[str, Any]:
    os.environ.update(env)
    import logging

    from quicksave.manager import CheckpointManager

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("quicksave").addHandler(handler)
    job = _Job()
    manager = CheckpointManager(_config(folder, policy), job.states())
    raised: list[tuple[int, str]] = []
    longest = 0.0
    for step in range(1, STEPS + 1):
        job.step()
        began = time.monotonic()
        try:
            manager.save(step)
        except CheckpointError as e:
            raised.append((step, f"{type(e).__name__}: {e}"))
            if policy == "raise":
                break
        finally:
            longest = max(longest, time.monotonic() - began)
        if step == DOWN_AFTER:
            # Step 6 becomes durable but its commit is not seen yet: step 7, with
            # nothing due, collects it and runs retention while the server is down.
            assert manager.session.writer is not None and manager.session.writer.drain(120)
            if rank == 0:
                _mark(ctl, "kill")
            _await(ctl, "down")
        if step == UP_AFTER and policy != "defaults":
            try:  # settles the outage's saves on every rank ("log": no raise)
                manager.wait()
            except CheckpointError as e:
                raised.append((step, f"{type(e).__name__}: {e}"))
            break
    during = {"failed_saves": manager.failed_saves, "steps": job.train_state.step}
    if rank == 0:
        _mark(ctl, "restart")
    _await(ctl, "up")
    for step in range(job.train_state.step + 1, STEPS + 1):
        job.step()
        manager.save(step)  # after the outage every save commits ("log" and "raise")
    manager.close()
    _after_every_close()
    return {
        "raised": raised,
        "during": during,
        "failed_saves": manager.failed_saves,
        "consecutive": manager.consecutive_failures,
        "statuses": {r.step: r.status for r in manager.metrics},
        "committed": manager.committed_steps(),
        "digest": job.digest(),
        "longest_save_s": longest,
        "retention_failed": any("retention or clean-up in" in w for w in warnings),
    }


def _after_every_close() -> None:
    """A barrier: the lease holder's close (its last retention included) is done before
    any rank lists the folder."""
    import torch.distributed as dist

    dist.barrier()


def _rank_resume(rank: int, world: int, folder: str, env: dict[str, str]) -> dict[str, Any]:
    os.environ.update(env)
    from quicksave.manager import CheckpointManager

    job = _Job()
    with CheckpointManager(_config(folder, "raise"), job.states()) as manager:
        step = manager.load()
    return {"step": step, "digest": job.digest(), "train_step": job.train_state.step}


def _objects(server: SeaweedServer, bucket: str, prefix: str) -> list[str]:
    client = server.client()
    try:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [o["Key"][len(prefix) :] for page in pages for o in page.get("Contents", [])]
    finally:
        client.close()


def _run(
    server: SeaweedServer, bucket: str, tmp_path: Path, policy: str, outage_s: float | None = None
) -> list[dict]:
    ctl = tmp_path / f"ctl-{policy}"
    ctl.mkdir()
    operator = _Operator(server, str(ctl), outage_s)
    try:
        results = run_ranks(
            _rank_outage,
            2,
            f"s3://{bucket}/run",
            server.env(),
            str(ctl),
            policy,
            config=LAUNCH,
        )
    finally:
        operator.stop()
    down = operator.times["up"] - operator.times["down"]
    longest = max(r["longest_save_s"] for r in results)
    print(f"outage campaign ({policy}): server down {down:.1f} s; longest save() {longest:.1f} s")
    return results


def test_log_policy_two_ranks_ride_out_a_stopped_server(server, bucket, tmp_path):
    results = _run(server, bucket, tmp_path, "log")
    for rank, r in enumerate(results):
        assert r["raised"] == [], (rank, r["raised"])  # training never raised
        # the save of step 8 failed in the background; those due while it still
        # retried were skipped, never waited for, and one due after its failure was
        # settled was made and failed too (how many: the loop's pace against the
        # 2 s deadline) -- counted alike on both ranks
        failed = r["during"]["failed_saves"]
        assert r["during"] == {"failed_saves": failed, "steps": UP_AFTER}, (rank, r)
        assert failed == results[0]["during"]["failed_saves"] and 1 <= failed <= 3, r
        assert (r["failed_saves"], r["consecutive"]) == (failed, 0), (rank, r)
        # kept: the newest two commits (a save due while the one before it met the
        # restarting server is skipped too)
        assert len(r["committed"]) == 2 and r["committed"][-1] == STEPS, (rank, r)
        assert r["committed"] == results[0]["committed"], (rank, r)
        outage = {s: v for s, v in r["statuses"].items() if DOWN_AFTER < s <= UP_AFTER}
        assert outage[8] == "failed" and set(outage.values()) == {"failed"}, (rank, outage)
        assert len(outage) == failed, (rank, outage)
        after = {s: v for s, v in r["statuses"].items() if s > UP_AFTER}
        assert set(after.values()) == {"committed"} and {18, 20} <= set(after), (rank, r)
    assert results[0]["digest"] == results[1]["digest"]
    # step 7 (nothing due) met the outage in retention's listing: logged, not raised
    assert results[0]["retention_failed"] and not results[1]["retention_failed"]
    # nothing half-written: every step prefix left is a committed checkpoint
    names = _objects(server, bucket, "run/")
    steps = {n.split("/", 1)[0] for n in names if n.startswith("step-")}
    assert steps == {f"step-{s}" for s in results[0]["committed"]}, sorted(names)
    for step in steps:
        assert f"{step}/manifest.json" in names
    resumed = run_ranks(_rank_resume, 2, f"s3://{bucket}/run", server.env(), config=LAUNCH)
    for r in resumed:
        assert (r["step"], r["train_step"]) == (20, 20)
        assert r["digest"] == results[0]["digest"]


def test_raise_policy_both_ranks_raise_the_same_error_at_the_same_save(server, bucket, tmp_path):
    results = _run(server, bucket, tmp_path, "raise")
    (first,), (second,) = results[0]["raised"], results[1]["raised"]
    assert first == second, results  # the same step, type and message on both ranks
    step, text = first
    # step 8 fails in the background: raised at the first settling call after its
    # failure arrived (a due save, or the wait() at step 12; saves due while it still
    # retried were skipped, never waited for): which one, the loop's pace decides
    assert step in (DOWN_AFTER + 4, UP_AFTER), first
    assert text.startswith("CheckpointError: ") and f"s3://{bucket}/run/step-8" in text
    assert "cannot reach endpoint" in text and "retry_deadline_s=2" in text
    assert "Connection closed by peer" not in text
    for r in results:  # the job carried on after the error: later saves committed
        assert len(r["committed"]) == 2 and r["committed"][-1] == STEPS, r
    assert results[0]["retention_failed"]  # at step 7, which raised nothing


def test_with_the_defaults_a_short_outage_is_ridden_out_without_a_failure(server, bucket, tmp_path):
    # The outage (~15 s with the restart) against the default retry_deadline_s
    # of 60 s: the save made while the server is down (step 8) rides it out in the
    # background and commits; those due while it still retries were skipped, never
    # waited for (the training thread does not wait on the store).
    results = _run(server, bucket, tmp_path, "defaults", outage_s=12.0)
    for rank, r in enumerate(results):
        assert r["raised"] == [] and r["failed_saves"] == 0, (rank, r)
        assert set(r["statuses"].values()) == {"committed"}, (rank, r["statuses"])
        assert {2, 4, 6, 8} <= set(r["statuses"]), (rank, r["statuses"])
        assert r["committed"][-1] == max(r["statuses"]), (rank, r)  # the newest save


# ------------------------------------------------- the training thread never waits
#
# Issue 27: every store call a save needs runs in the background. Measured from inside
# each rank: every connection the training thread opens to the S3 port while the server
# is down (there must be none: a store call there is a wait on the store), and the time
# each save() took, due or not. The times are reported (docs/RELIABILITY.md, "Outage
# campaign"); what the test asserts is structural, so a loaded machine cannot fail it.

TT_STEPS = 24
TT_DOWN_AFTER, TT_UP_AFTER = 6, 16  # saves of steps 8..16 meet the outage


class _TrainingThreadConnects:
    """Counts the connections the calling (training) thread opens to ``port``."""

    def __init__(self, port: int) -> None:
        import socket

        self.port = port
        self.count = 0
        self.armed = False
        self._main = threading.get_ident()
        self._connect = socket.socket.connect
        counter = self

        def connect(sock, address):  # type: ignore[no-untyped-def]
            if (
                counter.armed
                and threading.get_ident() == counter._main
                and isinstance(address, tuple)
                and address[1] == counter.port
            ):
                counter.count += 1
            return counter._connect(sock, address)

        socket.socket.connect = connect  # type: ignore[method-assign]


def _rank_training_thread(
    rank: int, world: int, folder: str, env: dict[str, str], ctl: str, deadline: float | None
) -> dict[str, Any]:
    os.environ.update(env)
    from urllib.parse import urlsplit

    from quicksave.manager import CheckpointConfig, CheckpointManager
    from quicksave.storage import StorageOptions

    connects = _TrainingThreadConnects(urlsplit(env["AWS_ENDPOINT_URL"]).port or 80)
    job = _Job()
    if deadline is None:  # the defaults: retry_deadline_s=60, on_save_error="raise"
        config = CheckpointConfig(folder=folder, interval=2, keep_latest_k=2, on_save_error="log")
    else:
        s3 = S3Options(retry_deadline_s=deadline, connect_timeout_s=1.0, read_timeout_s=10.0)
        config = CheckpointConfig(
            folder=folder,
            interval=2,
            keep_latest_k=2,
            on_save_error="log",
            max_consecutive_failures=100,
            storage=StorageOptions(s3=s3),
        )
    manager = CheckpointManager(config, job.states())
    times: list[tuple[int, bool, float]] = []  # (step, due, seconds in save()) while down
    raised: list[str] = []
    for step in range(1, TT_STEPS + 1):
        job.step()
        down = TT_DOWN_AFTER < step <= TT_UP_AFTER
        connects.armed = down
        began = time.perf_counter()
        try:
            manager.save(step)
        except CheckpointError as e:
            raised.append(f"step {step}: {e}")
        took = time.perf_counter() - began
        connects.armed = False
        if down:
            times.append((step, step % 2 == 0, took))
        if step == TT_DOWN_AFTER:
            manager.wait()  # step 6 committed and housekept before the outage
            if rank == 0:
                _mark(ctl, "kill")
            _await(ctl, "down")
        elif step == TT_UP_AFTER:
            if rank == 0:
                _mark(ctl, "restart")
            _await(ctl, "up")
            manager.wait()  # the outage's saves end (failed or committed), settled alike
        elif step == TT_STEPS - 1:
            manager.wait()  # (a save due while the last one still retries is skipped)
    manager.close()
    _after_every_close()
    return {
        "times": times,
        "connects": connects.count,
        "raised": raised,
        "statuses": {r.step: r.status for r in manager.metrics},
        "committed": manager.committed_steps(),
    }


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("deadline", [2.0, None], ids=["retry_deadline_s=2", "defaults"])
def test_the_training_thread_never_waits_on_a_store_that_is_down(
    server, bucket, tmp_path, world, deadline
):
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    operator = _Operator(server, str(ctl))
    try:
        results = run_ranks(
            _rank_training_thread,
            world,
            f"s3://{bucket}/run",
            server.env(),
            str(ctl),
            deadline,
            config=LAUNCH,
        )
    finally:
        operator.stop()
    for rank, r in enumerate(results):
        due = [t for _, d, t in r["times"] if d]
        idle = [t for _, d, t in r["times"] if not d]
        print(
            f"outage, {world} rank(s), {'defaults' if deadline is None else 'retry_deadline_s=2'}"
            f", rank {rank}: longest save() while down: due {max(due) * 1e3:.1f} ms, "
            f"not due {max(idle) * 1e3:.1f} ms"
        )
        # no store call on the training thread while the store was down
        assert r["connects"] == 0, (rank, r)
        assert r["raised"] == [], (rank, r["raised"])  # on_save_error="log"
        # the saves after the outage commit; nothing of a failed save is visible
        after = {s: v for s, v in r["statuses"].items() if s > TT_UP_AFTER}
        assert TT_STEPS in after and set(after.values()) == {"committed"}, (rank, r)
        assert r["committed"][-1] == TT_STEPS and len(r["committed"]) == 2, (rank, r)
    names = _objects(server, bucket, "run/")
    steps = {n.split("/", 1)[0] for n in names if n.startswith("step-")}
    assert steps == {f"step-{s}" for s in results[0]["committed"]}, sorted(names)
    for step in steps:
        assert f"{step}/manifest.json" in names
