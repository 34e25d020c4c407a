"""Hugging Face export (issue 20, point 7): ``quicksave.export_hf`` / ``quicksave convert
--to hf`` write a directory that ``from_pretrained`` loads into the same model (logits
torch.equal), from full checkpoints and from the manager's exports at any step."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import quicksave
from helpers.hf_models import (  # first: transformers is imported offline (HF_HUB_OFFLINE)
    GPT2LMHeadModel,
    LlamaForCausalLM,
    cast_weights,
    gpt2,
    llama,
    logits,
    train_and_save,
)
from quicksave.cli.main import main
from quicksave.commit.outputs import upload_dir
from quicksave.errors import CheckpointError, CheckpointExistsError
from quicksave.format.hf_layout import INDEX_NAME, WEIGHTS_NAME, parse_size, plan_shards
from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState, TrainState
from quicksave.storage import parse_location
from quicksave.tools.convert import convert
from quicksave.tools.hf_export import write_model_dir


def stored(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export directory, key -> tensor, with the file it is in checked
    against the index where there is one."""
    files = sorted(p for p in os.listdir(out) if p.endswith(".safetensors"))
    where: dict[str, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(out / name), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for key in f.keys():  # noqa: SIM118 (not a dict)
                assert key not in tensors, key
                tensors[key], where[key] = f.get_tensor(key), name
    if len(files) > 1:
        index = json.loads((out / INDEX_NAME).read_text())
        assert index["weight_map"] == where
        assert index["metadata"]["total_size"] == sum(
            t.numel() * t.element_size() for t in tensors.values()
        )
    return tensors


def load_hf(cls: type, out: Path, **kw) -> torch.nn.Module:
    """``cls.from_pretrained(out)``, asserting that every weight came from the files."""
    model, info = cls.from_pretrained(str(out), output_loading_info=True, **kw)
    assert info["missing_keys"] == set() or info["missing_keys"] == []
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    return model


# ---------------------------------------------------------------- GPT-2, Llama


def test_gpt2_full_checkpoint_exports_the_model_only_and_loads_bit_exact(tmp_path: Path) -> None:
    job = train_and_save(gpt2(), tmp_path / "ckpt", steps=2, async_mode="process")
    job.manager.close()
    out = tmp_path / "hf"
    assert quicksave.export_hf(tmp_path / "ckpt" / "step-2", out, config=job.model.config) == str(
        out
    )

    assert sorted(os.listdir(out)) == ["config.json", WEIGHTS_NAME]  # one shard: no index
    tensors = stored(out)
    # no prefix, no optimizer state; the tied head is left out, as save_pretrained does
    assert set(tensors) == set(job.model.state_dict()) - {"lm_head.weight"}
    for key, t in tensors.items():
        assert torch.equal(t, job.model.state_dict()[key]), key
    loaded = load_hf(GPT2LMHeadModel, out)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tied again on load
    assert torch.equal(logits(loaded), logits(job.model))


def test_gpt2_sharded_export_has_an_index_and_loads(tmp_path: Path) -> None:
    job = train_and_save(gpt2(), tmp_path / "ckpt")
    out = tmp_path / "hf"
    limit = 20_000
    quicksave.export_hf(
        job.manager.step_path(2), out, max_shard_bytes=limit, config=job.model.config
    )
    tensors = stored(out)
    index = json.loads((out / INDEX_NAME).read_text())
    names = sorted(set(index["weight_map"].values()))
    n = len(names)
    assert n > 2 and names == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (out / WEIGHTS_NAME).exists()
    for name in names:  # at most the limit, unless one tensor alone is larger
        keys = [k for k, f in index["weight_map"].items() if f == name]
        size = sum(tensors[k].numel() * tensors[k].element_size() for k in keys)
        assert size <= limit or len(keys) == 1, (name, size, keys)
    assert index["metadata"]["total_parameters"] == sum(t.numel() for t in tensors.values())
    loaded = load_hf(GPT2LMHeadModel, out)
    assert torch.equal(logits(loaded), logits(job.model))
    job.manager.close()


def test_an_untrained_model_keeps_equal_but_untied_weights(tmp_path: Path) -> None:
    # Fresh LayerNorm weights are all ones and biases all zeros: equal values are no tie.
    model = gpt2(seed=3)
    job = train_and_save(model, tmp_path / "ckpt", steps=0)
    job.manager.save(0)  # the seed checkpoint: the model only
    quicksave.export_hf(job.manager.step_path(0), tmp_path / "hf", config=model.config)
    keys = set(stored(tmp_path / "hf"))
    assert keys == set(model.state_dict()) - {"lm_head.weight"}
    assert {"transformer.h.0.ln_1.weight", "transformer.h.0.ln_2.weight"} <= keys
    loaded = load_hf(GPT2LMHeadModel, tmp_path / "hf")
    assert torch.equal(logits(loaded), logits(model))
    job.manager.close()


@pytest.mark.parametrize("tied", [False, True])
def test_llama_export_in_bfloat16_equals_the_bfloat16_model(tmp_path: Path, tied: bool) -> None:
    job = train_and_save(llama(tied=tied), tmp_path / "ckpt")
    out = tmp_path / "hf"
    quicksave.export_hf(
        job.manager.step_path(2), out, dtype="bfloat16", config=job.model.config.to_dict()
    )
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    tensors = stored(out)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    expected = set(job.model.state_dict()) - ({"lm_head.weight"} if tied else set())
    assert set(tensors) == expected
    loaded = load_hf(LlamaForCausalLM, out)
    assert loaded.dtype == torch.bfloat16
    reference = cast_weights(job.model, torch.bfloat16)
    assert torch.equal(logits(loaded), logits(reference))
    job.manager.close()


def test_llama_float32_export_equals_the_model(tmp_path: Path) -> None:
    job = train_and_save(llama(seed=5), tmp_path / "ckpt")
    quicksave.export_hf(job.manager.step_path(2), tmp_path / "hf", config=job.model.config)
    loaded = load_hf(LlamaForCausalLM, tmp_path / "hf")
    assert loaded.dtype == torch.float32
    assert torch.equal(logits(loaded), logits(job.model))
    job.manager.close()


# ---------------------------------------------------------------- the manager's export


def test_manager_exports_at_any_step_the_model_as_it_is(tmp_path: Path) -> None:
    job = train_and_save(gpt2(), tmp_path / "ckpt", steps=1, async_mode="process")
    job.manager.save(2, force=True)  # in flight while the export is asked for
    before = logits(job.model)
    path = job.manager.export(1, dtype=torch.bfloat16)
    assert path == job.manager.export_path(1) == str(tmp_path / "ckpt" / "export-step-1")
    assert job.manager.metrics[-1].kind == "export"
    m = json.loads((tmp_path / "ckpt" / "export-step-1" / "manifest.json").read_text())
    assert m["user_metadata"]["export_dtype"] == "bfloat16"
    assert m["user_metadata"]["tied_weights"] == {
        "model": [["transformer.wte.weight", "lm_head.weight"]]
    }
    assert {k.split(".")[0] for k in m["tensors"]} == {"model"}
    # exported again: skipped, not rewritten
    assert job.manager.export(1) == path
    assert [r.kind for r in job.manager.metrics].count("export") == 1

    quicksave.export_hf(path, tmp_path / "hf", config=job.model.config)
    loaded = load_hf(GPT2LMHeadModel, tmp_path / "hf")
    assert loaded.dtype == torch.bfloat16
    reference = cast_weights(job.model, torch.bfloat16)
    assert torch.equal(logits(loaded), logits(reference))
    assert torch.equal(logits(job.model), before)  # the export left the model alone
    job.manager.close()


def test_manager_export_defaults_to_export_dtype_and_refuses_when_read_only(
    tmp_path: Path,
) -> None:
    job = train_and_save(gpt2(), tmp_path / "ckpt", steps=1, export_dtype="float16")
    job.manager.export(7)
    m = json.loads((tmp_path / "ckpt" / "export-step-7" / "manifest.json").read_text())
    assert {t["dtype"] for t in m["tensors"].values()} == {"float16"}
    with pytest.raises(CheckpointError, match="export dtype must be a torch floating dtype"):
        job.manager.export(8, dtype="int8")
    job.manager.close()

    reader = CheckpointManager(
        CheckpointConfig(folder=str(tmp_path / "ckpt"), read_only=True),
        {"model": ModelState(job.model)},
    )
    with pytest.raises(CheckpointError, match="does not write checkpoints: it was built with"):
        reader.export(9)
    assert not (tmp_path / "ckpt" / "export-step-9").exists()
    reader.close()


# ---------------------------------------------------------------- choosing the model


def test_the_model_state_is_chosen_by_name_or_record(tmp_path: Path) -> None:
    enc, dec = gpt2(seed=1), gpt2(seed=2)
    ckpt = tmp_path / "two"
    quicksave.save({"encoder": enc.state_dict(), "decoder": dec.state_dict(), "step": 3}, ckpt)
    with pytest.raises(CheckpointError) as info:
        quicksave.export_hf(ckpt, tmp_path / "hf")
    assert str(info.value) == (
        "cannot tell which state holds the model: no state is named 'model' and the "
        "checkpoint does not record its model state; states with tensors: 'decoder', "
        "'encoder'; choose one with state=NAME (quicksave convert --to hf --state NAME) "
        f"[path={ckpt}]"
    )
    with pytest.raises(CheckpointError) as info:
        quicksave.export_hf(ckpt, tmp_path / "hf", state="model")
    assert str(info.value) == (
        "no model state 'model' with tensors in this checkpoint; its states with tensors: "
        f"'decoder', 'encoder' [path={ckpt}]"
    )
    assert not (tmp_path / "hf").exists()

    quicksave.export_hf(ckpt, tmp_path / "hf", state="decoder", config=dec.config)
    # no record of ties (quicksave.save): the duplicate head is kept, and loads the same
    assert set(stored(tmp_path / "hf")) == set(dec.state_dict())
    loaded = load_hf(GPT2LMHeadModel, tmp_path / "hf")
    assert torch.equal(logits(loaded), logits(dec))


def test_a_manager_with_two_model_states_is_ambiguous(tmp_path: Path) -> None:
    a, b = gpt2(seed=1), llama(seed=2)
    manager = CheckpointManager(
        CheckpointConfig(folder=str(tmp_path / "ckpt"), async_mode="disabled"),
        {"gpt": ModelState(a), "llama": ModelState(b), "train": TrainState()},
    )
    manager.save(5, force=True)
    manager.close()
    with pytest.raises(CheckpointError) as info:
        quicksave.export_hf(manager.step_path(5), tmp_path / "hf")
    assert str(info.value) == (
        "this checkpoint holds several model states ('gpt', 'llama'); choose one with "
        f"state=NAME (quicksave convert --to hf --state NAME) [path={manager.step_path(5)}]"
    )
    quicksave.export_hf(manager.step_path(5), tmp_path / "hf", state="llama", config=b.config)
    loaded = load_hf(LlamaForCausalLM, tmp_path / "hf")
    assert torch.equal(logits(loaded), logits(b))


def test_no_model_state(tmp_path: Path) -> None:
    ckpt = tmp_path / "opt"
    quicksave.save({"optimizer": {"lr": 0.1}, "step": 4}, ckpt)
    with pytest.raises(CheckpointError) as info:
        quicksave.export_hf(ckpt, tmp_path / "hf")
    assert str(info.value) == f"this checkpoint holds no tensors: no model to export [path={ckpt}]"
    with pytest.raises(CheckpointError, match="states with tensors: none"):
        quicksave.export_hf(ckpt, tmp_path / "hf", state="optimizer")


def test_a_flat_state_dict_checkpoint_is_the_model(tmp_path: Path) -> None:
    model = llama(seed=4)
    quicksave.save(model.state_dict(), tmp_path / "flat")
    quicksave.export_hf(tmp_path / "flat", tmp_path / "hf", config=model.config)
    loaded = load_hf(LlamaForCausalLM, tmp_path / "hf")
    assert torch.equal(logits(loaded), logits(model))


def test_an_existing_output_is_never_overwritten(tmp_path: Path) -> None:
    model = gpt2()
    quicksave.save({"model": model.state_dict()}, tmp_path / "ckpt")
    (tmp_path / "hf").mkdir()
    with pytest.raises(CheckpointExistsError, match="never overwrites"):
        quicksave.export_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert os.listdir(tmp_path / "hf") == []
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "hf"]  # no temporary left


def test_bad_arguments(tmp_path: Path) -> None:
    quicksave.save({"model": gpt2().state_dict()}, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="the export dtype must be a torch floating"):
        quicksave.export_hf(tmp_path / "ckpt", tmp_path / "hf", dtype="int32")
    with pytest.raises(CheckpointError, match="max_shard_bytes must be positive"):
        quicksave.export_hf(tmp_path / "ckpt", tmp_path / "hf", max_shard_bytes=0)
    assert not (tmp_path / "hf").exists()


# ---------------------------------------------------------------- CLI and pure parts


def test_cli_convert_to_hf(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    job = train_and_save(llama(seed=6), tmp_path / "ckpt")
    job.manager.close()
    config = tmp_path / "config.json"
    config.write_text(job.model.config.to_json_string())
    out = tmp_path / "hf"
    argv = ["convert", job.manager.step_path(2), str(out), "--to", "hf", "--dtype", "bfloat16"]
    assert main([*argv, "--max-shard-size", "10KB", "--config", str(config)]) == 0
    assert capsys.readouterr().out == f"wrote {out} (hf)\n"
    assert (out / INDEX_NAME).exists()
    loaded = load_hf(LlamaForCausalLM, out)  # config.json from --config
    assert torch.equal(logits(loaded), logits(cast_weights(job.model, torch.bfloat16)))

    assert main(["convert", job.manager.step_path(1), str(tmp_path / "x"), "--to", "hf",
                 "--state", "nope"]) == 2  # fmt: skip
    assert "no model state 'nope'" in capsys.readouterr().err
    rc = main(["convert", job.manager.step_path(1), str(tmp_path / "t"), "--to", "torch",
               "--dtype", "bfloat16"])  # fmt: skip
    assert rc == 2 and "--dtype: only with --to hf" in capsys.readouterr().err
    # convert(..., "hf") is export_hf with its defaults
    quicksave_out = convert(job.manager.step_path(1), tmp_path / "d", "hf")
    assert quicksave_out == str(tmp_path / "d") and (tmp_path / "d" / WEIGHTS_NAME).exists()


def test_plan_shards_follows_save_pretrained() -> None:
    sizes = {"a": 4, "b": 4, "c": 10, "d": 1, "e": 2, "f": 3}
    assert plan_shards(sizes, 8) == [["a", "b"], ["c"], ["d", "e", "f"]]
    assert plan_shards(sizes, 100) == [list(sizes)]
    assert plan_shards({}, 8) == []


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("1.5 kB") == 1500
    assert parse_size("1024") == 1024
    for bad in ("", "GB", "5XB", "0", "-1", "0.5B"):
        with pytest.raises(CheckpointError):
            parse_size(bad)


class _Store:
    """A backend that records uploads and deletions, failing the upload of ``fail``."""

    def __init__(self, fail: str | None = None) -> None:
        self.fail, self.puts, self.deleted = fail, [], []

    def put(self, key: str, data: memoryview, **_: object) -> dict[str, str]:
        if self.fail is not None and key.endswith(self.fail):
            raise CheckpointError("the store refused it", path=key)
        self.puts.append(key)
        return {}

    def delete(self, keys: list[str]) -> None:
        self.deleted.extend(keys)


def test_a_store_upload_publishes_the_index_last_and_removes_a_partial_one(
    tmp_path: Path,
) -> None:
    tensors = {f"w{i}": torch.full((10,), float(i)) for i in range(3)}  # 40 bytes each
    names = write_model_dir(tensors, str(tmp_path / "d"), 80, {"model_type": "x"})
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert names == ["config.json", *shards, INDEX_NAME]
    dst = parse_location("s3://bucket/out")
    ok = _Store()
    upload_dir(ok, dst.key, dst.url, str(tmp_path / "d"), names)
    assert ok.puts == [f"out/{n}" for n in names] and ok.deleted == []

    failing = _Store(fail=INDEX_NAME)
    with pytest.raises(CheckpointError, match="the store refused it"):
        upload_dir(failing, dst.key, dst.url, str(tmp_path / "d"), names)
    assert failing.deleted == failing.puts == [f"out/{n}" for n in names[:-1]]
