"""The overlap-guard campaign: training loops that write weights behind the manager's
back, at a size where the background copy takes real time, with no gates — the copy
races the training thread as it would in a job.

For each loop and async mode: a default ``CheckpointManager`` (``staging="overlap"``)
saves at ``--saves`` steps; right after each ``save()`` returns, the loop makes its
write. Each save then ends committed (its tensors compared, bit for bit, with a copy
taken at the moment of ``save()``) or failed with a ``CheckpointError``. The campaign
fails if any committed tensor differs. Results go to docs/RELIABILITY.md.

Usage::

    python tests/faults/overlap_campaign.py --layers 40 --dim 2048   # 671 MB of weights
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from quicksave.errors import CheckpointError
from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState, OptimizerState

LOOPS = ("by_hand", "second_optimizer", "inplace_edit")


class Loop:
    def __init__(self, kind: str, layers: int, dim: int) -> None:
        torch.manual_seed(0)
        self.kind = kind
        self.model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
        params = list(self.model.parameters())
        self.registered: list[torch.optim.Optimizer] = []
        self.others: list[torch.optim.Optimizer] = []
        if kind == "second_optimizer":  # the manager is given the first half only
            self.registered = [torch.optim.SGD(params[: len(params) // 2], lr=1e-3)]
            self.others = [torch.optim.SGD(params[len(params) // 2 :], lr=1e-3)]
        elif kind == "inplace_edit":
            self.registered = [torch.optim.SGD(params, lr=1e-3)]
        self.x = torch.randn(4, dim)

    def states(self) -> dict[str, Any]:
        states: dict[str, Any] = {"model": ModelState(self.model)}
        if self.registered:
            states["optimizer"] = OptimizerState(self.model, self.registered)
        return states

    def step(self) -> None:
        self.model.zero_grad()
        self.model(self.x).square().mean().backward()
        with torch.no_grad():
            if self.kind == "by_hand":
                for p in self.model.parameters():
                    p.sub_(1e-3 * p.grad)
        for o in self.others + self.registered:
            o.step()

    def right_after_save(self) -> None:
        with torch.no_grad():
            if self.kind == "by_hand":  # the next update by hand, at once
                for p in self.model.parameters():
                    p.sub_(1e-3 * p.grad)
            elif self.kind == "second_optimizer":
                for o in self.others:
                    o.step()
            else:
                for p in self.model.parameters():
                    p.mul_(0.5)


def model_tensors(states: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in states["model"].parts[0].state_dict().items()}


def run(kind: str, mode: str, layers: int, dim: int, saves: list[int], root: Path) -> dict:
    loop = Loop(kind, layers, dim)
    states = loop.states()
    folder = root / f"{kind}-{mode}"
    config = CheckpointConfig(folder=str(folder), interval=10**9, async_mode=mode)
    expected: dict[int, dict[str, torch.Tensor]] = {}
    errors: list[str] = []
    t0 = time.monotonic()
    with CheckpointManager(config, states) as manager:
        for step in range(1, max(saves) + 3):
            loop.step()
            try:
                if manager.save(step, force=step in saves):
                    expected[step] = model_tensors(states)
                    loop.right_after_save()
            except CheckpointError as e:
                errors.append(str(e).split(". ")[0])
        try:
            manager.wait()
        except CheckpointError as e:
            errors.append(str(e).split(". ")[0])
        committed = manager.committed_steps()
    outcome: dict[str, Any] = {"loop": kind, "mode": mode, "errors": errors, "saves": {}}
    for step in saves:
        if step not in committed:
            outcome["saves"][step] = "failed (CheckpointError)"
            continue
        fresh = Loop(kind, layers, dim)
        fresh_states = {"model": ModelState(fresh.model)}
        reader = CheckpointConfig(folder=str(folder), async_mode="disabled")
        with CheckpointManager(reader, fresh_states) as m:
            m.load(step, strict=False)
        got = model_tensors(fresh_states)
        bad = sum(not torch.equal(got[k], v) for k, v in expected[step].items())
        outcome["saves"][step] = f"committed, {bad}/{len(got)} tensors differ"
        outcome.setdefault("torn", 0)
        outcome["torn"] += bad
    outcome["seconds"] = round(time.monotonic() - t0, 1)
    del expected
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--saves", default="4,7", help="steps saved (comma-separated)")
    parser.add_argument("--modes", default="process,thread")
    parser.add_argument("--loops", default=",".join(LOOPS))
    args = parser.parse_args(argv)
    saves = [int(s) for s in args.saves.split(",")]
    mb = args.layers * (args.dim * args.dim + args.dim) * 4 / 1e6
    print(f"# {args.layers} x Linear({args.dim}, {args.dim}): {mb:.0f} MB of weights")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.loops.split(","):
            for mode in args.modes.split(","):
                r = run(kind, mode, args.layers, args.dim, saves, Path(tmp))
                print(json.dumps(r), flush=True)
                results.append(r)
    torn = sum(r.get("torn", 0) for r in results)
    print(f"# committed tensors that differ from the state at save(): {torn}")
    return 1 if torn else 0


if __name__ == "__main__":
    sys.exit(main())
