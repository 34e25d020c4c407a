"""Incremental saves through ``CheckpointManager`` (``IncrementalConfig``, FORMAT.md §9):
blocks unchanged since the last committed checkpoint are neither copied nor written and
the new checkpoint refers to the one holding them; the folder grows by what changed;
every kept step verifies and loads bit-exactly (after retention too); a write that the
version counters miss (``.data``, a numpy view) is in the next checkpoint; every
``full_every``-th save is full; the layout (so the plan cache and the pool) stays the
same; stock DCP readers refuse an incremental checkpoint and read its converted copy.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

import quicksave
from helpers.lora_job import COLS, ROWS, Job  # the frozen base: 8 blocks of 64 rows
from helpers.state import assert_bit_equal
from quicksave.errors import CheckpointError
from quicksave.format import MANIFEST_NAME
from quicksave.format.manifest import to_json_bytes
from quicksave.format.manifest_parse import from_json_bytes
from quicksave.loading.verify import verify_checkpoint
from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState, OptimizerState
from quicksave.tools.convert import convert
from quicksave.worker import persisters
from quicksave.worker.job import JobResult, PersistJob

BLOCK = 64 << 10  # small blocks: a small model spans several of them


def _config(folder: Path, **kw: Any) -> CheckpointConfig:
    incremental = quicksave.IncrementalConfig(
        enabled=True,
        block_bytes=BLOCK,
        min_bytes=1024,
        full_every=kw.pop("full_every", 8),
        max_unused=kw.pop("incremental_max_unused", None),
    )
    kw.setdefault("async_mode", "thread")
    return CheckpointConfig(folder=str(folder), interval=1, incremental=incremental, **kw)


def _manifest(folder: Path, step: int) -> dict[str, Any]:
    return json.loads((folder / f"step-{step}" / MANIFEST_NAME).read_bytes())


def _bases(doc: dict[str, Any], fqn: str) -> list[int | None]:
    return [c.get("base") for c in doc["tensors"][fqn]["chunks"]]


def _allocated(checkpoint: Path) -> int:
    """Bytes the checkpoint's files occupy on disk (holes take none)."""
    return sum(os.stat(p).st_blocks * 512 for p in checkpoint.iterdir())


def _load_model(checkpoint: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    quicksave.load({"model": out}, checkpoint, strict=False)
    return out


def _assert_loads(checkpoint: Path, expected: dict[str, torch.Tensor]) -> None:
    assert verify_checkpoint(checkpoint).ok, verify_checkpoint(checkpoint).problems
    out = _load_model(checkpoint, expected)
    for fqn, value in expected.items():
        assert_bit_equal(out[fqn], value, f"{checkpoint.name}: {fqn}")


@pytest.fixture
def job() -> Iterator[Job]:
    yield Job()


def _train_and_save(
    folder: Path,
    job: Job,
    steps: range,
    edit: Any = None,
    records: list[Any] | None = None,
    **kw: Any,
) -> tuple[dict[int, dict[str, torch.Tensor]], tuple[int, int]]:
    """Train and save at each of ``steps``; the model's state at each, and the plan
    cache's (hits, misses); the manager's save records into ``records``."""
    manager = CheckpointManager(_config(folder, **kw), job.states())
    snaps = {}
    try:
        for step in steps:
            job.step()
            if edit is not None:
                edit(step, job)
            assert manager.save(step)
            manager.wait()  # (each save commits before the next: it is the base)
            snaps[step] = job.snapshot()
        plans = manager.session.writer.saver._plans  # type: ignore[union-attr]
        counts = (plans.hits, plans.misses)
        if records is not None:
            records.extend(manager.metrics)
    finally:
        manager.close()
    return snaps, counts


# ------------------------------------------------------------------------ the saves


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_unchanged_blocks_are_referred_to_and_every_step_loads(
    tmp_path: Path, job: Job, mode: str
) -> None:
    folder = tmp_path / "run"
    snaps, (hits, misses) = _train_and_save(folder, job, range(1, 5), async_mode=mode)
    first, later = _manifest(folder, 1), _manifest(folder, 3)
    assert first["format_version"] == 1
    assert later["format_version"] == 2
    # the frozen weight: 8 blocks, each its own chunk at every save, referring to step 1
    assert _bases(first, "model.base.weight") == [None] * 8
    assert _bases(later, "model.base.weight") == [1] * 8
    assert _bases(later, "model.base.bias") == [1]
    # the adapters and their moments changed: written
    assert _bases(later, "model.up.weight") == [None]
    assert _bases(later, "optimizer.state.up.weight.exp_avg") == [None]
    # the layout is the same at every save: one plan, reused
    assert misses == 1 and hits >= 3
    # in each data file the frozen weight's blocks lie after the chunks written at every
    # save (which the writer then writes in one run, not one per gap)
    chunks = [c for t in later["tensors"].values() for c in t["chunks"]]
    base_blocks = later["tensors"]["model.base.weight"]["chunks"]
    for name in {c["file"] for c in chunks}:
        written = [c["offset"] for c in chunks if c["file"] == name and "base" not in c]
        blocks = [c["offset"] for c in base_blocks if c["file"] == name]
        assert not written or not blocks or max(written) < min(blocks), name
    # the folder grows by what changed: the frozen base is not written again
    frozen = ROWS * COLS * 4  # (the bias's hole may share a page with written bytes)
    assert _allocated(folder / "step-1") - _allocated(folder / "step-3") >= frozen
    for step, snap in snaps.items():
        _assert_loads(folder / f"step-{step}", snap)
        # each manifest is the canonical encoding of what it says (a process's writer
        # encodes the later ones through its template of the plan's skeleton)
        raw = (folder / f"step-{step}" / MANIFEST_NAME).read_bytes()
        assert to_json_bytes(from_json_bytes(raw)) == raw


def test_writes_that_version_counters_miss_are_in_the_next_checkpoint(
    tmp_path: Path, job: Job
) -> None:
    """``.data`` writes and numpy-view writes leave ``_version`` alone: the digests see
    them; the blocks they touched are written, the others referred to."""

    def edit(step: int, job: Job) -> None:
        weight = job.model.base.weight
        if step == 3:
            weight.data[70] += 1.0  # block 1 (rows 64..127)
        if step == 4:
            weight.detach().numpy()[300, 5] = 42.0  # block 4 (rows 256..319)

    folder = tmp_path / "run"
    version = job.model.base.weight._version
    snaps, _ = _train_and_save(folder, job, range(1, 6), edit)
    assert job.model.base.weight._version == version  # torch saw none of them
    assert _bases(_manifest(folder, 3), "model.base.weight") == [1, None, 1, 1, 1, 1, 1, 1]
    assert _bases(_manifest(folder, 4), "model.base.weight") == [1, 3, 1, 1, None, 1, 1, 1]
    assert _bases(_manifest(folder, 5), "model.base.weight") == [1, 3, 1, 1, 4, 1, 1, 1]
    assert snaps[4]["base.weight"][300, 5] == 42.0
    for step, snap in snaps.items():
        _assert_loads(folder / f"step-{step}", snap)


def test_every_kth_save_is_full(tmp_path: Path, job: Job) -> None:
    folder = tmp_path / "run"
    _train_and_save(folder, job, range(1, 8), full_every=3)
    versions = {s: _manifest(folder, s)["format_version"] for s in range(1, 8)}
    assert versions == {1: 1, 2: 2, 3: 2, 4: 1, 5: 2, 6: 2, 7: 1}
    assert _bases(_manifest(folder, 6), "model.base.weight") == [4] * 8


def test_a_frozen_base_is_never_rewritten_on_a_count_alone(tmp_path: Path, job: Job) -> None:
    """The defaults (no ``full_every``, ``max_unused=1.0``): a LoRA chain keeps only the
    adapters of its full save unused, so no save of a long run rewrites the frozen base
    (a count would: every K-th save, the whole base again)."""
    default = quicksave.IncrementalConfig()
    assert default.full_every is None
    folder = tmp_path / "run"
    records: list[Any] = []
    snaps, _ = _train_and_save(
        folder,
        job,
        range(1, 21),
        records=records,
        full_every=None,
        incremental_max_unused=default.max_unused,
    )
    for step in range(2, 21):
        assert _bases(_manifest(folder, step), "model.base.weight") == [1] * 8, step
    # each save's record says what it referred to instead of writing (the manifest's)
    for r in records:
        chunks = [c for t in _manifest(folder, r.step)["tensors"].values() for c in t["chunks"]]
        assert r.bytes_referred == sum(c["length"] for c in chunks if c.get("base") is not None)
    assert records[0].bytes_referred == 0 and records[-1].bytes_referred >= ROWS * COLS * 4
    _assert_loads(folder / "step-20", snaps[20])


def _unused_and_total(folder: Path, step: int) -> tuple[int, int]:
    """From the manifests on disk: the bytes that the steps ``step`` refers to wrote and
    its state does not use, and the bytes of its state (``IncrementalConfig.max_unused``)."""
    doc = _manifest(folder, step)
    chunks = [c for t in doc["tensors"].values() for c in t["chunks"]]
    used: dict[int, int] = {}
    for c in chunks:
        if c.get("base") is not None:
            used[c["base"]] = used.get(c["base"], 0) + c["length"]

    def wrote(at: int) -> int:
        held = _manifest(folder, at)["tensors"].values()
        return sum(c["length"] for t in held for c in t["chunks"] if c.get("base") is None)

    return sum(wrote(at) - n for at, n in used.items()), sum(c["length"] for c in chunks)


def _rewritten(folder: Path, step: int) -> list[str]:
    """The chunks that the save of ``step`` wrote again with the bytes (xxh3) they had
    at the save before it."""
    now, before = _manifest(folder, step)["tensors"], _manifest(folder, step - 1)["tensors"]
    return [
        f"{fqn}[{i}]"
        for fqn, t in now.items()
        for i, c in enumerate(t["chunks"])
        if c.get("base") is None and c["xxh3_64"] == before[fqn]["chunks"][i]["xxh3_64"]
    ]


def _check_compactions(
    folder: Path, steps: range, records: list[Any], ratio: float, least: int = 1
) -> None:
    """From the manifests on disk: saves wrote unchanged blocks again (compactions), at
    ``least`` of them, each only after a save whose unused bytes exceeded ``ratio`` × the
    state's, each fewer bytes than a full save; and what the chain keeps unused never
    exceeds the bound by more than what one other save writes. (A compaction whose
    blocks all changed at that step anyway is not seen as one.)"""
    unused = {s: _unused_and_total(folder, s) for s in steps}
    total = unused[steps[0]][1]
    compacted = [s for s in steps[1:] if _rewritten(folder, s)]
    assert len(compacted) >= least, compacted
    for step in compacted:
        assert unused[step - 1][0] > ratio * total, (step, unused[step - 1])
    written = {r.step: r.bytes for r in records}
    assert max(written[s] for s in compacted) < written[steps[0]]
    steady = max(written[s] for s in steps[1:] if s not in compacted)
    assert max(u for u, _ in unused.values()) <= ratio * total + steady


@pytest.mark.parametrize("ratio", [0.5, 1.0])
def test_a_chain_rewrites_what_superseded_checkpoints_still_hold(
    tmp_path: Path, job: Job, ratio: float
) -> None:
    """A sparse update (a different block of the frozen weight each step, behind its
    counter): each save leaves older blocks and adapters unused in the steps it refers
    to. The save after one whose unused bytes exceed ``max_unused`` × the state's writes
    again the unchanged blocks that the most superseded steps still hold (and only
    then), never the whole state: no save but the first is full, and what the chain
    keeps unused stays bounded. Recomputed from the manifests on disk; every step loads."""
    folder = tmp_path / "run"

    def edit(step: int, job: Job) -> None:
        job.model.base.weight.detach().numpy()[64 * (step % 8) + 1, 2] += 1.0

    steps = range(1, 25)
    records: list[Any] = []
    snaps, _ = _train_and_save(
        folder, job, steps, edit, records, full_every=None, incremental_max_unused=ratio
    )
    assert [_manifest(folder, s)["format_version"] for s in steps] == [1] + [2] * 23
    _check_compactions(folder, steps, records, ratio, least=2)
    for step in steps:
        _assert_loads(folder / f"step-{step}", snaps[step])


class _SparseJob:
    """An EmbeddingBag of 512 × 256 float32 (8 blocks) trained by SparseAdam on two rows a
    step in different blocks: its weight and both moments change a row at a time, and
    the optimizer's tensors are deferred (copied, and compared, by the background copy)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.EmbeddingBag(ROWS, COLS, mode="sum", sparse=True)
        self.optim = torch.optim.SparseAdam(list(self.model.parameters()), lr=1e-2)
        self.k = 0

    def states(self) -> dict[str, Any]:
        return {
            "model": ModelState(self.model),
            "optimizer": OptimizerState(self.model, self.optim),
        }

    def step(self) -> None:
        self.k += 1
        rows = torch.tensor([[65 * self.k % ROWS, 97 * self.k % ROWS]])
        self.model(rows).pow(2).sum().backward()
        self.optim.step()
        self.optim.zero_grad()

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}


def test_deferred_blocks_of_superseded_steps_are_written_again(tmp_path: Path) -> None:
    """The same rule where the sparse tensors are the optimizer's (deferred: their blocks
    are compared by the background copy, ``_Sift``): a block held by a step the chain
    stops referring to is written again, never referred to."""
    folder = tmp_path / "run"
    steps = range(1, 21)
    records: list[Any] = []
    snaps, _ = _train_and_save(
        folder, _SparseJob(), steps, None, records, full_every=None, incremental_max_unused=0.5
    )  # type: ignore[arg-type]
    assert [_manifest(folder, s)["format_version"] for s in steps] == [1] + [2] * 19
    assert _bases(_manifest(folder, 2), "model.weight").count(None) <= 2  # (two rows changed)
    _check_compactions(folder, steps, records, 0.5)
    for step in steps:
        _assert_loads(folder / f"step-{step}", snaps[step])


def test_retention_keeps_the_bases_of_kept_steps(tmp_path: Path, job: Job) -> None:
    folder = tmp_path / "run"
    snaps, _ = _train_and_save(folder, job, range(1, 8), keep_latest_k=2, full_every=4)
    kept = sorted(int(p.name.split("-")[1]) for p in folder.glob("step-*"))
    assert kept == [5, 6, 7]  # 6 and 7, and 5 which they refer to
    for step in kept:
        _assert_loads(folder / f"step-{step}", snaps[step])


def test_a_changed_layout_makes_a_full_save(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    config = _config(folder)
    state = {"w": torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)}
    with CheckpointManager(config, {"m": _Holder(state)}) as m:
        m.save(1)
        m.wait()
        m.save(2)
        m.wait()
        state["extra"] = torch.ones(3)
        m.save(3)
        m.wait()
    assert _manifest(folder, 2)["format_version"] == 2
    assert _manifest(folder, 3)["format_version"] == 1


class _Holder:
    """A ``Stateful`` whose state dict is a plain dict of tensors that a test edits."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state)

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.state.update(sd)


def test_sparse_embedding_updates_rewrite_only_the_rows_touched(tmp_path: Path) -> None:
    torch.manual_seed(0)
    table = nn.EmbeddingBag(4096, 64, mode="sum", sparse=True)  # 1 MiB: 16 blocks
    optim = torch.optim.SGD(table.parameters(), lr=0.1)
    folder = tmp_path / "run"
    snaps = {}
    with CheckpointManager(
        _config(folder), {"model": ModelState(table), "optimizer": OptimizerState(table, optim)}
    ) as manager:
        for step in range(1, 5):
            rows = torch.tensor([step * 7, step * 7 + 1])  # rows of block 0 only
            table(rows, torch.tensor([0])).sum().backward()
            optim.step()
            optim.zero_grad()
            manager.save(step)
            manager.wait()
            snaps[step] = {k: v.clone() for k, v in table.state_dict().items()}
    doc = _manifest(folder, 3)
    assert _bases(doc, "model.weight") == [None] + [1] * 15
    assert _allocated(folder / "step-1") >= 5 * _allocated(folder / "step-3")
    for step, snap in snaps.items():
        _assert_loads(folder / f"step-{step}", snap)


# ---------------------------------------------------------------- DCP and convert


def test_stock_dcp_refuses_an_incremental_checkpoint_and_reads_its_converted_copy(
    tmp_path: Path, job: Job
) -> None:
    folder = tmp_path / "run"
    snaps, _ = _train_and_save(folder, job, range(1, 3))
    assert _manifest(folder, 2)["format_version"] == 2
    like = {f"model.{k}": torch.zeros_like(v) for k, v in snaps[2].items()}
    with pytest.raises(CheckpointException) as info:
        dcp.load(like, checkpoint_id=str(folder / "step-2"), no_dist=True)
    failure = info.value.failures[0]
    failure = failure[0] if isinstance(failure, tuple) else failure
    assert isinstance(failure, CheckpointError) and "quicksave convert --to dcp" in failure.message
    out = tmp_path / "stock"
    convert(folder / "step-2", out, "dcp")
    loaded = {"model": {k: torch.zeros_like(v) for k, v in snaps[2].items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(out)), no_dist=True)
    for fqn, value in snaps[2].items():
        assert_bit_equal(loaded["model"][fqn], value, fqn)


def test_off_by_default(tmp_path: Path, job: Job) -> None:
    assert not quicksave.IncrementalConfig().enabled
    folder = tmp_path / "run"
    config = CheckpointConfig(folder=str(folder), interval=1, async_mode="thread")
    with CheckpointManager(config, job.states()) as manager:
        for step in (1, 2):
            job.step()
            manager.save(step)
            manager.wait()
    doc = _manifest(folder, 2)
    assert doc["format_version"] == 1
    assert len(doc["tensors"]["model.base.weight"]["chunks"]) == 1


@pytest.mark.parametrize(
    "bad",
    [
        {"block_bytes": 0},
        {"full_every": 0},
        {"max_unused": -1},
        {"max_unused": float("nan")},
        {"max_unused": "1"},
        {"min_bytes": -1},
        {"block_bytes": 1.5},
        {"watch_writes": "auto"},
    ],
)
def test_bad_config_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(CheckpointError, match="IncrementalConfig"):
        quicksave.IncrementalConfig(**bad)


def test_incremental_without_the_async_engine_is_refused(tmp_path: Path) -> None:
    """``async_mode="disabled"`` saves through ``quicksave.save``, which writes every
    byte: refused when the config is made, not silently full."""
    with pytest.raises(CheckpointError, match="async_mode='disabled' writes every byte") as e:
        _config(tmp_path, async_mode="disabled")
    assert e.value.path == str(tmp_path)
    CheckpointConfig(folder=str(tmp_path), interval=1, async_mode="disabled")  # off: fine


# ------------------------------------------------------------------- the engine alone


def _engine(**kw: Any) -> quicksave.EngineConfig:
    incremental = quicksave.IncrementalConfig(enabled=True, block_bytes=BLOCK)
    kw.setdefault("mode", "thread")
    return quicksave.EngineConfig(staging="blocking", fsync=False, incremental=incremental, **kw)


def test_a_save_after_a_failed_one_is_full(tmp_path: Path) -> None:
    """A failed save leaves no base (it might have committed unseen): the next is full."""
    config = _engine()
    folder = tmp_path / "run"
    state = {"w": torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)}
    folder.mkdir()
    (folder / "step-2").write_text("in the way")
    with quicksave.AsyncSaver(config) as saver:
        saver.save(state, folder / "step-1", step=1).wait()  # type: ignore[union-attr]
        failed = saver.save(state, folder / "step-2", step=2)
        assert failed is not None
        with pytest.raises(CheckpointError):
            failed.wait()
        for step in (3, 4):
            saver.save(state, folder / f"step-{step}", step=step).wait()  # type: ignore[union-attr]
    assert _manifest(folder, 3)["format_version"] == 1
    assert _bases(_manifest(folder, 4), "w") == [3] * 8
    _assert_loads_plain(folder / "step-4", state)


def test_a_save_committed_as_the_saver_closes_reports_what_it_referred_to(
    tmp_path: Path,
) -> None:
    """``close(abort=True)`` right after an incremental save committed, its result not
    read yet: the save is done, and its result says what it wrote and what it referred
    to as its manifest does (not the whole files as written)."""
    config = _engine(mode="process")
    folder = tmp_path / "run"
    state = {"w": torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)}
    saver = quicksave.AsyncSaver(config)
    try:
        saver.save(state, folder / "step-1", step=1).wait()  # type: ignore[union-attr]
        state["w"][0] += 1.0  # block 0 changes; 1-7 are referred to
        handle = saver.save(state, folder / "step-2", step=2)
        assert handle is not None
        manifest = folder / "step-2" / MANIFEST_NAME
        for _ in range(6000):  # (committed: the writer's result is not read before close)
            if manifest.exists():
                break
            threading.Event().wait(0.01)
        assert manifest.exists() and not handle._done.is_set()  # (done() would collect)
    finally:
        saver.close(abort=True)
    result = handle.wait(0)
    chunks = _manifest(folder, 2)["tensors"]["w"]["chunks"]
    referred = sum(c["length"] for c in chunks if c.get("base") is not None)
    assert _bases(_manifest(folder, 2), "w") == [None] + [1] * 7
    assert result.bytes_referred == referred == 7 * BLOCK
    files = sum(p.stat().st_size for p in (folder / "step-2").glob("*.safetensors"))
    assert result.bytes == files - referred, (result.bytes, files, referred)
    _assert_loads_plain(folder / "step-2", state)


def _assert_loads_plain(checkpoint: Path, expected: dict[str, torch.Tensor]) -> None:
    assert verify_checkpoint(checkpoint).ok
    out = {k: torch.zeros_like(v) for k, v in expected.items()}
    quicksave.load(out, checkpoint)
    for fqn, value in expected.items():
        assert_bit_equal(out[fqn], value, fqn)


# ------------------------------------------------------------- trusting the counters


def test_trusted_counters_refer_without_hashing_and_a_miss_fails_that_save_only(
    tmp_path: Path, job: Job
) -> None:
    """``trust_counters``: an untouched frozen block is referred to on its version
    counter's word and checked by the background copy; a ``.data`` write (which the
    counter misses) fails that save, never committed, and the next save writes it."""
    folder = tmp_path / "run"
    incremental = quicksave.IncrementalConfig(
        enabled=True, block_bytes=BLOCK, min_bytes=1024, trust_counters=True, watch_writes=False
    )
    config = CheckpointConfig(
        folder=str(folder), interval=1, async_mode="thread", incremental=incremental
    )
    snaps: dict[int, dict[str, torch.Tensor]] = {}
    with CheckpointManager(config, job.states()) as manager:
        for step in (1, 2, 3):
            job.step()
            manager.save(step)
            manager.wait()
            snaps[step] = job.snapshot()
        job.model.base.weight.data[70] += 1.0  # block 1: its counter does not move
        job.step()
        manager.save(4)  # refers to the old block 1 on the counter's word...
        with pytest.raises(CheckpointError, match="version counters did not move") as info:
            manager.wait()  # ...and the background copy's check fails the save
        assert info.value.fqn == "model.base.weight@64,0"
        job.step()
        manager.save(5)
        manager.wait()
        snaps[5] = job.snapshot()
    assert not (folder / "step-4").exists()
    assert _bases(_manifest(folder, 3), "model.base.weight") == [1] * 8
    assert _bases(_manifest(folder, 5), "model.base.weight") == [1, None, 1, 1, 1, 1, 1, 1]
    for step, snap in snaps.items():
        _assert_loads(folder / f"step-{step}", snap)


def test_a_save_while_another_is_in_flight_is_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The save in flight could commit first and become the newest step, after which
    retention may delete the older base: a save that starts beside it refers to nothing."""
    gate = threading.Event()
    original = persisters.execute_job

    def gated(job: PersistJob, pool: memoryview, *rest: object) -> JobResult:
        if job.step == 2:
            assert gate.wait(60)
        return original(job, pool, *rest)

    monkeypatch.setattr(persisters, "execute_job", gated)
    folder = tmp_path / "run"
    state = {"w": torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)}
    with quicksave.AsyncSaver(_engine(max_in_flight=2)) as saver:
        saver.save(state, folder / "step-1", step=1).wait()  # type: ignore[union-attr]
        second = saver.save(state, folder / "step-2", step=2)  # held by its writer
        third = saver.save(state, folder / "step-3", step=3)  # beside it: full
        gate.set()
        second.wait()  # type: ignore[union-attr]
        third.wait()  # type: ignore[union-attr]
        saver.save(state, folder / "step-4", step=4).wait()  # type: ignore[union-attr]
    assert _bases(_manifest(folder, 2), "w") == [1] * 8
    assert _manifest(folder, 3)["format_version"] == 1
    assert _bases(_manifest(folder, 4), "w") == [3] * 8
    for step in (2, 3, 4):
        _assert_loads_plain(folder / f"step-{step}", state)


def test_non_contiguous_blocks_are_hashed_from_the_pool(tmp_path: Path) -> None:
    """A block that cannot be hashed where it lies is staged and hashed from the pool;
    an unchanged one is then only not written."""
    folder = tmp_path / "run"
    weight = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(COLS, ROWS)
    state = {"w": weight.t()}  # (ROWS, COLS), not contiguous: every block is strided
    with quicksave.AsyncSaver(_engine()) as saver:
        for step in (1, 2, 3):
            if step == 3:
                weight[5, 300] = -1.0  # row 300 of w: block 4
            saver.save(state, folder / f"step-{step}", step=step).wait()  # type: ignore[union-attr]
            _assert_loads_plain(folder / f"step-{step}", {"w": state["w"].contiguous()})
    assert _bases(_manifest(folder, 2), "w") == [1] * 8
    assert _bases(_manifest(folder, 3), "w") == [1, 1, 1, 1, None, 1, 1, 1]


def test_a_restarted_job_saves_full_first(tmp_path: Path, job: Job) -> None:
    """A new manager knows no base committed by itself: its first save refers to
    nothing, the next ones to it."""
    folder = tmp_path / "run"
    _train_and_save(folder, job, range(1, 3))
    resumed = Job()
    with CheckpointManager(_config(folder), resumed.states()) as manager:
        assert manager.load() == 2
        for step in (3, 4):
            resumed.step()
            manager.save(step)
            manager.wait()
    assert _manifest(folder, 3)["format_version"] == 1
    assert _bases(_manifest(folder, 4), "model.base.weight") == [3] * 8


def test_a_save_under_another_name_never_becomes_a_base(tmp_path: Path) -> None:
    """A reference names a step (``step-<N>``): a save under another name (Lightning's
    ``last.ckpt``) is full and is never referred to, so the next ``step-<N>`` save refers
    to the last ``step-<N>`` one (it referred to a ``step-2`` that did not exist)."""
    state = {"frozen": torch.randn(ROWS, COLS), "head": torch.zeros(7)}
    with quicksave.AsyncSaver(_engine()) as saver:
        for name, step in (("step-1", 1), ("last", 2), ("step-3", 3)):
            state["head"] += 1
            handle = saver.save(state, tmp_path / name, step=step)
            assert handle is not None
            handle.wait()
    assert set(_bases(_manifest(tmp_path, 3), "frozen")) == {1}
    assert set(_bases(json.loads((tmp_path / "last" / MANIFEST_NAME).read_bytes()), "frozen")) == {
        None
    }
    assert verify_checkpoint(tmp_path / "step-3").ok
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    quicksave.load(out, tmp_path / "step-3")
    assert_bit_equal(out["frozen"], state["frozen"], "frozen")


def test_saves_under_inference_mode_compare_bytes(tmp_path: Path) -> None:
    """Inference tensors keep no version counter (reading one raises): each incremental
    save under ``torch.inference_mode()`` compares their bytes, and a write made there
    (no counter moves) is in the next checkpoint."""
    incremental = quicksave.IncrementalConfig(enabled=True, block_bytes=64 << 10, min_bytes=1)
    config = quicksave.EngineConfig(mode="thread", fsync=False, incremental=incremental)
    with torch.inference_mode():
        state = {"w": torch.randn(512, 256), "x": torch.ones(1000)}
    with quicksave.AsyncSaver(config) as saver:
        for step in (1, 2, 3):
            with torch.inference_mode():
                if step == 3:
                    state["w"][300] = 7.0  # block 4 of 8
                saver.save(state, tmp_path / f"step-{step}", step=step).wait(60)
    assert _bases(_manifest(tmp_path, 2), "w") == [1] * 8
    assert _bases(_manifest(tmp_path, 3), "w") == [1, 1, 1, 1, None, 1, 1, 1]
    out = {"w": torch.zeros(512, 256), "x": torch.zeros(1000)}
    quicksave.load(out, tmp_path / "step-3")
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["x"], state["x"])
