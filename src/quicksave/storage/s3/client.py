"""Making the botocore S3 client of one bucket: boto3's session (profile), the endpoint,
the credentials (``S3Options`` first, the standard AWS chain for the rest) and the client
config (botocore's own retries off: :mod:`quicksave.storage.retry` is the one loop).

Called once, by :class:`~quicksave.storage.s3.backend.S3Backend` when it is made without
a client. boto3 is imported here, on that call, with a clear error naming the
``quicksave[s3]`` extra when it is not installed; the module itself is torch-free and
boto-free at import.
"""

from __future__ import annotations

import os
from typing import Any

from quicksave.errors import CheckpointError
from quicksave.storage.backend import S3Options
from quicksave.storage.s3.errors import scrub

INSTALL_HINT = "pip install 'quicksave[s3]'"


def make_client(bucket: str, options: S3Options, max_concurrency: int) -> tuple[Any, set[str]]:
    """A botocore S3 client for ``bucket`` and every secret it was given (explicit or
    from the chain: never to be shown in a message).

    Raises:
        CheckpointError: boto3 is not installed, the profile does not exist, only half
            of the explicit credentials are given and the chain lacks the other, or
            botocore refuses the settings.
    """
    secrets = {s for s in (options.secret_access_key, options.session_token) if s}
    try:
        import boto3
        import botocore.config
        import botocore.exceptions as bex
    except ImportError as e:
        raise CheckpointError(
            f"s3://{bucket}: the S3 backend needs boto3, which is not installed ({INSTALL_HINT})"
        ) from e
    o = options
    try:
        session = boto3.session.Session(profile_name=o.profile or None)
    except bex.ProfileNotFound as e:
        raise CheckpointError(
            f"s3://{bucket}: AWS profile {o.profile or os.environ.get('AWS_PROFILE')!r} "
            "not found in the shared config"
        ) from e
    endpoint = o.endpoint_url or _configured_endpoint(session)
    style = o.addressing_style or ("path" if endpoint else None)
    config = botocore.config.Config(
        retries={"total_max_attempts": 1, "mode": "standard"},
        max_pool_connections=max(2 * max_concurrency, 10),
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
                f"s3://{bucket}: S3Options gives only one of access_key_id and "
                "secret_access_key, and the AWS chain has no credentials for the other"
            )
        if getattr(frozen, "secret_key", None):
            secrets.add(frozen.secret_key)
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
            f"s3://{bucket}: cannot make an S3 client: {scrub(str(e), secrets)}"
        ) from None
    if key_id is None:  # the chain's credentials: keep them out of messages too
        frozen = _chain_credentials(session)
        if frozen is not None:
            secrets.update(s for s in (frozen.secret_key, frozen.token) if s)
    return client, secrets


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
