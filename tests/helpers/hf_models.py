"""Small Hugging Face causal LMs built from configs (nothing downloaded), trained a few
steps through a ``CheckpointManager``, for the Hugging Face export tests."""

from __future__ import annotations

import copy
import itertools
import os
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never online

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState, OptimizerState

VOCAB = 96


def gpt2(seed: int = 0) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 whose ``lm_head.weight`` is ``transformer.wte.weight`` (tied)."""
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def llama(seed: int = 0, tied: bool = False) -> LlamaForCausalLM:
    """A 2-layer Llama with grouped-query attention; ``tied``: its head tied too."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
        tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def tokens(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, 12), generator=g)


def logits(model: Any, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The model's logits in eval mode (no dropout)."""
    model.eval()
    with torch.no_grad():
        return model(tokens() if ids is None else ids).logits


def cast_weights(model: Any, dtype: torch.dtype) -> Any:
    """A copy of ``model`` with its floating weights (parameters and buffers in its
    state dict) cast to ``dtype``, as ``from_pretrained(dtype=...)`` builds it: buffers
    outside the state dict (Llama's rotary ``inv_freq``) stay as they are, where
    ``model.to(dtype)`` would cast them too."""
    out = copy.deepcopy(model)
    saved = set(out.state_dict())
    for name, t in itertools.chain(out.named_parameters(), out.named_buffers()):
        if name in saved and t.is_floating_point():
            t.data = t.data.to(dtype)
    return out


@dataclass
class Trained:
    model: Any
    manager: CheckpointManager


def train_and_save(
    model: Any, folder: str | os.PathLike[str], steps: int = 2, **config: Any
) -> Trained:
    """Train ``model`` ``steps`` AdamW steps, ``save(step)`` after each through a manager
    on ``folder`` (model and optimizer states); the manager stays open."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config.setdefault("async_mode", "disabled")
    manager = CheckpointManager(
        CheckpointConfig(folder=str(folder), interval=1, **config),
        {"model": ModelState(model), "optimizer": OptimizerState(model, optim)},
    )
    model.train()
    for step in range(1, steps + 1):
        ids = tokens(seed=100 + step)
        model(ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()
        manager.save(step)
    manager.wait()
    return Trained(model, manager)
