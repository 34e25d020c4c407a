"""The state dicts ``quicksave bench --storage`` moves: the ``large``, ``small`` and
``model`` shapes (:func:`shape_specs`, :func:`build_shape`; see the package docstring)
and :func:`pack`, the same bytes in one buffer for the raw methods."""

from __future__ import annotations

import torch

from quicksave_tools.bench.methods import nbytes_of, state_dict_of
from quicksave_tools.bench.storage.config import SHAPES, SMALL_TENSOR


def shape_specs(shape: str, total_bytes: int) -> list[tuple[str, torch.dtype, int]]:
    """Names, dtypes and byte sizes of the tensors of ``shape`` (see the package docstring)."""
    if shape == "large":
        each = max(4, (total_bytes // 4) // 4 * 4)
        return [(f"large.{i}", torch.float32, each) for i in range(4)]
    if shape == "small":
        n = max(1, total_bytes // SMALL_TENSOR)
        return [
            (f"layer.{i}.weight", torch.float32 if i % 2 == 0 else torch.bfloat16, SMALL_TENSOR)
            for i in range(n)
        ]
    if shape == "model":
        return _model_specs(total_bytes)
    raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")


MODEL_LAYERS = 24


def _model_specs(total_bytes: int) -> list[tuple[str, torch.dtype, int]]:
    """A transformer's parameters with AdamW's state, float32, ~``total_bytes`` in all:
    per layer 12 h^2 weights (qkv 3h^2, out h^2, MLP 4h^2 + 4h^2) and 8 small vectors."""
    h = max(8, int((total_bytes / (3 * 4 * 12 * MODEL_LAYERS)) ** 0.5) // 8 * 8)
    per_layer = (
        ("attn.qkv.weight", 3 * h * h),
        ("attn.qkv.bias", 3 * h),
        ("attn.out.weight", h * h),
        ("attn.out.bias", h),
        ("norm1.weight", h),
        ("norm1.bias", h),
        ("mlp.up.weight", 4 * h * h),
        ("mlp.up.bias", 4 * h),
        ("mlp.down.weight", 4 * h * h),
        ("mlp.down.bias", h),
        ("norm2.weight", h),
        ("norm2.bias", h),
    )
    specs = []
    for i in range(MODEL_LAYERS):
        for name, numel in per_layer:
            fqn = f"model.layers.{i}.{name}"
            specs.append((fqn, torch.float32, 4 * numel))
            specs.append((f"optim.{fqn}.exp_avg", torch.float32, 4 * numel))
            specs.append((f"optim.{fqn}.exp_avg_sq", torch.float32, 4 * numel))
            specs.append((f"optim.{fqn}.step", torch.float32, 4))
    return specs


def build_shape(shape: str, total_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A deterministic state dict of ``shape`` holding about ``total_bytes``."""
    return state_dict_of(shape_specs(shape, total_bytes), seed)


def pack(sd: dict[str, torch.Tensor]) -> torch.Tensor:
    """The bytes of every tensor of ``sd``, one after the other, in one uint8 tensor."""
    flat = torch.empty(nbytes_of(sd), dtype=torch.uint8)
    pos = 0
    for t in sd.values():
        n = t.numel() * t.element_size()
        flat[pos : pos + n].copy_(t.reshape(-1).view(torch.uint8))
        pos += n
    return flat
