"""The registries of schemes, commit strategies and writer leases (storage/registry.py):
a new store, a new strategy and a new lease each come in as one entry in
``StorageOptions``, with no ``if`` edited, and are used by real saves and loads."""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import quicksave
from quicksave.commit import CheckpointKind, classify, strategy_class
from quicksave.commit.choose import STRATEGIES
from quicksave.commit.rename import RenameCommit
from quicksave.commit.strategy import StagedFiles
from quicksave.errors import CheckpointError
from quicksave.manager import CheckpointConfig, CheckpointManager
from quicksave.manager.lease import LEASES, FolderLease, lease_for
from quicksave.storage import Location, StorageOptions, parse_location
from quicksave.storage.registry import Registry
from quicksave.storage.schemes import SCHEMES, LocalScheme, S3Scheme


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.arange(10), "step": seed}


def _load(path: str, storage: StorageOptions | None = None) -> dict[str, Any]:
    out = {"w": torch.zeros(64, 32), "b": torch.zeros(10, dtype=torch.long), "step": -1}
    quicksave.load(out, path, storage=storage)
    return out


# -- the registry itself ----------------------------------------------------------------


def test_a_registry_is_a_frozen_value_that_extends_into_a_new_one() -> None:
    base = Registry({"a": 1, "b": 2})
    more = base.with_entry("c", 3).with_entry("a", 10)
    assert base.names == ("a", "b") and base.get("a") == 1  # unchanged
    assert more.names == ("a", "b", "c") and more.get("a") == 10
    assert Registry({"b": 20}).over(base).entries == (("a", 1), ("b", 20))
    assert hash(more) == hash(Registry({"a": 10, "b": 2, "c": 3}))
    assert pickle.loads(pickle.dumps(more)) == more
    with pytest.raises(CheckpointError) as e:
        base.require("z", "widget", path="/p")
    assert e.value.message == "no widget is registered as 'z' (registered: 'a', 'b')"
    assert e.value.path == "/p"


def test_the_built_in_entries() -> None:
    assert SCHEMES.names == ("file", "s3", "msc")
    assert STRATEGIES.names == ("rename", "manifest-last")
    assert LEASES.names == ("flock", "store")
    assert strategy_class("/tmp/x") is RenameCommit
    assert strategy_class("s3://bucket/x").name == "manifest-last"


# -- a new S3-compatible store ----------------------------------------------------------


def _mys3(s3_server: Any) -> StorageOptions:
    """``mys3://`` as the test server, with its own endpoint and identity: nothing of it
    in ``StorageOptions.s3`` or the environment."""
    entry = S3Scheme(
        endpoint_url=s3_server.endpoint_url,
        region=s3_server.region,
        access_key_id=s3_server.access_key_id,
        secret_access_key=s3_server.secret_access_key,
    )
    return StorageOptions(schemes=Registry({"mys3": entry}))


@pytest.fixture
def no_aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.chdir(tmp_path)


def test_a_registered_s3_compatible_scheme_saves_and_loads(
    s3_server: Any, s3_bucket: str, no_aws_env: None
) -> None:
    opts = _mys3(s3_server)
    url = f"mys3://{s3_bucket}/run/step-1"
    loc = parse_location(url, options=opts)
    assert (loc.scheme, loc.container, loc.key, loc.url) == ("mys3", s3_bucket, "run/step-1", url)
    state = _state(1)
    quicksave.save(state, url, storage=opts)
    client = s3_server.client()
    try:
        listed = client.list_objects_v2(Bucket=s3_bucket, Prefix="run/step-1/")
        assert "run/step-1/manifest.json" in {o["Key"] for o in listed["Contents"]}
    finally:
        client.close()
    out = _load(url, opts)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
    assert out["step"] == 1


def test_a_registered_s3_compatible_scheme_under_the_manager(
    s3_server: Any, s3_bucket: str, no_aws_env: None
) -> None:
    # the default async mode: the worker process gets the registry with the location
    folder = f"mys3://{s3_bucket}/job"
    model = torch.nn.Linear(8, 4)
    config = CheckpointConfig(folder=folder, keep_latest_k=2, storage=_mys3(s3_server))
    with CheckpointManager(config, {"model": model}) as m:
        for step in (1, 2, 3):
            with torch.no_grad():
                model.weight.fill_(float(step))
            m.save(step, force=True)
        m.wait()
    with torch.no_grad():
        model.weight.zero_()
    with CheckpointManager(config, {"model": model}) as m:
        assert m.committed_steps() == [2, 3]
        assert m.load() == 3
    assert torch.equal(model.weight, torch.full((4, 8), 3.0))
    client = s3_server.client()
    try:
        keys = {o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket)["Contents"]}
    finally:
        client.close()
    assert "job/.quicksave-lease.json" in keys  # the store's lease, named by the entry
    assert not os.listdir(".")  # nothing written locally


def test_an_unregistered_scheme_is_an_error_naming_the_url(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as e:
        quicksave.save(_state(0), "mys3://bucket/run/step-1")
    assert e.value.path == "mys3://bucket/run/step-1"
    assert "unknown URL scheme 'mys3'" in e.value.message
    with pytest.raises(CheckpointError) as e:
        parse_location(
            "mys3:/bucket/run",
            options=StorageOptions(
                schemes=Registry({"mys3": S3Scheme(endpoint_url="http://127.0.0.1:1")})
            ),
        )
    # registered, its missing '//' is named as such
    assert "did you mean 'mys3://bucket/run'" in e.value.message


# -- a new commit strategy ----------------------------------------------------------------


class RecordingCommit(RenameCommit):
    """A test double of a commit strategy: commits by renaming, and records, in a file
    beside the checkpoint, that it was the one that committed (in the order called)."""

    name: ClassVar[str] = "recording"

    def commit(
        self,
        draft: str,
        loc: Location,
        members: Mapping[str, bytes],
        expected: Mapping[str, int],
        *,
        replace: bool = False,
        staged: StagedFiles | None = None,
    ) -> None:
        super().commit(draft, loc, members, expected, replace=replace, staged=staged)
        with open(f"{loc.key}.committed-by", "a") as f:
            f.write(f"{self.name} {sorted(expected)}\n")


def _recording() -> StorageOptions:
    return StorageOptions(
        commits=Registry({"recording": RecordingCommit}),
        schemes=Registry({"file": LocalScheme(commit="recording")}),
    )


def test_a_registered_commit_strategy_commits_a_real_save(tmp_path: Path) -> None:
    opts = _recording()
    path = str(tmp_path / "step-1")
    assert strategy_class(parse_location(path, options=opts)) is RecordingCommit
    state = _state(3)
    quicksave.save(state, path, storage=opts)
    record = Path(f"{path}.committed-by").read_text()
    assert record.startswith("recording ['rank-00000-00.safetensors'")
    out = _load(path)  # a rename commit: an ordinary checkpoint
    assert torch.equal(out["w"], state["w"]) and out["step"] == 3


@pytest.mark.parametrize("async_mode", ["thread", "disabled"])
def test_a_registered_commit_strategy_under_the_manager(tmp_path: Path, async_mode: str) -> None:
    model = torch.nn.Linear(8, 4)
    config = CheckpointConfig(folder=str(tmp_path), async_mode=async_mode, storage=_recording())
    with CheckpointManager(config, {"model": model}) as m:
        m.save(1, force=True)
        m.wait()
    assert (tmp_path / "step-1.committed-by").read_text().startswith("recording ")
    assert classify(str(tmp_path / "step-1")) is CheckpointKind.QUICKSAVE


def test_a_scheme_naming_an_unregistered_strategy_is_an_error(tmp_path: Path) -> None:
    opts = StorageOptions(schemes=Registry({"file": LocalScheme(commit="nope")}))
    path = str(tmp_path / "step-1")
    with pytest.raises(CheckpointError) as e:
        quicksave.save(_state(0), path, storage=opts)
    assert "no commit strategy is registered as 'nope'" in e.value.message
    assert e.value.path == path
    assert not os.path.exists(path)


# -- a new writer lease -------------------------------------------------------------------


class CountingLease(FolderLease):
    """A test double of a writer lease: the flock lease, counting acquisitions in a
    file of the folder."""

    def try_acquire(self) -> bool:
        got = super().try_acquire()
        with open(os.path.join(self.folder, "leases-taken"), "a") as f:
            f.write("1\n")
        return got


def test_a_registered_lease_is_taken_by_the_manager(tmp_path: Path) -> None:
    opts = StorageOptions(
        leases=Registry({"counting": CountingLease.at}),
        schemes=Registry({"file": LocalScheme(lease="counting")}),
    )
    assert isinstance(lease_for(parse_location(str(tmp_path), options=opts)), CountingLease)
    config = CheckpointConfig(folder=str(tmp_path), async_mode="disabled", storage=opts)
    with CheckpointManager(config, {"model": torch.nn.Linear(2, 2)}) as m:
        m.save(1, force=True)
        assert m.committed_steps() == [1]
    assert (tmp_path / "leases-taken").read_text() == "1\n"
