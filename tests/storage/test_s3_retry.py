"""The S3 backend's retry loop and error handling, with an in-process fake client.

The fake stands in for botocore's S3 client only where a real server cannot be made to
fail on cue (throttling on the Nth try, a reset in the middle of a body, a part that
fails after others were sent); behaviour against a real store is in test_s3_backend.py.
"""

from __future__ import annotations

import datetime
import http.client
import random
import subprocess
import sys
import threading

import boto3  # noqa: F401  (pinned in the dev extra: missing, collection fails)
import pytest
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
    ReadTimeoutError,
)

from quicksave.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from quicksave.storage.backend import S3Options
from quicksave.storage.retry import RetryPolicy, call_with_retries
from quicksave.storage.s3 import S3Backend
from quicksave.storage.s3.errors import is_retryable
from quicksave.storage.s3.upload import MIN_PART_SIZE

SECRET = "FAKEsecretKEY/do-not-print+0123456789abcdef"
TOKEN = "FAKEsessionTOKEN-never-shown-9876543210"
MiB = 1 << 20


def client_error(code: str, status: int, message: str = "", op: str = "PutObject") -> ClientError:
    return ClientError(
        {
            "Error": {"Code": code, "Message": message},
            "ResponseMetadata": {"HTTPStatusCode": status},
        },
        op,
    )


class FakeBody:
    """A response body whose read() can fail after some bytes."""

    def __init__(self, data: bytes, fail_after: int | None = None) -> None:
        self._data = data
        self._pos = 0
        self._fail_after = fail_after

    def read(self, amt: int | None = None) -> bytes:
        end = len(self._data) if amt is None else min(len(self._data), self._pos + amt)
        if self._fail_after is not None and end > self._fail_after:
            if self._pos >= self._fail_after:
                raise ConnectionResetError("connection reset by peer")
            end = self._fail_after
        chunk = self._data[self._pos : end]
        self._pos = end
        return chunk

    def close(self) -> None:
        pass


class FakeMeta:
    endpoint_url = "http://fake-s3.invalid:9000"


class FakeClient:
    """Records every call; ``script[op]`` is a list of outcomes used in turn (an
    exception is raised, anything else is returned, a callable is called with the
    kwargs); when a script runs out, ``default[op]`` answers."""

    meta = FakeMeta()

    def __init__(self, **script: list) -> None:
        self.script = {op: list(outcomes) for op, outcomes in script.items()}
        self.calls: list[tuple[str, dict]] = []
        self.lock = threading.Lock()
        self.objects: dict[str, bytes] = {}

    def _answer(self, op: str, kwargs: dict, default):
        with self.lock:
            self.calls.append((op, kwargs))
            outcomes = self.script.get(op)
            outcome = outcomes.pop(0) if outcomes else default
        if isinstance(outcome, BaseException):
            raise outcome
        if callable(outcome):
            return outcome(**kwargs)
        return outcome

    def ops(self, op: str) -> list[dict]:
        return [kw for name, kw in self.calls if name == op]

    # the S3 operations the backend uses
    def put_object(self, **kw):
        return self._answer("put_object", kw, {"ETag": '"e"'})

    def create_multipart_upload(self, **kw):
        return self._answer("create_multipart_upload", kw, {"UploadId": "UP1"})

    def upload_part(self, **kw):
        body = kw["Body"]
        data = bytes(body) if isinstance(body, (bytes, bytearray)) else bytes(body.read())
        kw = {**kw, "Body": data}
        return self._answer("upload_part", kw, {"ETag": f'"etag-{kw["PartNumber"]}"'})

    def complete_multipart_upload(self, **kw):
        return self._answer("complete_multipart_upload", kw, {})

    def abort_multipart_upload(self, **kw):
        return self._answer("abort_multipart_upload", kw, {})

    def head_bucket(self, **kw):
        return self._answer("head_bucket", kw, {})

    def head_object(self, **kw):
        return self._answer("head_object", kw, client_error("404", 404, op="HeadObject"))

    def get_object(self, **kw):
        return self._answer("get_object", kw, client_error("NoSuchKey", 404, op="GetObject"))

    def delete_objects(self, **kw):
        return self._answer("delete_objects", kw, {})

    def list_objects_v2(self, **kw):
        return self._answer("list_objects_v2", kw, {"IsTruncated": False})

    def list_multipart_uploads(self, **kw):
        return self._answer("list_multipart_uploads", kw, {"IsTruncated": False})


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def backend(client: FakeClient, clock: Clock | None = None, **opts) -> S3Backend:
    clock = clock or Clock()
    options = S3Options(
        secret_access_key=SECRET,
        session_token=TOKEN,
        access_key_id="AKIAFAKE",
        part_size=opts.pop("part_size", MIN_PART_SIZE),
        max_concurrency=opts.pop("max_concurrency", 3),
        max_attempts=opts.pop("max_attempts", None),
        retry_deadline_s=opts.pop("retry_deadline_s", 60.0),
        **opts,
    )
    return S3Backend(
        "bkt", options, client=client, rng=random.Random(7), sleep=clock.sleep, clock=clock
    )


def assert_no_secret(exc: BaseException) -> None:
    for text in (str(exc), repr(exc), str(exc.args)):
        assert SECRET not in text and TOKEN not in text


# --------------------------------------------------------------------------- the loop


def test_retries_throttling_5xx_and_resets_then_succeeds():
    client = FakeClient(
        put_object=[
            client_error("SlowDown", 503, "Please reduce your request rate."),
            client_error("ServiceUnavailable", 503),
            ConnectionResetError(104, "Connection reset by peer"),
            client_error("InternalError", 500),
            {"ETag": '"ok"'},
        ]
    )
    clock = Clock()
    b = backend(client, clock)
    digests = b.put("k", memoryview(b"hello"), ranges=[("all", 0, 5)])
    assert len(client.ops("put_object")) == 5
    assert digests["all"] == format(__import__("xxhash").xxh3_64_intdigest(b"hello"), "016x")
    # full jitter: try n waits uniform(0, min(cap, base * 2**(n-1)))
    assert len(clock.sleeps) == 4
    for n, pause in enumerate(clock.sleeps, start=1):
        assert 0.0 <= pause <= min(5.0, 0.1 * 2 ** (n - 1))


def test_gives_up_after_max_attempts_naming_url_and_last_cause():
    client = FakeClient(put_object=[client_error("SlowDown", 503, "Reduce your rate")] * 10)
    b = backend(client, max_attempts=3)
    with pytest.raises(CheckpointError) as info:
        b.put("run/step-1/data", memoryview(b"x" * 10))
    e = info.value
    assert len(client.ops("put_object")) == 3
    assert "s3://bkt/run/step-1/data" in str(e)
    assert "3 attempt" in str(e) and "SlowDown" in str(e)
    assert type(e) is CheckpointError


def test_respects_retry_deadline():
    clock = Clock()
    calls = []

    def slow_failure(**kw):
        calls.append(kw)
        clock.now += 10.0  # each try takes 10 s (e.g. a read timeout)
        raise ReadTimeoutError(endpoint_url="http://fake-s3.invalid:9000/bkt/k")

    client = FakeClient(get_object=[slow_failure] * 100)
    b = backend(client, clock, max_attempts=100, retry_deadline_s=25.0)
    with pytest.raises(CheckpointError) as info:
        b.read_into("k", 0, memoryview(bytearray(4)))
    # tries start at t=0, ~10, ~20; none starts after 25 s
    assert 2 <= len(calls) <= 3
    assert clock.now < 25.0 + 10.0 + 5.0
    assert "s3://bkt/k" in str(info.value) and "read_timeout_s" in str(info.value)


def test_deadline_with_real_clock_is_bounded():
    attempts = []

    def fail():
        attempts.append(1)
        raise ConnectionResetError("reset")

    policy = RetryPolicy(max_attempts=1000, deadline_s=0.3, base_s=0.01, cap_s=0.05)
    with pytest.raises(CheckpointError, match="last cause: ConnectionResetError"):
        call_with_retries(
            fail,
            policy,
            what="op",
            url="s3://b/k",
            retryable=is_retryable,
            translate=lambda e: CheckpointError(str(e)),
        )
    assert 2 < len(attempts) < 1000


def test_the_deadline_rules_connection_errors_not_a_count_of_tries():
    # The store is down for 40 s (connections refused), then back. With the default
    # policy (no max_attempts) a 60 s deadline rides it out, however many tries it takes;
    # the old loop gave up after 6 tries in a couple of seconds.
    clock = Clock()

    def refused(**kw):
        if clock.now < 40.0:
            raise EndpointConnectionError(endpoint_url="http://fake-s3.invalid:9000/bkt/k")
        return {"ETag": '"back"'}

    client = FakeClient(put_object=[refused] * 1000)
    b = backend(client, clock, retry_deadline_s=60.0)
    b.put("k", memoryview(b"data"))
    tries = len(client.ops("put_object"))
    assert tries > 6  # more than the old cap of 6
    assert 40.0 <= clock.now <= 60.0
    assert all(0.0 <= pause <= 5.0 for pause in clock.sleeps)  # capped per pause


def test_an_outage_longer_than_the_deadline_gives_up_at_the_deadline_not_before():
    clock = Clock()
    client = FakeClient(
        head_object=[EndpointConnectionError(endpoint_url="http://fake-s3.invalid:9000")] * 1000
    )
    b = backend(client, clock, retry_deadline_s=60.0)
    with pytest.raises(CheckpointError) as info:
        b.stat("run/step-5/manifest.json")
    # the last pause is cut to the time left: the last try starts at the deadline
    assert clock.now == pytest.approx(60.0)
    text = str(info.value)
    assert "s3://bkt/run/step-5/manifest.json" in text
    assert f"{len(client.ops('head_object'))} attempt(s) in 60.0 s" in text
    assert "retry_deadline_s=60" in text and "max_attempts" not in text
    assert "cannot reach endpoint http://fake-s3.invalid:9000" in text


def test_max_attempts_still_caps_when_set():
    clock = Clock()
    client = FakeClient(head_object=[ConnectionResetError("reset")] * 10)
    b = backend(client, clock, max_attempts=4, retry_deadline_s=600.0)
    with pytest.raises(CheckpointError, match="max_attempts=4, retry_deadline_s=600"):
        b.stat("k")
    assert len(client.ops("head_object")) == 4


@pytest.mark.parametrize(
    ("code", "status", "words"),
    [
        ("AccessDenied", 403, "access denied"),
        ("InvalidAccessKeyId", 403, "bad credentials (InvalidAccessKeyId)"),
        ("SignatureDoesNotMatch", 403, "bad credentials (SignatureDoesNotMatch)"),
        ("ExpiredToken", 400, "expired credentials"),
    ],
)
def test_auth_errors_are_not_retried(code, status, words):
    client = FakeClient(put_object=[client_error(code, status, "denied")] * 5)
    b = backend(client)
    with pytest.raises(CheckpointError) as info:
        b.put("a/b", memoryview(b"data"))
    assert len(client.ops("put_object")) == 1
    assert words in str(info.value) and "s3://bkt/a/b" in str(info.value)
    assert "fake-s3.invalid" in str(info.value)  # names the endpoint


def test_access_denied_on_missing_bucket_says_no_such_bucket():
    # SeaweedFS answers a PUT into a missing bucket with AccessDenied
    client = FakeClient(
        put_object=[client_error("AccessDenied", 403)],
        head_bucket=[client_error("404", 404, op="HeadBucket")],
    )
    with pytest.raises(CheckpointError, match="no such bucket 'bkt'"):
        backend(client).put("k", memoryview(b"x"))


def test_no_such_bucket_and_missing_object():
    client = FakeClient(get_object=[client_error("NoSuchBucket", 404, op="GetObject")])
    b = backend(client)
    with pytest.raises(CheckpointError, match="no such bucket 'bkt'") as info:
        b.get("k", 100)
    assert not isinstance(info.value, CheckpointNotFoundError)
    assert len(client.ops("get_object")) == 1
    with pytest.raises(CheckpointNotFoundError, match="s3://bkt/gone"):
        b.get("gone", 100)
    with pytest.raises(CheckpointNotFoundError, match="s3://bkt/gone"):
        b.read_into("gone", 0, memoryview(bytearray(10)))


def test_stat_404_checks_the_bucket_once():
    client = FakeClient()
    b = backend(client)
    assert b.stat("a") is None
    assert b.stat("b") is None
    assert len(client.ops("head_bucket")) == 1
    missing = FakeClient(head_bucket=[client_error("404", 404, op="HeadBucket")])
    with pytest.raises(CheckpointError, match="no such bucket 'bkt'"):
        backend(missing).stat("a")


def test_secret_never_in_messages():
    leaky = f"The request signature we calculated does not match; secret={SECRET} token={TOKEN}"
    client = FakeClient(
        put_object=[client_error("SignatureDoesNotMatch", 403, leaky)],
        get_object=[RuntimeError(f"weird failure mentioning {SECRET}")],
        head_object=[client_error("SlowDown", 503, leaky)] * 10,
    )
    b = backend(client, max_attempts=2)
    for op in (
        lambda: b.put("k", memoryview(b"x")),
        lambda: b.get("k", 10),
        lambda: b.stat("k"),
    ):
        with pytest.raises(CheckpointError) as info:
            op()
        assert_no_secret(info.value)
        assert "***" in str(info.value)
    assert SECRET not in repr(b) and SECRET not in repr(b.options)
    assert TOKEN not in repr(b.options)


def test_connection_errors_are_retried_and_named():
    client = FakeClient(
        head_object=[EndpointConnectionError(endpoint_url="http://fake-s3.invalid:9000/bkt/k")] * 3
    )
    b = backend(client, max_attempts=3)
    with pytest.raises(CheckpointError) as info:
        b.stat("k")
    assert len(client.ops("head_object")) == 3
    assert "cannot reach endpoint http://fake-s3.invalid:9000" in str(info.value)
    assert "s3://bkt/k" in str(info.value)


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (client_error("SlowDown", 503), True),
        (client_error("Throttling", 400), True),
        (client_error("RequestLimitExceeded", 400), True),
        (client_error("TooManyRequests", 429), True),
        (client_error("InternalError", 500), True),
        (client_error("Whatever", 502), True),
        (client_error("504", 504), True),
        (client_error("AccessDenied", 403), False),
        (client_error("InvalidAccessKeyId", 403), False),
        (client_error("SignatureDoesNotMatch", 403), False),
        (client_error("NoSuchBucket", 404), False),
        (client_error("404", 404), False),
        (EndpointConnectionError(endpoint_url="http://x"), True),
        (ConnectionClosedError(endpoint_url="http://x"), True),
        (ReadTimeoutError(endpoint_url="http://x"), True),
        (ConnectionResetError(), True),
        (http.client.IncompleteRead(b"", 10), True),
        (ValueError("no"), False),
    ],
)
def test_is_retryable(exc, expected):
    assert is_retryable(exc) is expected


def test_urllib3_protocol_error_is_retryable():
    from urllib3.exceptions import ProtocolError

    assert is_retryable(ProtocolError("Connection broken", ConnectionResetError()))


# --------------------------------------------------------------------------- multipart


def _data(n: int) -> bytearray:
    return bytearray(random.Random(n).randbytes(n))


def test_multipart_parts_are_slices_in_order():
    client = FakeClient()
    b = backend(client)
    data = _data(3 * MIN_PART_SIZE + 123)
    ranges = [("a", 0, len(data)), ("b", MIN_PART_SIZE - 5, 10)]
    digests = b.put("big", memoryview(data), ranges=ranges)
    parts = sorted(client.ops("upload_part"), key=lambda kw: kw["PartNumber"])
    assert [len(p["Body"]) for p in parts] == [MIN_PART_SIZE] * 3 + [123]
    assert b"".join(p["Body"] for p in parts) == bytes(data)
    (complete,) = client.ops("complete_multipart_upload")
    assert complete["UploadId"] == "UP1"
    assert complete["MultipartUpload"]["Parts"] == [
        {"PartNumber": i, "ETag": f'"etag-{i}"'} for i in (1, 2, 3, 4)
    ]
    import xxhash

    for name, off, length in ranges:
        assert digests[name] == format(xxhash.xxh3_64_intdigest(data[off : off + length]), "016x")
    assert not client.ops("abort_multipart_upload")


def test_part_size_below_s3_minimum_is_raised_to_5_mib():
    client = FakeClient()
    b = backend(client, part_size=1 * MiB)
    assert b.part_size == MIN_PART_SIZE
    b.put("k", memoryview(_data(MIN_PART_SIZE + 1)))
    assert sorted(len(p["Body"]) for p in client.ops("upload_part")) == [1, MIN_PART_SIZE]


def test_failed_part_aborts_the_upload():
    client = FakeClient(upload_part=[{"ETag": '"1"'}, client_error("AccessDenied", 403)])
    b = backend(client, max_concurrency=1)
    with pytest.raises(CheckpointError) as info:
        b.put("run/big", memoryview(_data(3 * MIN_PART_SIZE)))
    assert "s3://bkt/run/big" in str(info.value) and "access denied" in str(info.value)
    (abort,) = client.ops("abort_multipart_upload")
    assert abort == {"Bucket": "bkt", "Key": "run/big", "UploadId": "UP1"}
    assert not client.ops("complete_multipart_upload")
    assert len(client.ops("upload_part")) == 2  # the third part was never sent
    assert_no_secret(info.value)


def test_part_retries_exhausted_aborts_and_names_cause():
    client = FakeClient(upload_part=[client_error("SlowDown", 503)] * 100)
    b = backend(client, max_attempts=2, max_concurrency=2)
    with pytest.raises(CheckpointError, match="SlowDown") as info:
        b.put("k", memoryview(_data(2 * MIN_PART_SIZE + 1)))
    assert "s3://bkt/k" in str(info.value)
    assert len(client.ops("abort_multipart_upload")) == 1
    assert not client.ops("complete_multipart_upload")


def test_failed_complete_aborts():
    client = FakeClient(complete_multipart_upload=[client_error("InvalidPart", 400)])
    with pytest.raises(CheckpointError, match="InvalidPart"):
        backend(client).put("k", memoryview(_data(MIN_PART_SIZE + 1)))
    assert len(client.ops("abort_multipart_upload")) == 1


def test_lost_complete_answer_is_not_a_failure():
    # try 1 completes on the server but the answer is lost; try 2 finds no upload
    client = FakeClient(
        complete_multipart_upload=[
            ConnectionResetError("reset"),
            client_error("NoSuchUpload", 404),
        ],
        head_object=[
            {
                "ContentLength": MIN_PART_SIZE + 1,
                "LastModified": __import__("datetime").datetime.now(),
            }
        ],
    )
    backend(client).put("k", memoryview(_data(MIN_PART_SIZE + 1)))
    assert not client.ops("abort_multipart_upload")


# --------------------------------------------------------------------------- reads


def _ranged_gets(data: bytes, fail_after: int) -> tuple[list, list[str]]:
    """Two scripted answers to ranged GETs of ``data``: the first breaks off after
    ``fail_after`` bytes of its body; and the list of the ranges asked for."""
    seen: list[str] = []

    def get(**kw):
        seen.append(kw["Range"])
        lo, hi = (int(x) for x in kw["Range"].removeprefix("bytes=").split("-"))
        piece = data[lo : hi + 1]
        return {
            "Body": FakeBody(piece, fail_after=fail_after if len(seen) == 1 else None),
            "ContentLength": len(piece),
            "ContentRange": f"bytes {lo}-{hi}/{len(data)}",
        }

    return [get, get], seen


def test_read_resumes_after_a_reset_mid_body():
    data = bytes(range(256)) * 40
    answers, seen = _ranged_gets(data, fail_after=1000)
    dest = bytearray(5000)
    backend(FakeClient(get_object=answers)).read_into("k", 100, memoryview(dest))
    assert bytes(dest) == data[100:5100]
    assert seen == ["bytes=100-5099", "bytes=1100-5099"]


def test_scatter_read_is_one_request_resumed_across_views():
    data = bytes(range(256)) * 40
    answers, seen = _ranged_gets(data, fail_after=1500)  # inside the third view
    views = [bytearray(1000), bytearray(0), bytearray(2000), bytearray(7)]
    backend(FakeClient(get_object=answers)).read_scatter("k", 50, [memoryview(v) for v in views])
    assert b"".join(views) == data[50:3057]
    assert views[0] == data[50:1050] and views[3] == data[3050:3057]
    assert seen == ["bytes=50-3056", "bytes=1550-3056"]


def test_short_object_is_corrupt_with_both_lengths():
    def get(**kw):
        return {"Body": FakeBody(b"abc"), "ContentLength": 3, "ContentRange": "bytes 0-2/3"}

    client = FakeClient(get_object=[get])
    with pytest.raises(CorruptCheckpointError) as info:
        backend(client).read_into("k", 0, memoryview(bytearray(10)))
    text = str(info.value)
    assert "s3://bkt/k" in text and "3 bytes" in text and "10 bytes" in text


def test_get_refuses_large_object_without_reading():
    class Body(FakeBody):
        def read(self, amt=None):
            raise AssertionError("must not read")

    client = FakeClient(get_object=[{"Body": Body(b""), "ContentLength": 10**9}])
    with pytest.raises(CorruptCheckpointError, match="1000000000 bytes"):
        backend(client).get("k", 1000)


# --------------------------------------------------------------------------- the rest


def test_delete_batches_of_1000_and_ignores_missing():
    client = FakeClient(
        delete_objects=[{}, {"Errors": [{"Key": "k5", "Code": "NoSuchKey", "Message": "x"}]}]
    )
    backend(client).delete(f"k{i}" for i in range(1500))
    batches = client.ops("delete_objects")
    assert [len(kw["Delete"]["Objects"]) for kw in batches] == [1000, 500]
    backend(FakeClient()).delete([])


def test_delete_per_key_error_raises():
    client = FakeClient(
        delete_objects=[{"Errors": [{"Key": "a", "Code": "AccessDenied", "Message": "no"}]}]
    )
    with pytest.raises(CheckpointError, match="AccessDenied") as info:
        backend(client).delete(["a", "b"])
    assert "s3://bkt/a" in str(info.value)


def test_pagination_and_children():
    t = datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc)
    client = FakeClient(
        list_objects_v2=[
            {
                "IsTruncated": True,
                "NextContinuationToken": "T",
                "CommonPrefixes": [{"Prefix": "run/b/"}],
                "Contents": [{"Key": "run/a", "Size": 1, "LastModified": t}],
            },
            {
                "IsTruncated": False,
                "CommonPrefixes": [{"Prefix": "run/0/"}],
                "Contents": [{"Key": "run/", "Size": 0, "LastModified": t}],
            },
        ]
    )
    assert backend(client).children("run") == ["0", "a", "b"]
    first, second = client.ops("list_objects_v2")
    assert first["Prefix"] == "run/" and first["Delimiter"] == "/"
    assert "ContinuationToken" not in first and second["ContinuationToken"] == "T"


def test_missing_boto3_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)
    with pytest.raises(CheckpointError, match=r"pip install 'quicksave\[s3\]'"):
        S3Backend("bkt", S3Options())


def test_module_is_torch_free_and_boto3_lazy():
    code = (
        "import sys, quicksave.storage.s3; "
        "assert 'torch' not in sys.modules, 'torch'; "
        "assert 'boto3' not in sys.modules, 'boto3'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
