"""Per-thread CPU of a training process with a quicksave saver (docs/benchmarks.md, issue 28).

Usage: PYTHONPATH=<src> python thread_probe.py process|none [hidden]; DIST=1 adds a one-rank
gloo group, as `quicksave bench --training` has. Trains an MLP of 8 x hidden^2 with AdamW for
30 steps, a save every 5; prints the step median, the sum, and each thread's CPU seconds.
"""
import os, sys, time, json, tempfile, threading, statistics as st
import torch
torch.set_num_threads(2)
from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState, OptimizerState
from quicksave_tools.bench.shapes import mlp

def thread_cpu():
    out = {}
    names = {t.native_id: t.name for t in threading.enumerate()}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        comm = open(f"/proc/self/task/{tid}/comm").read().strip()
        out[int(tid)] = (names.get(int(tid), comm), (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK"))
    return out

hidden = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
model = mlp(hidden, 8, 0)
optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(32, hidden); y = torch.randn(32, hidden)
folder = tempfile.mkdtemp(dir=os.environ.get("TMPDIR", "/tmp"))
mode = sys.argv[1]
import torch.distributed as dist
if os.environ.get("DIST"):
    dist.init_process_group("gloo", store=dist.FileStore(folder + "/.store", 1), rank=0, world_size=1)
mgr = None
if mode != "none":
    mgr = CheckpointManager(CheckpointConfig(folder=folder, interval=5, async_mode="process", staging="overlap"),
                            {"model": ModelState(model), "optim": OptimizerState(model, optim)})
steps = []
c0 = time.process_time(); t00 = thread_cpu()
for step in range(1, 31):
    t0 = time.perf_counter()
    optim.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optim.step()
    steps.append(time.perf_counter() - t0)
    if mgr is not None:
        mgr.save(step)
if mgr: mgr.close()
c1 = time.process_time(); t1 = thread_cpu()
print(mode, "steps med", round(st.median(steps), 3), "sum", round(sum(steps), 2), "cpu", round(c1 - c0, 2))
for tid, (name, cpu) in sorted(t1.items(), key=lambda kv: -(kv[1][1] - t00.get(kv[0], ("", 0))[1])):
    d = cpu - t00.get(tid, ("", 0))[1]
    if d > 0.05: print("   ", name, round(d, 2))
after = []
for _ in range(6):
    t0 = time.perf_counter()
    optim.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optim.step()
    after.append(time.perf_counter() - t0)
c2 = time.process_time()
print("   after close: med", round(st.median(after), 3), "cpu", round(c2 - c1, 2), "threads", [t.name for t in threading.enumerate()])
t2 = thread_cpu()
for tid, (name, cpu) in t2.items():
    d = cpu - t1.get(tid, ("", 0))[1]
    if d > 0.02: print("     ", name, round(d, 2))
import shutil; shutil.rmtree(folder)
