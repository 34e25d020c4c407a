"""The overlap copy read alone: ``BackgroundCopy`` over a real pool and plan, no saver.

Its whole answer is the :class:`CopyDone` that ``wait()`` returns (the saver submits or
fails the save from it) and the addresses it adds to ``unguarded``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from helpers_engine.engine_util import engine_plan
from quicksave.saving.background_copy import BackgroundCopy, Overlap
from quicksave.saving.guard import Snapshot
from quicksave.saving.handle import SaveHandle
from quicksave.saving.staging import PoolCopier
from quicksave.stage.pool import StagingPool


@dataclass(frozen=True)
class Job:
    """The fields of a ``PersistJob`` the copy touches."""

    job_id: int
    digests: dict[str, str] = field(default_factory=dict)


@pytest.fixture
def state() -> dict[str, torch.Tensor]:
    return {"w": torch.randn(64, 32), "b": torch.arange(100, dtype=torch.float32)}


@pytest.fixture
def copy_of(state: dict[str, torch.Tensor]) -> Iterator[tuple[BackgroundCopy, Overlap]]:
    plan = engine_plan(state)
    pool = StagingPool(plan.layout, pin=False)
    bc = BackgroundCopy(PoolCopier(), rank=3)
    handle = SaveHandle(7, "/ckpt/step-7", time.monotonic())
    names = list(state)
    overlap = Overlap(Job(1), handle, Snapshot.take(state, names), state, {})  # type: ignore[arg-type]
    bc.start(overlap, pool, plan, names, None)
    try:
        yield bc, overlap
    finally:
        bc.join()
        pool.close()


def test_no_copy_no_answer() -> None:
    assert BackgroundCopy(PoolCopier(), rank=0).wait() is None


def test_an_untouched_copy_is_handed_back_with_its_digests(copy_of) -> None:
    bc, overlap = copy_of
    done = bc.wait()
    assert done is not None and done.error is None and not done.torn
    assert done.handle is overlap.handle and done.job is not None
    assert set(done.job.digests) == {"w", "b"}  # hashed while copied: the writer only writes
    assert overlap.handle.bytes_copied == (64 * 32 + 100) * 4
    assert bc.thread is None and bc.unguarded == set()


def test_a_tensor_written_before_the_check_fails_that_save_and_is_copied_in_save_after(
    copy_of, state
) -> None:
    bc, overlap = copy_of
    bc.thread.join()  # the copy is done; the write below lands before the training thread's check
    state["b"].add_(1)
    done = bc.wait()
    assert done is not None and done.torn and done.job is not None and done.job.job_id == 1
    assert done.error is not None and done.error.fqn == "b" and done.error.rank == 3
    assert "step 7 was not committed" in done.error.message
    assert bc.unguarded == {state["b"].data_ptr()}
