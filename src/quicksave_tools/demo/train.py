"""The demo's training loop, run as a child process by ``quicksave demo``.

``python -m quicksave_tools.demo.train --json OUT [--folder F --interval N ...]`` trains the
tiny language model of :mod:`quicksave_tools.demo.model` on the shipped text with AdamW and a
warm-up + cosine learning-rate schedule, checkpointing through
:class:`~quicksave.manager.CheckpointManager` (model, optimizer, scheduler, batch
sampler, train state with the loss history, RNG). With ``--resume`` it first restores
the newest committed checkpoint.

Everything that could make two runs differ is pinned: the seed, the thread count,
deterministic algorithms, dropout RNG (checkpointed), and the sampler's private
generator (checkpointed). So an uninterrupted run and a killed-and-resumed one end with
bit-identical parameters.

Protocol with the parent (stdout, one line each, flushed):
``@@step N`` after step N (and its checkpoint call) finished; ``@@hold N`` after the
optimizer step of ``--hold-at`` N, *before* its checkpoint call, after which the run
stops and waits to be killed; ``@@done N`` at the end. Results go to
the ``--json`` file, rewritten (atomically) after every checkpoint and at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from quicksave.manager import (
    CheckpointConfig,
    CheckpointManager,
    ModelState,
    OptimizerState,
    RNGState,
    TrainState,
)
from quicksave_tools.demo.data import BatchSampler, CharTokenizer, load_corpus
from quicksave_tools.demo.model import ModelConfig, TinyLM

DEFAULT_ASYNC_MODE = "process"  # a persistent worker writes; staging overlaps training


@dataclass(frozen=True)
class TrainConfig:
    """One training run.

    Attributes:
        steps: total optimizer steps of the full run.
        seed: seeds the model initialisation, dropout and the batch sampler.
        batch_size: windows per batch.
        lr: peak learning rate (after warm-up).
        warmup: linear warm-up steps; cosine decay to 10% of ``lr`` afterwards.
        threads: ``torch.set_num_threads`` (results are exact only at equal counts).
        folder: checkpoint folder; None trains without checkpoints.
        interval: checkpoint every ``interval`` steps.
        keep: keep the newest ``keep`` checkpoints (0: all).
        async_mode: the manager's ``async_mode``.
        resume: restore the newest committed checkpoint before training.
        hold_at: after step ``hold_at`` stop and wait (to be killed); None runs to the end.
        json_path: where to write the results; None writes nothing.
    """

    steps: int = 120
    seed: int = 0
    batch_size: int = 16
    lr: float = 3e-3
    warmup: int = 10
    threads: int = 1
    folder: str | None = None
    interval: int = 20
    keep: int = 0
    async_mode: str = DEFAULT_ASYNC_MODE
    resume: bool = False
    hold_at: int | None = None
    json_path: str | None = None


def lr_lambda(warmup: int, total: int) -> Callable[[int], float]:
    """Multiplier of the peak LR at scheduler step ``i``: linear warm-up, cosine to 0.1."""

    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        progress = min(1.0, (i - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over names, dtypes, shapes and raw bytes, in name order.

    Example:
        >>> len(tensor_digest({"w": torch.zeros(2)}))
        64
    """
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def optimizer_digest(optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 of every tensor in the optimizer state (moments and step counts)."""
    flat: dict[str, torch.Tensor] = {}
    for idx, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                flat[f"{idx}.{key}"] = value
    return tensor_digest(flat)


def _metric_record(record: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return dataclasses.asdict(record)
    if isinstance(record, dict):
        return dict(record)
    keys = ("step", "kind", "path", "bytes", "blocking_s", "staging_s", "durable_s", "status")
    return {k: getattr(record, k, None) for k in keys}


def _in_flight(manager: CheckpointManager) -> int:
    return sum(getattr(r, "status", None) == "in_flight" for r in manager.metrics)


def _write_json(path: str, payload: dict[str, Any]) -> None:
    # Replace in one rename so the parent never reads half a file, even after SIGKILL.
    tmp = f"{path}.partial"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)


def _emit(tag: str, step: int) -> None:
    print(f"@@{tag} {step}", flush=True)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run (or resume) the training of ``cfg`` and return its results.

    Args:
        cfg: the run.

    Returns:
        A JSON-able dict: ``final_loss``, ``losses`` (one per step, including those
        restored from the checkpoint), ``params_sha256``, ``optimizer_sha256``,
        ``resumed_from`` (step or None), ``restore_s``, ``checkpoints`` (the manager's
        metrics records), ``committed_steps``, ``train_s``.

    Raises:
        quicksave.CheckpointError: a checkpoint could not be written or restored.

    Example::

        result = train(TrainConfig(steps=30, folder="ckpt", interval=10))

    The process-wide settings it needs (threads, deterministic algorithms, the seed)
    are restored when it returns: a caller in the same process (a test) keeps its own.
    """
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        with torch.random.fork_rng(devices=[]):
            return _train(cfg)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _train(cfg: TrainConfig) -> dict[str, Any]:
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.seed)

    text = load_corpus()
    tokenizer = CharTokenizer.from_text(text)
    tokens = tokenizer.encode(text)
    model = TinyLM(ModelConfig(vocab_size=tokenizer.vocab_size))
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1
    )
    scheduler = LambdaLR(optimizer, lr_lambda(cfg.warmup, cfg.steps))
    sampler = BatchSampler(tokens, cfg.batch_size, model.cfg.context, seed=cfg.seed + 1)

    manager: CheckpointManager | None = None
    train_state: TrainState | None = None
    result: dict[str, Any] = {
        "steps": cfg.steps,
        "seed": cfg.seed,
        "resumed_from": None,
        "restore_s": None,
        "checkpoints": [],
        "committed_steps": [],
        "num_params": sum(p.numel() for p in model.parameters()),
        "model": dataclasses.asdict(model.cfg),
        "corpus_chars": len(text),
    }
    if cfg.folder is not None:
        train_state = TrainState()
        config = CheckpointConfig(
            folder=cfg.folder,
            interval=cfg.interval,
            keep_latest_k=cfg.keep,
            last_step=cfg.steps,
            async_mode=cfg.async_mode,
        )
        manager = CheckpointManager(
            config,
            {
                "model": ModelState(model),
                "optimizer": OptimizerState(model, optimizer),
                "lr_scheduler": scheduler,
                "dataloader": sampler,
                "train_state": train_state,
                "rng": RNGState(),
            },
        )
        if cfg.resume:
            t0 = time.perf_counter()
            restored = manager.load()
            result["restore_s"] = time.perf_counter() - t0
            result["resumed_from"] = restored
    losses: list[float] = list(train_state.losses) if train_state is not None else []
    start = train_state.step if train_state is not None else 0

    def report() -> None:
        if manager is not None:
            result["checkpoints"] = [_metric_record(r) for r in manager.metrics]
            result["committed_steps"] = list(manager.committed_steps())
        if cfg.json_path is not None:
            _write_json(cfg.json_path, result)

    model.train()
    t_train = time.perf_counter()
    try:
        for step in range(start + 1, cfg.steps + 1):
            inputs, targets = sampler.next_batch()
            _, loss = model(inputs, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            if step == cfg.hold_at:
                # Announced before this step's checkpoint call: if one is due, the
                # parent's SIGKILL lands while it is being written.
                _emit("hold", step)
            if train_state is not None:
                train_state.step = step
                train_state.losses.append(losses[-1])
                train_state.log_steps.append(step)
                in_flight = _in_flight(manager)
                # Rewrite the results when a checkpoint starts or one in flight finishes
                # (the records then carry its staging and time-to-durable).
                if manager.save(step) or _in_flight(manager) != in_flight:
                    report()
            _emit("step", step)
            while step == cfg.hold_at:  # wait for the parent's SIGKILL: no clean-up runs
                time.sleep(3600)
        result["train_s"] = time.perf_counter() - t_train
    finally:
        if manager is not None:
            manager.close()
    result["final_step"] = cfg.steps
    result["losses"] = losses
    result["final_loss"] = losses[-1] if losses else None
    result["params_sha256"] = tensor_digest(dict(model.state_dict()))
    result["optimizer_sha256"] = optimizer_digest(optimizer)
    report()
    _emit("done", cfg.steps)
    return result


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Command line of ``python -m quicksave_tools.demo.train`` → :class:`TrainConfig`."""
    p = argparse.ArgumentParser(prog="python -m quicksave_tools.demo.train", description=__doc__)
    d = TrainConfig()
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--folder", default=None, help="checkpoint folder (none: no checkpoints)")
    p.add_argument("--interval", type=int, default=d.interval)
    p.add_argument("--keep", type=int, default=d.keep)
    p.add_argument("--async-mode", default=d.async_mode)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--hold-at", type=int, default=None)
    p.add_argument("--json", dest="json_path", default=None)
    a = p.parse_args(argv)
    return TrainConfig(
        steps=a.steps,
        seed=a.seed,
        batch_size=a.batch_size,
        lr=a.lr,
        warmup=a.warmup,
        threads=a.threads,
        folder=a.folder,
        interval=a.interval,
        keep=a.keep,
        async_mode=a.async_mode,
        resume=a.resume,
        hold_at=a.hold_at,
        json_path=a.json_path,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the training child. Returns the exit status."""
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
