"""The manager's policy objects, with plain numbers (no I/O, no clock)."""

from __future__ import annotations

import pytest

from quicksave.errors import CheckpointError
from quicksave.manager.policies import (
    EveryNSeconds,
    EveryNSteps,
    KeepLatestK,
    RetentionPolicy,
    SavePolicy,
)


def test_every_n_steps_saves_on_multiples_and_when_forced() -> None:
    policy = EveryNSteps(5)
    decisions = [policy.should_save(s, now=0.0, force=False) for s in range(0, 12)]
    assert [s for s, d in zip(range(12), decisions, strict=True) if d] == [0, 5, 10]
    assert policy.should_save(7, now=0.0, force=True)
    assert isinstance(policy, SavePolicy)


def test_every_n_seconds_counts_from_first_call_and_restarts_after_a_save() -> None:
    policy = EveryNSeconds(10.0)
    assert not policy.should_save(1, now=100.0, force=False)  # interval starts here
    assert not policy.should_save(2, now=109.9, force=False)
    assert policy.should_save(3, now=110.0, force=False)
    policy.saved(3, now=111.0)
    assert not policy.should_save(4, now=120.5, force=False)
    assert policy.should_save(5, now=121.0, force=False)
    assert policy.should_save(6, now=111.0, force=True)


def test_every_n_seconds_with_explicit_start() -> None:
    policy = EveryNSeconds(2, start=0.0)
    assert policy.should_save(1, now=2.0, force=False)
    assert not EveryNSeconds(2, start=0.0).should_save(1, now=1.5, force=False)


@pytest.mark.parametrize(
    ("k", "committed", "in_flight", "expected"),
    [
        (0, [1, 2, 3, 4], set(), []),  # 0 keeps all
        (1, [1, 2, 3, 4], set(), [1, 2, 3]),
        (2, [40, 10, 30, 20], set(), [10, 20]),  # order of the input does not matter
        (3, [1, 2], set(), []),
        (1, [], set(), []),
        (1, [1, 2, 3], {1}, [2]),  # in flight: never deleted
        (1, [5], {5}, []),
    ],
)
def test_keep_latest_k(k: int, committed: list[int], in_flight: set[int], expected: list[int]):
    assert KeepLatestK(k).to_delete(committed, in_flight) == expected


def test_keep_latest_k_never_deletes_the_newest_committed_even_if_in_flight_is_newer() -> None:
    # Step 9 is being written (not committed): it takes none of the k places, and the
    # newest committed (3) stays.
    assert KeepLatestK(1).to_delete([1, 2, 3], in_flight={9}) == [1, 2]
    assert isinstance(KeepLatestK(1), RetentionPolicy)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: EveryNSteps(0), "EveryNSteps needs a whole number of steps >= 1, got 0"),
        (lambda: EveryNSteps(2.5), "EveryNSteps needs a whole number of steps >= 1, got 2.5"),
        (lambda: EveryNSteps(True), "EveryNSteps needs a whole number of steps >= 1, got True"),
        (lambda: EveryNSeconds(0), "EveryNSeconds needs a positive number of seconds, got 0"),
        (lambda: KeepLatestK(-1), "KeepLatestK needs k >= 0 (0 keeps all), got -1"),
    ],
)
def test_bad_policy_arguments(build, message: str) -> None:
    with pytest.raises(CheckpointError) as info:
        build()
    assert str(info.value) == message
