"""The two commit strategies side by side, on a real directory, a real S3 server
(SeaweedFS on loopback) and fsspec's memory filesystem (the generic fsspec store): the
same calls, the same outcomes — and a failed or interrupted commit never leaves
anything that reads as a checkpoint."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from quicksave.commit import COMMITTED, CheckpointKind, CommitStrategy, open_strategy
from quicksave.commit.manifest_last import ManifestLastCommit
from quicksave.commit.rename import RenameCommit
from quicksave.errors import CheckpointError, CheckpointNotFoundError
from quicksave.format import DCP_METADATA_NAME, MANIFEST_NAME
from quicksave.storage import Location, parse_location

DATA = "rank-00000-0.safetensors"


@pytest.fixture(params=["file", "s3", "memory"])
def where(request, tmp_path, monkeypatch) -> Iterator[tuple[CommitStrategy, Location]]:
    """A strategy and the location of one checkpoint (``ckpt``) under a fresh folder."""
    if request.param == "file":
        loc = parse_location(str(tmp_path / "run" / "ckpt"))
    elif request.param == "memory":
        run = f"memory://{tmp_path.name}/run"  # fsspec's one memory filesystem: a fresh root
        loc = parse_location(f"{run}/ckpt")
    else:
        server = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("s3_bucket")
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        loc = parse_location(f"s3://{bucket}/run/ckpt")
    with open_strategy(loc) as s:
        yield s, loc


def _write_data(s: CommitStrategy, draft: str, data: bytes = b"0123456789") -> None:
    s.backend.put(s.member_key(draft, DATA), memoryview(data))


def test_each_location_gets_its_strategy(where) -> None:
    s, loc = where
    expected = RenameCommit if loc.scheme == "file" else ManifestLastCommit
    assert type(s) is expected
    assert s.atomic_replace is (expected is RenameCommit)


def test_a_commit_makes_it_visible_at_once(where) -> None:
    s, loc = where
    draft = s.begin(loc, "aaaaaaaaaaaa")
    _write_data(s, draft)
    assert s.classify(loc) is not CheckpointKind.QUICKSAVE
    s.commit(draft, loc, {DCP_METADATA_NAME: b"meta", MANIFEST_NAME: b"{}"}, {DATA: 10})
    assert s.classify(loc) is CheckpointKind.QUICKSAVE
    assert s.committed(loc.parent()) == {"ckpt": CheckpointKind.QUICKSAVE}


def test_a_failed_commit_leaves_nothing_that_reads_as_a_checkpoint(where) -> None:
    s, loc = where
    draft = s.begin(loc, "bbbbbbbbbbbb")
    _write_data(s, draft, b"short")  # 5 bytes where the plan says 10
    with pytest.raises(CheckpointError, match="expected 10"):
        s.commit(draft, loc, {DCP_METADATA_NAME: b"meta", MANIFEST_NAME: b"{}"}, {DATA: 10})
    assert s.classify(loc) not in COMMITTED
    s.discard(draft, [DATA])
    assert s.classify(loc) is CheckpointKind.MISSING
    assert s.committed(loc.parent()) == {}


def test_a_discard_after_an_interrupted_commit_leaves_no_phantom(where) -> None:
    """A writer killed between ``.metadata`` and the manifest: once its files are
    discarded, a ``.metadata`` left alone would read as a stock DCP checkpoint."""
    s, loc = where
    draft = s.begin(loc, "cccccccccccc")
    _write_data(s, draft)
    s.backend.put(s.member_key(draft, DCP_METADATA_NAME), memoryview(b"meta"))
    assert s.classify(loc) not in COMMITTED
    s.discard(draft, [DATA])
    assert s.classify(loc) is CheckpointKind.MISSING


def test_members_are_written_read_and_deleted_alike(where) -> None:
    s, loc = where
    draft = s.begin(loc, "dddddddddddd")
    s.write_member(draft, "part-rank-00000.json", b'{"a": 1}')
    assert s.read_member(draft, "part-rank-00000.json", 100) == b'{"a": 1}'
    s.delete_members(draft, ["part-rank-00000.json", "part-rank-00001.json"])
    with pytest.raises(CheckpointNotFoundError):
        s.read_member(draft, "part-rank-00000.json", 100)


def test_remove_and_quarantine_take_it_out_of_sight(where) -> None:
    s, loc = where
    for name in ("a", "b"):
        target = loc.parent().child(name)
        draft = s.begin(target, f"{name * 12}")
        _write_data(s, draft)
        s.commit(draft, target, {DCP_METADATA_NAME: b"m", MANIFEST_NAME: b"{}"}, {DATA: 10})
    assert set(s.committed(loc.parent())) == {"a", "b"}
    assert s.remove(loc.parent().child("a"))
    moved = s.quarantine(loc.parent().child("b"), "a test")
    assert moved is not None and ".corrupt-" in moved
    assert s.committed(loc.parent()) == {}
    assert s.classify(loc.parent().child("a")) is CheckpointKind.MISSING


def test_replace_only_where_it_is_atomic(where) -> None:
    s, loc = where
    draft = s.begin(loc, "eeeeeeeeeeee")
    _write_data(s, draft)
    s.commit(draft, loc, {DCP_METADATA_NAME: b"m", MANIFEST_NAME: b"{}"}, {DATA: 10})
    if not s.atomic_replace:
        with pytest.raises(CheckpointError, match="not supported on an object store"):
            s.check_target(loc, replace=True)
        return
    draft = s.begin(loc, "ffffffffffff", replace=True)
    _write_data(s, draft, b"9876543210")
    s.commit(draft, loc, {DCP_METADATA_NAME: b"m2", MANIFEST_NAME: b"{}"}, {DATA: 10}, replace=True)
    assert s.backend.get(s.member_key(loc.key, DATA), 100) == b"9876543210"
    assert s.committed(loc.parent()) == {"ckpt": CheckpointKind.QUICKSAVE}


def test_a_discard_never_touches_a_committed_checkpoint(where) -> None:
    """A save whose manifest landed but whose reply was lost (or another writer's
    commit at the same name): the failed save's discard must leave it whole."""
    s, loc = where
    draft = s.begin(loc, "gggggggggggg")
    _write_data(s, draft)
    s.commit(draft, loc, {DCP_METADATA_NAME: b"m", MANIFEST_NAME: b"{}"}, {DATA: 10})
    s.discard(draft, [DATA])
    assert s.classify(loc) is CheckpointKind.QUICKSAVE
    assert s.backend.get(s.member_key(loc.key, DATA), 100) == b"0123456789"


def test_abandon_removes_only_a_draft_of_its_own(where) -> None:
    """From the trainer side, after its writer died: a temporary directory is this
    save's alone; a store's prefix may still be committed by another rank's writer."""
    s, loc = where
    draft = s.begin(loc, "hhhhhhhhhhhh")
    _write_data(s, draft)
    s.abandon(draft, [DATA])
    left = s.backend.stat(s.member_key(draft, DATA)) is not None
    assert left is s.writes_in_place
