"""The model shapes of the training-loop benchmark: three ways to hold the same ~1.6 GB of
state (~134M float32 parameters plus AdamW's two moments), so that no one layout of
tensors decides the result.

* ``mlp`` — a wide MLP: 8 × Linear(4096, 4096), 16 parameter tensors of up to 64 MiB.
* ``transformer`` — a 24-layer decoder-only language model (d_model 640, 10 heads,
  4× MLP, separate q/k/v/o projections, learned positions, a 32k vocabulary tied to the
  output head): 388 parameter tensors, most of them 0.4–6.6 MiB, ~1,550 state entries.
* ``embedding`` — a recommendation-style model: one EmbeddingBag(200,000 × 512) table
  (102M parameters: 1.23 GB of the state with its moments) whose gradient is non-zero
  only in the rows a batch looks up (≈ 4k of 200k per step), plus a small dense MLP.

More shapes are not of that state, for incremental saves (run only when named):

* ``lora`` — a LoRA-style fine-tune, a frozen base of ``size_mb`` MB (default 1536:
  24 × Linear(4096, 4096), float32) with rank-16 adapters beside every layer, the only
  tensors AdamW trains (~12 MB of state with their moments). The frozen base is the
  same whatever the seed (pretrained weights), so a resumed job that restores the
  adapters alone gets the same model.
* ``embedding-sparse`` / ``embedding-sparse-zipf`` — an EmbeddingBag(100,000 × 128)
  with ``sparse=True`` (48.8 MiB) and a small MLP, trained by Adagrad, which changes
  only the rows a step looked up (and their rows of its ``sum``): ~1 % of the rows per
  step, in a moving window of the newest rows, or Zipf-distributed over rows sorted by
  popularity (:func:`_sparse_ids`). The model counts the rows it looked up
  (``take_touched()``), so the benchmark can set the bytes an incremental save writes
  against the bytes that changed.

Each shape is ``(model, batches, loss)`` with seeded weights and data, so every method
of one run trains exactly the same thing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

__all__ = ["DEFAULT_SHAPES", "LORA_MB", "SHAPES", "Shape", "build", "mlp", "optimizer"]


@dataclass(frozen=True)
class Shape:
    """One model shape: how to build it, and what it is (for the report)."""

    name: str
    about: str
    # (seed, quick, size_mb: the state's size where the shape has one, None: its default)
    build: Callable[
        [int, bool, int | None], tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]], Any]
    ]
    # the shape's optimizer (None: AdamW, lr 1e-4)
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None
    # whether every tensor of the state changes at every step (what an incremental
    # save must then cost no more than a full one for)
    every_tensor_changes: bool = True


def mlp(hidden: int, layers: int, seed: int) -> nn.Module:
    """``layers`` Linear(hidden, hidden) with ReLU between them (hidden=4096, layers=8:
    134.25M parameters, 1.61 GB with AdamW's two moments)."""
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(hidden, hidden))
        if i < layers - 1:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def _mlp(seed: int, quick: bool, size_mb: int | None = None) -> tuple[nn.Module, list, Callable]:
    hidden, layers, batch = (256, 4, 8) if quick else (4096, 8, 32)
    model = mlp(hidden, layers, seed)
    g = torch.Generator().manual_seed(seed + 1)
    data = [(torch.randn(batch, hidden, generator=g), torch.randn(batch, hidden, generator=g))]
    data += [(torch.randn(batch, hidden, generator=g), torch.randn(batch, hidden, generator=g))]
    return model, data, nn.functional.mse_loss


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (
            p(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for p in (self.q, self.k, self.v)
        )
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class _LM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        for table in (self.tok, self.pos):
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.t()  # output head tied to the embedding


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _transformer(
    seed: int, quick: bool, size_mb: int | None = None
) -> tuple[nn.Module, list, Callable]:
    vocab, d, layers, heads, batch, seq = (
        (512, 64, 24, 4, 2, 16) if quick else (32000, 640, 24, 10, 2, 32)
    )
    torch.manual_seed(seed)
    model = _LM(vocab, d, layers, heads, context=seq)
    g = torch.Generator().manual_seed(seed + 1)
    data = []
    for _ in range(2):
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        data.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return model, data, _lm_loss


class _Recommender(nn.Module):
    def __init__(self, rows: int, dim: int, hidden: int, depth: int, sparse: bool = False) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(rows, dim, mode="sum", sparse=sparse)
        layers: list[nn.Module] = [nn.Linear(dim, hidden), nn.ReLU()]
        for _ in range(depth):
            layers += [nn.Linear(hidden, hidden), nn.ReLU()]
        layers.append(nn.Linear(hidden, 1))
        self.dense = nn.Sequential(*layers)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dense(self.table(ids)).squeeze(-1)


def _embedding(
    seed: int, quick: bool, size_mb: int | None = None
) -> tuple[nn.Module, list, Callable]:
    rows, dim, hidden, depth, batch, bag = (
        (5000, 32, 64, 2, 16, 4) if quick else (200_000, 512, 2048, 7, 256, 16)
    )
    torch.manual_seed(seed)
    model = _Recommender(rows, dim, hidden, depth)
    g = torch.Generator().manual_seed(seed + 1)
    data = []
    for _ in range(2):
        # skewed ids (a few rows are hot), as lookups of real catalogs are
        u = torch.rand(batch, bag, generator=g)
        ids = (rows * u.pow(3)).long().clamp_(max=rows - 1)
        data.append((ids, torch.randn(batch, generator=g)))
    return model, data, nn.functional.mse_loss


class _SparseRecommender(_Recommender):
    """:class:`_Recommender` with sparse gradients for its table, which also counts the
    distinct rows its training steps looked up (the rows a row-wise optimizer changes):
    :meth:`take_touched` gives their number since its last call."""

    def __init__(self, rows: int, dim: int, hidden: int, depth: int) -> None:
        super().__init__(rows, dim, hidden, depth, sparse=True)
        self._seen: list[torch.Tensor] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self._seen.append(ids.unique())
        return super().forward(ids)

    def take_touched(self) -> int:
        seen, self._seen = self._seen, []
        return int(torch.cat(seen).unique().numel()) if seen else 0


SPARSE_WINDOW = 0.02  # embedding-sparse: the hot window, a share of the rows
SPARSE_DRIFT = 0.002  # ... and how far it moves on per step
SPARSE_ZIPF = 1.2  # embedding-sparse-zipf: the exponent over rows by popularity
SPARSE_BATCHES = 64  # distinct batches (steps) before they repeat


def _sparse_ids(pattern: str, rows: int, lookups: int, g: torch.Generator) -> list[torch.Tensor]:
    """The looked-up rows of :data:`SPARSE_BATCHES` steps, ``lookups`` per step (about
    1 % of the rows distinct in either pattern):

    * ``window`` — rows in the order their items were created, the newest taking the
      traffic (news, short videos): uniform over a window of the newest
      :data:`SPARSE_WINDOW` of the rows, which moves on by :data:`SPARSE_DRIFT` of the
      rows per step as new items appear. Between two checkpoints a contiguous range
      of rows changes.
    * ``zipf`` — rows sorted by popularity (hot rows first, as frequency-ordered
      vocabularies and embedding caches keep them), drawn from a Zipf law of exponent
      :data:`SPARSE_ZIPF`: most lookups hit a few hot rows, the rest a long tail
      spread over the whole table.
    """
    out = []
    if pattern == "window":
        window, drift = max(1, round(rows * SPARSE_WINDOW)), rows * SPARSE_DRIFT
        for step in range(SPARSE_BATCHES):
            top = min(rows, window + round(step * drift))
            out.append(top - 1 - torch.randint(0, window, (lookups,), generator=g))
        return out
    weights = torch.arange(1, rows + 1, dtype=torch.float64).pow(-SPARSE_ZIPF)
    cdf = weights.cumsum(0)
    cdf = cdf / cdf[-1]
    for _ in range(SPARSE_BATCHES):
        u = torch.rand(lookups, generator=g, dtype=torch.float64)
        out.append(torch.searchsorted(cdf, u).clamp_(max=rows - 1))
    return out


def _embedding_sparse(pattern: str) -> Callable[[int, bool, int | None], tuple]:
    def build_it(
        seed: int, quick: bool, size_mb: int | None = None
    ) -> tuple[nn.Module, list, Callable]:
        rows, dim, hidden, batch = (5000, 32, 64, 32) if quick else (100_000, 128, 512, 256)
        bag = 6 if pattern == "window" else 16
        torch.manual_seed(seed)
        model = _SparseRecommender(rows, dim, hidden, 1)
        g = torch.Generator().manual_seed(seed + 1)
        data = [
            (ids.view(batch, -1), torch.randn(batch, generator=g))
            for ids in _sparse_ids(pattern, rows, batch * bag, g)
        ]
        return model, data, nn.functional.mse_loss

    return build_it


def _adagrad(model: nn.Module) -> torch.optim.Optimizer:
    # Adagrad takes the table's sparse gradients (updating, with its ``sum``, only the
    # rows looked up) and the MLP's dense ones in one optimizer, as DLRM-style
    # recommenders train; AdamW refuses sparse gradients.
    return torch.optim.Adagrad(model.parameters(), lr=1e-2)


class _LoraLayer(nn.Module):
    def __init__(self, d: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.down = nn.Linear(d, rank, bias=False)
        self.up = nn.Linear(rank, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + self.up(self.down(x)))


LORA_MB = 1536  # the frozen base of the ``lora`` shape, by default


def _lora(seed: int, quick: bool, size_mb: int | None = None) -> tuple[nn.Module, list, Callable]:
    d, rank, batch = (256, 4, 4) if quick else (4096, 16, 4)
    mb = 1 if quick else (size_mb or LORA_MB)
    layers = max(1, round(mb * 2**20 / (d * d * 4)))
    torch.manual_seed(0)  # the pretrained base: the same in every job
    model = nn.Sequential(*(_LoraLayer(d, rank) for _ in range(layers)))
    torch.manual_seed(seed)
    for layer in model:
        nn.init.normal_(layer.down.weight, std=d**-0.5)
        nn.init.normal_(layer.up.weight, std=0.01)
    g = torch.Generator().manual_seed(seed + 1)
    data = [(torch.randn(batch, d, generator=g), torch.randn(batch, d, generator=g))]
    data += [(torch.randn(batch, d, generator=g), torch.randn(batch, d, generator=g))]
    return model, data, nn.functional.mse_loss


# The shapes a run takes when none are named (``lora`` only when asked for).
DEFAULT_SHAPES = ("mlp", "transformer", "embedding")

SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("mlp", "wide MLP, 8 × Linear(4096, 4096): 16 parameter tensors", _mlp),
        Shape(
            "transformer",
            "24-layer LM, d 640, 32k vocab (tied): 388 parameter tensors",
            _transformer,
        ),
        Shape(
            "embedding",
            "EmbeddingBag 200k × 512 (sparse gradients) + 8-layer MLP of width 2048",
            _embedding,
        ),
        Shape(
            "lora",
            "frozen base of N × Linear(4096, 4096) with rank-16 adapters (AdamW on them)",
            _lora,
            every_tensor_changes=False,
        ),
        Shape(
            "embedding-sparse",
            "EmbeddingBag 100k × 128 (sparse=True) + 3-layer MLP, Adagrad; each step looks "
            "up ~1 % of the rows, in a window of the newest 2 % moving on 0.2 % a step",
            _embedding_sparse("window"),
            _adagrad,
            every_tensor_changes=False,
        ),
        Shape(
            "embedding-sparse-zipf",
            "EmbeddingBag 100k × 128 (sparse=True) + 3-layer MLP, Adagrad; each step looks "
            f"up ~1 % of the rows, Zipf ({SPARSE_ZIPF}) over rows sorted by popularity",
            _embedding_sparse("zipf"),
            _adagrad,
            every_tensor_changes=False,
        ),
    )
}


def optimizer(shape: str | None, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer the shape ``shape`` trains with (None, or a shape without one of
    its own: AdamW, lr 1e-4, on every parameter: a frozen one has no gradient)."""
    make = SHAPES[shape].optimizer if shape in SHAPES else None
    if make is not None:
        return make(model)
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def build(
    shape: str, seed: int, quick: bool = False, size_mb: int | None = None
) -> tuple[nn.Module, list, Callable]:
    """The seeded model, its batches (inputs, targets) and its loss function
    (``size_mb``: the size of a shape that has one, e.g. ``lora``'s frozen base)."""
    try:
        return SHAPES[shape].build(seed, quick, size_mb)
    except KeyError:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}") from None
