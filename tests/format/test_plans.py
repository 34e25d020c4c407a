"""The manifest's optional ``plans`` (per-rank save plans): JSON round trip, schema,
rejection of malformed plans, and manifests without it (the golden fixture) still load."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from helpers.checks import seal_manifest, validate_against_schema
from quicksave.adapters.dcp_reader import manifest_rank_plans, save_plan_of
from quicksave.errors import CorruptCheckpointError
from quicksave.format.manifest import (
    PlannedChunk,
    RankPlan,
    to_json_bytes,
)
from quicksave.format.manifest_parse import from_json_bytes

FIXTURE = Path(__file__).parent / "fixtures" / "manifest_v1.json"

PLANS = (
    RankPlan(
        (
            PlannedChunk("w", (0, 0), (2, 4), (4, 4), "float32"),
            PlannedChunk("b", (), (), (), "bfloat16"),
        ),
        ("train.step",),
    ),
    RankPlan((PlannedChunk("w", (2, 0), (2, 4), (4, 4), "float32"),), ()),
)


def _fixture_with_plans(plans=PLANS):
    m = from_json_bytes(FIXTURE.read_bytes())
    return dataclasses.replace(m, world_size=len(plans), plans=plans)


def test_plans_round_trip_and_validate():
    m = _fixture_with_plans()
    data = to_json_bytes(m)
    doc = json.loads(data)
    assert list(doc)[-2:] == ["plans", "manifest_xxh3_64"]  # the checksum stays last
    assert doc["plans"][1] == {
        "tensors": [
            {"fqn": "w", "offsets": [2, 0], "sizes": [2, 4], "shape": [4, 4], "dtype": "float32"}
        ],
        "objects": [],
    }
    validate_against_schema(doc)
    assert from_json_bytes(data) == m


def test_manifest_without_plans_loads():
    m = from_json_bytes(FIXTURE.read_bytes())
    assert m.plans is None and m.world_size == 1
    assert "plans" not in json.loads(to_json_bytes(m))
    # A one-rank checkpoint's plan is its content.
    (plan,) = manifest_rank_plans(m)
    assert sorted(c.fqn for c in plan.tensors) == sorted(m.tensors)
    assert sorted(plan.objects) == sorted(m.objects)
    sp = save_plan_of(plan, m)
    assert sp.storage_data == plan
    assert sp.planner_data["model.linear.weight"] == ("model", "linear", "weight")


def test_multi_rank_manifest_without_plans_has_none():
    m = dataclasses.replace(from_json_bytes(FIXTURE.read_bytes()), world_size=2)
    assert manifest_rank_plans(m) is None


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(plans=d["plans"][:1]), "plans must be a list of world_size=2"),
        (lambda d: d["plans"][0].pop("objects"), "plans[0] lacks 'objects'"),
        (lambda d: d["plans"][1]["tensors"][0].update(offsets=[3, 0]), "lies outside shape"),
        (lambda d: d["plans"][0].update(objects=[1]), "plans[0].objects must be strings"),
    ],
)
def test_rejects_malformed_plans(mutate, message):
    doc = json.loads(to_json_bytes(_fixture_with_plans()))
    mutate(doc)
    with pytest.raises(CorruptCheckpointError) as e:
        from_json_bytes(seal_manifest(doc), path="/ckpt/manifest.json")
    assert message in e.value.message and e.value.path == "/ckpt/manifest.json"
