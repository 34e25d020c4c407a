"""``quicksave demo``: the end-to-end kill-and-resume run, and its parts."""

from __future__ import annotations

import io
import json
from importlib import resources
from pathlib import Path

import pytest
import torch

import quicksave
from quicksave_tools.demo import main
from quicksave_tools.demo.config import DemoConfig
from quicksave_tools.demo.data import BatchSampler, CharTokenizer, load_corpus
from quicksave_tools.demo.model import ModelConfig, TinyLM
from quicksave_tools.demo.report import compare, summarize
from quicksave_tools.demo.run import default_kill_at, parse_args, run_demo
from quicksave_tools.demo.train import tensor_digest


def _sampler(seed: int = 3, context: int = 16) -> BatchSampler:
    tokens = torch.arange(500) % 37
    return BatchSampler(tokens, batch_size=4, context=context, seed=seed)


def test_demo_kill_and_resume_is_bit_exact(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    folder = tmp_path / "demo"
    status = main(["--steps", "30", "--interval", "10", "--folder", str(folder)])
    out = capsys.readouterr().out

    assert status == 0, out
    assert "bit-exact: yes" in out
    assert "SIGKILL at step 15 (exit status -9)" in out
    reference = json.loads((folder / "reference.json").read_text())
    resumed = json.loads((folder / "resumed.json").read_text())
    # The resume really restored a mid-run checkpoint rather than starting over.
    assert resumed["resumed_from"] == 10
    assert resumed["final_loss"] == reference["final_loss"]
    assert resumed["losses"] == reference["losses"] and len(resumed["losses"]) == 30
    assert resumed["params_sha256"] == reference["params_sha256"]
    # The folder holds committed checkpoints only: 10 (before the kill), 20 and 30.
    ckpts = sorted(p.name for p in (folder / "checkpoints").iterdir())
    assert ckpts == ["export-step-30", "step-10", "step-20", "step-30"]
    assert "step-20                  committed" in out


@pytest.mark.slow
def test_demo_kill_during_a_save_resumes_from_a_committed_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    folder = tmp_path / "demo"
    # Step 20 is a checkpoint step: the kill is aimed at its write.
    status = main(["--steps", "22", "--interval", "10", "--kill-at", "20", "--folder", str(folder)])
    out = capsys.readouterr().out

    assert status == 0, out
    assert "bit-exact: yes" in out
    resumed = json.loads((folder / "resumed.json").read_text())
    kill_line = next(line for line in out.splitlines() if "kill step" in line)
    if "half-written: step-20.tmp-" in kill_line:
        # Killed mid-write: step 20 was invisible, so the resume used step 10.
        assert "committed then: step-10;" in kill_line
        assert resumed["resumed_from"] == 10
    else:
        # The write finished before the kill landed; then it is committed and used.
        assert resumed["resumed_from"] in (10, 20)
    assert not any(".tmp-" in p.name for p in (folder / "checkpoints").iterdir())


def test_demo_refuses_a_folder_with_checkpoints(tmp_path: Path):
    (tmp_path / "checkpoints" / "step-5").mkdir(parents=True)
    out = io.StringIO()
    status = run_demo(DemoConfig(steps=30, interval=10, kill_at=15, folder=str(tmp_path)), out)
    assert status == 1
    assert "already holds checkpoints" in out.getvalue()


def test_demo_arguments_are_checked():
    assert default_kill_at(120, 20) == 70
    assert default_kill_at(30, 10) == 15
    cfg = parse_args(["--steps", "50", "--interval", "10", "--kill-at", "30", "--folder", "x"])
    assert (cfg.steps, cfg.interval, cfg.kill_at, cfg.keep_folder) == (50, 10, 30, True)
    # Killing before the first checkpoint would leave nothing to resume from.
    with pytest.raises(SystemExit) as e:
        parse_args(["--steps", "50", "--interval", "10", "--kill-at", "10", "--folder", "x"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        parse_args(["--steps", "50", "--interval", "60"])


def test_compare_flags_any_difference():
    ref = {"final_loss": 2.5, "losses": [3.0, 2.5], "params_sha256": "a", "optimizer_sha256": "b"}
    assert compare(ref, dict(ref))["bit_exact"]
    off = dict(ref, losses=[3.0, 2.5000000000000004], final_loss=2.5000000000000004)
    checks = compare(ref, off)
    assert not checks["bit_exact"] and not checks["final_loss"] and checks["params"]


def test_shipped_text_is_in_the_package():
    folder = resources.files("quicksave_tools.demo") / "data"
    names = sorted(p.name for p in folder.iterdir() if p.name.endswith(".txt"))
    assert len(names) >= 3
    text = load_corpus()
    assert len(text) >= 30_000
    assert "lighthouse" in text.lower()
    tok = CharTokenizer.from_text(text)
    assert tok.decode(tok.encode(text[:200])) == text[:200]
    with pytest.raises(ValueError, match="is not in the vocabulary"):
        CharTokenizer.from_text("abc").encode("abz")


def test_sampler_resumes_exactly_in_memory():
    sampler = _sampler()
    for _ in range(5):
        sampler.next_batch()
    state = sampler.state_dict()
    expected = [sampler.next_batch() for _ in range(3)]

    fresh = _sampler()
    fresh.load_state_dict(state)
    assert fresh.batches_drawn == 5
    for x_exp, y_exp in expected:
        x, y = fresh.next_batch()
        assert torch.equal(x, x_exp) and torch.equal(y, y_exp)
    # Targets are the inputs shifted by one token.
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_sampler_resumes_exactly_through_a_checkpoint(tmp_path: Path):
    sampler = _sampler()
    for _ in range(4):
        sampler.next_batch()
    quicksave.save({"dataloader": sampler}, tmp_path / "ckpt")
    expected = [sampler.next_batch() for _ in range(3)]

    fresh = _sampler()
    quicksave.load({"dataloader": fresh}, tmp_path / "ckpt")
    got = [fresh.next_batch() for _ in range(3)]
    for (x_exp, y_exp), (x, y) in zip(expected, got, strict=True):
        assert torch.equal(x, x_exp) and torch.equal(y, y_exp)
    assert fresh.batches_drawn == 7


def test_sampler_rejects_state_of_another_shape():
    state = _sampler(context=16).state_dict()
    other = _sampler(context=8)
    with pytest.raises(quicksave.IncompatibleStateError) as e:
        other.load_state_dict(state)
    assert "saved with context=16 but this sampler has context=8" in str(e.value)
    assert "fqn=context" in str(e.value)


def test_model_is_causal_and_deterministic():
    torch.manual_seed(0)
    model = TinyLM(ModelConfig(vocab_size=11, context=8, d_model=16, n_layers=2, n_heads=2))
    model.eval()
    idx = torch.randint(0, 11, (2, 8))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 8, 11) and loss is not None and loss.ndim == 0
    # Changing the last token must not change what the model says about earlier positions.
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 11
    logits2, _ = model(changed)
    assert torch.equal(logits[:, :-1], logits2[:, :-1])
    assert model.head.weight is model.tok_emb.weight
    torch.manual_seed(0)
    twin = TinyLM(ModelConfig(vocab_size=11, context=8, d_model=16, n_layers=2, n_heads=2))
    assert tensor_digest(twin.state_dict()) == tensor_digest(model.state_dict())
    with pytest.raises(ValueError, match="exceeds the context of 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_summary_reports_a_mismatch():
    ref = {
        "final_loss": 2.5, "losses": [3.0, 2.5], "params_sha256": "a" * 64,
        "optimizer_sha256": "b" * 64, "num_params": 1000, "corpus_chars": 34000,
        "model": {"n_layers": 4, "d_model": 128, "n_heads": 4, "context": 64, "vocab_size": 58},
        "checkpoints": [], "restore_s": None, "resumed_from": None,
    }  # fmt: skip
    save = {"step": 1, "kind": "full", "path": "p", "bytes": 2_000_000, "blocking_s": 0.5}
    intr = dict(ref, checkpoints=[save], killed_at=1, committed_at_kill=["step-1"],
                leftovers_at_kill=[])  # fmt: skip
    res = dict(ref, params_sha256="c" * 64, restore_s=0.25, resumed_from=1)
    cfg = DemoConfig(steps=2, interval=1, kill_at=1, folder="unused")
    out = io.StringIO()
    wall = {"reference": 1.0, "interrupted": 1.0, "resumed": 1.0}
    ok = summarize(cfg, {"reference": ref, "interrupted": intr, "resumed": res}, wall, out)
    text = out.getvalue()
    assert not ok
    assert "bit-exact            no (params differ)" in text
    assert "write GB/s           0.004 (bytes / blocking time)" in text
    assert "resumed from step    1" in text
