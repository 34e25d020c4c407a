"""``quicksave.async_api``: the NVRx-compatible API (:mod:`quicksave.compat.nvrx`) under the
name that NVIDIA Resiliency Extension users switch their imports to.

``nvidia_resiliency_ext.checkpointing.async_ckpt.<module>`` becomes
``quicksave.async_api.<module>``: each submodule below is the very module object of
:mod:`quicksave.compat.nvrx` (not a copy), so patches and ``isinstance`` checks see one
definition. Also exported: :func:`quicksave.async_save`.
"""

import importlib
import sys

from quicksave.compat.nvrx import *  # noqa: F403
from quicksave.compat.nvrx import __all__ as _nvrx_all
from quicksave.saving.async_save import async_save

SUBMODULES = (
    "core",
    "filesystem_async",
    "process_state",
    "request",
    "state_dict_saver",
    "torch_ckpt",
)

for _name in SUBMODULES:
    globals()[_name] = sys.modules[f"{__name__}.{_name}"] = importlib.import_module(
        f"quicksave.compat.nvrx.{_name}"
    )
del _name

__all__ = [*_nvrx_all, "async_save"]
