"""api.py: what save/load do around the planner's steps."""

import gc

import pytest
import torch

import quicksave
import quicksave.worker.persist


def test_gc_is_paused_during_the_call_and_restored_after(tmp_path, monkeypatch):
    seen = []
    real_write = quicksave.worker.persist.write_file

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return real_write(*args, **kwargs)

    monkeypatch.setattr(quicksave.worker.persist, "write_file", spy)
    assert gc.isenabled()
    quicksave.save({"w": torch.ones(4)}, tmp_path / "a")
    assert seen == [False]
    assert gc.isenabled()
    with pytest.raises(quicksave.IncompatibleStateError):
        quicksave.load({"w": torch.ones(5)}, tmp_path / "a")
    assert gc.isenabled()


def test_a_disabled_gc_stays_disabled(tmp_path):
    gc.disable()
    try:
        quicksave.save({"w": torch.ones(4)}, tmp_path / "a")
        quicksave.load({"w": torch.zeros(4)}, tmp_path / "a")
        assert not gc.isenabled()
    finally:
        gc.enable()
