"""A trainer for the incremental-save kill test (tests/faults/test_incremental_kills.py):
resumes from its folder, then saves every step incrementally until killed, printing
``saved <step>`` after each ``save()``.

The state at step ``s`` is a pure function of ``s`` (:func:`expected`): a frozen table of
which step ``k`` rewrote rows ``k % ROWS`` and ``97 k % ROWS`` (two of its 8 blocks, so
most stay unchanged from one save to the next, and a save's blocks are superseded one at
a time: its checkpoint stays referred to for the other, half unused), and a small head
that changes at every step.

Usage: ``python incremental_child.py <folder> <policy>``: ``every4`` (a full save every
4) or ``compact`` (no full save after the first; ``max_unused=0.5`` rewrites the blocks
that the most superseded checkpoints still hold).
"""

from __future__ import annotations

import sys

import torch

ROWS, COLS = 512, 256  # 512 KiB of float32: 8 blocks of 64 KiB


def expected(step: int) -> dict[str, torch.Tensor]:
    """The state after step ``step``."""
    table = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    for k in range(1, step + 1):
        table[k % ROWS] = float(k)
        table[97 * k % ROWS] = -float(k)
    return {"table": table, "head": torch.full((16,), float(step))}


class _State:
    def __init__(self) -> None:
        self.sd = expected(0)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.sd)

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        for k, v in sd.items():
            self.sd[k].copy_(v)


def main(folder: str, policy: str) -> None:
    import quicksave
    from quicksave.manager import CheckpointConfig, CheckpointManager

    chains = {"every4": {"full_every": 4}, "compact": {"max_unused": 0.5}}[policy]
    incremental = quicksave.IncrementalConfig(enabled=True, block_bytes=64 << 10, **chains)
    config = CheckpointConfig(
        folder=folder, interval=1, keep_latest_k=2, async_mode="thread", incremental=incremental
    )
    state = _State()
    manager = CheckpointManager(config, {"s": state})
    step = manager.load() or 0
    print(f"resumed {step}", flush=True)
    while True:
        step += 1
        state.sd["table"][step % ROWS] = float(step)
        state.sd["table"][97 * step % ROWS] = -float(step)
        state.sd["head"].fill_(float(step))
        manager.save(step)
        print(f"saved {step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
