"""quicksave as torchtitan's checkpoint backend (``quicksave.integrations.torchtitan``).

A torchtitan-style job (tests/helpers/titan.py: torchtitan's optimizer, LR scheduler and
data loader containers, a tiny model sharded with FSDP2 on gloo CPU ranks) checkpoints
through ``QuicksaveCheckpointManager`` built from its ``Config`` as torchtitan's trainer
builds it. Checked:

- 2 ranks: a run interrupted after step 4 and resumed in fresh processes ends bit-exactly
  where an uninterrupted run does (parameters, optimizer state, LR scheduler, train
  state, data position and the next batch), through the async engine with overlapped
  staging; the folder is torchtitan's (``step-<N>``, keep_latest_k, a model-only last
  step) and every checkpoint verifies;
- 2 ranks -> 3 ranks: the full tensors after loading equal the saved ones (the data
  loader, per data-parallel rank, excluded as torchtitan requires; without that, every
  rank fails with the key named);
- one process: stock torchtitan meets a quicksave checkpoint (a clear error), resumes
  bit-exactly after ``quicksave convert --to dcp``; the backend resumes from a stock
  torchtitan checkpoint only with ``allow_dcp``; a model-only last step is refused as a
  training state; torchtitan's config system builds the backend;
- the example script under torchrun.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torchtitan  # noqa: F401  (pinned in the dev extra: missing, collection fails)
from torch.distributed.checkpoint import CheckpointException
from torchtitan.components.checkpointer import BaseCheckpointManager
from torchtitan.components.checkpointer import CheckpointManager as StockManager
from torchtitan.config import Configurable

from helpers import titan
from quicksave import StorageReader
from quicksave.errors import CheckpointError, CheckpointNotFoundError
from quicksave.integrations.torchtitan import QuicksaveCheckpointManager
from quicksave.loading.verify import verify_checkpoint
from quicksave.tools.convert import convert

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "multirank"))
from launcher import LaunchConfig, run_ranks

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = LaunchConfig(timeout_s=150.0, preload=("torch._dynamo",))


def _config(**kw: Any) -> QuicksaveCheckpointManager.Config:
    kw.setdefault("enable", True)
    kw.setdefault("folder", "checkpoint")
    kw.setdefault("interval", 2)
    kw.setdefault("keep_latest_k", 2)
    return QuicksaveCheckpointManager.Config(**kw)


# ------------------------------------------------------------------ 2 ranks: resume


def _first_run(rank: int, world: int, root: str) -> dict[str, Any]:
    """The uninterrupted reference (its own folder), then a run that stops after step 4
    (its checkpoints in ``root/run``)."""
    ref = titan.build(_config(async_mode="disabled"), os.path.join(root, "ref"))
    assert ref.checkpointer.load() is False
    titan.train(ref)
    reference = titan.fingerprint(ref)
    reference["next_batch"] = titan.next_batch_digest(ref)
    ref.checkpointer.close()

    job = titan.build(_config(async_mode="async_with_pinned_mem"), os.path.join(root, "run"))
    assert job.checkpointer.load() is False
    titan.train(job, until=4)
    at_4 = titan.fingerprint(job)
    job.checkpointer.close()  # waits for step 4's save; the "crash" comes after it
    kinds = [(r.step, r.kind, r.status) for r in job.checkpointer.metrics]
    return {"reference": reference, "at_4": at_4, "kinds": kinds}


def _resume(rank: int, world: int, root: str) -> dict[str, Any]:
    job = titan.build(_config(async_mode="async_with_pinned_mem"), os.path.join(root, "run"))
    assert job.checkpointer.load() is True
    resumed_at = job.train_state.step
    titan.train(job)
    out = titan.fingerprint(job)
    out["next_batch"] = titan.next_batch_digest(job)
    job.checkpointer.close()
    return {
        "resumed_at": resumed_at,
        "final": out,
        "steps": job.checkpointer.committed_steps(),
        "kinds": [(r.step, r.kind, r.status) for r in job.checkpointer.metrics],
    }


def _reshard(rank: int, world: int, root: str) -> dict[str, Any]:
    """3 ranks load the 2 ranks' step 4: first with the data loader (refused on every
    rank: rank 2 has no entry), then excluding it, as torchtitan requires."""
    folder = os.path.join(root, "run")
    job = titan.build(_config(load_step=4, load_only=True), folder)
    try:
        job.checkpointer.load(step=4)
    except CheckpointError as e:
        refused = str(e)
    else:
        refused = ""
    job.checkpointer.close()
    job = titan.build(_config(load_only=True, exclude_from_loading=["dataloader"]), folder)
    assert job.checkpointer.load(step=4) is True
    out = titan.fingerprint(job)
    job.checkpointer.close()
    return {"refused": refused, "loaded": out}


def _without_rank_local(fp: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fp.items() if k not in ("data_pos", "next_batch")}


@pytest.mark.slow
def test_resume_bit_exact_then_reshard_to_three_ranks(tmp_path: Path) -> None:
    first = run_ranks(_first_run, 2, str(tmp_path), config=LAUNCH)
    assert first[0]["kinds"] == [(2, "full", "committed"), (4, "full", "committed")]
    run = tmp_path / "run" / "checkpoint"
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step-")) == [
        "step-2",
        "step-4",
    ]

    second = run_ranks(_resume, 2, str(tmp_path), config=LAUNCH)
    for rank in (0, 1):
        assert second[rank]["resumed_at"] == 4
        assert second[rank]["final"] == first[rank]["reference"], f"rank {rank}"
    # the two ranks hold different data (their own streams), the same model
    assert second[0]["final"]["next_batch"] != second[1]["final"]["next_batch"]
    assert _without_rank_local(second[0]["final"]) == _without_rank_local(second[1]["final"])
    # step 6 is the last step: model-only (last_save_model_only), written synchronously;
    # keep_latest_k=2 deleted step 2
    assert second[0]["kinds"] == [(6, "export", "committed")]
    assert second[0]["steps"] == [4, 6]
    for step in (4, 6):
        report = verify_checkpoint(str(run / f"step-{step}"))
        assert report.ok, report
    manifest = StorageReader(run / "step-6").read_manifest()
    assert manifest.user_metadata["checkpoint_kind"] == "export"
    assert not any(k.startswith("optimizer") for k in manifest.tensors)

    third = run_ranks(_reshard, 3, str(tmp_path), config=LAUNCH)
    for rank in range(3):
        assert "dataloader.dp_rank_2" in third[rank]["refused"], third[rank]["refused"]
        assert "exclude_from_loading" in third[rank]["refused"]
        assert _without_rank_local(third[rank]["loaded"]) == _without_rank_local(
            first[0]["at_4"]
        ), f"rank {rank}"


# ------------------------------------------------------------------ one process


def _run_alone(config: Any, base: Path, until: int | None = None, steps: int = 6) -> titan.Job:
    job = titan.build(config, str(base), steps=steps)
    job.checkpointer.load()
    titan.train(job, until=until)
    return job


def test_stock_torchtitan_and_quicksave_convert_both_ways(tmp_path: Path) -> None:
    reference = _run_alone(_config(async_mode="disabled"), tmp_path / "ref")
    expected = titan.fingerprint(reference)
    reference.checkpointer.close()

    # quicksave writes steps 2 and 4 (async in a worker thread), then stops
    job = _run_alone(_config(async_mode="async", async_worker="thread"), tmp_path / "qs", 4)
    job.checkpointer.close()
    step4 = tmp_path / "qs" / "checkpoint" / "step-4"

    # stock torchtitan on that folder: the error names the format and what to do
    stock_cfg = StockManager.Config(enable=True, folder="checkpoint", keep_latest_k=0)
    stock = titan.build(stock_cfg, str(tmp_path / "qs"))
    with pytest.raises(CheckpointException) as info:  # a BaseException, as torch raises it
        stock.checkpointer.load()
    text = str(info.value)
    assert "this is a quicksave checkpoint (format v1: its index is manifest.json" in text
    assert "quicksave convert --to dcp" in text and f"path={step4}" in text, text

    # quicksave convert --to dcp: stock torchtitan resumes bit-exactly from it
    convert(str(step4), str(tmp_path / "dcp" / "checkpoint" / "step-4"), "dcp")
    stock = titan.build(stock_cfg, str(tmp_path / "dcp"))
    assert stock.checkpointer.load() is True and stock.train_state.step == 4
    titan.train(stock)
    assert titan.fingerprint(stock) == expected

    # ... and the other way: stock torchtitan's step 4 resumes in the backend, with
    # allow_dcp only (without it, the folder's stock checkpoints are named, not ignored)
    titan_dir = tmp_path / "dcp"
    refusing = titan.build(_config(async_mode="disabled"), str(titan_dir))
    with pytest.raises(CheckpointNotFoundError, match=r"steps \[4, 6\].*allow_dcp"):
        refusing.checkpointer.load()
    refusing.checkpointer.close()
    job = titan.build(_config(async_mode="disabled", allow_dcp=True), str(titan_dir))
    assert job.checkpointer.load(step=4) is True and job.train_state.step == 4
    titan.train(job)
    assert titan.fingerprint(job) == expected
    job.checkpointer.close()


def test_model_only_last_step_and_seed(tmp_path: Path) -> None:
    job = _run_alone(_config(async_mode="disabled", interval=10), tmp_path, steps=3)
    job.checkpointer.close()
    folder = tmp_path / "checkpoint"
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("step-")) == ["step-3"]
    again = titan.build(_config(async_mode="disabled", interval=10), str(tmp_path), steps=3)
    with pytest.raises(CheckpointError, match="holds the model only") as info:
        again.checkpointer.load()
    assert info.value.path == str(folder / "step-3")
    again.checkpointer.close()
    # a new run starts from its weights
    fresh = titan.build(
        _config(
            folder="other",
            initial_load_path=str(folder / "step-3"),
            initial_load_model_only=True,
        ),
        str(tmp_path),
        steps=3,
    )
    assert fresh.checkpointer.load() is True and fresh.train_state.step == 0
    for name, value in fresh.model.state_dict().items():
        assert torch.equal(value, job.model.state_dict()[name]), name
    fresh.checkpointer.close()

    # the seed: save(0, last_step=True) as torchtitan's create_seed_checkpoint does
    seed = titan.build(_config(folder="seeded"), str(tmp_path))
    assert seed.checkpointer.save(0, last_step=True) is True
    seed.checkpointer.close()
    resumed = titan.build(_config(folder="seeded"), str(tmp_path))
    assert resumed.checkpointer.load() is True and resumed.train_state.step == 0


def test_corrupt_newest_is_skipped_and_quarantined(tmp_path: Path) -> None:
    reference = _run_alone(_config(async_mode="disabled"), tmp_path / "ref", until=2)
    expected = titan.fingerprint(reference)
    expected["next_batch"] = titan.next_batch_digest(reference)
    reference.checkpointer.close()
    job = _run_alone(_config(async_mode="disabled", keep_latest_k=0), tmp_path, until=4)
    job.checkpointer.close()
    step4 = tmp_path / "checkpoint" / "step-4"
    manifest = StorageReader(step4).read_manifest()
    chunk = manifest.tensors["layers.1.w2.weight"].chunks[0]
    with open(step4 / chunk.file, "r+b") as f:  # one bit of one tensor
        f.seek(chunk.offset + 5)
        byte = f.read(1)[0]
        f.seek(chunk.offset + 5)
        f.write(bytes([byte ^ 0x01]))
    resumed = titan.build(_config(async_mode="disabled"), str(tmp_path))
    assert resumed.checkpointer.load() is True
    loaded = titan.fingerprint(resumed)
    loaded["next_batch"] = titan.next_batch_digest(resumed)
    del loaded["data_pos"], expected["data_pos"]  # the loader restores it at iter()
    assert loaded == expected  # step 2, exactly
    names = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    assert "step-2" in names and "step-4" not in names, names
    assert any(n.startswith("step-4.corrupt-") for n in names), names
    assert resumed.checkpointer.committed_steps() == [2]
    resumed.checkpointer.close()


@dataclass(kw_only=True, slots=True)
class TrainerConfig(Configurable.Config):
    """The checkpoint field of torchtitan's ``Trainer.Config`` (importing the trainer
    needs triton, absent on CPU machines)."""

    checkpoint: BaseCheckpointManager.Config = field(default_factory=StockManager.Config)


def test_torchtitan_config_system_builds_the_backend() -> None:
    """As torchtitan's trainer declares it (``checkpoint: BaseCheckpointManager.Config``,
    stock default) and parses it (tyro, the config registry's value as default): the
    backend's Config survives the CLI, its fields are flags, and build() makes it."""
    import tyro
    from torchtitan.config.manager import ConfigManager, custom_registry

    ConfigManager()  # registers torchtitan's CLI rules
    default = TrainerConfig(checkpoint=_config(async_mode="async"))
    args = ["--checkpoint.interval", "7", "--checkpoint.async_worker", "thread"]
    parsed = tyro.cli(TrainerConfig, args=args, default=default, registry=custom_registry)
    assert type(parsed.checkpoint) is QuicksaveCheckpointManager.Config
    assert (parsed.checkpoint.interval, parsed.checkpoint.async_worker) == (7, "thread")
    assert parsed.checkpoint._owner is QuicksaveCheckpointManager
    with pytest.raises(CheckpointError, match="last_save_in_hf"):
        _config(last_save_in_hf=True)
    with pytest.raises(CheckpointError, match="thread_count"):
        _config(thread_count=0)


def test_taking_a_folder_without_locks_warns_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the filesystem has no working locks, the backend still writes, but says
    that one job per folder is not enforced there (as CheckpointManager does)."""
    import errno
    import fcntl
    import logging

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING, logger="quicksave"):
        job = titan.build(_config(folder="ckpt"), str(tmp_path))
    try:
        assert job.checkpointer.read_only_reason is None
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        folder = str(tmp_path / "ckpt")
        assert any(folder in m and "not enforced" in m for m in warned), warned
    finally:
        job.checkpointer.close()


# ------------------------------------------------------------------ the example


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_example_runs_under_torchrun(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        str(ROOT / "examples" / "torchtitan_quicksave.py"),
        "--dump-folder",
        str(tmp_path),
        "--steps",
        "6",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "resumed at step 4" in done.stdout, done.stdout
    assert "bit-exact: True" in done.stdout, done.stdout
