"""A resume whose optimizer states stream in behind ``load()`` (``stream_load``, on by
default where the load has no collective): the optimizers' step, ``state_dict()`` and
every manager call wait for them, the result is bit-exact, and a torn optimizer chunk
is raised at that wait, naming it, with the checkpoint moved aside so that the next
resume takes the newest whole one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quicksave.errors import CorruptCheckpointError
from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState, OptimizerState


def _job(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)
    for _ in range(steps):
        optim.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optim.step()


def _states(model, optim):
    return {"model": ModelState(model), "optim": OptimizerState(model, optim)}


def _save(folder: Path, steps: list[int]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, optim = _job(0)
    config = CheckpointConfig(folder=str(folder), async_mode="disabled")
    with CheckpointManager(config, _states(model, optim)) as manager:
        for step in steps:
            _train(model, optim, 1)
            manager.save(step, force=True)
    return model, optim


@pytest.mark.parametrize("stream", [True, False])
def test_a_streamed_resume_is_bit_exact_and_the_optimizer_waits_for_it(tmp_path, stream):
    saved_model, saved_optim = _save(tmp_path / "ckpt", [1, 2])
    config = CheckpointConfig(folder=str(tmp_path / "ckpt"), async_mode="disabled")
    model, optim = _job(3)  # other weights, an optimizer without state
    manager = CheckpointManager(
        CheckpointConfig(**{**config.__dict__, "stream_load": stream}), _states(model, optim)
    )
    assert manager.load() == 2
    record = manager.last_load
    assert record.tier == "folder" and (record.stream is not None) == stream
    for a, b in zip(model.state_dict().values(), saved_model.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # the model is in place when load() returns
    got = optim.state_dict()  # waits for the streamed states
    want = saved_optim.state_dict()
    assert got["state"].keys() == want["state"].keys()
    for k in want["state"]:
        for name, value in want["state"][k].items():
            assert torch.equal(torch.as_tensor(got["state"][k][name]), torch.as_tensor(value))
    assert record.restored_s is not None and record.restored_s >= record.seconds
    # the resumed job trains on exactly as the saving one does
    _train(model, optim, 1)
    _train(saved_model, saved_optim, 1)
    for a, b in zip(model.parameters(), saved_model.parameters(), strict=True):
        assert torch.equal(a, b)
    manager.close()


def test_a_torn_optimizer_chunk_is_raised_after_load_and_moved_aside(tmp_path):
    folder = tmp_path / "ckpt"
    _save(folder, [1, 2])
    manifest = json.loads((folder / "step-2" / "manifest.json").read_text())
    fqn = next(k for k in manifest["tensors"] if k.startswith("optim.state.") and "exp_avg" in k)
    chunk = manifest["tensors"][fqn]["chunks"][0]
    with open(folder / "step-2" / chunk["file"], "r+b") as f:
        f.seek(chunk["offset"] + chunk["length"] // 2)
        f.write(b"\xff" * 8)

    config = CheckpointConfig(folder=str(folder), async_mode="disabled", stream_load=True)
    model, optim = _job(3)
    manager = CheckpointManager(config, _states(model, optim))
    assert manager.load() == 2  # the model's part is whole: training may start
    optim.zero_grad()
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as raised:
        optim.step()  # the optimizer's step waits for its states: they are torn
    assert raised.value.fqn == fqn
    assert not (folder / "step-2").exists()  # moved aside, never picked again
    assert any(p.name.startswith("step-2.corrupt-") for p in folder.iterdir())
    manager.close()

    model, optim = _job(4)
    with CheckpointManager(config, _states(model, optim)) as manager:
        assert manager.load() == 1
        assert optim.state_dict()["state"]  # loaded whole


def test_forward_and_backward_run_while_the_optimizer_states_stream_and_step_waits(tmp_path):
    """The model's states are in place and the optimizers' state allocated before
    ``load_streamed`` returns; a forward and backward then run while the stream is held
    back, and the step runs only once the stream's load has finished (an order of
    events, not a timing)."""
    import threading

    import quicksave
    from quicksave.loading.checkpoint import require_committed
    from quicksave.manager.streamed_load import load_streamed

    saved_model, saved_optim = _save(tmp_path / "ckpt", [1])
    checkpoint = require_committed(tmp_path / "ckpt" / "step-1")
    model, optim = _job(3)
    events: list[str] = []
    stepping, release = threading.Event(), threading.Event()

    def load(part, leave):
        if "optim" in part:  # the stream: held back until the training thread steps
            assert release.wait(60), "the step never came to wait for the stream"
        elif optim.state:  # allocated before the model's load, to fault it in meanwhile
            events.append("allocated")
        quicksave.load(part, checkpoint, leave=leave)
        events.append("optim loaded" if "optim" in part else "model loaded")

    stream = load_streamed(
        _states(model, optim), load, checkpoint, stream=True, on_done=lambda: None
    )
    assert stream is not None and not stream.done
    assert events == ["allocated", "model loaded"]
    for a, b in zip(model.state_dict().values(), saved_model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    optim.register_step_pre_hook(lambda *_: events.append("step"))  # after the stream's
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)
    optim.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    events.append("forward and backward")
    helper = threading.Thread(target=lambda: (stepping.wait(60), release.set()))
    helper.start()
    stepping.set()
    optim.step()
    helper.join()
    assert events == [
        "allocated",
        "model loaded",
        "forward and backward",
        "optim loaded",
        "step",
    ]
    assert stream.done
    _train(saved_model, saved_optim, 1)  # the same step on the saved job: equal weights
    for a, b in zip(model.parameters(), saved_model.parameters(), strict=True):
        assert torch.equal(a, b)
