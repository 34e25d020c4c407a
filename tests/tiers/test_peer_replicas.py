"""Peer replicas without other ranks: the placement by node, the recovery's choice of
where each rank's snapshot comes from, and a snapshot's files as they travel (mapped on
one side, received into a draft that commits by one rename on the other), and a
replica read by the receiver's load straight into its destinations."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from quicksave import api
from quicksave.commit import CheckpointKind
from quicksave.errors import CheckpointError
from quicksave.format import MANIFEST_NAME
from quicksave.format.manifest_parse import from_json_bytes
from quicksave.loading.checkpoint import Checkpoint
from quicksave.manager import MemoryTierConfig
from quicksave.storage import parse_location
from quicksave.tiers import peer_recovery
from quicksave.tiers.peer_files import Incoming, Outgoing, check_names
from quicksave.tiers.peer_recovery import holders_by_step
from quicksave.tiers.peer_replicas import Placement


def test_placement_puts_each_replica_on_another_node() -> None:
    two = Placement.resolve(1, 2, 4)
    assert [two.targets(r) for r in range(4)] == [[2], [3], [0], [1]]
    assert [two.sources(r) for r in range(4)] == [[2], [3], [0], [1]]
    three = Placement.resolve(2, 2, 6)  # 3 nodes: the two copies on the two others
    assert three.targets(1) == [3, 5] and three.sources(1) == [5, 3]
    for r in range(6):
        nodes = {t // 2 for t in three.targets(r)}
        assert len(nodes) == 2 and r // 2 not in nodes


def test_ranks_per_node_from_the_launcher_else_one_node() -> None:
    assert Placement.resolve(1, None, 4, {"LOCAL_WORLD_SIZE": "2"}).ranks_per_node == 2
    with pytest.raises(CheckpointError) as e:
        Placement.resolve(1, None, 4, {})
    assert str(e.value) == (
        "memory.replicas is 1 but the job has 1 node(s) of 4 rank(s) (ranks_per_node: "
        "memory.ranks_per_node, else LOCAL_WORLD_SIZE): each replica needs another node "
        "than the snapshot's"
    )
    assert Placement.resolve(0, None, 4, {}).targets(0) == []


def test_bad_placements_are_refused() -> None:
    with pytest.raises(CheckpointError, match="do not split into whole nodes"):
        Placement.resolve(1, 3, 4)
    with pytest.raises(CheckpointError, match="memory.replicas is 2 but the job has 2 node"):
        Placement.resolve(2, 2, 4)
    with pytest.raises(CheckpointError, match="memory.replicas must be an integer >= 0"):
        MemoryTierConfig(root="/tmp", replicas=-1)
    with pytest.raises(CheckpointError, match="memory.ranks_per_node must be an integer >= 1"):
        MemoryTierConfig(root="/tmp", ranks_per_node=0)


def test_each_rank_gets_a_step_from_its_own_memory_first_else_a_replica() -> None:
    reports = [
        ([4, 5], {2: [4, 5]}),  # rank 0 holds 4, 5 and rank 2's replicas of them
        ([4, 5], {3: [5]}),
        ([], {0: [4, 5]}),  # rank 2's node was replaced: only its replicas of 0
        ([3], {1: [4, 5]}),  # rank 3 keeps an old step; rank 1 holds its replica of 5
    ]
    got = holders_by_step(reports)
    # step 4: rank 3 has no copy anywhere; step 3: only rank 3 has it
    assert got == {5: [0, 1, 0, 1]}
    assert holders_by_step([([7], {}), ([7], {})]) == {7: [0, 1]}
    assert holders_by_step([([7], {}), ([], {})]) == {}


def _snapshot(path: str) -> dict[str, torch.Tensor]:
    state = {"w": torch.randn(64, 32), "b": torch.arange(5), "empty": torch.empty(0)}
    api.save(state, path, step=3, no_dist=True)
    return state


def test_a_snapshot_travels_as_its_files_and_loads_bit_exact(tmp_path) -> None:
    state = _snapshot(str(tmp_path / "own" / "step-3"))
    out = Outgoing.open(str(tmp_path / "own" / "step-3"))
    shutil.rmtree(tmp_path / "own")  # retention meanwhile: the maps keep the files
    final = tmp_path / "replica-of-1" / "step-3"
    incoming = Incoming(final, out.files)
    sends, recvs = out.tensors(), incoming.tensors()
    assert [t.numel() for t in sends] == [t.numel() for t in recvs]
    for s, r in zip(sends, recvs, strict=True):
        r.copy_(s)  # what the transfer does
    del sends, recvs
    out.close()
    assert not final.exists()  # nothing visible before the commit
    assert incoming.commit()
    assert sorted(os.listdir(final)) == sorted(name for name, _ in out.files)
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    api.load(loaded, str(final), no_dist=True)
    for k in state:
        assert torch.equal(loaded[k], state[k]), k
    assert [p for p in os.listdir(final.parent) if p != "step-3"] == []  # no draft left


def test_a_torn_copy_fails_its_checksums(tmp_path) -> None:
    state = _snapshot(str(tmp_path / "own" / "step-3"))
    out = Outgoing.open(str(tmp_path / "own" / "step-3"))
    final = tmp_path / "replica-of-1" / "step-3"
    incoming = Incoming(final, out.files)
    for s, r in zip(out.tensors(), incoming.tensors(), strict=True):
        r.copy_(s)
        if s.numel() > 4096:
            r[-16:] = 0xFF  # bytes lost on the way
    incoming.commit()
    with pytest.raises(CheckpointError, match="checksum"):
        api.load({k: torch.zeros_like(v) for k, v in state.items()}, str(final), no_dist=True)


def test_a_peers_file_list_names_plain_files_only() -> None:
    assert check_names([["manifest.json", 10], [".metadata", 0]]) == [
        ("manifest.json", 10),
        (".metadata", 0),
    ]
    for bad in (["../x", 1], ["a/b", 1], ["..", 1], ["x", -1], ["x", "1"], "x"):
        with pytest.raises(CheckpointError, match="a peer sent a bad file entry"):
            check_names([bad])


def test_a_node_holding_every_ranks_snapshot_or_a_replica_lists_the_step(tmp_path) -> None:
    import json

    from quicksave.tiers.listing import memory_holdings

    url = "file:///runs/a"
    job = tmp_path / f"quicksave-{os.getuid()}" / "job-a"
    job.mkdir(parents=True)
    (job / "job.json").write_text(json.dumps({"folder_url": url}))
    world = job / "world-4"
    for held, steps in (("rank-0", [4, 5]), ("rank-1", [5]), ("replica-of-2", [4, 5])):
        for step in steps:
            api.save({"x": torch.ones(2)}, str(world / held / f"step-{step}"), no_dist=True)
    api.save({"x": torch.ones(2)}, str(world / "replica-of-3" / "step-5"), no_dist=True)
    got = [(h.step, h.ranks, h.complete) for h in memory_holdings(url, str(tmp_path))]
    assert got == [(4, 2, False), (5, 4, True)]


def test_replicas_on_a_single_node_job_are_refused_before_any_memory_is_made(tmp_path) -> None:
    from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState

    root = tmp_path / "shm"
    root.mkdir()
    memory = MemoryTierConfig(root=str(root), job_id="one", replicas=1)
    config = CheckpointConfig(folder=str(tmp_path / "ckpt"), async_mode="disabled", memory=memory)
    with pytest.raises(CheckpointError, match="memory.replicas is 1 but the job has 1 node"):
        CheckpointManager(config, {"model": ModelState(torch.nn.Linear(2, 2))})
    assert list(root.iterdir()) == []  # no job folder, no agent


class _Served:
    """A holder's replica answering reads in this process (what the transfer of
    ``peer_recovery`` does across ranks): its files' maps, sliced as the holder does."""

    def __init__(self, outgoing: Outgoing, tear: bool = False) -> None:
        self.maps = outgoing.by_name()
        self.sizes = dict(outgoing.files)
        self.tear = tear
        self.asked: list[list[tuple[str, int, int]]] = []

    def read(self, reads: list[tuple[str, int, memoryview]], landed=None) -> None:
        slices, error = peer_recovery._slices(
            self.maps, [[name, offset, len(view)] for name, offset, view in reads]
        )
        assert error is None
        self.asked.append([(name, offset, len(view)) for name, offset, view in reads])
        slices = iter(slices)
        for i, (_, _, view) in enumerate(reads):  # in order, each checked as it lands
            if len(view):
                dst = torch.frombuffer(view, dtype=torch.uint8)
                dst.copy_(next(slices))
                if self.tear and dst.numel() > 4096:
                    dst[-16:] = 0xFF
            if landed is not None:
                landed(i)


def _remote(path: str, served: _Served) -> Checkpoint:
    manifest = from_json_bytes(served.maps[MANIFEST_NAME].numpy().tobytes(), path)
    return Checkpoint(
        parse_location(path), CheckpointKind.QUICKSAVE, read={"manifest": manifest}, remote=served
    )


def test_a_replica_loads_through_reads_straight_into_the_destinations(tmp_path) -> None:
    path = str(tmp_path / "replica-of-1" / "step-3")
    state = _snapshot(path)
    served = _Served(Outgoing.open(path))
    shutil.rmtree(path)  # the receiver reads nothing at the path: only the holder's maps
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    api.load(loaded, _remote(path, served), no_dist=True)
    for k in state:
        assert torch.equal(loaded[k], state[k]), k
    # one exchange; each non-empty tensor's bytes asked once, as many as it holds
    assert len(served.asked) == 1
    lengths = sorted(n for _, _, n in served.asked[0] if n)
    assert lengths == sorted(v.numel() * v.element_size() for v in state.values() if v.numel())


def test_a_replica_torn_on_the_way_fails_its_checksums(tmp_path) -> None:
    path = str(tmp_path / "replica-of-1" / "step-3")
    state = _snapshot(path)
    served = _Served(Outgoing.open(path), tear=True)
    with pytest.raises(CheckpointError, match="checksum"):
        api.load({k: torch.zeros_like(v) for k, v in state.items()}, _remote(path, served),
                 no_dist=True)  # fmt: skip


def test_a_holder_serves_only_bytes_its_replica_has(tmp_path) -> None:
    path = str(tmp_path / "step-3")
    _snapshot(path)
    maps = Outgoing.open(path).by_name()
    data = next(name for name in maps if name.endswith(".safetensors"))
    size = maps[data].numel()
    assert peer_recovery._slices(maps, [[data, 0, size]])[1] is None
    for bad in ([data, 1, size], ["../x", 0, 1], [data, -1, 2], [data, 0], "x"):
        slices, error = peer_recovery._slices(maps, [bad])
        assert slices == [] and "no such bytes" in error, bad
