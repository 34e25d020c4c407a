"""Commit records reach the workers from the trainer: a rank whose worker died posts its
failure where the coordinator's writer reads (the base store, not the PrefixStore that
``init_process_group`` wraps around it), so the save fails at once on every rank."""

from __future__ import annotations

import torch.distributed as dist

from quicksave.dist import records
from quicksave.dist.saving import DistContext, DistSaving


def test_a_dead_workers_failure_reaches_the_coordinators_writer(tmp_path) -> None:
    base = dist.FileStore(str(tmp_path / "store"), 1)
    wrapped = dist.PrefixStore("default_pg", dist.PrefixStore("0", base))  # as c10d does
    saving = DistSaving(DistContext(None, wrapped, rank=1, world_size=2, commit_timeout_s=3.0))
    saving.worker_failed("tok", "it died")
    writer = records.connect(saving.address)  # how the coordinator's worker connects
    assert records.wait_ranks(writer, "tok", 2, 0.0) == {1: "it died"}
    assert not saving.settled("tok")
    records.post_commit(writer, "tok", "rank 1: it died")
    assert saving.settled("tok")
