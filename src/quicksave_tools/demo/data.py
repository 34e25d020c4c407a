"""Demo data: the text shipped with the package, a character tokenizer, and a batch
sampler that can be checkpointed and resumed exactly.

The sampler is ``Stateful``: its ``state_dict()`` holds the state of its own
``torch.Generator`` and the number of batches drawn so far, so a run restored from a
checkpoint draws the very batches the uninterrupted run would have drawn next.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch

from quicksave.errors import IncompatibleStateError


def load_corpus() -> str:
    """Concatenate the ``demo/data/*.txt`` files shipped inside the package.

    Files are read in name order so every process builds the same corpus.

    Returns:
        The text of all files, separated by blank lines.

    Raises:
        FileNotFoundError: the package was installed without its data files.

    Example:
        >>> text = load_corpus()
        >>> len(text) > 30_000
        True
    """
    folder = resources.files("quicksave_tools.demo") / "data"
    names = sorted(p.name for p in folder.iterdir() if p.name.endswith(".txt"))
    if not names:
        raise FileNotFoundError(f"no demo text files found in {folder}; reinstall quicksave")
    return "\n\n".join((folder / n).read_text(encoding="utf-8") for n in names)


@dataclass(frozen=True)
class CharTokenizer:
    """Maps each distinct character of a corpus to an id (sorted, so deterministic).

    Example:
        >>> tok = CharTokenizer.from_text("abca")
        >>> tok.decode(tok.encode("cab"))
        'cab'
    """

    chars: str

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """Build the vocabulary of ``text``."""
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Ids of ``text`` as a 1-D int64 tensor.

        Raises:
            ValueError: ``text`` holds a character outside the vocabulary.
        """
        index = {c: i for i, c in enumerate(self.chars)}
        try:
            return torch.tensor([index[c] for c in text], dtype=torch.long)
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """The text of ``ids``."""
        return "".join(self.chars[int(i)] for i in ids)


class BatchSampler:
    """Draws random windows of ``context + 1`` tokens as (input, target) batches.

    Deterministic for a given seed and resumable: ``state_dict()`` captures the
    generator state and the batch count; ``load_state_dict()`` puts both back, after
    checking that the sampler is over the same data with the same shape.

    Args:
        tokens: the whole corpus as a 1-D int64 tensor.
        batch_size: windows per batch.
        context: tokens per input window.
        seed: seeds the sampler's private generator (the global RNG is not touched).

    Raises:
        ValueError: the corpus is too short for one window.

    Example:
        >>> s = BatchSampler(torch.arange(100), batch_size=2, context=8, seed=0)
        >>> saved = s.state_dict()
        >>> x1, _ = s.next_batch()
        >>> s.load_state_dict(saved)
        >>> torch.equal(s.next_batch()[0], x1)
        True
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, context: int, seed: int) -> None:
        if tokens.dim() != 1 or tokens.numel() < context + 2:
            raise ValueError(
                f"need a 1-D token tensor of at least {context + 2} tokens, "
                f"got shape {tuple(tokens.shape)}"
            )
        self.tokens = tokens
        self.batch_size = batch_size
        self.context = context
        self.seed = seed
        self.batches_drawn = 0
        self._gen = torch.Generator()
        self._gen.manual_seed(seed)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (inputs, targets) pair, each of shape (batch_size, context)."""
        high = self.tokens.numel() - self.context - 1
        starts = torch.randint(0, high, (self.batch_size,), generator=self._gen)
        offsets = torch.arange(self.context + 1)
        windows = self.tokens[starts[:, None] + offsets[None, :]]
        self.batches_drawn += 1
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue with the next batch (a fresh copy)."""
        return {
            "generator": self._gen.get_state(),
            "batches_drawn": self.batches_drawn,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "context": self.context,
            "num_tokens": int(self.tokens.numel()),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (as returned by :meth:`state_dict`).

        Raises:
            IncompatibleStateError: ``state`` was saved by a sampler over other data or
                with another batch shape (the message names the field); nothing is
                changed then.
        """
        for key in ("seed", "batch_size", "context", "num_tokens"):
            mine = getattr(self, key) if key != "num_tokens" else int(self.tokens.numel())
            if key not in state:
                raise IncompatibleStateError("sampler state is missing a field", fqn=key)
            if int(state[key]) != mine:
                raise IncompatibleStateError(
                    f"sampler state was saved with {key}={state[key]} but this sampler has "
                    f"{key}={mine}; resume with the same data and batch settings",
                    fqn=key,
                )
        gen_state = state["generator"]
        if not isinstance(gen_state, torch.Tensor) or gen_state.dtype != torch.uint8:
            raise IncompatibleStateError(
                "sampler generator state must be a uint8 tensor", fqn="generator"
            )
        self._gen.set_state(gen_state.clone())
        self.batches_drawn = int(state["batches_drawn"])
