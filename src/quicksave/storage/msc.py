"""The Multi-Storage Client backend: one MSC profile (``msc://<profile>/<key>``).

NVIDIA's Multi-Storage Client (package ``multi-storage-client``, ``pip install
'quicksave[msc]'``) reaches S3, GCS, Azure, OCI, AIStore, POSIX and more through named
*profiles* in a YAML/JSON config file. This backend drives one profile through MSC's
public :class:`~multistorageclient.StorageClient` API, so whatever the profile configures
(its provider, credentials provider, retry policy, cache, replicas, the provider's
``multipart_threshold`` / ``multipart_chunksize`` / ``max_concurrency``, the Rust client)
applies to quicksave's I/O as it does to any other MSC user.

Config lookup is MSC's own: ``StorageOptions.msc_config`` names the file; without it MSC
searches ``$MSC_CONFIG``, then its default paths (``~/.msc_config.yaml``,
``~/.config/msc/config.yaml``, ``/etc/msc_config.yaml``, ...), exactly as
``msc.resolve_storage_client("msc://<profile>/...")`` does. An S3 profile for an
S3-compatible server (SeaweedFS, MinIO) looks like::

    profiles:
      ckpt:
        storage_provider:
          type: s3
          options:
            base_path: my-bucket            # bucket[/prefix]
            endpoint_url: http://127.0.0.1:8333
            region_name: us-east-1
            s3: {addressing_style: path}    # path-style URLs for a custom endpoint
        credentials_provider:
          type: S3Credentials
          options: {access_key: ..., secret_key: ...}

The backend is a *store* (``atomic_rename = False``) whatever the provider, POSIX
included: a checkpoint is committed by writing its manifest last.

How bytes move:

- ``put`` hands MSC a read-only, seekable file object over the caller's memoryview
  (``StorageClient.upload_file``). Objects up to the provider's ``multipart_threshold``
  (S3: 64 MiB by default) become one PUT; MSC reads them with ``f.read()``, which is one
  copy of the object (botocore takes ``bytes`` but not a memoryview). Larger ones are
  uploaded by boto3's transfer manager in ``multipart_chunksize`` parts, several in
  flight; it reads each part with ``f.read(part_size)``: one memcpy per byte, in
  part-sized pieces, at most about ten parts (s3transfer's
  ``max_in_memory_upload_chunks``) held at once, never a second whole-object buffer.
  No public MSC call takes a memoryview without that copy. The ranges' xxh3-64 are
  computed meanwhile on another thread (xxhash releases the GIL).
- ``read_into`` issues ranged reads (``StorageClient.read(byte_range=...)``), several in
  parallel on a thread pool owned by the backend for large ranges. MSC returns each range
  as a new ``bytes``, which is copied into the destination: one extra memcpy per byte.

Torch-free, and ``multistorageclient`` is imported only when a backend is created.
"""

from __future__ import annotations

import io
import os
import re
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, NoReturn

import xxhash

from quicksave.checksum import hexdigest
from quicksave.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from quicksave.storage.backend import ObjectInfo, Range, StorageOptions, byte_view, hash_ranges

READ_PIECE = 32 << 20  # bytes per ranged GET of a large read_into
MAX_CONCURRENCY = 8  # ranged GETs in flight per read_into (and the pool's size)

_INSTALL_HINT = "pip install 'quicksave[msc]'"

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


def _import_msc() -> Any:
    try:
        import multistorageclient
    except ImportError as e:
        raise CheckpointError(
            f"msc:// locations need the Multi-Storage Client; install it with {_INSTALL_HINT} "
            f"({type(e).__name__}: {e})"
        ) from None
    return multistorageclient


class _ViewReader(io.RawIOBase):
    """A read-only, seekable binary file over a memoryview, for MSC's ``upload_file``.

    ``read`` returns ``bytes`` (a copy of the piece asked for: botocore refuses a
    memoryview body); ``readinto`` copies straight into the caller's buffer; ``getvalue``
    is the view itself (MSC's POSIX provider asks for it to learn the size).
    """

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = len(self._view) + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if pos < 0:
            raise ValueError(f"negative seek position {pos}")
        self._pos = pos
        return pos

    def read(self, size: int | None = -1) -> bytes:
        start = min(self._pos, len(self._view))
        stop = len(self._view) if size is None or size < 0 else min(start + size, len(self._view))
        self._pos = stop
        return self._view[start:stop].tobytes()

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, b: Any) -> int:
        dest = memoryview(b).cast("B")
        start = min(self._pos, len(self._view))
        n = min(len(dest), len(self._view) - start)
        dest[:n] = self._view[start : start + n]
        self._pos = start + n
        return n

    def getvalue(self) -> memoryview:
        return self._view

    def __len__(self) -> int:
        return len(self._view)


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


def _exc_chain(e: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


class MscBackend:
    """One MSC profile as a quicksave storage backend (see the module docstring).

    Args:
        profile: the MSC profile name (``msc://<profile>/...``).
        options: ``options.msc_config`` names the MSC config file; ``None`` uses MSC's
            own search (``$MSC_CONFIG``, then MSC's default paths).
        read_piece: bytes per ranged GET when ``read_into`` splits a large read.
        max_concurrency: ranged GETs in flight per ``read_into`` (upload parallelism is
            the profile's ``max_concurrency`` option, read by MSC's S3 provider).

    Retries: MSC's ``retry`` config (default 3 attempts with backoff) over the provider's
    own (botocore "standard" mode for S3); both are bounded in count and time.
    """

    scheme = "msc"
    atomic_rename = False

    def __init__(
        self,
        profile: str,
        options: StorageOptions | None = None,
        *,
        read_piece: int = READ_PIECE,
        max_concurrency: int = MAX_CONCURRENCY,
    ) -> None:
        if not profile or "/" in profile:
            raise CheckpointError(f"invalid MSC profile name {profile!r}")
        self.profile = profile
        self._options = options if options is not None else StorageOptions()
        self._read_piece = max(1, int(read_piece))
        self._max_concurrency = max(1, int(max_concurrency))
        self._lock = threading.Lock()
        self._closed = False
        msc = _import_msc()
        self._msc_types = msc.types
        self.config_file, self._secrets = self._locate_config(msc)
        self._client = self._build_client(msc)
        self._pool = ThreadPoolExecutor(self._max_concurrency, thread_name_prefix="quicksave-msc")
        self._hasher = ThreadPoolExecutor(2, thread_name_prefix="quicksave-msc-hash")

    # -- setup -------------------------------------------------------------------------

    def _locate_config(self, msc: Any) -> tuple[str | None, list[str]]:
        """The config file MSC will use (None: none found) and the secrets to hide."""
        explicit = self._options.msc_config
        if explicit is not None:
            path = os.path.abspath(os.fspath(explicit))
            if not os.path.isfile(path):
                raise CheckpointError(
                    f"MSC config file {path} does not exist (StorageOptions.msc_config) "
                    f"for profile {self.profile!r}",
                    path=self.url(""),
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

    def _config_name(self) -> str:
        if self.config_file:
            return f"MSC config file {self.config_file}"
        return "MSC config (no file found: set MSC_CONFIG or StorageOptions.msc_config)"

    def _build_client(self, msc: Any) -> Any:
        files = [self.config_file] if self._options.msc_config is not None else None
        where = self._config_name()
        try:
            config = msc.StorageClientConfig.from_file(
                files, profile=self.profile, telemetry_provider=msc.get_telemetry_provider()
            )
        except ValueError as e:
            text = str(e)
            if (
                f'Profile "{self.profile}" not found' in text
                or f"Profile {self.profile} not found" in text
            ):
                raise CheckpointError(
                    f"unknown MSC profile {self.profile!r}: it is not defined in {where}"
                    f"{self._available_profiles()}",
                    path=self.url(""),
                ) from None
            raise self._config_error(e, where) from None
        except Exception as e:
            raise self._config_error(e, where) from None
        try:
            return msc.StorageClient(config)
        except Exception as e:
            raise self._config_error(e, where) from None

    def _available_profiles(self) -> str:
        if not self.config_file:
            return ""
        try:
            if self.config_file.endswith(".json"):
                import json

                with open(self.config_file, encoding="utf-8") as f:
                    doc = json.load(f)
            else:
                import yaml

                with open(self.config_file, encoding="utf-8") as f:
                    doc = yaml.safe_load(f)
            names = sorted(str(n) for n in (doc or {}).get("profiles", {}))
        except Exception:
            return ""
        return f" (it defines: {', '.join(names) or 'no profiles'})"

    def _config_error(self, e: BaseException, where: str) -> CheckpointError:
        detail = self._describe(e)
        for cause in _exc_chain(e):
            mark = getattr(cause, "problem_mark", None)  # YAML: say where, not the text
            if mark is not None:
                detail = (
                    f"not valid YAML at line {mark.line + 1}, column {mark.column + 1}"
                    f" ({getattr(cause, 'problem', None) or type(cause).__name__})"
                )
                break
            if type(cause).__name__ == "JSONDecodeError":
                detail = (
                    f"not valid JSON at line {cause.lineno}, column {cause.colno} ({cause.msg})"  # type: ignore[attr-defined]
                )
                break
        return CheckpointError(
            f"cannot use MSC profile {self.profile!r} from {where}: {detail}",
            path=self.url(""),
        )

    # -- errors ------------------------------------------------------------------------

    def _scrub(self, text: str) -> str:
        for s in self._secrets:
            if s in text:
                text = text.replace(s, "***")
        return text

    def _describe(self, e: BaseException) -> str:
        text = " ".join(str(e).split())
        if len(text) > 600:
            text = text[:600] + "..."
        return self._scrub(f"{type(e).__name__}: {text}" if text else type(e).__name__)

    def _error(self, e: BaseException, op: str, key: str) -> CheckpointError:
        """A quicksave error for ``e`` (raised by MSC while doing ``op`` on ``key``)."""
        url = self.url(key)
        if isinstance(e, CheckpointError):
            return e
        if isinstance(e, FileNotFoundError):
            return CheckpointNotFoundError(f"{op} failed: no such object", path=url)
        detail = self._describe(e)
        if isinstance(e, PermissionError):
            msg = (
                f"{op} failed: permission denied; check the credentials of MSC profile "
                f"{self.profile!r} ({self._config_name()}): {detail}"
            )
        elif any(
            isinstance(c, (ConnectionError, TimeoutError)) or type(c).__name__ in _CONNECTION_ERRORS
            for c in _exc_chain(e)
        ):
            msg = (
                f"{op} failed: cannot reach the storage of MSC profile {self.profile!r} "
                f"(check its endpoint and the network): {detail}"
            )
        elif isinstance(e, self._msc_types.RetryableError):
            msg = f"{op} failed after MSC's retries (transient storage error): {detail}"
        else:
            msg = f"{op} failed: {detail}"
        return CheckpointError(msg, path=url)

    def _raise(self, e: BaseException, op: str, key: str) -> NoReturn:
        err = self._error(e, op, key)
        if err is e:
            raise err
        leaks = any(s in str(c) for c in _exc_chain(e) for s in self._secrets)
        raise err from (None if leaks else e)

    def _live(self) -> Any:
        client = self._client
        if self._closed or client is None:
            raise CheckpointError("the MSC backend is closed", path=self.url(""))
        return client

    # -- the Backend protocol ----------------------------------------------------------

    def url(self, key: str) -> str:
        return f"msc://{self.profile}/{key.lstrip('/')}"

    def put(self, key: str, data: memoryview, *, ranges: Sequence[Range] = ()) -> dict[str, str]:
        """Store ``data`` as ``key`` (whole or not at all) and return the xxh3-64 of every
        ``(name, offset, length)`` range, hashed on another thread while uploading.

        Small objects are one PUT (MSC reads them into one ``bytes``: a copy of the
        object); large ones are multipart uploads driven by MSC's provider, which reads
        each part into its own buffer (a copy per part, a bounded few at a time) and aborts
        the upload if any part fails.
        """
        client = self._live()
        view = byte_view(data)
        n = len(view)
        for name, off, length in ranges:
            if off < 0 or length < 0 or off + length > n:
                raise ValueError(f"range {name!r} [{off}, {off + length}) is outside 0..{n}")
        hashed: Future[dict[str, str]] | None = (
            self._hasher.submit(hash_ranges, view, tuple(ranges)) if ranges else None
        )
        try:
            client.upload_file(key, _ViewReader(view))
        except BaseException as e:
            if hashed is not None:
                hashed.cancel()
            if isinstance(e, Exception):
                self._raise(e, "upload", key)
            raise
        return hashed.result() if hashed is not None else {}

    def read_into(self, key: str, offset: int, dest: memoryview) -> None:
        """Fill ``dest`` with ``key[offset : offset + len(dest)]``: one ranged read, or
        ``read_piece``-sized ranged reads in parallel for a large range. Each piece comes
        back from MSC as ``bytes`` and is copied into ``dest``."""
        client = self._live()
        out = byte_view(dest, writable=True)
        n = len(out)
        if offset < 0:
            raise ValueError(f"negative offset {offset}")
        if n == 0:
            if self.stat(key) is None:
                raise CheckpointNotFoundError("read failed: no such object", path=self.url(key))
            return
        pieces = [(p, min(self._read_piece, n - p)) for p in range(0, n, self._read_piece)]
        short = False
        try:
            if len(pieces) == 1:
                short = not self._read_piece_into(client, key, offset, out)
            else:
                futures = [
                    self._pool.submit(
                        self._read_piece_into, client, key, offset + p, out[p : p + size]
                    )
                    for p, size in pieces
                ]
                wait(futures, return_when=FIRST_EXCEPTION)
                for f in futures:
                    f.cancel()
                wait(futures)  # none still writes into dest once this returns or raises
                short = not all([f.result() for f in futures if not f.cancelled()])
        except CheckpointNotFoundError:
            raise
        except Exception as e:
            info = self._stat_quiet(key)
            if info is not None and info.size < offset + n:
                raise self._short(key, info.size, offset, n) from None
            self._raise(e, "read", key)
        if short:
            info = self._stat_quiet(key)
            raise self._short(key, info.size if info else None, offset, n)

    def _read_piece_into(self, client: Any, key: str, offset: int, out: memoryview) -> bool:
        """Read ``len(out)`` bytes at ``offset`` into ``out``; False if the object ended."""
        try:
            data = client.read(key, byte_range=self._msc_types.Range(offset, len(out)))
        except Exception as e:
            if isinstance(e, FileNotFoundError):
                self._raise(e, "read", key)
            raise
        got = memoryview(data).cast("B")
        if len(got) != len(out):
            k = min(len(got), len(out))
            out[:k] = got[:k]
            return False
        out[:] = got
        return True

    def _short(self, key: str, size: int | None, offset: int, n: int) -> CorruptCheckpointError:
        have = f"{size} bytes long" if size is not None else "of unknown length"
        return CorruptCheckpointError(
            f"object is {have} but the read needs bytes [{offset}, {offset + n}) "
            f"({n} bytes): truncated or replaced",
            path=self.url(key),
        )

    def _stat_quiet(self, key: str) -> ObjectInfo | None:
        try:
            return self.stat(key)
        except CheckpointError:
            return None

    def read_scatter(self, key: str, offset: int, dests: Sequence[memoryview]) -> None:
        """MSC hands back ``bytes``, so the range is read once and copied out."""
        views = [byte_view(d, writable=True) for d in dests]
        buf = memoryview(bytearray(sum(len(v) for v in views)))
        self.read_into(key, offset, buf)
        pos = 0
        for v in views:
            v[:] = buf[pos : pos + len(v)]
            pos += len(v)

    def get(self, key: str, max_bytes: int) -> bytes:
        """The whole object; one larger than ``max_bytes`` is refused before reading it."""
        info = self.stat(key)
        if info is None:
            raise CheckpointNotFoundError("read failed: no such object", path=self.url(key))
        if info.size > max_bytes:
            raise CorruptCheckpointError(
                f"object is {info.size} bytes, more than the {max_bytes} allowed for it",
                path=self.url(key),
            )
        client = self._live()
        try:
            data = client.read(key)
        except Exception as e:
            self._raise(e, "read", key)
        body = data if isinstance(data, bytes) else bytes(memoryview(data))
        if len(body) > max_bytes:
            raise CorruptCheckpointError(
                f"object is {len(body)} bytes, more than the {max_bytes} allowed for it",
                path=self.url(key),
            )
        return body

    def stat(self, key: str) -> ObjectInfo | None:
        """The object ``key`` (a "directory" is not an object: None)."""
        client = self._live()
        try:
            meta = client.info(key, strict=False)
        except FileNotFoundError:
            return None
        except Exception as e:
            self._raise(e, "stat", key)
        if meta.type != "file":
            return None
        return ObjectInfo(key, int(meta.content_length), _mtime(meta))

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``. MSC lists directories, not raw
        prefixes: the directory holding ``prefix`` is listed (recursively) and filtered."""
        client = self._live()
        directory = prefix if prefix.endswith("/") or not prefix else prefix.rpartition("/")[0]
        if directory and not directory.endswith("/"):
            directory += "/"
        try:
            for meta in client.list(path=directory, include_directories=False):
                if meta.type == "file" and meta.key.startswith(prefix):
                    yield ObjectInfo(meta.key, int(meta.content_length), _mtime(meta))
        except FileNotFoundError:
            return
        except Exception as e:
            self._raise(e, "list", prefix)

    def children(self, prefix: str) -> list[str]:
        """The names directly under the directory ``prefix``, sorted."""
        client = self._live()
        directory = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        names: set[str] = set()
        try:
            for meta in client.list(path=directory, include_directories=True):
                if not meta.key.startswith(directory):
                    continue
                name = meta.key[len(directory) :].strip("/")
                if name:
                    names.add(name.split("/", 1)[0])
        except FileNotFoundError:
            return []
        except Exception as e:
            self._raise(e, "list", directory)
        return sorted(names)

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` (missing ones are no error), in batches where the provider has
        a bulk delete (S3: 1000 keys a request)."""
        client = self._live()
        todo = list(dict.fromkeys(keys))
        if not todo:
            return
        try:
            client.delete_many(todo)
        except FileNotFoundError:
            pass
        except Exception as e:
            self._raise(e, "delete", todo[0] if len(todo) == 1 else os.path.commonprefix(todo))

    def _provider(self) -> Any:
        """The profile's storage provider, for what MSC's ``StorageClient`` does not
        offer: conditional writes (its ``write`` takes no condition, though every
        provider's ``put_object`` does) and reads that no cache answers. None where a
        metadata provider or replicas sit between a key and the object the provider
        writes, or this MSC has no such attribute: then there are no conditional writes."""
        client = self._live()
        single = getattr(client, "_delegate", client)
        if getattr(single, "_metadata_provider", None) or getattr(single, "_replica_manager", None):
            return None
        provider = getattr(single, "_storage_provider", None)
        return provider if hasattr(provider, "put_object") else None

    def put_if(self, key: str, data: bytes, *, if_match: str | None = None) -> str | None:
        """Through the profile's provider (S3: ``If-None-Match: *`` / ``If-Match``).
        Providers that take no condition (POSIX) write anyway: the writer lease finds
        that out by probing and says it is best-effort there."""
        provider = self._provider()
        if provider is None:
            raise NotImplementedError(f"{self.url(key)}: no conditional writes through MSC here")
        body = bytes(byte_view(data))
        condition = {"if_none_match": "*"} if if_match is None else {"if_match": if_match}
        try:
            provider.put_object(key, body, **condition)
        except self._msc_types.PreconditionFailedError:
            return None
        except FileNotFoundError:  # If-Match on a missing object (AWS: 404)
            return None
        except NotImplementedError:
            raise
        except Exception as e:
            self._raise(e, "conditional write", key)
        got = self.get_tagged(key, len(body))
        if got is None or got[0] != body:
            return None  # replaced at once by another writer: its version, not ours
        return got[1]

    def get_tagged(self, key: str, max_bytes: int) -> tuple[bytes, str] | None:
        """Read past any cache, the version tag being the provider's ETag (the
        content's xxh3-64 where it has none); the object's metadata is read before and
        after it, and again if they differ, so the tag is the content's."""
        provider = self._provider()
        if provider is None:
            raise NotImplementedError(f"{self.url(key)}: no tagged reads through MSC here")
        try:
            for _ in range(5):
                before = provider.get_object_metadata(key)
                if int(before.content_length) > max_bytes:
                    raise CorruptCheckpointError(
                        f"object is {before.content_length} bytes, more than the "
                        f"{max_bytes} allowed for it",
                        path=self.url(key),
                    )
                body = bytes(provider.get_object(key))
                after = provider.get_object_metadata(key)
                if before.etag == after.etag and len(body) <= max_bytes:
                    tag = after.etag or hexdigest(xxhash.xxh3_64_intdigest(body))
                    return body, str(tag)
        except FileNotFoundError:
            return None
        except CheckpointError:
            raise
        except Exception as e:
            self._raise(e, "read", key)
        raise CheckpointError("the object keeps changing while read", path=self.url(key))

    def abort_uploads(self, prefix: str, older_than_s: float) -> int:
        """Always 0: MSC's API has no listing of incomplete multipart uploads. A failed
        upload is aborted by MSC's provider when it fails; what a killed process leaves
        behind needs a bucket lifecycle rule (AbortIncompleteMultipartUpload) or the
        ``s3://`` backend's clean-up on the same bucket."""
        self._live()
        return 0

    def close(self) -> None:
        """Stop the backend's threads and drop the MSC client (its connections go with
        it; MSC has no explicit close)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._hasher.shutdown(wait=True, cancel_futures=True)
        self._client = None

    def __enter__(self) -> MscBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MscBackend(profile={self.profile!r}, config={self.config_file!r})"

    def __reduce__(self) -> tuple[Any, ...]:  # rebuilt from the profile and options
        return (_rebuild, (self.profile, self._options, self._read_piece, self._max_concurrency))


def _rebuild(profile: str, options: StorageOptions, read_piece: int, max_concurrency: int):
    return MscBackend(profile, options, read_piece=read_piece, max_concurrency=max_concurrency)


def _mtime(meta: Any) -> float:
    last = getattr(meta, "last_modified", None)
    try:
        return float(last.timestamp()) if last is not None else 0.0
    except (OverflowError, OSError, ValueError):  # MSC's "unknown" is datetime.min
        return 0.0
