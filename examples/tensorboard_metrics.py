"""Each checkpoint's figures in TensorBoard, and its phases in a profiler trace.

A small MLP trains with AdamW; a :class:`quicksave.CheckpointManager` (asynchronous
process mode) saves every ``--interval`` steps. The manager's ``on_metrics`` hook gets one
:class:`quicksave.SaveRecord` per checkpoint once it is committed (or failed), on the
training thread, and one line sends its figures to TensorBoard::

    on_metrics=lambda r: [writer.add_scalar(k, v, r.step) for k, v in r.scalars().items()]

(``quicksave/blocking_s``: the time in ``save()``; ``staging_s``; ``durable_s``;
``throughput_mbps``; ``bytes``; ``failed``). With ``--trace FILE`` the run is profiled
with ``torch.profiler``: every phase of every save is a range on the thread that ran it
(``quicksave.save.collect``, ``plan``, ``stage``, ``wait_staging``, ``submit``), and the
worker process's ``persist`` and ``commit``, which the profiler cannot see, are added to
the exported trace from the records (``quicksave.trace.add_writer_spans``). Open it in
Perfetto (ui.perfetto.dev) or ``chrome://tracing``. Prints::

    logged 4 checkpoints to <logdir>
    trace with the writer's phases: <FILE> (8 writer events)

Run it (CPU, a few seconds; ``pip install 'quicksave[tensorboard]'``)::

    python examples/tensorboard_metrics.py --folder /tmp/tb-ckpt --logdir /tmp/tb-logs
    python examples/tensorboard_metrics.py --folder /tmp/tb-ckpt2 --logdir /tmp/tb-logs2 \\
        --trace /tmp/tb-trace.json
    tensorboard --logdir /tmp/tb-logs

Exit status: 0 on success, non-zero on any failure.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile
from torch.utils.tensorboard import SummaryWriter

from quicksave import CheckpointConfig, CheckpointManager, ModelState, OptimizerState, TrainState
from quicksave.trace import add_writer_spans


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--folder", required=True, help="checkpoint folder")
    p.add_argument("--logdir", required=True, help="TensorBoard log directory")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--interval", type=int, default=2)
    p.add_argument("--trace", default=None, metavar="FILE", help="write a profiler trace")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_state = TrainState()
    writer = SummaryWriter(args.logdir)
    manager = CheckpointManager(
        CheckpointConfig(
            folder=args.folder,
            interval=args.interval,
            on_metrics=lambda r: [writer.add_scalar(k, v, r.step) for k, v in r.scalars().items()],
        ),
        {"model": ModelState(model), "optim": OptimizerState(model, optim), "train": train_state},
    )
    # The background copy runs on a thread of its own: profile every thread to see it.
    profiler = (
        profile(
            activities=[ProfilerActivity.CPU],
            experimental_config=_ExperimentalConfig(profile_all_threads=True),
        )
        if args.trace
        else contextlib.nullcontext()
    )
    with profiler:
        for step in range(train_state.step + 1, args.steps + 1):
            x = torch.randn(32, 64)
            loss = F.mse_loss(model(x), x[:, :8])
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()  # waits, through the manager's hook, for the last save's copy
            train_state.step = step
            writer.add_scalar("train/loss", loss.item(), step)
            manager.save(step)
        manager.close()  # the last checkpoint commits; its record reaches the hook
    writer.close()
    print(f"logged {len(manager.metrics)} checkpoints to {args.logdir}")
    if args.trace:
        profiler.export_chrome_trace(args.trace)
        added = add_writer_spans(args.trace, manager.metrics)
        print(f"trace with the writer's phases: {args.trace} ({added} writer events)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
