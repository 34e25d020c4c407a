"""CPU shim for running NVRx's async_ckpt on a machine without CUDA (nvrx_compat only).

``run_nvrx_tests.py --target nvrx`` and ``time_to_finalize.py`` copy this file into a temp
directory and put that directory first on ``PYTHONPATH`` of the ranks they start, so that
Python imports it at start-up in every rank and in every process the ranks start (NVRx's
spawned checkpoint worker and multiprocessing manager inherit the environment; forked
children inherit the patched modules). It never edits NVRx's files and changes none of
NVRx's logic: it only turns the CUDA calls NVRx's ``async_ckpt`` makes unconditionally into
their CPU equivalents, and only when ``torch.cuda.is_available()`` is False (with CUDA it
does nothing). The patches (and nothing else):

* ``torch.cuda.synchronize()`` -> no-op (nothing runs asynchronously on the CPU);
* ``torch.cuda.current_device()`` -> ``"cpu"`` (what ``torch.cpu.current_device()``
  returns), so ``torch.tensor(..., device=torch.cuda.current_device())`` -- the tensors
  of NVRx's all-reduces and broadcast -- is a CPU tensor, as gloo needs;
* ``torch.cuda.device_count()`` -> 1 (``rank % torch.cuda.device_count()`` in the
  persistent worker is otherwise a ZeroDivisionError);
* ``torch.cuda.set_device(...)`` -> no-op (the worker's ``torch.cuda.set_device(0)``);
* ``torch.empty`` and ``torch.tensor`` with ``device`` ``"cuda"``/``"cuda:N"``/a CUDA
  ``torch.device`` -> the same call with ``device="cpu"`` (the worker's
  ``torch.empty(1, device='cuda:0')`` and ``state_dict_saver``'s
  ``torch.tensor(..., device='cuda')``); any other call is passed through unchanged.

torch is patched when something imports it (an import hook), not here: a process that
never imports torch (e.g. a multiprocessing manager) does not pay for importing it, which
keeps ``time_to_finalize.py``'s NVRx timings fair. Then any other ``sitecustomize`` on
``sys.path`` (which this file shadows) is run.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys


def _is_cuda(device: object) -> bool:
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return getattr(device, "type", None) == "cuda"


def _cpu_device(factory):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return wrapper


def _patch(torch) -> None:
    if torch.cuda.is_available():
        return
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    torch.empty = _cpu_device(torch.empty)
    torch.tensor = _cpu_device(torch.tensor)


class _PatchTorchOnImport(importlib.abc.MetaPathFinder):
    """Finds ``torch`` with the other finders and patches it right after it has run."""

    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # once, and no recursion into find_spec below
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module) -> None:
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def _chain_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or os.curdir) == here:
            continue
        candidate = os.path.join(entry or os.curdir, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_nvrx_compat_next_sc", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


if "torch" in sys.modules:
    _patch(sys.modules["torch"])
else:
    sys.meta_path.insert(0, _PatchTorchOnImport())
_chain_next_sitecustomize()
