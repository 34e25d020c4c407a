"""The request layer of one S3 bucket: every request of the S3 backend goes through
:meth:`S3Requests.call`, i.e. through the one retry loop
(:func:`~quicksave.storage.retry.call_with_retries`): throttling, 5xx and connection
failures (:func:`~quicksave.storage.s3.errors.is_retryable`) are retried with full-jitter
exponential backoff for as long as ``S3Options.retry_deadline_s`` allows
(``S3Options.max_attempts``, unset by default, may also cap the tries). Everything else
(access denied, bad credentials, a missing bucket) becomes a
:class:`~quicksave.errors.CheckpointError` at once, naming the ``s3://`` URL, with every
known secret scrubbed from its text.

Made once per backend (:class:`~quicksave.storage.s3.backend.S3Backend`) and shared by its
uploads, downloads and listings, from any thread. Torch-free.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from quicksave.errors import CheckpointError, CheckpointNotFoundError
from quicksave.storage.backend import ObjectInfo, S3Options
from quicksave.storage.retry import RetryPolicy, call_with_retries
from quicksave.storage.s3.errors import (
    AUTH_CODES,
    NOT_FOUND_CODES,
    botocore_exceptions,
    describe,
    error_code,
    is_retryable,
    scrub,
)

T = TypeVar("T")


class S3Requests:
    """Retried, translated requests to one bucket (see the module docstring).

    Args:
        bucket: the bucket's name.
        client: the botocore S3 client (shared by threads).
        options: the settings (timeouts, for messages).
        policy: how requests are retried.
        secrets: texts never to show in a message.
        endpoint_url: the endpoint, for messages (None: AWS).
    """

    def __init__(
        self,
        bucket: str,
        client: Any,
        options: S3Options,
        policy: RetryPolicy,
        secrets: set[str],
        endpoint_url: str | None,
        scheme: str = "s3",
    ) -> None:
        self.bucket = bucket
        self.scheme = scheme
        self.client = client
        self.options = options
        self.policy = policy
        self.secrets = secrets
        self.endpoint_url = endpoint_url
        self._bucket_checked = False

    def url(self, key: str) -> str:
        return f"{self.scheme}://{self.bucket}/{key}"

    def scrub(self, text: str) -> str:
        """``text`` with the secrets hidden."""
        return scrub(text, self.secrets)

    def describe(self, exc: BaseException) -> str:
        """What went wrong, in a few words, scrubbed."""
        return self.scrub(describe(exc, self.endpoint_url, self.options))

    def translate(self, exc: BaseException, url: str, what: str) -> CheckpointError:
        """A CheckpointError for a failure that no retry will cure."""
        code, status = error_code(exc)
        bex = botocore_exceptions()
        if code == "NoSuchBucket":
            return CheckpointError(f"{what}: no such bucket {self.bucket!r}", path=url)
        if code in AUTH_CODES:
            if code in ("AccessDenied", "403") and self._bucket_missing():
                # some stores (SeaweedFS) answer a PUT into a missing bucket with 403
                return CheckpointError(f"{what}: no such bucket {self.bucket!r}", path=url)
            return CheckpointError(
                f"{what}: {AUTH_CODES[code]} at {self.endpoint_url or 'AWS'}; check the "
                "credentials (AWS_ACCESS_KEY_ID/AWS_PROFILE or S3Options) and the bucket "
                f"policy; server said: {self.describe(exc)}",
                path=url,
            )
        if code in NOT_FOUND_CODES:
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
                    f"{self.describe(exc)}",
                    path=url,
                )
        return CheckpointError(f"{what} failed: {self.describe(exc)}", path=url)

    def _bucket_missing(self) -> bool:
        """Best effort: does HEAD bucket say 404? (Only on error paths.)"""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as exc:  # noqa: BLE001
            code, status = error_code(exc)
            return status == 404 or code in ("NoSuchBucket", "404", "NotFound")
        return False

    def call(
        self,
        fn: Callable[[], T],
        *,
        what: str,
        url: str,
        stop: threading.Event | None = None,
        policy: RetryPolicy | None = None,
    ) -> T:
        """``fn()`` through the retry loop; ``what`` and ``url`` name it in errors;
        ``stop`` (set by a failed sibling of a parallel transfer) ends the retries;
        ``policy`` replaces the backend's for this call."""
        return call_with_retries(
            fn,
            self.policy if policy is None else policy,
            what=what,
            url=url,
            retryable=is_retryable,
            translate=lambda exc: self.translate(exc, url, what),
            describe=self.describe,
            stop=stop,
        )

    def head(self, key: str) -> ObjectInfo | None:
        """HEAD ``key`` once, no retries, None when missing (error paths only)."""
        try:
            answer = self.client.head_object(Bucket=self.bucket, Key=key)
        except Exception:  # noqa: BLE001
            return None
        return ObjectInfo(key, int(answer["ContentLength"]), answer["LastModified"].timestamp())

    def check_bucket(self, url: str) -> None:
        """Raise if the bucket does not exist (asked once per backend, after a 404: HEAD
        answers a missing bucket and a missing key alike, so that a typo in the bucket
        is not "no checkpoint")."""
        if self._bucket_checked:
            return

        def attempt() -> None:
            self.client.head_bucket(Bucket=self.bucket)

        try:
            self.call(attempt, what="HEAD bucket", url=url)
        except CheckpointNotFoundError:
            raise CheckpointError(f"no such bucket {self.bucket!r}", path=url) from None
        self._bucket_checked = True
