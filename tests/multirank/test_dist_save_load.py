"""Multi-rank save and resharded load over real gloo process groups.

One 4-rank group saves a state dict holding DTensors (Shard(0), Shard(1), Replicate,
2-D meshes, uneven shapes), a ShardedTensor, replicated plain tensors, per-rank values
and plain objects; the same group then makes rank 2 fail with ENOSPC during a second
save, and rank 1 alone refuse its input in a third. Fresh groups of 1, 2, 3 and 4 ranks
load the checkpoint into different placements and check every value bit for bit, then
read a copy with one flipped byte, then load into a destination that does not fit on
one rank. The parent process (no process group at all) loads it into full tensors.

Every value is a function of its global index, so any loader can check what it got.
Functions whose name starts with ``_rank_`` run inside the spawned ranks.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import struct
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from launcher import LaunchConfig, run_ranks

import quicksave
from quicksave.commit import CheckpointKind, classify, is_temp_name
from quicksave.commit.manifest_reader import read_manifest
from quicksave.errors import CheckpointError, CorruptCheckpointError, IncompatibleStateError
from quicksave.saving.config import EngineConfig
from quicksave.saving.dist_save import DistContext
from quicksave.saving.engine import AsyncSaver

pytestmark = pytest.mark.slow

SAVE_WORLD = 4
GOOD = "step-1"
ASYNC_GOOD = "async-step-1"
FAILED = "step-2"
REFUSED = "step-3"
LAUNCH = LaunchConfig(
    timeout_s=150.0, grace_s=20.0, collective_timeout_s=60.0, preload=("torch._dynamo",)
)

# fqn -> (dtype, global shape); values come from _full().
TENSORS: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
    "dt.rows": (torch.float32, (10, 7)),
    "dt.cols": (torch.bfloat16, (10, 7)),
    "dt.repl": (torch.int64, (5, 3)),
    "dt.grid": (torch.float64, (10, 7)),
    "dt.mixed": (torch.float32, (9, 5)),
    "dt.special": (torch.float32, (11,)),
    "st.rows": (torch.float32, (10, 7)),
    "plain.a": (torch.float32, (64,)),
    "plain.b": (torch.int32, (8, 8)),
    "plain.c": (torch.float16, (33,)),
    "plain.d": (torch.uint8, (100,)),
}
REPLICATED = ["plain.a", "plain.b", "plain.c", "plain.d", "dt.repl"]
for _r in range(SAVE_WORLD):
    TENSORS[f"rank{_r}.local"] = (torch.float32, (6,))
OBJECTS: dict[str, Any] = {
    "train": {"step": 1234, "name": "quicksave-dist", "lr": 0.5, "tags": ["a", "b"]},
    **{f"rank{r}.note": f"written by rank {r}" for r in range(SAVE_WORLD)},
}


# ------------------------------------------------------------------ expected values
def _full(fqn: str) -> torch.Tensor:
    """The global value of ``fqn``: deterministic, distinct per tensor and per element."""
    dtype, shape = TENSORS[fqn]
    if fqn == "dt.special":
        vals = [
            0.0,
            -0.0,
            float("inf"),
            float("-inf"),
            float("nan"),
            1e-45,
            -1.5,
            3.0e38,
            7.0,
            -2.0,
            0.1,
        ]
        return torch.tensor(vals, dtype=dtype)
    seed = sum(map(ord, fqn))
    numel = 1
    for s in shape:
        numel *= s
    idx = torch.arange(numel, dtype=torch.float64)
    if dtype.is_floating_point:
        return (idx * 0.37 - seed / 7.0).to(dtype).reshape(shape)
    return ((idx * 3 + seed) % (256 if dtype == torch.uint8 else 1 << 20)).to(dtype).reshape(shape)


def _assert_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal dtype, shape and bytes (NaN payloads and -0.0 included)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    a = actual.detach().contiguous().reshape(-1).view(torch.uint8)
    e = expected.detach().contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(a, e), f"{what}: bytes differ\n{actual}\n!=\n{expected}"


def _local_values(rank: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32) + 1000.0 * rank


# ------------------------------------------------------------- state in the ranks
def _meshes(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    flat = init_device_mesh("cpu", (world,))
    grid = init_device_mesh("cpu", (2, world // 2)) if world % 2 == 0 and world > 2 else None
    return flat, grid


def _sharded_tensor(full: torch.Tensor, world: int, dim: int, rank: int):
    """A ShardedTensor chunked along ``dim`` (torch.chunk sizes: uneven), filled from
    ``full`` (pass garbage to make a load destination)."""
    from torch.distributed._shard.sharded_tensor import Shard as STShard
    from torch.distributed._shard.sharded_tensor import ShardMetadata, init_from_local_shards

    pieces = torch.chunk(full, world, dim=dim)
    shards, start = [], 0
    for r, piece in enumerate(pieces):
        if r == rank:
            offsets = [0] * full.dim()
            offsets[dim] = start
            meta = ShardMetadata(offsets, list(piece.shape), f"rank:{r}/cpu")
            shards.append(STShard(piece.clone(), meta))
        start += piece.shape[dim]
    return init_from_local_shards(shards, *full.shape)


def _save_state(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    flat, grid = _meshes(world)
    assert grid is not None, "the save layout needs an even world size >= 4"
    sd: dict[str, Any] = {
        "dt.rows": distribute_tensor(_full("dt.rows"), flat, [Shard(0)]),
        "dt.cols": distribute_tensor(_full("dt.cols"), flat, [Shard(1)]),
        "dt.repl": distribute_tensor(_full("dt.repl"), flat, [Replicate()]),
        "dt.grid": distribute_tensor(_full("dt.grid"), grid, [Shard(0), Shard(1)]),
        "dt.mixed": distribute_tensor(_full("dt.mixed"), grid, [Replicate(), Shard(0)]),
        "dt.special": distribute_tensor(_full("dt.special"), flat, [Shard(0)]),
        "st.rows": _sharded_tensor(_full("st.rows"), world, 0, rank),
    }
    for fqn in ("plain.a", "plain.b", "plain.c", "plain.d"):
        sd[fqn] = _full(fqn)
    sd[f"rank{rank}.local"] = _local_values(rank)
    sd[f"rank{rank}.note"] = OBJECTS[f"rank{rank}.note"]
    sd["train"] = dict(OBJECTS["train"])
    return sd


def _load_destination(rank: int, world: int) -> tuple[dict[str, Any], dict[str, list]]:
    """Garbage-filled destinations with placements other than the saved ones."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    flat, grid = _meshes(world)

    def junk(fqn: str) -> torch.Tensor:
        dtype, shape = TENSORS[fqn]
        return torch.full(shape, 77, dtype=dtype)

    placements: dict[str, list] = {
        "dt.rows": [Shard(1)],  # saved Shard(0)
        "dt.cols": [Replicate()],  # saved Shard(1)
        "dt.repl": [Shard(0)],  # saved Replicate()
        "dt.mixed": [Shard(1)],  # saved [Replicate(), Shard(0)] on a 2-D mesh
        "dt.special": [Shard(0)],  # same placement, other boundaries
    }
    sd: dict[str, Any] = {
        fqn: distribute_tensor(junk(fqn), flat, p) for fqn, p in placements.items()
    }
    if grid is not None:
        placements["dt.grid"] = [Shard(1), Shard(0)]  # saved [Shard(0), Shard(1)]
        sd["dt.grid"] = distribute_tensor(junk("dt.grid"), grid, placements["dt.grid"])
    else:
        placements["dt.grid"] = [Shard(0)]
        sd["dt.grid"] = distribute_tensor(junk("dt.grid"), flat, placements["dt.grid"])
    sd["st.rows"] = _sharded_tensor(junk("st.rows"), world, 1, rank)  # saved chunked on dim 0
    for fqn in REPLICATED[:4] + [f"rank{r}.local" for r in range(SAVE_WORLD)]:
        sd[fqn] = junk(fqn)
    for r in range(SAVE_WORLD):
        sd[f"rank{r}.note"] = "not loaded"
    sd["train"] = {"step": -1, "name": "", "lr": 0.0, "tags": []}
    return sd, placements


def _check_loaded(sd: dict[str, Any], placements: dict[str, list], where: str) -> list[str]:
    """Assert every loaded value bit for bit; return the fqns checked. Collective
    (``full_tensor``): every rank calls it with the same keys in the same order."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    checked = []
    for fqn in sorted(sd):
        value = sd[fqn]
        if isinstance(value, DTensor):
            assert list(value.placements) == placements[fqn], f"{where} {fqn}: placements changed"
            _assert_bits(value.full_tensor(), _full(fqn), f"{where} {fqn} (full)")
            want = distribute_tensor(_full(fqn), value.device_mesh, value.placements).to_local()
            _assert_bits(value.to_local(), want, f"{where} {fqn} (local shard)")
        elif fqn == "st.rows":
            full = _full(fqn)
            for shard in value.local_shards():
                box = full
                for dim, (o, n) in enumerate(
                    zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes, strict=True)
                ):
                    box = box.narrow(dim, o, n)
                _assert_bits(shard.tensor, box, f"{where} {fqn} shard {shard.metadata}")
        elif fqn.endswith(".local"):
            _assert_bits(value, _local_values(int(fqn[4])), f"{where} {fqn}")
        elif isinstance(value, torch.Tensor):
            _assert_bits(value, _full(fqn), f"{where} {fqn}")
        elif fqn == "train":
            assert value == OBJECTS["train"], f"{where} {fqn}: {value!r}"
        else:
            assert value == OBJECTS[fqn], f"{where} {fqn}: {value!r}"
        checked.append(fqn)
    return checked


# ------------------------------------------------------------------- rank bodies
def _rank_save_then_fail(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save GOOD; then a save where rank 2's disk is full; then one where only rank 1
    holds a value that cannot be stored; then load GOOD back."""
    good, failed = os.path.join(root, GOOD), os.path.join(root, FAILED)
    sd = _save_state(rank, world)
    quicksave.save(sd, good, step=1, user_metadata={"run": "dist"})
    dist.barrier()
    assert os.path.isfile(os.path.join(good, "manifest.json")), f"rank {rank}: not committed"
    # The same state through the async engine's multi-rank path (plan cache, parts,
    # store records): it must load exactly like GOOD.
    ctx = DistContext(None, dist.distributed_c10d._get_default_store(), rank, world)
    with AsyncSaver(EngineConfig(mode="thread"), dist_context=ctx) as saver:
        handle = saver.save(sd, os.path.join(root, ASYNC_GOOD), step=1)
        assert handle is not None
        handle.wait(60)

    real_pwrite = os.pwrite

    def full_disk(*_args: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if rank == 2:
        # Only this process is patched; persist writes through os.pwrite.
        os.pwrite = full_disk  # type: ignore[assignment]
    try:
        with pytest.raises(CheckpointError) as info:
            quicksave.save(_save_state(rank, world), failed, step=2)
    finally:
        os.pwrite = real_pwrite  # type: ignore[assignment]
    err = info.value
    dist.barrier()  # the coordinator has cleaned up before the others look
    leftovers = sorted(os.listdir(root))

    # Input checks are local to a rank; the others must not wait forever for rank 1.
    refused = _save_state(rank, world)
    if rank == 1:
        refused["rank1.note"] = object()
    with pytest.raises(IncompatibleStateError) as info:
        quicksave.save(refused, os.path.join(root, REFUSED), step=3)
    dist.barrier()
    leftovers_refused = sorted(os.listdir(root))

    dest, placements = _load_destination(rank, world)
    checked = _check_loaded_after(dest, placements, good, rank)
    return {
        "error_type": type(err).__name__,
        "error": str(err),
        "error_rank": err.rank,
        "leftovers": leftovers,
        "refused": (info.value.fqn, info.value.rank, str(info.value)),
        "leftovers_refused": leftovers_refused,
        "checked": checked,
    }


def _check_loaded_after(dest: dict, placements: dict, path: str, rank: int) -> list[str]:
    quicksave.load(dest, path)
    return _check_loaded(dest, placements, f"rank {rank} loading {path}:")


def _rank_load_and_corrupt(rank: int, world: int, root: str, bad_file: str) -> dict[str, Any]:
    """Load GOOD resharded to ``world`` ranks; then load a copy with one flipped byte in
    the chunk of "dt.cols" that rank 1 wrote (every rank reads it: Replicate)."""
    good = os.path.join(root, GOOD)
    dest, placements = _load_destination(rank, world)
    checked = _check_loaded_after(dest, placements, good, rank)

    corrupt = os.path.join(root, f"corrupt-{world}")
    if rank == 0:
        shutil.copytree(good, corrupt)
        chunk = next(
            c for c in read_manifest(corrupt).tensors["dt.cols"].chunks if c.file == bad_file
        )
        with open(os.path.join(corrupt, bad_file), "r+b") as f:
            f.seek(chunk.offset + chunk.length // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
    dist.barrier()
    dest, _ = _load_destination(rank, world)
    with pytest.raises(CorruptCheckpointError) as info:
        quicksave.load(dest, corrupt)
    err = info.value

    # A destination that does not fit on the last rank only: every rank must fail with it.
    dest, _ = _load_destination(rank, world)
    if rank == world - 1:
        dest["plain.a"] = torch.zeros(65)
    with pytest.raises(IncompatibleStateError) as info:
        quicksave.load(dest, good)
    misfit = info.value
    return {
        "checked": checked,
        "error": str(err),
        "path": err.path,
        "fqn": err.fqn,
        "error_rank": err.rank,
        "misfit": (misfit.fqn, misfit.rank, str(misfit)),
    }


def _rank_crash_while_writing(rank: int, world: int, root: str) -> None:
    """Rank 2's process dies in the middle of writing its data (no Python clean-up)."""
    if rank == 2:
        os.pwrite = lambda *_args: os._exit(3)  # type: ignore[assignment]
    state = {"shared": torch.arange(50.0), f"rank{rank}.local": _local_values(rank)}
    try:
        quicksave.save(state, os.path.join(root, "crashed"))
        outcome = "saved"
    except CheckpointError as e:
        outcome = f"{type(e).__name__}: {e}"
    with open(os.path.join(root, f"outcome-{rank}.txt"), "w") as f:
        f.write(outcome)


def _rank_fail_on_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 gives up")
    dist.barrier()  # rank 0 waits for a peer that is gone


def _rank_hang(rank: int, world: int, pid_dir: str) -> None:
    with open(os.path.join(pid_dir, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3600)


# ------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("dist-ckpt"))
    results = run_ranks(_rank_save_then_fail, SAVE_WORLD, root, config=LAUNCH)
    return root, results


def _data_file_keys(path: str) -> dict[str, set[str]]:
    """Safetensors header keys of every data file (read directly, as a check of the format)."""
    out = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with open(os.path.join(path, name), "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            out[name] = {k for k in header if k != "__metadata__"}
    return out


def test_four_rank_save_layout(saved: tuple[str, list[dict[str, Any]]]) -> None:
    root, _ = saved
    path = os.path.join(root, GOOD)
    m = read_manifest(path)
    assert m.world_size == SAVE_WORLD and m.step == 1 and m.user_metadata == {"run": "dist"}
    data_files = {name: f for name, f in m.files.items() if f.rank is not None}
    for name, f in data_files.items():
        match = re.fullmatch(r"rank-(\d{5})-(\d{2})\.safetensors", name)
        assert match and int(match.group(1)) == f.rank, name
        assert os.path.getsize(os.path.join(path, name)) == f.size, name
    assert {f.rank for f in data_files.values()} == set(range(SAVE_WORLD))
    assert set(m.tensors) == set(TENSORS)
    assert set(m.objects) == {"train.step", "train.name", "train.lr", "train.tags"} | {
        f"rank{r}.note" for r in range(SAVE_WORLD)
    }

    keys = _data_file_keys(path)
    assert set(keys) == set(data_files)
    writer_rank = {}
    for fqn in REPLICATED:
        (chunk,) = m.tensors[fqn].chunks  # written once, though every rank held it
        holders = [name for name, ks in keys.items() if fqn in ks]
        assert holders == [chunk.file], f"{fqn} stored in {holders}"
        with open(os.path.join(path, chunk.file), "rb") as f:
            f.seek(chunk.offset)
            stored = f.read(chunk.length)
        assert stored == _full(fqn).reshape(-1).view(torch.uint8).numpy().tobytes(), fqn
        writer_rank[fqn] = data_files[chunk.file].rank
    assert len(set(writer_rank.values())) > 1, f"replicated tensors all on one rank: {writer_rank}"
    for r in range(SAVE_WORLD):
        (chunk,) = m.tensors[f"rank{r}.local"].chunks
        assert data_files[chunk.file].rank == r
    # Uneven shards: rows 3,3,3,1 (Shard(0)), columns 2,2,2,1 (Shard(1)), and the
    # [Replicate(), Shard(0)] tensor of the 2x2 mesh is two row blocks, each written once.
    assert [c.sizes for c in m.tensors["dt.rows"].chunks] == [(3, 7)] * 3 + [(1, 7)]
    assert [c.sizes for c in m.tensors["dt.cols"].chunks] == [(10, 2)] * 3 + [(10, 1)]
    assert [c.offsets for c in m.tensors["dt.mixed"].chunks] == [(0, 0), (5, 0)]
    assert [c.sizes for c in m.tensors["st.rows"].chunks] == [(3, 7)] * 3 + [(1, 7)]
    assert len(m.tensors["dt.grid"].chunks) == 4


def test_failed_rank_save_commits_nothing(saved: tuple[str, list[dict[str, Any]]]) -> None:
    root, results = saved
    for rank, res in enumerate(results):
        assert res["error_type"] == "CheckpointError", (rank, res["error"])
        assert res["error_rank"] == 2, (rank, res["error"])
        assert "ENOSPC" in res["error"] and "rank=2" in res["error"], (rank, res["error"])
        # the file it was writing: in the checkpoint's hidden temporary beside it
        assert os.path.join(root, f".quicksave.{FAILED}.tmp-") in res["error"], (rank, res)
        assert res["leftovers"] == [ASYNC_GOOD, GOOD], (rank, res["leftovers"])  # no tmp
        assert set(res["checked"]) >= set(TENSORS), rank  # the previous one still loads
    assert not os.path.exists(os.path.join(root, FAILED))


def test_input_refused_on_one_rank_fails_every_rank(
    saved: tuple[str, list[dict[str, Any]]],
) -> None:
    root, results = saved
    for rank, res in enumerate(results):
        fqn, err_rank, text = res["refused"]
        assert (fqn, err_rank) == ("rank1.note", 1), (rank, text)
        assert "object" in text and "rank=1" in text, (rank, text)
        assert res["leftovers_refused"] == [ASYNC_GOOD, GOOD], (rank, res["leftovers_refused"])


def test_rank_crash_during_save_fails_the_others_and_commits_nothing(tmp_path) -> None:
    with pytest.raises(AssertionError) as info:
        run_ranks(_rank_crash_while_writing, SAVE_WORLD, str(tmp_path), config=LAUNCH)
    text = str(info.value)
    assert text.startswith("1 of 4 ranks failed") and "--- rank 2 exited with code 3" in text
    for rank in (0, 1, 3):
        outcome = (tmp_path / f"outcome-{rank}.txt").read_text()
        assert outcome.startswith(
            "CheckpointError: a collective with the other ranks failed (did a rank crash or "
            "time out? see its log); nothing was committed: "
        ), outcome
        assert f"rank={rank}]" in outcome, outcome
    assert classify(str(tmp_path / "crashed")) is CheckpointKind.MISSING
    others = set(os.listdir(tmp_path)) - {f"outcome-{r}.txt" for r in (0, 1, 3)}
    assert all(is_temp_name(n) for n in others), others  # never anything that looks committed


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_resharded_load_and_corruption(saved: tuple[str, list[dict[str, Any]]], world: int) -> None:
    root, _ = saved
    bad_file = next(
        c.file
        for c in read_manifest(os.path.join(root, GOOD)).tensors["dt.cols"].chunks
        if c.file.startswith("rank-00001-")
    )
    results = run_ranks(_rank_load_and_corrupt, world, root, bad_file, config=LAUNCH)
    expected_keys = set(TENSORS) | {f"rank{r}.note" for r in range(SAVE_WORLD)} | {"train"}
    for rank, res in enumerate(results):
        assert set(res["checked"]) == expected_keys, rank
        assert res["path"] == os.path.join(root, f"corrupt-{world}", bad_file), res["error"]
        assert res["fqn"] == "dt.cols" and "checksum mismatch" in res["error"], res["error"]
        # Every rank read the flipped chunk itself and reported it.
        assert res["error_rank"] == 0, res["error"]
        for other in range(1, world):
            assert f"rank {other}: CorruptCheckpointError" in res["error"], res["error"]
        fqn, err_rank, text = res["misfit"]
        assert (fqn, err_rank) == ("plain.a", world - 1), text
        assert "shape mismatch: checkpoint [64], state dict [65]" in text, text


def _rank_load(rank: int, world: int, path: str) -> list[str]:
    dest, placements = _load_destination(rank, world)
    return _check_loaded_after(dest, placements, path, rank)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_async_engine_checkpoint_loads_resharded(
    saved: tuple[str, list[dict[str, Any]]], world: int
) -> None:
    root, _ = saved
    path = os.path.join(root, ASYNC_GOOD)
    assert read_manifest(path).world_size == SAVE_WORLD
    results = run_ranks(_rank_load, world, path, config=LAUNCH)
    expected_keys = set(TENSORS) | {f"rank{r}.note" for r in range(SAVE_WORLD)} | {"train"}
    for rank, checked in enumerate(results):
        assert set(checked) == expected_keys, rank


@pytest.mark.parametrize("name", [GOOD, ASYNC_GOOD])
def test_load_in_plain_process(saved: tuple[str, list[dict[str, Any]]], name: str) -> None:
    root, _ = saved
    assert not (dist.is_available() and dist.is_initialized())
    dest: dict[str, Any] = {
        fqn: torch.zeros(shape, dtype=dt) for fqn, (dt, shape) in TENSORS.items()
    }
    dest.update({f"rank{r}.note": "" for r in range(SAVE_WORLD)})
    dest["train"] = {"step": 0, "name": "", "lr": 0.0, "tags": []}
    quicksave.load(dest, os.path.join(root, name))
    for fqn in TENSORS:
        want = _local_values(int(fqn[4])) if fqn.endswith(".local") else _full(fqn)
        _assert_bits(dest[fqn], want, fqn)
    assert dest["train"] == OBJECTS["train"]
    assert all(dest[f"rank{r}.note"] == OBJECTS[f"rank{r}.note"] for r in range(SAVE_WORLD))


def test_launcher_reports_the_failing_rank() -> None:
    with pytest.raises(AssertionError) as info:
        run_ranks(_rank_fail_on_one, 2, config=LaunchConfig(timeout_s=60.0, grace_s=5.0))
    text = str(info.value)
    assert "--- rank 1 raised:" in text and "ValueError: rank 1 gives up" in text
    assert text.index("--- rank 1") < text.index("--- rank 0")  # the cause comes first


def _gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_launcher_kills_a_hung_group(tmp_path) -> None:
    with pytest.raises(AssertionError) as info:
        run_ranks(_rank_hang, 2, str(tmp_path), config=LaunchConfig(timeout_s=12.0))
    text = str(info.value)
    assert "--- rank 0 was killed: the group ran past 12 s" in text
    assert "--- rank 1 was killed: the group ran past 12 s" in text
    pids = [int((tmp_path / f"{r}.pid").read_text()) for r in range(2)]
    deadline = time.monotonic() + 10.0  # SIGKILL was sent; allow for reaping
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids), pids
