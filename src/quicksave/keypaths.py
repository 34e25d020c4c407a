"""What DCP's flattening loses, recorded at save time so that a load without a template
gives back the structure that was saved (``quicksave.load_state``, ``convert``).

- **Key types.** DCP names nested values by ``str(key)``; :func:`typed_paths` turns its
  paths into paths whose non-string keys are :class:`~.format.keys.DictKey` elements.
- **Empty dicts.** A dict with nothing in it has no leaf, so DCP drops it (an
  optimizer's ``"state": {}`` before its first step, a loop's empty ``state_dict``);
  :func:`empty_dicts` lists their paths.

Both walk the state dict as DCP's ``traverse_state_dict`` does (dicts always; lists
only when they hold tensors, dicts or such lists; tuples never).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .format.keys import DictKey

Path = tuple[Any, ...]


def typed_paths(original: Mapping[str, Any], mappings: Mapping[str, Path]) -> dict[str, Path]:
    """``mappings`` (fqn -> DCP path, as ``flatten_state_dict`` returns it) with each
    string element that stood for a non-string dict key of ``original`` replaced by
    its :class:`DictKey`. Paths that need no change are returned as they are."""
    by_text: dict[int, dict[str, Any]] = {}  # id(dict) -> str(key) -> key, built once
    return {fqn: _typed(original, path, by_text) for fqn, path in mappings.items()}


def _typed(root: Any, path: Path, by_text: dict[int, dict[str, Any]]) -> Path:
    node = root
    elements: list[Any] | None = None
    for i, element in enumerate(path):
        if isinstance(node, Mapping):
            if element in node:  # a str key (DCP's element is the key itself)
                node = node[element]
                continue
            index = by_text.get(id(node))
            if index is None:
                index = by_text[id(node)] = {str(k): k for k in node if not isinstance(k, str)}
            if element not in index:
                return path if elements is None else tuple(elements)
            key = index[element]
            typed = DictKey.of(key)
            if typed is not None:
                if elements is None:
                    elements = list(path)
                elements[i] = typed
            node = node[key]
        elif isinstance(node, list) and isinstance(element, int) and element < len(node):
            node = node[element]
        else:
            break
    return path if elements is None else tuple(elements)


def empty_dicts(original: Mapping[str, Any]) -> list[Path]:
    """Paths (DCP-style, with :class:`DictKey` for non-string keys) of the empty dicts
    in ``original`` that DCP's flattening drops."""
    out: list[Path] = []
    for key, value in original.items():
        _walk(_element(key), value, out)
    return out


def _element(key: Any) -> Any:
    if isinstance(key, str):
        return key
    typed = DictKey.of(key)
    return typed if typed is not None else str(key)


def _walk(path: Path | Any, value: Any, out: list[Path]) -> None:
    if not isinstance(path, tuple):
        path = (path,)
    if isinstance(value, Mapping):
        if not value:
            out.append(path)
        for k, v in value.items():
            _walk(path + (_element(k),), v, out)
    elif isinstance(value, list) and not _terminal(value):
        for i, v in enumerate(value):
            _walk(path + (i,), v, out)


def _terminal(value: list[Any]) -> bool:
    """DCP's rule: a list is one value unless it holds a tensor, a dict, or such a list."""
    for entry in value:
        if isinstance(entry, (torch.Tensor, Mapping)):
            return False
        if isinstance(entry, list) and not _terminal(entry):
            return False
    return True
