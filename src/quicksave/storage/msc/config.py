"""Finding and loading the MSC config of one profile: :func:`import_msc` (with a clear
error naming the ``quicksave[msc]`` extra), :func:`locate_config` (the file MSC will use,
by MSC's own search, and every credential in it, to be hidden from messages) and
:func:`build_client` (MSC's ``StorageClient`` of the profile; an unknown profile, a file
that does not parse or a refused provider become a
:class:`~quicksave.errors.CheckpointError` saying which and where).

Called in this order, once, by :class:`~quicksave.storage.msc.backend.MscBackend` when it
is made. Torch-free; ``multistorageclient`` is imported only by :func:`import_msc`.
"""

from __future__ import annotations

import os
import re
from typing import Any

from quicksave.errors import CheckpointError
from quicksave.storage.backend import StorageOptions
from quicksave.storage.msc.errors import MscErrors, config_name, exc_chain

INSTALL_HINT = "pip install 'quicksave[msc]'"

# config keys whose values are never shown (credentials of any provider)
_SECRET_KEY = re.compile(
    r"secret|token|password|passwd|credential|sas|account_key|access_key", re.I
)
# the same in a file that does not parse: ``secret_key: value`` / ``"secret_key": "value"``
_SECRET_LINE = re.compile(
    r"""["']?[\w-]*(?:secret|token|password|passwd|passphrase|account_key|access_key)[\w-]*["']?"""
    r"""\s*[:=]\s*["']?([^"'\s,}#]+)""",
    re.I,
)
_SECRET_ENV = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_CONNECTION_STRING",
    "OCI_API_KEY",
)


def import_msc() -> Any:
    """The ``multistorageclient`` module, or a CheckpointError naming the extra."""
    try:
        import multistorageclient
    except ImportError as e:
        raise CheckpointError(
            f"msc:// locations need the Multi-Storage Client; install it with {INSTALL_HINT} "
            f"({type(e).__name__}: {e})"
        ) from None
    return multistorageclient


def _walk_secrets(value: Any, under_secret: bool, out: set[str]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _walk_secrets(v, under_secret or bool(_SECRET_KEY.search(str(k))), out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _walk_secrets(v, under_secret, out)
    elif under_secret and isinstance(value, str):
        out.add(value)
        out.add(os.path.expandvars(value))  # ${VAR} is expanded by MSC when it loads


def _file_secrets(path: str | None) -> set[str]:
    """Every credential-like value in a config file, parsed or not (best effort)."""
    out: set[str] = set()
    if not path:
        return out
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return out
    out.update(m.group(1) for m in _SECRET_LINE.finditer(text))
    try:
        if path.endswith(".json"):
            import json

            doc = json.loads(text)
        else:
            import yaml

            doc = yaml.safe_load(text)
        _walk_secrets(doc, False, out)
    except Exception:  # malformed: the regex above is all there is
        pass
    return {os.path.expandvars(s) for s in out} | out


def locate_config(
    msc: Any, profile: str, options: StorageOptions, url: str
) -> tuple[str | None, list[str]]:
    """The config file MSC will use (None: none found) and the secrets to hide
    (longest first). ``url`` names the profile in the error of a missing explicit file."""
    explicit = options.msc_config
    if explicit is not None:
        path = os.path.abspath(os.fspath(explicit))
        if not os.path.isfile(path):
            raise CheckpointError(
                f"MSC config file {path} does not exist (StorageOptions.msc_config) "
                f"for profile {profile!r}",
                path=url,
            )
        found: str | None = path
    else:
        candidates: list[str] = []
        env = os.getenv("MSC_CONFIG")
        if env:
            candidates.append(env)
        search = getattr(msc.config, "_find_config_file_paths", None)
        if search is not None:
            candidates.extend(search())
        found = next(
            (os.path.abspath(p) for p in candidates if os.path.exists(os.path.abspath(p))),
            None,
        )
    secrets = _file_secrets(found)
    try:
        from multistorageclient.rclone import read_rclone_config

        rclone_dict, _ = read_rclone_config()
        _walk_secrets(rclone_dict, False, secrets)
    except Exception:
        pass
    for name in _SECRET_ENV:
        if os.environ.get(name):
            secrets.add(os.environ[name])
    # longest first, so that a secret containing another is hidden whole
    return found, sorted((s for s in secrets if len(s) >= 4), key=len, reverse=True)


def build_client(msc: Any, options: StorageOptions, errors: MscErrors) -> Any:
    """MSC's ``StorageClient`` of ``errors.profile`` from ``errors.config_file``."""
    profile, config_file = errors.profile, errors.config_file
    files = [config_file] if options.msc_config is not None else None
    where = config_name(config_file)
    try:
        config = msc.StorageClientConfig.from_file(
            files, profile=profile, telemetry_provider=msc.get_telemetry_provider()
        )
    except ValueError as e:
        text = str(e)
        if f'Profile "{profile}" not found' in text or f"Profile {profile} not found" in text:
            raise CheckpointError(
                f"unknown MSC profile {profile!r}: it is not defined in {where}"
                f"{_available_profiles(config_file)}",
                path=errors.url(""),
            ) from None
        raise _config_error(errors, e, where) from None
    except Exception as e:
        raise _config_error(errors, e, where) from None
    try:
        return msc.StorageClient(config)
    except Exception as e:
        raise _config_error(errors, e, where) from None


def _available_profiles(config_file: str | None) -> str:
    if not config_file:
        return ""
    try:
        if config_file.endswith(".json"):
            import json

            with open(config_file, encoding="utf-8") as f:
                doc = json.load(f)
        else:
            import yaml

            with open(config_file, encoding="utf-8") as f:
                doc = yaml.safe_load(f)
        names = sorted(str(n) for n in (doc or {}).get("profiles", {}))
    except Exception:
        return ""
    return f" (it defines: {', '.join(names) or 'no profiles'})"


def _config_error(errors: MscErrors, e: BaseException, where: str) -> CheckpointError:
    detail = errors.describe(e)
    for cause in exc_chain(e):
        mark = getattr(cause, "problem_mark", None)  # YAML: say where, not the text
        if mark is not None:
            detail = (
                f"not valid YAML at line {mark.line + 1}, column {mark.column + 1}"
                f" ({getattr(cause, 'problem', None) or type(cause).__name__})"
            )
            break
        if type(cause).__name__ == "JSONDecodeError":
            detail = f"not valid JSON at line {cause.lineno}, column {cause.colno} ({cause.msg})"  # type: ignore[attr-defined]
            break
    return CheckpointError(
        f"cannot use MSC profile {errors.profile!r} from {where}: {detail}",
        path=errors.url(""),
    )
