"""Two writing managers on one folder in one process: the second is read-only, and its
reason says that the holder is this process (another manager in it), not "another
live process" naming our own pid; a manager in another process still gets that."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from quicksave.errors import CheckpointError
from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState


def _manager(folder: Path) -> CheckpointManager:
    config = CheckpointConfig(folder=str(folder), interval=1, async_mode="disabled")
    return CheckpointManager(config, {"model": ModelState(torch.nn.Linear(2, 2))})


def test_a_second_manager_in_this_process_is_told_that_this_process_holds_the_lease(
    tmp_path: Path,
) -> None:
    first = _manager(tmp_path / "ckpt")
    second = _manager(tmp_path / "ckpt")
    try:
        reason = second.read_only_reason
        assert reason is not None
        prefix = f"this process (pid {os.getpid()} on host {socket.gethostname()!r} since "
        assert reason.startswith(prefix), reason
        assert reason.endswith(
            ") holds the folder's writer lease already: another manager in this process "
            "writes to this folder; close() that one first, use another folder, or build "
            "this one read-only to only load"
        ), reason
        with pytest.raises(CheckpointError) as info:
            second.save(1)
        assert info.value.message == f"this manager does not write checkpoints: {reason}"
    finally:
        second.close()
        first.close()
    third = _manager(tmp_path / "ckpt")  # once the first is closed, the folder is free
    try:
        assert third.read_only_reason is None
        assert third.save(1)
    finally:
        third.close()


def test_a_manager_in_another_process_still_names_that_process(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, torch
                from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState
                m = CheckpointManager(
                    CheckpointConfig(folder={str(tmp_path / "ckpt")!r}, async_mode="disabled"),
                    {{"model": ModelState(torch.nn.Linear(2, 2))}},
                )
                assert m.read_only_reason is None
                print("held", flush=True)
                sys.stdin.read()  # until the test closes our stdin
                m.close()
                """
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        manager = _manager(tmp_path / "ckpt")
        reason = manager.read_only_reason
        manager.close()
        assert reason is not None
        assert reason.startswith(
            f"another live process holds the folder's writer lease (pid {holder.pid} on host "
        ), reason
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        assert holder.wait(timeout=120) == 0
