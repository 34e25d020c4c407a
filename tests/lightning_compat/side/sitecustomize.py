"""QuicksaveCheckpointIO as Lightning's default CheckpointIO, in every process of a run.

``run_lightning_tests.py`` puts this directory first on ``PYTHONPATH`` and sets
``QS_LIGHTNING_MODE`` (``stock``, ``sync`` or ``async``), so Python imports this file at
start-up in the pytest process and in every process it starts (``strategy="ddp_spawn"``
children, which re-import Lightning). In ``sync`` and ``async`` mode it changes one thing
in Lightning, when ``lightning.pytorch.strategies.strategy`` is imported (an import hook):
the name ``TorchCheckpointIO`` there, which only the ``Strategy.checkpoint_io`` property
calls (for a strategy given no ``CheckpointIO``, and for the IO a
``_WrappingCheckpointIO`` such as ``AsyncCheckpointIO`` wraps), builds
``QuicksaveCheckpointIO(async_save=<mode is async>)`` instead. A test that passes its own
``CheckpointIO`` keeps it. In ``stock`` mode it does nothing. Then any other
``sitecustomize`` on ``sys.path`` (which this file shadows) is run.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

TARGET = "lightning.pytorch.strategies.strategy"


def _patch(module) -> None:
    from quicksave.integrations.lightning import QuicksaveCheckpointIO

    async_save = os.environ["QS_LIGHTNING_MODE"] == "async"

    def default_checkpoint_io() -> QuicksaveCheckpointIO:
        return QuicksaveCheckpointIO(async_save=async_save)

    module.TorchCheckpointIO = default_checkpoint_io


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds ``TARGET`` with the other finders and patches it right after it has run."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # once, and no recursion into find_spec below
        spec = importlib.util.find_spec(name)
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
            spec = importlib.util.spec_from_file_location("_lightning_compat_next_sc", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


if os.environ.get("QS_LIGHTNING_MODE") in ("sync", "async"):
    if TARGET in sys.modules:
        _patch(sys.modules[TARGET])
    else:
        sys.meta_path.insert(0, _PatchOnImport())
_chain_next_sitecustomize()
