"""The peer restore of ``quicksave bench --recovery`` (``quicksave-peer``), the child
side: two ranks of one gloo group (a ``FileStore``), each its own "node" (its own
memory root, ``ranks_per_node=1``), the memory tier with one peer replica
(``MemoryTierConfig(replicas=1)``). :mod:`.recovery` runs both ranks side by side.

Kinds (``spec["kind"]``):

* ``peer_save`` — rank ``r`` trains the shape one step from seed ``seed + r`` (the two
  ranks hold different bytes, so that a rank given the other's state is caught), saves
  step :data:`~.recovery_state.STEP` to node memory and waits until its snapshot and
  the peer's replica are through (``manager.wait()``); reports its digests, its
  snapshot's bytes and what the replication sent; then dies unclosed (``os._exit``),
  as a crashed trainer: the node memory and its agent stay.
* ``peer_restore`` — both ranks of a fresh job (models of other weights) restore after
  the driver removed node 1's memory (a replaced node): rank 0 reads its own memory,
  rank 1 fetches its snapshot from rank 0's replica (``manager.last_load.tier ==
  "peer"``). Rank 1 is measured as any restore (:func:`~.recovery_child.after_restore`:
  time to fully restored and bit-exact check, or time to first step); rank 0 loads,
  then waits, idle, until rank 1 is done, so that it takes no CPU from the measurement.
  Both die unclosed too; the driver kills the agents at the end.

Rank 0, the holder, trains the shape's quick variant (its own state a few MB; the
replica it holds and serves is rank 1's whole state): its own restore from memory,
which runs while it serves, is the memory tier's and not the peer path's, and on a
cluster it runs on the holder's node's cores; on this machine's two cores it would
take them from the transfer measured (a 1.6 GB restore of its own beside the serving
made rank 1's restore up to 2x slower in one run of 2026-12-02).
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
import time
from typing import Any

import torch.distributed as dist

from quicksave.manager import CheckpointConfig, CheckpointManager
from quicksave_tools.bench.recovery_child import (
    after_restore,
    fresh_job,
    memory_config,
    quicksave_restore,
    states_of,
)
from quicksave_tools.bench.recovery_state import STEP, digests, files_under, nbytes, state_items
from quicksave_tools.bench.recovery_state import trainer as make_trainer
from quicksave_tools.bench.savers import Unavailable

PEER_CHILD = (
    "import sys; from quicksave_tools.bench.recovery_peer import child_main; "
    "sys.exit(child_main(sys.argv[1:]))"
)
_DONE = "rank-1-done"


def peer_config(spec: dict[str, Any]) -> CheckpointConfig:
    """This rank's configuration: its node's memory root, one replica on the other node
    (the folder's interval far away: only node memory holds the step)."""
    return memory_config(
        spec["folder"],
        every=1,
        interval=10**9,
        root=spec["node_roots"][spec["rank"]],
        job_id=spec["job_id"],
        idle_timeout_s=spec["idle_timeout_s"],
        replicas=1,
        ranks_per_node=1,
    )


def _own_shape(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec of this rank's own state: rank 0 (the holder) the quick variant
    (module doc)."""
    return {**spec, "quick": True} if spec["rank"] == 0 else spec


def _join(spec: dict[str, Any]) -> dist.Store:
    import torch

    torch.set_num_threads(spec["threads"])
    store = dist.FileStore(spec["store"], 2)
    timeout = datetime.timedelta(seconds=spec["timeout_s"])
    dist.init_process_group("gloo", store=store, rank=spec["rank"], world_size=2, timeout=timeout)
    return store


def run_peer_save(spec: dict[str, Any], keep: list) -> dict[str, Any]:
    _join(spec)
    rank = spec["rank"]
    config = peer_config(spec)
    model, optim, steps = make_trainer(_own_shape(spec), seed=spec["seed"] + rank)
    steps.step()  # AdamW's state exists from here on
    items = state_items(model, optim)
    result: dict[str, Any] = {"rank": rank, "bytes": nbytes(items), "tensors": len(items)}
    del items
    result["digests"] = digests(model, optim)
    gc.collect()
    manager = CheckpointManager(config, states_of(model, optim))
    keep.append(manager)  # never closed: this trainer dies (see child_main)
    t0 = time.perf_counter()
    manager.save(STEP)
    manager.wait()  # the snapshot, and its replica on the other node
    result["seconds"] = time.perf_counter() - t0
    tier = manager.memory_tier
    snapshot = tier.path(STEP)
    result["snapshot"] = snapshot
    result["snapshot_bytes"] = sum(os.path.getsize(p) for p in files_under(snapshot))
    replicas = tier.replicas
    result["replicated"] = [
        {"step": s.step, "sent": s.sent, "received": s.received, "seconds": s.seconds}
        for s in replicas.log
    ]
    result["held"] = {str(k): v for k, v in replicas.held().items()}
    if replicas.error is not None:
        result["failed"] = f"rank {rank}: replication failed: {replicas.error}"
    dist.barrier()  # both replicas through before either trainer dies
    return result


def run_peer_restore(spec: dict[str, Any], keep: list) -> dict[str, Any]:
    store = _join(spec)
    rank = spec["rank"]
    job = fresh_job(_own_shape(spec), seed=spec["seed"] + 100 + rank)
    states = states_of(*job[:2])
    result: dict[str, Any] = {"method": spec["method"], "pass": spec["pass"], "rank": rank}
    gc.collect()
    dist.barrier()  # both jobs built: the restore starts together
    if rank == 0:
        out = quicksave_restore(peer_config(spec), states, keep)
        job[1].state_dict()  # a streamed resume: its optimizer's state in place
        store.wait([_DONE], datetime.timedelta(seconds=spec["timeout_s"]))
        return {**result, "tier": out.get("tier"), "restore_s": out["restore_s"]}
    try:
        out = quicksave_restore(peer_config(spec), states, keep)
        return after_restore(spec, result, out, job)
    finally:
        store.set(_DONE, "1")


def child_main(argv: list[str]) -> int:
    """Entry point of one rank's process (``python -c PEER_CHILD spec.json``); it ends
    with ``os._exit``, its manager unclosed (a crashed trainer: see the module doc)."""
    from quicksave_tools.bench.child import child_entry

    keep: list = []
    kinds = {"peer_save": run_peer_save, "peer_restore": run_peer_restore}

    def run(spec: dict[str, Any]) -> dict[str, Any]:
        try:
            return kinds[spec["kind"]](spec, keep)
        except Unavailable as e:
            return {"unavailable": str(e)}

    rc = child_entry(argv, run)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
