"""What DCP's flattening loses, recorded at save time so that a load without a template
gives back the structure that was saved (``quicksave.load_state``, ``convert``).

- **Key types.** DCP names nested values by ``str(key)``; the paths :func:`structure`
  returns have a :class:`~.format.keys.DictKey` for each non-string key instead.
- **Empty dicts.** A dict with nothing in it has no leaf, so DCP drops it (an
  optimizer's ``"state": {}`` before its first step, a loop's empty ``state_dict``);
  :func:`structure` lists their paths.

One walk of the state dict, as DCP's ``traverse_state_dict`` walks it (dicts always;
lists only when they hold tensors, dicts or such lists; tuples never), so every leaf
gets the fqn DCP gives it. It runs on every save: one pass, no lookups per fqn.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from quicksave.errors import IncompatibleStateError
from quicksave.format.keys import DictKey

Path = tuple[Any, ...]


def structure(
    nested: Mapping[str, Any], mappings: Mapping[str, Path]
) -> tuple[dict[str, Path], list[Path]]:
    """The typed paths and the empty dicts of ``nested``.

    Args:
        nested: the state dict (``Stateful`` values already turned into state dicts).
        mappings: fqn -> DCP path, as ``flatten_state_dict`` returned them for it.

    Returns:
        ``(paths, empty)``: ``mappings`` with each string element that stood for a
        non-string dict key replaced by its :class:`DictKey` (paths without one are
        DCP's own), and the paths of the empty dicts.
    """
    typed: dict[str, Path] = {}
    empty: list[Path] = []

    def walk(path: Path, value: Any, has_typed: bool) -> None:
        if isinstance(value, Mapping):
            if not value:
                empty.append(path)
            for k, v in value.items():
                element = _element(k)
                walk(path + (element,), v, has_typed or isinstance(element, DictKey))
        elif isinstance(value, list) and not _terminal(value):
            for i, v in enumerate(value):
                walk(path + (i,), v, has_typed)
        elif has_typed:
            typed[".".join(map(str, path))] = path

    for key, value in nested.items():
        element = _element(key)
        walk((element,), value, isinstance(element, DictKey))
    return {fqn: typed.get(fqn, path) for fqn, path in mappings.items()}, empty


DUPLICATE_FQN = (
    "two values get this name (dict keys whose str() is the same, e.g. 0 and '0', are "
    "named alike when the state dict is flattened); rename one"
)


def flatten_with_paths(
    nested: Mapping[str, Any], rank: int | None = None
) -> tuple[dict[str, Any], dict[str, Path], list[Path]]:
    """DCP's ``flatten_state_dict`` and :func:`structure` in one walk of ``nested``: the
    one flattening of every save path (``rank_plans.collect_local``).

    Returns:
        ``(flat, paths, empty)``: fqn -> leaf, exactly as ``flatten_state_dict`` gives
        them (same fqns, same order); fqn -> its path as :func:`structure` gives it
        (typed where a key is not a ``str``, else DCP's own); the empty dicts' paths.

    Raises:
        IncompatibleStateError: two leaves get one fqn (where DCP raises ``duplicated
            flatten key <fqn>``); names the fqn and ``rank``.
    """
    flat: dict[str, Any] = {}
    paths: dict[str, Path] = {}
    empty: list[Path] = []

    def walk(names: tuple, path: Path, value: Any, has_typed: bool) -> None:
        # ``names``: DCP's path (``str(key)`` per key, list indices); ``path``: the
        # typed one, taken where it holds a DictKey (as structure() does)
        if isinstance(value, Mapping):
            if not value:
                empty.append(path)
            for k, v in value.items():
                if type(k) is str:
                    walk(names + (k,), path + (k,), v, has_typed)
                else:
                    element = _element(k)
                    typed = has_typed or isinstance(element, DictKey)
                    walk(names + (str(k),), path + (element,), v, typed)
        elif isinstance(value, list) and not _terminal(value):
            for i, v in enumerate(value):
                walk(names + (i,), path + (i,), v, has_typed)
        else:
            fqn = ".".join(map(str, names))
            if fqn in flat:
                raise IncompatibleStateError(DUPLICATE_FQN, fqn=fqn, rank=rank)
            flat[fqn] = value
            paths[fqn] = path if has_typed else names

    for key, value in nested.items():
        element = _element(key)
        walk((str(key),), (element,), value, isinstance(element, DictKey))
    return flat, paths, empty


def _element(key: Any) -> Any:
    """A dict key as a path element: a ``str`` as it is, a kept type as its
    :class:`DictKey`, any other key as its ``str()`` (as DCP names it)."""
    if isinstance(key, str):
        return key
    typed = DictKey.of(key)
    return typed if typed is not None else str(key)


def _terminal(value: list[Any]) -> bool:
    """DCP's rule: a list is one value unless it holds a tensor, a dict, or such a list."""
    for entry in value:
        if isinstance(entry, (torch.Tensor, Mapping)):
            return False
        if isinstance(entry, list) and not _terminal(entry):
            return False
    return True


def walked(value: Any) -> bool:
    """Whether the flattening walks into ``value`` (a mapping, or a list that holds a
    tensor, a mapping or such a list) rather than keeping it as one leaf."""
    return isinstance(value, Mapping) or (isinstance(value, list) and not _terminal(value))
