"""The block views of an incremental save (``saving/block_split.py``): cut once and
kept while a tensor's memory, layout and counter stay — a state dict's tensors are new
objects at every save — and cut again, on the new memory, as soon as one of them moves."""

from __future__ import annotations

import torch

from quicksave.saving.block_split import Blocks, _cut_key
from quicksave.saving.config import IncrementalConfig
from quicksave.saving.rank_plans import collect_local

BLOCK = 4 << 10


def _blocks(blocks: Blocks, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    state = collect_local({"w": weight.detach(), "b": torch.zeros(4)}, 0, whole=True)
    return {k: t for k, t in blocks.blocked(state).tensors.items() if k != "b"}


def test_views_are_kept_while_the_memory_stays_and_cut_again_when_it_moves() -> None:
    blocks = Blocks(IncrementalConfig(enabled=True, block_bytes=BLOCK, min_bytes=1))
    weight = torch.nn.Parameter(torch.randn(64, 64), requires_grad=False)  # 4 blocks
    first = _blocks(blocks, weight)
    assert len(first) == 4
    assert not blocks.kept  # (nothing before: cut)
    again = _blocks(blocks, weight)  # a new detached tensor, the same memory
    assert all(again[k] is first[k] for k in first)
    assert blocks.kept == set(first)  # steady: its blocks' counters need no reading

    with torch.no_grad():
        weight[3] += 1.0  # the counter moves: cut again
    moved = _blocks(blocks, weight)
    assert all(moved[k] is not first[k] for k in first)
    assert not blocks.kept
    assert torch.equal(torch.cat(list(moved.values())), weight.detach())

    weight.data = torch.randn(64, 64)  # other memory, its counter untouched
    swapped = _blocks(blocks, weight)
    assert not blocks.kept
    storage = weight.untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == storage for v in swapped.values())
    assert torch.equal(torch.cat(list(swapped.values())), weight.detach())

    weight.data = weight.data.t().contiguous().t()  # other memory and strides
    strided = _blocks(blocks, weight)
    assert torch.equal(torch.cat(list(strided.values())), weight.detach())
    storage = weight.untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == storage for v in strided.values())


def test_an_inference_tensor_written_in_place_is_read_anew() -> None:
    """Written in inference mode, where no counter moves: the views (kept or not) lie
    on its memory and read the write; one with no counter at all is never kept."""
    blocks = Blocks(IncrementalConfig(enabled=True, block_bytes=BLOCK, min_bytes=1))
    with torch.inference_mode():
        weight = torch.randn(64, 64)
    _blocks(blocks, weight)
    with torch.inference_mode():
        weight[5] = 3.0
    again = _blocks(blocks, weight)
    assert torch.equal(torch.cat(list(again.values())), weight)
    with torch.inference_mode():
        assert _cut_key(weight, weight) is None


def test_kept_views_no_longer_on_the_tensors_memory_are_cut_again() -> None:
    """A kept view whose storage was resized away under it (another storage may then lie
    at the tensor's address, with a counter reading the same) is not the tensor's memory:
    the views are cut again, though the cut key matches (white box: the kept entry's
    first view is made to lie elsewhere)."""
    blocks = Blocks(IncrementalConfig(enabled=True, block_bytes=BLOCK, min_bytes=1))
    weight = torch.nn.Parameter(torch.randn(64, 64), requires_grad=False)
    first = _blocks(blocks, weight)
    at, views = blocks._views["w"]
    elsewhere = torch.zeros(64, 64)
    blocks._views["w"] = (at, [(views[0][0], elsewhere[:16], views[0][2]), *views[1:]])
    again = _blocks(blocks, weight)
    assert not blocks.kept
    assert all(again[k] is not first[k] for k in first)
    assert torch.equal(torch.cat(list(again.values())), weight.detach())
    _blocks(blocks, weight)
    assert blocks.kept == set(first)  # (intact again: kept)
