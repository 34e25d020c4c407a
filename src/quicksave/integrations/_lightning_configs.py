"""OmegaConf configs in a Lightning checkpoint, stored without pickle.

Lightning puts a module's hyper-parameters in the checkpoint as they are: a
``DictConfig`` or ``ListConfig`` (an argument of ``__init__``, or the whole
``save_hyperparameters(cfg)``, when Lightning also records its class as
``hparams_type``). quicksave stores values as typed JSON, which knows dicts and lists,
not OmegaConf's classes. So before a save every config becomes its plain container
(``OmegaConf.to_container(resolve=False)``: interpolations stay ``${...}`` strings,
missing values ``???``) and its place is recorded under :data:`CONFIGS_KEY`, with its
``struct`` and ``readonly`` flags; ``hparams_type`` becomes the class's name. After a
load, each recorded place gets its config back (``OmegaConf.create``) and
``hparams_type`` its class: ``cfg.optim.lr`` works as it did when saved. A value
OmegaConf cannot turn into a container (an enum, a path) is refused by the save, naming
its key.

omegaconf is imported only where a checkpoint holds a config (the user's code imported
it to make one).

The order of dict keys is the other thing typed storage loses: a checkpoint's entries
come back in name order. Lightning users (and Lightning's own tests) expect the module's
``state_dict`` and the other dicts in the order they were saved, so
:func:`encode_order` records the keys of every dict whose order is not the one a load
gives back, under :data:`ORDER_KEY`, and :func:`decode_order` restores it.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Mapping
from typing import Any

from quicksave.errors import CheckpointError

# Top-level key of the stored dict that records where configs were (never in
# Lightning's own dict: it is removed again on load).
CONFIGS_KEY = "quicksave_omegaconf"
_KINDS = ("DictConfig", "ListConfig")
_TYPE_KEYS = ("hparams_type", "datamodule_hparams_type")


def _omegaconf() -> Any | None:
    """The omegaconf module if the process imported it (no config exists otherwise)."""
    return sys.modules.get("omegaconf")


def encode_configs(checkpoint: Mapping[str, Any]) -> Mapping[str, Any]:
    """``checkpoint`` with every OmegaConf config replaced by its plain container and
    recorded under :data:`CONFIGS_KEY` (``checkpoint`` itself if it holds none; else a
    copy of the dicts and lists on the way to a config, the rest shared)."""
    oc = _omegaconf()
    if oc is None:
        return checkpoint
    records: list[dict[str, Any]] = []

    def walk(value: Any, where: list[Any]) -> Any:
        kind = next((k for k in _KINDS if isinstance(value, getattr(oc, k))), None)
        if kind is not None:
            records.append(
                {
                    "path": list(where),
                    "kind": kind,
                    "struct": bool(oc.OmegaConf.is_struct(value)),
                    "readonly": bool(oc.OmegaConf.is_readonly(value)),
                }
            )
            return oc.OmegaConf.to_container(value, resolve=False)
        if isinstance(value, (dict, list)):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            changed = {}
            for k, v in items:
                new = walk(v, [*where, k])
                if new is not v:
                    changed[k] = new
            if not changed:
                return value
            out = copy.copy(value)  # its own type (OrderedDict, AttributeDict...)
            for k, v in changed.items():
                out[k] = v
            return out
        return value

    top = dict(checkpoint)
    for key in list(top):
        if key in _TYPE_KEYS and isinstance(top[key], type):
            cls = top[key]
            if cls in tuple(getattr(oc, k) for k in _KINDS):
                records.append({"path": [key], "kind": "type:" + cls.__name__})
                top[key] = cls.__name__
            continue
        top[key] = walk(top[key], [key])
    if not records:
        return checkpoint
    top[CONFIGS_KEY] = records
    return top


def decode_configs(checkpoint: dict[str, Any], path: str) -> dict[str, Any]:
    """Give back the configs :func:`encode_configs` recorded (in place).

    Raises:
        CheckpointError: the checkpoint holds configs and omegaconf is not installed,
            or a record does not match the checkpoint (naming ``path``).
    """
    records = checkpoint.pop(CONFIGS_KEY, None)
    if not records:
        return checkpoint
    try:
        import omegaconf as oc
    except ImportError:
        raise CheckpointError(
            "this Lightning checkpoint holds OmegaConf configs (hyper-parameters): "
            "pip install omegaconf to load it",
            path=path,
        ) from None
    for record in records:
        *parents, last = record["path"]
        node: Any = checkpoint
        try:
            for k in parents:
                node = node[k]
            kind = record["kind"]
            if kind.startswith("type:"):
                node[last] = getattr(oc, kind[len("type:") :])
                continue
            config = oc.OmegaConf.create(node[last])
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"the record of an OmegaConf config at {record['path']} does not match "
                f"the checkpoint ({type(e).__name__}: {e})",
                path=path,
            ) from None
        if kind != type(config).__name__:
            raise CheckpointError(
                f"the OmegaConf config at {record['path']} was a {kind}, its stored "
                f"value makes a {type(config).__name__}",
                path=path,
            )
        if record.get("struct"):
            oc.OmegaConf.set_struct(config, True)
        if record.get("readonly"):
            oc.OmegaConf.set_readonly(config, True)
        node[last] = config
    return checkpoint


# Top-level key that records the saved order of dict keys (removed again on load).
ORDER_KEY = "quicksave_key_order"


def encode_order(checkpoint: Mapping[str, Any]) -> Mapping[str, Any]:
    """``checkpoint`` with the key order of its dicts recorded under :data:`ORDER_KEY`
    (a copy of the top level; only dicts of two keys or more not already in sorted
    order are recorded)."""
    records: list[dict[str, Any]] = []

    def walk(value: Any, where: list[Any]) -> None:
        if isinstance(value, dict):
            keys = list(value)
            plain = all(type(k) in (str, int) for k in keys)  # what a value can hold
            if plain and len(keys) > 1 and keys != sorted(keys, key=str):
                records.append({"path": list(where), "keys": keys})
            for k, v in value.items():
                walk(v, [*where, k])
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, [*where, i])

    walk(dict(checkpoint), [])
    if not records:
        return checkpoint
    top = dict(checkpoint)
    top[ORDER_KEY] = records
    return top


def decode_order(checkpoint: dict[str, Any], path: str) -> dict[str, Any]:
    """Put the dicts :func:`encode_order` recorded back in their saved order (the top
    level included: a new dict is returned).

    Raises:
        CheckpointError: a record does not match the checkpoint (naming ``path``).
    """
    records = checkpoint.pop(ORDER_KEY, None)
    if not records:
        return checkpoint
    top_keys: list[Any] | None = None
    for record in sorted(records, key=lambda r: -len(r["path"])):  # innermost first
        where, keys = record["path"], record["keys"]
        if not where:
            top_keys = keys
            continue
        *parents, last = where
        node: Any = checkpoint
        try:
            for k in parents:
                node = node[k]
            old = node[last]
            if set(old) != set(keys):
                raise KeyError(f"keys {sorted(map(str, set(old) ^ set(keys)))} differ")
            new = copy.copy(old)  # its own type (OrderedDict, AttributeDict...)
            new.clear()
            for k in keys:
                new[k] = old[k]
            node[last] = new
        except (KeyError, IndexError, TypeError) as e:
            raise CheckpointError(
                f"the recorded key order of the dict at {where} does not match the "
                f"checkpoint ({type(e).__name__}: {e})",
                path=path,
            ) from None
    if top_keys is None:
        return checkpoint
    if set(checkpoint) != set(top_keys):
        raise CheckpointError(
            "the recorded key order of the checkpoint's top level does not match it",
            path=path,
        )
    return {k: checkpoint[k] for k in top_keys}
