"""``saving/chain_disk.py``: what a chain of incremental saves keeps unused on disk, and
which older steps a save stops referring to once that exceeds ``max_unused``."""

from __future__ import annotations

from quicksave.saving.chain_disk import ChainDisk

MB = 1 << 20


def test_the_unused_bytes_of_a_chain() -> None:
    sizes = {"a": 4 * MB, "b": 4 * MB, "c": 4 * MB, "d": 4 * MB}
    total = 20 * MB  # (4 MB untracked: written at every save)
    full = ChainDisk.after(1, {}, sizes, total, None)
    assert full == ChainDisk({1: total}, {}, 0, total)
    # step 2 refers to a, b, c in step 1 and writes d and the untracked bytes
    two = ChainDisk.after(2, {"a": 1, "b": 1, "c": 1}, sizes, total, full)
    assert two.used == {1: 12 * MB} and two.wrote == {1: total, 2: 8 * MB}
    assert two.unused == 8 * MB  # step 1's d and untracked bytes
    # step 3 refers to a and b in 1, to d in 2 (c changed)
    three = ChainDisk.after(3, {"a": 1, "b": 1, "d": 2}, sizes, total, two)
    assert three.used == {1: 8 * MB, 2: 4 * MB}
    assert three.unused == (total - 8 * MB) + (8 * MB - 4 * MB)
    # a step the base never knew counts as a whole state's bytes (so it goes first)
    odd = ChainDisk.after(4, {"a": 7}, sizes, total, three)
    assert odd.unused == total - 4 * MB


def test_victims_free_the_most_per_byte_rewritten_until_the_bound_holds() -> None:
    total = 100 * MB
    disk = ChainDisk(
        wrote={1: 100 * MB, 2: 10 * MB, 3: 10 * MB, 4: 10 * MB, 5: 10 * MB},
        used={1: 60 * MB, 2: 1 * MB, 3: 5 * MB, 4: 1 * MB},
        unused=40 * MB + 9 * MB + 5 * MB + 9 * MB,
        total=total,
    )
    assert disk.victims(None) == frozenset()
    assert disk.victims(0.7) == frozenset()  # 63 MB unused: within 70
    assert disk.victims(0.6) == {2}  # the least used (older first among equals): 54 left
    assert disk.victims(0.5) == {2, 4}  # 45 left
    assert disk.victims(0.1) == {2, 4, 3, 1}  # the full save's last: most rewritten per freed
    assert disk.victims(0.0) == {1, 2, 3, 4}


def test_one_cheap_step_is_taken_rather_than_the_full_save() -> None:
    """A partly frozen state: the full save (step 1) holds the frozen bytes and has the
    lowest share used, but one small step frees enough alone for a quarter of the
    bytes: it is the one written again, not the frozen base."""
    disk = ChainDisk(
        wrote={1: 100, 5: 20, 6: 20, 7: 25, 8: 30},
        used={1: 40, 5: 10, 6: 10, 7: 15, 8: 18},
        unused=60 + 10 + 10 + 10 + 12,
        total=100,
    )
    assert disk.victims(1.0) == {5}  # 102 unused: 2 over; step 5 frees 10 for 10
    assert disk.victims(0.5) == {1}  # 52 over: only the full save frees that much alone
    assert disk.victims(0.0) == {1, 5, 6, 7, 8}
