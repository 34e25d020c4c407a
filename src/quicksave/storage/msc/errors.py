"""What an MSC failure means to the user: :class:`MscErrors` turns whatever MSC or its
provider raised into a :class:`~quicksave.errors.CheckpointError` naming the ``msc://``
URL and the profile (permission denied: check the credentials; unreachable: check the
endpoint; transient: after MSC's own retries), with every credential of the config
scrubbed from the text and from the exception chain.

Made once per backend by :class:`~quicksave.storage.msc.backend.MscBackend`, once its
config file and secrets are known; used on every failed call, from any thread.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NoReturn

from quicksave.errors import CheckpointError, CheckpointNotFoundError

_CONNECTION_ERRORS = (
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ProxyConnectionError",
    "NewConnectionError",
    "MaxRetryError",
    "ProtocolError",
)


def exc_chain(e: BaseException) -> Iterator[BaseException]:
    """``e`` and its causes and contexts, each once."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def profile_url(profile: str, key: str) -> str:
    """The ``msc://`` URL of ``key`` in ``profile``."""
    return f"msc://{profile}/{key.lstrip('/')}"


def config_name(config_file: str | None) -> str:
    """The MSC config in words, for messages."""
    if config_file:
        return f"MSC config file {config_file}"
    return "MSC config (no file found: set MSC_CONFIG or StorageOptions.msc_config)"


class MscErrors:
    """The error messages of one MSC profile (see the module docstring).

    Args:
        profile: the profile's name.
        config_file: the config file in use (None: none found).
        secrets: texts never to show, longest first.
        retryable: MSC's ``RetryableError`` type (None before MSC is imported).
    """

    def __init__(
        self,
        profile: str,
        config_file: str | None,
        secrets: list[str],
        retryable: type[BaseException] | None = None,
    ) -> None:
        self.profile = profile
        self.config_file = config_file
        self.secrets = secrets
        self.retryable = retryable

    def url(self, key: str) -> str:
        return profile_url(self.profile, key)

    def scrub(self, text: str) -> str:
        for s in self.secrets:
            if s in text:
                text = text.replace(s, "***")
        return text

    def describe(self, e: BaseException) -> str:
        """``Type: text`` of ``e``, on one line, at most 600 characters, scrubbed."""
        text = " ".join(str(e).split())
        if len(text) > 600:
            text = text[:600] + "..."
        return self.scrub(f"{type(e).__name__}: {text}" if text else type(e).__name__)

    def error(self, e: BaseException, op: str, key: str) -> CheckpointError:
        """A quicksave error for ``e`` (raised by MSC while doing ``op`` on ``key``)."""
        url = self.url(key)
        if isinstance(e, CheckpointError):
            return e
        if isinstance(e, FileNotFoundError):
            return CheckpointNotFoundError(f"{op} failed: no such object", path=url)
        detail = self.describe(e)
        if isinstance(e, PermissionError):
            msg = (
                f"{op} failed: permission denied; check the credentials of MSC profile "
                f"{self.profile!r} ({config_name(self.config_file)}): {detail}"
            )
        elif any(
            isinstance(c, (ConnectionError, TimeoutError)) or type(c).__name__ in _CONNECTION_ERRORS
            for c in exc_chain(e)
        ):
            msg = (
                f"{op} failed: cannot reach the storage of MSC profile {self.profile!r} "
                f"(check its endpoint and the network): {detail}"
            )
        elif self.retryable is not None and isinstance(e, self.retryable):
            msg = f"{op} failed after MSC's retries (transient storage error): {detail}"
        else:
            msg = f"{op} failed: {detail}"
        return CheckpointError(msg, path=url)

    def raise_(self, e: BaseException, op: str, key: str) -> NoReturn:
        """Raise :meth:`error`'s error, chained to ``e`` unless a secret is in the chain."""
        err = self.error(e, op, key)
        if err is e:
            raise err
        leaks = any(s in str(c) for c in exc_chain(e) for s in self.secrets)
        raise err from (None if leaks else e)
