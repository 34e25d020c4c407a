"""Boilerplate shared by the torchrun examples (``fsdp2_quicksave.py``, ``tp_quicksave.py``,
``pp_quicksave.py``; ``torchtitan_quicksave.py`` uses only :func:`exit_without_finalizing`).

Nothing here touches quicksave beyond waiting on a manager: the models, the parallelism
and the checkpoint calls stay in each script. The scripts run as ``python examples/x.py``
or ``torchrun ... examples/x.py``, so ``examples/`` is ``sys.path[0]`` and they import
this module as ``from _common import ...``.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from quicksave import CheckpointManager


def example_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the options every torchrun example takes; the script adds its
    model's.

    Run and checkpoints: ``--folder`` (required), ``--steps`` (8), ``--interval`` (4),
    ``--kill-at STEP``. Training: ``--lr`` (3e-3), ``--warmup`` (2 steps), ``--max-norm``
    (1.0, gradient clipping), ``--seed`` (0).
    """
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--folder", required=True, help="checkpoint folder (path or URL)")
    p.add_argument("--steps", type=int, default=8, help="train until this step")
    p.add_argument("--interval", type=int, default=4, help="checkpoint every N steps")
    p.add_argument(
        "--kill-at",
        type=int,
        default=None,
        metavar="STEP",
        help="SIGKILL every rank once the checkpoint of STEP has committed",
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping")
    p.add_argument("--seed", type=int, default=0)
    return p


def setup_cpu(distributed: bool = True) -> tuple[int, int]:
    """One thread, deterministic algorithms and, if ``distributed``, the gloo process
    group (collective: every rank calls it). Returns ``(rank, world size)``; ``(0, 1)``
    without a process group."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if not distributed:
        return 0, 1
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0":
        dist.init_process_group("gloo")
    else:  # torchrun restarted the job: the ranks meet under keys of this attempt's own
        # (gloo's rendezvous keys of the failed attempt are still in torchrun's store)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False
        )
        store = dist.PrefixStore(f"attempt-{attempt}", store)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    return dist.get_rank(), dist.get_world_size()


def print0(message: str) -> None:
    """Print (flushed) on rank 0 only, or always without a process group."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def lr_lambda(warmup: int, total: int) -> Callable[[int], float]:
    """The ``LambdaLR`` factor of a linear warm-up over ``warmup`` steps, then a cosine
    decay to 0.1 at step ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def synthetic_batch(seed: int, step: int, size: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of ``step``: a pure function of the step, so a resumed run sees
    exactly the data the uninterrupted one saw."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(size, dim, generator=g)
    return x, torch.sin(x.roll(1, dims=1)) * 0.5


def sigkill_once_committed(
    manager: CheckpointManager, step: int, ranks: list[int] | None = None
) -> None:
    """Collective (a barrier): wait until this rank's checkpoint of ``step`` (and its
    memory snapshot) is committed and every rank got there, then crash as hard as a
    process can (SIGKILL itself) on ``ranks`` (default: every rank); the others go on."""
    manager.wait()  # the checkpoint of this step is committed ...
    dist.barrier()  # ... on every rank: now crash
    if ranks is not None and dist.get_rank() not in ranks:
        return
    print(f"rank {dist.get_rank()}: SIGKILL after step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL was sent")


def add_memory_options(p: argparse.ArgumentParser) -> None:
    """``--memory-every N`` (a node-memory tier: a snapshot every N steps),
    ``--memory-root`` (its tmpfs, default /dev/shm) and ``--kill-rank-at STEP`` (the last
    rank SIGKILLs itself once the snapshot of STEP is committed, on torchrun's first
    attempt only: the restarted job resumes from memory)."""
    p.add_argument("--memory-every", type=int, default=None, metavar="N")
    p.add_argument("--memory-root", default="/dev/shm")
    p.add_argument("--kill-rank-at", type=int, default=None, metavar="STEP")


def leaves(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf of nested dicts, lists and tuples, keyed by its dotted path."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, f"{prefix}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from leaves(item, f"{prefix}.{i}")
    else:
        yield prefix, value


def _hash_leaf(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        h.update(repr(value).encode())


def leaf_hash(value: Any) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes, or of another value's ``repr``."""
    h = hashlib.sha256()
    _hash_leaf(h, value)
    return h.hexdigest()


def digest(state: dict[str, Any]) -> str:
    """SHA-256 over every leaf of ``state`` (tensor bytes, dtype and shape; other values
    by ``repr``), in key order."""
    h = hashlib.sha256()
    for key, value in sorted(leaves(state)):
        h.update(key.encode())
        _hash_leaf(h, value)
    return h.hexdigest()


def full_state_digest(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> str | None:
    """The digest of the full model and optimizer state (keys are parameter fqns, so a
    sharded model and a plain one compare). Distributed: collective, gathers the full
    tensors onto rank 0 and returns the digest there (None on the other ranks)."""
    distributed = dist.is_initialized()
    model_sd, optim_sd = get_state_dict(
        model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=distributed)
    )
    if distributed and dist.get_rank() != 0:
        return None
    return digest({"model": model_sd, "optim": optim_sd, "step": step})


def exit_without_finalizing(code: int) -> NoReturn:
    """Flush stdout and stderr and leave with ``code`` at once: call it last, after
    ``destroy_process_group()``, with everything committed and printed."""
    # Leave without interpreter finalization. torch's gloo worker threads outlive
    # destroy_process_group() (the group stays referenced from C++), and one that is
    # still dropping the buffers of a finished collective when Python finalizes takes
    # the GIL and aborts the process ("terminate called without an active exception",
    # SIGABRT; pytorch/pytorch#190489).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
