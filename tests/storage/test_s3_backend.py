"""The S3 backend against a real S3 server (SeaweedFS on loopback, fixtures in
tests/storage/conftest.py), with a fault-injecting proxy in front where failures are
the point."""

from __future__ import annotations

import base64
import hashlib
import os
import random
import socket
import time

import boto3  # noqa: F401  (pinned in the dev extra: missing, collection fails)
import pytest
import xxhash

from quicksave.checksum import hexdigest
from quicksave.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from quicksave.storage.backend import Backend, ObjectInfo, S3Options
from quicksave.storage.s3 import S3Backend
from quicksave.storage.s3.upload import MIN_PART_SIZE

PART = MIN_PART_SIZE  # 5 MiB: the smallest part S3 allows keeps these tests fast


def options(server, **overrides) -> S3Options:
    settings = dict(
        endpoint_url=server.endpoint_url,
        access_key_id=server.access_key_id,
        secret_access_key=server.secret_access_key,
        region=server.region,
        part_size=PART,
        max_concurrency=4,
    )
    settings.update(overrides)
    return S3Options(**settings)


@pytest.fixture
def bucket(s3_server, s3_bucket):
    s3_server.create_bucket(s3_bucket)  # no error if the fixture made it already
    return s3_bucket


@pytest.fixture
def backend(s3_server, bucket):
    b = S3Backend(bucket, options(s3_server))
    yield b
    b.close()


def payload(n: int, seed: int = 0) -> bytearray:
    return bytearray(random.Random(seed * 1_000_003 + n).randbytes(n))


def xxh(data) -> str:
    return hexdigest(xxhash.xxh3_64_intdigest(bytes(data)))


def test_is_a_backend(backend, bucket):
    assert isinstance(backend, Backend)
    assert backend.scheme == "s3" and backend.atomic_rename is False
    assert backend.url("run/step-1/data") == f"s3://{bucket}/run/step-1/data"


@pytest.mark.parametrize(
    "size", [0, 1, PART - 1, PART, PART + 1, int(3.5 * PART)], ids=lambda n: f"{n}B"
)
def test_put_read_round_trip_with_ranges(backend, s3_server, bucket, size):
    data = payload(size)
    ranges = [("whole", 0, size), ("empty", size // 2, 0)]
    if size > 2:
        ranges += [("head", 0, size // 3), ("tail", size - size // 3, size // 3)]
    if size > PART:
        ranges.append(("across", PART - 1000, 1001))  # spans the first part boundary
    digests = backend.put("obj", memoryview(data), ranges=ranges)
    assert digests == {name: xxh(data[off : off + n]) for name, off, n in ranges}

    out = bytearray(size)
    backend.read_into("obj", 0, memoryview(out))
    assert out == data
    assert backend.stat("obj").size == size
    assert backend.get("obj", size) == bytes(data)
    etag = s3_server.client().head_object(Bucket=bucket, Key="obj")["ETag"]
    parts = -(-size // PART)
    # a single PUT up to part_size, a multipart upload of ceil(size / part) parts beyond
    assert etag.strip('"').endswith(f"-{parts}") == (size > PART)


def test_read_into_across_part_boundaries(backend):
    size = int(3.5 * PART)
    data = payload(size, seed=1)
    backend.put("obj", memoryview(data))
    cases = [
        (PART - 100, 200),  # a small read across the first boundary
        (2 * PART - 1, PART + 7),  # > part_size: split into parallel ranged GETs
        (3, size - 3),  # almost all of it, from an odd offset
        (size - 1, 1),  # the last byte
        (size, 0),  # an empty read at the very end
        (12345, 3 * PART),  # three full-size pieces, none aligned
    ]
    for offset, length in cases:
        out = bytearray(length)
        backend.read_into("obj", offset, memoryview(out))
        assert out == data[offset : offset + length], (offset, length)


def test_read_into_non_byte_buffer(backend):
    import array

    data = payload(4096, seed=2)
    backend.put("obj", memoryview(data))
    dest = array.array("I", bytes(4096))  # 4-byte items: cast to bytes inside
    backend.read_into("obj", 0, memoryview(dest))
    assert dest.tobytes() == bytes(data)


def test_short_and_missing_objects(backend, bucket):
    backend.put("ten", memoryview(b"0123456789"))
    with pytest.raises(CorruptCheckpointError) as info:
        backend.read_into("ten", 4, memoryview(bytearray(10)))
    text = str(info.value)
    assert f"s3://{bucket}/ten" in text and "10 bytes" in text and "offset 4" in text
    with pytest.raises(CorruptCheckpointError, match="only 10 bytes"):
        backend.read_into("ten", 10, memoryview(bytearray(1)))  # starts at the end
    with pytest.raises(CorruptCheckpointError, match="only 10 bytes"):
        backend.read_into("ten", 11, memoryview(bytearray(0)))
    with pytest.raises(CorruptCheckpointError, match="only 10 bytes"):  # split read
        backend.read_into("ten", 0, memoryview(bytearray(2 * PART + 1)))
    with pytest.raises(CheckpointNotFoundError, match=f"s3://{bucket}/nope"):
        backend.read_into("nope", 0, memoryview(bytearray(3)))
    with pytest.raises(CheckpointNotFoundError, match=f"s3://{bucket}/nope"):
        backend.read_into("nope", 0, memoryview(bytearray(0)))
    with pytest.raises(CheckpointNotFoundError, match=f"s3://{bucket}/nope"):
        backend.get("nope", 100)
    with pytest.raises(CorruptCheckpointError, match="10 bytes, more than the 9"):
        backend.get("ten", 9)
    assert backend.get("ten", 10) == b"0123456789"
    assert backend.stat("nope") is None


def test_list_children_stat_delete(backend):
    keys = ["run/a", "run/b/c", "run/b/d", "run/e/f/g", "runx", "other/x"]
    for i, key in enumerate(keys):
        backend.put(key, memoryview(b"x" * i))
    assert backend.children("run") == ["a", "b", "e"]
    assert backend.children("run/") == ["a", "b", "e"]
    assert backend.children("run/b") == ["c", "d"]
    assert backend.children("") == ["other", "run", "runx"]
    assert backend.children("nothing/here") == []

    listed = sorted(backend.list("run/"), key=lambda o: o.key)
    assert [o.key for o in listed] == ["run/a", "run/b/c", "run/b/d", "run/e/f/g"]
    assert [o.size for o in listed] == [0, 1, 2, 3]
    assert {o.key for o in backend.list("run")} == {*keys[:5]}  # a plain prefix
    assert all(abs(o.mtime - time.time()) < 600 for o in listed)

    info = backend.stat("run/b/d")
    assert isinstance(info, ObjectInfo) and info.key == "run/b/d" and info.size == 2

    backend.delete(["run/a", "run/b/c", "never/existed", "run/a"])
    assert backend.stat("run/a") is None and backend.stat("run/b/c") is None
    assert backend.children("run") == ["b", "e"]
    backend.delete([])


def test_list_paginates(backend):
    for i in range(30):
        backend.put(f"many/{i:03d}", memoryview(b"."))
    client = backend._client
    original = client.list_objects_v2
    pages = []

    def small_pages(**kw):
        pages.append(kw)
        return original(**kw, MaxKeys=7)

    client.list_objects_v2 = small_pages
    try:
        assert len(list(backend.list("many/"))) == 30
        assert len(pages) == 5
        assert backend.children("many") == [f"{i:03d}" for i in range(30)]
    finally:
        del client.list_objects_v2


def test_abort_uploads_finds_incomplete_upload(backend, s3_server, bucket):
    client = s3_server.client()
    up = client.create_multipart_upload(Bucket=bucket, Key="run/step-1/data")
    client.upload_part(
        Bucket=bucket, Key="run/step-1/data", UploadId=up["UploadId"], PartNumber=1, Body=b"x"
    )
    other = client.create_multipart_upload(Bucket=bucket, Key="elsewhere/data")
    assert backend.abort_uploads("run/", older_than_s=3600) == 0  # too young
    time.sleep(1.5)
    assert backend.abort_uploads("run/", older_than_s=0.1) == 1
    left = client.list_multipart_uploads(Bucket=bucket).get("Uploads") or []
    assert [u["UploadId"] for u in left] == [other["UploadId"]]
    assert backend.abort_uploads("run/", older_than_s=0.1) == 0
    assert backend.abort_uploads("", older_than_s=0.1) == 1


def test_missing_bucket(s3_server):
    # reads only: SeaweedFS creates a missing bucket on an authenticated PUT (AWS answers
    # NoSuchBucket; the 403 SeaweedFS gives anonymous PUTs is covered in test_s3_retry)
    b = S3Backend("no-such-bucket-qs", options(s3_server))
    try:
        for op in (
            lambda: b.read_into("k", 0, memoryview(bytearray(4))),
            lambda: b.read_into("k", 0, memoryview(bytearray(2 * PART + 1))),
            lambda: b.get("k", 10),
            lambda: b.stat("k"),
            lambda: list(b.list("k")),
            lambda: b.children("k"),
        ):
            with pytest.raises(CheckpointError) as info:
                op()
            assert not isinstance(info.value, CheckpointNotFoundError)
            assert "no such bucket 'no-such-bucket-qs'" in str(info.value)
            assert "s3://no-such-bucket-qs/" in str(info.value)
    finally:
        b.close()


def test_wrong_credentials(s3_server, bucket, fault_proxy):
    wrong = "WRONGsecret+" + os.urandom(8).hex()
    via = fault_proxy.endpoint_url  # the proxy counts the requests
    cases = [
        (options(s3_server, endpoint_url=via, secret_access_key=wrong), "SignatureDoesNotMatch"),
        (
            options(
                s3_server,
                endpoint_url=via,
                access_key_id="AKIANOSUCHKEY0000000",
                secret_access_key=wrong,
            ),
            "InvalidAccessKeyId",
        ),
    ]
    for opts, code in cases:
        b = S3Backend(bucket, opts)
        try:
            for op in (
                lambda b=b: b.put("k", memoryview(b"data")),
                lambda b=b: b.read_into("k", 0, memoryview(bytearray(4))),
                lambda b=b: list(b.list("")),
            ):
                before = fault_proxy.stats["requests"]
                with pytest.raises(CheckpointError) as info:
                    op()
                assert fault_proxy.stats["requests"] == before + 1  # refused once, not retried
                text = str(info.value)
                assert f"bad credentials ({code})" in text, text
                assert f"s3://{bucket}/" in text
                assert wrong not in text and wrong not in repr(info.value)
                assert s3_server.secret_access_key not in text
        finally:
            b.close()


def test_access_denied(s3_server, bucket):
    opts = options(
        s3_server,
        access_key_id=s3_server.restricted_access_key_id,
        secret_access_key=s3_server.restricted_secret_access_key,
    )
    b = S3Backend(bucket, opts)
    try:
        with pytest.raises(CheckpointError, match="access denied") as info:
            b.put("k", memoryview(b"data"))
        assert f"s3://{bucket}/k" in str(info.value)
        assert s3_server.restricted_secret_access_key not in str(info.value)
    finally:
        b.close()
    allowed = s3_server.create_bucket(s3_server.restricted_bucket)
    with S3Backend(allowed, opts) as ok:
        ok.put("qs-probe", memoryview(b"fine"))
        assert ok.get("qs-probe", 10) == b"fine"
        ok.delete(["qs-probe"])


def test_configuration_from_environment(s3_server, bucket, monkeypatch):
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    with S3Backend(bucket, S3Options(part_size=PART)) as b:
        assert b.endpoint_url == s3_server.endpoint_url
        b.put("env", memoryview(b"from the environment"))
        assert b.get("env", 100) == b"from the environment"
        # options win over the environment
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with S3Backend(bucket, S3Options(secret_access_key=s3_server.secret_access_key)) as b:
        assert b.get("env", 100) == b"from the environment"


def test_unreachable_endpoint(bucket):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    opts = S3Options(
        endpoint_url=f"http://127.0.0.1:{port}",
        access_key_id="AKIAX",
        secret_access_key="secret-xyz",
        region="us-east-1",
        max_attempts=3,
        retry_deadline_s=5,
        connect_timeout_s=1,
    )
    with S3Backend(bucket, opts) as b:
        t0 = time.monotonic()
        with pytest.raises(CheckpointError) as info:
            b.stat("k")
        assert time.monotonic() - t0 < 30
    text = str(info.value)
    assert f"cannot reach endpoint http://127.0.0.1:{port}" in text
    assert f"s3://{bucket}/k" in text and "3 attempt" in text
    assert "secret-xyz" not in text


# --------------------------------------------------------------------------- faults


def test_slowdown_is_retried(s3_server, bucket, fault_proxy):
    opts = options(s3_server, endpoint_url=fault_proxy.endpoint_url, max_attempts=5)
    with S3Backend(bucket, opts) as b:
        fault_proxy.fail_next(2, "slowdown")
        b.put("through-proxy", memoryview(b"survived throttling"))
        fault_proxy.fail_next(2, "slowdown")
        assert b.get("through-proxy", 100) == b"survived throttling"
    assert fault_proxy.stats["slowdowns"] == 4


def test_slowdown_gives_up_after_max_attempts(s3_server, bucket, fault_proxy):
    opts = options(s3_server, endpoint_url=fault_proxy.endpoint_url, max_attempts=2)
    with S3Backend(bucket, opts) as b:
        fault_proxy.mode = "slowdown"
        with pytest.raises(CheckpointError) as info:
            b.put("k", memoryview(b"x"))
        fault_proxy.mode = "pass"
    assert "2 attempt" in str(info.value) and f"s3://{bucket}/k" in str(info.value)


def test_dropped_connections_are_retried_for_parts_and_reads(s3_server, bucket, fault_proxy):
    data = payload(2 * PART + 5, seed=3)
    opts = options(s3_server, endpoint_url=fault_proxy.endpoint_url, max_attempts=6)
    with S3Backend(bucket, opts) as b:
        fault_proxy.fail_next(2, "drop")
        b.put("big", memoryview(data), ranges=[("all", 0, len(data))])
        out = bytearray(len(data))
        fault_proxy.fail_next(2, "drop")
        b.read_into("big", 0, memoryview(out))
    assert out == data
    assert fault_proxy.stats["dropped"] == 4


def test_blackhole_fails_in_bounded_time(s3_server, bucket, fault_proxy):
    opts = options(
        s3_server,
        endpoint_url=fault_proxy.endpoint_url,
        read_timeout_s=1.0,
        connect_timeout_s=1.0,
        retry_deadline_s=3.0,
        max_attempts=100,
    )
    with S3Backend(bucket, opts) as b:
        fault_proxy.mode = "blackhole"
        try:
            for op in (
                lambda: b.put("k", memoryview(b"x" * 100)),
                lambda: b.read_into("k", 0, memoryview(bytearray(10))),
            ):
                t0 = time.monotonic()
                with pytest.raises(CheckpointError) as info:
                    op()
                assert time.monotonic() - t0 < 30  # a hang guard, not a timing test
                assert f"s3://{bucket}/k" in str(info.value)
                assert "read_timeout_s=1" in str(info.value)
        finally:
            fault_proxy.mode = "pass"


def test_single_puts_are_checked_by_the_store(backend, s3_server, bucket, monkeypatch):
    """A single PUT carries Content-MD5, and the store refuses a body that does not
    match it: a PUT cut off by the writer's death can never leave a truncated object
    (for a manifest, that would be a half-written commit)."""
    sent = []
    real = backend._client.put_object

    def spy(**kwargs):
        sent.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(backend._client, "put_object", spy)
    data = payload(5000)
    backend.put("manifest.json", memoryview(data))
    assert sent[-1]["ContentMD5"] == base64.b64encode(hashlib.md5(data).digest()).decode()
    assert backend.get("manifest.json", 5000) == bytes(data)
    # the server really checks it: a body that is not the one the digest was taken of
    with pytest.raises(Exception, match="BadDigest|InvalidDigest|Content-MD5|md5"):
        s3_server.client().put_object(
            Bucket=bucket, Key="short", Body=bytes(data[:4000]), ContentMD5=sent[-1]["ContentMD5"]
        )
    assert backend.stat("short") is None
