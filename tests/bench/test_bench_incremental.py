"""``quicksave bench --training`` and incremental saves: the sparse embedding shapes (what
their steps change), a tiny real run of one with a small block size, and the
side-by-side ratios (:mod:`quicksave_tools.bench.training_incremental`)."""

from __future__ import annotations

import json

import pytest
import torch

from quicksave_tools.bench import main
from quicksave_tools.bench.shapes import DEFAULT_SHAPES, SHAPES, build, optimizer
from quicksave_tools.bench.training_incremental import incremental_rows, incremental_table
from quicksave_tools.bench.training_report import format_training_report


@pytest.mark.parametrize("shape", ["embedding-sparse", "embedding-sparse-zipf"])
def test_a_sparse_embedding_step_changes_only_the_rows_it_looked_up(shape: str) -> None:
    assert shape not in DEFAULT_SHAPES and not SHAPES[shape].every_tensor_changes
    model, batches, loss_fn = build(shape, seed=0)
    rows = model.table.weight.shape[0]
    assert model.table.sparse and rows == 100_000
    # about 1 % of the rows per step, a fresh draw at every step
    for ids, _ in batches[:8]:
        assert 0.008 * rows < ids.unique().numel() < 0.013 * rows
    assert not torch.equal(batches[0][0], batches[1][0])
    if shape == "embedding-sparse":  # a window of the newest 2 % of the rows
        assert all(int(ids.max() - ids.min()) < 0.02 * rows for ids, _ in batches)
    optim = optimizer(shape, model)
    assert isinstance(optim, torch.optim.Adagrad)
    table = model.table.weight
    before = (table.detach().clone(), optim.state[table]["sum"].clone())
    model.take_touched()
    for ids, target in batches[:3]:
        optim.zero_grad(set_to_none=True)
        loss_fn(model(ids), target).backward()
        optim.step()
    looked_up = torch.cat([ids.reshape(-1) for ids, _ in batches[:3]]).unique()
    for old, new in zip(before, (table.detach(), optim.state[table]["sum"]), strict=True):
        changed = (old != new).any(dim=1).nonzero().reshape(-1)
        assert torch.equal(changed, looked_up)
    assert model.take_touched() == looked_up.numel() and model.take_touched() == 0


def test_quick_sparse_embedding_run_sets_bytes_against_the_full_save_and_the_change(
    tmp_path, capsys
) -> None:
    methods = "quicksave-process,quicksave-incremental"
    argv = ["--training", "--quick", "--shapes", "embedding-sparse", "--methods", methods]
    rc = main([*argv, "--incremental-block-kb", "16", "--dir", str(tmp_path), "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = json.loads(captured.out)
    assert report["config"]["incremental_block_kb"] == 16
    sh = report["shapes"]["embedding-sparse"]
    full, incr = (sh["methods"][m] for m in methods.split(","))
    state = sh["state"]["bytes"]
    for m in (full, incr):
        assert [e["step"] for e in m["runs"][0]["events"]] == [2, 4, 6]
        assert all(e["rows_touched"] > 0 for e in m["runs"][0]["events"])
        # the quick table: 5000 × 32 float32, and Adagrad's sum of the same rows
        per_row, whole = 2 * 32 * 4, state - 5000 * 2 * 32 * 4
        assert m["changed_later_median_bytes"] == pytest.approx(
            m["rows_touched_later_median"] * per_row + whole, rel=1e-3
        )
    # the same training: the same rows changed whichever method saved them
    assert full["rows_touched_later_median"] == incr["rows_touched_later_median"]
    # a full save writes the state every time; an incremental one what changed and more
    # (whole 16 KiB blocks, the manifest), far from all of it with blocks this small
    assert full["disk_later_median_bytes"] >= state
    assert incr["disk_first_bytes"] >= state
    changed = incr["changed_later_median_bytes"]
    assert changed <= incr["disk_later_median_bytes"] < full["disk_later_median_bytes"] / 3
    rows = {(r["shape"], r["what"].split(" (")[0]): r for r in report["incremental"]}
    fewer = rows[("embedding-sparse", "bytes on disk per later save: quicksave-process / this")]
    assert fewer["cmp"] == "≥" and fewer["limit"] == 5.0
    assert fewer["value"] == pytest.approx(  # (the report rounds to 4 digits)
        full["disk_later_median_bytes"] / incr["disk_later_median_bytes"], rel=1e-3
    )
    assert fewer["met"] is (fewer["value"] >= 5.0)
    vs_changed = rows[
        ("embedding-sparse", "bytes on disk per later save / bytes of the state that changed")
    ]
    assert vs_changed["value"] >= 1 and vs_changed["limit"] is None
    # no target on its loop overhead (that is the dense shapes')
    over = rows[("embedding-sparse", "loop overhead per checkpoint: this / quicksave-process")]
    assert over["limit"] is None and over["met"] is None
    text = format_training_report(report)
    assert text.splitlines()[0].endswith("; incremental blocks 16 KiB")
    assert "Incremental saves side by side (IncrementalConfig.block_bytes 16 KiB" in text
    assert "| embedding-sparse | quicksave-incremental | bytes on disk per later save" in text
    assert "later vs changed" in text


def _method(overhead: float | None, later: float, **extra: float) -> dict:
    return {
        "loop_median_s": 1.0,
        "overhead_per_checkpoint_s": overhead,
        "disk_later_median_bytes": later,
        **extra,
    }


def test_side_by_side_ratios_and_their_targets() -> None:
    lora = {
        "state": {"bytes": 1000},
        "methods": {
            "quicksave-process": _method(0.5, 1000.0),
            "quicksave-incremental": _method(
                0.11,
                104.0,
                trainable_bytes=90.0,
                manifest_later_median_bytes=10.0,
                steady_overhead_per_checkpoint_s=0.13,
            ),
            "quicksave-trainable": _method(0.1, 95.0, steady_overhead_per_checkpoint_s=0.1),
            "quicksave-incremental-counters": {"failed": "boom"},
        },
    }
    rows = incremental_rows("lora", lora)
    by = {r["what"]: r for r in rows}
    assert {r["method"] for r in rows} == {"quicksave-incremental"}  # the failed one: none
    assert by["bytes on disk per later save: quicksave-process / this"]["value"] == 1000 / 104
    assert by["bytes on disk per later save: quicksave-process / this"]["met"] is None
    over = by["loop overhead per checkpoint: this / quicksave-trainable"]
    assert over["value"] == pytest.approx(1.1) and over["limit"] == 1.2 and over["met"] is True
    steady = next(r for r in rows if r["what"].startswith("loop overhead per later checkpoint"))
    assert steady["value"] == pytest.approx(1.3) and steady["limit"] == 1.2
    assert steady["met"] is False  # (checked apart from the overall one, which is met)
    lora_bytes = by["bytes on disk per later save / (trainable state + this manifest)"]
    assert lora_bytes["value"] == pytest.approx(1.04) and lora_bytes["met"] is True
    # lora is not a shape whose every tensor changes: no target on the overhead vs full
    assert by["loop overhead per checkpoint: this / quicksave-process"]["limit"] is None
    # a negative overhead (the baseline slower than the method) is no measurement
    dense = {
        "methods": {
            "quicksave-process": _method(0.4, 100.0),
            "quicksave-incremental": _method(-0.01, 101.0),
        }
    }
    (fewer, over) = incremental_rows("mlp", dense)
    assert over["limit"] == 1.05 and over["value"] < 1.05 and over["met"] is False
    dense["methods"]["quicksave-incremental"]["overhead_per_checkpoint_s"] = 0.43
    assert incremental_rows("mlp", dense)[1]["met"] is False  # 1.075× > 1.05×
    dense["methods"]["quicksave-incremental"]["overhead_per_checkpoint_s"] = 0.41
    assert incremental_rows("mlp", dense)[1]["met"] is True
    # every tensor trainable: the trainable state's save is the full one, not compared
    dense["methods"]["quicksave-trainable"] = _method(0.4, 100.0)
    dense["methods"]["quicksave-incremental"]["trainable_bytes"] = 100.0
    dense["state"] = {"bytes": 100}
    assert len(incremental_rows("mlp", dense)) == 2
    # without a full save or an incremental one, nothing to set side by side
    assert incremental_rows("mlp", {"methods": {"quicksave-process": _method(0.4, 1.0)}}) == []


def test_a_loop_ratio_within_the_hosts_noise_is_unresolved() -> None:
    """The loops without checkpoints spread 0.6 s over 6 checkpoints (0.1 s each): a
    0.02 s overhead against 0.01 s (2×, a target of 1.2× asks to tell 0.012 s apart) is
    neither met nor missed; the same ratio with overheads far above the noise is."""
    lora = {
        "state": {"bytes": 1000},
        "baseline": {"loop_s": [10.0, 10.6, 10.3]},
        "methods": {
            "quicksave-incremental": _method(
                0.02, 104.0, checkpoints=6, trainable_bytes=90.0, manifest_later_median_bytes=10.0
            ),
            "quicksave-trainable": _method(0.01, 95.0),
        },
    }
    over = next(r for r in incremental_rows("lora", lora) if r["what"].startswith("loop overhead"))
    assert over["value"] == pytest.approx(2.0) and over["unresolved"] is True
    assert over["met"] is None and over["noise_s"] == pytest.approx(0.1)
    assert "unresolved (host noise ±0.100 s per checkpoint)" in "\n".join(
        incremental_table(incremental_rows("lora", lora), None)
    )
    lora["methods"]["quicksave-incremental"]["overhead_per_checkpoint_s"] = 2.0
    lora["methods"]["quicksave-trainable"]["overhead_per_checkpoint_s"] = 1.0
    over = next(r for r in incremental_rows("lora", lora) if r["what"].startswith("loop overhead"))
    assert over["unresolved"] is False and over["met"] is False  # 2.0 s vs 1.2 s: resolved
    lora["baseline"]["loop_s"] = [10.0]  # (one loop: no spread known, the ratio decides)
    lora["methods"]["quicksave-incremental"]["overhead_per_checkpoint_s"] = 0.02
    lora["methods"]["quicksave-trainable"]["overhead_per_checkpoint_s"] = 0.01
    over = next(r for r in incremental_rows("lora", lora) if r["what"].startswith("loop overhead"))
    assert over["unresolved"] is False and over["met"] is False
    # a compared method's own repeats spread too (1.2 s over 6 checkpoints): unresolved
    lora["methods"]["quicksave-trainable"]["loop_s"] = [11.0, 12.2, 11.5]
    over = next(r for r in incremental_rows("lora", lora) if r["what"].startswith("loop overhead"))
    assert over["unresolved"] is True and over["noise_s"] == pytest.approx(0.2)


def test_steady_overhead_leaves_out_the_first_save_and_keeps_the_drain() -> None:
    from quicksave_tools.bench.training_summary import _Baseline, _steady_extra_s

    base = _Baseline(loop_s=8.0, step_s=[1.0] * 8, step_median_s=1.0)
    # saves at steps 1, 4, 7; the first save's step and the next cost 3 s more, each
    # later save's step 0.5 s more, and the final drain 0.25 s
    steps = [2.5, 2.5, 1.0, 1.5, 1.0, 1.0, 1.5, 1.0]
    run = {"events": [{"step": 1}, {"step": 4}, {"step": 7}], "step_s": steps,
           "loop_s": sum(steps) + 0.25}  # fmt: skip
    assert _steady_extra_s(run, base) == pytest.approx((0.5 + 0.5 + 0.25) / 2)
    assert _steady_extra_s({**run, "events": run["events"][:1]}, base) is None  # no later


def test_in_run_extras_read_each_later_save_against_the_same_runs_quiet_steps() -> None:
    from quicksave_tools.bench.training_summary import _in_run_extras_s

    # saves at steps 2, 6, 10 of 12; quiet steps 1.0 s (the first step 9 s: left out);
    # the saves at 6 and 10 cost 0.25 s and 0.5 s over their windows; the one at 10
    # has its whole window (steps 10-12); the first save is not a later one
    steps = [9.0, 3.0, 2.0, 1.0, 1.0, 1.25, 1.0, 1.0, 1.0, 1.5, 1.0, 1.0]
    run = {"events": [{"step": 2}, {"step": 6}, {"step": 10}], "step_s": steps}
    assert _in_run_extras_s(run) == pytest.approx([0.25, 0.5])
    # a drift of the whole run (a slower host) moves nothing
    slow = {**run, "step_s": [t + 0.5 for t in steps]}
    assert _in_run_extras_s(slow) == pytest.approx([0.25, 0.5])
    # the last save's window past the loop's end: not read
    short = {**run, "step_s": steps[:11]}
    assert _in_run_extras_s(short) == pytest.approx([0.25])


def test_bench_recovery_refuses_a_shape_with_its_own_optimizer() -> None:
    from quicksave_tools.bench.recovery import RecoveryBenchConfig, check_config

    with pytest.raises(ValueError, match="embedding-sparse train with an optimizer other than"):
        check_config(RecoveryBenchConfig(loop_shapes=("mlp", "embedding-sparse")))
