"""The fresh processes of ``quicksave bench --recovery`` (the child side; :mod:`.recovery`
runs them with :func:`~quicksave_tools.bench.child.run_in_fresh_process`).

Kinds (``spec["kind"]``):

* ``save`` — trains the shape one step (AdamW's state exists), records every state
  tensor's digest (:func:`~.recovery_state.digests`), then saves step
  :data:`~.recovery_state.STEP` with every method: quicksave to a local folder and to
  ``s3://`` (``async_mode="disabled"``: committed when ``save()`` returns), DCP
  (``dcp.save``), torch_checkpointing, and quicksave with the memory tier
  (``MemoryTierConfig(every=1, keep=2)``), whose trainer then dies without closing
  (``os._exit``), as a crashed one does.
* ``restore`` — a fresh job: a model of other weights and an AdamW without state,
  restored by one method from a cold page cache (local folders evicted first), timed
  from the call to its return. ``pass="full"`` then reads every state tensor twice
  (digests: the bit-exact check); the first pass's extra time over the second counts
  bytes a lazy restore had not read yet (time to fully restored). ``pass="first_step"``
  runs a forward and backward before the restore (warming the kernels, so that their
  first-call costs do not count), then times the first training step after it and three
  steady ones (time to first step: the restore plus the first step's extra over the
  median steady step, at least zero).
* ``loops`` — one round of the loop part: training loops of ``steps`` steps, one after
  the other, each on a freshly built trainer: without checkpoints, with the floor copy
  (:mod:`.floor_cost`: memcpy + xxh3 of the state on a thread) or with the memory tier
  every ``every`` steps.
* ``floor`` — one floor of :mod:`.recovery_floors`.

A memory-tier method that the installed quicksave does not have reports itself
unavailable (``unavailable``), never failed.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import sys
import time
from typing import Any

import torch

from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState, OptimizerState
from quicksave_tools.bench.recovery_state import (
    STEP,
    cached_fraction,
    differences,
    digests,
    evict,
    nbytes,
    state_items,
    trainer,
)
from quicksave_tools.bench.savers import TORCH_CHECKPOINTING, Unavailable, make_saver

CHILD = (
    "import sys; from quicksave_tools.bench.recovery_child import child_main; "
    "sys.exit(child_main(sys.argv[1:]))"
)
QUICKSAVE_DISK = "quicksave-disk"
# the same checkpoint restored all at once (no streamed optimizer state): what the
# stream costs or saves the first step, side by side
QUICKSAVE_DISK_WHOLE = "quicksave-disk-whole"
QUICKSAVE_OBJECT_STORE = "quicksave-object-store"
QUICKSAVE_MEMORY = "quicksave-memory"
QUICKSAVE_PEER = "quicksave-peer"  # two ranks: :mod:`.recovery_peer`
DCP = "dcp"
METHODS = (QUICKSAVE_DISK, QUICKSAVE_DISK_WHOLE, QUICKSAVE_MEMORY, QUICKSAVE_PEER,
           QUICKSAVE_OBJECT_STORE, DCP, TORCH_CHECKPOINTING)  # fmt: skip
LOCAL = (QUICKSAVE_DISK, QUICKSAVE_DISK_WHOLE, DCP, TORCH_CHECKPOINTING)  # evicted


def memory_config(folder: str, every: int, interval: int, **memory: Any) -> CheckpointConfig:
    """A configuration with the memory tier every ``every`` steps (and the folder every
    ``interval`` steps; ``memory``: more of ``MemoryTierConfig``, as its root or
    replicas), or :class:`Unavailable` if this quicksave has no such memory tier."""
    try:
        from quicksave.manager import MemoryTierConfig  # type: ignore[attr-defined]

        tier = MemoryTierConfig(every=every, keep=2, **memory)
        return CheckpointConfig(  # type: ignore[call-arg]
            folder=folder, interval=interval, memory=tier, stream_load=True
        )
    except (ImportError, TypeError) as e:
        raise Unavailable(f"this quicksave has no memory tier ({type(e).__name__}: {e})") from e


def _storage(spec: dict[str, Any]) -> Any:
    import quicksave

    if "endpoint_url" not in spec:
        return quicksave.StorageOptions()
    s3 = quicksave.S3Options(endpoint_url=spec["endpoint_url"], region=spec["region"])
    return quicksave.StorageOptions(s3=s3)  # credentials: the AWS chain (this env)


def states_of(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}


def _start(spec: dict[str, Any]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    # A one-rank gloo group, as in the training benchmark: DCP and torch_checkpointing
    # run in the same setting as quicksave.
    os.makedirs(spec["work"], exist_ok=True)
    store = dist.FileStore(os.path.join(spec["work"], f".store-{os.getpid()}"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


# -------------------------------------------------------------------------------- save
def _save_one(method: str, spec: dict[str, Any], states: dict[str, Any], keep: list) -> None:
    where = spec["locations"][method]
    if method == QUICKSAVE_DISK_WHOLE:
        if QUICKSAVE_DISK not in spec["methods"]:
            raise Unavailable(f"restores the {QUICKSAVE_DISK} checkpoint: run that method too")
        return  # saved as quicksave-disk (the same location)
    if method in (QUICKSAVE_DISK, QUICKSAVE_OBJECT_STORE):
        config = CheckpointConfig(folder=where, interval=1, async_mode="disabled",
                                  storage=_storage(spec) if method == QUICKSAVE_OBJECT_STORE
                                  else _storage({}))  # fmt: skip
        manager = CheckpointManager(config, states)
        try:
            manager.save(STEP)
        finally:
            manager.close()
    elif method == QUICKSAVE_MEMORY:
        manager = CheckpointManager(memory_config(where, every=1, interval=10**9), states)
        manager.save(STEP)
        manager.wait()
        keep.append(manager)  # never closed: this trainer dies (see child_main)
    else:
        saver = make_saver("dcp.save" if method == DCP else method, where, states, 1)
        try:
            saver.save(STEP)
            saver.finish()
        finally:
            saver.close()


def run_save(spec: dict[str, Any], keep: list) -> dict[str, Any]:
    _start(spec)
    model, optim, steps = trainer(spec, seed=spec["seed"])
    steps.step()  # AdamW's state exists from here on
    states = states_of(model, optim)
    items = state_items(model, optim)
    result: dict[str, Any] = {
        "bytes": nbytes(items),
        "tensors": len(items),
        "digests": digests(model, optim),
        "saves": {},
    }
    del items
    for method in spec["methods"]:  # the memory tier last: its trainer dies after it
        gc.collect()
        t0 = time.perf_counter()
        try:
            _save_one(method, spec, states, keep)
            result["saves"][method] = {"seconds": time.perf_counter() - t0}
        except Unavailable as e:
            result["saves"][method] = {"unavailable": str(e)}
        except Exception as e:  # noqa: BLE001 - one method's failure is reported
            result["saves"][method] = {"failed": f"{type(e).__name__}: {e}"[:400]}
    if QUICKSAVE_DISK_WHOLE in result["saves"] and QUICKSAVE_DISK in result["saves"]:
        result["saves"][QUICKSAVE_DISK_WHOLE] = result["saves"][QUICKSAVE_DISK]  # one save
    return result


# ----------------------------------------------------------------------------- restore
def quicksave_restore(
    config: CheckpointConfig, states: dict[str, Any], keep: list | None
) -> dict[str, Any]:
    """A fresh manager of ``config`` loads the newest step into ``states``, timed.
    ``keep``: the manager is kept there unclosed (this job dies too: its node memory
    stays for the next job); None: ``out["close"]`` closes it."""
    t0 = time.perf_counter()
    manager = CheckpointManager(config, states)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    loaded = manager.load()
    out: dict[str, Any] = {"restore_s": time.perf_counter() - t0, "setup_s": setup}
    last = getattr(manager, "last_load", None)
    if last is not None:
        out["tier"] = getattr(last, "tier", None)
        out["tier_seconds"] = getattr(last, "seconds", None)
        out["last_load"] = last  # (popped: restored_s, once streamed states are in)
    if keep is not None:
        keep.append(manager)
    else:
        out["close"] = manager.close
    if loaded != STEP:
        raise RuntimeError(f"the fresh manager loaded step {loaded}, not {STEP}")
    return out


def _restore_one(
    method: str, spec: dict[str, Any], states: dict[str, Any], keep: list
) -> dict[str, Any]:
    where = spec["locations"][method]
    if method in (QUICKSAVE_DISK, QUICKSAVE_DISK_WHOLE, QUICKSAVE_OBJECT_STORE, QUICKSAVE_MEMORY):
        if method == QUICKSAVE_MEMORY:
            config = memory_config(where, every=1, interval=10**9)
        else:
            stream = method != QUICKSAVE_DISK_WHOLE
            config = CheckpointConfig(
                folder=where, interval=1, storage=_storage(spec), stream_load=stream
            )
        crashes = method == QUICKSAVE_MEMORY and spec.get("crash")
        try:
            return quicksave_restore(config, states, keep if crashes else None)
        except RuntimeError as e:
            raise RuntimeError(f"{method}: {e}") from e
    saver = make_saver("dcp.save" if method == DCP else method, where, states, 1)
    try:
        times = saver.restore_fresh(STEP, states)
    finally:
        saver.close()
    return {"restore_s": times["load_s"], "setup_s": times.get("setup_s", 0.0)}


def _timed_digests(model: torch.nn.Module, optim: torch.optim.Optimizer) -> tuple[dict, float]:
    t0 = time.perf_counter()
    d = digests(model, optim)
    return d, time.perf_counter() - t0


def fresh_job(spec: dict[str, Any], seed: int) -> tuple[torch.nn.Module, Any, Any]:
    """A restore's fresh job: a model of other weights (``seed``), an AdamW without
    state; on the ``first_step`` pass its kernels warmed by a forward and backward (so
    that their first-call costs do not count)."""
    model, optim, steps = trainer(spec, seed=seed)
    if spec["pass"] == "first_step":
        steps.forward_backward()
        optim.zero_grad(set_to_none=True)
    return model, optim, steps


def after_restore(
    spec: dict[str, Any], result: dict[str, Any], out: dict[str, Any], job: tuple
) -> dict[str, Any]:
    """``result`` with the restore's figures (``out``: :func:`quicksave_restore`'s) and
    its pass measured on ``job`` (:func:`fresh_job`'s): ``full``, the bit-exact check and
    time to fully restored; ``first_step``, time to first step (module doc)."""
    model, optim, steps = job
    close = out.pop("close", None)
    last = out.pop("last_load", None)
    result.update(out)
    if spec["pass"] == "full":
        optim.state_dict()  # a streamed resume: waits for the optimizers' states
        streamed = getattr(last, "restored_s", None)
        result["streamed_restored_s"] = streamed
        got, first = _timed_digests(model, optim)
        again, second = _timed_digests(model, optim)
        result["read_all_s"] = [first, second]
        result["fully_restored_s"] = max(
            result["restore_s"] + max(0.0, first - second), streamed or 0.0
        )
        wrong = differences(spec["expected"], got)
        result["bit_exact"] = not wrong and got == again
        result["wrong"] = wrong[:5]
    else:
        t0 = time.perf_counter()
        steps.step()
        first = time.perf_counter() - t0
        steady = []
        for _ in range(3):
            t0 = time.perf_counter()
            steps.step()
            steady.append(time.perf_counter() - t0)
        result["first_step_s"] = first
        result["steady_step_s"] = statistics.median(steady)
        result["first_step_extra_s"] = first - result["steady_step_s"]
        # a first step faster than a steady one is noise, not a restore that saved time
        extra = max(0.0, result["first_step_extra_s"])
        result["time_to_first_step_s"] = result["restore_s"] + extra
    if close is not None:
        close()
    return result


def run_restore(spec: dict[str, Any], keep: list) -> dict[str, Any]:
    _start(spec)
    method = spec["method"]
    job = fresh_job(spec, seed=spec["seed"] + 1)
    states = states_of(*job[:2])
    result: dict[str, Any] = {"method": method, "pass": spec["pass"]}
    if method in LOCAL or method == QUICKSAVE_MEMORY:
        evict(spec["locations"][method])
        result["cached_before"] = cached_fraction(spec["locations"][method])
    gc.collect()
    try:
        out = _restore_one(method, spec, states, keep)
    except Unavailable as e:
        return {**result, "unavailable": str(e)}
    return after_restore(spec, result, out, job)


# -------------------------------------------------------------------------------- loop
def run_loop(spec: dict[str, Any], keep: list) -> dict[str, Any]:
    """One loop (``variant``: ``none``, ``floor`` or ``memory``, every ``every`` steps)."""
    from quicksave_tools.bench.floor_cost import run_loop as floor_loop

    torch.set_num_threads(spec["threads"])
    variant, every, steps = spec["variant"], spec["every"], spec["steps"]
    if variant in ("none", "floor"):
        r = floor_loop(spec["shape"], steps, every, variant == "floor", bool(spec.get("quick")))
        return {"loop_s": r["loop_s"], "bytes": r["bytes"]}
    from quicksave_tools.bench.training_loop import build_trainer

    model, optim, step = build_trainer({"shape": spec["shape"], "seed": 0,
                                        "quick": bool(spec.get("quick"))})  # fmt: skip
    step()
    config = memory_config(spec["folder"], every=every, interval=10**9)
    manager = CheckpointManager(config, states_of(model, optim))
    # Untimed: the first snapshots build the tier's buffers (as the floor's buffer is
    # allocated untimed). A snapshot takes a new buffer only while none is free, so the
    # last one may be built a snapshot or two after the others (a commit, or the
    # retention that frees a buffer, that lags a step): two snapshots more than buffers.
    warm = every * (getattr(manager.memory_tier, "buffers", 1) + 2)
    try:
        for s in range(1, warm + 1):
            step()
            manager.save(s)
        manager.wait()
        t0 = time.perf_counter()
        for s in range(warm + 1, warm + steps + 1):
            step()
            manager.save(s)
        manager.wait()
        return {"loop_s": time.perf_counter() - t0}
    finally:
        manager.close()


def run_loops(spec: dict[str, Any], keep: list) -> dict[str, Any]:
    """One round of a shape's loops (``spec["variants"]``: ``[name, variant, every]``),
    one after the other in this process, each from a freshly built trainer; a loop that
    fails is reported as failed, the others still run. An untimed loop first: the
    process's first training steps pay one-time costs that would fall on whichever loop
    runs first."""
    run_loop({**spec, "variant": "none", "every": 1, "steps": 2}, keep)
    gc.collect()
    runs: dict[str, Any] = {}
    for name, variant, every in spec["variants"]:
        folder = os.path.join(spec["work"], f"loop-{name}")
        try:
            runs[name] = run_loop({**spec, "variant": variant, "every": every,
                                   "folder": folder}, keep)  # fmt: skip
        except Unavailable:
            raise
        except Exception as e:  # noqa: BLE001 - one loop's failure is reported
            runs[name] = {"failed": f"{type(e).__name__}: {e}"[:400]}
        finally:
            shutil.rmtree(folder, ignore_errors=True)
            gc.collect()
    return {"runs": runs}


# -------------------------------------------------------------------------------- entry
def _run(spec: dict[str, Any], keep: list) -> dict[str, Any]:
    kind = spec["kind"]
    if kind == "floor":
        from quicksave_tools.bench.recovery_floors import FLOORS

        torch.set_num_threads(spec["threads"])
        return FLOORS[spec["floor"]](spec)
    run = {"save": run_save, "restore": run_restore, "loops": run_loops}[kind]
    try:
        return run(spec, keep)
    except Unavailable as e:
        return {"unavailable": str(e)}


def child_main(argv: list[str]) -> int:
    """Entry point of one fresh process (``python -c CHILD spec.json``). A process that
    holds a memory-tier manager (``keep``) ends with ``os._exit``, unclosed: a crashed
    trainer, whose snapshot the node's memory keeps for the next job."""
    from quicksave_tools.bench.child import child_entry

    keep: list = []
    rc = child_entry(argv, lambda spec: _run(spec, keep))
    if keep:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc
