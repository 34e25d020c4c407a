"""The floor-cost measurement (quicksave_tools.bench.floor_cost) on a tiny model: the
copy really reads every state tensor (its bytes match the optimizer's state), takes CPU
time, and the optimizer step waits for it."""

from __future__ import annotations

import torch

from quicksave_tools.bench import floor_cost


def test_the_floor_copy_copies_every_state_tensor_and_is_waited_for() -> None:
    model, optim, step = floor_cost.build_trainer({"shape": "mlp", "seed": 0, "quick": True})
    step()
    tensors = floor_cost._state_tensors(model, optim)
    assert len(tensors) == 3 * len(list(model.parameters()))  # weights, exp_avg, exp_avg_sq
    floor = floor_cost._FloorCopy(tensors)
    floor.start()
    with floor.guard():  # the optimizer step's wait
        assert floor.thread is None
    assert len(floor.cpu_s) == 1 and floor.cpu_s[0] >= 0
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
    assert torch.equal(floor.buffer, flat)


def test_measure_reports_one_extra_figure_per_loop_with_the_copy() -> None:
    r = floor_cost.measure("mlp", repeats=2, steps=4, interval=2, quick=True)
    assert len(r["extra_s_per_ckpt"]) == len(r["copy_loop_s"]) == len(r["baseline_loop_s"]) == 2
    assert r["bytes"] > 0 and r["copy_cpu_s_per_ckpt"] >= 0
