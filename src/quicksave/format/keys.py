"""Dict keys that are not strings, inside nested state-dict paths (FORMAT.md §2.1).

DCP names a nested value by the ``str()`` of each key on its way (an optimizer's
``{"state": {0: {"exp_avg": ...}}}`` becomes ``state.0.exp_avg`` with the path
``("state", "0", "exp_avg")``), so a load without a template cannot tell the key ``0``
from the key ``"0"``. quicksave keeps the path's elements as DCP writes them and records
the type of each key that was not a string beside them: in memory as a :class:`DictKey`
(a ``str`` equal to DCP's element, so every consumer of DCP-style paths still works),
in the manifest as the entry's ``key_types`` list.

Key types kept: ``int``, ``bool``, ``None`` and ``float``. Any other key (an enum, a
tuple, an object) is stored as its ``str()`` and comes back as that string, as it does
from DCP.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

# The key under which quicksave's DCP save planner lists the empty dicts in its DCP
# mappings (``planner_data``): a rank's in its local plan, every rank's in the global
# metadata (``adapters.dcp_save_planner``). A tuple is never an fqn.
EMPTY_KEY = ("quicksave.empty_dicts",)
# Where a rank's local DCP save plan carries its copies of entries other ranks may hold
# too (``ranks/replicas.py``), for the coordinator to compare (``adapters.dcp_save_planner``).
REPLICAS_KEY = ("quicksave.replicas",)

# type name in the manifest -> the Python type it restores
KEY_TYPES: dict[str, type] = {"int": int, "bool": bool, "none": type(None), "float": float}
_NAME_OF: dict[type, str] = {t: n for n, t in KEY_TYPES.items()}


class DictKey(str):
    """A dict key that was not a ``str``: its ``str()`` (DCP's path element) plus
    the key itself (``.key``).

    Example::

        k = DictKey.of(0)
        k == "0" and k.key == 0 and k.type_name == "int"
    """

    key: Any
    type_name: str

    @classmethod
    def of(cls, key: Any) -> DictKey | None:
        """The DictKey of ``key``, or None if its type is not kept (see module doc)."""
        name = _NAME_OF.get(type(key))
        if name is None:
            return None
        k = cls(str(key))
        k.key, k.type_name = key, name
        return k

    @classmethod
    def parse(cls, text: str, type_name: str) -> DictKey:
        """The key ``text`` of type ``type_name`` (from a manifest).

        Raises:
            ValueError: ``type_name`` is unknown or ``text`` is not the ``str()`` of a
                key of that type.
        """
        if type_name == "int":
            key: Any = int(text) if text.lstrip("-").isdigit() else None
            ok = key is not None and str(key) == text
        elif type_name == "bool":
            key, ok = text == "True", text in ("True", "False")
        elif type_name == "none":
            key, ok = None, text == "None"
        elif type_name == "float":
            try:
                key = float(text)
            except ValueError:
                key = None
            ok = key is not None and (str(key) == text or math.isnan(key) and text == "nan")
        else:
            raise ValueError(f"unknown key type {type_name!r}")
        if not ok:
            raise ValueError(f"{text!r} is not a key of type {type_name}")
        k = cls(text)
        k.key, k.type_name = key, type_name
        return k

    def __repr__(self) -> str:  # deterministic: plan keys hash repr() of paths
        return f"DictKey({self.key!r})"

    def __reduce__(self) -> tuple:
        return (DictKey.parse, (str(self), self.type_name))


def real_key(element: Any) -> Any:
    """The key a path element stands for: ``DictKey`` -> its key; others as they are."""
    return element.key if isinstance(element, DictKey) else element


def dcp_planner_data(planner_data: Any) -> Any:
    """DCP ``Metadata.planner_data`` as DCP itself writes it: fqn -> path of plain
    ``str`` and ``int`` elements. quicksave's save planner also puts typed paths and
    its ``EMPTY_KEY`` entry there for its manifest; a ``.metadata`` pickle must
    hold neither (stock readers unpickle it, some with a restricted unpickler)."""
    if not isinstance(planner_data, dict):
        return planner_data
    return {
        fqn: tuple(str(e) if isinstance(e, DictKey) else e for e in path)
        for fqn, path in planner_data.items()
        if isinstance(fqn, str)
    }


def names_itself(path: Sequence[Any], fqn: str) -> bool:
    """``path`` is ``(fqn,)`` with a plain ``str`` key: the manifest then omits it."""
    return len(path) == 1 and type(path[0]) is str and path[0] == fqn


def key_types_of(path: Sequence[Any]) -> list[str | None] | None:
    """The manifest's ``key_types`` for ``path`` (None if every key is as written)."""
    types = [e.type_name if isinstance(e, DictKey) else None for e in path]
    return types if any(t is not None for t in types) else None


def typed_path(path: Sequence[Any], key_types: Sequence[Any] | None) -> tuple[Any, ...]:
    """A path read from JSON with its ``key_types`` applied.

    Raises:
        ValueError: ``key_types`` does not fit ``path`` (length, a typed element that
            is not a string, an unknown type or a text of the wrong type).
    """
    if key_types is None:
        return tuple(path)
    if not isinstance(key_types, list) or len(key_types) != len(path):
        raise ValueError("key_types must be a list as long as path")
    out: list[Any] = []
    for element, name in zip(path, key_types, strict=True):
        if name is None:
            out.append(element)
        elif not isinstance(element, str) or not isinstance(name, str):
            raise ValueError("a typed key must be a string with a type name")
        else:
            out.append(DictKey.parse(element, name))
    return tuple(out)
