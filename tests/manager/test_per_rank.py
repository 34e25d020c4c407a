"""``quicksave.PerRank`` in one process: its entries, its checks, and what a load on
another number of ranks does (``on_resize``). The multi-rank behaviour is in
tests/multirank/test_per_rank_state.py."""

from __future__ import annotations

from typing import Any

import pytest
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

import quicksave
from quicksave.errors import IncompatibleStateError
from quicksave.manager import CheckpointConfig, CheckpointManager
from quicksave.manager.states import PerRankLoad, PerRankState


class Position:
    def __init__(self, batches: int) -> None:
        self.batches = batches

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches = int(state_dict["batches"])


def _stored(ranks: range) -> dict[str, Any]:
    return {f"dataloader.rank_{r}.batches": BytesStorageMetadata() for r in ranks}


def test_each_rank_saves_and_restores_its_own_entry() -> None:
    loader = Position(7)
    wrapped = quicksave.PerRank(loader)
    assert isinstance(wrapped, PerRankState) and wrapped.state is loader
    assert wrapped.state_dict() == {"rank_0": {"batches": 7}}
    wrapped.load_state_dict({"rank_0": {"batches": 9}})
    assert loader.batches == 9


def test_what_is_not_stateful_or_no_policy_is_refused() -> None:
    with pytest.raises(IncompatibleStateError, match="has no state_dict"):
        quicksave.PerRank(object())
    with pytest.raises(
        IncompatibleStateError, match=r"on_resize must be one of \('error', 'keep'\)"
    ):
        quicksave.PerRank(Position(0), on_resize="drop")


def test_a_load_on_fewer_ranks_is_refused_by_default() -> None:
    with pytest.raises(IncompatibleStateError) as info:
        PerRankLoad("dataloader", quicksave.PerRank(Position(0)), _stored(range(4)))
    e = info.value
    assert e.fqn == "dataloader"
    assert e.message.startswith(
        "this per-rank state was saved by 4 ranks and this job has 1: the entries of "
        "ranks 1-3 would be lost. Resume on 4 ranks, or build it as "
        "quicksave.PerRank(obj, on_resize='keep')"
    )


def test_keep_loads_the_own_entry_and_ignores_the_others() -> None:
    loader = Position(0)
    stand_in = PerRankLoad(
        "dataloader", quicksave.PerRank(loader, on_resize="keep"), _stored(range(2))
    )
    # rank 1's entry gets a throwaway destination, under its stored name
    assert set(stand_in.state_dict()) == {"rank_0", "rank_1.batches"}
    stand_in.load_state_dict({"rank_0": {"batches": 5}, "rank_1.batches": 6})
    assert loader.batches == 5


def test_the_same_number_of_ranks_loads(tmp_path) -> None:
    loader = Position(41)
    config = CheckpointConfig(folder=str(tmp_path / "ckpt"), async_mode="disabled")
    manager = CheckpointManager(config, {"dataloader": quicksave.PerRank(loader)})
    assert manager.save(1, force=True)
    manager.close()
    restored = Position(0)
    manager = CheckpointManager(config, {"dataloader": quicksave.PerRank(restored)})
    assert manager.load() == 1 and restored.batches == 41
    manager.close()
