"""Replicated entries: what several ranks save under one name must be equal.

A checkpoint keeps one copy of each name. When several ranks hold a name, planning
writes one rank's copy (the replicated weights of data parallelism are written once);
a load gives that copy to every rank. That is right when the copies are equal and
silently wrong when they are not: each rank's data loader position under a plain name
would come back as one rank's. So the copies are compared when the ranks' plans meet,
and a difference fails the save on every rank, naming the name, the ranks, their values
and ``quicksave.PerRank``, the wrapper that gives each rank an entry of its own.

The rule (docs/ARCHITECTURE.md, "Replicated entries"):

- every non-tensor value that several ranks save is compared (a digest of its typed-JSON
  encoding: equal means equal bit for bit, ``-0.0`` is not ``0.0``);
- a tensor chunk that several ranks save is compared when it is on the CPU and at most
  ``CHECK_BYTES``: scalars, counters, RNG states, small buffers. Bigger chunks and chunks
  on an accelerator are written from one holder without comparing (reading every
  replicated weight of a data-parallel model on every save would cost a pass over the
  model and a device synchronisation; data parallelism keeps those equal by design).

Where it runs (no collective of its own): ``quicksave.save`` (``saving/sync_save.py``)
and the NVRx API's DCP planning (``adapters/dcp_save_planner.py``) send every rank's
copies to the coordinator with its local plan; the async engine sends them with its
plan on a plan-cache miss, and on a hit every rank votes a fingerprint of its shared
copies in the one all-reduce it makes anyway (``saving/plan_vote.agree_save``);
fingerprints that differ send the copies to the coordinator, which names what differs.
Which entries a rank holds and shares (``local_copies``, ``shared_keys``) is the
planner's business: ``saving/rank_plans.py``.

Example::

    a = {"v:pos": value_copy("pos", 100)}
    b = {"v:pos": value_copy("pos", 101)}
    error = divergence([a, b])       # IncompatibleStateError naming pos, ranks 0 and 1
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from quicksave.errors import IncompatibleStateError
from quicksave.format.dtypes import dtype_name

if TYPE_CHECKING:
    import torch

CHECK_BYTES = 64 * 1024  # replicated tensor chunks up to this size are compared
SUMMARY_CHARS = 60
FINGERPRINT_BITS = 60
NEUTRAL = 1 << 62  # a rank with no shared copy: above every fingerprint in the MIN vote
_PREVIEW = 6  # elements of a tensor shown in its summary


@dataclass(frozen=True)
class Copy:
    """One rank's copy of an entry that other ranks may hold too.

    Attributes:
        fqn: the entry's name in the checkpoint.
        digest: xxh3-64 (hex) of its bytes (tensors) or canonical JSON (values).
        summary: a short rendering for error messages ("" when not asked for).
    """

    fqn: str
    digest: str
    summary: str = ""


def value_key(fqn: str) -> str:
    """The entry key of a non-tensor value (tensors' keys cannot collide with it)."""
    return f"v:{fqn}"


def tensor_key(chunk_key: str) -> str:
    """The entry key of a tensor chunk (``plan.chunk_key``)."""
    return f"t:{chunk_key}"


def value_copy(fqn: str, encoded: Any, describe: bool = True) -> Copy:
    """The copy of a value from its typed-JSON encoding (``format.objects.encode``)."""
    text = json.dumps(encoded, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    digest = xxhash.xxh3_64_hexdigest(text.encode("utf-8", "surrogatepass"))
    return Copy(fqn, digest, _clip(text) if describe else "")


def checked(tensor: torch.Tensor) -> bool:
    """Whether a replicated chunk is compared: on the CPU and at most ``CHECK_BYTES``."""
    return tensor.device.type == "cpu" and tensor.numel() * tensor.element_size() <= CHECK_BYTES


def tensor_copy(fqn: str, tensor: torch.Tensor, describe: bool = True) -> Copy | None:
    """The copy of a tensor chunk, or None if it is not compared (see ``checked``)."""
    from quicksave.checksum import tensor_view

    if not checked(tensor):
        return None
    t = tensor.detach().contiguous()
    digest = xxhash.xxh3_64_hexdigest(tensor_view(t))
    return Copy(fqn, digest, _tensor_summary(t, digest) if describe else "")


def _tensor_summary(t: torch.Tensor, digest: str) -> str:
    head = f"{dtype_name(t.dtype)}{list(t.shape)}"
    try:
        flat = t.reshape(-1)[:_PREVIEW].tolist()
    except (RuntimeError, TypeError):  # dtypes without Python scalars (bits*, uint1..7)
        return f"{head} xxh3 {digest}"
    shown = flat[0] if t.dim() == 0 else flat
    more = "…" if t.numel() > _PREVIEW else ""
    return _clip(f"{head} {shown}{more}")


def _clip(text: str) -> str:
    return text if len(text) <= SUMMARY_CHARS else text[: SUMMARY_CHARS - 1] + "…"


def fingerprint(copies: Mapping[str, Copy]) -> int | None:
    """A ``FINGERPRINT_BITS`` number of these copies (keys and digests), or None if
    there are none. Equal on two ranks iff (but for hash collisions) they hold the same
    shared entries with the same bytes."""
    if not copies:
        return None
    h = xxhash.xxh3_64()
    for key in sorted(copies):
        h.update(f"{key}\0{copies[key].digest}\n".encode("utf-8", "surrogatepass"))
    return h.intdigest() >> (64 - FINGERPRINT_BITS)


def divergence(copies: Sequence[Mapping[str, Copy]]) -> IncompatibleStateError | None:
    """Compare every entry that several ranks sent (``copies[r]``: rank r's copies).

    Returns:
        None if all copies of every shared entry are equal, else the error every rank
        raises: it names the first differing entry (fqn), each rank's value, the lowest
        rank whose copy differs (``rank``) and the fix; other differing entries are
        listed after it.
    """
    by_key: dict[str, list[tuple[int, Copy]]] = {}
    for r, cs in enumerate(copies):
        for key, c in cs.items():
            by_key.setdefault(key, []).append((r, c))
    differing = sorted(
        (held[0][1].fqn, key)
        for key, held in by_key.items()
        if len(held) > 1 and len({c.digest for _, c in held}) > 1
    )
    if not differing:
        return None
    fqn, key = differing[0]
    held = by_key[key]
    first_digest = held[0][1].digest
    rank = next(r for r, c in held if c.digest != first_digest)
    top = fqn.split(".", 1)[0]
    more = ""
    if len(differing) > 1:
        names = [f for f, _ in differing[1:]]
        more = f" (also different across ranks: {_some(names)})"
    return IncompatibleStateError(
        f"ranks hold different values under one name ({_by_value(held)}), and a "
        "checkpoint keeps one value per name: a load would give every rank the same one. "
        "Register state that differs per rank (a data loader's position, per-rank "
        f"counters) as quicksave.PerRank(...), e.g. {{{top!r}: quicksave.PerRank(obj)}}: "
        "each rank then saves and restores its own entry; if it should be equal on every "
        "rank, make it so before saving (e.g. all-reduce a logged loss); nothing was saved" + more,
        fqn=fqn,
        rank=rank,
    )


def _by_value(held: list[tuple[int, Copy]]) -> str:
    """``rank 0: 100; rank 1: 101`` (ranks with equal copies grouped, 4 groups shown)."""
    groups: dict[str, list[int]] = {}
    summary: dict[str, str] = {}
    for r, c in held:
        groups.setdefault(c.digest, []).append(r)
        summary.setdefault(c.digest, c.summary or f"xxh3 {c.digest}")
    parts = []
    for digest, ranks in list(groups.items())[:4]:
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_some(ranks, 8)}"
        parts.append(f"{who}: {summary[digest]}")
    if len(groups) > 4:
        parts.append(f"… ({len(groups)} different values in all)")
    return "; ".join(parts)


def _some(items: Sequence[Any], limit: int = 5) -> str:
    shown = ", ".join(str(x) for x in items[:limit])
    return shown + (f", … ({len(items)} in all)" if len(items) > limit else "")
