"""Independent checks of a written checkpoint against docs/FORMAT.md.

Written from the spec, not from quicksave's reader, so a bug shared by writer and
reader still shows up here.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import xxhash

SCHEMA_PATH = (
    Path(__file__).resolve().parents[2] / "src" / "quicksave" / "format" / "manifest.schema.json"
)
ALIGN = 4096


def hexdigest(data: bytes) -> str:
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


def load_schema() -> dict[str, Any]:
    """The manifest JSON Schema (the test that needs it fails if it is missing)."""
    return json.loads(SCHEMA_PATH.read_text())


def validate_against_schema(doc: Any) -> None:
    import jsonschema

    jsonschema.validate(doc, load_schema(), cls=jsonschema.Draft202012Validator)


def manifest_doc(checkpoint: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse manifest.json and check its self-checksum (spec §2)."""
    data = (Path(checkpoint) / "manifest.json").read_bytes()
    key = b'"manifest_xxh3_64":"'
    pos = data.rindex(key) + len(key)
    zeroed = data[:pos] + b"0" * 16 + data[pos + 16 :]
    assert data[pos : pos + 16].decode() == hexdigest(zeroed), "manifest self-checksum"
    assert data.endswith(b'"}\n'), "manifest_xxh3_64 must be the last member"
    return json.loads(data)


def check_checkpoint(checkpoint: str | os.PathLike[str]) -> dict[str, Any]:
    """Check every promise the manifest makes about the files; return the manifest.

    Checks: schema (when the schema file exists), file sizes and digests, safetensors
    headers (length prefix, 4 KiB alignment, metadata, entries covering the data region
    without holes), zero padding, chunk alignment and chunk digests.
    """
    root = Path(checkpoint)
    doc = manifest_doc(root)
    if SCHEMA_PATH.exists():
        validate_against_schema(doc)
    names = {p.name for p in root.iterdir()} - {"manifest.json"}
    assert names == set(doc["files"]), f"files on disk {names} != manifest {set(doc['files'])}"
    chunks_by_file: dict[str, list[dict[str, Any]]] = {}
    for tensor in doc["tensors"].values():
        for c in tensor["chunks"]:
            assert c["offset"] % ALIGN == 0, f"chunk offset {c['offset']} not 4 KiB aligned"
            chunks_by_file.setdefault(c["file"], []).append(c)
    for name, entry in doc["files"].items():
        data = (root / name).read_bytes()
        assert len(data) == entry["size"], f"{name}: size"
        if "rank" not in entry:
            assert hexdigest(data) == entry["xxh3_64"], f"{name}: digest"
            continue
        start = entry["data_start"]
        assert start % ALIGN == 0
        assert hexdigest(data[:start]) == entry["xxh3_64"], f"{name}: header digest"
        (n,) = struct.unpack("<Q", data[:8])
        assert 8 + n == start, f"{name}: header length"
        header = json.loads(data[8:start])
        assert header.pop("__metadata__") == {
            "format": "quicksave",
            "format_version": "1",
            "rank": str(entry["rank"]),
        }
        spans = sorted(tuple(v["data_offsets"]) for v in header.values())
        pos = 0
        for lo, hi in spans:  # safetensors: the entries tile the data region exactly
            assert lo == pos, f"{name}: hole or overlap at {pos}"
            pos = hi
        assert start + pos == len(data), f"{name}: data region length"
        for key, v in header.items():
            lo, hi = v["data_offsets"]
            if key.startswith("__quicksave_pad_"):
                assert data[start + lo : start + hi] == bytes(hi - lo), f"{name}: padding"
            else:
                assert (start + lo) % ALIGN == 0, f"{name}: {key} not aligned"
        for c in chunks_by_file.get(name, []):
            piece = data[c["offset"] : c["offset"] + c["length"]]
            assert len(piece) == c["length"] and hexdigest(piece) == c["xxh3_64"]
    return doc


def seal_manifest(doc: dict[str, Any]) -> bytes:
    """Serialize ``doc`` like quicksave does and give it a valid self-checksum, so a
    test can hand a reader a deliberately wrong manifest that passes the checksum."""
    doc = {**doc, "manifest_xxh3_64": "0" * 16}
    data = (json.dumps(doc, separators=(",", ":"), ensure_ascii=True) + "\n").encode()
    return reseal(data)


def reseal(data: bytes) -> bytes:
    """Recompute the self-checksum of manifest bytes (whatever else they contain)."""
    key = b'"manifest_xxh3_64":"'
    pos = data.rindex(key) + len(key)
    zeroed = data[:pos] + b"0" * 16 + data[pos + 16 :]
    return data[:pos] + hexdigest(zeroed).encode() + data[pos + 16 :]


MANIFEST_FIXTURE = Path(__file__).resolve().parents[1] / "format" / "fixtures" / "manifest_v1.json"


def golden_manifest_doc() -> dict[str, Any]:
    """The golden v1 manifest fixture, parsed (a fresh copy each call)."""
    return json.loads(MANIFEST_FIXTURE.read_bytes())


def manifest_parse_error(data: bytes, path: str = "/ckpt/manifest.json") -> Any:
    """The CorruptCheckpointError that parsing ``data`` as a manifest must raise
    (checked to name ``path``)."""
    import pytest

    from quicksave.errors import CorruptCheckpointError
    from quicksave.format.manifest_parse import from_json_bytes

    with pytest.raises(CorruptCheckpointError) as info:
        from_json_bytes(data, path)
    assert info.value.path == path
    return info.value
