"""DCP-layout checkpoints (FORMAT.md §8) end to end: stock DCP loads them, quicksave
loads, lists, inspects and verifies them without unpickling, and every damaged byte is
found (by verify; by load where load reads it)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import quicksave
from helpers.checks import seal_manifest, validate_against_schema
from helpers.dcp_layout import DATA_FILE, write_dcp_layout_checkpoint
from helpers.state import raw
from quicksave.cli.main import main as cli_main
from quicksave.commit import CheckpointKind, classify, kind_of
from quicksave.commit.manifest_reader import read_manifest
from quicksave.errors import (
    CheckpointError,
    CheckpointExistsError,
    CorruptCheckpointError,
)
from quicksave.format import dcp_layout
from quicksave.format.dcp_layout import FOOTER_SIZE, parse_footer
from quicksave.format.manifest import LAYOUT_DCP, to_json_bytes
from quicksave.format.manifest_parse import from_json_bytes
from quicksave.loading.catalog import list_checkpoints
from quicksave.loading.checkpoint import require_committed
from quicksave.loading.verify import verify_checkpoint
from quicksave.manager import folder
from quicksave.tools.inspect_checkpoint import inspect_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def state() -> dict:
    g = torch.Generator().manual_seed(1)
    out = {
        "model": {
            "w": torch.randn(6, 5, generator=g).to(torch.bfloat16),  # two chunks
            "b": torch.arange(-2, 5, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "e": torch.empty(0, 3),
            "s": torch.tensor(3.25, dtype=torch.float64),
        },
        "step": 9,
        "opt": {"lr": 0.01, "betas": (0.9, 0.95)},
    }
    if hasattr(torch, "float8_e4m3fn"):
        out["model"]["f8"] = torch.randn(4, generator=g).to(torch.float8_e4m3fn)
    return out


def zeros_like_state() -> dict:
    def blank(v):
        if isinstance(v, dict):
            return {k: blank(x) for k, x in v.items()}
        if isinstance(v, torch.Tensor):
            return torch.zeros(v.shape, dtype=v.dtype)
        return None

    return blank(state())


def assert_same(got: dict, want: dict) -> None:
    for k, v in want.items():
        if isinstance(v, dict):
            assert_same(got[k], v)
        elif isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert torch.equal(raw(got[k]), raw(v)), k
        else:
            assert got[k] == v, k


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "step-9"
    write_dcp_layout_checkpoint(path, state(), step=9, split={"model.w": 2})
    return path


def region_offsets(path: Path) -> dict[str, int]:
    """One byte offset (file, offset) per region of a DCP-layout checkpoint."""
    meta = (path / ".metadata").read_bytes()
    f = parse_footer(meta[-FOOTER_SIZE:], len(meta), "x")
    m = read_manifest(path)
    chunk = m.tensors["model.b"].chunks[0]
    return {
        "P": f.pickle_length // 2,
        "M": f.pickle_length + f.manifest_length // 2,
        "F-magic": len(meta) - 1,
        "F-length": len(meta) - 40 + 9,
        "F-digest": len(meta) - 40 + 24,
        "chunk": chunk.offset + 3,
        "outside-zip": chunk.offset - 10,  # the local header's padding before data/0
        "outside-object": 100,  # the first byte item (torch.save of an object)
    }


def flip(path: Path, name: str, offset: int) -> None:
    data = bytearray((path / name).read_bytes())
    data[offset] ^= 0x01
    (path / name).write_bytes(bytes(data))


# --------------------------------------------------------------------------- reading


def test_the_files_are_exactly_dcps(ckpt: Path) -> None:
    assert sorted(os.listdir(ckpt)) == [".metadata", DATA_FILE]
    assert classify(ckpt) is CheckpointKind.QUICKSAVE


def test_stock_dcp_loads_it(ckpt: Path) -> None:
    dest = zeros_like_state()
    dcp.load(dest, storage_reader=FileSystemReader(ckpt), no_dist=True)
    assert_same(dest, state())


def test_quicksave_loads_it_bit_exactly(ckpt: Path) -> None:
    dest = zeros_like_state()
    quicksave.load(dest, ckpt)
    assert_same(dest, state())


def test_quicksave_storage_reader_loads_it(ckpt: Path) -> None:
    dest = zeros_like_state()
    dcp.load(dest, storage_reader=quicksave.StorageReader(ckpt), no_dist=True)
    assert_same(dest, state())


def test_the_manifest_comes_from_metadata(ckpt: Path) -> None:
    m = read_manifest(ckpt)
    assert m.layout == LAYOUT_DCP and m.step == 9
    assert set(m.files) == {DATA_FILE} and m.files[DATA_FILE].data_start is None
    assert m.files[DATA_FILE].size == (ckpt / DATA_FILE).stat().st_size
    w = m.tensors["model.w"]
    assert [c.offsets for c in w.chunks] == [(0, 0), (3, 0)]
    assert any(c.offset % 4096 for t in m.tensors.values() for c in t.chunks)
    blob = (ckpt / ".metadata").read_bytes()
    f = parse_footer(blob[-FOOTER_SIZE:], len(blob), "x")
    text = blob[f.pickle_length : f.pickle_length + f.manifest_length]
    assert text.endswith(b'"layout":"dcp","manifest_xxh3_64":"' + text[-19:-3] + b'"}\n')
    assert to_json_bytes(m) == text
    validate_against_schema(json.loads(text))


def test_listing_and_inspecting(ckpt: Path, capsys) -> None:
    (info,) = list_checkpoints(ckpt.parent)
    assert (info.format, info.layout, info.committed, info.step, info.problem) == (
        "quicksave",
        "dcp",
        True,
        9,
        None,
    )
    assert info.mtime == (ckpt / ".metadata").lstat().st_mtime
    s = inspect_checkpoint(ckpt)
    assert (s.format, s.layout, s.step, s.world_size) == ("quicksave", "dcp", 9, 1)
    assert {t.fqn: t.chunks for t in s.tensors}["model.w"] == 2
    assert {o.fqn: o.preview for o in s.objects}["opt.betas"] == "(0.9, 0.95)"
    assert cli_main(["ls", str(ckpt.parent), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["format"], row["layout"], row["status"]) == ("quicksave", "dcp", "committed")
    assert cli_main(["inspect", str(ckpt)]) == 0
    assert "format:      quicksave (dcp layout)" in capsys.readouterr().out


def test_verify_reads_every_byte(ckpt: Path) -> None:
    report = verify_checkpoint(ckpt)
    assert report.ok, report.problems
    total = sum(p.stat().st_size for p in ckpt.iterdir())
    assert (report.files_checked, report.bytes_checked) == (2, total)
    assert (report.tensors, report.objects) == (len(read_manifest(ckpt).tensors), 3)


def test_a_stock_dcp_directory_stays_dcp(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    assert classify(tmp_path / "d") is CheckpointKind.DCP
    (info,) = list_checkpoints(tmp_path)
    assert (info.format, info.layout) == ("dcp", "dcp")


def test_kind_of_asks_the_footer_only_when_the_names_look_like_dcp() -> None:
    asked = []

    def probe(answer: bool):
        return lambda: asked.append(answer) or answer

    assert kind_of("s", {".metadata", DATA_FILE}, probe(True)) is CheckpointKind.QUICKSAVE
    assert kind_of("s", {".metadata", DATA_FILE}, probe(False)) is CheckpointKind.DCP
    assert kind_of("s", {"manifest.json", ".metadata"}, probe(True)) is CheckpointKind.QUICKSAVE
    assert kind_of("s.tmp-0", {".metadata"}, probe(True)) is CheckpointKind.UNCOMMITTED
    assert kind_of("s", {DATA_FILE}, probe(True)) is CheckpointKind.NOT_CHECKPOINT
    assert asked == [True, False]


def test_a_committed_dcp_layout_checkpoint_is_never_overwritten(ckpt: Path) -> None:
    with pytest.raises(CheckpointExistsError):
        quicksave.save({"x": torch.ones(1)}, ckpt)


def test_the_manager_folder_counts_and_deletes_it(ckpt: Path) -> None:
    assert folder.committed_steps(ckpt.parent, allow_dcp=False) == [9]
    checkpoint = require_committed(ckpt, allow_dcp=False, step=9)
    assert checkpoint.kind is CheckpointKind.QUICKSAVE
    folder.delete_checkpoint(ckpt)
    assert not ckpt.exists()


class RecordingStore:
    """Just enough of a Backend for deleting a checkpoint on a store."""

    atomic_rename = False  # a store: its commit strategy is manifest-last

    def __init__(self, keys: list[str]) -> None:
        self.keys = set(keys)
        self.deleted: list[list[str]] = []

    def delete(self, keys) -> None:
        keys = list(keys)
        self.deleted.append(keys)
        self.keys -= set(keys)

    def list(self, prefix: str):
        from quicksave.storage import ObjectInfo

        return [ObjectInfo(k, 1, 0.0) for k in sorted(self.keys) if k.startswith(prefix)]

    def children(self, prefix: str) -> list[str]:
        base = prefix.rstrip("/") + "/"
        return sorted({k[len(base) :].split("/")[0] for k in self.keys if k.startswith(base)})


def test_on_a_store_the_commit_is_deleted_first() -> None:
    store = RecordingStore(["c/step-1/.metadata", f"c/step-1/{DATA_FILE}"])
    folder.delete_checkpoint(quicksave.storage.parse_location("s3://bucket/c/step-1"), store)
    assert store.deleted[:2] == [["c/step-1/manifest.json"], ["c/step-1/.metadata"]]
    assert store.keys == set()


def test_convert_reads_it(ckpt: Path, tmp_path: Path) -> None:
    from quicksave.tools.convert import convert

    out = convert(ckpt, tmp_path / "copy", "quicksave")
    dest = zeros_like_state()
    quicksave.load(dest, out)
    assert_same(dest, state())


# --------------------------------------------------------------------------- damage

EXPECTED = {  # region -> (file, kind verify reports)
    "P": (".metadata", "checksum"),
    "M": (".metadata", "manifest"),
    "F-magic": (".metadata", "manifest"),
    "F-length": (".metadata", "manifest"),
    "F-digest": (".metadata", "checksum"),
    "chunk": (DATA_FILE, "chunk"),
    "outside-zip": (DATA_FILE, "checksum"),
    "outside-object": (DATA_FILE, "checksum"),
}


@pytest.mark.parametrize("region", sorted(EXPECTED))
def test_a_changed_byte_anywhere_is_found(ckpt: Path, region: str) -> None:
    name, kind = EXPECTED[region]
    flip(ckpt, name, region_offsets(ckpt)[region])
    assert classify(ckpt) is CheckpointKind.QUICKSAVE  # still claims the layout
    report = verify_checkpoint(ckpt)
    assert [(p.file, p.kind) for p in report.problems] == [(name, kind)], report.problems
    if region == "chunk":
        assert report.problems[0].fqn == "model.b"


@pytest.mark.parametrize("region", ["M", "F-magic", "F-length"])
def test_load_refuses_a_damaged_manifest_or_footer(ckpt: Path, region: str) -> None:
    flip(ckpt, ".metadata", region_offsets(ckpt)[region])
    with pytest.raises(CorruptCheckpointError) as info:
        quicksave.load(zeros_like_state(), ckpt)
    assert info.value.path == str(ckpt / ".metadata")


def test_load_refuses_a_damaged_chunk(ckpt: Path) -> None:
    flip(ckpt, DATA_FILE, region_offsets(ckpt)["chunk"])
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as info:
        quicksave.load(zeros_like_state(), ckpt)
    assert (info.value.path, info.value.fqn) == (str(ckpt / DATA_FILE), "model.b")


@pytest.mark.parametrize("cut", [1, 20, 32])
def test_a_metadata_cut_in_its_footer_is_corrupt(ckpt: Path, cut: int) -> None:
    meta = ckpt / ".metadata"
    meta.write_bytes(meta.read_bytes()[:-cut])
    assert classify(ckpt) is CheckpointKind.QUICKSAVE
    report = verify_checkpoint(ckpt)
    assert [(p.file, p.kind) for p in report.problems] == [(".metadata", "manifest")]
    with pytest.raises(CorruptCheckpointError, match="footer") as info:
        quicksave.load(zeros_like_state(), ckpt)
    assert info.value.path == str(meta)


def test_a_metadata_cut_in_its_manifest_is_not_loaded_as_stock_dcp(ckpt: Path) -> None:
    meta = ckpt / ".metadata"
    blob = meta.read_bytes()
    f = parse_footer(blob[-FOOTER_SIZE:], len(blob), "x")
    meta.write_bytes(blob[: f.pickle_length + 100])
    assert classify(ckpt) is CheckpointKind.DCP  # no footer left to claim the layout
    with pytest.raises(CorruptCheckpointError, match="truncated or damaged") as info:
        quicksave.load(zeros_like_state(), ckpt)
    assert info.value.path == str(meta)
    with pytest.raises(CheckpointError):
        verify_checkpoint(ckpt)  # not a quicksave checkpoint any more: never "OK"


def test_a_footer_claiming_a_huge_manifest_is_refused_unread(ckpt: Path, monkeypatch) -> None:
    """A sparse .metadata whose footer adds up but claims a manifest over 1 GiB."""
    meta = ckpt / ".metadata"
    blob = meta.read_bytes()
    f = parse_footer(blob[-FOOTER_SIZE:], len(blob), "x")
    len_m = (1 << 30) + 1
    with open(meta, "r+b") as out:
        out.truncate(f.pickle_length + len_m)
        out.seek(0, os.SEEK_END)
        out.write(dcp_layout.FOOTER_MAGIC + struct.pack("<QQQ", f.pickle_length, len_m, 0))
        out.write(dcp_layout.FOOTER_MAGIC)
    reads = []
    import quicksave.commit.manifest_reader as mr

    real = mr.read_range
    monkeypatch.setattr(
        mr, "read_range", lambda f, o, n, **k: reads.append(n) or real(f, o, n, **k)
    )
    with pytest.raises(CorruptCheckpointError, match="1 GiB limit") as info:
        read_manifest(ckpt)
    assert info.value.path == str(meta)
    assert max(reads) <= 80


def test_files_missing_or_added_are_reported(ckpt: Path) -> None:
    (ckpt / "stray.bin").write_bytes(b"x")
    report = verify_checkpoint(ckpt)
    assert [(p.file, p.kind) for p in report.problems] == [("stray.bin", "unexpected-file")]
    (ckpt / DATA_FILE).unlink()
    report = verify_checkpoint(ckpt)
    assert ("__0_0.distcp", "missing-file") in [(p.file, p.kind) for p in report.problems]
    with pytest.raises(CorruptCheckpointError, match="missing") as info:
        quicksave.load(zeros_like_state(), ckpt)
    assert info.value.path == str(ckpt / DATA_FILE)


def test_a_truncated_data_file_is_reported(ckpt: Path) -> None:
    data = (ckpt / DATA_FILE).read_bytes()
    (ckpt / DATA_FILE).write_bytes(data[:-30])
    kinds = {p.kind for p in verify_checkpoint(ckpt).problems}
    assert {"size", "truncated"} <= kinds


# --------------------------------------------------------------------------- manifest rules


def dcp_doc(ckpt: Path) -> dict:
    return json.loads(to_json_bytes(read_manifest(ckpt)))


def parse_error(doc: dict) -> str:
    data = seal_manifest(doc)
    with pytest.raises(CorruptCheckpointError) as info:
        from_json_bytes(data, "/c/.metadata", layout=LAYOUT_DCP)
    assert info.value.path == "/c/.metadata"
    return info.value.message


def test_dcp_manifest_rules(ckpt: Path) -> None:
    doc = dcp_doc(ckpt)
    entry = doc["files"][DATA_FILE]
    chunks = doc["tensors"]["model.w"]["chunks"]

    bad = json.loads(json.dumps(doc))
    bad["files"][DATA_FILE]["data_start"] = 4096
    assert "data_start" in parse_error(bad)
    bad = json.loads(json.dumps(doc))
    del bad["files"][DATA_FILE]["rank"]
    assert "lacks 'rank'" in parse_error(bad)
    bad = json.loads(json.dumps(doc))
    bad["files"][".metadata"] = dict(entry)
    assert "bad file name '.metadata'" in parse_error(bad)
    bad = json.loads(json.dumps(doc))
    bad["tensors"]["model.w"]["chunks"][1]["offset"] = entry["size"] - 2
    assert "lies beyond the size" in parse_error(bad)
    bad = json.loads(json.dumps(doc))
    bad["tensors"]["model.w"]["chunks"][1]["offset"] = chunks[0]["offset"] + 2
    assert "overlap" in parse_error(bad)
    bad = json.loads(json.dumps(doc))
    bad["layout"] = "other"
    assert "layout must be 'dcp'" in parse_error(bad)

    with pytest.raises(CorruptCheckpointError, match="layout 'dcp' where"):
        from_json_bytes(seal_manifest(doc), "/c/manifest.json", layout="quicksave")
    plain = {k: v for k, v in doc.items() if k != "layout"}
    with pytest.raises(CorruptCheckpointError, match="layout 'quicksave' where"):
        from_json_bytes(seal_manifest(plain), "/c/.metadata", layout=LAYOUT_DCP)


def test_schema_follows_the_layout(ckpt: Path) -> None:
    import jsonschema

    doc = dcp_doc(ckpt)
    validate_against_schema(doc)
    with_start = json.loads(json.dumps(doc))
    with_start["files"][DATA_FILE]["data_start"] = 4096
    with pytest.raises(jsonschema.ValidationError):
        validate_against_schema(with_start)
    without_layout = {k: v for k, v in doc.items() if k != "layout"}
    with pytest.raises(jsonschema.ValidationError):  # unaligned offsets, no data_start
        validate_against_schema(without_layout)
