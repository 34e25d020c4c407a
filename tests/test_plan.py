"""Planning is pure: file layouts computed from chunk specs alone, no I/O."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from quicksave.adapters.dcp_save_planner import DcpSavePlanner
from quicksave.layout.plan import (
    PAD_PREFIX,
    ItemSpec,
    chunk_key,
    data_file_name,
    layout_file,
    layout_rank,
)


def _item(fqn: str, nbytes: int, dtype: str = "uint8", offsets=(0,), shape=None) -> ItemSpec:
    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    sizes = (nbytes // size,)
    return ItemSpec(fqn, tuple(offsets), sizes, shape or sizes, dtype, nbytes)


def _header(layout) -> dict:
    (n,) = struct.unpack("<Q", layout.header[:8])
    assert 8 + n == layout.data_start == len(layout.header)
    text = layout.header[8:]
    assert text.rstrip(b" ").endswith(b"}")  # JSON, then space padding up to data_start
    return json.loads(text)


def test_names():
    assert data_file_name(3, 1) == "rank-00003-01.safetensors"
    assert chunk_key("w", (0, 0), (4, 4), (4, 4)) == "w"
    assert chunk_key("w", (4, 0), (4, 4), (8, 4)) == "w@4,0"
    assert chunk_key("w", (0, 0), (4, 4), (8, 4)) == "w@0,0"
    assert chunk_key("s", (), (), ()) == "s"


def test_layout_aligns_every_chunk_and_pads_the_gaps():
    items = [_item("a", 10), _item("b", 5000), _item("c", 4096), _item("d", 0), _item("e", 1)]
    f = layout_file("rank-00000-00.safetensors", 0, items)
    assert f.data_start % 4096 == 0
    assert [e.item.fqn for e in f.entries] == ["a", "b", "c", "d", "e"]
    starts = [e.offset for e in f.entries]
    assert all(s % 4096 == 0 for s in starts)
    assert starts == [4096, 8192, 16384, 20480, 20480]
    assert f.size == 20481 and f.payload_bytes == 10 + 5000 + 4096 + 1
    header = _header(f)
    assert header.pop("__metadata__") == {"format": "quicksave", "format_version": "1", "rank": "0"}
    spans = sorted(tuple(v["data_offsets"]) for v in header.values())
    pos = 0
    for lo, hi in spans:  # safetensors requires the entries to tile the data region
        assert lo == pos
        pos = hi
    assert f.data_start + pos == f.size
    pads = {k: v for k, v in header.items() if k.startswith(PAD_PREFIX)}
    assert all(
        v["dtype"] == "U8" and v["shape"] == [v["data_offsets"][1] - v["data_offsets"][0]]
        for v in pads.values()
    )
    assert len(pads) == 2  # after "a" and after "b"; "c" ends aligned


def test_non_native_dtypes_are_described_as_bytes():
    items = [
        _item("f8", 8, "float8_e8m0fnu"),
        _item("c32", 16, "complex32"),
        _item("bf", 8, "bfloat16"),
        _item("u3", 3, "uint3"),
    ]
    header = _header(layout_file("x", 0, items))
    assert header["f8"]["dtype"] == "U8" and header["f8"]["shape"] == [8]
    assert header["c32"]["dtype"] == "U8" and header["c32"]["shape"] == [16]
    assert header["u3"]["dtype"] == "U8"
    assert header["bf"]["dtype"] == "BF16" and header["bf"]["shape"] == [4]


def test_layout_is_deterministic_and_pure():
    items = [_item(f"t{i}", 100 * i + 1) for i in range(20)]
    a = layout_rank(2, items, n_files=3)
    b = layout_rank(2, list(reversed(items)), n_files=3)
    assert a == b
    assert [f.name for f in a.files] == [data_file_name(2, i) for i in range(3)]
    assert all(f.rank == 2 for f in a.files)


def test_split_balances_bytes_across_files():
    items = [_item("big", 1000), *[_item(f"s{i}", 100) for i in range(10)]]
    layout = layout_rank(0, items, n_files=2)
    loads = sorted(f.payload_bytes for f in layout.files)
    assert loads == [1000, 1000]
    keys = sorted(e.item.key for f in layout.files for e in f.entries)
    assert keys == sorted(i.key for i in items)  # every chunk placed exactly once


def test_a_tensor_in_several_chunks_is_laid_out_after_the_whole_ones():
    # an incremental save's row blocks (here "base", 4 blocks) go after the tensors held
    # whole, whatever their names: the chunks written at every save lie together
    blocks = [_item("base", 1000, offsets=(1000 * i,), shape=(4000,)) for i in range(4)]
    whole = [_item(name, 300) for name in ("a.lora", "z.lora", "base_norm")]
    layout = layout_rank(0, [*blocks, *whole], n_files=2)
    for f in layout.files:
        names = [e.item.fqn for e in f.entries]
        assert names == sorted(n for n in names if n != "base") + ["base"] * names.count("base")
        offsets = [e.offset for e in f.entries]
        assert offsets == sorted(offsets)
    assert sum(e.item.fqn == "base" for f in layout.files for e in f.entries) == 4
    assert any(f.entries[0].item.fqn != "base" for f in layout.files)


@pytest.mark.parametrize("n_files, expected", [(0, 1), (1, 1), (4, 3), (10, 3)])
def test_file_count_is_bounded_by_items(n_files: int, expected: int):
    items = [_item("a", 1), _item("b", 2), _item("c", 3)]
    assert len(layout_rank(0, items, n_files=n_files).files) == expected


def test_rank_without_items_writes_no_file():
    assert layout_rank(5, [], n_files=4).files == ()
    assert layout_rank(5, []).total_bytes == 0


def test_chunks_of_one_tensor_get_distinct_keys():
    items = [
        ItemSpec("w", (0, 0), (2, 4), (4, 4), "float32", 32),
        ItemSpec("w", (2, 0), (2, 4), (4, 4), "float32", 32),
    ]
    header = _header(layout_file("x", 1, items))
    assert {"w@0,0", "w@2,0"} <= set(header)
    assert header["w@2,0"]["shape"] == [2, 4] and header["w@2,0"]["dtype"] == "F32"


# ------------------------------------------------------------ dedup of replicated chunks


def _write_item(fqn: str, n: int, dtype: torch.dtype) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size([0])),
        type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size([0]), torch.Size([n])),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size([n]),
        ),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint3, torch.bits16, torch.int7])
def test_replicated_items_are_written_once_balanced_by_bytes(dtype: torch.dtype):
    items = [_write_item(f"p{i}", 100 * (i + 1), dtype) for i in range(6)]
    plans = [SavePlan(items=list(items)) for _ in range(3)]
    planner = DcpSavePlanner()
    out = planner._dedup_save_plans(plans)
    owners = [i.index.fqn for p in out for i in p.items]
    assert sorted(owners) == [f"p{i}" for i in range(6)]
    size = torch.empty((), dtype=dtype).element_size()
    loads = [sum(i.tensor_data.chunk.sizes[0] * size for i in p.items) for p in out]
    assert all(load > 0 for load in loads)  # every rank takes part in writing


def test_dedup_to_lowest_rank_policy():
    items = [_write_item(f"p{i}", 10, torch.float32) for i in range(4)]
    planner = DcpSavePlanner()
    planner.dedup_save_to_lowest_rank = True
    out = planner._dedup_save_plans([SavePlan(items=list(items)) for _ in range(3)])
    assert [len(p.items) for p in out] == [4, 0, 0]
