"""The ``quicksave`` command line, driven through ``main([...])`` and once as a process."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import quicksave
from quicksave.cli.main import human_bytes, main

# Stock DCP calls in one process warn that torch.distributed is off; that is intended here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(6, 4, generator=g), "b": torch.arange(5, dtype=torch.int32)},
        "ema": torch.randn(3, generator=g).to(torch.bfloat16),
        "opt": {"lr": 0.01, "betas": (0.9, 0.95)},
        "step": 7,
    }


def save(path: Path, step: int) -> Path:
    quicksave.save(state(step), path, step=step, user_metadata={"run": "cli-test"})
    return path


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return save(tmp_path / "step-7", 7)


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# --------------------------------------------------------------------------- ls
def test_ls_lists_sorted_by_step_with_status(tmp_path: Path, capsys) -> None:
    for step in (20, 3, 100):
        save(tmp_path / f"step-{step}", step)
    pending = tmp_path / "step-200.tmp-0123456789ab"
    pending.mkdir()
    (pending / "rank-00000-00.safetensors").write_bytes(b"x" * 10)
    dcp.save({"x": torch.ones(4)}, checkpoint_id=str(tmp_path / "dcp-step-50"), no_dist=True)
    (tmp_path / "not-a-checkpoint").mkdir()
    (tmp_path / "loose-file.txt").write_text("hi")
    capsys.readouterr()  # DCP's own single-process warning above is not ls's output

    rc, out, err = run(capsys, "ls", str(tmp_path))
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "STEP", "STATUS", "FORMAT", "SIZE", "MODIFIED", "TIERS"]
    rows = [line.split()[:4] for line in lines[1:]]
    assert rows == [
        ["step-3", "3", "committed", "quicksave"],
        ["step-20", "20", "committed", "quicksave"],
        ["dcp-step-50", "50", "committed", "dcp"],
        ["step-100", "100", "committed", "quicksave"],
        ["step-200.tmp-0123456789ab", "200", "uncommitted", "quicksave"],
    ]

    rc, out, _ = run(capsys, "ls", str(tmp_path), "--json")
    doc = json.loads(out)
    assert rc == 0 and [d["step"] for d in doc] == [3, 20, 50, 100, 200]
    by_name = {d["name"]: d for d in doc}
    size = sum(p.stat().st_size for p in (tmp_path / "step-20").iterdir())
    assert by_name["step-20"]["size"] == size
    assert by_name["step-20"]["mtime"] == (tmp_path / "step-20" / "manifest.json").stat().st_mtime
    assert by_name["step-200.tmp-0123456789ab"] | {"mtime": 0, "modified": ""} == {
        "name": "step-200.tmp-0123456789ab",
        "run": ".",
        "path": str(pending),
        "format": "quicksave",
        "layout": "quicksave",
        "status": "uncommitted",
        "committed": False,
        "step": 200,
        "size": 10,
        "mtime": 0,
        "modified": "",
        "problem": None,
        "tiers": [],  # uncommitted: no tier holds it
    }
    assert by_name["step-20"]["tiers"] == ["folder"]

    rc, out, _ = run(capsys, "ls", str(tmp_path), "--bytes")
    assert f" {size} " in next(line for line in out.splitlines() if line.startswith("step-20 "))


def test_ls_of_a_checkpoint_lists_itself(checkpoint: Path, capsys) -> None:
    rc, out, _ = run(capsys, "ls", str(checkpoint), "--json")
    (info,) = json.loads(out)
    assert rc == 0 and info["name"] == "." and info["step"] == 7 and info["committed"]


def test_ls_errors_name_the_path(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "nowhere"
    rc, out, err = run(capsys, "ls", str(missing))
    assert (rc, out) == (2, "")
    assert err == f"quicksave: error: no such file or directory [path={missing}]\n"
    (tmp_path / "f").write_text("")
    rc, _, err = run(capsys, "ls", str(tmp_path / "f"))
    assert rc == 2 and "not a directory" in err and str(tmp_path / "f") in err
    rc, out, err = run(capsys, "ls", str(tmp_path))
    assert (rc, out) == (0, "") and "no checkpoints in" in err


def test_ls_shows_a_damaged_manifest(tmp_path: Path, capsys) -> None:
    ck = save(tmp_path / "step-4", 4)
    (ck / "manifest.json").write_bytes((ck / "manifest.json").read_bytes()[:-20])
    rc, out, _ = run(capsys, "ls", str(tmp_path), "--json")
    (info,) = json.loads(out)
    assert rc == 0 and info["step"] == 4  # from the name
    assert "checksum" in info["problem"] or "manifest" in info["problem"]


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1536, 5 << 20, 3 << 40)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "5.0 MiB",
        "3.0 TiB",
    ]


# --------------------------------------------------------------------------- inspect
def test_inspect_json(checkpoint: Path, capsys) -> None:
    rc, out, err = run(capsys, "inspect", str(checkpoint), "--json")
    assert rc == 0 and err == ""
    doc = json.loads(out)
    assert (doc["format"], doc["step"], doc["world_size"]) == ("quicksave", 7, 1)
    assert doc["tensors"] == [
        {"fqn": "ema", "dtype": "bfloat16", "shape": [3], "bytes": 6, "chunks": 1},
        {"fqn": "model.b", "dtype": "int32", "shape": [5], "bytes": 20, "chunks": 1},
        {"fqn": "model.w", "dtype": "float32", "shape": [6, 4], "bytes": 96, "chunks": 1},
    ]
    assert doc["objects"] == [
        {"fqn": "opt.betas", "type": "tuple", "preview": "(0.9, 0.95)"},
        {"fqn": "opt.lr", "type": "float", "preview": "0.01"},
        {"fqn": "step", "type": "int", "preview": "7"},
    ]
    files = {p.name: p.stat().st_size for p in checkpoint.iterdir() if p.name != "manifest.json"}
    assert doc["files"] == files
    assert doc["totals"] == {
        "tensors": 3,
        "objects": 3,
        "tensor_bytes": 122,
        "files": len(files),
        "file_bytes": sum(files.values()),
    }
    assert doc["user_metadata"] == {"run": "cli-test"}


def test_inspect_text(checkpoint: Path, capsys) -> None:
    rc, out, _ = run(capsys, "inspect", str(checkpoint), "--bytes")
    assert rc == 0
    assert "step:        7" in out and "world size:  1" in out
    assert "totals:      3 tensors (122), 3 objects" in out
    assert any(
        line.split() == ["model.w", "float32", "[6,", "4]", "96", "1"] for line in out.splitlines()
    )
    assert any(line.split() == ["opt.lr", "float", "0.01"] for line in out.splitlines())


def test_inspect_dcp_reads_the_pickle_restricted(tmp_path: Path, capsys) -> None:
    """A stock DCP directory's .metadata is read by the restricted unpickler (DCP's
    metadata classes only); --allow-pickle unpickles it fully. Both describe it alike."""
    path = tmp_path / "dcp"
    dcp.save({"w": torch.zeros(2, 3), "n": 3}, checkpoint_id=str(path), no_dist=True)
    capsys.readouterr()  # DCP's own single-process warning is not the CLI's output
    docs = []
    for extra in ((), ("--allow-pickle",)):
        rc, out, err = run(capsys, "inspect", str(path), "--json", *extra)
        assert (rc, err) == (0, "")
        docs.append(json.loads(out))
    assert docs[0] == docs[1]
    doc = docs[0]
    assert doc["format"] == "dcp"
    assert doc["tensors"] == [
        {"fqn": "w", "dtype": "float32", "shape": [2, 3], "bytes": 24, "chunks": 1}
    ]
    assert [o["fqn"] for o in doc["objects"]] == ["n"]


def test_inspect_dcp_refuses_a_pickle_that_names_other_globals(tmp_path: Path, capsys) -> None:
    path = tmp_path / "dcp"
    dcp.save({"w": torch.zeros(2)}, checkpoint_id=str(path), no_dist=True)
    capsys.readouterr()  # DCP's own single-process warning is not the CLI's output
    (path / ".metadata").write_bytes(pickle.dumps(types.SimpleNamespace(a=1)))
    rc, out, err = run(capsys, "inspect", str(path))
    assert (rc, out) == (2, "")
    assert err == (
        "quicksave: error: the DCP metadata pickle refers to types.SimpleNamespace, which is "
        "not part of DCP's metadata; refusing to unpickle it (pass allow_pickle=True only "
        f"if you trust this checkpoint) [path={path / '.metadata'}]\n"
    )


def test_inspect_uncommitted_and_missing(tmp_path: Path, capsys) -> None:
    tmp = tmp_path / "x.tmp-0123456789ab"
    tmp.mkdir()
    rc, _, err = run(capsys, "inspect", str(tmp))
    assert rc == 2 and "never committed" in err and str(tmp) in err
    rc, _, err = run(capsys, "inspect", str(tmp_path / "none"))
    assert rc == 2 and f"no such file or directory [path={tmp_path / 'none'}]" in err


# --------------------------------------------------------------------------- verify
def test_verify_ok_and_corrupt(checkpoint: Path, capsys) -> None:
    rc, out, err = run(capsys, "verify", str(checkpoint), "--no-progress")
    assert rc == 0 and err == ""
    assert out.startswith(f"OK {checkpoint}: 4 files, ") and "3 tensors, 3 objects verified" in out

    doc = json.loads((checkpoint / "manifest.json").read_bytes())
    chunk = doc["tensors"]["model.w"]["chunks"][0]
    with open(checkpoint / chunk["file"], "r+b") as f:
        f.seek(chunk["offset"])
        first = f.read(1)
        f.seek(chunk["offset"])
        f.write(bytes([first[0] ^ 0x10]))
    rc, out, _ = run(capsys, "verify", str(checkpoint))
    lines = out.splitlines()
    assert rc == 1
    assert lines[0].startswith(f"CORRUPT {chunk['file']}: model.w: chunk: checksum mismatch")
    assert lines[-1] == f"FAILED {checkpoint}: 1 problem"

    rc, out, _ = run(capsys, "verify", str(checkpoint), "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["ok"] is False
    assert [(p["file"], p["fqn"], p["kind"]) for p in doc["problems"]] == [
        (chunk["file"], "model.w", "chunk")
    ]


def test_verify_exit_2_when_not_a_committed_checkpoint(tmp_path: Path, capsys) -> None:
    rc, out, err = run(capsys, "verify", str(tmp_path / "missing"))
    assert (rc, out) == (2, "")
    assert err == f"quicksave: error: no such file or directory [path={tmp_path / 'missing'}]\n"
    tmp = tmp_path / "step-1.tmp-0123456789ab"
    tmp.mkdir()
    rc, _, err = run(capsys, "verify", str(tmp))
    assert rc == 2 and "was never committed" in err and "Traceback" not in err


def test_console_script_verify(checkpoint: Path) -> None:
    """The installed ``quicksave`` script runs main() and passes its exit status on."""
    script = Path(sys.executable).parent / "quicksave"
    assert script.exists(), f"console script missing: {script} (pip install -e .)"
    (checkpoint / "extra.bin").write_bytes(b"1")
    proc = subprocess.run([str(script), "verify", str(checkpoint)], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.splitlines() == [
        "CORRUPT extra.bin: unexpected-file: file not listed in the manifest",
        f"FAILED {checkpoint}: 1 problem",
    ]


class _Unpickled(Exception):
    pass


def _refuse(*args, **kwargs):
    raise _Unpickled("something tried to unpickle")


def test_verify_inspect_ls_never_unpickle(
    checkpoint: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    dcp_dir = tmp_path / "dcp"
    dcp.save({"w": torch.zeros(2)}, checkpoint_id=str(dcp_dir), no_dist=True)
    monkeypatch.setattr(pickle, "load", _refuse)
    monkeypatch.setattr(pickle, "loads", _refuse)
    monkeypatch.setattr(pickle, "Unpickler", _refuse)
    monkeypatch.setattr(torch, "load", _refuse)
    assert run(capsys, "verify", str(checkpoint))[0] == 0
    assert run(capsys, "inspect", str(checkpoint))[0] == 0
    assert run(capsys, "inspect", str(checkpoint), "--json")[0] == 0
    assert run(capsys, "ls", str(tmp_path))[0] == 0
    # Control: the patches do catch an unpickling path (DCP's .metadata reader).
    rc, _, err = run(capsys, "inspect", str(dcp_dir), "--allow-pickle")
    assert rc == 2 and "_Unpickled: something tried to unpickle" in err


# --------------------------------------------------------------------------- convert
def test_convert_cli_writes_and_refuses_to_overwrite(
    checkpoint: Path, tmp_path: Path, capsys
) -> None:
    out_path = tmp_path / "out" / "model.pt"
    rc, out, err = run(capsys, "convert", str(checkpoint), str(out_path), "--to", "torch")
    assert rc == 0 and out == f"wrote {out_path} (torch)\n"
    loaded = torch.load(out_path, weights_only=True)
    assert torch.equal(loaded["model"]["w"], state(7)["model"]["w"])
    before = out_path.read_bytes()
    rc, out, err = run(capsys, "convert", str(checkpoint), str(out_path), "--to", "safetensors")
    assert (rc, out) == (2, "")
    assert "output already exists" in err and str(out_path) in err
    assert out_path.read_bytes() == before
    assert sorted(os.listdir(out_path.parent)) == ["model.pt"]  # no temporaries left


def test_convert_cli_usage_errors(checkpoint: Path, tmp_path: Path, capsys) -> None:
    rc, _, err = run(capsys, "convert", str(checkpoint), str(tmp_path / "o"))
    assert rc == 2 and "--to" in err
    rc, _, err = run(capsys, "convert", str(checkpoint), str(tmp_path / "o"), "--to", "zip")
    assert rc == 2 and "invalid choice: 'zip'" in err


# --------------------------------------------------------------------------- demo, bench
@pytest.mark.parametrize("name", ["demo", "bench"])
def test_demo_and_bench_pass_arguments_through(name: str, monkeypatch, capsys) -> None:
    seen = []
    fake = types.ModuleType(f"quicksave_tools.{name}")
    fake.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, f"quicksave_tools.{name}", fake)
    assert main([name, "--steps", "2", "extra", "--help"]) == 3
    assert seen == [["--steps", "2", "extra", "--help"]]


def test_pass_through_without_main_is_a_clear_error(monkeypatch, capsys) -> None:
    fake = types.ModuleType("quicksave_tools.demo")
    monkeypatch.setitem(sys.modules, "quicksave_tools.demo", fake)
    rc, _, err = run(capsys, "demo")
    assert rc == 2
    assert err == (
        "quicksave: error: `quicksave demo` is not available in this installation "
        "(quicksave_tools.demo has no main())\n"
    )


def test_help_and_version(capsys) -> None:
    rc, out, _ = run(capsys, "--help")
    assert rc == 0
    for cmd in ("ls", "inspect", "verify", "convert", "demo", "bench"):
        assert cmd in out
    rc, out, _ = run(capsys, "--version")
    assert (rc, out) == (0, f"quicksave {quicksave.__version__}\n")
    rc, _, err = run(capsys)
    assert rc == 2 and "required" in err


# --------------------------------------------------------------------------- escapes
def test_printable_and_json_text() -> None:
    from quicksave.cli.text import json_text, printable

    assert printable("a\x1b[2J\x07\x7f\x9b\u202eb\tc") == "a\\x1b[2J\\x07\\x7f\\x9b\\u202eb\\x09c"
    assert printable("ünïcödé ☃ / \\ ok") == "ünïcödé ☃ / \\ ok"
    doc = {"k\x1b": ["\x9b", "\u2028", "é"]}
    text = json_text(doc)
    assert json.loads(text) == doc and "é" in text
    assert not any(c in text for c in "\x1b\x9b\u2028")


def test_names_with_terminal_escapes_are_shown_escaped(tmp_path: Path, capsys) -> None:
    name = "w\x1b]52;c;cHduZWQ=\x07"  # OSC 52: would write the clipboard
    path = tmp_path / "step-1\x1b[2J"
    quicksave.save({name: torch.ones(2), "v": "x\x1b[31m"}, path, step=1)
    for argv in (("inspect", str(path)), ("verify", str(path)), ("ls", str(tmp_path))):
        rc, out, err = run(capsys, *argv)
        assert rc == 0 and "\x1b" not in out + err and "\x07" not in out + err, argv
    rc, out, _ = run(capsys, "inspect", str(path))
    assert "w\\x1b]52;c;cHduZWQ=\\x07" in out and "step-1\\x1b[2J" in out
    rc, out, _ = run(capsys, "inspect", str(path), "--json")
    assert {t["fqn"] for t in json.loads(out)["tensors"]} == {name}
    (path / "manifest.json").write_bytes(b"\x1b[2J")
    rc, out, err = run(capsys, "inspect", str(path))
    assert rc == 2 and "\x1b" not in err and "step-1\\x1b[2J" in err
