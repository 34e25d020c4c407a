"""Commit records reach the workers from the trainer: a rank whose worker died posts its
failure where the coordinator's writer reads (the base store, not the PrefixStore that
``init_process_group`` wraps around it), so the save fails at once on every rank."""

from __future__ import annotations

import torch.distributed as dist

from quicksave.commit import rank_records as records
from quicksave.saving.dist_save import DistContext, DistSaving


def test_a_dead_workers_failure_reaches_the_coordinators_writer(tmp_path) -> None:
    base = dist.FileStore(str(tmp_path / "store"), 1)
    wrapped = dist.PrefixStore("default_pg", dist.PrefixStore("0", base))  # as c10d does
    saving = DistSaving(DistContext(None, wrapped, rank=1, world_size=2, commit_timeout_s=60.0))
    saving.worker_failed("tok", "it died")
    writer = records.connect(saving.address)  # how the coordinator's worker connects
    assert records.wait_ranks(writer, "tok", 2, 0.0) == {1: "it died"}
    assert not saving.settled("tok")
    records.post_commit(writer, "tok", "rank 1: it died")
    assert saving.settled("tok")


def test_store_clients_connect_once_for_concurrent_callers(tmp_path) -> None:
    """The worker's start-up thread and its first job may ask for the same store at once:
    one connection, the same client for both, nobody joining a thread not yet started."""
    import threading

    owner = dist.FileStore(str(tmp_path / "store"), 1)  # kept: its end removes the file
    owner.set("k", "v")
    address = records.StoreAddress("file", path=str(tmp_path / "store"))
    for _ in range(20):
        clients = records.StoreClients()
        barrier = threading.Barrier(8)
        got: list[object] = []
        errors: list[BaseException] = []

        def ask(clients=clients, barrier=barrier, got=got, errors=errors) -> None:
            barrier.wait()
            try:
                got.append(clients.get(address, 5.0))
            except BaseException as e:  # noqa: BLE001 - the test reports it
                errors.append(e)

        threads = [threading.Thread(target=ask) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == []
        assert len(got) == 8 and all(c is got[0] for c in got) and got[0] is not None
        assert bytes(got[0].get("k")) == b"v"
        assert clients.status() == {"stores": 1, "connecting": 0, "connects": 1}


def test_store_clients_report_a_failed_connection_as_none() -> None:
    clients = records.StoreClients()
    address = records.StoreAddress("nowhere")
    assert clients.get(address, 1.0) is None  # connect() refused the kind
    assert clients.status() == {"stores": 0, "connecting": 0, "connects": 0}
