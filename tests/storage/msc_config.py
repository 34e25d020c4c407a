"""Write a Multi-Storage Client config file for tests (and benchmarks).

``write_msc_config(directory, endpoint_url=..., bucket=..., ...)`` writes an MSC config
with one S3 profile pointing at a bucket on an S3-compatible server (SeaweedFS) and
returns the file's path; ``msc_config_for(server, bucket, directory)`` does the same from
the ``s3_server`` fixture's attributes. Point MSC at it with
``monkeypatch.setenv("MSC_CONFIG", path)`` or ``StorageOptions(msc_config=path)``.

What SeaweedFS (or MinIO) needs in the profile: ``endpoint_url`` (``http://host:port``),
``region_name`` (any, it signs the requests), path-style addressing
(``s3: {addressing_style: path}``: virtual-host style would put the bucket in the host
name) and static credentials (``credentials_provider: {type: S3Credentials, ...}``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import yaml


def msc_profile(
    *,
    endpoint_url: str,
    bucket: str,
    access_key: str | None = None,
    secret_key: str | None = None,
    region: str = "us-east-1",
    prefix: str = "",
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One MSC profile (a dict) for an S3 bucket (``prefix``: a key prefix inside it)."""
    base_path = bucket + ("/" + prefix.strip("/") if prefix.strip("/") else "")
    provider_options: dict[str, Any] = {
        "base_path": base_path,
        "endpoint_url": endpoint_url,
        "region_name": region,
        "s3": {"addressing_style": "path"},
    }
    provider_options.update(options or {})
    profile: dict[str, Any] = {"storage_provider": {"type": "s3", "options": provider_options}}
    if access_key is not None or secret_key is not None:
        profile["credentials_provider"] = {
            "type": "S3Credentials",
            "options": {"access_key": access_key or "", "secret_key": secret_key or ""},
        }
    return profile


def write_msc_config(
    directory: str | os.PathLike[str],
    *,
    endpoint_url: str,
    bucket: str,
    profile: str = "qs",
    access_key: str | None = None,
    secret_key: str | None = None,
    region: str = "us-east-1",
    prefix: str = "",
    options: dict[str, Any] | None = None,
    extra_profiles: dict[str, dict[str, Any]] | None = None,
    fmt: str = "yaml",
    name: str | None = None,
) -> str:
    """Write an MSC config with the profile ``profile`` (plus ``extra_profiles``) into
    ``directory`` as YAML or JSON; returns the file's absolute path.

    ``options`` are extra S3 provider options (``multipart_threshold``,
    ``multipart_chunksize``, ``max_concurrency``, ``request_checksum_calculation``,
    ``rust_client``, ...)."""
    if fmt not in ("yaml", "json"):
        raise ValueError(f"fmt must be 'yaml' or 'json', not {fmt!r}")
    profiles = {
        profile: msc_profile(
            endpoint_url=endpoint_url,
            bucket=bucket,
            access_key=access_key,
            secret_key=secret_key,
            region=region,
            prefix=prefix,
            options=options,
        )
    }
    profiles.update(extra_profiles or {})
    doc = {"profiles": profiles}
    os.makedirs(directory, exist_ok=True)
    path = os.path.abspath(os.path.join(os.fspath(directory), name or f"msc_config.{fmt}"))
    with open(path, "w", encoding="utf-8") as f:
        if fmt == "json":
            json.dump(doc, f, indent=2)
        else:
            yaml.safe_dump(doc, f, sort_keys=False)
    return path


def msc_config_for(
    server: Any, bucket: str, directory: str | os.PathLike[str], **kwargs: Any
) -> str:
    """``write_msc_config`` for a bucket on the ``s3_server`` fixture's server (its
    ``endpoint_url``, ``access_key_id``, ``secret_access_key`` and ``region``; any of
    them can be overridden, e.g. ``endpoint_url=fault_proxy.endpoint_url``)."""
    kwargs.setdefault("endpoint_url", server.endpoint_url)
    kwargs.setdefault("access_key", getattr(server, "access_key_id", None))
    kwargs.setdefault("secret_key", getattr(server, "secret_access_key", None))
    kwargs.setdefault("region", getattr(server, "region", None) or "us-east-1")
    return write_msc_config(directory, bucket=bucket, **kwargs)
