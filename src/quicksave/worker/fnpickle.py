"""Pickle a call for the worker process, sending by value the functions it cannot import.

The generic transport of ``worker/calls.py``, which the NVRx-compatible API uses for the
functions its users hand over; it lives in ``worker/`` because the worker process
unpickles with it, and knows nothing of NVRx.

The worker is a fresh interpreter that does not re-import the trainer's ``__main__``
(see ``quicksave.worker.main``). Plain pickling sends a function by reference (module and
qualified name), so a function of the training script, a closure or a lambda fails there
("Can't get attribute 'write_file' on <module '__main__'>"). ``CallPickler`` is
multiprocessing's ``ForkingPickler`` (CPU tensors still travel as shared-memory handles
once ``torch.multiprocessing`` is imported) that sends exactly those functions by value:

- by reference (unchanged): a function found again by walking ``sys.modules[module]``
  along its ``__qualname__``, other than in ``__main__``;
- by value: the marshalled code, names, defaults, ``__dict__``, closure cells, and the
  globals the code reads (its ``LOAD_GLOBAL``-like instructions, nested code included).
  Modules among them go by name (imported again in the worker); other values through this
  same pickler (a helper of ``__main__`` by value too, a tensor as shared memory). The
  functions of one module share one globals dict in the worker, so recursion and mutual
  references work. The worker gets a copy: what a function changes there (a global, a
  closure variable) is not seen by the trainer.

Classes are never sent by value: a class of ``__main__`` (or one defined inside a
function), or an instance of one, is refused at pickling time with a ``CheckpointError``
that names it; so is anything else that does not pickle.

Payloads load with plain ``pickle.loads`` (``ForkingPickler.loads``): the rebuilding
functions below are module-level functions of ``quicksave.worker.fnpickle``. Code objects are
only readable by the interpreter version that wrote them; the payload records it and the
worker refuses a mismatch with a clear error.
"""

from __future__ import annotations

import builtins
import dis
import importlib
import importlib.util
import io
import marshal
import pickle
import sys
import types
from multiprocessing.reduction import ForkingPickler
from typing import Any

from quicksave.errors import CheckpointError

__all__ = ["CallPickler", "dumps", "loads"]

_MAIN_MODULES = frozenset({"__main__", "__mp_main__"})
# Instructions that read a global (a nested class body reads through LOAD_NAME).
_GLOBAL_READS = frozenset(
    {"LOAD_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME", "DELETE_NAME", "LOAD_FROM_DICT_OR_GLOBALS"}
)
# (implementation cache tag, bytecode magic number, version): marshalled code is only
# readable by the same interpreter.
_INTERPRETER = (
    sys.implementation.cache_tag,
    importlib.util.MAGIC_NUMBER,
    sys.version.split()[0],
)


class _Globals:
    """Stands for one globals dict while pickling: memoized by the pickler, so every
    function of that dict in one payload gets the same dict in the worker."""

    def __init__(self, module: str | None, package: str | None) -> None:
        self.module = module
        self.package = package


class CallPickler(ForkingPickler):
    """``ForkingPickler`` that sends by value the functions the worker cannot import.

    Use through :func:`dumps` (which also turns pickling failures into
    ``CheckpointError``); one instance pickles one payload.
    """

    def __init__(self, file: io.BytesIO, protocol: int | None = None) -> None:
        super().__init__(file, protocol)
        self._protocol = pickle.DEFAULT_PROTOCOL if protocol is None else protocol
        # id(globals dict) -> (the dict, its stand-in); the dict is held so ids stay unique
        self._globals: dict[int, tuple[dict[str, Any], _Globals]] = {}
        self._names: dict[types.CodeType, frozenset[str]] = {}

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.FunctionType):
            return NotImplemented if _importable(obj) else self._reduce_function(obj)
        if isinstance(obj, type):
            _refuse_class(obj, "")
            return NotImplemented
        if isinstance(obj, types.ModuleType):
            return _reduce_module(obj)
        if isinstance(obj, types.CellType):
            try:
                state: tuple[Any, ...] = (obj.cell_contents,)
            except ValueError:  # an empty cell: a variable not assigned yet
                state = ()
            return _new_cell, (), state, None, None, _fill_cell
        if isinstance(obj, _Globals):
            return _new_globals, (obj.module, obj.package)
        _refuse_class(type(obj), "an instance of ")
        _refuse_reference_to_main(obj, self._protocol)
        return NotImplemented

    def _reduce_function(self, fn: types.FunctionType) -> tuple[Any, ...]:
        name = _describe(fn)
        env = fn.__globals__
        entry = self._globals.get(id(env))
        if entry is None:
            package = env.get("__package__")
            stand_in = _Globals(env.get("__name__"), package if isinstance(package, str) else None)
            entry = self._globals[id(env)] = (env, stand_in)
        used = {k: env[k] for k in sorted(self._global_names(fn.__code__)) if k in env}
        used.pop("__builtins__", None)
        for k, v in used.items():
            _refuse_value(v, f"{name} uses the global {k!r}: ")
        cells = fn.__closure__ or ()
        for var, cell in zip(fn.__code__.co_freevars, cells, strict=True):
            try:
                value = cell.cell_contents
            except ValueError:  # empty: nothing to check
                continue
            _refuse_value(value, f"{name} captures {var!r}: ")
        args = (
            _INTERPRETER,
            marshal.dumps(fn.__code__),
            entry[1],
            fn.__name__,
            fn.__qualname__,
            tuple(cells),
        )
        state = {
            "globals": used,
            "defaults": fn.__defaults__,
            "kwdefaults": fn.__kwdefaults__,
            "dict": dict(fn.__dict__),
            "doc": fn.__doc__,
            "module": fn.__module__,
        }
        # State after the function is memoized: a function reaching itself (through a
        # global, a default or its __dict__) finds the one being rebuilt.
        return _make_function, args, state, None, None, _set_function_state

    def _global_names(self, code: types.CodeType) -> frozenset[str]:
        """Names of the globals ``code`` and its nested code objects read.

        The instructions, not ``co_names``: ``co_names`` also lists attribute names, and a
        training script's global ``model`` must not be shipped for a ``self.model``.
        """
        names = self._names.get(code)
        if names is None:
            found = {i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_READS}
            for const in code.co_consts:
                if isinstance(const, types.CodeType):
                    found |= self._global_names(const)
            names = self._names[code] = frozenset(found)
        return names


def dumps(obj: Any) -> bytes:
    """Pickle ``obj`` for the worker process (see the module docstring).

    Args:
        obj: typically a ``(fn, args, kwargs)`` call.

    Returns:
        The payload, for ``pickle.loads`` (``ForkingPickler.loads``) in the worker.

    Raises:
        CheckpointError: something in ``obj`` cannot be sent: a class of ``__main__`` or
            an instance of one (the message names it), or any object that does not
            pickle.

    Example:
        >>> payload = dumps((lambda x: x + 1, (1,), {}))
        >>> fn, args, kwargs = loads(payload)
        >>> fn(*args, **kwargs)
        2
    """
    buf = io.BytesIO()
    try:
        CallPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    except CheckpointError:
        raise
    except RecursionError as e:
        raise CheckpointError(f"cannot pickle {_describe(obj)}: it nests too deeply ({e})") from e
    except Exception as e:  # noqa: BLE001 - whatever fails to pickle is bad input
        raise CheckpointError(f"cannot pickle {_describe(obj)}: {type(e).__name__}: {e}") from e
    return buf.getvalue()


def loads(payload: bytes) -> Any:
    """Rebuild what :func:`dumps` pickled (plain ``pickle.loads``; import
    ``torch.multiprocessing`` first where tensors travel as shared memory)."""
    return pickle.loads(payload)


# ------------------------------------------------------------------ pickling helpers
def _importable(fn: types.FunctionType) -> bool:
    """Whether the worker finds ``fn`` by reference: its module, then its qualname."""
    module, qualname = fn.__module__, fn.__qualname__
    if module is None or module in _MAIN_MODULES or "<" in qualname:  # <locals>, <lambda>
        return False
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj is fn


def _reduce_module(module: types.ModuleType) -> tuple[Any, ...]:
    name = module.__name__
    if name in _MAIN_MODULES:
        raise CheckpointError(
            "the training script's module (__main__) cannot be sent to the worker process, "
            "which does not run the script: pass the values it needs instead"
        )
    if sys.modules.get(name) is not module:
        raise CheckpointError(
            f"module {name!r} cannot be sent to the worker process: it is not the module "
            f"that 'import {name}' gives (it was built by hand or reloaded)"
        )
    return importlib.import_module, (name,)


def _refuse_class(cls: type, what: str) -> None:
    """Raise for a class the worker cannot import (classes never go by value)."""
    module, qualname = getattr(cls, "__module__", None), getattr(cls, "__qualname__", "")
    if module in _MAIN_MODULES:
        where = "is defined in the training script (__main__), which the worker does not run"
    elif "<locals>" in qualname:
        where = "is defined inside a function"
    else:
        return
    raise CheckpointError(
        f"{what}class {module}.{qualname} cannot be sent to the worker process: the class "
        f"{where}; move it into an importable module (functions, closures and lambdas "
        "are sent by value, classes are not)"
    )


def _refuse_reference_to_main(obj: Any, protocol: int) -> None:
    """Raise for a function-like object of ``__main__`` that pickles by name (e.g. an
    ``functools.lru_cache`` wrapper): the trainer finds the name, the worker would not."""
    try:
        module = getattr(obj, "__module__", None)
        by_name = module in _MAIN_MODULES and isinstance(obj.__reduce_ex__(protocol), str)
    except Exception:  # noqa: BLE001 - not ours to judge: the pickler reports it
        return
    if by_name:
        qualname = getattr(obj, "__qualname__", "?")
        raise CheckpointError(
            f"{type(obj).__qualname__} {module}.{qualname} cannot be sent to the worker "
            "process: it is defined in the training script (__main__), which the worker "
            "does not run, and pickles by name; move it into an importable module (plain "
            "functions, closures and lambdas are sent by value)"
        )


def _refuse_value(value: Any, what: str) -> None:
    """Refuse early, naming the function that uses it, a class the worker cannot import."""
    if isinstance(value, type):
        _refuse_class(value, what)
    elif not isinstance(value, types.ModuleType | types.FunctionType):
        _refuse_class(type(value), what + "an instance of ")


def _describe(obj: Any) -> str:
    if isinstance(obj, types.FunctionType):
        return f"function {obj.__module__}.{obj.__qualname__}"
    if isinstance(obj, type):
        return f"class {obj.__module__}.{obj.__qualname__}"
    if isinstance(obj, tuple) and len(obj) == 3 and callable(obj[0]):  # a (fn, args, kwargs)
        return f"the call of {_describe(obj[0])}"
    return f"a {type(obj).__module__}.{type(obj).__qualname__}"


# ---------------------------------------------------------- rebuilding (the worker)
def _new_globals(module: str | None, package: str | None) -> dict[str, Any]:
    return {"__name__": module, "__package__": package, "__builtins__": builtins}


def _new_cell() -> types.CellType:
    return types.CellType()


def _fill_cell(cell: types.CellType, state: tuple[Any, ...]) -> None:
    if state:
        cell.cell_contents = state[0]


def _make_function(
    interpreter: tuple[str, bytes, str],
    code: bytes,
    env: dict[str, Any],
    name: str,
    qualname: str,
    closure: tuple[types.CellType, ...],
) -> types.FunctionType:
    if tuple(interpreter[:2]) != _INTERPRETER[:2]:
        raise CheckpointError(
            f"function {qualname} was pickled by Python {interpreter[2]} ({interpreter[0]}) "
            f"and cannot be rebuilt by Python {_INTERPRETER[2]} ({_INTERPRETER[0]}): "
            "functions sent by value need the same interpreter on both sides"
        )
    fn = types.FunctionType(marshal.loads(code), env, name, None, closure or None)
    fn.__qualname__ = qualname
    return fn


def _set_function_state(fn: types.FunctionType, state: dict[str, Any]) -> None:
    fn.__globals__.update(state["globals"])
    fn.__defaults__ = state["defaults"]
    fn.__kwdefaults__ = state["kwdefaults"]
    fn.__dict__.update(state["dict"])
    fn.__doc__ = state["doc"]
    fn.__module__ = state["module"]
