"""What an S3 failure means: whether another try may cure it (:func:`is_retryable`), and
the words a :class:`~quicksave.errors.CheckpointError` says about it.

Pure functions of the exception (and of the backend's endpoint and timeouts, given as
arguments), used by the request layer (:mod:`quicksave.storage.s3.requests`) on every
failed request. No message ever holds a secret: :func:`scrub` hides the ones given.
Torch-free; botocore is imported only when an exception is classified.
"""

from __future__ import annotations

import http.client
from collections.abc import Iterable
from typing import Any

from quicksave.storage.backend import S3Options

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
AUTH_CODES = {
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
NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})


def botocore_exceptions() -> Any:
    """``botocore.exceptions``, or None where botocore is not installed."""
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


def is_not_found(exc: BaseException) -> bool:
    """Whether ``exc`` says that the object is not there (a bare 404 included)."""
    code, status = error_code(exc)
    return status == 404 or code in NOT_FOUND_CODES


def is_retryable(exc: BaseException) -> bool:
    """Whether ``exc`` is transient: throttling, a 5xx, a dropped or timed-out
    connection, a response cut short."""
    code, status = error_code(exc)
    if code is not None or status is not None:
        return code in _THROTTLE_CODES or code in _TRANSIENT_CODES or status in _RETRY_STATUSES
    bex = botocore_exceptions()
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


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every one of ``secrets`` (4 characters or more) replaced by ``***``."""
    for secret in secrets:
        if len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


def describe(exc: BaseException, endpoint_url: str | None, options: S3Options) -> str:
    """What went wrong, in a few words (the server's code and message, or which
    endpoint could not be reached within which timeout); not yet scrubbed."""
    code, status = error_code(exc)
    if code is not None or status is not None:
        message = (getattr(exc, "response", {}).get("Error") or {}).get("Message") or ""
        return f"{code} (HTTP {status})" + (f": {message}" if message else "")
    bex = botocore_exceptions()
    if bex is not None and isinstance(exc, bex.EndpointConnectionError):
        return f"cannot reach endpoint {endpoint_url or '(default AWS endpoint)'}"
    if bex is not None and isinstance(exc, bex.ConnectTimeoutError):
        return (
            f"cannot reach endpoint {endpoint_url or '(default AWS endpoint)'} "
            f"(connect timed out after {options.connect_timeout_s:g} s)"
        )
    if isinstance(exc, TimeoutError) or "timeout" in type(exc).__name__.lower():
        return (
            f"no answer from {endpoint_url or 'the endpoint'} within "
            f"read_timeout_s={options.read_timeout_s:g} ({type(exc).__name__})"
        )
    return f"{type(exc).__name__}: {exc}"
