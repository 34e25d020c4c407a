"""The interval agreement's state machine, with a fake collective and fake clocks.

Several simulated ranks run in lockstep in one process; their votes meet in a fake
"all-reduce" that records which step launched each vote and which step consumed it, and
refuses to answer before every rank has voted (a real one would block there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch.distributed as dist

from quicksave.errors import CheckpointError
from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState
from quicksave.manager.interval import IntervalAgreement, needs_agreement
from quicksave.manager.policies import EveryNSeconds, EveryNSteps


@dataclass
class FakeAllReduce:
    """N ranks' votes, round by round; each rank's k-th vote belongs to round k."""

    world_size: int
    rounds: list[dict[int, bool]] = field(default_factory=list)
    launched: list[tuple[int, int]] = field(default_factory=list)  # (rank, step)
    consumed: list[tuple[int, int]] = field(default_factory=list)  # (rank, step)
    step: int = 0  # set by the driver before each call

    def vote_fn(self, rank: int):
        count = [0]

        def vote(due: bool) -> FakeVote:
            index = count[0]
            count[0] += 1
            while len(self.rounds) <= index:
                self.rounds.append({})
            self.rounds[index][rank] = due
            self.launched.append((rank, self.step))
            return FakeVote(self, rank, index)

        return vote


@dataclass
class FakeVote:
    net: FakeAllReduce
    rank: int
    index: int

    def wait(self) -> bool:
        votes = self.net.rounds[self.index]
        # A real all-reduce would block here: a rank consuming before all voted is a bug.
        assert len(votes) == self.net.world_size, f"round {self.index} incomplete: {votes}"
        self.net.consumed.append((self.rank, self.net.step))
        return max(votes.values())


def run(
    world_size: int,
    steps: list[int],
    due: dict[int, set[int]] | None = None,
    forced: set[int] = frozenset(),  # type: ignore[assignment]
    check_steps: int = 5,
) -> tuple[dict[int, list[int]], FakeAllReduce]:
    """Drive ``world_size`` agreements over ``steps``; rank r says "due" at ``due[r]``.
    Returns the steps each rank saved at, and the fake collective's log."""
    net = FakeAllReduce(world_size)
    agreements = [IntervalAgreement(check_steps, net.vote_fn(r)) for r in range(world_size)]
    saved: dict[int, list[int]] = {r: [] for r in range(world_size)}
    due = due or {}
    for step in steps:
        net.step = step
        for rank, agreement in enumerate(agreements):
            if agreement.decide(step, step in due.get(rank, set()), step in forced):
                saved[rank].append(step)
    return saved, net


def test_votes_launch_only_at_check_steps_and_are_consumed_at_the_next_one() -> None:
    saved, net = run(1, list(range(1, 21)), check_steps=5)
    assert saved == {0: []}
    assert [s for _, s in net.launched] == [1, 5, 10, 15, 20]
    # Each vote is consumed one check step after it was launched (never the same step).
    assert [s for _, s in net.consumed] == [5, 10, 15, 20]


def test_one_rank_due_makes_every_rank_save_at_the_same_step() -> None:
    # Only rank 1's clock ran past the interval (from step 3 on): it votes "due" at the
    # check step 5; every rank consumes that vote at step 10 and saves there.
    saved, net = run(3, list(range(1, 16)), due={1: set(range(3, 16))}, check_steps=5)
    assert saved == {0: [10], 1: [10], 2: [10]}
    # The vote launched at the saving step says "not due" (the save restarts the
    # interval), so no second save follows at step 15.
    assert net.rounds[2] == {0: False, 1: False, 2: False}
    assert net.rounds[1] == {0: False, 1: True, 2: False}


def test_due_between_check_steps_waits_for_the_next_vote() -> None:
    # Due from step 6: the vote at 10 carries it, the save is at 15 (<= 2 * check_steps
    # after it became due).
    saved, _ = run(2, list(range(1, 21)), due={0: set(range(6, 21))}, check_steps=5)
    assert saved == {0: [15], 1: [15]}


def test_a_forced_save_between_check_steps_voids_the_vote_in_flight() -> None:
    # Rank 0 voted "due" at step 5; the forced save at 7 restarted the interval, so
    # step 10 consumes that vote without saving.
    saved, net = run(2, list(range(1, 13)), due={0: {5}}, forced={7}, check_steps=5)
    assert saved == {0: [7], 1: [7]}
    assert net.rounds[1] == {0: True, 1: False}
    assert (0, 10) in net.consumed


def test_a_forced_save_at_a_check_step_consumes_and_votes_not_due() -> None:
    saved, net = run(2, list(range(1, 16)), due={0: {5, 10}}, forced={10}, check_steps=5)
    assert saved == {0: [10], 1: [10]}
    assert net.rounds[2] == {0: False, 1: False}  # launched at 10, consumed at 15


def test_gaps_and_backward_steps_keep_every_rank_on_the_same_check_steps() -> None:
    steps = [1, 3, 7, 12, 13, 21, 4, 6, 10]
    saved, net = run(2, steps, due={1: {7}}, check_steps=5)
    # 1: first call; 7 >= 5; 12 >= 10; 21 >= 15; 4 < 21 (went back: a resume); 6 >= 5;
    # 10 >= 10. Not 3 (< 5) nor 13 (< 15).
    assert [s for r, s in net.launched if r == 0] == [1, 7, 12, 21, 4, 6, 10]
    assert saved == {0: [12], 1: [12]}


def test_check_steps_of_one_votes_every_step() -> None:
    saved, net = run(2, [1, 2, 3, 4], due={0: {2}}, check_steps=1)
    assert saved == {0: [3], 1: [3]}
    assert len(net.launched) == 8


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "10"])
def test_bad_check_steps_are_refused(bad: object) -> None:
    with pytest.raises(CheckpointError) as info:
        IntervalAgreement(bad, lambda due: None)  # type: ignore[arg-type, return-value]
    assert str(info.value) == f"interval_check_steps must be an integer >= 1, got {bad!r}"


def test_state_is_visible_for_logs_and_debugging() -> None:
    net = FakeAllReduce(1)
    agreement = IntervalAgreement(4, net.vote_fn(0))
    assert agreement.next_check is None and not agreement.vote_in_flight
    assert not agreement.decide(2, due=True, forced=False)
    assert agreement.next_check == 4 and agreement.vote_in_flight
    assert agreement.votes_launched == 1
    assert repr(agreement) == "IntervalAgreement(check_steps=4, next_check=4, vote_in_flight=True)"


def test_only_clock_based_policies_need_agreement() -> None:
    class Custom:
        needs_agreement = True

        def should_save(self, step: int, now: float, force: bool) -> bool:
            return force

        def saved(self, step: int, now: float) -> None:
            pass

    class OptOut(EveryNSeconds):
        needs_agreement = False

    assert needs_agreement(EveryNSeconds(5))
    assert not needs_agreement(EveryNSteps(5))
    assert needs_agreement(Custom())
    assert not needs_agreement(OptOut(5))


def test_config_validates_interval_check_steps(tmp_path: Path) -> None:
    assert CheckpointConfig(folder=str(tmp_path)).interval_check_steps == 10
    with pytest.raises(CheckpointError) as info:
        CheckpointConfig(folder=str(tmp_path), interval_check_steps=0)
    assert str(info.value) == "interval_check_steps must be an integer >= 1, got 0"


def test_one_rank_decides_alone_without_any_collective(tmp_path: Path, monkeypatch) -> None:
    import torch.nn as nn

    def no_collective(*args: object, **kwargs: object) -> None:
        raise AssertionError("a single rank must not run a collective")

    monkeypatch.setattr(dist, "all_reduce", no_collective)
    now = [0.0]
    config = CheckpointConfig(
        folder=str(tmp_path / "ckpt"),
        interval=10,
        interval_type="seconds",
        interval_check_steps=3,
        async_mode="disabled",
    )
    with CheckpointManager(
        config, {"model": ModelState(nn.Linear(2, 2))}, clock=lambda: now[0]
    ) as manager:
        assert manager.schedule.agreement is None
        saved = []
        for step in range(1, 8):
            now[0] = step * 4.0  # due at step 4 (16 s, 12 s after step 1)
            if manager.save(step):
                saved.append(step)
    # As before agreement existed: saved the very step the interval ran out, not at a
    # check step.
    assert saved == [4, 7]
