"""A small decoder-only transformer language model for the demo.

Token and position embeddings, a stack of pre-norm blocks (causal self-attention, then an
MLP, each with a residual connection), a final norm and a head tied to the token
embedding. Small enough to train on two CPU cores in a minute, large enough (about 0.8 M
parameters plus AdamW state) that a checkpoint is several megabytes.

Attention is written out by hand rather than with ``scaled_dot_product_attention`` so the
dropout inside it draws from the ordinary torch RNG, which the demo checkpoints and
restores (``RNGState``); that is what makes a resumed run bit-exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the model.

    Attributes:
        vocab_size: number of distinct tokens (characters).
        context: the longest sequence the model reads (positions).
        d_model: width of the residual stream.
        n_layers: number of transformer blocks.
        n_heads: attention heads per block; must divide ``d_model``.
        dropout: dropout probability after attention weights and in residual branches.
        tied_head: reuse the token embedding matrix as the output head.
    """

    vocab_size: int
    context: int = 64
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    dropout: float = 0.1
    tied_head: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.vocab_size < 1 or self.context < 1:
            raise ValueError("vocab_size and context must be positive")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees only positions <= t."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.context, cfg.context, dtype=torch.bool))
        # Derived from the config, so it stays out of the state dict (and the checkpoint).
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Character-level decoder-only language model.

    Example:
        >>> model = TinyLM(ModelConfig(vocab_size=60))
        >>> logits, loss = model(torch.zeros(2, 8, dtype=torch.long))
        >>> tuple(logits.shape)
        (2, 8, 60)
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tied_head:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position, and the mean cross-entropy if ``targets`` is given.

        Args:
            idx: token ids, shape (batch, t) with t <= context.
            targets: next-token ids, same shape as ``idx``.

        Returns:
            (logits of shape (batch, t, vocab), loss or None).

        Raises:
            ValueError: the sequence is longer than the model's context.
        """
        t = idx.size(1)
        if t > self.cfg.context:
            raise ValueError(f"sequence length {t} exceeds the context of {self.cfg.context}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
