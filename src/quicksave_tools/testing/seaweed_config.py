"""The identities and config files of a
:class:`~quicksave_tools.testing.seaweed.SeaweedServer`, written into its temporary
directory before ``weed`` starts (which reads them from ``-config_dir``).

- :func:`new_credentials`: an AWS-style key pair, random per server;
- :func:`identities`: the S3 gateway's identities (``s3.json``): the *admin* may do
  everything on every bucket, the *restricted* one Read, Write, List and Tagging on one
  bucket only;
- :func:`write_config_files`: ``s3.json`` (mode 0600: it holds the secrets),
  ``master.toml`` (volumes per new bucket) and an empty ``security.toml`` (no JWT
  signing, no TLS, whatever ``$HOME/.seaweedfs`` or ``/etc/seaweedfs`` hold);
- :func:`write_filer_toml`: the filer's store (leveldb2) inside one attempt's data.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any


def new_credentials(prefix: str) -> tuple[str, str]:
    """An AWS-style key pair: ``prefix`` + upper-case alphanumerics, 20 characters in
    all, and a 40-character secret."""
    key = prefix + secrets.token_hex(10).upper()[: 20 - len(prefix)]
    return key, secrets.token_urlsafe(30)[:40]


def identities(
    admin: tuple[str, str], restricted: tuple[str, str], restricted_bucket: str
) -> dict[str, Any]:
    """The S3 gateway's identities: ``admin`` and ``restricted`` are (access key id,
    secret access key); the restricted one may use ``restricted_bucket`` only."""
    b = restricted_bucket
    return {
        "identities": [
            {
                "name": "quicksave_admin",
                "credentials": [{"accessKey": admin[0], "secretKey": admin[1]}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            },
            {
                "name": "quicksave_restricted",
                "credentials": [{"accessKey": restricted[0], "secretKey": restricted[1]}],
                "actions": [f"Read:{b}", f"Write:{b}", f"List:{b}", f"Tagging:{b}"],
            },
        ]
    }


def write_config_files(tmpdir: Path, ids: dict[str, Any], volumes_per_bucket: int) -> Path:
    """Write ``s3.json``, ``master.toml`` and ``security.toml`` into ``tmpdir``; returns
    the path of ``s3.json`` (``-s3.config``)."""
    config = tmpdir / "s3.json"
    config.write_text(json.dumps(ids, indent=1))
    config.chmod(0o600)
    (tmpdir / "master.toml").write_text(
        "[master.volume_growth]\n"
        f"copy_1 = {volumes_per_bucket}\n"
        "copy_2 = 2\ncopy_3 = 3\ncopy_other = 1\n"
    )
    # Shadows any security.toml in $HOME/.seaweedfs or /etc/seaweedfs (weed searches
    # -config_dir first): no JWT signing, no TLS.
    (tmpdir / "security.toml").write_text("")
    return config


def write_filer_toml(tmpdir: Path, data: Path) -> None:
    """The filer's store: leveldb2 in ``data`` (one start attempt's data directory)."""
    (tmpdir / "filer.toml").write_text(
        f'[leveldb2]\nenabled = true\ndir = "{data / "filerldb2"}"\n'
    )
