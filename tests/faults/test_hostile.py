"""Hostile checkpoints (tests/faults/hostile.py): never a hang, never code run, never a
byte read outside the checkpoint, never a raw terminal escape.

Every case goes through ``quicksave.load``, ``verify_checkpoint``,
``inspect_checkpoint``, ``convert`` and the CLI's ``inspect``/``verify``/``convert``,
and the whole folder through ``list_checkpoints`` and ``quicksave ls``. Those calls run
in one child process (this file run as a script), one call at a time under a 5 s
alarm, each printing a JSON line as it finishes: a regression that hangs fails one
case, and the child's own timeout fails the test rather than the suite. A few real
``python -m quicksave`` processes check the bytes a terminal would get.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
from hostile import (
    ESC_DIR,
    OUTSIDE,
    build_hostile_folder,
    destination,
    marker,
    pickle_setting_class_doc,
)

CALL_LIMIT_S = 5  # one call; each takes well under a second
CHILD_LIMIT_S = 90
# What a terminal must never get raw: C0 controls except newline and tab, DEL, C1.
RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

# Outcome per tool: "error" (a CheckpointError naming the case, or CLI exit 2),
# "corrupt" (verify's report lists problems; CLI exit 1), "ok" (exit 0).
MANIFEST_BROKEN = {
    "load": "error",
    "verify": "corrupt",
    "inspect": "error",
    "convert": "error",
}
DATA_BROKEN = {**MANIFEST_BROKEN, "inspect": "ok"}  # inspect reads the manifest only
OBJECT_BROKEN = DATA_BROKEN
DCP = {"load": "error", "verify": "error", "inspect": "error", "convert": "error"}
EXPECTED: dict[str, dict[str, str]] = {
    "fifo-data-file": DATA_BROKEN,
    "socket-data-file": DATA_BROKEN,
    "directory-data-file": DATA_BROKEN,
    "symlink-data-outside": DATA_BROKEN,
    "truncated-data-file": DATA_BROKEN,
    "escape-fqn": DATA_BROKEN,
    # The manifest (authoritative for loading) is intact; only verify reads the header.
    "safetensors-huge-header": {**DATA_BROKEN, "load": "ok", "convert": "ok"},
    "huge-typed-tensor": OBJECT_BROKEN,
    "huge-typed-ndarray": OBJECT_BROKEN,
    "object-ndarray-dtype": OBJECT_BROKEN,
    "deep-object-value": OBJECT_BROKEN,
    "dynamo-dtype-object": OBJECT_BROKEN,
    "dynamo-dtype-typed-tensor": OBJECT_BROKEN,
    "dynamo-dtype-tensor": OBJECT_BROKEN,
    ESC_DIR: {"load": "ok", "verify": "ok", "inspect": "ok", "convert": "ok"},
    "dcp-symlink-data": {**DCP, "inspect": "ok"},  # its metadata is fine
}
CLI_RC = {"ok": 0, "corrupt": 1, "error": 2}


def expected(name: str) -> dict[str, str]:
    return EXPECTED.get(name, DCP if name.startswith("dcp-") else MANIFEST_BROKEN)


# --------------------------------------------------------------------- the child


class _Alarm(Exception):
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Alarm(f"still running after {CALL_LIMIT_S} s")


def _call(fn: Any) -> dict[str, Any]:
    from quicksave.errors import CheckpointError

    start = time.monotonic()
    signal.alarm(CALL_LIMIT_S)
    try:
        value = fn()
        result: dict[str, Any] = {"outcome": "ok", "value": value}
    except CheckpointError as e:
        result = {"outcome": "error", "type": type(e).__name__, "path": e.path, "text": str(e)}
    except _Alarm as e:
        result = {"outcome": "hang", "text": str(e)}
    except BaseException as e:  # anything else is a bug: keep its traceback
        result = {"outcome": "crash", "text": "".join(traceback.format_exception(e))}
    finally:
        signal.alarm(0)
    result["seconds"] = time.monotonic() - start
    return result


def _cli(*argv: str) -> dict[str, Any]:
    from quicksave.cli.main import main

    out, err = io.StringIO(), io.StringIO()

    def run() -> int:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return main(list(argv))

    result = _call(run)
    result.update(out=out.getvalue(), err=err.getvalue())
    return result


def _probe(root: Path) -> None:
    """Run every tool on every case; one JSON line per call on stdout."""
    import warnings

    warnings.simplefilter("ignore")
    import quicksave
    from quicksave.loading.catalog import list_checkpoints
    from quicksave.loading.verify import verify_checkpoint
    from quicksave.tools.convert import convert
    from quicksave.tools.inspect_checkpoint import inspect_checkpoint

    signal.signal(signal.SIGALRM, _on_alarm)
    emit = sys.stdout.write
    out_dir = root / OUTSIDE / "converted"
    names = sorted(p.name for p in root.iterdir() if p.name != OUTSIDE)
    for i, name in enumerate(names):
        case = str(root / name)

        def verify(case: str = case) -> dict[str, Any]:
            report = verify_checkpoint(case)
            return {
                "ok": report.ok,
                "path": report.path,
                "problems": [str(p) for p in report.problems],
            }

        calls = {
            "load": lambda name=name, case=case: quicksave.load(destination(name), case) and None,
            "verify": verify,
            "inspect": lambda case=case: inspect_checkpoint(case).path,
            "convert": lambda case=case, i=i: convert(case, out_dir / f"a{i}.st", "safetensors"),
        }
        for tool, fn in calls.items():
            emit(json.dumps({"case": name, "tool": tool, **_call(fn)}) + "\n")
            sys.stdout.flush()
        for tool, argv in (
            ("cli-inspect", ("inspect", case)),
            ("cli-verify", ("verify", case)),
            ("cli-convert", ("convert", case, str(out_dir / f"b{i}.pt"), "--to", "torch")),
        ):
            emit(json.dumps({"case": name, "tool": tool, **_cli(*argv)}) + "\n")
            sys.stdout.flush()
    listing = _call(lambda: [(i.name, i.problem) for i in list_checkpoints(root)])
    emit(json.dumps({"case": None, "tool": "ls", **listing}) + "\n")
    emit(json.dumps({"case": None, "tool": "cli-ls", **_cli("ls", str(root))}) + "\n")
    from torch.distributed.checkpoint.metadata import MetadataIndex

    after = {
        "dynamo_imported": "torch._dynamo" in sys.modules,
        "metadata_index_doc": MetadataIndex.__doc__,
    }
    emit(json.dumps({"case": None, "tool": "after", "outcome": "ok", "value": after}) + "\n")


# --------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("hostile")
    return root, build_hostile_folder(root)


@pytest.fixture(scope="module")
def probe(folder: tuple[Path, dict[str, str]]) -> dict[tuple[str | None, str], dict]:
    root, _ = folder
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--probe", str(root)],
            capture_output=True,
            text=True,
            timeout=CHILD_LIMIT_S,
        )
    except subprocess.TimeoutExpired as e:
        last = (e.stdout or b"").splitlines()[-1:] if e.stdout else []
        pytest.fail(f"the probe did not finish in {CHILD_LIMIT_S} s; last result: {last}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {}
    for line in proc.stdout.splitlines():
        r = json.loads(line)
        results[(r["case"], r["tool"])] = r
    return results


def test_every_case_is_probed(folder, probe) -> None:
    root, cases = folder
    assert sorted(cases) == sorted(p.name for p in root.iterdir() if p.name != OUTSIDE)
    assert len(cases) >= 40
    for name in cases:
        for tool in ("load", "verify", "inspect", "convert", "cli-inspect", "cli-verify"):
            assert (name, tool) in probe, (name, tool)


@pytest.mark.parametrize("tool", ["load", "verify", "inspect", "convert"])
def test_python_api_fails_cleanly_naming_the_path(folder, probe, tool: str) -> None:
    root, cases = folder
    wrong = []
    for name in cases:
        r = probe[(name, tool)]
        want = expected(name)[tool]
        case = str(root / name)
        got = r["outcome"]
        if tool == "verify" and got == "ok":
            got = "ok" if r["value"]["ok"] else "corrupt"
            assert r["value"]["path"] == case
        if got != want:
            wrong.append(f"{name!r}: expected {want}, got {got}: {r.get('text', r.get('value'))}")
            continue
        if got == "error":
            assert r["path"] is not None and r["path"].startswith(case), (name, r)
        assert r["seconds"] < 5, (name, tool, r["seconds"])
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("tool", ["cli-inspect", "cli-verify", "cli-convert"])
def test_cli_exits_cleanly_without_raw_escapes(folder, probe, tool: str) -> None:
    from quicksave.cli.text import printable

    root, cases = folder
    wrong = []
    for name in cases:
        r = probe[(name, tool)]
        text = r["out"] + r["err"]
        want = CLI_RC[expected(name)[tool.removeprefix("cli-")]]
        if r["outcome"] != "ok" or r["value"] != want:
            wrong.append(f"{name!r}: expected exit {want}, got {r.get('value')}: {r}")
            continue
        assert "Traceback" not in text, (name, text)
        assert not RAW_CONTROL.search(text), (name, text)
        if want:
            assert printable(root / name) in text, (name, text)
        assert r["seconds"] < 5, (name, tool, r["seconds"])
    assert not wrong, "\n".join(wrong)


def test_ls_lists_every_case_and_each_problem(folder, probe) -> None:
    root, cases = folder
    r = probe[(None, "ls")]
    assert r["outcome"] == "ok", r
    listed = dict(r["value"])
    # The sources of the cases, one folder down, are listed too (ls searches run folders).
    sources = {f"{OUTSIDE}/base", f"{OUTSIDE}/dcp-base"}
    assert set(listed) == set(cases) | sources
    for name in cases:
        broken = expected(name) is MANIFEST_BROKEN
        assert (listed[name] is not None) == broken, (name, listed[name])
    r = probe[(None, "cli-ls")]
    assert r["outcome"] == "ok" and r["value"] == 0, r
    assert r["err"] == "" and not RAW_CONTROL.search(r["out"])
    rows = r["out"].splitlines()[1:]
    assert len(rows) == len(cases) + len(sources)
    assert sum("(bad manifest: " in row for row in rows) == sum(
        expected(n) is MANIFEST_BROKEN for n in cases
    )


def test_no_pickle_ran_and_nothing_was_imported(folder, probe) -> None:
    root, cases = folder
    assert not marker(root, "dcp-pickle-os-system").exists()
    assert not list((root / OUTSIDE).glob("pickle-ran-*"))
    after = probe[(None, "after")]["value"]
    assert after["dynamo_imported"] is False
    assert after["metadata_index_doc"] != "pwned"
    for name in ("dcp-pickle-os-system", "dcp-pickle-import", "dcp-pickle-build-on-class"):
        r = probe[(name, "load")]
        assert r["type"] == "CorruptCheckpointError", r
        assert r["path"] == str(root / name / ".metadata")
    assert "posix.system" in probe[("dcp-pickle-os-system", "load")]["text"]
    assert "torch._dynamo.config" in probe[("dcp-pickle-import", "load")]["text"]
    assert "BUILD" in probe[("dcp-pickle-build-on-class", "load")]["text"]


def test_nothing_outside_is_used(folder, probe) -> None:
    """Each link or name pointing outside leads to a valid file there: had a reader
    followed it, the call would have succeeded."""
    root, _ = folder
    messages = {
        "symlink-manifest-outside": "manifest is a symbolic link, not a regular file",
        "symlink-manifest-dev-zero": "manifest is a symbolic link, not a regular file",
        "symlink-manifest-fifo": "manifest is a symbolic link, not a regular file",
        "fifo-manifest": "manifest is a FIFO, not a regular file",
        "symlink-data-outside": "data file is a symbolic link, not a regular file",
        "fifo-data-file": "data file is a FIFO, not a regular file",
        "socket-data-file": "data file is a socket, not a regular file",
        "file-name-dotdot": "manifest: bad file name '../_outside/elsewhere-data.bin'",
        "file-name-absolute": "manifest: bad file name '/etc/passwd'",
        "dcp-pickle-path-escape": "data file '../_outside/elsewhere.distcp' is not a plain name",
        "dcp-symlink-data": "DCP data file is a symbolic link, not a regular file",
        "dcp-fifo-metadata": "DCP metadata is a FIFO, not a regular file",
    }
    for name, text in messages.items():
        r = probe[(name, "load")]
        assert r["outcome"] == "error" and text in r["text"], (name, r)


def test_named_failures(folder, probe) -> None:
    """The messages say what is wrong (a sample; the parser tests have the rest)."""
    texts = {
        ("deep-nesting", "inspect"): "manifest nests deeper than 100 levels",
        ("huge-step", "inspect"): "integer literal longer than 256 digits",
        ("nan-literal", "inspect"): "NaN is not valid JSON",
        ("world-size-zero", "inspect"): "world_size must be an integer in [1, 2**63)",
        ("negative-chunk-offset", "load"): "chunks[0].offset must be an integer in [0, 2**63)",
        ("huge-typed-tensor", "load"): "tensor declares 1073741824 elements of 4 bytes",
        ("dynamo-dtype-tensor", "load"): "unknown dtype '_dynamo'",
        ("dynamo-dtype-object", "load"): "unknown dtype '_dynamo'",
        ("object-ndarray-dtype", "load"): "numpy dtype '|O' is not allowed",
        ("deep-object-value", "load"): "value nests deeper than 96 levels",
        ("truncated-data-file", "load"): "data file is truncated",
    }
    for (name, tool), text in texts.items():
        assert text in probe[(name, tool)]["text"], (name, tool, probe[(name, tool)])
    verify = probe[("safetensors-huge-header", "verify")]["value"]
    assert any(
        "header: safetensors header: claims 1099511627776 bytes" in p for p in verify["problems"]
    ), verify


def test_real_cli_processes_print_no_escapes(folder) -> None:
    root, _ = folder
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for argv, rc in (
        (["ls", str(root)], 0),
        (["inspect", str(root / "fifo-manifest")], 2),
        (["verify", str(root / "escape-fqn")], 1),
        (["inspect", str(root / ESC_DIR)], 0),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "quicksave", *argv],
            capture_output=True,
            timeout=30,
            env=env,
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode == rc, (argv, out)
        assert b"Traceback" not in out and not re.search(rb"[\x00-\x08\x0b-\x1f\x7f]", out)
        assert not re.search("[\x80-\x9f]", out.decode("utf-8")), argv
    assert (
        b"\\x1b[2J"
        in subprocess.run(
            [sys.executable, "-m", "quicksave", "inspect", str(root / "escape-fqn")],
            capture_output=True,
            timeout=30,
            env=env,
        ).stdout
    )


def test_restricted_unpickler_reads_real_dcp_checkpoints(tmp_path: Path) -> None:
    """Model + optimizer state, nested dicts, objects: what stock dcp.save writes reads
    back through DCPReader exactly as through DCP's own reader."""
    import torch
    import torch.distributed.checkpoint as dcp

    from quicksave.loading.dcp_stock import DCPReader, read_dcp_metadata

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "extra": {"step": 3, "name": "run", "t": torch.arange(3, dtype=torch.int16)},
        "bf": torch.ones(2, dtype=torch.bfloat16),
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    md = read_dcp_metadata(tmp_path / "d")
    full = dcp.FileSystemReader(str(tmp_path / "d")).read_metadata()
    assert md.state_dict_metadata == full.state_dict_metadata
    assert md.storage_data == full.storage_data and md.planner_data == full.planner_data

    def zeros(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: zeros(x) for k, x in v.items()}
        if isinstance(v, list):
            return [zeros(x) for x in v]
        return None if isinstance(v, str) else v

    dest = zeros(state)
    dcp.load(dest, storage_reader=DCPReader(tmp_path / "d"), no_dist=True)
    for k, v in state["model"].items():
        assert torch.equal(dest["model"][k], v), k
    for p, s in state["optim"]["state"].items():
        for k, v in s.items():
            assert torch.equal(dest["optim"]["state"][p][k], v), (p, k)
    assert dest["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert dest["extra"]["name"] == "run" and dest["extra"]["step"] == 3
    assert torch.equal(dest["extra"]["t"], state["extra"]["t"])


def test_restricted_unpickler_refusals(tmp_path: Path) -> None:
    """In-process: a refused pickle changes nothing (BUILD on a class is refused before
    it sets anything) and its error names the file and the global."""
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from quicksave.errors import CorruptCheckpointError
    from quicksave.loading.dcp_stock import read_dcp_metadata

    path = tmp_path / "d"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(path), no_dist=True)
    good = (path / ".metadata").read_bytes()
    doc = MetadataIndex.__doc__
    for data, text in (
        (pickle_setting_class_doc(), "BUILD on type objects is not allowed"),
        (pickle.dumps(print), "refers to builtins.print"),
        (b"cbuiltins\neval\n(V1\ntR.", "refers to builtins.eval"),
        (b"\x80\x02ctorch\nload\n.", "refers to torch.load"),
        (b"\x80\x02ctorch.serialization\n_get_layout\nX\x0d\x00\x00\x00torch._dynamo\x85R.",
         "unknown torch layout 'torch._dynamo'"),
        (pickle.dumps({"not": "metadata"}), "the pickle holds a dict, not a Metadata"),
        (good[: len(good) // 2], "cannot unpickle the DCP metadata"),
    ):  # fmt: skip
        (path / ".metadata").write_bytes(data)
        with pytest.raises(CorruptCheckpointError) as info:
            read_dcp_metadata(path)
        assert text in info.value.message and info.value.path == str(path / ".metadata")
    assert MetadataIndex.__doc__ == doc
    (path / ".metadata").write_bytes(good)
    assert read_dcp_metadata(path, allow_pickle=True) == read_dcp_metadata(path)
    (path / "__0.metadata").write_bytes(good)
    assert read_dcp_metadata(path, rank=0) == read_dcp_metadata(path)


if __name__ == "__main__" and sys.argv[1:2] == ["--probe"]:
    _probe(Path(sys.argv[2]))
