"""The one retry loop of quicksave's own store clients: :func:`call_with_retries`.

Policy (:class:`RetryPolicy`): a transient failure (throttling, a 5xx, a refused, reset
or timed-out connection: the backend's ``retryable`` says which) is tried again after a
full-jitter exponential pause, ``uniform(0, min(cap_s, base_s * 2**(n-1)))`` seconds
after failed try ``n``, for as long as ``deadline_s`` allows: the deadline rules, so a
store that is down for 15 s is ridden out by a 60 s deadline whatever the number of
tries it takes. The last pause is cut to the time left, so the last try starts at the
deadline, not one pause before it. ``max_attempts`` (None by default) also caps the
number of tries, for a caller that would rather fail fast. Any other failure is
translated and raised at once.

Torch-free and boto-free: the S3 backend passes its own ``retryable`` and
``translate``; the worker process imports this module.
"""

from __future__ import annotations

import random
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from quicksave.errors import CheckpointError

T = TypeVar("T")

BACKOFF_BASE_S = 0.1
BACKOFF_CAP_S = 5.0  # no single pause is longer than this


class StoreHealth:
    """Whether the store answers, as the retry loop last saw it: :meth:`failing_since`
    is the monotonic time (``CLOCK_MONOTONIC``: comparable across processes) of the
    first failed try of the current outage, or 0.0 while the store answers.

    Written by :func:`call_with_retries` (in the writer); read by the trainer, which
    then does not wait for a staging pool that a save stuck on an unreachable store
    holds. ``page``: a buffer shared with the trainer (the worker process's heartbeat
    page) and the ``offset`` of the value in it; default: a private one (a thread).
    """

    def __init__(self, page: bytearray | memoryview | None = None, offset: int = 0) -> None:
        self._page = page if page is not None else bytearray(8)
        self._offset = offset

    def failing_since(self) -> float:
        return struct.unpack_from("d", self._page, self._offset)[0]

    def failing(self, since: float) -> None:
        if self.failing_since() == 0.0:
            struct.pack_into("d", self._page, self._offset, max(since, 1e-9))

    def answered(self) -> None:
        if self.failing_since() != 0.0:
            struct.pack_into("d", self._page, self._offset, 0.0)


@dataclass
class RetryPolicy:
    """How :func:`call_with_retries` retries (see the module docstring).

    Attributes:
        max_attempts: at most this many tries; None (default): as many as
            ``deadline_s`` allows.
        deadline_s: no try starts later than this after the first one.
        base_s, cap_s: the backoff's first bound and its cap per pause.
        rng, sleep, clock: the jitter's random source, the pause and the monotonic
            clock; injectable for tests.
        health: where to say whether the store answers (None: nowhere).
    """

    max_attempts: int | None = None
    deadline_s: float = 60.0
    base_s: float = BACKOFF_BASE_S
    cap_s: float = BACKOFF_CAP_S
    rng: random.Random = field(default_factory=random.Random)
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    health: StoreHealth | None = None

    def backoff(self, attempt: int) -> float:
        """The pause after failed try number ``attempt`` (1-based), before the deadline
        cuts it."""
        return self.rng.uniform(0.0, min(self.cap_s, self.base_s * (2 ** (attempt - 1))))

    def describe(self) -> str:
        """The settings, for error messages."""
        cap = "" if self.max_attempts is None else f"max_attempts={self.max_attempts}, "
        return f"{cap}retry_deadline_s={self.deadline_s:g}"


class Abandoned(CheckpointError):
    """A part of a parallel transfer that gave up because a sibling failed first."""


def type_and_text(exc: BaseException) -> str:
    """``Type: text`` of an exception, the default description of a last cause."""
    return f"{type(exc).__name__}: {exc}"


def call_with_retries(
    fn: Callable[[], T],
    policy: RetryPolicy,
    *,
    what: str,
    url: str,
    retryable: Callable[[BaseException], bool],
    translate: Callable[[BaseException], CheckpointError],
    describe: Callable[[BaseException], str] | None = None,
    stop: threading.Event | None = None,
) -> T:
    """``fn()``, tried again after transient failures (``retryable(exc)``).

    A :class:`CheckpointError` raised by ``fn`` passes through untouched. A failure that
    is not transient is ``translate``-d and raised at once. When time (or
    ``max_attempts``) runs out, or ``stop`` is set by a sibling that already failed, a
    CheckpointError names ``what``, ``url``, the tries, the seconds they took, the
    policy and the last cause (``describe(exc)``, by default its type and text).

    Example::

        call_with_retries(lambda: client.head_object(Bucket=b, Key=k), RetryPolicy(),
                          what="HEAD", url=f"s3://{b}/{k}", retryable=is_retryable,
                          translate=lambda e: CheckpointError(str(e)))
    """
    if describe is None:
        describe = type_and_text
    start = policy.clock()
    attempt = 0
    while True:
        attempt += 1
        try:
            answer = fn()
        except CheckpointError:
            raise
        except Exception as exc:
            if not retryable(exc):
                if policy.health is not None:
                    policy.health.answered()  # (with an error, but it answered)
                raise translate(exc) from exc
            if policy.health is not None:
                policy.health.failing(start)
            if stop is not None and stop.is_set():
                raise Abandoned(
                    f"{what} abandoned (another part of the same transfer failed); "
                    f"last cause: {describe(exc)}",
                    path=url,
                ) from exc
            elapsed = policy.clock() - start
            left = policy.deadline_s - elapsed
            capped = policy.max_attempts is not None and attempt >= policy.max_attempts
            if capped or left <= 0:
                raise CheckpointError(
                    f"{what} failed after {attempt} attempt(s) in {elapsed:.1f} s "
                    f"({policy.describe()}); last cause: {describe(exc)}; is the store "
                    "reachable? A longer S3Options.retry_deadline_s rides out longer outages",
                    path=url,
                ) from exc
            policy.sleep(min(policy.backoff(attempt), left))
            continue
        if policy.health is not None:
            policy.health.answered()
        return answer
