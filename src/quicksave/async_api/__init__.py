"""The seeds' asynchronous checkpointing API, on quicksave's engine.

Same names and meaning as NVIDIA Resiliency Extension's ``async_ckpt`` — ``AsyncRequest``,
``AsyncCallsQueue`` (``core``), ``TorchAsyncCheckpoint`` (``torch_ckpt``) — so a user of it
can switch by changing imports; plus ``async_save`` (``save``): one save in the quicksave
format through :class:`quicksave.engine.AsyncSaver`.
"""

from .core import AsyncCallsQueue
from .request import AsyncRequest
from .save import async_save
from .torch_ckpt import TorchAsyncCheckpoint

__all__ = ["AsyncCallsQueue", "AsyncRequest", "TorchAsyncCheckpoint", "async_save"]
from .filesystem_async import FileSystemWriterAsync  # noqa: E402
from .state_dict_saver import (  # noqa: E402
    CheckpointMetadataCache,
    get_metadata_caching_status,
    init_checkpoint_metadata_cache,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
    verify_global_md_reuse,
)

__all__ += [
    "CheckpointMetadataCache",
    "FileSystemWriterAsync",
    "get_metadata_caching_status",
    "init_checkpoint_metadata_cache",
    "save_state_dict_async_finalize",
    "save_state_dict_async_plan",
    "verify_global_md_reuse",
]
