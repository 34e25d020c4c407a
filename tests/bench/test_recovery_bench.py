"""A tiny run of ``quicksave bench --recovery`` (``--quick``): the report's structure,
every floor measured, every restore that ran bit-exact against the saved state, the
cold-cache eviction effective, the memory tier measured or said unavailable (never
failed), nothing left behind; and its helpers on their own (eviction, digests)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from quicksave_tools.bench import main as bench_main
from quicksave_tools.bench.recovery_child import (
    DCP,
    QUICKSAVE_DISK,
    QUICKSAVE_DISK_WHOLE,
    QUICKSAVE_MEMORY,
    QUICKSAVE_OBJECT_STORE,
    QUICKSAVE_PEER,
)
from quicksave_tools.bench.recovery_state import (
    STEP,
    cached_fraction,
    differences,
    digests,
    evict,
    trainer,
)


def _has_memory_tier() -> bool:
    import quicksave.manager

    return hasattr(quicksave.manager, "MemoryTierConfig")


def _weed_installed() -> bool:
    try:
        from quicksave_tools.testing.seaweed_process import find_weed

        find_weed()
        return True
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.slow  # a dozen fresh processes and a SeaweedFS
def test_recovery_quick_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    methods = [QUICKSAVE_DISK, QUICKSAVE_DISK_WHOLE, QUICKSAVE_MEMORY, QUICKSAVE_PEER,
               QUICKSAVE_OBJECT_STORE, DCP]  # fmt: skip
    argv = ["--recovery", "--quick", "--methods", ",".join(methods), "--loop-steps", "2"]
    rc = bench_main([*argv, "--every", "2", "--dir", str(tmp_path), "--json"])
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert rc == 0, captured.err
    assert "quicksave-disk" in captured.err and "floor" in captured.err  # the table
    assert report["quick"] is True and "posix_fadvise" in report["cold_cache"]
    [shape] = report["shapes"]
    assert shape["shape"] == "mlp" and shape["problems"] == []
    assert (
        shape["bytes"] > 0 and shape["tensors"] == 8 * 4
    )  # 4 Linear (w, b): each + step, 2 moments

    floors = shape["floors"]
    assert floors["memory"]["bytes"] == shape["bytes"]
    assert floors["memory"]["seconds"] >= floors["memory"]["copy_s"] > 0
    assert floors["disk"]["pread_s"] > 0 and floors["disk"]["bytes"] >= shape["bytes"]
    assert floors["disk"]["cached_before"] == 0.0  # the eviction took the files out
    assert "direct_s" in floors["disk"] or floors["disk"]["direct_unavailable"]
    assert floors["peer"]["bytes"] == shape["bytes"] and floors["peer"]["send_recv_s"] > 0

    restores = shape["restores"]
    assert set(restores) == set(methods)
    for method in (QUICKSAVE_DISK, QUICKSAVE_DISK_WHOLE, DCP):
        row = restores[method]
        assert row["bit_exact"] is True and row["wrong"] == [], method
        assert row["jobs"] == 2 and row["cached_before"] == 0.0, method
        assert row["fully_restored_s"] > 0 and row["restore_s"] > 0, method
        assert row["time_to_first_step_s"] is not None and row["steady_step_s"] > 0, method
        # the first step starts when load() returns, and ends no earlier
        assert 0 < row["first_step_starts_s"] <= row["time_to_first_step_s"], method
        starts = shape["ratios"]["first_step_starts_over_fully_restored"][method]
        assert starts == row["first_step_starts_s"] / row["fully_restored_s"], method
        assert shape["ratios"]["vs_floor"][method]["fully_restored"] > 0
    # the same checkpoint, read once: restored all at once, nothing left to stream
    assert shape["saves"][QUICKSAVE_DISK_WHOLE] == shape["saves"][QUICKSAVE_DISK]
    for r in shape["raw_restores"][QUICKSAVE_DISK_WHOLE]:
        if r["pass"] == "full":  # every state in place when load() returned
            assert r["streamed_restored_s"] <= r["restore_s"], r

    if _weed_installed():
        row = restores[QUICKSAVE_OBJECT_STORE]
        assert row["bit_exact"] is True, row
        assert floors["object_store"]["bytes"] >= shape["bytes"]
        assert floors["object_store"]["seconds"] > 0
    else:
        assert "no S3 test server" in restores[QUICKSAVE_OBJECT_STORE]["unavailable"]
        assert "unavailable" in floors["object_store"]

    memory, peer, loop = restores[QUICKSAVE_MEMORY], restores[QUICKSAVE_PEER], report["loop"]
    assert (loop["steps"], loop["every"], loop["repeats"]) == (2, 2, 1)
    assert list(loop["shapes"]) == ["mlp", "transformer", "embedding"] and loop["problems"] == []
    if _has_memory_tier():
        assert memory["bit_exact"] is True and memory["tiers"] == ["memory"], memory
        assert shape["ratios"]["memory_speedup"]["vs_disk"] > 0
        # rank 1 restored from rank 0's replica of its snapshot, bit-exact
        assert peer["bit_exact"] is True and peer["tiers"] == ["peer"], peer
        assert peer["jobs"] == 2 and peer["fully_restored_s"] > 0
        assert shape["ratios"]["vs_floor"][QUICKSAVE_PEER]["fully_restored"] > 0
        assert {r["rank_0_tier"] for r in shape["raw_restores"][QUICKSAVE_PEER]} == {"memory"}
        moved = shape["ratios"]["peer_bytes"]
        assert moved["state"] == moved["floor"] == shape["bytes"]  # the floor's same bytes
        assert moved["replica_sent"] >= moved["state"] and moved["snapshot_files"] >= moved["state"]
        assert shape["saves"][QUICKSAVE_PEER]["held_by_rank_0"] == {"1": [STEP]}
        for name, row in loop["shapes"].items():
            assert set(row["extra_s_per_step"]) == {
                "memory-every-1",
                "memory-every-2",
                "floor-every-1",
                "floor-every-2",
            }, name
            assert set(row["step_s"]) == {"none", *row["extra_s_per_step"]}, name
            assert all(len(runs) == 1 for runs in row["runs"].values()), name
            assert (
                set(row["over_floor"])
                == set(row["step_over_floor_step"])
                == {
                    "every-1",
                    "every-2",
                }
            ), name
    else:
        assert "no memory tier" in memory["unavailable"]
        assert "no memory tier" in peer["unavailable"]
        assert all("no memory tier" in r["unavailable"] for r in loop["shapes"].values())
        assert shape["ratios"]["memory_speedup"] == {"vs_disk": None, "vs_object_store": None}
    assert list(tmp_path.iterdir()) == []  # its folders are removed


def test_recovery_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["--recovery", "--shapes", "huge"]) == 2
    assert "known: mlp, transformer, embedding" in capsys.readouterr().err
    assert bench_main(["--recovery", "--methods", "rsync"]) == 2
    assert "methods must be some of" in capsys.readouterr().err


def test_evict_empties_the_page_cache_of_a_folder(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    for name in ("a", "sub/b"):
        (tmp_path / name).write_bytes(os.urandom(1 << 20))
    (tmp_path / "empty").write_bytes(b"")
    assert cached_fraction(str(tmp_path)) == 1.0  # just written: in the cache
    evict(str(tmp_path))
    assert cached_fraction(str(tmp_path)) == 0.0
    (tmp_path / "a").read_bytes()
    assert cached_fraction(str(tmp_path)) == 0.5


def test_digests_tell_a_bit_exact_state_from_another() -> None:
    spec = {"shape": "mlp", "quick": True}
    model, optim, steps = trainer(spec, seed=0)
    twin, twin_optim, twin_steps = trainer(spec, seed=0)
    assert differences(digests(model, optim), digests(twin, twin_optim)) == []
    steps.step()
    saved = digests(model, optim)
    assert len(saved) == 8 * 4 and differences(saved, digests(model, optim)) == []
    assert differences(saved, digests(twin, twin_optim)) == sorted(saved)  # no step yet
    twin_steps.step()
    assert differences(saved, digests(twin, twin_optim)) == []  # the same step: same bits
    with torch.no_grad():
        flat = next(model.parameters()).view(-1)
        flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))  # one bit
    assert differences(saved, digests(model, optim)) == ["model.0.weight"]
