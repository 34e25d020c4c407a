"""The user script of ``time_to_finalize.py``: NVRx's documented async-save flow, timed.

``time_to_finalize.py`` runs this file on every rank (torchrun's environment: ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; gloo) twice: as it is, importing NVIDIA
Resiliency Extension's ``nvidia_resiliency_ext.checkpointing.async_ckpt``, and as a copy
whose only change is that import rewritten to ``quicksave.compat.nvrx``. It is not meant to be
run by hand.

Per save, as in NVRx's ``examples/checkpointing/async_writer.py``: a
``FileSystemWriterAsync(ckpt_dir, thread_count=2)``, ``save_state_dict_async_plan``,
``writer.get_save_function_and_args()``, an ``AsyncRequest`` whose finalize function calls
``save_state_dict_async_finalize``, ``schedule_async_request`` on one persistent
``AsyncCallsQueue``, then ``maybe_finalize_async_calls(blocking=True, no_dist=False)``.
Every rank measures, from a barrier before the save: the blocking time (plan + schedule:
what a training loop waits for) and the time until finalized (until the blocking finalize
returns). The first save (which starts the queue's worker) is reported apart from the
``--saves`` timed ones. After each save, outside the timed region, every rank loads the
checkpoint with stock ``torch.distributed.checkpoint.load`` + ``FileSystemReader`` and
compares it with what it saved; then rank 0 deletes it.

Rank 0 writes the per-rank numbers to ``--result`` (JSON, rewritten after every save, so
that a run that fails half-way keeps what it measured). Any error ends the rank with a
traceback on stderr and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import (
    FileSystemWriterAsync,
)
from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from torch.distributed.checkpoint import FileSystemReader, load
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

MIB = 1 << 20


def build_state_dict(rank: int, count: int, tensor_mib: float) -> dict[str, torch.Tensor]:
    """``count`` float32 tensors of ``tensor_mib`` MiB, random, with this rank's own keys.

    The keys carry the rank so that every rank saves (and writes) its whole state dict: with
    the same keys on every rank, DCP's planner would treat the tensors as replicated and
    have only one rank write each.
    """
    numel = int(tensor_mib * MIB) // 4
    cols = 1024 if numel % 1024 == 0 else 1
    gen = torch.Generator().manual_seed(1000 + rank)
    return {
        f"rank{rank}.t{i:04d}": torch.empty(numel // cols, cols).uniform_(generator=gen)
        for i in range(count)
    }


def save(
    state_dict: dict[str, torch.Tensor],
    ckpt_dir: Path,
    queue: AsyncCallsQueue,
    writer_kwargs: dict,
) -> tuple[float, float]:
    """One save in NVRx's documented flow; (blocking s, until finalized s) on this rank."""
    dist.barrier()
    start = time.perf_counter()
    writer = FileSystemWriterAsync(str(ckpt_dir), thread_count=2, **writer_kwargs)
    plan_ret = save_state_dict_async_plan(state_dict, writer, None, 0, planner=DefaultSavePlanner())
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()

    def finalize_fn() -> None:
        save_state_dict_async_finalize(*plan_ret)

    request = AsyncRequest(save_fn, save_args, [finalize_fn], preload_fn=preload_fn)
    queue.schedule_async_request(request)
    blocking = time.perf_counter() - start
    queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    finalized = time.perf_counter() - start
    return blocking, finalized


def verify(
    state_dict: dict[str, torch.Tensor], into: dict[str, torch.Tensor], ckpt_dir: Path
) -> float:
    """Load ``ckpt_dir`` with stock DCP into ``into`` and compare; raise if anything differs."""
    start = time.perf_counter()
    for t in into.values():
        t.fill_(float("nan"))
    load(into, storage_reader=FileSystemReader(str(ckpt_dir)))
    bad = [k for k, t in state_dict.items() if not torch.equal(t, into[k])]
    if bad:
        raise AssertionError(
            f"{len(bad)} of {len(state_dict)} tensors differ from what was saved (first: {bad[0]})"
        )
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-root", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--tensor-mib", type=float, required=True)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--no-fsync", action="store_true")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    writer_kwargs = {"sync_files": False} if args.no_fsync else {}
    root = Path(args.ckpt_root)
    state_dict = build_state_dict(rank, args.count, args.tensor_mib)
    into = {k: torch.empty_like(t) for k, t in state_dict.items()}
    result: dict = {
        "world_size": world,
        "bytes_per_rank": sum(t.nbytes for t in state_dict.values()),
        "tensors_per_rank": len(state_dict),
        "module": FileSystemWriterAsync.__module__,
        "module_file": __import__(FileSystemWriterAsync.__module__, fromlist=["_"]).__file__,
        "first": None,
        "saves": [],
    }
    queue = AsyncCallsQueue()
    for i in range(args.saves + 1):
        ckpt_dir = root / f"save{i:02d}"
        blocking, finalized = save(state_dict, ckpt_dir, queue, writer_kwargs)
        try:
            verify_s = verify(state_dict, into, ckpt_dir)
        except Exception as e:  # reported as this implementation's failure, not a time
            raise RuntimeError(
                f"save {i}: the checkpoint does not load back with stock DCP: "
                f"{type(e).__name__}: {e}"
            ) from e
        per_rank = [None] * world
        dist.all_gather_object(per_rank, (blocking, finalized, verify_s))
        sample = {
            "blocking_s": [r[0] for r in per_rank],
            "finalized_s": [r[1] for r in per_rank],
            "verify_s": [r[2] for r in per_rank],
        }
        if i == 0:
            result["first"] = sample
        else:
            result["saves"].append(sample)
        if rank == 0:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
            tmp = Path(args.result + ".tmp")
            tmp.write_text(json.dumps(result, indent=1), encoding="utf-8")
            os.replace(tmp, args.result)
        # The next save's tensors differ from this one's (outside the timed region).
        for t in state_dict.values():
            t.view(-1)[0] = float(i + 1)
    queue.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
