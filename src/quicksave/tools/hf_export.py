"""Hugging Face export: the model of a quicksave checkpoint as a directory that
``transformers``' ``from_pretrained`` loads (``quicksave convert --to hf``).

What is written is what ``save_pretrained`` writes (:mod:`quicksave.format.hf_layout`):
``model.safetensors``, or shards of at most ``max_shard_bytes`` and their
``model.safetensors.index.json``; ``config.json`` if a ``config`` is given.

The keys are the model's own (``transformer.wte.weight``): the state that holds the
model is chosen (:func:`select_model`) and its name is not part of them; optimizer,
RNG, data-loader and every other state are never read. Of keys that were one tensor
when the checkpoint was saved (tied weights, recorded by the manager: see
:mod:`quicksave.saving.model_record`) only the first is written, as ``save_pretrained`` does;
``from_pretrained`` ties the others to it again. A checkpoint without that record
(written by ``quicksave.save``) keeps every key: ``from_pretrained`` loads the
duplicates and ties them all the same.

Order of work: read the manifest → choose the model state → read its tensors only
(checksummed) → drop tied duplicates → cast → plan shards → write them into a
temporary directory → publish. A local output appears by one rename (never over an
existing path); an object-store output is uploaded file by file with the index (or the
single ``model.safetensors``) last, so a reader that finds it finds every shard.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from quicksave.commit import open_strategy
from quicksave.commit.files import fsync_path
from quicksave.errors import CheckpointError
from quicksave.format.dtypes import safetensors_code
from quicksave.format.hf_layout import (
    CONFIG_NAME,
    DEFAULT_MAX_SHARD_BYTES,
    INDEX_NAME,
    SHARD_METADATA,
    index_doc,
    plan_shards,
    shard_names,
)
from quicksave.format.keys import real_key
from quicksave.format.manifest import Manifest
from quicksave.saving.model_record import (
    MODEL_STATES_KEY,
    TIED_WEIGHTS_KEY,
    cast_floating,
    floating_dtype,
)
from quicksave.storage import Location, StorageOptions, parse_location
from quicksave.tools.read_full import Flat, read_flat

logger = logging.getLogger("quicksave")


@dataclass(frozen=True)
class ModelSelection:
    """The model state chosen in a checkpoint: its ``name`` (None: the checkpoint is
    one flat model state dict) and Hugging Face key -> fqn of each of its tensors, in
    the manifest's order; ``skipped``: fqns of its non-tensor values (not exported)."""

    name: str | None
    keys: dict[str, str]
    skipped: tuple[str, ...] = ()


def export_hf(
    checkpoint: str | os.PathLike[str] | Location,
    out_dir: str | os.PathLike[str] | Location,
    *,
    state: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    config: Mapping[str, Any] | Any | None = None,
    storage: StorageOptions | None = None,
    progress: bool = False,
) -> str:
    """Write the model of a quicksave checkpoint as a Hugging Face model directory.

    Args:
        checkpoint: a committed quicksave checkpoint (a full ``step-<N>``, a seed, or an
            ``export-step-<N>``): a path or a ``file://``, ``s3://`` or ``msc://`` URL.
        out_dir: the directory to create (a path or an object-store URL); it must not
            exist. ``from_pretrained(out_dir)`` loads it (with a ``config.json``: see
            ``config``).
        state: the name of the state that holds the model. Default: the one the
            manager recorded (its ``ModelState``, or the state named ``"model"``); for
            checkpoints without that record, ``"model"``, the only state of an export,
            or the whole checkpoint when it is one flat state dict of tensors.
        dtype: cast floating tensors to this dtype (``"bfloat16"``, ``torch.float16``,
            ...); None keeps the stored dtypes. Other tensors are written as stored.
        max_shard_bytes: the most tensor bytes in one shard (a larger tensor gets a
            shard of its own); everything in one shard gives ``model.safetensors`` and
            no index.
        config: a model config to write as ``config.json``: a mapping, an object with
            ``to_dict()`` such as a ``transformers`` ``PretrainedConfig``, or the path of
            a JSON file or of a directory holding ``config.json`` (as ``--config``); its
            ``dtype`` is set to the exported weights' floating dtype. Without one,
            copy a ``config.json`` in yourself: ``transformers`` 5 looks for it to build
            a generative model's generation config, even given ``config=``.
        storage: how to reach an object store (input and output).
        progress: show a progress bar over the bytes read, on stderr.

    Returns:
        The path or URL of the directory written.

    Raises:
        CheckpointExistsError: ``out_dir`` exists.
        CheckpointError: no model state, or several and ``state`` not given (the message
            lists the candidates), a bad ``dtype`` or ``max_shard_bytes``, a tensor
            dtype safetensors cannot hold, or the output cannot be written (nothing is
            left at ``out_dir``).
        CheckpointNotFoundError, NotCommittedError, CorruptCheckpointError: the input
            is not a readable committed quicksave checkpoint.

    Example::

        quicksave.export_hf("ckpt/step-1000", "gpt2-hf", dtype="bfloat16",
                            config=model.config)
        model = GPT2LMHeadModel.from_pretrained("gpt2-hf")
    """
    cast = None if dtype is None else floating_dtype(dtype, "the export dtype")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int):
        raise CheckpointError(f"max_shard_bytes must be an int, got {max_shard_bytes!r}")
    if max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    src = parse_location(checkpoint, options=storage)
    dst = parse_location(out_dir, options=storage)
    conf = _config_dict(config)
    with open_strategy(dst) as out:
        out.check_free(dst)  # before reading anything
        chosen: list[ModelSelection] = []

        def select(m: Manifest) -> list[str]:
            chosen.append(select_model(m, state, src.url))
            return list(chosen[0].keys.values())

        flat, m = read_flat(src, progress, select)
        tensors = model_tensors(flat, m, chosen[0], cast, src.url)
        out.write_output(
            dst, lambda path: write_model_dir(tensors, path, max_shard_bytes, conf), "the export"
        )
    logger.info("quicksave: exported %d tensors of %s to %s", len(tensors), src.url, dst.url)
    if conf is None:
        logger.warning(
            "quicksave: %s has no config.json (pass config=): from_pretrained needs one "
            "there for a generative model, even with config= of its own",
            dst.url,
        )
    return dst.url


def select_model(m: Manifest, state: str | None, where: str) -> ModelSelection:
    """The model state of the checkpoint whose manifest is ``m`` (``state``: see
    :func:`export_hf`); ``where`` names the checkpoint in errors.

    Raises:
        CheckpointError: ``state`` is not a state with tensors, or no state (or several)
            can be taken as the model; the message lists the candidates.
    """
    nested: dict[str, dict[str, str]] = {}  # state name -> HF key -> fqn
    flat_keys: dict[str, str] = {}  # top-level tensors: the checkpoint is one state dict
    values: dict[str, list[str]] = {}  # state name -> fqns of its non-tensor values
    for fqn, t in m.tensors.items():
        path = t.path or (fqn,)
        if len(path) == 1:
            flat_keys[str(real_key(path[0]))] = fqn
            continue
        keys = nested.setdefault(str(real_key(path[0])), {})
        key = ".".join(str(real_key(p)) for p in path[1:])
        if key in keys:
            raise CheckpointError(
                f"two tensors of state {str(real_key(path[0]))!r} give the key {key!r}",
                path=where,
                fqn=fqn,
            )
        keys[key] = fqn
    for fqn, o in m.objects.items():
        path = o.path or (fqn,)
        values.setdefault(str(real_key(path[0])) if len(path) > 1 else "", []).append(fqn)
    candidates = ", ".join(repr(n) for n in sorted(nested)) or "none"
    how = "choose one with state=NAME (quicksave convert --to hf --state NAME)"
    if state is not None:
        if state not in nested:
            raise CheckpointError(
                f"no model state {state!r} with tensors in this checkpoint; its states "
                f"with tensors: {candidates}",
                path=where,
            )
        name: str | None = state
    else:
        name = _default_state(m, nested, bool(flat_keys), where, candidates, how)
    if name is None:
        return ModelSelection(None, flat_keys, tuple(values.get("", ())))
    return ModelSelection(name, nested[name], tuple(values.get(name, ())))


def _default_state(
    m: Manifest,
    nested: Mapping[str, Any],
    flat: bool,
    where: str,
    candidates: str,
    how: str,
) -> str | None:
    recorded = m.user_metadata.get(MODEL_STATES_KEY)
    if isinstance(recorded, list) and recorded:
        names = [str(n) for n in recorded]
        if len(names) > 1:
            raise CheckpointError(
                f"this checkpoint holds several model states ({', '.join(map(repr, names))}); "
                f"{how}",
                path=where,
            )
        if names[0] in nested:
            return names[0]
        raise CheckpointError(
            f"the model state {names[0]!r} recorded by the manager has no tensors here; "
            f"states with tensors: {candidates}",
            path=where,
        )
    if "model" in nested:
        return "model"
    if len(nested) == 1 and m.user_metadata.get("checkpoint_kind") in ("export", "seed"):
        return next(iter(nested))
    if not nested and flat:
        return None  # one flat state dict of tensors (quicksave.save(model.state_dict()))
    if not nested:
        raise CheckpointError("this checkpoint holds no tensors: no model to export", path=where)
    raise CheckpointError(
        f"cannot tell which state holds the model: no state is named 'model' and the "
        f"checkpoint does not record its model state; states with tensors: {candidates}; "
        f"{how}",
        path=where,
    )


def model_tensors(
    flat: Flat, m: Manifest, sel: ModelSelection, dtype: torch.dtype | None, where: str
) -> dict[str, torch.Tensor]:
    """Hugging Face key -> tensor of the selected model: tied duplicates (as recorded in
    ``m``) dropped where their bytes equal the first key's, cast to ``dtype``."""
    if sel.skipped:
        logger.warning(
            "quicksave: the model state's non-tensor values are not exported: %s",
            ", ".join(sel.skipped),
        )
    tensors = {key: flat[fqn][1] for key, fqn in sel.keys.items()}
    tied = m.user_metadata.get(TIED_WEIGHTS_KEY, {})
    groups = tied.get(sel.name, []) if isinstance(tied, dict) and sel.name is not None else []
    for group in groups:
        present = [k for k in group if k in tensors]
        for key in present[1:]:
            if _same_bytes(tensors[present[0]], tensors[key]):
                del tensors[key]
            else:
                logger.warning(
                    "quicksave: %s and %s were one tensor when saved but differ now; both "
                    "are exported",
                    present[0],
                    key,
                )
    for key, t in tensors.items():
        if safetensors_code(t.dtype) is None:
            raise CheckpointError(
                f"safetensors cannot hold a {t.dtype} tensor; Hugging Face models do not "
                "have one: choose the model state with state=NAME",
                path=where,
                fqn=sel.keys[key],
            )
    return tensors if dtype is None else cast_floating(tensors, dtype)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def write_model_dir(
    tensors: Mapping[str, torch.Tensor],
    directory: str,
    max_shard_bytes: int,
    config: dict[str, Any] | None = None,
) -> list[str]:
    """Write ``tensors`` (and ``config``) into ``directory`` (created if missing), each
    file fsynced. Returns the names written, the index (or the single weights file)
    last: the order to publish them in."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    names = shard_names(len(shards))
    for name, keys in zip(names, shards, strict=True):
        target = os.path.join(directory, name)
        save_file({k: tensors[k].contiguous() for k in keys}, target, metadata=SHARD_METADATA)
        fsync_path(target)
    written = list(names)
    if config is not None:
        floating = {t.dtype for t in tensors.values() if t.is_floating_point()}
        if len(floating) == 1:
            name = str(floating.pop()).removeprefix("torch.")
            config["dtype"] = name
            if "torch_dtype" in config:  # transformers before 5 reads this one
                config["torch_dtype"] = name
        _write_json(os.path.join(directory, CONFIG_NAME), config)
        written.insert(0, CONFIG_NAME)
    if len(shards) > 1:
        count = sum(t.numel() for t in tensors.values())
        _write_json(os.path.join(directory, INDEX_NAME), index_doc(shards, names, sizes, count))
        written.append(INDEX_NAME)
    fsync_path(directory)
    return written


def _config_dict(config: Mapping[str, Any] | Any | None) -> dict[str, Any] | None:
    """``export_hf``'s ``config`` (and the CLI's ``--config``) as a JSON-able dict: a
    mapping, an object with ``to_dict()``, or the path of a JSON file or of a directory
    holding ``config.json`` (a model directory)."""
    if config is None:
        return None
    if isinstance(config, (str, os.PathLike)):
        return _read_config(os.fspath(config))
    if isinstance(config, Mapping):
        return json.loads(json.dumps(dict(config)))  # a copy, and JSON-able or an error
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        raise CheckpointError(
            f"config must be a mapping, have to_dict() (a transformers config) or be the "
            f"path of a config.json (or of its directory), got {type(config).__name__}"
        )
    return json.loads(json.dumps(to_dict()))


def _read_config(path: str) -> dict[str, Any]:
    file = os.path.join(path, CONFIG_NAME) if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read the config: {e}", path=file) from None
    if not isinstance(doc, dict):
        raise CheckpointError(
            f"the config is a JSON {type(doc).__name__}, not an object", path=file
        )
    return doc


def _write_json(path: str, doc: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
