"""The multi-rank vote read alone: ``RankVote`` over a scripted ``poll`` and a stand-in for
the ranks' planning, no saver, no worker, no process group.

Each test scripts the snapshots this rank's saver would give (``RankState``) and checks
what the vote decides from them: the vote holds none of the saver's state, so these are
all its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from quicksave.errors import CheckpointError
from quicksave.saving.config import EngineConfig
from quicksave.saving.rank_vote import RankState, RankVote

READY = RankState(pool_free=True, worker_warm=True, store_failing=False, lost=False, oldest=None)
FULL = RankState(pool_free=False, worker_warm=True, store_failing=False, lost=False, oldest=None)


class ScriptedPoll:
    """The saver's side: answers each ``poll`` with the next state (the last one repeats)
    and records the timeouts it was asked to wait."""

    def __init__(self, *states: RankState) -> None:
        self.states = list(states)
        self.timeouts: list[float] = []

    def __call__(self, timeout: float) -> RankState:
        self.timeouts.append(timeout)
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]


@dataclass
class StandInPlanning:
    """What the vote needs of ``DistSaving``: the collective (here: this rank's vote only,
    the others' given), the commit records' settled outcomes and their deadlines."""

    others_go: bool = True
    posted: set[str] = field(default_factory=set)
    outcome_wait_s: float = 3600.0
    ctx: Any = field(default_factory=lambda: SimpleNamespace(commit_timeout_s=0.0))
    votes: list[tuple[bool, bool | None]] = field(default_factory=list)

    def settled(self, token: str) -> bool:
        return token in self.posted

    def plan(self, state_dict: Any, url: str, *, go: bool, ready: Any, **_: Any) -> str | None:
        now = ready() if go else None
        self.votes.append((go, now))
        return "the plan" if go and now and self.others_go else None


LOC = SimpleNamespace(url="/ckpt/step-1")


def _vote(planning: StandInPlanning, poll: ScriptedPoll, **config: Any) -> RankVote:
    return RankVote(planning, EngineConfig(**config), poll)  # type: ignore[arg-type]


def test_a_ready_rank_plans_and_every_rank_saves() -> None:
    planning, poll = StandInPlanning(), ScriptedPoll(READY)
    assert _vote(planning, poll).plan({}, LOC, 1, None, None) == "the plan"
    assert planning.votes == [(True, True)]


def test_an_unreported_failure_skips_the_save_everywhere_and_is_raised_here() -> None:
    planning, poll = StandInPlanning(), ScriptedPoll(READY)
    problem = CheckpointError("the last save failed", rank=0)
    with pytest.raises(CheckpointError) as e:
        _vote(planning, poll).plan({}, LOC, 1, None, problem)
    assert e.value is problem
    assert planning.votes == [(False, None)]  # this rank voted no: every rank skips


def test_another_ranks_no_skips_the_save_without_an_error() -> None:
    planning, poll = StandInPlanning(others_go=False), ScriptedPoll(READY)
    assert _vote(planning, poll).plan({}, LOC, 1, None, None) is None


def test_skip_backpressure_with_no_free_pool_votes_no() -> None:
    planning, poll = StandInPlanning(), ScriptedPoll(FULL)
    assert _vote(planning, poll, backpressure="skip").plan({}, LOC, 1, None, None) is None
    assert planning.votes == [(False, None)]


def test_a_pool_held_by_a_save_stuck_on_the_store_is_not_waited_for() -> None:
    stuck = RankState(False, True, store_failing=True, lost=False, oldest=("t", 0.0))
    poll = ScriptedPoll(stuck)
    assert _vote(StandInPlanning(), poll).ready(0.0, need_pool=True) is None
    assert poll.timeouts == [0.0]  # decided from the first snapshot: no wait


def test_the_vote_waits_in_step_for_the_outcome_of_a_lost_save() -> None:
    lost = RankState(True, True, store_failing=False, lost=True, oldest=None)
    poll = ScriptedPoll(lost, lost, READY)
    assert _vote(StandInPlanning(), poll).ready(0.0, need_pool=True) is True
    assert poll.timeouts == [0.0, 0.02, 0.02]  # polled until the outcome came


def test_a_full_rank_waits_in_step_for_its_oldest_save_until_its_outcome_is_posted() -> None:
    held = RankState(False, True, store_failing=False, lost=False, oldest=("tok", 0.0))
    planning = StandInPlanning(outcome_wait_s=float("inf"))

    class PostedAtTheThirdPoll(ScriptedPoll):
        def __call__(self, timeout: float) -> RankState:
            if len(self.timeouts) == 2:
                planning.posted.add("tok")  # the coordinator's verdict on that save
            return super().__call__(timeout)

    poll = PostedAtTheThirdPoll(held)
    # posted, but the pool is still this rank's own (slow) writer's: not ready within the
    # round (here 0 s), so every rank votes again
    assert _vote(planning, poll).ready(0.0, need_pool=True) is False
    assert poll.timeouts == [0.0, 0.02, 0.02]


def test_a_new_worker_still_warming_up_is_not_ready() -> None:
    warming = RankState(True, worker_warm=False, store_failing=False, lost=False, oldest=None)
    assert _vote(StandInPlanning(), ScriptedPoll(warming)).ready(0.0, need_pool=False) is False
