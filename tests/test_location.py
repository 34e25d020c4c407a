"""Locations: paths and file:// URLs are local; other schemes are refused before any
I/O at every entry point, never turned into a local directory named after them."""

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
        ("s3://bucket/run/step-1", "s3:// checkpoint locations are not supported"),
        ("msc://profile/run/step-1", r"quicksave\[msc\]"),
        ("gs://bucket/x", "unknown URL scheme 'gs'"),
        ("file://otherhost/x", "names the host 'otherhost'"),
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
    assert os.listdir(tmp_path) == []  # no local directory named 's3:' or the like


def test_file_url_round_trip(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/step-1"
    quicksave.save({"t": torch.arange(4.0)}, url)
    dest = {"t": torch.zeros(4)}
    quicksave.load(dest, url)
    assert torch.equal(dest["t"], torch.arange(4.0))
    assert (tmp_path / "step-1" / "manifest.json").exists()
