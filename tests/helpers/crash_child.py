"""Fork server for the crash test (tests/test_commit.py).

Started once as a subprocess (importing torch costs seconds, paying it once keeps the
test fast). Protocol, one line each way:

    server -> test: "ready"
    test -> server: "go <root> <first_step> <crash_point>"
    server -> test: "pid <pid>"   (a forked saver: saves step-<first_step>, step-<first_step+1>, ...
                                    printing "saved <step>" after each, until killed)
    server -> test: "exited <status>"

``crash_point`` is ``none`` (the test kills the saver at a random moment) or the name of a
point where the saver SIGKILLs itself: ``before-manifest``, ``before-rename``,
``after-rename``.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

import quicksave
from quicksave.commit import files as commit
from quicksave.commit import rename
from quicksave.storage import posix_io

NUMEL = 256 * 1024  # 1 MiB per float32 tensor


def state_for(step: int) -> dict:
    """Deterministic state of a given step, a few MiB."""
    base = torch.arange(NUMEL, dtype=torch.float32)
    return {
        "model": {
            "w": base + step,
            "v": (base * step).to(torch.bfloat16),
            "b": torch.full((NUMEL // 2,), step, dtype=torch.int64),
        },
        "step": step,
        "tag": f"step-{step}",
    }


def _die(*_args, **_kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(crash_point: str) -> None:
    if crash_point == "before-manifest":
        real_write = posix_io.write_durable

        def write_durable(path: str, data: bytes) -> None:
            if path.endswith("manifest.json"):
                _die()
            real_write(path, data)

        posix_io.write_durable = write_durable
    elif crash_point == "before-rename":
        commit.publish = _die
    elif crash_point == "after-rename":
        real_publish = commit.publish

        def publish(tmp: str, final: str, expected: dict[str, int], **kwargs) -> None:
            real_publish(tmp, final, expected, **kwargs)
            _die()

        commit.publish = publish
    # the rename commit looks these up at call time
    assert rename.files is commit and rename.posix_io is posix_io


def _saver(root: str, first: int, crash_point: str) -> None:
    _arm(crash_point)
    for step in range(first, first + 500):
        quicksave.save(state_for(step), os.path.join(root, f"step-{step}"), step=step)
        # One write: print() sends the text and the newline separately, and a SIGKILL
        # between them glued "saved N" to the server's next line.
        sys.stdout.write(f"saved {step}\n")
        sys.stdout.flush()
    os._exit(0)


def main() -> None:
    print("ready", flush=True)
    for line in sys.stdin:
        _, root, first, crash_point = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                _saver(root, int(first), crash_point)
            finally:
                os._exit(3)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exited {status}", flush=True)


if __name__ == "__main__":
    main()
