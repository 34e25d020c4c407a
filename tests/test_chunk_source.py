"""The reader resolves each chunk to the checkpoint that holds it
(:class:`quicksave.loading.chunks.ChunkSource`): a test double that sends the chunks of
some tensors to a second, earlier checkpoint proves that every read path (the reader of
``dcp.load`` / ``quicksave.load`` and ``read_flat`` of ``load_state`` / ``convert``)
reads them from there, bit-exactly, and reads the others from the checkpoint itself."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tests.helpers.state import assert_bit_equal, random_tensor

import quicksave
from quicksave.errors import CorruptCheckpointError
from quicksave.format.manifest import ChunkEntry
from quicksave.storage import Location, parse_location
from quicksave.tools.read_full import read_flat


@dataclass
class EarlierCheckpoint:
    """Chunks of the tensors in ``fqns`` are in the same file of ``earlier``; the rest
    in the checkpoint being read. Records what it was asked."""

    earlier: Location
    fqns: set[str]
    asked: list[str] = field(default_factory=list)

    def locate(self, checkpoint: Location, fqn: str, entry: ChunkEntry) -> tuple[Location, str]:
        self.asked.append(fqn)
        return (self.earlier if fqn in self.fqns else checkpoint), entry.file


def _zero_chunks_of(ckpt: Path, fqn: str) -> None:
    """Overwrite the stored bytes of every chunk of ``fqn`` in ``ckpt`` with zeros: read
    from there, they fail their checksums."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for c in manifest["tensors"][fqn]["chunks"]:
        with open(ckpt / c["file"], "r+b") as f:
            f.seek(c["offset"])
            f.write(b"\0" * c["length"])


@pytest.fixture
def two(tmp_path: Path) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """``step-1`` and ``step-2`` store the same ``frozen`` (bf16) and ``emb`` (fp32;
    the two in different data files) but different ``head``; step-2's own bytes of
    ``frozen`` and ``emb`` are zeroed. Returns both paths and step-2's state."""
    frozen = random_tensor((64, 8), torch.bfloat16, seed=1)
    emb = random_tensor((33, 7), torch.float32, seed=2)
    first = {"frozen": frozen, "emb": emb, "head": random_tensor((5,), torch.float32, seed=3)}
    second = {"frozen": frozen, "emb": emb, "head": random_tensor((5,), torch.float32, seed=4)}
    quicksave.save(first, tmp_path / "step-1")
    quicksave.save(second, tmp_path / "step-2")
    for fqn in ("frozen", "emb"):
        _zero_chunks_of(tmp_path / "step-2", fqn)
    return tmp_path / "step-1", tmp_path / "step-2", second


def _dcp_load(out: dict[str, torch.Tensor], reader: quicksave.StorageReader) -> None:
    with warnings.catch_warnings():  # DCP: torch.distributed is not initialized
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=reader, no_dist=True)


def test_without_the_source_the_zeroed_chunks_fail(two) -> None:
    _, second, expected = two
    out = {k: torch.zeros_like(v) for k, v in expected.items()}
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        quicksave.load(out, second)


def test_the_reader_reads_each_chunk_from_the_checkpoint_holding_it(two) -> None:
    first, second, expected = two
    source = EarlierCheckpoint(parse_location(first), {"frozen", "emb"})
    out = {k: torch.zeros_like(v) for k, v in expected.items()}
    _dcp_load(out, quicksave.StorageReader(second, chunks=source))
    for fqn, value in expected.items():
        assert_bit_equal(out[fqn], value, fqn)
    assert set(source.asked) == {"frozen", "emb", "head"}


def test_resharded_reads_and_unordered_destinations_too(two) -> None:
    """Destinations that are not the stored chunk as it is (a slice of a larger
    tensor, another layout) are filled through a buffer, from the same source."""
    first, second, expected = two
    source = EarlierCheckpoint(parse_location(first), {"frozen", "emb"})
    out = {
        "frozen": torch.zeros(8, 64, dtype=torch.bfloat16).t(),  # not contiguous
        "emb": torch.zeros_like(expected["emb"]),
        "head": torch.zeros_like(expected["head"]),
    }
    reader = quicksave.StorageReader(second, chunks=source, thread_count=1)
    _dcp_load(out, reader)
    for fqn, value in expected.items():
        assert_bit_equal(out[fqn].contiguous(), value, fqn)


def test_read_flat_reads_each_chunk_from_the_checkpoint_holding_it(two) -> None:
    first, second, expected = two
    source = EarlierCheckpoint(parse_location(first), {"frozen", "emb"})
    flat, _ = read_flat(parse_location(second), False, chunks=source)
    for fqn, value in expected.items():
        assert_bit_equal(flat[fqn][1], value, fqn)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        read_flat(parse_location(second), False)


def test_a_file_missing_in_the_holding_checkpoint_is_named(two) -> None:
    first, second, _ = two
    for name in os.listdir(first):
        if name.endswith(".safetensors"):
            os.remove(first / name)
    source = EarlierCheckpoint(parse_location(first), {"frozen", "emb"})
    with pytest.raises(CorruptCheckpointError, match="data file is missing") as info:
        read_flat(parse_location(second), False, chunks=source)
    assert info.value.path is not None and info.value.path.startswith(str(first))
