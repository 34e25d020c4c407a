"""Convert: rewrite a quicksave checkpoint as one ``torch.save`` file, a stock DCP
directory, or one consolidated safetensors file (``quicksave convert``).

The full (unsharded) state is rebuilt in host memory: one tensor per manifest entry
with its global shape and dtype, every stored chunk read straight into its box (and its
xxh3-64 checked), every object decoded from typed JSON (never unpickled), and the nested
structure restored from each entry's ``path``. Path elements that are integers are list
indices (that is how DCP flattens lists), so a dict whose keys were integers comes back
as a list.

Outputs appear atomically: they are written to ``<out>.tmp-<token>`` next to ``out``,
fsynced, then renamed; an existing ``out`` is never overwritten.

safetensors output: tensor keys are the flat fqns. ``__metadata__`` holds JSON strings:
``quicksave.objects`` (fqn -> ``{"value": typed JSON, "path": [...]}``, decodable with
``quicksave.format.objects.decode``), ``quicksave.paths`` (tensor fqn -> nested path,
where it differs from ``[fqn]``), ``quicksave.step`` and ``quicksave.user_metadata``.
A dtype that safetensors cannot describe (e.g. ``complex128``) is stored as its raw
little-endian bytes (``U8``, 1-D) and recorded in ``quicksave.raw_dtypes`` as
``{fqn: {"dtype": name, "shape": [...]}}``; ``t.view(dtype).reshape(shape)`` restores it.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import Any, Literal

import torch

from .commit import fsync_path, new_token, temp_path_for
from .errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError
from .format import FORMAT_VERSION
from .format import objects as objcodec
from .format.dtypes import dtype_from_name, element_size, safetensors_code
from .format.manifest import Manifest, read_manifest
from .persist import byte_view
from .reader import check_chunk_within, read_chunk_into, require_committed
from .storage import Location, StorageOptions, parse_location
from .storage.checkpoint_dir import CheckpointDir, Member
from .verify import byte_progress

Target = Literal["torch", "dcp", "safetensors", "quicksave"]
TARGETS: tuple[str, ...] = ("torch", "dcp", "safetensors", "quicksave")
Flat = dict[str, tuple[tuple[Any, ...], Any]]  # fqn -> (nested path, value)


def _nest(flat: Flat) -> dict[str, Any]:
    """Rebuild the nested state from (path, value) pairs; integer keys become list indices."""
    root: dict[Any, Any] = {}
    for fqn, (path, value) in flat.items():
        node = root
        for key in path[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise CorruptCheckpointError(
                    f"path {list(path)} conflicts with another entry", fqn=fqn
                )
            node = child
        node[path[-1]] = value

    def listify(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        items = {k: listify(v) for k, v in node.items()}
        keys = list(items)
        if (
            keys
            and all(isinstance(k, int) and not isinstance(k, bool) for k in keys)
            and sorted(keys) == list(range(len(keys)))
        ):
            return [items[i] for i in range(len(keys))]
        return items

    return {k: listify(v) for k, v in root.items()}


def load_full_state(
    path: str | os.PathLike[str], *, progress: bool = False
) -> tuple[dict[str, Any], Manifest]:
    """Read a whole quicksave checkpoint into host memory, unsharded.

    Args:
        path: a committed quicksave checkpoint.
        progress: show a tqdm bar over bytes read, on stderr.

    Returns:
        ``(state, manifest)``: the nested state dict as it was saved (tensors with their
        global shapes, objects decoded) and the manifest.

    Raises:
        CheckpointNotFoundError, NotCommittedError: ``path`` is not a committed quicksave
            checkpoint.
        CorruptCheckpointError: a file is missing, truncated or fails its checksum.

    Example::

        state, manifest = load_full_state("ckpt/step-100")
    """
    flat, m = _read_flat(parse_location(path), progress)
    return _nest(flat), m


def _open_data_files(d: CheckpointDir, m: Manifest) -> dict[str, Member]:
    """Open every data file the tensors use (regular files inside the checkpoint only)
    and check, before anything is allocated or read, that each holds its chunks and that
    the unsharded tensors fit in the bytes the files hold. Returns name -> member."""
    path = d.url
    fds: dict[str, Member] = {}
    sizes: dict[str, int] = {}
    try:
        for fqn, t in sorted(m.tensors.items()):
            for c in t.chunks:
                fpath = d.member_url(c.file)
                rank = m.files[c.file].rank
                if c.file not in fds:
                    try:
                        f = d.open(c.file, what="data file", fqn=fqn, rank=rank)
                    except FileNotFoundError:
                        raise CorruptCheckpointError(
                            "data file is missing", path=fpath, fqn=fqn, rank=rank
                        ) from None
                    fds[c.file], sizes[c.file] = f, f.size
                check_chunk_within(c, sizes[c.file], fpath, fqn, rank)
        need = sum(
            _volume(t.shape) * element_size(dtype_from_name(t.dtype, path=path, fqn=fqn))
            for fqn, t in m.tensors.items()
        )
        held = sum(sizes.values())
        if need > held:
            raise CorruptCheckpointError(
                f"the manifest's tensors need {need} bytes unsharded but the data files "
                f"hold {held}; refusing to allocate them",
                path=path,
            )
    except BaseException:
        for fd in fds.values():
            fd.close()
        raise
    return fds


def _read_flat(loc: Location, progress: bool) -> tuple[Flat, Manifest]:
    with CheckpointDir(loc) as d:
        return _read_flat_from(d, progress)


def _read_flat_from(d: CheckpointDir, progress: bool) -> tuple[Flat, Manifest]:
    path = d.url
    require_committed(d.location, backend=d.backend)
    m = read_manifest(d)
    flat: Flat = {}
    fds = _open_data_files(d, m)
    try:
        with byte_progress(m.total_tensor_bytes(), "read", progress) as bar:
            for fqn, t in sorted(m.tensors.items()):
                dtype = dtype_from_name(t.dtype, path=path, fqn=fqn)
                covered = sum(_volume(c.sizes) for c in t.chunks)
                # Zero only what no chunk will fill (FORMAT.md: chunks SHOULD cover).
                full = (
                    torch.empty(t.shape, dtype=dtype)
                    if covered == _volume(t.shape)
                    else torch.zeros(t.shape, dtype=dtype)
                )
                for c in t.chunks:
                    fpath = d.member_url(c.file)
                    whole = tuple(c.sizes) == tuple(t.shape)
                    buf = full if whole else torch.empty(c.sizes, dtype=dtype)
                    view = byte_view(buf)
                    if len(view) != c.length:
                        raise CorruptCheckpointError(
                            f"chunk length {c.length} does not match its sizes {list(c.sizes)} "
                            f"of {t.dtype} ({len(view)} bytes)",
                            path=fpath,
                            fqn=fqn,
                            rank=m.files[c.file].rank,
                        )
                    read_chunk_into(
                        fds[c.file], view, c, path=fpath, fqn=fqn, rank=m.files[c.file].rank
                    )
                    if not whole:
                        box = full
                        for dim, (o, s) in enumerate(zip(c.offsets, c.sizes, strict=True)):
                            box = box.narrow(dim, o, s)
                        box.copy_(buf)
                    bar.update(c.length)
                flat[fqn] = (t.path or (fqn,), full)
    finally:
        for fd in fds.values():
            fd.close()
    for fqn, o in sorted(m.objects.items()):
        flat[fqn] = (o.path or (fqn,), objcodec.decode(o.value, fqn=fqn, path=path))
    return flat, m


def _volume(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _write_torch(flat: Flat, m: Manifest, tmp: str) -> None:
    torch.save(_nest(flat), tmp)
    fsync_path(tmp)


def _write_dcp(flat: Flat, m: Manifest, tmp: str) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        # single-process by design; DCP warns about that on every call
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(_nest(flat), checkpoint_id=tmp, no_dist=True)


def _write_safetensors(flat: Flat, m: Manifest, tmp: str) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    raw: dict[str, Any] = {}
    for fqn in m.tensors:
        value = flat[fqn][1]
        if safetensors_code(value.dtype) is None:
            raw[fqn] = {"dtype": m.tensors[fqn].dtype, "shape": list(value.shape)}
            value = value.reshape(-1).view(torch.uint8)
        tensors[fqn] = value
    compact = {"separators": (",", ":"), "sort_keys": True}
    meta = {
        "format": "pt",
        "quicksave.format_version": str(FORMAT_VERSION),
        "quicksave.objects": json.dumps(
            {
                fqn: {"value": o.value, **({"path": list(o.path)} if o.path else {})}
                for fqn, o in m.objects.items()
            },
            **compact,
        ),
        "quicksave.paths": json.dumps(
            {fqn: list(t.path) for fqn, t in m.tensors.items() if t.path}, **compact
        ),
        "quicksave.user_metadata": json.dumps(m.user_metadata, **compact),
    }
    if m.step is not None:
        meta["quicksave.step"] = str(m.step)
    if raw:
        meta["quicksave.raw_dtypes"] = json.dumps(raw, **compact)
    save_file(tensors, tmp, metadata=meta)
    fsync_path(tmp)


_WRITERS = {"torch": _write_torch, "dcp": _write_dcp, "safetensors": _write_safetensors}


def _publish(tmp: str, out: str) -> None:
    """Rename ``tmp`` to ``out`` without ever replacing an existing ``out``."""
    if os.path.isdir(tmp):
        if os.path.lexists(out):  # rename() would replace an empty directory
            raise CheckpointExistsError(
                "output appeared while converting; not overwritten", path=out
            )
        os.rename(tmp, out)
    else:
        try:
            os.link(tmp, out)  # fails if ``out`` exists: no window where it is replaced
        except FileExistsError:
            raise CheckpointExistsError(
                "output appeared while converting; not overwritten", path=out
            ) from None
        except OSError:  # filesystems without hard links
            if os.path.lexists(out):
                raise CheckpointExistsError(
                    "output appeared while converting; not overwritten", path=out
                ) from None
            os.rename(tmp, out)
        else:
            os.unlink(tmp)
    fsync_path(os.path.dirname(out))


def convert(
    checkpoint: str | os.PathLike[str] | Location,
    out: str | os.PathLike[str] | Location,
    to: Target,
    *,
    progress: bool = False,
    storage: StorageOptions | None = None,
) -> str:
    """Write the quicksave checkpoint ``checkpoint`` in another format at ``out``.

    Args:
        checkpoint: a committed quicksave checkpoint: a path, or a ``file://``, ``s3://``
            or ``msc://`` URL.
        out: the file (``torch``, ``safetensors``) or directory (``dcp``, ``quicksave``)
            to create; it must not exist. Missing parent directories are created.
            ``torch``, ``safetensors`` and ``quicksave`` outputs may be object-store
            URLs too (a file is uploaded as one object once whole; a quicksave copy
            commits manifest-last): ``convert`` copies checkpoints between local disks
            and object stores.
        to: ``"torch"`` (one ``torch.save`` file of the nested state dict), ``"dcp"`` (a
            directory that stock ``torch.distributed.checkpoint.load`` reads with its
            default reader) or ``"safetensors"`` (one consolidated file, flat fqn keys;
            see the module docstring for its metadata), or ``"quicksave"`` (a copy in
            the quicksave format, same step and user metadata, e.g. to or from S3).
        progress: show a progress bar while reading, on stderr.

    Returns:
        The absolute path written.

    Raises:
        CheckpointExistsError: ``out`` already exists.
        CheckpointNotFoundError, NotCommittedError, CorruptCheckpointError: the input
            is not a readable committed quicksave checkpoint.
        CheckpointError: writing the output failed (nothing is left at ``out``).

    Example::

        convert("ckpt/step-100", "model.safetensors", "safetensors")
    """
    if to not in TARGETS:
        raise CheckpointError(
            f"unknown conversion target {to!r}; choose one of {', '.join(TARGETS)}"
        )
    src = parse_location(checkpoint, options=storage)
    dst = parse_location(out, options=storage)
    if to == "quicksave":
        from .api import save

        flat, m = _read_flat(src, progress)
        save(
            _nest(flat),
            dst,
            step=m.step,
            user_metadata=dict(m.user_metadata),
            storage=storage,
        )
        return dst.url
    if not dst.is_local:
        return _convert_to_store(src, dst, to, progress)
    out = dst.key
    if os.path.lexists(out):
        raise CheckpointExistsError(
            "output already exists; quicksave convert never overwrites (choose another path "
            "or delete it first)",
            path=out,
        )
    flat, m = _read_flat(src, progress)
    tmp = temp_path_for(out, new_token())
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        _WRITERS[to](flat, m, tmp)
        _publish(tmp, out)
    except OSError as e:
        raise CheckpointError(f"cannot write the converted checkpoint: {e}", path=out) from e
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        elif os.path.lexists(tmp):
            os.unlink(tmp)
    return out


def _convert_to_store(src: Location, dst: Location, to: str, progress: bool) -> str:
    """``torch`` / ``safetensors`` output to an object store: written to a local
    temporary file, then uploaded as one object (it appears whole or not at all)."""
    import mmap
    import tempfile

    if to == "dcp":
        raise CheckpointError(
            "a dcp output must be a local directory (or convert --to quicksave, which "
            "stock DCP readers such as MSC's also load)",
            path=dst.url,
        )
    backend = dst.open()
    try:
        if backend.stat(dst.key) is not None or backend.children(dst.key):
            raise CheckpointExistsError(
                "output already exists; quicksave convert never overwrites", path=dst.url
            )
        flat, m = _read_flat(src, progress)
        with tempfile.TemporaryDirectory(prefix="quicksave-convert-") as tmpdir:
            tmp = os.path.join(tmpdir, "out")
            _WRITERS[to](flat, m, tmp)
            with open(tmp, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    backend.put(dst.key, memoryview(b""))
                else:
                    with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mm:
                        view = memoryview(mm)
                        try:
                            backend.put(dst.key, view)
                        finally:
                            view.release()
    finally:
        backend.close()
    return dst.url
