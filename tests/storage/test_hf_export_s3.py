"""Hugging Face export on an object store (SeaweedFS): a manager's checkpoint on
``s3://`` exported to ``s3://`` (sharded, index uploaded last) and to a local directory;
``from_pretrained`` of the downloaded files gives the model's logits bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import quicksave
from helpers.hf_models import GPT2LMHeadModel, cast_weights, gpt2, logits, train_and_save
from quicksave.errors import CheckpointExistsError
from quicksave.format.hf_layout import INDEX_NAME


@pytest.fixture
def s3_env(s3_server, monkeypatch) -> None:
    """The AWS environment chain pointing at the server."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)


def _download(s3_server, bucket: str, prefix: str, dest: Path) -> dict[str, int]:
    """Every object under ``prefix`` into ``dest``; returns name -> size."""
    client = s3_server.client()
    try:
        sizes: dict[str, int] = {}
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for page in pages:
            for o in page.get("Contents", []):
                name = o["Key"][len(prefix) :]
                sizes[name] = o["Size"]
                dest.mkdir(parents=True, exist_ok=True)
                client.download_file(bucket, o["Key"], str(dest / name))
        return sizes
    finally:
        client.close()


def test_export_from_and_to_an_object_store(s3_env, s3_server, s3_bucket, tmp_path) -> None:
    folder = f"s3://{s3_bucket}/run"
    job = train_and_save(gpt2(), folder, steps=2)
    exported = job.manager.export(2, dtype="bfloat16")  # the manager's export, on the store
    assert exported == f"{folder}/export-step-2"
    job.manager.close()

    out = f"s3://{s3_bucket}/hf/gpt2"
    written = quicksave.export_hf(
        job.manager.step_path(2), out, max_shard_bytes=30_000, config=job.model.config
    )
    assert written == out
    objects = _download(s3_server, s3_bucket, "hf/gpt2/", tmp_path / "hf")
    index = json.loads((tmp_path / "hf" / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and set(objects) == {*shards, INDEX_NAME, "config.json"}
    assert "lm_head.weight" not in index["weight_map"]
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
    assert torch.equal(logits(loaded), logits(job.model))

    with pytest.raises(CheckpointExistsError, match="never overwrites"):
        quicksave.export_hf(job.manager.step_path(2), out)

    # from the store to a local directory, cast to bfloat16
    local = tmp_path / "local"
    quicksave.export_hf(job.manager.step_path(1), local, dtype="bfloat16", config=job.model.config)
    at_step_2 = cast_weights(job.model, torch.bfloat16)
    loaded = GPT2LMHeadModel.from_pretrained(str(local))
    assert loaded.dtype == torch.bfloat16
    # step 1's weights, not the model's (step 2): the export reads the checkpoint
    assert not torch.equal(logits(loaded), logits(at_step_2))
    quicksave.export_hf(exported, tmp_path / "local2", config=job.model.config)
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "local2"))
    assert torch.equal(logits(loaded), logits(at_step_2))
