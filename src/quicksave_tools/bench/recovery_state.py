"""What every process of ``quicksave bench --recovery`` shares: the trainer of a shape
(:func:`trainer`), the checkpoint's tensors in a fixed order and their xxh3 digests
(:func:`digests`: how every restore is checked bit-exact against the saved state), and
the cold page cache (:func:`evict`, :func:`cached_fraction` of :mod:`.page_cache`; how:
:data:`COLD_CACHE`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import xxhash

from quicksave_tools.bench.page_cache import cached_fraction, evict, files_under
from quicksave_tools.bench.shapes import build

__all__ = [  # the cold page cache's helpers with the rest: one import for every process
    "COLD_CACHE",
    "STEP",
    "cached_fraction",
    "differences",
    "digests",
    "evict",
    "files_under",
    "nbytes",
    "state_items",
    "trainer",
]

Batch = tuple[torch.Tensor, torch.Tensor]
STEP = 100  # the step every method saves and every restore asks for
COLD_CACHE = (
    "every file of the checkpoint is opened, fsync-ed (a dirty page cannot be dropped) and "
    "given posix_fadvise(POSIX_FADV_DONTNEED) over its whole length; the fraction of its "
    "pages still resident afterwards (mincore on a fresh map) is reported beside each cold "
    "measurement (cached_before). No root needed; only the checkpoint's pages leave the "
    "cache, not the whole machine's (drop_caches)."
)


def trainer(spec: dict[str, Any], seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """The shape's seeded model, an AdamW without state, and a :class:`_Steps` that
    trains it (``spec``: ``shape``, ``quick``)."""
    model, batches, loss_fn = build(spec["shape"], seed, bool(spec.get("quick")))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optim, _Steps(model, optim, batches, loss_fn)


class _Steps:
    """Training steps over the shape's batches: ``forward_backward()`` alone (warms the
    kernels without creating optimizer state) or a whole ``step()``."""

    def __init__(
        self,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        batches: list[Batch],
        loss_fn: Callable[..., torch.Tensor],
    ) -> None:
        self.model, self.optim, self.batches, self.loss_fn = model, optim, batches, loss_fn
        self.count = 0

    def forward_backward(self) -> None:
        x, y = self.batches[self.count % len(self.batches)]
        self.count += 1
        self.optim.zero_grad(set_to_none=True)
        self.loss_fn(self.model(x), y).backward()

    def step(self) -> None:
        self.forward_backward()
        self.optim.step()

    def __call__(self, guard: Callable[[], Any] = contextlib.nullcontext) -> None:
        """One step with ``optimizer.step()`` inside ``guard()`` (the floor loop's)."""
        self.forward_backward()
        with guard():
            self.optim.step()


def state_items(model: nn.Module, optim: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a checkpoint of the model and its AdamW holds, named, in a fixed
    order: the model's state dict, then each parameter's optimizer state by key."""
    items = [(f"model.{k}", v.detach()) for k, v in model.state_dict().items()]
    names = {p: n for n, p in model.named_parameters()}
    for p, st in optim.state.items():
        for key in sorted(st):
            if torch.is_tensor(st[key]):
                items.append((f"optim.{names[p]}.{key}", st[key]))
    return items


def nbytes(items: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in items)


def digests(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, str]:
    """Each state tensor's dtype, shape and xxh3-64 of its bytes: equal digests mean a
    bit-exact restore (a missing or extra tensor shows as a differing key)."""
    out = {}
    for name, t in state_items(model, optim):
        data = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        out[name] = f"{t.dtype}:{tuple(t.shape)}:{xxhash.xxh3_64_hexdigest(data)}"
    return out


def differences(expected: dict[str, str], got: dict[str, str]) -> list[str]:
    """Names whose digest differs, is missing or is extra (empty: bit-exact)."""
    return sorted(k for k in expected.keys() | got.keys() if expected.get(k) != got.get(k))
