"""Tracked CPU blocks that the kernel proves unwritten since they were hashed
(``IncrementalConfig.watch_writes``; the kernel's side: ``saving/write_watch.py``).

**The rule (never stale).** A block's digest is recorded only from bytes read *after*
the protection its record's token names: :meth:`CleanBlocks.protect` watches a block
(its pages protected) before anything hashes it, the block is hashed after (here, or
by the background copy or the writer: every digest a save reports for it was read
after), and :meth:`CleanBlocks.hashed` / :meth:`CleanBlocks.settled` record it under
that token. At the next save :meth:`CleanBlocks.check` returns the recorded digest
only if the block is the same memory (same address and size, of the same storage,
still held) and the kernel reports no page of it written since. A scan that finds a
write re-protects the pages atomically and gives the record a new token: a digest read
before it (a slow save's, still to come) is refused, one read after is recorded. A
range no longer registered, another address, a moved counter: the record goes and the
block is watched anew. So a write from any thread after the protection is reported at
the next check, and a digest is never taken as current past a write.

**What is watched.** Blocks of CPU tensors, contiguous, neither pinned (a device may
write it by DMA, which bypasses the page tables) nor shared (another process may write
it), lying in private anonymous mappings (not a file's pages: a file mapped privately
still reads the file's new bytes where this process has not written), and whose
tensor's version counter stood still over the last save interval (before the first
save: since ``prepare()``, :meth:`CleanBlocks.observe`): a tensor written at every step
(training) is never watched, so it pays neither faults nor scans (a write to a page
just protected costs a fault, ~0.3 ms per MB here: about 13× a hash of it). The
counter is only that cost hint; whether a block is unchanged is the kernel's word.

**Memory identity.** The storage of every block watched is held (a strong reference)
while it is watched: the allocator can then neither free the pages nor give them to
another tensor, and a discarded page (``MADV_DONTNEED``) — which reads as zeros
without counting as written — cannot happen to them. A storage resized in place gets
other memory: its address or size differs and the record goes. A tensor no longer
saved (or swapped for another) is let go at the next save; :meth:`CleanBlocks.close`
lets all go.

A block found written at ``_STRIKES`` checks in a row is unwatched and rests for a
while (each rest twice as long, up to ``_MAX_REST`` saves), so a tensor written behind
its counter at every step costs little more than a hash.

Call order: one save at a time, on the caller's lock (``Increments``):
:meth:`check` of the tracked blocks → :meth:`protect` (before any
hash of those blocks) → :meth:`hashed` → later :meth:`settled` with that save's
result. No I/O besides the ioctls and ``/proc/self/maps``.
"""

from __future__ import annotations

import itertools
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import torch

from quicksave.saving.guard import counter
from quicksave.saving.write_watch import WriteWatch

_STRIKES = 2  # consecutive saves found written before a block is unwatched
_MAX_REST = 64  # saves a block rests unwatched, at most


@dataclass
class _Record:
    """A block watched since ``token``'s protection; ``digest``: of its bytes read
    after it (None: not yet known)."""

    wid: int  # its watch (``WriteWatch.watch``)
    ptr: int
    nbytes: int
    storage: torch.UntypedStorage  # held: its pages stay this block's
    storage_ptr: int
    storage_nbytes: int
    view: torch.Tensor  # the block as protected (kept views come back: the same object)
    token: int  # which protection a digest must have been read after
    digest: str | None = None


def _key(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel() * t.element_size()


def _version(src: torch.Tensor) -> tuple[int, int]:
    version = counter(src)
    return src.data_ptr(), -1 if version is None else version


class CleanBlocks:
    """Per tracked block name: what the kernel proves about it (see the module doc).

    Args:
        watch: the kernel's write tracking (probed at the first use; unavailable:
            nothing is ever clean and every block is hashed).

    Attributes:
        skipped: bytes whose hash the latest save spared (blocks found clean).
    """

    def __init__(self, watch: WriteWatch) -> None:
        self._watch = watch
        self._records: dict[str, _Record] = {}
        self._seen: dict[str, tuple[int, int]] = {}  # name -> (data_ptr, counter) last save
        self._strikes: dict[str, int] = {}
        self._rest: dict[str, int] = {}  # name -> saves it stays unwatched
        self._next_rest: dict[str, int] = {}  # name -> its next rest (doubles)
        self._tokens = itertools.count(1)
        self.skipped = 0

    def available(self) -> bool:
        return self._watch.available()

    def begin(self, names: set[str]) -> None:
        """A new save of the tracked ``names``: records of other blocks go."""
        self.skipped = 0
        for name in [n for n in self._records if n not in names]:
            self._drop(name)
        for name in [n for n in self._seen if n not in names]:
            del self._seen[name]
        for name, left in list(self._rest.items()):
            if left <= 1:
                del self._rest[name]
            else:
                self._rest[name] = left - 1

    def observe(self, blocks: list[tuple[str, torch.Tensor]]) -> None:
        """The ``(name, source)`` blocks as they are now, taken as the last save's for
        :meth:`check`'s steady hint where no save saw them yet (``prepare()``, before
        the first save)."""
        for name, src in blocks:
            if name not in self._seen:
                self._seen[name] = _version(src)

    def _drop(self, name: str) -> None:
        rec = self._records.pop(name, None)
        if rec is not None:
            self._watch.unwatch(rec.wid)

    @staticmethod
    def _same_memory(rec: _Record, t: torch.Tensor, storages: dict[int, bool]) -> bool:
        # (the held storage keeps its memory: the same address is the same memory,
        # unless that storage itself was resized, i.e. moved; the view protected, come
        # back, lies where it lay if its storage did not move: its offset is its own)
        if t is not rec.view and (
            t.data_ptr() != rec.ptr or t.numel() * t.element_size() != rec.nbytes
        ):
            return False
        s = rec.storage
        same = storages.get(id(s))  # (a tensor's blocks share one storage: checked once)
        if same is None:
            same = storages[id(s)] = (
                s.data_ptr() == rec.storage_ptr and s.nbytes() == rec.storage_nbytes
            )
        return same

    def check(
        self,
        blocks: list[tuple[str, torch.Tensor, torch.Tensor]],
        kept: AbstractSet[str] = frozenset(),
    ) -> tuple[dict[str, str], set[str]]:
        """Of the ``(name, block, source)`` tracked: the digests of the blocks whose
        bytes the kernel proves unwritten since they were hashed (one scan per run of
        adjacent blocks), and the *steady* ones, whose source's address and version
        counter are those of the last save (a hint only: whether to watch a block);
        ``kept``: blocks known steady already (``Blocks.kept``: their views were kept,
        their tensor's address, layout and counter unchanged), whose counters are not
        read again. A block absent from the digests is to be :meth:`protect`-ed, if
        steady and ``watchable`` (a block still watched keeps its watch, protected
        again by the scan just made); one not steady is unwatched (being trained)."""
        seen_all, records = self._seen, self._records
        steady: set[str] = set()
        ask: dict[int, tuple[str, _Record]] = {}
        storages: dict[int, bool] = {}
        for name, t, src in blocks:
            if name in kept:
                steady.add(name)
            elif seen_all.get(name) == (seen := _version(src)):
                steady.add(name)
            else:
                seen_all[name] = seen
            rec = records.get(name)
            if rec is None:
                continue
            # (the view protected, kept: Blocks found its tensor's address and layout
            # those it was cut at, and its storage is held)
            same = (t is rec.view and name in kept) or self._same_memory(rec, t, storages)
            if name not in steady or not same:
                self._drop(name)
            elif rec.digest is not None:  # (None: never hashed since protected: hashed now)
                ask[rec.wid] = (name, rec)
        out: dict[str, str] = {}
        for wid, written in self._watch.written_many(list(ask)).items():
            name, rec = ask[wid]
            if written is False:
                self.skipped += rec.nbytes
                out[name] = rec.digest  # type: ignore[assignment]
            elif written is None:  # no longer registered: watched anew
                self._drop(name)
            else:
                self._written(name, rec)
        if self._strikes:  # (found unwritten: the strikes start again)
            for name in out:
                self._strikes.pop(name, None)
        return out, steady

    def _written(self, name: str, rec: _Record) -> None:
        """``rec``'s block was written: protected again by the scan, so a digest read
        from now on holds (a new token); written again and again, it rests a while."""
        rec.digest, rec.token = None, next(self._tokens)
        strikes = self._strikes.get(name, 0) + 1
        self._strikes[name] = strikes
        if strikes >= _STRIKES:
            self._drop(name)
            rest = self._next_rest.get(name, 2)
            self._rest[name] = rest
            self._next_rest[name] = min(2 * rest, _MAX_REST)
            self._strikes.pop(name, None)

    def watchable(self, name: str, t: torch.Tensor) -> bool:
        """Whether ``t``'s block may be watched (the kernel sees every write to it)."""
        return (
            name not in self._rest
            and t.device.type == "cpu"
            and t.is_contiguous()
            and t.numel() > 0
            and not t.is_pinned()
            and not t.is_shared()
        )

    def protect(self, blocks: dict[str, torch.Tensor]) -> dict[str, int]:
        """Protect ``blocks`` (before anything hashes them; one still watched is
        protected already): name -> the protection's token, for :meth:`hashed` /
        :meth:`settled`. A block the kernel refuses, or outside private anonymous
        memory, is left out (hashed as always)."""
        tokens: dict[str, int] = {}
        new = [n for n in blocks if n not in self._records]
        for name in blocks:
            if name in self._records:
                tokens[name] = self._records[name].token
        if not new or not self._watch.available():
            return tokens
        private = self._watch.private_anonymous([_key(blocks[n]) for n in new])
        new = [n for n, ok in zip(new, private, strict=True) if ok]
        wids = self._watch.watch_many([_key(blocks[n]) for n in new])
        for name, wid in zip(new, wids, strict=True):
            t = blocks[name]
            ptr, nbytes = _key(t)
            if wid is None:
                continue
            s = t.untyped_storage()
            token = next(self._tokens)
            self._records[name] = _Record(wid, ptr, nbytes, s, s.data_ptr(), s.nbytes(), t, token)
            tokens[name] = token
        return tokens

    def hashed(self, name: str, token: int | None, digest: str) -> None:
        """``digest`` of the block's bytes, read after its protection ``token``."""
        rec = self._records.get(name)
        if token is not None and rec is not None and rec.token == token:
            rec.digest = digest

    def settled(self, tokens: dict[str, int], digests: dict[str, str]) -> None:
        """A save committed with ``digests`` (read after the protections ``tokens``)."""
        for name, token in tokens.items():
            digest = digests.get(name)
            if digest is not None:
                self.hashed(name, token, digest)

    def close(self) -> None:
        """Drop every record and registration (the held storages go)."""
        self._records.clear()
        self._watch.close()
