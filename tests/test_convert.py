"""quicksave.tools.convert: the full state, bit-exact, in torch.save / stock DCP / safetensors."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file

import quicksave
from helpers.state import assert_bit_equal, assert_same_value, random_tensor
from quicksave.errors import CheckpointExistsError, CorruptCheckpointError, NotCommittedError
from quicksave.format import MANIFEST_NAME
from quicksave.format import objects as objcodec
from quicksave.format.manifest import (
    ChunkEntry,
    FileEntry,
    Manifest,
    ObjectEntry,
    TensorEntry,
    to_json_bytes,
)
from quicksave.layout.plan import ItemSpec, layout_rank
from quicksave.loading.verify import verify_checkpoint
from quicksave.storage.local import LocalBackend
from quicksave.tools.convert import convert, load_full_state
from quicksave.worker.persist import write_rank

# Stock DCP calls in one process warn that torch.distributed is off; that is intended here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def original_state() -> dict:
    return {
        "model": {
            "w": random_tensor((5, 3), torch.float32, seed=1),  # NaNs and infs included
            "h": random_tensor((4,), torch.bfloat16, seed=2),
            "layers": [
                random_tensor((2,), torch.int64, seed=3),
                random_tensor((3,), torch.float16, seed=4),
            ],
        },
        "flag": torch.tensor([True, False]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "opt": {"lr": 0.001, "betas": (0.9, 0.999), "name": "adamw", "eps": [1e-8]},
        "step": 12,
    }


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "step-12"
    quicksave.save(original_state(), path, step=12, user_metadata={"k": "v"})
    return path


def assert_tree_equal(actual, expected, where: str = "state") -> None:
    """Like assert_same_value but independent of dict key order."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), where
        for k in expected:
            assert_tree_equal(actual[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_tree_equal(a, e, f"{where}[{i}]")
    else:
        assert_same_value(actual, expected, where)


def test_load_full_state_rebuilds_nesting(checkpoint: Path) -> None:
    state, manifest = load_full_state(checkpoint)
    assert manifest.step == 12
    assert_tree_equal(state, original_state())


def test_to_torch_loads_with_weights_only(checkpoint: Path, tmp_path: Path) -> None:
    out = convert(checkpoint, tmp_path / "full.pt", "torch")
    assert out == str(tmp_path / "full.pt")
    assert_tree_equal(torch.load(out, weights_only=True), original_state())


def test_to_dcp_loads_with_stock_dcp_load(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "as-dcp"
    convert(checkpoint, out, "dcp")
    dest = {
        "model": {
            "w": torch.zeros(5, 3),
            "h": torch.zeros(4, dtype=torch.bfloat16),
            "layers": [torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.float16)],
        },
        "flag": torch.zeros(2, dtype=torch.bool),
        "scalar": torch.tensor(0.0, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "opt": {"lr": 0.0, "betas": None, "name": None, "eps": None},
        "step": 0,
    }
    dcp.load(dest, checkpoint_id=str(out))  # stock, default FileSystemReader
    assert_tree_equal(dest, original_state())
    assert not any(".tmp-" in n for n in os.listdir(tmp_path))


def test_to_safetensors(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    convert(checkpoint, out, "safetensors")
    tensors = load_file(out)
    expected = original_state()
    assert set(tensors) == {
        "model.w",
        "model.h",
        "model.layers.0",
        "model.layers.1",
        "flag",
        "scalar",
        "empty",
    }
    assert_bit_equal(tensors["model.w"], expected["model"]["w"])
    assert_bit_equal(tensors["model.layers.1"], expected["model"]["layers"][1])
    assert_bit_equal(tensors["scalar"], expected["scalar"])
    with safe_open(out, "pt") as f:
        meta = f.metadata()
    objects = json.loads(meta["quicksave.objects"])
    assert objcodec.decode(objects["opt.betas"]["value"]) == (0.9, 0.999)
    assert objects["opt.betas"]["path"] == ["opt", "betas"]
    assert objects["step"] == {"value": 12}
    assert json.loads(meta["quicksave.paths"])["model.layers.0"] == ["model", "layers", 0]
    assert (meta["quicksave.step"], json.loads(meta["quicksave.user_metadata"])) == (
        "12",
        {"k": "v"},
    )
    assert "quicksave.raw_dtypes" not in meta


def test_safetensors_stores_unsupported_dtypes_as_raw_bytes(tmp_path: Path) -> None:
    value = random_tensor((2, 3), torch.complex128, seed=5)
    quicksave.save({"z": value}, tmp_path / "ck")
    convert(tmp_path / "ck", tmp_path / "z.safetensors", "safetensors")
    stored = load_file(tmp_path / "z.safetensors")["z"]
    with safe_open(tmp_path / "z.safetensors", "pt") as f:
        raw = json.loads(f.metadata()["quicksave.raw_dtypes"])
    assert raw == {"z": {"dtype": "complex128", "shape": [2, 3]}}
    assert stored.dtype == torch.uint8 and stored.shape == (96,)
    assert_bit_equal(stored.view(torch.complex128).reshape(raw["z"]["shape"]), value)


def test_refuses_existing_output_and_leaves_nothing_behind(
    checkpoint: Path, tmp_path: Path
) -> None:
    for target in ("torch", "dcp", "safetensors"):
        out = tmp_path / f"exists-{target}"
        out.mkdir()
        with pytest.raises(CheckpointExistsError, match="output already exists") as e:
            convert(checkpoint, out, target)
        assert e.value.path == str(out) and os.listdir(out) == []
    names = set(os.listdir(tmp_path))
    assert not any(".tmp-" in n for n in names)


def test_corrupt_input_fails_before_writing(checkpoint: Path, tmp_path: Path) -> None:
    manifest = json.loads((checkpoint / MANIFEST_NAME).read_bytes())
    chunk = manifest["tensors"]["model.h"]["chunks"][0]
    with open(checkpoint / chunk["file"], "r+b") as f:
        f.seek(chunk["offset"] + 1)
        f.write(b"\xee")
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as e:
        convert(checkpoint, tmp_path / "o.pt", "torch")
    assert (e.value.fqn, e.value.rank) == ("model.h", 0)
    assert e.value.path == str(checkpoint / chunk["file"])
    assert not (tmp_path / "o.pt").exists()


def test_uncommitted_input_is_refused(tmp_path: Path) -> None:
    tmp = tmp_path / "a.tmp-0123456789ab"
    tmp.mkdir()
    with pytest.raises(NotCommittedError):
        convert(tmp, tmp_path / "o.pt", "torch")


# ----------------------------------------------------------------- sharded checkpoints
def write_sharded_checkpoint(
    path: Path, full: dict[str, torch.Tensor], splits: dict[str, int]
) -> None:
    """A 2-rank checkpoint: tensor ``fqn`` split along dim 0 at ``splits[fqn]`` (rank 0
    gets the rows before it, rank 1 the rest); written with quicksave's own layout and
    persist stages so the bytes are exactly what a 2-rank save produces."""
    path.mkdir()
    items: list[list[tuple[ItemSpec, torch.Tensor]]] = [[], []]
    for fqn, t in full.items():
        cut = splits[fqn]
        for rank, (lo, hi) in enumerate(((0, cut), (cut, t.shape[0]))):
            piece = t[lo:hi].contiguous()
            spec = ItemSpec(
                fqn,
                (lo,) + (0,) * (t.dim() - 1),
                tuple(piece.shape),
                tuple(t.shape),
                str(t.dtype).removeprefix("torch."),
                piece.numel() * piece.element_size(),
            )
            items[rank].append((spec, piece))
    chunks: dict[str, list[ChunkEntry]] = {fqn: [] for fqn in full}
    files: dict[str, FileEntry] = {}
    for rank, rank_items in enumerate(items):
        layout = layout_rank(rank, [spec for spec, _ in rank_items], n_files=1)
        by_key = {spec.key: piece for spec, piece in rank_items}
        (written,) = write_rank(LocalBackend(fsync=False), str(path), layout, by_key)
        (flayout,) = layout.files
        files[flayout.name] = FileEntry(
            written.size, written.header_xxh3_64, rank, flayout.data_start
        )
        for e in flayout.entries:
            chunks[e.item.fqn].append(
                ChunkEntry(
                    e.item.offsets,
                    e.item.sizes,
                    flayout.name,
                    e.offset,
                    e.length,
                    written.chunk_xxh3_64[e.item.key],
                )
            )
    manifest = Manifest(
        step=3,
        world_size=2,
        tensors={
            fqn: TensorEntry(
                str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(chunks[fqn])
            )
            for fqn, t in full.items()
        },
        objects={"note": ObjectEntry("sharded")},
        files=files,
    )
    (path / MANIFEST_NAME).write_bytes(to_json_bytes(manifest))


def test_sharded_checkpoint_is_consolidated(tmp_path: Path) -> None:
    full = {
        "w": random_tensor((5, 4), torch.float32, seed=7),
        "v": random_tensor((6,), torch.int16, seed=8),
    }
    ck = tmp_path / "sharded"
    write_sharded_checkpoint(ck, full, {"w": 2, "v": 3})
    assert verify_checkpoint(ck).ok  # the hand-built checkpoint is well formed
    state, manifest = load_full_state(ck)
    assert manifest.world_size == 2 and len(manifest.tensors["w"].chunks) == 2
    assert_bit_equal(state["w"], full["w"])
    assert_bit_equal(state["v"], full["v"])
    assert state["note"] == "sharded"
    convert(ck, tmp_path / "s.safetensors", "safetensors")
    assert_bit_equal(load_file(tmp_path / "s.safetensors")["w"], full["w"])

    # A byte flipped in rank 1's chunk of "w" is reported with that fqn.
    chunk = manifest.tensors["w"].chunks[1]
    with open(ck / chunk.file, "r+b") as f:
        f.seek(chunk.offset + chunk.length - 1)
        last = f.read(1)[0]
        f.seek(chunk.offset + chunk.length - 1)
        f.write(bytes([last ^ 0x80]))
    problems = verify_checkpoint(ck).problems
    assert [(p.file, p.fqn, p.kind) for p in problems] == [(chunk.file, "w", "chunk")]
    with pytest.raises(CorruptCheckpointError) as e:
        load_full_state(ck)
    assert (e.value.fqn, e.value.rank) == ("w", 1)
    assert math.prod(chunk.sizes) == 12
