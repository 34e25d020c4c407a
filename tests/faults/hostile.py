"""A folder of hostile checkpoints, one subdirectory per attack (like safetensors' folder
of malicious files).

Every case starts from a real checkpoint written by ``quicksave.save`` (or stock
``dcp.save``) and is then damaged the way an attacker or a broken tool would. Manifests
are re-sealed with a *valid* self-checksum, so that readers get past the checksum and
the deeper checks are what is exercised. Things that must not be read live in
``_outside/`` next to the cases (not a checkpoint: ``quicksave ls`` skips it): valid
copies of a manifest and a data file (if a reader followed a link to them, it would
succeed, so an error proves it did not), a FIFO, and the markers a malicious pickle
would create if it ran.

Usage::

    .venv/bin/python tests/faults/hostile.py /tmp/hostile   # then: quicksave ls /tmp/hostile
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import struct
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xxhash

ESC_NAME = "w\x1b[2J\x1b]0;pwned\x07\x9b31m"  # clear screen, set title, C1 CSI
ESC_DIR = "step-9\x1b[31m\x1b]8;;x:evil\x1b\\red\x1b[0m"  # colour, an OSC 8 link (no "/")
OUTSIDE = "_outside"


def quicksave_state() -> dict[str, Any]:
    """The state every quicksave case starts from (also a fitting load destination)."""
    return {
        "model": {
            "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "b": torch.arange(3, dtype=torch.int64),
        },
        "ema": torch.ones(4, dtype=torch.bfloat16),
        "opt": {"lr": 0.1, "betas": (0.9, 0.99), "pair": (torch.ones(2), "x")},
        "step": 5,
    }


def dcp_state() -> dict[str, Any]:
    return {"w": torch.arange(4, dtype=torch.float32), "cfg": {"lr": 0.5}}


def escape_state() -> dict[str, Any]:
    return {ESC_NAME: torch.arange(5, dtype=torch.float32), "n": 1}


def destination(name: str) -> dict[str, Any]:
    """A state dict to load case ``name`` into (zeros of the saved structure)."""
    if name.startswith("dcp-"):
        state = dcp_state()
    elif name == "escape-fqn":
        state = escape_state()
    else:
        state = quicksave_state()

    def zero(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: zero(x) for k, x in v.items()}
        return v

    return zero(state)


def marker(root: str | os.PathLike[str], name: str) -> Path:
    """Where case ``name``'s malicious pickle would leave a trace if it ran."""
    return Path(root) / OUTSIDE / f"pickle-ran-{name}"


# ------------------------------------------------------------------------ helpers


def seal(data: bytes) -> bytes:
    """Give manifest bytes a valid self-checksum (FORMAT.md §2), whatever they hold."""
    key = b'"manifest_xxh3_64":"'
    pos = data.rindex(key) + len(key)
    zeroed = data[:pos] + b"0" * 16 + data[pos + 16 :]
    digest = f"{xxhash.xxh3_64_intdigest(zeroed):016x}".encode()
    return data[:pos] + digest + data[pos + 16 :]


def _doc(case: Path) -> dict[str, Any]:
    return json.loads((case / "manifest.json").read_bytes())


def _dump(doc: dict[str, Any]) -> bytes:
    doc = {**doc, "manifest_xxh3_64": "0" * 16}  # last, as quicksave writes it
    return (json.dumps(doc, separators=(",", ":"), ensure_ascii=True) + "\n").encode()


def _edit(case: Path, fn: Callable[[dict[str, Any]], Any]) -> None:
    doc = _doc(case)
    fn(doc)
    (case / "manifest.json").write_bytes(seal(_dump(doc)))


def _edit_text(case: Path, old: bytes, new: bytes) -> None:
    data = (case / "manifest.json").read_bytes()
    assert old in data, (case.name, old)
    (case / "manifest.json").write_bytes(seal(data.replace(old, new, 1)))


def _data_file(case: Path) -> str:
    return next(n for n, f in _doc(case)["files"].items() if "rank" in f)


def _first_chunk(doc: dict[str, Any], fqn: str = "model.w") -> dict[str, Any]:
    return doc["tensors"][fqn]["chunks"][0]


def _set_object(fqn: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def fn(doc: dict[str, Any]) -> None:
        doc["objects"][fqn]["value"] = value

    return fn


def _replace_with_link(path: Path, target: str | Path) -> None:
    path.unlink()
    path.symlink_to(target)


def _replace_with_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _replace_with_socket(path: Path) -> None:
    path.unlink()
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))  # the socket file stays after close


class _RunsCommand:
    """Pickles as ``os.system(command)``: what a malicious ``.metadata`` does."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.command,))


def pickle_setting_class_doc() -> bytes:
    """``setattr(MetadataIndex, "__doc__", "pwned")`` through BUILD on the class itself:
    only allowed globals, yet it would change torch for the whole process."""
    return (
        b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadataIndex\n"
        b"N}(X\x07\x00\x00\x00__doc__X\x05\x00\x00\x00pwnedu\x86b."
    )


# ------------------------------------------------------------------------ the cases


def build_hostile_folder(root: str | os.PathLike[str]) -> dict[str, str]:
    """Write one hostile checkpoint per case under ``root`` (which may exist; the case
    directories must not).

    Returns:
        case name (its directory name under ``root``) -> what is wrong with it.
    """
    import torch.distributed.checkpoint as dcp

    import quicksave

    root = Path(root)
    outside = root / OUTSIDE
    outside.mkdir(parents=True)
    base = outside / "base"
    quicksave.save(quicksave_state(), base, step=5, user_metadata={"run": "hostile"})
    dcp_base = outside / "dcp-base"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single-process DCP warns about it
        dcp.save(dcp_state(), checkpoint_id=str(dcp_base), no_dist=True)
    data_name = _data_file(base)
    shutil.copy(base / "manifest.json", outside / "elsewhere-manifest.json")
    shutil.copy(base / data_name, outside / "elsewhere-data.bin")
    os.mkfifo(outside / "elsewhere-fifo")
    distcp = next(p.name for p in dcp_base.iterdir() if p.suffix == ".distcp")
    shutil.copy(dcp_base / distcp, outside / "elsewhere.distcp")

    cases: dict[str, str] = {}

    def case(name: str, what: str, src: Path = base) -> Path:
        path = root / name
        shutil.copytree(src, path, symlinks=True)
        cases[name] = what
        return path

    # -- files that are not regular files inside the checkpoint
    c = case("fifo-manifest", "manifest.json is a FIFO (a plain open blocks forever)")
    _replace_with_fifo(c / "manifest.json")
    c = case("fifo-data-file", "the data file is a FIFO")
    _replace_with_fifo(c / data_name)
    c = case("socket-data-file", "the data file is a Unix socket")
    _replace_with_socket(c / data_name)
    c = case("directory-data-file", "the data file is a directory")
    (c / data_name).unlink()
    (c / data_name).mkdir()
    c = case("symlink-manifest-fifo", "manifest.json is a symbolic link to a FIFO outside")
    _replace_with_link(c / "manifest.json", outside / "elsewhere-fifo")
    c = case("symlink-manifest-dev-zero", "manifest.json is a symbolic link to /dev/zero")
    _replace_with_link(c / "manifest.json", "/dev/zero")
    c = case(
        "symlink-manifest-outside",
        "manifest.json is a symbolic link to a valid manifest outside the checkpoint",
    )
    _replace_with_link(c / "manifest.json", outside / "elsewhere-manifest.json")
    c = case(
        "symlink-data-outside",
        "the data file is a symbolic link to a valid copy of it outside the checkpoint",
    )
    _replace_with_link(c / data_name, outside / "elsewhere-data.bin")

    # -- file names in the manifest that leave the directory
    for name, target in (
        ("file-name-dotdot", f"../{OUTSIDE}/elsewhere-data.bin"),
        ("file-name-absolute", "/etc/passwd"),
        ("file-name-nul", "rank-00000-00.safetensors\x00.txt"),
    ):
        c = case(name, f"the manifest names the data file {target!r}")

        def rename(doc: dict[str, Any], target: str = target) -> None:
            doc["files"][target] = doc["files"].pop(data_name)
            for t in doc["tensors"].values():
                for ch in t["chunks"]:
                    ch["file"] = target

        _edit(c, rename)

    # -- JSON a naive parser chokes on (valid checksums)
    c = case("deep-nesting", "user_metadata nests 100,000 levels deep (RecursionError)")
    _edit_text(
        c,
        b'"user_metadata":{',
        b'"user_metadata":{"deep":' + b"[" * 100_000 + b"]" * 100_000 + b",",
    )
    c = case("deep-user-metadata", "user_metadata nests 150 levels (parses; over the limit)")
    _edit_text(
        c, b'"user_metadata":{', b'"user_metadata":{"deep":' + b"[" * 150 + b"]" * 150 + b","
    )
    c = case("huge-step", "step is a 5,000-digit integer (ValueError in int())")
    _edit_text(c, b'"step":5,', b'"step":' + b"9" * 5000 + b",")
    c = case("huge-int-object", "an object value is a 5,000-digit integer")
    _edit(c, _set_object("step", 0))
    _edit_text(c, b'"step":{"value":0', b'"step":{"value":' + b"7" * 5000)
    c = case("nan-literal", "user_metadata holds a NaN literal (not JSON)")
    _edit_text(c, b'"user_metadata":{', b'"user_metadata":{"x":NaN,')
    c = case("infinity-overflow", "user_metadata holds 1e999, which overflows to inf")
    _edit_text(c, b'"user_metadata":{', b'"user_metadata":{"x":1e999,')

    # -- integer fields out of range
    c = case("negative-step", "step is -1")
    _edit(c, lambda d: d.update(step=-1))
    c = case("world-size-zero", "world_size is 0")
    _edit(c, lambda d: d.update(world_size=0))
    c = case("negative-chunk-offset", "a chunk's offset is -4096 (EINVAL from pread)")
    _edit(c, lambda d: _first_chunk(d).update(offset=-4096))
    c = case("unaligned-chunk-offset", "a chunk's offset is not a multiple of 4096")
    _edit(c, lambda d: _first_chunk(d).update(offset=_first_chunk(d)["offset"] + 1))
    c = case("chunk-length-mismatch", "a chunk's length is not sizes × element size")
    _edit(c, lambda d: _first_chunk(d).update(length=_first_chunk(d)["length"] + 4))
    c = case("chunk-outside-shape", "a chunk's box lies outside its tensor")
    _edit(c, lambda d: _first_chunk(d).update(offsets=[1, 0]))
    c = case("huge-shape", "a tensor's shape holds 2**64 bytes (numel overflow)")

    def huge_shape(d: dict[str, Any]) -> None:
        t = d["tensors"]["model.w"]
        t["shape"] = [2**62, 4]
        t["chunks"][0]["offsets"] = [0, 0]

    _edit(c, huge_shape)
    c = case("file-size-2-63", "a file's size is 2**63 (out of range)")
    _edit(c, lambda d: d["files"][data_name].update(size=2**63))

    # -- typed-JSON objects (FORMAT.md §4)
    c = case("huge-typed-tensor", "a 60-byte object declares an uninitialized 4 GiB tensor")
    _edit(
        c,
        _set_object("opt.pair", {"$t": "tensor", "dtype": "float32", "shape": [2**30], "v": ""}),
    )
    c = case("huge-typed-ndarray", "an ndarray object declares 2**40 elements with no bytes")
    _edit(
        c,
        _set_object("opt.pair", {"$t": "ndarray", "dtype": "<f8", "shape": [2**40], "v": ""}),
    )
    c = case("object-ndarray-dtype", "an ndarray object of numpy dtype O (objects)")
    _edit(
        c,
        _set_object(
            "opt.pair", {"$t": "ndarray", "dtype": "|O", "shape": [1], "v": "AAAAAAAAAAA="}
        ),
    )
    c = case("deep-object-value", "an object value nests 300 tuples deep")
    deep: Any = 1
    for _ in range(300):
        deep = {"$t": "tuple", "v": [deep]}
    _edit(c, _set_object("opt.lr", deep))
    c = case("dynamo-dtype-object", "a typed-JSON dtype named _dynamo (imports torch._dynamo)")
    _edit(c, _set_object("opt.pair", {"$t": "dtype", "v": "_dynamo"}))
    c = case("dynamo-dtype-typed-tensor", "a typed-JSON tensor of dtype _dynamo")
    _edit(
        c,
        _set_object("opt.pair", {"$t": "tensor", "dtype": "_dynamo", "shape": [0], "v": ""}),
    )
    c = case("dynamo-dtype-tensor", "a tensor entry of dtype _dynamo")
    _edit(c, lambda d: d["tensors"]["model.w"].update(dtype="_dynamo"))
    c = case("escape-dtype", "a tensor entry's dtype holds terminal escapes")
    _edit(c, lambda d: d["tensors"]["model.w"].update(dtype="\x1b[2Jfloat32"))

    # -- data files that are not what the manifest says
    c = case("safetensors-huge-header", "the data file's header length claims 2**40 bytes")
    raw = bytearray((c / data_name).read_bytes())
    raw[:8] = struct.pack("<Q", 2**40)
    (c / data_name).write_bytes(bytes(raw))

    def header_digest(d: dict[str, Any], raw: bytes = bytes(raw)) -> None:
        f = d["files"][data_name]
        f["xxh3_64"] = f"{xxhash.xxh3_64_intdigest(raw[: f['data_start']]):016x}"

    _edit(c, header_digest)
    c = case("truncated-data-file", "the data file ends before its chunks (size resealed)")
    with open(c / data_name, "r+b") as f:
        f.truncate(4096)
    _edit(c, lambda d: d["files"][data_name].update(size=4096))

    # -- terminal escapes in names (valid checkpoints otherwise)
    c = root / "escape-fqn"
    quicksave.save(escape_state(), c, step=3)
    cases["escape-fqn"] = "an fqn with ESC, OSC and C1 sequences; one of its bytes flipped"
    chunk = _first_chunk(_doc(c), ESC_NAME)
    with open(c / chunk["file"], "r+b") as f:
        f.seek(chunk["offset"])
        byte = f.read(1)
        f.seek(chunk["offset"])
        f.write(bytes([byte[0] ^ 0xFF]))
    case(ESC_DIR, "a directory name with ESC and OSC 8 sequences (intact checkpoint)")

    # -- stock DCP directories: the .metadata pickle
    c = case("dcp-pickle-os-system", "the .metadata pickle calls os.system", dcp_base)
    command = f"touch {marker(root, 'dcp-pickle-os-system')}"
    (c / ".metadata").write_bytes(pickle.dumps(_RunsCommand(command)))
    c = case("dcp-pickle-import", "the .metadata pickle names torch._dynamo.config", dcp_base)
    (c / ".metadata").write_bytes(b"\x80\x02ctorch._dynamo\nconfig\n.")
    c = case(
        "dcp-pickle-build-on-class",
        "the .metadata pickle sets MetadataIndex.__doc__ through BUILD on the class",
        dcp_base,
    )
    (c / ".metadata").write_bytes(pickle_setting_class_doc())
    c = case(
        "dcp-pickle-path-escape",
        "valid DCP metadata whose data file is ../_outside/elsewhere.distcp",
        dcp_base,
    )
    md = pickle.loads((dcp_base / ".metadata").read_bytes())  # our own file: trusted
    for info in md.storage_data.values():
        info.relative_path = f"../{OUTSIDE}/elsewhere.distcp"
    (c / ".metadata").write_bytes(pickle.dumps(md))
    c = case("dcp-fifo-metadata", "the DCP .metadata is a FIFO", dcp_base)
    _replace_with_fifo(c / ".metadata")
    c = case(
        "dcp-symlink-data",
        "the DCP data file is a symbolic link to a valid copy outside",
        dcp_base,
    )
    _replace_with_link(c / distcp, outside / "elsewhere.distcp")
    return cases


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} FOLDER  (FOLDER must not hold these cases yet)")
    for name, what in build_hostile_folder(sys.argv[1]).items():
        print(f"{name!r}: {what}")
