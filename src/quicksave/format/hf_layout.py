"""The layout of a Hugging Face model directory, as ``save_pretrained`` writes it and
``from_pretrained`` reads it (no I/O: names, the shard plan and the index document).

- One shard: ``model.safetensors``, no index.
- Several: ``model-00001-of-0000M.safetensors`` ... and ``model.safetensors.index.json``,
  ``{"metadata": {"total_size": <tensor bytes>, "total_parameters": <elements>},
  "weight_map": {key: shard file name}}``.
- Every shard's safetensors ``__metadata__`` holds ``"format": "pt"``
  (``from_pretrained`` refuses a file without it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from quicksave.errors import CheckpointError

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
SHARD_METADATA = {"format": "pt"}
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # the Hugging Face Hub's usual "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def plan_shards(sizes: Mapping[str, int], max_bytes: int) -> list[list[str]]:
    """Keys (with their byte sizes, in order) grouped into shards, a shard closed when
    the next tensor would take it past ``max_bytes`` (``save_pretrained``'s rule); a
    tensor larger than ``max_bytes`` is a shard of its own."""
    shards: list[list[str]] = []
    used = 0
    for key, n in sizes.items():
        if not shards or (shards[-1] and used + n > max_bytes):
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += n
    return shards


def shard_names(count: int) -> list[str]:
    """The file names of ``count`` shards, as ``save_pretrained`` names them."""
    if count == 1:
        return [WEIGHTS_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def index_doc(
    shards: list[list[str]], names: list[str], sizes: Mapping[str, int], parameters: int
) -> dict[str, Any]:
    """The ``model.safetensors.index.json`` document of ``shards`` written as ``names``."""
    return {
        "metadata": {"total_size": sum(sizes.values()), "total_parameters": parameters},
        "weight_map": {k: name for name, keys in zip(names, shards, strict=True) for k in keys},
    }


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"500MiB"`` -> 524_288_000, ``"1024"`` -> 1024.

    Raises:
        CheckpointError: not a positive whole number of bytes with an optional unit.
    """
    s = text.strip().upper().replace(" ", "")
    digits = len(s) - len(s.lstrip("0123456789."))
    try:
        value = float(s[:digits]) * _UNITS[s[digits:]]
    except (KeyError, ValueError):
        raise CheckpointError(
            f"not a size: {text!r} (e.g. 5GB, 500MiB, or a number of bytes)"
        ) from None
    if value <= 0 or value != int(value):
        raise CheckpointError(f"not a positive whole number of bytes: {text!r}")
    return int(value)
