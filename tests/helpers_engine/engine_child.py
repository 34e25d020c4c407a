"""Child trainers for the engine tests (run as ``python engine_child.py MODE ARGS``).

Modes:
    trainer DIR MIB   start an AsyncSaver (process mode), print "worker <pid>", start saving
                      MIB MiB to DIR/ckpt, print "saving", then wait forever (the test
                      SIGKILLs this process mid-save).
    atexit DIR MIB    save MIB MiB to DIR/ckpt (value 7.0) in process mode, print
                      "in_flight <n>", and exit without close(): the atexit handler must
                      commit the save.
    eacces DIR        (run without CAP_DAC_OVERRIDE) save DIR/a, make DIR read-only
                      (mode 0555), save DIR/b; print "error <type>|<message>" and "a-ok".
"""

from __future__ import annotations

import os
import sys
import time

import torch

from quicksave.errors import CheckpointError
from quicksave.saving.config import EngineConfig
from quicksave.saving.engine import AsyncSaver


def state(mib: int, value: float) -> dict[str, torch.Tensor]:
    numel = mib * 2**20 // 4 // 4
    return {f"w{i}": torch.full((numel,), value + i, dtype=torch.float32) for i in range(4)}


def main(argv: list[str]) -> None:
    mode, root = argv[0], argv[1]
    if mode == "trainer":
        saver = AsyncSaver(EngineConfig(mode="process"))
        print(f"worker {saver.worker_pid}", flush=True)
        saver.save(state(int(argv[2]), 1.0), os.path.join(root, "ckpt"), step=1)
        print("saving", flush=True)
        time.sleep(3600)
    elif mode == "atexit":
        saver = AsyncSaver(EngineConfig(mode="process"))
        saver.save(state(int(argv[2]), 7.0), os.path.join(root, "ckpt"), step=7)
        print(f"in_flight {saver.in_flight}", flush=True)
        # no close(): interpreter exit must finish the save
    elif mode == "eacces":
        saver = AsyncSaver(EngineConfig(mode="process"))
        saver.save(state(1, 1.0), os.path.join(root, "a"), step=1).wait(60)
        os.chmod(root, 0o555)
        try:
            saver.save(state(1, 2.0), os.path.join(root, "b"), step=2).wait(60)
            print("error none|saved", flush=True)
        except CheckpointError as e:
            print(f"error {type(e).__name__}|{e}", flush=True)
        finally:
            os.chmod(root, 0o755)
        out = {k: torch.zeros_like(v) for k, v in state(1, 0.0).items()}
        import quicksave

        quicksave.load(out, os.path.join(root, "a"))
        assert all(torch.equal(out[k], v) for k, v in state(1, 1.0).items())
        print("a-ok", flush=True)
        saver.close()
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv[1:])
