"""Locations: paths and file:// URLs are local; s3:// and msc:// go to object stores
(tests/storage); other schemes are refused before any I/O at every entry point, never
turned into a local directory named after them."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import quicksave
from quicksave.errors import CheckpointError
from quicksave.manager import CheckpointConfig
from quicksave.storage import local_path, parse_location


def test_paths_and_file_urls_are_local(tmp_path: Path) -> None:
    assert local_path(tmp_path / "a") == str(tmp_path / "a")
    assert local_path(f"file://{tmp_path}/b%20c") == str(tmp_path / "b c")
    assert local_path(f"file://localhost{tmp_path}/d") == str(tmp_path / "d")
    assert local_path("rel/x") == os.path.abspath("rel/x")


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("nosuch://bucket/x", "unknown URL scheme 'nosuch'"),
        ("gs://bucket/x", "served through fsspec, which needs a package"),  # gcsfs absent
        ("file://otherhost/x", "names the host 'otherhost'"),
        ("s3://", "needs a bucket"),
        ("s3://bkt/x/../y", "'..' components"),
        ("msc:///x", "needs a profile"),
    ],
)
def test_other_schemes_are_refused_before_any_io(tmp_path, monkeypatch, url, match) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=match) as e:
        quicksave.save({"t": torch.ones(2)}, url)
    assert e.value.path == url
    with pytest.raises(CheckpointError, match=match):
        quicksave.load({"t": torch.zeros(2)}, url)
    with pytest.raises(CheckpointError, match=match):
        quicksave.StorageWriter(url)
    with pytest.raises(CheckpointError):
        CheckpointConfig(folder=url)
    assert os.listdir(tmp_path) == []  # no local directory named 'gs:' or the like


def test_object_store_urls_never_become_local_directories(tmp_path, monkeypatch) -> None:
    """Without credentials or a config, an S3 or MSC URL fails naming the URL; it is
    never taken as a relative path (it used to become a local directory 's3:')."""
    monkeypatch.chdir(tmp_path)
    for k in list(os.environ):
        if k.startswith("AWS_") or k.startswith("MSC_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("HOME", str(tmp_path))
    for url in ("s3://bucket/run/step-1", "msc://profile/run/step-1"):
        with pytest.raises(CheckpointError) as e:
            quicksave.save({"t": torch.ones(2)}, url)
        assert url.rsplit("/", 1)[0] in str(e.value)
        with pytest.raises(CheckpointError):
            quicksave.load({"t": torch.zeros(2)}, url)
    assert os.listdir(tmp_path) == []


def test_file_url_round_trip(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/step-1"
    quicksave.save({"t": torch.arange(4.0)}, url)
    dest = {"t": torch.zeros(4)}
    quicksave.load(dest, url)
    assert torch.equal(dest["t"], torch.arange(4.0))
    assert (tmp_path / "step-1" / "manifest.json").exists()


# --------------------------------------------------------------- 'scheme:' without '//'
TYPOS = [  # (what the user wrote, what the error must suggest)
    ("s3:/bucket/run1", "did you mean 's3://bucket/run1'?"),
    ("s3:bucket/run1", "did you mean 's3://bucket/run1'?"),
    ("S3:/b", "did you mean 's3://b'?"),
    ("s3:", "did you mean 's3://<bucket>/<path>'?"),
    ("msc:profile/x", "did you mean 'msc://profile/x'?"),
    ("gs:bucket", "write './gs:bucket'"),
    ("run:2024/x", "write './run:2024/x'"),
    ("C:/ckpt", "write './C:/ckpt'"),  # Linux only: no drive letters
    ("file:relative", "must name an absolute path (file:/abs/path or file:///abs/path)"),
    ("file://", "must name an absolute path"),
    ("file:///tmp/run#3", "percent-encode them (%3F, %23)"),
    ("file://ckpt/x", "did you mean 'file:///ckpt/x'?"),
    (" s3://bucket/x", "must not begin or end with white space"),
    (" s3:/bucket/x", "did you mean 's3://bucket/x'?"),
    ("s3://bucket/x\n", "must not begin or end with white space"),
]


@pytest.mark.parametrize(("raw", "hint"), TYPOS)
def test_a_scheme_without_slashes_is_an_error_that_suggests_the_url(raw, hint) -> None:
    with pytest.raises(CheckpointError) as e:
        parse_location(raw)
    assert hint in e.value.message
    assert e.value.path == raw


def test_the_error_names_the_string_and_that_it_is_never_local() -> None:
    with pytest.raises(CheckpointError) as e:
        parse_location("s3:/bucket/run1", what="checkpoint folder")
    assert e.value.message == (
        "'s3:/bucket/run1' is not a checkpoint folder location: an s3: URL needs '//' "
        "after the scheme; did you mean 's3://bucket/run1'? quicksave never takes "
        "'s3:...' as a local path"
    )


def test_a_pathlib_path_that_collapsed_the_slashes_is_explained() -> None:
    with pytest.raises(CheckpointError, match="pathlib.Path collapses '//'") as e:
        parse_location(Path("s3://bucket/run1"))  # Path() makes it 's3:/bucket/run1'
    assert "did you mean 's3://bucket/run1'?" in e.value.message


def test_file_urls_of_rfc_8089_are_the_absolute_path(tmp_path: Path) -> None:
    want = str(tmp_path / "ckpt")
    for url in (
        f"file:{want}",
        f"file://{want}",
        f"file://localhost{want}",
        f"FILE:{want}",
        Path(f"file://{want}"),  # pathlib collapses it to 'file:/...': still the path
    ):
        loc = parse_location(url)
        assert (loc.scheme, loc.key) == ("file", want), url


def test_local_names_with_colons_are_local_when_unambiguous(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_location("./ckpt:1").key == str(tmp_path / "ckpt:1")
    assert parse_location("runs/a:b").key == str(tmp_path / "runs" / "a:b")
    assert parse_location(str(tmp_path / "run:2024")).key == str(tmp_path / "run:2024")
    assert parse_location("ckpt").key == str(tmp_path / "ckpt")
    quicksave.save({"t": torch.arange(3.0)}, "./step:1")  # the documented spelling works
    dest = {"t": torch.zeros(3)}
    quicksave.load(dest, "./step:1")
    assert torch.equal(dest["t"], torch.arange(3.0))
    assert os.listdir(tmp_path) == ["step:1"]


def test_save_to_a_file_url_of_one_slash_writes_the_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "abs" / "step-1"
    quicksave.save({"t": torch.ones(2)}, f"file:{target}")
    assert (target / "manifest.json").is_file()
    assert not (tmp_path / "file:").exists()  # it used to become ./file:/...


# --------------------------------------------------------------- every entry point
def _entry_points() -> dict[str, Callable[[str], object]]:
    """Each way a user hands quicksave a location, called with that location."""
    import torch.distributed.checkpoint as dcp

    from quicksave.compat.nvrx import FileSystemWriterAsync, TorchAsyncCheckpoint
    from quicksave.loading.catalog import list_checkpoints
    from quicksave.loading.verify import verify_checkpoint
    from quicksave.saving.config import EngineConfig
    from quicksave.saving.engine import AsyncSaver
    from quicksave.tools.convert import convert
    from quicksave.tools.inspect_checkpoint import inspect_checkpoint

    def engine_save(url: str) -> None:
        saver = AsyncSaver(EngineConfig(mode="thread"))
        try:
            saver.save({"t": torch.ones(2)}, url)
        finally:
            saver.close()

    def torch_async_save(url: str) -> None:
        ckpt = TorchAsyncCheckpoint(persistent_queue=False)
        try:
            ckpt.async_save({"t": torch.ones(2)}, url)
        finally:
            ckpt.close()

    def dcp_checkpoint_id(url: str) -> None:  # StorageWriter.reset(checkpoint_id)
        dcp.save({"t": torch.ones(2)}, checkpoint_id=url, storage_writer=_writer(), no_dist=True)

    def _writer():
        return quicksave.StorageWriter("./unused")

    return {
        "save": lambda u: quicksave.save({"t": torch.ones(2)}, u),
        "load": lambda u: quicksave.load({"t": torch.zeros(2)}, u),
        "async_save": lambda u: quicksave.async_save({"t": torch.ones(2)}, u),
        "load_state": lambda u: quicksave.load_state(u),
        "StorageWriter": lambda u: quicksave.StorageWriter(u),
        "StorageReader": lambda u: quicksave.StorageReader(u),
        "dcp.save checkpoint_id": dcp_checkpoint_id,
        "CheckpointConfig.folder": lambda u: CheckpointConfig(folder=u),
        "AsyncSaver.save": engine_save,
        "FileSystemWriterAsync": lambda u: FileSystemWriterAsync(u),
        "TorchAsyncCheckpoint.async_save": torch_async_save,
        "list_checkpoints": list_checkpoints,
        "inspect_checkpoint": inspect_checkpoint,
        "verify_checkpoint": verify_checkpoint,
        "convert (source)": lambda u: convert(u, "./out.pt", "torch"),
        "convert (target)": lambda u: convert(_saved(), u, "quicksave"),
        "export_hf (source)": lambda u: quicksave.export_hf(u, "./hf"),
        "export_hf (target)": lambda u: quicksave.export_hf(_saved(), u),
    }


def _saved() -> str:
    """A committed checkpoint in the working directory (the source of a convert)."""
    path = os.path.abspath("src-ckpt")
    if not os.path.exists(path):
        quicksave.save({"t": torch.ones(2)}, path)
    return path


@pytest.mark.parametrize("entry", sorted(_entry_points()))
@pytest.mark.parametrize(("raw", "hint"), TYPOS[:2] + TYPOS[5:6] + TYPOS[8:9])
def test_every_entry_point_refuses_before_any_io(tmp_path, monkeypatch, entry, raw, hint):
    monkeypatch.chdir(tmp_path)
    call = _entry_points()[entry]
    if entry.endswith("(target)"):
        _saved()
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(CheckpointError) as e:
        call(raw)
    assert hint in e.value.message, (entry, e.value)
    assert e.value.path == raw
    assert sorted(os.listdir(tmp_path)) == before  # nothing local named after it


@pytest.mark.parametrize("command", ["ls", "inspect", "verify", "convert-src", "convert-out"])
def test_every_cli_command_refuses_and_suggests(tmp_path, monkeypatch, capsys, command):
    from quicksave.cli.main import main

    monkeypatch.chdir(tmp_path)
    src = _saved()
    argv = {
        "ls": ["ls", "s3:/bucket/run1"],
        "inspect": ["inspect", "s3:/bucket/run1"],
        "verify": ["verify", "s3:/bucket/run1"],
        "convert-src": ["convert", "s3:/bucket/run1", "out.pt", "--to", "torch"],
        "convert-out": ["convert", src, "s3:/bucket/run1", "--to", "quicksave"],
    }[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("quicksave: error: 's3:/bucket/run1' is not a ")
    assert "did you mean 's3://bucket/run1'?" in err
    assert sorted(os.listdir(tmp_path)) == ["src-ckpt"]


def test_the_demo_folder_is_checked_too(tmp_path, monkeypatch) -> None:
    from quicksave_tools.demo.run import parse_args

    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="did you mean 's3://bucket/demo'"):
        parse_args(["--folder", "s3:/bucket/demo"])
    assert os.listdir(tmp_path) == []


def test_lightning_checkpoint_io_refuses(tmp_path, monkeypatch) -> None:
    from lightning.pytorch import LightningModule

    from quicksave.integrations.lightning import QuicksaveCheckpointIO, load_from_checkpoint

    monkeypatch.chdir(tmp_path)
    io = QuicksaveCheckpointIO()
    calls = {
        "save_checkpoint": lambda u: io.save_checkpoint({"state_dict": {}}, u),
        "load_checkpoint": io.load_checkpoint,
        "remove_checkpoint": io.remove_checkpoint,
        "load_from_checkpoint": lambda u: load_from_checkpoint(LightningModule, u),
    }
    for name, call in calls.items():
        with pytest.raises(CheckpointError, match="did you mean 's3://bucket/run1/last.ckpt'"):
            call("s3:/bucket/run1/last.ckpt")
        assert os.listdir(tmp_path) == [], name
    io.teardown()


def test_torchtitan_folder_and_initial_load_path_refuse(tmp_path, monkeypatch) -> None:
    from helpers.titan import build
    from quicksave.integrations.torchtitan import QuicksaveCheckpointManager

    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="did you mean 's3://bucket/titan'"):
        QuicksaveCheckpointManager.Config(enable=True, folder="s3:/bucket/titan")
    cfg = QuicksaveCheckpointManager.Config(enable=True, folder="titan")
    cfg.folder = "s3:/bucket/titan"  # as torchtitan's command line sets it, after __init__
    with pytest.raises(CheckpointError, match="did you mean 's3://bucket/titan'"):
        build(cfg, base_folder=str(tmp_path / "dump"))  # not <dump>/s3:/bucket/titan
    cfg = QuicksaveCheckpointManager.Config(enable=True, folder=str(tmp_path / "ckpt"))
    job = build(cfg, base_folder="")
    job.checkpointer.config.initial_load_path = "s3:bucket/seed"  # torchtitan refuses it sooner
    try:
        with pytest.raises(CheckpointError, match="did you mean 's3://bucket/seed'"):
            job.checkpointer.load()
    finally:
        job.checkpointer.close()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no dump/s3:/..., no ./s3:bucket
