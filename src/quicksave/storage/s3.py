"""The S3 backend: one bucket of Amazon S3 or an S3-compatible store (SeaweedFS, MinIO...).

Objects are written from the caller's memory (``put``: one PUT up to ``part_size``, a
multipart upload of slices of the buffer beyond it, several parts in flight) and read
straight into the caller's buffer (``read_into``: ranged GETs, parallel for large reads,
the response body read into the destination slice with ``readinto``). No temporary
files, no whole-buffer copies.

Every request goes through one retry loop (:func:`~quicksave.storage.retry.call_with_retries`):
throttling, 5xx and connection failures (:func:`is_retryable`) are retried with
full-jitter exponential backoff for as long as ``S3Options.retry_deadline_s`` allows
(``S3Options.max_attempts``, unset by default, may also cap the tries); botocore's own
retries are switched off so that there is exactly one loop. Everything else (access denied, bad
credentials, a missing bucket) becomes a :class:`~quicksave.errors.CheckpointError` at
once, naming the ``s3://`` URL. No message ever holds a secret key or session token.

Torch-free (the worker process imports it); boto3 is imported when a backend is made,
with a clear error naming the ``quicksave[s3]`` extra when it is not installed.
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import hashlib
import http.client
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from quicksave.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from quicksave.storage.backend import ObjectInfo, Range, S3Options, byte_view, hash_ranges
from quicksave.storage.retry import Abandoned, RetryPolicy, call_with_retries

T = TypeVar("T")

MIN_PART_SIZE = 5 << 20  # S3: every part but the last is at least 5 MiB
MAX_PARTS = 10_000  # S3: at most 10,000 parts per upload
DELETE_BATCH = 1000  # S3: at most 1,000 keys per DeleteObjects
SMALL_BODY = 1 << 20  # bodies up to this are sent as bytes (see _body)

_INSTALL_HINT = "pip install 'quicksave[s3]'"

# error codes (and HTTP statuses) worth another try
_THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "TooManyRequestsException",
        "BandwidthLimitExceeded",
        "ProvisionedThroughputExceededException",
    }
)
_TRANSIENT_CODES = frozenset(
    {
        "InternalError",
        "InternalServerError",
        "ServiceUnavailable",
        "RequestTimeout",
        "RequestTimeoutException",
        "PriorRequestNotComplete",
        "500",
        "502",
        "503",
        "504",
    }
)
_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
# error codes that no retry will cure, and what to call them
_AUTH_CODES = {
    "AccessDenied": "access denied",
    "AllAccessDisabled": "access denied (AllAccessDisabled)",
    "AccountProblem": "access denied (AccountProblem)",
    "InvalidAccessKeyId": "bad credentials (InvalidAccessKeyId)",
    "SignatureDoesNotMatch": "bad credentials (SignatureDoesNotMatch)",
    "InvalidToken": "bad credentials (InvalidToken)",
    "ExpiredToken": "expired credentials (ExpiredToken)",
    "TokenRefreshRequired": "expired credentials (TokenRefreshRequired)",
    "InvalidSecurity": "bad credentials (InvalidSecurity)",
    "AuthorizationHeaderMalformed": "bad request signature (AuthorizationHeaderMalformed: "
    "wrong region?)",
    "403": "access denied (HTTP 403)",
}
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})


# --------------------------------------------------------------------------- retries


def _botocore_exceptions():
    try:
        import botocore.exceptions as bex
    except ImportError:  # pragma: no cover - boto3 always brings botocore
        return None
    return bex


def error_code(exc: BaseException) -> tuple[str | None, int | None]:
    """The S3 error code and HTTP status of a botocore ``ClientError`` (None, None
    for anything else)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None, None
    code = (response.get("Error") or {}).get("Code")
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return (str(code) if code is not None else None), status


def is_retryable(exc: BaseException) -> bool:
    """Whether ``exc`` is transient: throttling, a 5xx, a dropped or timed-out
    connection, a response cut short."""
    code, status = error_code(exc)
    if code is not None or status is not None:
        return code in _THROTTLE_CODES or code in _TRANSIENT_CODES or status in _RETRY_STATUSES
    bex = _botocore_exceptions()
    if bex is not None:
        if isinstance(exc, bex.SSLError):
            return False  # a certificate problem does not go away
        if isinstance(
            exc,
            (
                bex.EndpointConnectionError,
                bex.ConnectionClosedError,
                bex.ReadTimeoutError,
                bex.ConnectTimeoutError,
                bex.ResponseStreamingError,
                bex.IncompleteReadError,
                bex.HTTPClientError,
                bex.ConnectionError,
            ),
        ):
            return True
    try:
        import urllib3.exceptions as u3
    except ImportError:  # pragma: no cover
        u3 = None
    if u3 is not None and isinstance(
        exc,
        (u3.ProtocolError, u3.ReadTimeoutError, u3.ConnectTimeoutError, u3.NewConnectionError),
    ):
        return True
    # builtin ConnectionError covers resets, refusals, broken pipes, RemoteDisconnected
    return isinstance(exc, (ConnectionError, TimeoutError, http.client.IncompleteRead))


# --------------------------------------------------------------------------- buffers


class _MemoryReader:
    """A read-only, seekable file over a memoryview: what botocore takes as a request
    body (it refuses a bare memoryview) without copying the buffer. ``read`` returns
    slices of the view; each attempt gets a fresh reader, so retries rewind."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._pos = 0

    def __len__(self) -> int:  # botocore's Content-Length (remaining bytes)
        return len(self._view) - self._pos

    def read(self, size: int | None = -1) -> memoryview:
        end = (
            len(self._view) if size is None or size < 0 else min(self._pos + size, len(self._view))
        )
        chunk = self._view[self._pos : end]
        self._pos = end
        return chunk

    def readinto(self, b: Any) -> int:
        chunk = self.read(len(b))
        b[: len(chunk)] = chunk
        return len(chunk)

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: len(self._view)}[whence]
        self._pos = max(0, min(base + pos, len(self._view)))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def close(self) -> None:  # botocore may close the body; the view stays the caller's
        pass


# Single PUTs up to this size carry Content-MD5 (manifests, .metadata, parts, small data
# files: MD5 runs at ~0.6 GB/s, so at most ~15 ms each).
CHECKED_PUT = 8 << 20


def _body(view: memoryview) -> bytes | _MemoryReader:
    """A request body for ``view``: small ones as bytes (a copy of up to 1 MiB costs less
    than the ``Expect: 100-continue`` round trip botocore adds to file-like bodies),
    larger ones as a :class:`_MemoryReader` over the caller's memory."""
    if len(view) <= SMALL_BODY:
        return view.tobytes()
    return _MemoryReader(view)


def _check_ranges(ranges: Sequence[Range], size: int) -> None:
    for name, off, length in ranges:
        if off < 0 or length < 0 or off + length > size:
            raise ValueError(f"range {name!r} [{off}, {off + length}) is outside the {size} bytes")


def _parse_total(content_range: str | None) -> int | None:
    """The object's size from a ``Content-Range: bytes a-b/total`` header."""
    if not content_range or "/" not in content_range:
        return None
    total = content_range.rsplit("/", 1)[1].strip()
    return int(total) if total.isdigit() else None


# --------------------------------------------------------------------------- backend


class S3Backend:
    """The :class:`~quicksave.storage.backend.Backend` of one S3 bucket.

    Args:
        bucket: the bucket's name.
        options: endpoint, credentials, part size, concurrency, retries, timeouts
            (``None`` fields leave a setting to the standard AWS chain).
        client: an S3 client to use instead of making one (tests).
        rng: the random source of backoff jitter (default: a fresh ``random.Random``).
        sleep, clock: injectable for tests.

    Thread-safe: the botocore client is shared by threads; the thread pool of parallel
    parts and ranged reads belongs to this instance (made on first use, stopped by
    :meth:`close`).
    """

    scheme = "s3"
    atomic_rename = False

    def __init__(
        self,
        bucket: str,
        options: S3Options | None = None,
        *,
        client: Any = None,
        rng: random.Random | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not bucket or "/" in bucket:
            raise CheckpointError(f"not an S3 bucket name: {bucket!r}")
        self.bucket = bucket
        self.options = options = options if options is not None else S3Options()
        self.part_size = max(int(options.part_size), MIN_PART_SIZE)
        self.max_concurrency = max(1, int(options.max_concurrency))
        attempts = options.max_attempts
        self.policy = RetryPolicy(
            max_attempts=None if attempts is None else max(1, int(attempts)),
            deadline_s=float(options.retry_deadline_s),
            rng=rng if rng is not None else random.Random(),
            sleep=sleep,
            clock=clock,
        )
        self._secrets = {s for s in (options.secret_access_key, options.session_token) if s}
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._bucket_checked = False
        self._owns_client = client is None
        if client is None:
            client = self._make_client()
        self._client = client
        meta = getattr(client, "meta", None)
        self.endpoint_url: str | None = getattr(meta, "endpoint_url", None) or options.endpoint_url

    # ----------------------------------------------------------------- client

    def _make_client(self) -> Any:
        try:
            import boto3
            import botocore.config
            import botocore.exceptions as bex
        except ImportError as e:
            raise CheckpointError(
                f"s3://{self.bucket}: the S3 backend needs boto3, which is not installed "
                f"({_INSTALL_HINT})"
            ) from e
        o = self.options
        try:
            session = boto3.session.Session(profile_name=o.profile or None)
        except bex.ProfileNotFound as e:
            raise CheckpointError(
                f"s3://{self.bucket}: AWS profile {o.profile or os.environ.get('AWS_PROFILE')!r} "
                "not found in the shared config"
            ) from e
        endpoint = o.endpoint_url or _configured_endpoint(session)
        style = o.addressing_style or ("path" if endpoint else None)
        config = botocore.config.Config(
            retries={"total_max_attempts": 1, "mode": "standard"},
            max_pool_connections=max(2 * self.max_concurrency, 10),
            connect_timeout=o.connect_timeout_s,
            read_timeout=o.read_timeout_s,
            s3={"addressing_style": style} if style else None,
            # quicksave hashes every byte itself (xxh3 in the manifest); a CRC of each
            # request body would be one more pass over memory
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        kwargs: dict[str, Any] = {"config": config}
        if o.endpoint_url:
            kwargs["endpoint_url"] = o.endpoint_url
        if o.region:
            kwargs["region_name"] = o.region
        key_id, secret = o.access_key_id, o.secret_access_key
        if (key_id is None) != (secret is None):  # the other half from the chain
            frozen = _chain_credentials(session)
            key_id = key_id if key_id is not None else getattr(frozen, "access_key", None)
            secret = secret if secret is not None else getattr(frozen, "secret_key", None)
            if key_id is None or secret is None:
                raise CheckpointError(
                    f"s3://{self.bucket}: S3Options gives only one of access_key_id and "
                    "secret_access_key, and the AWS chain has no credentials for the other"
                )
            if getattr(frozen, "secret_key", None):
                self._secrets.add(frozen.secret_key)
        if key_id is not None:
            kwargs["aws_access_key_id"] = key_id
            kwargs["aws_secret_access_key"] = secret
            if o.session_token is not None:
                kwargs["aws_session_token"] = o.session_token
        elif o.session_token is not None:
            kwargs["aws_session_token"] = o.session_token
        try:
            client = session.client("s3", **kwargs)
        except bex.BotoCoreError as e:
            raise CheckpointError(
                f"s3://{self.bucket}: cannot make an S3 client: {self._scrub(str(e))}"
            ) from None
        if key_id is None:  # the chain's credentials: keep them out of messages too
            frozen = _chain_credentials(session)
            if frozen is not None:
                self._secrets.update(s for s in (frozen.secret_key, frozen.token) if s)
        return client

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            if len(secret) >= 4:
                text = text.replace(secret, "***")
        return text

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def __repr__(self) -> str:
        return f"S3Backend(bucket={self.bucket!r}, endpoint_url={self.endpoint_url!r})"

    # ----------------------------------------------------------------- errors

    def _describe(self, exc: BaseException) -> str:
        code, status = error_code(exc)
        if code is not None or status is not None:
            message = (getattr(exc, "response", {}).get("Error") or {}).get("Message") or ""
            text = f"{code} (HTTP {status})" + (f": {message}" if message else "")
        else:
            bex = _botocore_exceptions()
            if bex is not None and isinstance(exc, bex.EndpointConnectionError):
                text = f"cannot reach endpoint {self.endpoint_url or '(default AWS endpoint)'}"
            elif bex is not None and isinstance(exc, bex.ConnectTimeoutError):
                text = (
                    f"cannot reach endpoint {self.endpoint_url or '(default AWS endpoint)'} "
                    f"(connect timed out after {self.options.connect_timeout_s:g} s)"
                )
            elif isinstance(exc, TimeoutError) or "timeout" in type(exc).__name__.lower():
                text = (
                    f"no answer from {self.endpoint_url or 'the endpoint'} within "
                    f"read_timeout_s={self.options.read_timeout_s:g} ({type(exc).__name__})"
                )
            else:
                text = f"{type(exc).__name__}: {exc}"
        return self._scrub(text)

    def _translate(self, exc: BaseException, url: str, what: str) -> CheckpointError:
        """A CheckpointError for a failure that no retry will cure."""
        code, status = error_code(exc)
        bex = _botocore_exceptions()
        if code == "NoSuchBucket":
            return CheckpointError(f"{what}: no such bucket {self.bucket!r}", path=url)
        if code in _AUTH_CODES:
            if code in ("AccessDenied", "403") and self._bucket_missing():
                # some stores (SeaweedFS) answer a PUT into a missing bucket with 403
                return CheckpointError(f"{what}: no such bucket {self.bucket!r}", path=url)
            return CheckpointError(
                f"{what}: {_AUTH_CODES[code]} at {self.endpoint_url or 'AWS'}; check the "
                "credentials (AWS_ACCESS_KEY_ID/AWS_PROFILE or S3Options) and the bucket "
                f"policy; server said: {self._describe(exc)}",
                path=url,
            )
        if code in _NOT_FOUND_CODES:
            return CheckpointNotFoundError(f"{what}: no such object", path=url)
        if bex is not None:
            if isinstance(exc, bex.NoCredentialsError):
                return CheckpointError(
                    f"{what}: no AWS credentials found (set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or S3Options)",
                    path=url,
                )
            if isinstance(exc, (bex.PartialCredentialsError, bex.CredentialRetrievalError)):
                return CheckpointError(
                    f"{what}: incomplete AWS credentials ({type(exc).__name__})", path=url
                )
            if isinstance(exc, bex.NoRegionError):
                return CheckpointError(
                    f"{what}: no AWS region (set AWS_REGION or S3Options.region)", path=url
                )
            if isinstance(exc, bex.SSLError):
                return CheckpointError(
                    f"{what}: TLS error talking to {self.endpoint_url or 'AWS'}: "
                    f"{self._describe(exc)}",
                    path=url,
                )
        return CheckpointError(f"{what} failed: {self._describe(exc)}", path=url)

    def _bucket_missing(self) -> bool:
        """Best effort: does HEAD bucket say 404? (Only on error paths.)"""
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except Exception as exc:  # noqa: BLE001
            code, status = error_code(exc)
            return status == 404 or code in ("NoSuchBucket", "404", "NotFound")
        return False

    def _call(
        self,
        fn: Callable[[], T],
        *,
        what: str,
        url: str,
        stop: threading.Event | None = None,
    ) -> T:
        return call_with_retries(
            fn,
            self.policy,
            what=what,
            url=url,
            retryable=is_retryable,
            translate=lambda exc: self._translate(exc, url, what),
            describe=self._describe,
            stop=stop,
        )

    # ----------------------------------------------------------------- threads

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.max_concurrency, thread_name_prefix="quicksave-s3"
                )
            return self._pool

    def _start(
        self, tasks: list[Callable[[threading.Event], T]]
    ) -> tuple[list[concurrent.futures.Future], threading.Event]:
        """Submit ``tasks`` (each is given the shared stop event) to the pool. A task
        that fails sets the event at once, so that no queued sibling starts after it."""
        stop = threading.Event()

        def run(task: Callable[[threading.Event], T]) -> T:
            if stop.is_set():
                raise Abandoned("not started: another part of the same transfer failed")
            try:
                return task(stop)
            except BaseException:
                stop.set()
                raise

        pool = self._executor()
        return [pool.submit(run, task) for task in tasks], stop

    @staticmethod
    def _finish(futures: list[concurrent.futures.Future], stop: threading.Event) -> list:
        """Wait for ``futures``; on the first failure stop the others (queued ones are
        cancelled, running ones make no further try) and, once none is running any
        more, raise that failure. Never returns while a task still touches the
        caller's buffer."""
        try:
            concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        finally:
            if not all(f.done() and not f.cancelled() and f.exception() is None for f in futures):
                stop.set()
                for f in futures:
                    f.cancel()
            concurrent.futures.wait(futures)
        errors = [f.exception() for f in futures if not f.cancelled() and f.exception()]
        if errors:  # the first real cause, not a sibling's "abandoned"
            raise next((e for e in errors if not isinstance(e, Abandoned)), errors[0])
        return [f.result() for f in futures]

    # ----------------------------------------------------------------- writing

    def _part_size_for(self, size: int) -> int:
        part = self.part_size
        if size > part * MAX_PARTS:  # keep within 10,000 parts, whole MiB
            part = -(-size // MAX_PARTS)
            part = -(-part // (1 << 20)) * (1 << 20)
        return part

    def put(self, key: str, data: memoryview, *, ranges: Sequence[Range] = ()) -> dict[str, str]:
        view = byte_view(data)
        size = len(view)
        _check_ranges(ranges, size)
        url = self.url(key)
        part = self._part_size_for(size)
        if size <= part:
            digests = hash_ranges(view, ranges)
            extra = {}
            if size <= CHECKED_PUT:
                # The store checks the body it got against this and refuses a short one.
                # A PUT cut off by the writer's death (SIGKILL mid-request) must never
                # leave a truncated object: for the manifest, that is a commit.
                extra["ContentMD5"] = base64.b64encode(hashlib.md5(view).digest()).decode()
            self._call(
                lambda: self._client.put_object(
                    Bucket=self.bucket, Key=key, Body=_body(view), **extra
                ),
                what=f"PUT of {size} bytes",
                url=url,
            )
            return digests
        return self._put_multipart(key, view, ranges, part, url)

    def _put_multipart(
        self, key: str, view: memoryview, ranges: Sequence[Range], part: int, url: str
    ) -> dict[str, str]:
        size = len(view)
        created = self._call(
            lambda: self._client.create_multipart_upload(Bucket=self.bucket, Key=key),
            what="starting a multipart upload",
            url=url,
        )
        upload_id = created["UploadId"]
        try:
            offsets = range(0, size, part)
            count = len(offsets)

            def upload(number: int, piece: memoryview) -> Callable[[threading.Event], dict]:
                def task(stop: threading.Event) -> dict:
                    answer = self._call(
                        lambda: self._client.upload_part(
                            Bucket=self.bucket,
                            Key=key,
                            UploadId=upload_id,
                            PartNumber=number,
                            Body=_body(piece),
                        ),
                        what=f"upload of part {number}/{count} ({len(piece)} bytes)",
                        url=url,
                        stop=stop,
                    )
                    return {"PartNumber": number, "ETag": answer["ETag"]}

                return task

            futures, stop = self._start(
                [upload(i + 1, view[off : off + part]) for i, off in enumerate(offsets)]
            )
            try:
                # the caller's thread hashes while the parts are on the wire (xxhash drops
                # the GIL): one more pass over memory, overlapped with the upload
                digests = hash_ranges(view, ranges)
            except BaseException:
                stop.set()
                for f in futures:
                    f.cancel()
                concurrent.futures.wait(futures)
                raise
            parts = self._finish(futures, stop)
            self._complete(key, upload_id, parts, size, url)
            return digests
        except BaseException as exc:
            self._abort(key, upload_id)
            if isinstance(exc, CheckpointError):
                raise
            if isinstance(exc, Exception):
                raise CheckpointError(
                    f"multipart upload of {size} bytes failed (aborted): "
                    f"{self._scrub(f'{type(exc).__name__}: {exc}')}",
                    path=url,
                ) from exc
            raise

    def _complete(self, key: str, upload_id: str, parts: list, size: int, url: str) -> None:
        tries = 0

        def complete() -> None:
            nonlocal tries
            tries += 1
            try:
                self._client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                )
            except Exception as exc:
                # an earlier try may have completed it and only its answer was lost
                if tries > 1 and error_code(exc)[0] == "NoSuchUpload":
                    info = self._head(key)
                    if info is not None and info.size == size:
                        return
                raise

        self._call(complete, what=f"completing a multipart upload of {len(parts)} parts", url=url)

    def _abort(self, key: str, upload_id: str) -> None:
        """Abort an upload, best effort and briefly (two tries at most: the store may be
        what failed; a leftover is found later by :meth:`abort_uploads`)."""
        url = self.url(key)
        tries = min(2, self.policy.max_attempts or 2)
        try:
            call_with_retries(
                lambda: self._client.abort_multipart_upload(
                    Bucket=self.bucket, Key=key, UploadId=upload_id
                ),
                dataclasses.replace(self.policy, max_attempts=tries),
                what="aborting a multipart upload",
                url=url,
                retryable=is_retryable,
                translate=lambda exc: self._translate(exc, url, "aborting a multipart upload"),
            )
        except Exception:  # noqa: BLE001 - the original failure is what matters
            pass

    # ----------------------------------------------------------------- reading

    def read_into(self, key: str, offset: int, dest: memoryview) -> None:
        view = byte_view(dest, writable=True)
        size = len(view)
        url = self.url(key)
        if offset < 0:
            raise ValueError(f"negative offset {offset}")
        if size == 0:
            info = self.stat(key)
            if info is None:
                raise CheckpointNotFoundError("no such object", path=url)
            if info.size < offset:
                raise self._short(url, offset, 0, info.size)
            return
        step = self.part_size
        if size <= step:
            self._read_range(key, offset, view, url, None)
            return
        tasks = [
            (
                lambda stop, lo=lo: self._read_range(
                    key, offset + lo, view[lo : lo + step], url, stop
                )
            )
            for lo in range(0, size, step)
        ]
        self._finish(*self._start(tasks))

    def _short(self, url: str, offset: int, length: int, actual: int | None) -> CheckpointError:
        have = "of unknown size" if actual is None else f"only {actual} bytes long"
        return CorruptCheckpointError(
            f"object is {have}; reading {length} bytes at offset {offset} needs "
            f"{offset + length}: truncated, or not the expected object",
            path=url,
        )

    def read_scatter(self, key: str, offset: int, dests: Sequence[memoryview]) -> None:
        views = [byte_view(d, writable=True) for d in dests]
        views = [v for v in views if len(v)]
        if len(views) <= 1:
            self.read_into(key, offset, views[0] if views else memoryview(bytearray()))
            return
        self._read_range(key, offset, views, self.url(key), None)

    def _read_range(
        self,
        key: str,
        offset: int,
        dest: memoryview | list[memoryview],
        url: str,
        stop: threading.Event | None,
    ) -> None:
        """Fill ``dest`` (one view, or several filled in turn) from ``key`` at
        ``offset``: one ranged GET, resumed where it broke off when a retry is needed."""
        views = [dest] if isinstance(dest, memoryview) else dest
        length = sum(len(v) for v in views)
        done = 0

        def attempt() -> None:
            nonlocal done
            start = offset + done
            want = length - done
            try:
                answer = self._client.get_object(
                    Bucket=self.bucket, Key=key, Range=f"bytes={start}-{start + want - 1}"
                )
            except Exception as exc:
                if error_code(exc)[0] == "InvalidRange":  # the object ends before `start`
                    info = self._head(key)
                    raise self._short(url, offset, length, info.size if info else None) from None
                raise
            body = answer["Body"]
            got = answer.get("ContentLength")
            total = _parse_total(answer.get("ContentRange"))
            if answer.get("ContentRange") is None and start != 0:
                _close_body(body, reuse=False)
                raise CheckpointError(
                    "the server ignored the Range header of a ranged GET", path=url
                )
            if got is not None and got < want:
                _close_body(body, reuse=False)
                raise self._short(url, offset, length, total)
            try:
                done += _read_body_into(body, _skip(views, done))
            except _Progress as p:  # keep what arrived: the next try resumes after it
                done += p.got
                raise p.cause from None

        self._call(
            attempt,
            what=f"ranged GET of {length} bytes at offset {offset}",
            url=url,
            stop=stop,
        )

    def get(self, key: str, max_bytes: int) -> bytes:
        url = self.url(key)

        def attempt() -> bytes:
            answer = self._client.get_object(Bucket=self.bucket, Key=key)
            return _small_body(answer, max_bytes, url)

        return self._call(attempt, what="GET", url=url)

    # ----------------------------------------------------------------- metadata

    def _head(self, key: str) -> ObjectInfo | None:
        """HEAD ``key`` once, no retries, None when missing (error paths only)."""
        try:
            answer = self._client.head_object(Bucket=self.bucket, Key=key)
        except Exception:  # noqa: BLE001
            return None
        return ObjectInfo(key, int(answer["ContentLength"]), answer["LastModified"].timestamp())

    def stat(self, key: str) -> ObjectInfo | None:
        url = self.url(key)

        def attempt() -> ObjectInfo | None:
            try:
                answer = self._client.head_object(Bucket=self.bucket, Key=key)
            except Exception as exc:
                code, status = error_code(exc)
                if status == 404 or code in _NOT_FOUND_CODES:
                    return None
                raise
            return ObjectInfo(key, int(answer["ContentLength"]), answer["LastModified"].timestamp())

        info = self._call(attempt, what="HEAD", url=url)
        if info is None:
            # HEAD answers a missing bucket and a missing key alike (bare 404): tell
            # them apart once per backend, so a typo in the bucket is not "no checkpoint"
            self._check_bucket(url)
        return info

    def _check_bucket(self, url: str) -> None:
        if self._bucket_checked:
            return

        def attempt() -> None:
            self._client.head_bucket(Bucket=self.bucket)

        try:
            self._call(attempt, what="HEAD bucket", url=url)
        except CheckpointNotFoundError:
            raise CheckpointError(f"no such bucket {self.bucket!r}", path=url) from None
        self._bucket_checked = True

    def _pages(self, method: str, url: str, what: str, **params: Any) -> Iterator[dict]:
        """The pages of a paginated listing, each fetched with retries."""
        call = getattr(self._client, method)
        token: dict[str, Any] = {}
        while True:
            page = self._call(lambda t=token: call(**params, **t), what=what, url=url)
            yield page
            if not page.get("IsTruncated"):
                return
            if method == "list_objects_v2":
                nxt = page.get("NextContinuationToken")
                token = {"ContinuationToken": nxt}
            else:
                nxt = page.get("NextKeyMarker")
                token = {"KeyMarker": nxt, "UploadIdMarker": page.get("NextUploadIdMarker", "")}
            if not nxt:
                return

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        url = self.url(prefix)
        for page in self._pages("list_objects_v2", url, "LIST", Bucket=self.bucket, Prefix=prefix):
            for item in page.get("Contents") or ():
                yield ObjectInfo(item["Key"], int(item["Size"]), item["LastModified"].timestamp())

    def children(self, prefix: str) -> list[str]:
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        url = self.url(prefix)
        names: set[str] = set()
        for page in self._pages(
            "list_objects_v2", url, "LIST", Bucket=self.bucket, Prefix=prefix, Delimiter="/"
        ):
            for item in page.get("CommonPrefixes") or ():
                name = item["Prefix"][len(prefix) :].rstrip("/")
                if name:
                    names.add(name)
            for item in page.get("Contents") or ():
                name = item["Key"][len(prefix) :]
                if name:
                    names.add(name)
        return sorted(names)

    def delete(self, keys: Iterable[str]) -> None:
        todo = list(dict.fromkeys(keys))
        for lo in range(0, len(todo), DELETE_BATCH):
            batch = todo[lo : lo + DELETE_BATCH]
            url = self.url(batch[0])
            answer = self._call(
                lambda batch=batch: self._client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
                ),
                what=f"DELETE of {len(batch)} object(s)",
                url=url,
            )
            failed = [e for e in answer.get("Errors") or () if e.get("Code") != "NoSuchKey"]
            if failed:
                first = failed[0]
                raise CheckpointError(
                    f"could not delete {len(failed)} of {len(batch)} object(s); first: "
                    f"{first.get('Code')}: {self._scrub(str(first.get('Message', '')))}",
                    path=self.url(first.get("Key", batch[0])),
                )

    def abort_uploads(self, prefix: str, older_than_s: float) -> int:
        url = self.url(prefix)
        now = time.time()
        count = 0
        for page in self._pages(
            "list_multipart_uploads", url, "listing multipart uploads",
            Bucket=self.bucket, Prefix=prefix,
        ):  # fmt: skip
            for upload in page.get("Uploads") or ():
                initiated = upload.get("Initiated")
                age = now - initiated.timestamp() if initiated is not None else float("inf")
                if age <= older_than_s:
                    continue
                key, upload_id = upload["Key"], upload["UploadId"]

                def abort(key: str = key, upload_id: str = upload_id) -> None:
                    try:
                        self._client.abort_multipart_upload(
                            Bucket=self.bucket, Key=key, UploadId=upload_id
                        )
                    except Exception as exc:
                        if error_code(exc)[0] != "NoSuchUpload":  # gone already: fine
                            raise

                self._call(abort, what="aborting a multipart upload", url=self.url(key))
                count += 1
        return count

    # ----------------------------------------------------------------- conditional

    def put_if(self, key: str, data: bytes, *, if_match: str | None = None) -> str | None:
        view = byte_view(data)
        url = self.url(key)
        condition = {"IfNoneMatch": "*"} if if_match is None else {"IfMatch": if_match}
        md5 = base64.b64encode(hashlib.md5(view).digest()).decode()

        def attempt() -> tuple[str, str | None]:
            conflicts = 0
            while True:
                try:
                    answer = self._client.put_object(
                        Bucket=self.bucket, Key=key, Body=bytes(view), ContentMD5=md5, **condition
                    )
                except Exception as exc:
                    code, status = error_code(exc)
                    if status == 412 or code == "PreconditionFailed":
                        return "refused", None
                    if status == 501 or code == "NotImplemented":
                        return "unsupported", None
                    if code == "ConditionalRequestConflict" and conflicts < 3:
                        # two conditional writes of the key crossed: S3 asks for another
                        # try, whose condition it evaluates afresh
                        conflicts += 1
                        self.policy.sleep(self.policy.backoff(conflicts))
                        continue
                    raise
                return "written", answer.get("ETag")

        outcome, tag = self._call(attempt, what="conditional PUT", url=url)
        if outcome == "unsupported" or (outcome == "written" and not tag):
            raise NotImplementedError(f"{url}: the store does not support conditional writes")
        return tag

    def get_tagged(self, key: str, max_bytes: int) -> tuple[bytes, str] | None:
        url = self.url(key)

        def attempt() -> tuple[bytes, str] | None:
            try:
                answer = self._client.get_object(Bucket=self.bucket, Key=key)
            except Exception as exc:
                code, status = error_code(exc)
                if status == 404 or code in _NOT_FOUND_CODES:
                    return None
                raise
            return _small_body(answer, max_bytes, url), str(answer.get("ETag") or "")

        got = self._call(attempt, what="GET", url=url)
        if got is None:
            self._check_bucket(url)  # a typo in the bucket is no "no object"
        return got

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if self._owns_client:
            closer = getattr(self._client, "close", None)
            if closer is not None:
                try:
                    closer()
                except Exception:  # noqa: BLE001
                    pass

    def __enter__(self) -> S3Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- helpers


def _chain_credentials(session: Any) -> Any:
    """The standard chain's credentials (frozen), or None."""
    try:
        creds = session.get_credentials()
        return creds.get_frozen_credentials() if creds is not None else None
    except Exception:  # noqa: BLE001
        return None


def _configured_endpoint(session: Any) -> str | None:
    """The endpoint the standard chain gives (``AWS_ENDPOINT_URL_S3``,
    ``AWS_ENDPOINT_URL``, the profile's ``endpoint_url``), or None (AWS itself)."""
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(name):
            return os.environ[name]
    try:
        scoped = session._session.get_scoped_config()  # boto3 Session -> botocore's
    except Exception:  # noqa: BLE001
        return None
    s3 = scoped.get("s3")
    if isinstance(s3, dict) and s3.get("endpoint_url"):
        return s3["endpoint_url"]
    return scoped.get("endpoint_url") or None


# how the response body is read: "readinto" (straight into the destination, through the
# http.client response under urllib3) or "copy" (botocore's read(), then a memcpy)
READ_MODE = "readinto"
_COPY_CHUNK = 8 << 20


def _skip(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` without their first ``n`` bytes (taken in turn)."""
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out


def _read_body_into(body: Any, dests: list[memoryview]) -> int:
    """Read a botocore StreamingBody into ``dests``, filling each in turn (a scatter
    read: neighbouring chunks straight into their destinations); returns how many bytes
    arrived before a failure (raised after counting, so that a retry resumes)."""
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    direct = READ_MODE == "readinto" and fp is not None and hasattr(fp, "readinto")
    got = 0
    try:
        for dest in dests:
            want, have = len(dest), 0
            while have < want:
                if direct:
                    n = fp.readinto(dest[have:])
                else:
                    chunk = body.read(min(want - have, _COPY_CHUNK))
                    n = len(chunk)
                    dest[have : have + n] = chunk
                if not n:
                    raise http.client.IncompleteRead(b"", want - have)
                have += n
                got += n
    except BaseException as exc:
        _close_body(body, reuse=False)
        raise _Progress(got, exc) from exc
    _close_body(body, reuse=True)
    return got


class _Progress(Exception):
    """Internal: a body read failed after ``got`` bytes (``cause`` says why)."""

    def __init__(self, got: int, cause: BaseException) -> None:
        super().__init__(got, cause)
        self.got = got
        self.cause = cause


def _small_body(answer: dict, max_bytes: int, url: str) -> bytes:
    """The body of a GET answer, refused (CorruptCheckpointError) beyond ``max_bytes``:
    by its declared length before reading, or by what came."""
    body = answer["Body"]
    size = answer.get("ContentLength")
    if size is not None and size > max_bytes:
        _close_body(body, reuse=False)
        raise CorruptCheckpointError(
            f"object is {size} bytes, more than the {max_bytes} expected at most", path=url
        )
    data = body.read()
    _close_body(body, reuse=True)
    if len(data) > max_bytes:
        raise CorruptCheckpointError(
            f"object is {len(data)} bytes, more than the {max_bytes} expected at most", path=url
        )
    return data


def _close_body(body: Any, *, reuse: bool) -> None:
    """Finish with a response body: hand a fully read connection back to the pool
    (``reuse``), or drop it (a half-read one cannot carry another request)."""
    raw = getattr(body, "_raw_stream", None)
    try:
        if reuse and raw is not None and hasattr(raw, "release_conn"):
            raw.release_conn()
            return
        body.close()
        if raw is not None and hasattr(raw, "release_conn"):
            raw.release_conn()
    except Exception:  # noqa: BLE001
        pass
