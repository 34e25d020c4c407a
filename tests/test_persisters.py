"""The persister seam (worker/persisters.py): the built-in persisters implement the
``Persister`` protocol, and a test double of a writer that outlives its trainers,
attached to through the protocol, writes a real save of the engine from the staging
pool itself; its commit strategy sees the staged bytes (``StagedFiles``)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import torch

from helpers_engine.engine_util import load_back, same_bytes
from quicksave.commit.rename import RenameCommit
from quicksave.commit.strategy import StagedFiles
from quicksave.saving.config import EngineConfig
from quicksave.saving.engine import AsyncSaver
from quicksave.storage import Location, StorageOptions
from quicksave.storage.registry import Registry
from quicksave.storage.retry import StoreHealth
from quicksave.storage.schemes import LocalScheme
from quicksave.worker.calls import CallResult
from quicksave.worker.execute import execute_job
from quicksave.worker.job import JobResult, PersistJob
from quicksave.worker.persisters import (
    PERSISTERS,
    Persister,
    PersisterStart,
    ThreadPersister,
)


class LongLivedWriter:
    """Stands for a writer that outlives the trainers that use it (a daemon process):
    trainers attach to it, hand it their pools, and detach; it keeps running."""

    def __init__(self) -> None:
        self.pools: dict[tuple[int, int], memoryview] = {}  # (trainer, pool id) -> pool
        self.attached: set[int] = set()
        self.jobs = 0

    def run(self, trainer: int, job: PersistJob) -> JobResult:
        self.jobs += 1
        # the bytes are read where the trainer staged them: the pool itself, no copy
        return execute_job(job, self.pools[(trainer, job.pool_id)])


class AttachedPersister:
    """A test double of the ``Persister`` protocol: attaches to a ``LongLivedWriter``
    instead of starting a writer, and only detaches from it on ``close``."""

    def __init__(self, writer: LongLivedWriter, start: PersisterStart) -> None:
        self.writer = writer
        self.trainer = id(self)
        self.rank = start.rank
        self.health = StoreHealth()
        self._results: list[JobResult | CallResult] = []
        writer.attached.add(self.trainer)

    def map_pool(self, pool_id: int, fd: int, nbytes: int, buffer: memoryview) -> None:
        assert len(buffer) >= nbytes
        self.writer.pools[(self.trainer, pool_id)] = buffer

    def unmap_pool(self, pool_id: int) -> None:
        self.writer.pools.pop((self.trainer, pool_id), None)

    def submit(self, job: PersistJob) -> None:
        self._results.append(self.writer.run(self.trainer, job))

    def poll(self, timeout: float = 0.0) -> list[JobResult | CallResult]:
        out, self._results = self._results, []
        return out

    def close(self, timeout: float) -> None:
        for key in [k for k in self.writer.pools if k[0] == self.trainer]:
            del self.writer.pools[key]
        self.writer.attached.discard(self.trainer)

    def kill(self) -> None:
        self.close(0.0)


class StagedCommit(RenameCommit):
    """A test double of a commit strategy that uses the staged bytes (as a memory tier
    would keep them): it commits by renaming, and records beside the checkpoint the
    SHA-256 of each data file as it lies in the pool."""

    name: ClassVar[str] = "staged"

    def commit(
        self,
        draft: str,
        loc: Location,
        members: Mapping[str, bytes],
        expected: Mapping[str, int],
        *,
        replace: bool = False,
        staged: StagedFiles | None = None,
    ) -> None:
        assert staged is not None and set(staged.files) == set(expected)
        seen = {n: hashlib.sha256(staged.view(n)).hexdigest() for n in sorted(expected)}
        super().commit(draft, loc, members, expected, replace=replace, staged=staged)
        Path(f"{loc.key}.staged.json").write_text(json.dumps(seen))


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(256, 64, generator=g), "b": torch.arange(1000, dtype=torch.int16)}


def test_the_built_in_persisters_implement_the_protocol() -> None:
    assert PERSISTERS.names == ("process", "thread")
    p = PERSISTERS.require("thread", "persister")(PersisterStart(EngineConfig().worker))
    try:
        assert isinstance(p, ThreadPersister) and isinstance(p, Persister)
    finally:
        p.close(1.0)


def test_an_attached_persister_writes_the_engines_saves_from_the_pool(tmp_path: Path) -> None:
    writer = LongLivedWriter()
    storage = StorageOptions(
        commits=Registry({"staged": StagedCommit}),
        schemes=Registry({"file": LocalScheme(commit="staged")}),
    )
    config = EngineConfig(
        persister=lambda start: AttachedPersister(writer, start), storage=storage, fsync=False
    )
    for n in (1, 2):  # two trainers in turn, one writer
        state = _state(n)
        path = tmp_path / f"step-{n}"
        with AsyncSaver(config) as saver:
            saver.save(state, path, step=n).wait(60)
            assert len(writer.attached) == 1
        assert writer.attached == set() and writer.pools == {}  # detached, pools given back
        assert writer.jobs == n  # the writer outlived the first trainer
        out = load_back(state, path)
        assert all(same_bytes(out[k], v) for k, v in state.items())
        seen = json.loads(Path(f"{path}.staged.json").read_text())
        on_disk = {f: hashlib.sha256((path / f).read_bytes()).hexdigest() for f in seen}
        assert seen == on_disk and seen  # the commit saw the very bytes written
        assert sorted(os.listdir(path)) == sorted([*seen, ".metadata", "manifest.json"])
