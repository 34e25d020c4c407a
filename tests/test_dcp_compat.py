"""``dcp_compat`` layouts: a quicksave checkpoint that DCP's stock ``FileSystemReader``
(and MSC's ``MultiStorageFileSystemReader``, which is one) loads bit-exact, because every
chunk is preceded by its torch legacy-serialization prefix and the objects follow the
``.metadata`` pickle as ``torch.save`` bytes (docs/FORMAT.md §3, §5)."""

from __future__ import annotations

import io
import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

import quicksave
from helpers.state import assert_bit_equal, random_tensor, storable_dtypes
from quicksave.compat.nvrx.filesystem_async import FileSystemWriterAsync
from quicksave.format.safetensors_header import parse_header
from quicksave.format.torch_legacy import TORCH_LEGACY_PREFIX, legacy_prefix, storage_type_name
from quicksave.layout.plan import ItemSpec, layout_file
from quicksave.loading.verify import verify_checkpoint


def _dcp_dtypes() -> list[torch.dtype]:
    """Storable dtypes that DCP's planner can size (it fails on sub-byte ones)."""
    out = []
    for d in storable_dtypes():
        try:
            torch._utils._element_size(d)
        except (TypeError, RuntimeError):
            continue
        out.append(d)
    return out


def _prefixed(d: torch.dtype) -> bool:
    return storage_type_name(d) is not None


def _state() -> dict:
    sd: dict = {
        f"t.{str(d)[6:]}": random_tensor((5, 3), d, seed=i) for i, d in enumerate(_dcp_dtypes())
    }
    sd["big"] = random_tensor((300, 41), torch.float32, seed=99)  # spans several pages
    sd["scalar"] = random_tensor((), torch.float64, seed=98)
    sd["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    sd["step"] = 1234
    sd["cfg"] = {"lr": 0.5, "betas": (0.9, 0.99), "name": "x", "blob": b"\x00\xff"}
    return sd


def _zeros(sd: dict) -> dict:
    out: dict = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = _zeros(v)
        else:
            out[k] = torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
    return out


@pytest.mark.parametrize("thread_count", [1, 3])
def test_stock_reader_loads_every_prefixed_dtype_and_objects(ckpt: Path, thread_count: int):
    sd = _state()
    dcp.save(
        sd,
        storage_writer=quicksave.StorageWriter(
            ckpt, dcp_compat=True, fsync=False, thread_count=thread_count
        ),
    )
    assert verify_checkpoint(ckpt).ok, verify_checkpoint(ckpt).problems
    raw_only = {k for k, v in sd.items() if isinstance(v, torch.Tensor) and not _prefixed(v.dtype)}
    assert raw_only  # float8, uint16/32/64, complex32, bits*: no legacy storage type
    target = {k: v for k, v in _zeros(sd).items() if k not in raw_only}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=FileSystemReader(ckpt))
    for k, v in sd.items():
        if k in raw_only:
            continue
        if isinstance(v, torch.Tensor):
            assert_bit_equal(target[k], v, k)
        else:
            assert target[k] == v, k
    # quicksave's own reader loads everything, the raw-only dtypes included
    back = _zeros(sd)
    quicksave.load(back, ckpt)
    for k in raw_only:
        assert_bit_equal(back[k], sd[k], k)


def test_stock_reader_fails_on_raw_only_dtypes(ckpt: Path):
    sd = {"f8": random_tensor((4,), torch.float8_e4m3fn, seed=1)}
    dcp.save(sd, storage_writer=quicksave.StorageWriter(ckpt, dcp_compat=True, fsync=False))
    assert verify_checkpoint(ckpt).ok
    with pytest.raises(CheckpointException), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(_zeros(sd), storage_reader=FileSystemReader(ckpt))


def _save_sharded(path: Path, tensors: dict[str, torch.Tensor], world: int) -> None:
    """Drive ``quicksave.StorageWriter`` as DCP does for ``world`` ranks, rank r holding
    rows ``r::world``-blocks (torch.chunk along dim 0) of every tensor."""

    class _Planner:
        def __init__(self, data: dict[MetadataIndex, torch.Tensor]) -> None:
            self.data = data

        def resolve_data(self, item: WriteItem) -> torch.Tensor:
            return self.data[item.index]

    writer = quicksave.StorageWriter(path, dcp_compat=True, fsync=False, thread_count=2)
    plans, planners = [], []
    md: dict = {}
    for r in range(world):
        items, data = [], {}
        for fqn, t in tensors.items():
            pieces = torch.chunk(t, world, dim=0)
            row = sum(p.shape[0] for p in pieces[:r])
            if r >= len(pieces):
                continue
            piece = pieces[r]
            offsets = torch.Size([row] + [0] * (t.dim() - 1))
            chunk = ChunkStorageMetadata(offsets, piece.shape)
            idx = MetadataIndex(fqn, offsets)
            items.append(
                WriteItem(
                    index=idx,
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk, TensorProperties(dtype=t.dtype), t.shape),
                )
            )
            data[idx] = piece
            md.setdefault(fqn, TensorStorageMetadata(TensorProperties(dtype=t.dtype), t.shape, []))
            md[fqn].chunks.append(chunk)
        writer.set_up_storage_writer(r == 0, rank=r)
        plans.append(writer.prepare_local_plan(SavePlan(items)))
        planners.append(_Planner(data))
    central = writer.prepare_global_plan(plans)
    results = [writer.write_data(central[r], planners[r]).wait() for r in range(world)]
    writer.finish(Metadata(state_dict_metadata=md), results)


def test_sharded_chunks_load_with_stock_reader(ckpt: Path):
    tensors = {
        "w": random_tensor((37, 11), torch.float32, seed=1),
        "h": random_tensor((9, 4, 3), torch.bfloat16, seed=2),
        "i": random_tensor((5,), torch.int64, seed=3),
        "c": random_tensor((6, 2), torch.complex128, seed=4),
        "f8": random_tensor((8, 3), torch.float8_e5m2, seed=5),  # raw-only
    }
    _save_sharded(ckpt, tensors, world=3)
    report = verify_checkpoint(ckpt)
    assert report.ok, report.problems
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert len(manifest["tensors"]["w"]["chunks"]) == 3
    stock = {k: torch.zeros_like(v) for k, v in tensors.items() if k != "f8"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(stock, storage_reader=FileSystemReader(ckpt))
    for k, v in stock.items():
        assert_bit_equal(v, tensors[k], k)
    back = {k: torch.zeros_like(v) for k, v in tensors.items()}
    quicksave.load(back, ckpt)
    for k, v in back.items():
        assert_bit_equal(v, tensors[k], k)


def _prefix_entries(path: Path) -> list[tuple[str, int, int]]:
    out = []
    for f in sorted(path.glob("*.safetensors")):
        data = f.read_bytes()
        n = int.from_bytes(data[:8], "little")
        _, entries = parse_header(data[8 : 8 + n], len(data), str(f))
        out += [(f.name, e.start, e.end) for e in entries if e.name.startswith(TORCH_LEGACY_PREFIX)]
    return out


def test_verify_catches_a_flipped_prefix_byte(ckpt: Path):
    sd = {"w": random_tensor((64, 8), torch.float32, seed=1), "step": 3}
    dcp.save(sd, storage_writer=quicksave.StorageWriter(ckpt, dcp_compat=True, fsync=False))
    (name, start, end), *_ = _prefix_entries(ckpt)
    f = ckpt / name
    data = bytearray(f.read_bytes())
    data[(start + end) // 2] ^= 0x40
    f.write_bytes(bytes(data))
    problems = verify_checkpoint(ckpt).problems
    assert [(p.file, p.fqn, p.kind) for p in problems] == [(name, "w", "prefix")], problems


def test_layout_places_prefix_right_before_aligned_chunks():
    items = [
        ItemSpec("a", (0,), (10,), (10,), "float32", 40),
        ItemSpec("b", (0, 0), (3, 5), (3, 5), "bfloat16", 30),
        ItemSpec("c", (0,), (4,), (4,), "float8_e4m3fn", 4),  # raw-only
    ]
    plain = layout_file("f", 0, items)
    compat = layout_file("f", 0, items, dcp_compat=True)
    assert plain.fixed == ()
    assert layout_file("f", 0, items, dcp_compat=False) == plain
    assert [len(b) for _, b in compat.fixed] == [
        len(legacy_prefix(torch.float32, (10,))),
        len(legacy_prefix(torch.bfloat16, (3, 5))),
    ]
    for (off, b), e in zip(compat.fixed, compat.entries[:2], strict=True):
        assert e.offset % 4096 == 0 and off + len(b) == e.offset
    assert compat.entries[2].offset % 4096 == 0
    # The bytes laid out before each chunk are a legacy torch.save's head (computed afresh,
    # not from the cache): followed by the tensor's raw bytes, torch.load reads the tensor.
    for (_, b), (dtype, shape) in zip(
        compat.fixed, [(torch.float32, (10,)), (torch.bfloat16, (3, 5))], strict=True
    ):
        assert bytes(b) == legacy_prefix.__wrapped__(dtype, shape)
        t = torch.randn(shape).to(dtype)
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        loaded = torch.load(io.BytesIO(bytes(b) + raw), weights_only=True)
        assert loaded.dtype == dtype and torch.equal(loaded, t)


def test_filesystem_writer_async_defaults_to_dcp_compat(tmp_path: Path):
    assert FileSystemWriterAsync(tmp_path / "a").dcp_compat is True
    assert FileSystemWriterAsync(tmp_path / "b", dcp_compat=False).dcp_compat is False
    assert quicksave.StorageWriter(tmp_path / "c").dcp_compat is False


def test_metadata_pickle_then_objects(ckpt: Path):
    sd = {"w": torch.ones(3), "step": 7, "note": "hi"}
    dcp.save(sd, storage_writer=quicksave.StorageWriter(ckpt, dcp_compat=True, fsync=False))
    raw = (ckpt / ".metadata").read_bytes()
    f = io.BytesIO(raw)
    md = pickle.load(f)
    for fqn, value in (("step", 7), ("note", "hi")):
        info = md.storage_data[MetadataIndex(fqn)]
        assert info.relative_path == ".metadata" and info.offset >= f.tell()
        blob = raw[info.offset : info.offset + info.length]
        assert torch.load(io.BytesIO(blob), weights_only=True) == value
    # same state, same bytes
    again = ckpt.parent / "again"
    dcp.save(sd, storage_writer=quicksave.StorageWriter(again, dcp_compat=True, fsync=False))
    assert (again / ".metadata").read_bytes() == raw
