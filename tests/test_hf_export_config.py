"""``export_hf(config=...)`` and ``quicksave convert --to hf --config`` take the same
configs: a mapping or ``PretrainedConfig``, and the path of a JSON file or of a model
directory holding ``config.json`` (``from_pretrained``'s own layout); each writes the same
``config.json`` (its ``dtype`` the weights'), and a config that cannot be read is an error
naming its path, before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import quicksave
from helpers.hf_models import LlamaForCausalLM, llama, train_and_save
from quicksave.cli.main import main
from quicksave.errors import CheckpointError


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("hfconfig")
    job = train_and_save(llama(seed=3), root / "ckpt")
    job.manager.close()
    job.model.save_pretrained(root / "pretrained")  # a model directory: config.json in it
    return job, root


def _written_config(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())


def test_each_kind_of_config_writes_the_same_config_json(trained, tmp_path: Path) -> None:
    job, root = trained
    step = job.manager.step_path(2)
    file = root / "pretrained" / "config.json"
    given = {
        "object": job.model.config,
        "mapping": job.model.config.to_dict(),
        "file (str)": str(file),
        "file (Path)": file,
        "directory": root / "pretrained",
    }
    written = {}
    for name, config in given.items():
        out = tmp_path / name.replace(" ", "-").replace("(", "").replace(")", "")
        quicksave.export_hf(step, out, dtype="bfloat16", config=config)
        written[name] = _written_config(out)
    for name in ("file", "directory"):
        out = tmp_path / f"cli-{name}"
        path = file if name == "file" else root / "pretrained"
        argv = ["convert", step, str(out), "--to", "hf", "--dtype", "bfloat16"]
        assert main([*argv, "--config", str(path)]) == 0
        written[f"--config {name}"] = _written_config(out)
    reference = written["file (str)"]
    assert reference["dtype"] == "bfloat16" and reference["model_type"] == "llama"
    assert reference["hidden_size"] == job.model.config.hidden_size
    for name in ("file (Path)", "directory", "--config file", "--config directory"):
        assert written[name] == reference, name
    # The object and the mapping go through to_dict(); from_pretrained reads each alike.
    for name in ("object", "mapping"):
        assert written[name]["dtype"] == "bfloat16"
    assert LlamaForCausalLM.from_pretrained(str(tmp_path / "directory")).config.hidden_size == (
        job.model.config.hidden_size
    )


def test_a_config_that_cannot_be_read_names_its_path_and_writes_nothing(
    trained, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    job, _ = trained
    step = job.manager.step_path(2)
    missing = tmp_path / "nope.json"
    with pytest.raises(CheckpointError) as info:
        quicksave.export_hf(step, tmp_path / "out", config=missing)
    assert info.value.message.startswith("cannot read the config: [Errno 2] No such file")
    assert info.value.path == str(missing)
    empty_dir = tmp_path / "model-dir"
    empty_dir.mkdir()
    with pytest.raises(CheckpointError) as info:
        quicksave.export_hf(step, tmp_path / "out", config=empty_dir)
    assert info.value.path == str(empty_dir / "config.json")
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    argv = ["convert", step, str(tmp_path / "out"), "--to", "hf", "--config", str(listed)]
    assert main(argv) == 2
    assert f"the config is a JSON list, not an object [path={listed}]" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
