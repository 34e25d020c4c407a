"""``CheckpointManager.load(step, strict=...)``: a folder written by stock torchtitan.

torchtitan's checkpoints are stock DCP folders (``step-<N>/.metadata``) whose keys are
torchtitan's layout: the model's keys at the top level beside ``optimizer``,
``lr_scheduler``, ``dataloader`` (one entry per data-parallel rank) and ``train_state``.
A quicksave manager with other states lists them (``allow_dcp=True``); a strict load
refuses, naming the keys, and ``strict=False`` loads the states it has.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torchtitan  # noqa: F401  (pinned in the dev extra: missing, collection fails)

from helpers import titan
from quicksave import CheckpointConfig, CheckpointManager
from quicksave.errors import IncompatibleStateError


class _Stateful:
    """torchtitan's ``OptimizersContainer`` is a ``torch.optim.Optimizer``, which the
    manager refuses (a bare optimizer keys its state by index); the container's own
    ``state_dict()`` is keyed by parameter fqn, so it is handed over as a Stateful."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)


def _stock_torchtitan_folder(tmp_path: Path) -> titan.Job:
    from torchtitan.components.checkpointer import CheckpointManager as StockManager

    config = StockManager.Config(enable=True, folder="checkpoint", interval=2, keep_latest_k=0)
    job = titan.build(config, str(tmp_path), steps=4)
    titan.train(job, until=3)  # stock torchtitan writes step-2
    return job


def test_torchtitan_checkpoint_loads_with_strict_false(tmp_path: Path) -> None:
    written = _stock_torchtitan_folder(tmp_path)
    fresh = titan.build(titan.disabled_checkpoint(), str(tmp_path / "fresh"), steps=4)
    states = {
        "optimizer": _Stateful(fresh.optimizers),
        "lr_scheduler": fresh.lr_schedulers,
        "train_state": fresh.train_state,
    }
    config = CheckpointConfig(
        folder=str(tmp_path / "checkpoint"), allow_dcp=True, async_mode="disabled"
    )
    with CheckpointManager(config, states) as manager:
        assert manager.committed_steps() == [2]
        with pytest.raises(IncompatibleStateError) as info:
            manager.load()
        assert info.value.message == (  # the states, then the keys (its cause)
            "the checkpoint of step 2 (the newest committed one) holds the states "
            "'dataloader', 'layers', 'lr_scheduler', 'norm', 'optimizer', 'output', "
            "'tok_embeddings', 'train_state', and this manager loads 'lr_scheduler', "
            "'optimizer', 'train_state' (not this manager's: 'dataloader', 'layers', 'norm', "
            "'output', 'tok_embeddings'): it was written by something else (quicksave.save, "
            "another program). Keep other checkpoints out of the manager's folder, or "
            "load(strict=False) to load the states both have"
        )
        message = info.value.__cause__.message
        assert message.startswith("state dict keys do not match the checkpoint (")
        for key in ("tok_embeddings.weight", "dataloader.dp_rank_0", "dataloader.world_size"):
            assert key in message, message
        assert "pass strict=False" in message
        assert info.value.path == str(tmp_path / "checkpoint" / "step-2")

        assert manager.load(strict=False) == 2
        assert manager.load(step=2, strict=False) == 2
    tokens = 2 * titan.SEQ * titan.BATCH
    assert fresh.train_state.state_dict() == {"step": 2, "ntokens_seen": tokens}
    assert fresh.lr_schedulers.state_dict() == {"last_epoch": 2}
    at_2 = titan.build(titan.disabled_checkpoint(), str(tmp_path / "again"), steps=4)
    titan.train(at_2, until=2)
    expected = {k: v for k, v in titan.fingerprint(at_2).items() if k.startswith("optimizer")}
    loaded = {k: v for k, v in titan.fingerprint(fresh).items() if k.startswith("optimizer")}
    assert loaded == expected and expected
    # the model was not among the states: left as it was built
    assert (
        titan.fingerprint(fresh)["model.output.weight"]
        != titan.fingerprint(written)["model.output.weight"]
    )
