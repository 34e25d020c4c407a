"""The layering rules of docs/ARCHITECTURE.md, checked on the source (tests/structure.py
reads it with ast; imports inside functions count like any other)."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from helpers.structure import (
    BACKEND_LAYERS,
    LIBRARY,
    MAX_LINES,
    TOOLS,
    backend_branches,
    collective_calls,
    cycles,
    in_layer,
    layer_of,
    load,
    manifest_builds,
    package_of,
    package_pairs,
    plan_caches,
    plan_exchanges,
    staging_allocations,
    upward_imports,
)

MODS = load()
LIB = {n: m for n, m in MODS.items() if in_layer(n, LIBRARY)}

# the only module that calls torch.distributed's collectives
RANKS_TALK = "quicksave.ranks.collectives"
# what a layer may import from the package, besides itself
BELOW_FORMAT = ("quicksave.errors", "quicksave.checksum")
BELOW_STORAGE = (*BELOW_FORMAT, "quicksave.format")
# the standard modules that do I/O: none of them in format/
IO_MODULES = {"os", "shutil", "socket", "mmap", "tempfile", "subprocess", "pathlib", "glob"}


def _outside(name: str, allowed: tuple[str, ...]) -> bool:
    return not any(in_layer(name, a) for a in allowed)


def test_the_graph_is_read_from_the_whole_package() -> None:
    # a broken walk (wrong root, a renamed package) would make every rule below pass
    assert len(LIB) > 80 and any(in_layer(n, TOOLS) for n in MODS)
    assert "quicksave.saving.handle" in MODS["quicksave.manager.session"].imports


def test_no_import_cycles() -> None:
    assert cycles(MODS) == []


def test_every_package_has_a_layer() -> None:
    packages = {p for n in LIB if (p := package_of(n)) is not None}
    assert {p: layer_of(p) for p in packages}  # KeyError names a package with no layer


def test_no_import_from_a_lower_layer_into_a_higher_one() -> None:
    assert upward_imports(LIB) == []


def test_no_two_packages_import_each_other() -> None:
    assert package_pairs(LIB) == []


def test_no_module_over_the_size_limit() -> None:
    big = {n: m.lines for n, m in MODS.items() if m.lines > MAX_LINES}
    assert big == {}


def test_format_does_no_io() -> None:
    for name, m in LIB.items():
        if not in_layer(name, "quicksave.format"):
            continue
        assert {i for i in m.imports if _outside(i, (*BELOW_FORMAT, "quicksave.format"))} == set()
        assert m.external & IO_MODULES == set(), name
        opens = [
            n.lineno
            for n in ast.walk(m.tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "open"
        ]
        assert opens == [], f"{name} calls open() at lines {opens}"


def test_storage_imports_nothing_above_it() -> None:
    for name, m in LIB.items():
        if in_layer(name, "quicksave.storage"):
            above = {i for i in m.imports if _outside(i, (*BELOW_STORAGE, "quicksave.storage"))}
            assert above == set(), name


def test_the_library_never_imports_the_tools() -> None:
    # (the command line runs `quicksave demo` / `bench` by name, on demand: no import)
    for name, m in LIB.items():
        assert {i for i in m.imports if in_layer(i, TOOLS)} == set(), name


# The one place that still asks which backend it has, and why: listing a local tree
# walks directories (links, depth) where a store's listing is one request. Everything
# else asks the location's commit strategy (quicksave.commit) or its scheme's entry (a
# folder's writer lease: quicksave.manager.lease.lease_for).
BACKEND_BRANCHES_ALLOWED = {"quicksave.loading.catalog": 1}


def test_only_the_commit_strategy_knows_the_backend() -> None:
    found = {
        n: len(backend_branches(m))
        for n, m in LIB.items()
        if not any(in_layer(n, layer) for layer in BACKEND_LAYERS) and backend_branches(m)
    }
    assert found == BACKEND_BRANCHES_ALLOWED
    assert sum(found.values()) <= 1


def test_one_module_talks_to_other_ranks() -> None:
    talkers = {n for n, m in LIB.items() if collective_calls(m)}
    assert talkers == {RANKS_TALK}


def test_one_plan_exchange_and_one_plan_cache() -> None:
    # every save path exchanges plans through one function and caches them in one class
    exchanges = {(n, f) for n, m in LIB.items() for _, f in plan_exchanges(m)}
    assert exchanges == {("quicksave.ranks.exchange", "central_round")}
    caches = {(n, c, view) for n, m in LIB.items() for _, c, view in plan_caches(m)}
    assert {(n, c) for n, c, view in caches if not view} == {
        ("quicksave.saving.plan_cache", "PlanCache")
    }


def test_one_staging_pool() -> None:
    # every save path stages into stage/pool.StagingPool: no other module allocates
    # shared memory to stage tensors in
    allocators = {n for n, m in LIB.items() if staging_allocations(m)}
    assert allocators == {"quicksave.stage.pool"}


def test_one_manifest_builder() -> None:
    # every save path builds its manifest as a skeleton (saving.skeleton) that
    # commit.parts.manifest_from_parts fills; format/ only parses manifest.json
    builders = {(n, f) for n, m in LIB.items() for _, f in manifest_builds(m)}
    assert builders == {
        ("quicksave.layout.skeleton", "manifest_skeleton"),
        ("quicksave.format.manifest_parse", "from_json_bytes"),
    }


# every module of the worker package (the process runs main; the others, torch-free too,
# are imported by it or by the trainer beside the engine)
WORKER_MODULES = sorted(n for n in LIB if n.startswith("quicksave.worker."))


@pytest.mark.parametrize("module", WORKER_MODULES)
def test_the_worker_imports_no_torch_at_start(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.startswith('torch')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_rules_see_a_violation(tmp_path) -> None:
    # the checks themselves: a cycle and a collective in a throwaway package are found
    pkg = tmp_path / "quicksave"
    (pkg / "format").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "format" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from quicksave import b\n")
    (pkg / "b.py").write_text(
        "import torch.distributed as dist\nfrom quicksave import a\n"
        "def g():\n    dist.all_reduce(1)\n"
    )
    (pkg / "format" / "x.py").write_text("import os\n")
    mods = load(tmp_path, ("quicksave",))
    assert cycles(mods) == [["quicksave.a", "quicksave.b"]]
    (pkg / "storage").mkdir()
    (pkg / "storage" / "__init__.py").write_text("")
    (pkg / "storage" / "y.py").write_text("from quicksave.manager import z\n")
    (pkg / "manager").mkdir()
    (pkg / "manager" / "__init__.py").write_text("")
    (pkg / "manager" / "z.py").write_text("from quicksave.storage import y\n")
    layered = {
        n: m
        for n, m in load(tmp_path, ("quicksave",)).items()
        if n.startswith(("quicksave.storage", "quicksave.manager"))
    }
    assert upward_imports(layered) == [("quicksave.storage.y", "quicksave.manager.z")]
    assert package_pairs(layered) == [("manager", "storage")]
    assert [c for _, c in collective_calls(mods["quicksave.b"])] == ["dist.all_reduce"]
    assert "os" in mods["quicksave.format.x"].external
    (pkg / "c.py").write_text(
        "class MyPlans:\n    pass\n"
        "def swap(w, x):\n    y = talk.gather_object(x, 0)\n    return talk.scatter_object(y, 0)\n"
        "def dcp(w):\n    return w.reduce_scatter('plan', 1, 2)\n"
    )
    c = load(tmp_path, ("quicksave",))["quicksave.c"]
    assert [f for _, f in plan_exchanges(c)] == ["swap", "dcp"]
    assert [(cls, view) for _, cls, view in plan_caches(c)] == [("MyPlans", False)]


def test_no_module_shadows_a_public_name() -> None:
    # importing a submodule sets the package's attribute of that name: a module
    # a module or package named "load" in quicksave would replace quicksave.load()
    import quicksave

    top = {n.split(".")[1] for n in LIB if n.count(".") >= 1}
    assert top & set(quicksave.__all__) == set()


# one of each on the save and load paths: the function, defined at module level once
ONE_DEFINITION = ("collect_local", "global_plan", "flatten_with_paths", "require_committed")


def test_one_collector_one_planner_one_flattening_one_require_committed() -> None:
    defined = {
        name: sorted(
            n
            for n, m in LIB.items()
            for node in m.tree.body
            if isinstance(node, ast.FunctionDef) and node.name == name
        )
        for name in ONE_DEFINITION
    }
    assert defined == {
        "collect_local": ["quicksave.saving.rank_plans"],
        "global_plan": ["quicksave.saving.rank_plans"],
        "flatten_with_paths": ["quicksave.saving.keypaths"],
        "require_committed": ["quicksave.loading.checkpoint"],
    }
    # the single-rank engine plans with the same planner: no collector of its own
    names = {
        node.name
        for m in LIB.values()
        for node in ast.walk(m.tree)
        if isinstance(node, ast.FunctionDef)
    }
    assert "collect_state" not in names and "validate_for_save" not in names
