"""Restore into a fresh job, each restore in a new process: quicksave (manager.load(),
default CheckpointConfig), quicksave before issue 20 point 9 (same, older source tree
on PYTHONPATH), dcp.load and torch_checkpointing, on the training benchmark's shapes.

    git archive <commit before the change> src | tar -x -C /tmp/old
    python docs/bench-runs/fresh_restore.py run --shapes mlp,transformer,embedding \
        --repeats 3 --before /tmp/old/src --out result.json

(``QUICK=1`` builds the shapes' tiny versions: a smoke run.)

The writer process trains one step (AdamW state exists) and saves the same state with
each library; every restore process builds the model with other weights and an AdamW
without state, restores, and checks every tensor against the writer's xxh3 digests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

METHODS = ("quicksave", "quicksave-before", "dcp.load", "torch_checkpointing")


def _job(shape: str, seed: int) -> tuple[Any, Any, dict[str, Any]]:
    import torch

    from quicksave.bench.shapes import build
    from quicksave.manager import ModelState, OptimizerState

    torch.set_num_threads(2)
    model, batches, loss_fn = build(shape, seed, bool(os.environ.get("QUICK")))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    states = {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}
    return model, (optim, batches, loss_fn), states


def _digests(states: dict[str, Any]) -> dict[str, str]:
    import torch
    import xxhash
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict({k: v.state_dict() for k, v in states.items()})
    out = {}
    for k, v in flat.items():
        if isinstance(v, torch.Tensor):
            b = v.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            out[k] = f"{v.dtype}:{tuple(v.shape)}:{xxhash.xxh3_64_hexdigest(b)}"
        else:
            out[k] = repr(v)
    return out


def _tc_manager() -> Any:
    from torch_checkpointing import CheckpointManager as TcManager
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    storage = LocalFileSystemStorageConfig(use_direct_io=False)
    return TcManager(TcManager.Config(storage_config=storage))


def write(shape: str, root: str) -> None:
    import torch.distributed.checkpoint as dcp

    from quicksave.manager import CheckpointConfig, CheckpointManager

    model, (optim, batches, loss_fn), states = _job(shape, 0)
    x, y = batches[0]
    optim.zero_grad()
    loss_fn(model(x), y).backward()
    optim.step()
    with CheckpointManager(
        CheckpointConfig(folder=os.path.join(root, "qs"), interval=1, async_mode="disabled"),
        states,
    ) as manager:
        manager.save(1)
    sd = {k: v.state_dict() for k, v in states.items()}
    dcp.save(sd, checkpoint_id=os.path.join(root, "dcp"))
    tc = _tc_manager()
    tc.save(os.path.join(root, "tc"), sd).result()
    tc.close()
    with open(os.path.join(root, "digests.json"), "w") as f:
        json.dump(_digests(states), f)


def restore(shape: str, root: str, method: str) -> dict[str, Any]:
    import gc

    import torch.distributed.checkpoint as dcp

    model, (optim, _, _), states = _job(shape, 1)
    gc.collect()
    out: dict[str, Any] = {"setup_s": 0.0}
    if method.startswith("quicksave"):
        from quicksave.manager import CheckpointConfig, CheckpointManager

        t0 = time.perf_counter()
        manager = CheckpointManager(
            CheckpointConfig(folder=os.path.join(root, "qs"), interval=1), states
        )
        t1 = time.perf_counter()
        step = manager.load()
        t2 = time.perf_counter()
        manager.close()
        assert step == 1, step
        out.update(setup_s=t1 - t0, load_s=t2 - t1)
    elif method == "dcp.load":
        t0 = time.perf_counter()
        dcp.load(states, checkpoint_id=os.path.join(root, "dcp"))
        out["load_s"] = time.perf_counter() - t0
    else:
        t0 = time.perf_counter()
        tc = _tc_manager()
        t1 = time.perf_counter()
        into = {name: s.state_dict() for name, s in states.items()}
        loaded = tc.load(os.path.join(root, "tc"), into=into)
        for name, s in states.items():
            s.load_state_dict(loaded[name])
        t2 = time.perf_counter()
        tc.close()
        out.update(setup_s=t1 - t0, load_s=t2 - t1)
    with open(os.path.join(root, "digests.json")) as f:
        want = json.load(f)
    got = _digests(states)
    bad = sorted(k for k in want if got.get(k) != want[k])
    out["values_equal"] = not bad and set(got) == set(want)
    out["differ"] = bad[:5]
    return out


def _child(args: list[str], env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, env=env, timeout=1800
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{args} failed: {proc.stderr[-3000:]}")
    return proc.stdout


def run(shapes: list[str], repeats: int, before: str | None, base: str) -> dict[str, Any]:
    import statistics

    results: dict[str, Any] = {}
    methods = [m for m in METHODS if before or m != "quicksave-before"]
    for shape in shapes:
        root = os.path.join(base, shape)
        os.makedirs(root, exist_ok=True)
        _child(["write", shape, root])
        runs: dict[str, list[dict]] = {m: [] for m in methods}
        for r in range(repeats):
            order = methods[r % len(methods) :] + methods[: r % len(methods)]
            for method in order:
                env = dict(os.environ)
                if method == "quicksave-before":
                    env["PYTHONPATH"] = before + os.pathsep + env.get("PYTHONPATH", "")
                res = json.loads(_child(["restore", shape, root, method], env).splitlines()[-1])
                runs[method].append(res)
                print(shape, method, res, file=sys.stderr, flush=True)
        import shutil

        shutil.rmtree(root, ignore_errors=True)
        results[shape] = {
            m: {
                "load_s": [round(x["load_s"], 3) for x in rs],
                "setup_s": [round(x["setup_s"], 3) for x in rs],
                "load_median_s": round(statistics.median(x["load_s"] for x in rs), 3),
                "values_equal": all(x["values_equal"] for x in rs),
            }
            for m, rs in runs.items()
        }
    return results


def main() -> None:
    if sys.argv[1] == "write":
        write(sys.argv[2], sys.argv[3])
        return
    if sys.argv[1] == "restore":
        import warnings

        warnings.filterwarnings("ignore")
        print(json.dumps(restore(sys.argv[2], sys.argv[3], sys.argv[4])))
        return
    p = argparse.ArgumentParser()
    p.add_argument("cmd")
    p.add_argument("--shapes", default="mlp,transformer,embedding")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--before")
    p.add_argument("--dir", default="/tmp/fresh-restore")
    p.add_argument("--out")
    a = p.parse_args()
    t0 = time.time()
    res = run(a.shapes.split(","), a.repeats, a.before, a.dir)
    doc = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "wall_s": round(time.time() - t0, 1),
        "loadavg_end": os.getloadavg(),
        "cpus": os.cpu_count(),
        "results": res,
    }
    text = json.dumps(doc, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
