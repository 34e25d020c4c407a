"""A child for the writer-lease tests: builds a writing CheckpointManager on an
object-store folder (S3 settings from the environment), prints ``holding`` once it holds
the folder's writer lease, then waits to be killed (SIGKILL by the test).

Usage: python lease_holder.py FOLDER EXPIRY_S RENEW_S MACHINE
MACHINE: ``here`` (this process as it is) or ``elsewhere`` (the lease names a process
of another machine, so that its death can only be learnt from the lease's expiry).
"""

from __future__ import annotations

import sys
import time

import torch

from quicksave.manager import CheckpointConfig, CheckpointManager, store_lease
from quicksave.storage import StorageOptions


def main(folder: str, expiry_s: float, renew_s: float, machine: str) -> None:
    if machine == "elsewhere":
        store_lease.this_process = lambda: store_lease.Holder("elsewhere", 4242, "b00t", 7, 99)
    storage = StorageOptions(lease_expiry_s=expiry_s, lease_renew_s=renew_s)
    config = CheckpointConfig(folder=folder, async_mode="disabled", storage=storage)
    manager = CheckpointManager(config, {"model": torch.nn.Linear(4, 4)})
    if manager.read_only_reason is not None:
        raise SystemExit(f"no lease: {manager.read_only_reason}")
    print("holding", flush=True)
    while True:
        time.sleep(1.0)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4])
