"""The collect cache: a single-rank saver's answer of the one collector,
``rank_plans.collect_local(state_dict, rank, whole=True)``, for the last state dict,
reused while a new state dict has the same structure, so that a steady save collects
its thousands of tensors in a few calls instead of a few Python calls per tensor.

What a collect derives from the structure alone is kept: the fqns, the key paths, the
empty dicts, which leaves are tensors, each tensor's checks (its dtype is storable,
its layout strided, it is not on ``meta``) and the plan's key
(``LocalState.shape_key``). The next state dict reuses them once it is seen to have
the same structure: per container (not per leaf) the same keys and the same type of
every value, every list kept whole still kept whole; per tensor (one ``map`` over all
of them, no object kept per tensor) the same dtype, shape, layout and ``meta``-ness.
Anything else — a new or missing key, another type, dtype or shape, a tensor subclass
such as a DTensor — is collected by ``collect_local`` again, and that answer is kept
instead. Plain values are encoded at every save (their value now), but for an ``int``,
``float``, ``str``, ``bool`` or ``None``, or a tuple of such values (an optimizer's
``betas``), that is the very object of the last save (it cannot have changed); a small
value whose new encoding is the same JSON keeps the last encoding object, so that what
is made from the encodings downstream (the manifest's entries, their pickled bytes) is
seen unchanged and reused.

Call order: the engine's training thread calls :meth:`CollectCache.collect` at each
save (and ``prepare()``), under the saver's lock. Pure: no I/O, no collective.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from quicksave.errors import IncompatibleStateError
from quicksave.format import objects as objcodec
from quicksave.saving.collect import to_state_dict
from quicksave.saving.keypaths import walked
from quicksave.saving.rank_plans import LocalState, collect_local

# the tensor types collected as themselves (whole_local detaches them; a DTensor is not)
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
# what a tensor's checks and its place in the plan depend on
_FACTS = operator.attrgetter("dtype", "shape", "layout", "is_meta")
_GRAD = operator.attrgetter("requires_grad")
# plain values whose object cannot change: the same object encodes the same
_IMMUTABLE = frozenset({int, float, str, bool, type(None)})
_IMMUTABLE_OR_TUPLE = _IMMUTABLE | {tuple}  # a tuple: if what it holds is (_frozen)
_SMALL = 64  # values of a container compared with the last encoding (see _encode)
_NONE = object()


@dataclass(frozen=True)
class _Node:
    """A container the flattening walks into: a mapping (its keys) or a list (its
    length), the type of each value, the positions of the values walked into (with
    their nodes) and of the lists kept whole."""

    keys: tuple | int
    key_types: tuple
    types: tuple
    children: tuple[tuple[int, _Node], ...]
    whole_lists: tuple[int, ...]


@dataclass(frozen=True)
class _Entry:
    """What one collect derived from the structure."""

    root: _Node
    fqns: tuple[str, ...]  # the leaves, in flattening order
    tensor_at: tuple[int, ...]  # positions of the tensor leaves
    object_at: tuple[int, ...]  # positions of the other leaves
    immutable: tuple[bool, ...]  # per other leaf: of a type whose object never changes
    tuple_at: tuple[int, ...]  # which other leaves are tuples (immutable if what they hold is)
    facts: tuple[tuple, ...]  # per tensor leaf: _FACTS
    paths: tuple[tuple[str, tuple], ...]  # as LocalState's (no tensor is kept here)
    empty: tuple[tuple, ...]
    shape_key: tuple  # LocalState.shape_key of this structure


class CollectCache:
    """One saver's collect cache (one entry: the latest structure).

    Attributes:
        hits / misses: collects answered from the cache / by ``collect_local``.
    """

    def __init__(self) -> None:
        self._entry: _Entry | None = None
        # the last collect's plain values and their encodings (reused where unchanged)
        self._values: tuple[list[Any], dict[str, Any]] | None = None
        self.hits = 0
        self.misses = 0

    def collect(self, state_dict: Mapping[str, Any], rank: int) -> LocalState:
        """``collect_local(state_dict, rank, whole=True)``, from the cache where the
        structure is the cached one (its ``shape_key`` then the cached one).

        Raises:
            IncompatibleStateError: as ``collect_local`` (names fqn and rank; before
                any I/O).
        """
        nested = to_state_dict(state_dict)
        entry = self._entry
        if entry is not None:
            found = _reuse(entry, nested, rank, self._values)
            if found is not None:
                state, self._values = found
                self.hits += 1
                return state
        self.misses += 1
        self._entry, self._values = None, None
        state = collect_local(nested, rank, whole=True)
        self._entry = _entry_of(nested, state)
        if self._entry is not None:
            self._values = ([], state.values)  # (no value is reused from a miss)
        return state


def _reuse(
    entry: _Entry,
    nested: Mapping[str, Any],
    rank: int,
    last: tuple[list[Any], dict[str, Any]] | None,
) -> tuple[LocalState, tuple[list[Any], dict[str, Any]]] | None:
    """The collect of ``nested`` from ``entry`` and its plain values; None if its
    structure differs. ``last``: the previous collect's values and their encodings: an
    immutable value that is the same object is not encoded again, and where none
    changed the encodings are the same dict."""
    leaves: list[Any] = []
    if not _gather(entry.root, nested, leaves) or len(leaves) != len(entry.fqns):
        return None
    tensors = [leaves[i] for i in entry.tensor_at] if entry.object_at else leaves
    if not all(map(operator.eq, map(_FACTS, tensors), entry.facts)):
        return None
    fqns = entry.fqns
    names = [fqns[i] for i in entry.tensor_at] if entry.object_at else fqns
    sources = dict(zip(names, tensors, strict=True))
    staged = sources
    if any(map(_GRAD, tensors)):  # (a Parameter itself, not state_dict()'s detached view)
        staged = {n: t.detach() for n, t in sources.items()}
    values = [leaves[i] for i in entry.object_at]
    old_values, old_objects = last if last is not None else ([], {})
    objects = old_objects if len(old_values) == len(values) else {}
    if objects:  # an immutable value that is the same object is encoded alike
        kept = list(map(operator.and_, map(operator.is_, values, old_values), entry.immutable))
        for j in entry.tuple_at:  # (a tuple is immutable where all it holds is)
            kept[j] = kept[j] and _frozen(values[j])
        at = zip(entry.object_at, values, kept, strict=True)
        redo = [(fqns[i], v) for i, v, keep in at if not keep]
    else:
        redo = [(fqns[i], v) for i, v in zip(entry.object_at, values, strict=True)]
    try:
        for fqn, v in redo:
            encoded = _encode(v, fqn, old_objects)
            if encoded is not objects.get(fqn, _NONE):
                if objects is old_objects and objects:
                    objects = dict(old_objects)  # (keeps the order)
                objects[fqn] = encoded
    except IncompatibleStateError as e:
        raise IncompatibleStateError(e.message, fqn=e.fqn, rank=rank) from None
    state = LocalState(
        rank, staged, objects, sources, entry.paths, entry.empty, None, entry.shape_key
    )
    return state, (values, objects)


def _encode(value: Any, fqn: str, last: dict[str, Any]) -> Any:
    """``value`` encoded; the last save's encoding of ``fqn`` itself where a small one
    is the same JSON (a new list of the same names, as an optimizer's flattened
    ``param_groups`` hold per parameter): the manifest entries and the bytes they
    pickle to are then those of the last save."""
    encoded = objcodec.encode(value, fqn)
    old = last.get(fqn, _NONE)
    return old if _same_json(encoded, old, _SMALL) else encoded


def _frozen(value: Any) -> bool:
    """Whether ``value`` can never change: of an immutable type, or a tuple of such
    values (an optimizer's ``betas``), however nested."""
    return type(value) in _IMMUTABLE or (type(value) is tuple and all(map(_frozen, value)))


def _same_json(a: Any, b: Any, budget: int) -> bool:
    """Whether two encodings are the same JSON (types included: ``1``, ``1.0`` and
    ``True`` differ, so do ``0.0`` and ``-0.0``), looking at no more than ``budget``
    values of a container."""
    if type(a) is not type(b):
        return False
    if type(a) is list:
        return len(a) == len(b) <= budget and all(
            _same_json(x, y, budget) for x, y in zip(a, b, strict=True)
        )
    if type(a) is dict:
        return (
            len(a) == len(b) <= budget
            and list(a) == list(b)  # (the order too)
            and all(_same_json(v, b[k], budget) for k, v in a.items())
        )
    if type(a) is float:
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return bool(a == b)


def _gather(node: _Node, value: Any, leaves: list[Any]) -> bool:
    """Append the leaves of ``value`` to ``leaves`` in flattening order; False if its
    structure is not ``node``'s."""
    if isinstance(value, Mapping):
        keys = tuple(value)
        if keys != node.keys or tuple(map(type, keys)) != node.key_types:
            return False
        values: Any = tuple(value.values())
    elif isinstance(value, list) and len(value) == node.keys:
        values = value
    else:
        return False
    if tuple(map(type, values)) != node.types:
        return False
    if any(walked(values[i]) for i in node.whole_lists):
        return False
    start = 0
    for i, child in node.children:
        leaves.extend(values[start:i])
        if not _gather(child, values[i], leaves):
            return False
        start = i + 1
    leaves.extend(values[start:] if start else values)
    return True


def _entry_of(nested: Mapping[str, Any], state: LocalState) -> _Entry | None:
    """The cache entry of ``state``, the collect of ``nested``; None where it does not
    fit: a tensor of another type than :data:`_PLAIN` (``whole_local``'s other cases)."""
    leaves: list[Any] = []
    root = _node(nested, leaves)
    tensor_at = tuple(i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor))
    object_at = tuple(i for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor))
    if len(tensor_at) != len(state.sources) or len(object_at) != len(state.values):
        return None
    if any(type(leaves[i]) not in _PLAIN for i in tensor_at):
        return None
    # collect_local's dicts keep the flattening order, the tensors' and the values' apart
    order: list[str] = [""] * len(leaves)
    for i, (fqn, t) in zip(tensor_at, state.sources.items(), strict=True):
        if t is not leaves[i]:
            return None
        order[i] = fqn
    for i, fqn in zip(object_at, state.values, strict=True):
        order[i] = fqn
    facts = tuple(_FACTS(leaves[i]) for i in tensor_at)
    immutable = tuple(type(leaves[i]) in _IMMUTABLE_OR_TUPLE for i in object_at)
    tuple_at = tuple(j for j, i in enumerate(object_at) if type(leaves[i]) is tuple)
    at = (tensor_at, object_at, immutable, tuple_at, facts)
    return _Entry(root, tuple(order), *at, state.paths, state.empty, state.shape_key)


def _node(value: Any, leaves: list[Any]) -> _Node:
    """The node of a container the flattening walks into, appending its leaves."""
    if isinstance(value, Mapping):
        keys: tuple | int = tuple(value)
        key_types = tuple(map(type, value))
        values = list(value.values())
    else:
        keys, key_types, values = len(value), (), value
    children = []
    whole = []
    for i, v in enumerate(values):
        if walked(v):
            children.append((i, _node(v, leaves)))
        else:
            leaves.append(v)
            if isinstance(v, list):
                whole.append(i)
    return _Node(keys, key_types, tuple(map(type, values)), tuple(children), tuple(whole))
