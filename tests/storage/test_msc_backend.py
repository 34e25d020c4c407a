"""MscBackend (quicksave.storage.msc) against a real S3 server (SeaweedFS, through the
``s3_server`` / ``s3_bucket`` fixtures), with MSC configs written by ``msc_config.py``."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import multistorageclient  # noqa: F401  (pinned in the dev extra: missing, collection fails)
import pytest
import xxhash
from msc_config import msc_config_for, msc_profile, write_msc_config

from quicksave.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from quicksave.storage.backend import Backend, StorageOptions
from quicksave.storage.msc import MscBackend

MiB = 1 << 20
PART = 5 * MiB  # the profile's multipart part size (S3's minimum) and threshold
PIECE = 3 * MiB  # read_into's ranged GET size in these tests

SMALL_PARTS = {"multipart_threshold": PART, "multipart_chunksize": PART, "max_concurrency": 4}


def _bytes(n: int, seed: int = 1) -> bytes:
    """``n`` deterministic, non-repeating-looking bytes."""
    out = bytearray()
    i = 0
    while len(out) < n:
        out += xxhash.xxh3_128_digest(seed.to_bytes(8, "little") + i.to_bytes(8, "little")) * 64
        i += 1
    return bytes(out[:n])


def _hex(b: bytes | memoryview) -> str:
    return f"{xxhash.xxh3_64(b).intdigest():016x}"


def _all_text(e: BaseException) -> str:
    """Everything an error shows: its str, repr, args and its whole cause chain."""
    parts = []
    seen = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        parts += [str(cur), repr(cur), repr(cur.args)]
        cur = cur.__cause__ or cur.__context__
    return "\n".join(parts)


@pytest.fixture
def bucket(s3_server, s3_bucket) -> str:
    return s3_server.create_bucket(s3_bucket)  # no error if the fixture made it already


@pytest.fixture
def config(s3_server, bucket, tmp_path) -> str:
    return msc_config_for(s3_server, bucket, tmp_path, profile="qs", options=SMALL_PARTS)


@pytest.fixture
def backend(config):
    b = MscBackend("qs", StorageOptions(msc_config=config), read_piece=PIECE)
    yield b
    b.close()


# -- identity ------------------------------------------------------------------------------


def test_protocol_and_url(backend, config):
    assert isinstance(backend, Backend)
    assert backend.scheme == "msc"
    assert backend.atomic_rename is False
    assert backend.url("ckpt/step-1/manifest.json") == "msc://qs/ckpt/step-1/manifest.json"
    assert backend.config_file == config
    assert "secret" not in repr(backend).lower()


def test_import_is_torch_free_and_lazy():
    code = (
        "import sys, quicksave.storage.msc\n"
        "print('torch' in sys.modules, 'multistorageclient' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_missing_msc_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "multistorageclient", None)  # import raises ImportError
    with pytest.raises(CheckpointError, match=r"pip install 'quicksave\[msc\]'"):
        MscBackend("qs", StorageOptions())


# -- put / read_into -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "size", [0, 1, 4096 + 7, 2 * PART + 12345], ids=["0B", "1B", "4KiB", "3parts"]
)
def test_put_read_round_trip(backend, s3_server, bucket, size):
    data = _bytes(size, seed=size)
    key = f"rt/obj-{size}"
    assert backend.put(key, memoryview(data)) == {}
    info = backend.stat(key)
    assert info is not None and info.size == size and info.key == key
    out = bytearray(size)
    backend.read_into(key, 0, memoryview(out))
    assert out == data
    assert backend.get(key, max_bytes=size) == data
    # what landed on the server, read without MSC
    head = s3_server.client().head_object(Bucket=bucket, Key=key)
    assert head["ContentLength"] == size
    if size > PART:  # uploaded in parts: the ETag is "<md5 of md5s>-<number of parts>"
        assert head["ETag"].strip('"').endswith("-3")


def test_put_from_a_typed_view(backend):
    import array

    a = array.array("i", range(1000))  # a non-byte memoryview is read as its bytes
    backend.put("typed", memoryview(a))
    assert backend.get("typed", 1 << 20) == a.tobytes()


def test_range_hashes(backend):
    size = 2 * PART + 999
    data = _bytes(size, seed=7)
    ranges = [
        ("header", 0, 64),
        ("empty", 100, 0),
        ("across-part-boundary", PART - 1000, 2000),
        ("whole", 0, size),
        ("tail", size - 17, 17),
        ("overlap", 50, 3 * MiB),
    ]
    got = backend.put("hashed", memoryview(data), ranges=ranges)
    assert got == {name: _hex(data[off : off + n]) for name, off, n in ranges}
    assert all(len(v) == 16 for v in got.values())


def test_range_outside_the_data_is_refused(backend):
    with pytest.raises(ValueError, match="outside"):
        backend.put("bad", memoryview(b"abc"), ranges=[("x", 2, 5)])
    assert backend.stat("bad") is None


def test_read_into_at_offsets_and_in_parallel_pieces(backend):
    size = 4 * PIECE + 321  # 5 ranged GETs for a whole read
    data = _bytes(size, seed=3)
    backend.put("pieces", memoryview(data))
    for offset, n in [(0, size), (1, size - 1), (PIECE - 5, 2 * PIECE + 10), (size - 3, 3), (7, 0)]:
        out = bytearray(n)
        backend.read_into("pieces", offset, memoryview(out))
        assert out == data[offset : offset + n], (offset, n)
    # into a slice of a larger buffer
    big = bytearray(b"\xee" * (size + 10))
    backend.read_into("pieces", 0, memoryview(big)[5 : 5 + size])
    assert big[:5] == b"\xee" * 5 and big[5 : 5 + size] == data and big[-5:] == b"\xee" * 5


@pytest.mark.parametrize("n", [10, 3 * PIECE], ids=["one-get", "pieces"])
def test_read_past_the_end_names_both_lengths(backend, n):
    backend.put("short", memoryview(b"x" * 100))
    with pytest.raises(CorruptCheckpointError) as ei:
        backend.read_into("short", 95, memoryview(bytearray(n)))
    msg = str(ei.value)
    assert "100 bytes" in msg and f"[95, {95 + n})" in msg and "msc://qs/short" in msg


def test_read_starting_past_the_end(backend):
    backend.put("short", memoryview(b"x" * 100))
    with pytest.raises(CorruptCheckpointError, match="100 bytes"):
        backend.read_into("short", 200, memoryview(bytearray(4)))


def test_read_into_refuses_a_read_only_buffer(backend):
    backend.put("k", memoryview(b"abc"))
    with pytest.raises(ValueError, match="writable"):
        backend.read_into("k", 0, memoryview(b"xyz"))


# -- get / stat ----------------------------------------------------------------------------


def test_get_checks_the_size_first(backend):
    backend.put("doc.json", memoryview(b"{}" * 50))
    assert backend.get("doc.json", 100) == b"{}" * 50
    with pytest.raises(CorruptCheckpointError, match="100 bytes, more than the 99 allowed"):
        backend.get("doc.json", 99)


def test_stat(backend):
    t0 = time.time()
    backend.put("dir/obj", memoryview(b"12345"))
    info = backend.stat("dir/obj")
    assert info is not None and info.size == 5 and info.key == "dir/obj"
    assert abs(info.mtime - t0) < 600  # the server's clock, not ours: loosely
    assert backend.stat("dir/none") is None
    assert backend.stat("dir") is None  # a "directory" is not an object
    assert backend.stat("dir/") is None


# -- missing objects -----------------------------------------------------------------------


def test_missing_object(backend):
    for call in (
        lambda: backend.read_into("no/such", 0, memoryview(bytearray(10))),
        lambda: backend.read_into("no/such", 0, memoryview(bytearray(3 * PIECE))),
        lambda: backend.read_into("no/such", 0, memoryview(bytearray(0))),
        lambda: backend.get("no/such", 100),
    ):
        with pytest.raises(CheckpointNotFoundError) as ei:
            call()
        assert ei.value.path == "msc://qs/no/such"
        assert "msc://qs/no/such" in str(ei.value)


# -- list / children / delete --------------------------------------------------------------


def _populate(backend) -> list[str]:
    keys = [
        "run/step-1/manifest.json",
        "run/step-1/data/rank0.bin",
        "run/step-1/data/rank1.bin",
        "run/step-10/manifest.json",
        "run/step-2.tmp-abc/part-0",
        "run/latest",
        "other/x",
    ]
    for i, k in enumerate(keys):
        backend.put(k, memoryview(b"z" * i))
    return keys


def test_list(backend):
    keys = _populate(backend)
    listed = {o.key: o.size for o in backend.list("run/")}
    assert listed == {k: i for i, k in enumerate(keys) if k.startswith("run/")}
    assert sorted(o.key for o in backend.list("run/step-1")) == sorted(
        k
        for k in keys
        if k.startswith("run/step-1")  # a name prefix: step-1 and step-10
    )
    assert sorted(o.key for o in backend.list("run/step-1/")) == sorted(
        k for k in keys if k.startswith("run/step-1/")
    )
    assert [o.key for o in backend.list("run/step-2.tmp")] == ["run/step-2.tmp-abc/part-0"]
    assert sorted(o.key for o in backend.list("")) == sorted(keys)
    assert list(backend.list("nothing/")) == []
    assert list(backend.list("run/zzz")) == []


def test_children(backend):
    _populate(backend)
    assert backend.children("run") == ["latest", "step-1", "step-10", "step-2.tmp-abc"]
    assert backend.children("run/") == ["latest", "step-1", "step-10", "step-2.tmp-abc"]
    assert backend.children("run/step-1") == ["data", "manifest.json"]
    assert backend.children("run/step-1/data/") == ["rank0.bin", "rank1.bin"]
    assert backend.children("") == ["other", "run"]
    assert backend.children("nothing") == []


def test_delete(backend):
    keys = _populate(backend)
    backend.delete([])
    backend.delete(["run/latest", "run/latest", "never/was"])  # duplicates and missing: fine
    assert backend.stat("run/latest") is None
    backend.delete(o.key for o in backend.list("run/"))
    assert list(backend.list("run/")) == []
    assert [o.key for o in backend.list("")] == ["other/x"]
    # SeaweedFS keeps the emptied "directory" run/ as a common prefix; S3 would not
    assert "other" in backend.children("") and set(backend.children("")) <= {"other", "run"}
    del keys


def test_delete_many(backend):
    keys = [f"many/{i:04d}" for i in range(40)]
    for k in keys:
        backend.put(k, memoryview(b"."))
    backend.delete(keys)
    assert list(backend.list("many/")) == []


def test_abort_uploads_is_zero(backend):
    assert backend.abort_uploads("", older_than_s=0) == 0


# -- configuration -------------------------------------------------------------------------


def test_msc_config_env_is_the_default(s3_server, bucket, tmp_path, monkeypatch):
    path = msc_config_for(s3_server, bucket, tmp_path, profile="envprof", fmt="json")
    monkeypatch.setenv("MSC_CONFIG", path)
    with MscBackend("envprof", StorageOptions()) as b:
        assert b.config_file == path
        b.put("via-env", memoryview(b"hello"))
        assert b.get("via-env", 10) == b"hello"


def test_prefix_inside_the_bucket(s3_server, bucket, tmp_path):
    path = msc_config_for(s3_server, bucket, tmp_path, profile="sub", prefix="team/a")
    with MscBackend("sub", StorageOptions(msc_config=path)) as b:
        b.put("ckpt/k", memoryview(b"v"))
        assert [o.key for o in b.list("")] == ["ckpt/k"]
        assert b.children("") == ["ckpt"]
    body = s3_server.client().get_object(Bucket=bucket, Key="team/a/ckpt/k")["Body"].read()
    assert body == b"v"


def test_unknown_profile(config):
    with pytest.raises(CheckpointError) as ei:
        MscBackend("nope", StorageOptions(msc_config=config))
    msg = str(ei.value)
    assert "'nope'" in msg and config in msg and "qs" in msg


def test_unknown_profile_without_any_config(tmp_path, monkeypatch):
    monkeypatch.delenv("MSC_CONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("XDG_CONFIG_DIRS", str(tmp_path / "xdg-dirs"))
    if any(os.path.exists(p) for p in ("/etc/msc_config.yaml", "/etc/msc_config.json")):
        pytest.skip("a system-wide MSC config exists")
    with pytest.raises(CheckpointError, match=r"unknown MSC profile 'nope'.*MSC_CONFIG"):
        MscBackend("nope", StorageOptions())


def test_config_file_that_does_not_exist(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(CheckpointError, match="does not exist") as ei:
        MscBackend("qs", StorageOptions(msc_config=missing))
    assert missing in str(ei.value)


def test_posix_profile_is_a_store_too(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    cfg = tmp_path / "posix.json"
    cfg.write_text(
        json.dumps(
            {
                "profiles": {
                    "local": {
                        "storage_provider": {"type": "file", "options": {"base_path": str(root)}}
                    }
                }
            }
        )
    )
    with MscBackend("local", StorageOptions(msc_config=str(cfg)), read_piece=1000) as b:
        assert b.atomic_rename is False
        data = _bytes(5000)
        assert b.put("a/b/c", memoryview(data), ranges=[("r", 10, 100)]) == {
            "r": _hex(data[10:110])
        }
        out = bytearray(4000)
        b.read_into("a/b/c", 500, memoryview(out))
        assert out == data[500:4500]
        assert b.children("a") == ["b"]
        assert [o.key for o in b.list("a/")] == ["a/b/c"]
        assert (root / "a" / "b" / "c").read_bytes() == data
        b.delete(["a/b/c"])
        assert b.stat("a/b/c") is None


# -- errors never show a secret ------------------------------------------------------------


def test_wrong_secret_is_a_permission_error_without_the_secret(s3_server, bucket, tmp_path):
    wrong = "Wr0ng-" + s3_server.secret_access_key[::-1]
    path = msc_config_for(s3_server, bucket, tmp_path, profile="bad", secret_key=wrong)
    with MscBackend("bad", StorageOptions(msc_config=path)) as b:
        for call in (
            lambda: b.put("k", memoryview(b"data")),
            lambda: b.read_into("k", 0, memoryview(bytearray(4))),
            lambda: list(b.list("")),
        ):
            with pytest.raises(CheckpointError) as ei:
                call()
            text = _all_text(ei.value)
            assert wrong not in text and s3_server.secret_access_key not in text
            assert "msc://bad/" in str(ei.value)
        with pytest.raises(CheckpointError, match="permission denied") as ei:
            b.put("k", memoryview(b"data"))
        assert "'bad'" in str(ei.value) and path in str(ei.value)


def test_access_denied_is_a_permission_error(s3_server, bucket, tmp_path):
    path = msc_config_for(
        s3_server,
        bucket,  # not the restricted identity's bucket
        tmp_path,
        profile="restricted",
        access_key=s3_server.restricted_access_key_id,
        secret_key=s3_server.restricted_secret_access_key,
    )
    with MscBackend("restricted", StorageOptions(msc_config=path)) as b:
        with pytest.raises(CheckpointError, match="permission denied") as ei:
            b.put("k", memoryview(b"data"))
    assert s3_server.restricted_secret_access_key not in _all_text(ei.value)


def test_unreachable_endpoint(s3_server, tmp_path):
    secret = "Sekr1t-" + "q" * 30
    path = write_msc_config(
        tmp_path,
        endpoint_url="http://127.0.0.1:9",  # discard port: connection refused
        bucket="b",
        profile="down",
        access_key="AKIDOWN",
        secret_key=secret,
        options={"retries": {"max_attempts": 1, "mode": "standard"}, "connect_timeout": 2},
    )
    with MscBackend("down", StorageOptions(msc_config=path)) as b:
        with pytest.raises(CheckpointError, match="cannot reach") as ei:
            b.get("k", 10)
    assert secret not in _all_text(ei.value)
    assert "msc://down/k" in str(ei.value)


def test_malformed_config_does_not_echo_the_secret(tmp_path):
    secret = "Sekr1t-Malformed-" + "w" * 20
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(
        "profiles:\n"
        "  qs:\n"
        "    credentials_provider:\n"
        "      type: S3Credentials\n"
        f"      options: {{secret_key: {secret}: oops, access_key: AKIDX}}\n"
    )
    with pytest.raises(CheckpointError) as ei:
        MscBackend("qs", StorageOptions(msc_config=str(cfg)))
    assert secret not in _all_text(ei.value)
    assert str(cfg) in str(ei.value)


def test_invalid_config_does_not_echo_the_secret(tmp_path):
    secret = "Sekr1t-Invalid-" + "v" * 20
    profile = msc_profile(endpoint_url="http://127.0.0.1:9", bucket="b", secret_key=secret)
    profile["storage_provider"]["type"] = "not-a-provider"  # fails MSC's schema
    cfg = tmp_path / "invalid.json"
    cfg.write_text(json.dumps({"profiles": {"qs": profile}}))
    with pytest.raises(CheckpointError) as ei:
        MscBackend("qs", StorageOptions(msc_config=str(cfg)))
    assert secret not in _all_text(ei.value)


# -- life cycle ----------------------------------------------------------------------------


def test_close(config):
    b = MscBackend("qs", StorageOptions(msc_config=config))
    b.put("k", memoryview(b"v"))
    b.close()
    b.close()
    with pytest.raises(CheckpointError, match="closed"):
        b.get("k", 10)


def test_pickles_as_profile_and_options(backend):
    backend.put("p", memoryview(b"pickled"))
    clone = pickle.loads(pickle.dumps(backend))
    try:
        assert clone.profile == "qs" and clone.config_file == backend.config_file
        assert clone.get("p", 100) == b"pickled"
    finally:
        clone.close()


def test_concurrent_puts_and_reads(backend):
    from concurrent.futures import ThreadPoolExecutor

    blobs = {f"conc/{i}": _bytes(PART + i * 1000, seed=i) for i in range(4)}

    def one(item):
        key, data = item
        h = backend.put(key, memoryview(data), ranges=[("all", 0, len(data))])
        out = bytearray(len(data))
        backend.read_into(key, 0, memoryview(out))
        return h["all"] == _hex(data) and out == data

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(one, blobs.items()))


def test_helper_writes_yaml_and_json(tmp_path):
    y = write_msc_config(tmp_path, endpoint_url="http://h:1", bucket="b", profile="p")
    j = write_msc_config(tmp_path, endpoint_url="http://h:1", bucket="b", profile="p", fmt="json")
    assert Path(y).suffix == ".yaml" and Path(j).suffix == ".json"
    doc = json.loads(Path(j).read_text())
    opts = doc["profiles"]["p"]["storage_provider"]["options"]
    assert opts["base_path"] == "b" and opts["s3"] == {"addressing_style": "path"}


# -- faults (through the FaultProxy in front of the server) ---------------------------------


@pytest.fixture
def proxied(s3_server, bucket, tmp_path, fault_proxy):
    path = msc_config_for(
        s3_server,
        bucket,
        tmp_path,
        profile="px",
        endpoint_url=fault_proxy.endpoint_url,
        options={**SMALL_PARTS, "retries": {"max_attempts": 3, "mode": "standard"}},
    )
    with MscBackend("px", StorageOptions(msc_config=path), read_piece=PIECE) as b:
        yield b


def test_transient_errors_are_retried(proxied, fault_proxy):
    data = _bytes(2 * PART + 5, seed=11)
    fault_proxy.fail_next(2, "slowdown")  # 503 SlowDown twice, then the server again
    assert proxied.put("retried", memoryview(data), ranges=[("all", 0, len(data))]) == {
        "all": _hex(data)
    }
    fault_proxy.fail_next(2, "slowdown")
    out = bytearray(len(data))
    proxied.read_into("retried", 0, memoryview(out))
    assert out == data
    assert fault_proxy.stats["slowdowns"] == 4


def test_a_failed_upload_leaves_no_object(proxied, fault_proxy, s3_server):
    data = _bytes(2 * PART + 5, seed=12)
    fault_proxy.mode = "drop"  # every request: connection reset
    with pytest.raises(CheckpointError) as ei:
        proxied.put("torn", memoryview(data))
    assert "msc://px/torn" in str(ei.value)
    assert s3_server.secret_access_key not in _all_text(ei.value)
    fault_proxy.mode = "pass"
    assert proxied.stat("torn") is None
