"""Locations: paths and file:// URLs are local; s3:// and msc:// go to object stores
(tests/storage); other schemes are refused before any I/O at every entry point, never
turned into a local directory named after them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import quicksave
from quicksave.errors import CheckpointError
from quicksave.manager import CheckpointConfig
from quicksave.storage import local_path


def test_paths_and_file_urls_are_local(tmp_path: Path) -> None:
    assert local_path(tmp_path / "a") == str(tmp_path / "a")
    assert local_path(f"file://{tmp_path}/b%20c") == str(tmp_path / "b c")
    assert local_path(f"file://localhost{tmp_path}/d") == str(tmp_path / "d")
    assert local_path("rel/x") == os.path.abspath("rel/x")


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("gs://bucket/x", "unknown URL scheme 'gs'"),
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
