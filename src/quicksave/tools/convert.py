"""Convert: rewrite a quicksave checkpoint as one ``torch.save`` file, a stock DCP
directory, or one consolidated safetensors file (``quicksave convert``); ``--to hf``
(the model only, for Hugging Face) is :mod:`quicksave.tools.hf_export`, over the reading here.

The full (unsharded) state is rebuilt in host memory: one tensor per manifest entry
with its global shape and dtype, every stored chunk read straight into its box (and its
xxh3-64 checked), every object decoded from typed JSON (never unpickled), and the nested
structure restored from each entry's ``path`` and ``key_types`` and the manifest's
``empty_dicts`` (FORMAT.md §2.1): dict keys come back with the types they were saved
with (``int``, ``bool``, ``None``, ``float``, ``str``; any other key type as its
``str()``), path elements that are integers are list indices, and empty dicts are
there. Checkpoints written before quicksave recorded key types give non-string keys
back as strings.

Outputs appear atomically: they are written to a hidden temporary next to ``out``
(docs/FORMAT.md §6), fsynced, then renamed; an existing ``out`` is never overwritten.

safetensors output: tensor keys are the flat fqns. ``__metadata__`` holds JSON strings:
``quicksave.objects`` (fqn -> ``{"value": typed JSON, "path": [...]}``, decodable with
``quicksave.format.objects.decode``), ``quicksave.paths`` (tensor fqn -> nested path,
where it differs from ``[fqn]``), ``quicksave.key_types`` (fqn -> the entry's
``key_types``, where it has them), ``quicksave.empty_dicts`` (the manifest's
``empty_dicts``), ``quicksave.step`` and ``quicksave.user_metadata``;
:func:`load_state` reads such a file back into the nested state.
A dtype that safetensors cannot describe (e.g. ``complex128``) is stored as its raw
little-endian bytes (``U8``, 1-D) and recorded in ``quicksave.raw_dtypes`` as
``{fqn: {"dtype": name, "shape": [...]}}``; ``t.view(dtype).reshape(shape)`` restores it.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import torch

from quicksave.commit import CheckpointKind, open_strategy
from quicksave.commit.files import fsync_path
from quicksave.errors import CheckpointError, CorruptCheckpointError
from quicksave.format import DCP_METADATA_NAME, FORMAT_VERSION
from quicksave.format import objects as objcodec
from quicksave.format.dtypes import dtype_from_name, safetensors_code
from quicksave.format.keys import key_types_of, real_key, typed_path
from quicksave.format.manifest import Manifest
from quicksave.loading.checkpoint import require_committed
from quicksave.storage import Location, StorageOptions, parse_location
from quicksave.tools.read_full import Flat, read_flat

Target = Literal["torch", "dcp", "safetensors", "quicksave", "hf"]
TARGETS: tuple[str, ...] = ("torch", "dcp", "safetensors", "quicksave", "hf")


def _nest(flat: Flat, empty: Sequence[tuple[Any, ...]] = ()) -> dict[str, Any]:
    """Rebuild the nested state from (path, value) pairs and the paths of empty dicts.

    Path elements that are plain ``int`` are list indices (DCP flattens lists that
    way; a dict's int keys are ``DictKey`` elements), so a node whose keys are exactly
    the ints ``0 .. n-1`` becomes a list."""
    root: dict[Any, Any] = {}

    def place(path: tuple[Any, ...], what: str) -> dict[Any, Any]:
        node = root
        for key in path[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise CorruptCheckpointError(
                    f"path {list(path)} conflicts with another entry", fqn=what
                )
            node = child
        return node

    for fqn, (path, value) in flat.items():
        place(path, fqn)[path[-1]] = value
    for path in empty:
        node = place(path, ".".join(map(str, path)))
        if not isinstance(node.setdefault(path[-1], {}), dict):
            raise CorruptCheckpointError(
                f"empty dict at {list(path)} conflicts with another entry",
                fqn=".".join(map(str, path)),
            )

    def build(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        keys = list(node)
        if keys and all(type(k) is int for k in keys) and sorted(keys) == list(range(len(keys))):
            return [build(node[i]) for i in range(len(keys))]
        return {real_key(k): build(v) for k, v in node.items()}

    return {real_key(k): build(v) for k, v in root.items()}


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
    flat, m = read_flat(parse_location(path), progress)
    return _nest(flat, m.empty_dicts), m


def load_state(
    path: str | os.PathLike[str],
    *,
    storage: StorageOptions | None = None,
    allow_dcp_pickle: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Load a whole checkpoint without a template: the nested state as it was saved.

    For frameworks that have no state dict to load into (a Lightning ``CheckpointIO``,
    an inference server, a conversion script). Tensors come back unsharded with their
    global shapes, on the CPU; dict keys with the types they were saved with (``int``,
    ``bool``, ``None``, ``float`` and ``str``; a key of any other type as its
    ``str()``, FORMAT.md §2.1); lists as lists, tuples as tuples, empty dicts as empty
    dicts; values decoded from typed JSON, never unpickled.

    Args:
        path: a committed quicksave checkpoint (either layout; a path or a ``file://``,
            ``s3://`` or ``msc://`` URL), a safetensors file written by ``quicksave
            convert --to safetensors``, or a stock DCP checkpoint (whose ``.metadata``
            records dict keys as strings only: they come back as strings).
        storage: how to reach an object store.
        allow_dcp_pickle: see :func:`quicksave.load` (stock DCP checkpoints only).
        progress: show a tqdm bar over bytes read, on stderr (quicksave checkpoints).

    Raises:
        CheckpointNotFoundError, NotCommittedError: nothing committed at ``path``.
        CorruptCheckpointError: a file is missing, truncated or fails its checksum.
        CheckpointError: ``path`` is a file that is not a quicksave safetensors file.

    Example::

        state = quicksave.load_state("ckpt/step-100")
        optimizer.load_state_dict(state["optimizer"])  # "state" keyed by int ids
    """
    loc = parse_location(path, options=storage)
    single = loc.local_file()
    if single is not None:
        return _load_safetensors_state(single)
    checkpoint = require_committed(loc, allow_dcp=True)
    if checkpoint.kind is CheckpointKind.DCP:
        return _load_dcp_state(loc, allow_dcp_pickle)
    flat, m = read_flat(checkpoint, progress)
    return _nest(flat, m.empty_dicts)


def _load_dcp_state(loc: Location, allow_pickle: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.utils import _DistWrapper

    from quicksave.loading import steps
    from quicksave.loading.dcp_stock import DCPReader, RestrictedObjectsMixin

    class Planner(RestrictedObjectsMixin, _EmptyStateDictLoadPlanner):
        pass

    planner = Planner()
    planner.allow_pickle, planner.path = allow_pickle, loc.url
    reader = DCPReader(loc, allow_pickle=allow_pickle)
    metadata = reader.read_metadata()  # a refused pickle fails here, naming the file
    state: dict[str, Any] = {}
    # This process alone, also inside a process group (the planner fills ``state``).
    alone = _DistWrapper(None, False, 0)
    local = steps.load_local_plan(state, metadata, planner, reader, alone)
    central = steps.exchange_load_plans(local, planner, reader, alone, loc.url)
    steps.read_all(central, planner, reader, alone, loc.url)
    return state


def _load_safetensors_state(path: str) -> dict[str, Any]:
    """A file of ``convert --to safetensors``: its tensors and ``__metadata__`` nested."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            if "quicksave.format_version" not in meta:
                raise CheckpointError(
                    "not a quicksave checkpoint, nor a safetensors file written by "
                    "'quicksave convert --to safetensors' (no quicksave metadata)",
                    path=path,
                )
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except CheckpointError:
        raise
    except Exception as e:  # safetensors' own errors: a file that is not safetensors
        raise CheckpointError(f"cannot read as a safetensors file: {e}", path=path) from None
    try:
        paths = json.loads(meta.get("quicksave.paths", "{}"))
        types = json.loads(meta.get("quicksave.key_types", "{}"))
        objects = json.loads(meta.get("quicksave.objects", "{}"))
        raw = json.loads(meta.get("quicksave.raw_dtypes", "{}"))
        empty = [
            typed_path(e["path"], e.get("key_types"))
            for e in json.loads(meta.get("quicksave.empty_dicts", "[]"))
        ]
        flat: Flat = {}
        for fqn, t in tensors.items():
            if fqn in raw:
                r = raw[fqn]
                t = t.view(dtype_from_name(r["dtype"], path=path, fqn=fqn)).reshape(r["shape"])
            flat[fqn] = (typed_path(paths.get(fqn, [fqn]), types.get(fqn)), t)
        for fqn, o in objects.items():
            value = objcodec.decode(o["value"], fqn=fqn, path=path)
            flat[fqn] = (typed_path(o.get("path", [fqn]), types.get(fqn)), value)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(f"bad quicksave metadata: {e}", path=path) from None
    return _nest(flat, empty)


def _write_torch(flat: Flat, m: Manifest, tmp: str) -> None:
    torch.save(_nest(flat, m.empty_dicts), tmp)
    fsync_path(tmp)


def _write_dcp(flat: Flat, m: Manifest, tmp: str) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        # single-process by design; DCP warns about that on every call
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(_nest(flat, m.empty_dicts), checkpoint_id=tmp, no_dist=True)


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
        "quicksave.key_types": json.dumps(
            {
                fqn: types
                for fqn, e in [*m.tensors.items(), *m.objects.items()]
                if e.path and (types := key_types_of(e.path)) is not None
            },
            **compact,
        ),
        "quicksave.empty_dicts": json.dumps(
            [{"path": list(p), "key_types": key_types_of(p)} for p in m.empty_dicts], **compact
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
            the quicksave format, same step and user metadata, e.g. to or from S3), or
            ``"hf"`` (the model only, as a Hugging Face ``from_pretrained`` directory:
            :func:`quicksave.export_hf` with its defaults; call it for its options).
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
    if to == "hf":
        from quicksave.tools.hf_export import export_hf

        return export_hf(checkpoint, out, progress=progress, storage=storage)
    src = parse_location(checkpoint, options=storage)
    dst = parse_location(out, options=storage)
    if to == "quicksave":
        from quicksave.api import save

        flat, m = read_flat(src, progress)
        save(
            _nest(flat),
            dst,
            step=m.step,
            user_metadata=dict(m.user_metadata),
            storage=storage,
        )
        return dst.url
    with open_strategy(dst) as out:
        out.check_free(dst)  # before reading anything
        flat, m = read_flat(src, progress)

        def build(path: str) -> list[str] | None:
            _WRITERS[to](flat, m, path)
            return _upload_order(path) if os.path.isdir(path) else None

        out.write_output(dst, build, "the converted checkpoint")
    return dst.url


def _upload_order(directory: str) -> list[str]:
    """The files of a directory output, the one that commits it last (DCP's
    ``.metadata``, which readers look for first)."""
    return sorted(sorted(os.listdir(directory)), key=lambda n: n == DCP_METADATA_NAME)
