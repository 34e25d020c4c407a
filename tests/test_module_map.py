"""The module map of docs/ARCHITECTURE.md is generated from the source and stays so:
``python tests/helpers/structure.py --module-map`` writes it, this test fails when the
committed map differs from what the modules' docstrings say now."""

from __future__ import annotations

import difflib

from helpers.structure import (
    ARCHITECTURE,
    LIBRARY,
    MAP_COMMAND,
    MAP_END,
    MAP_START,
    SRC,
    TOOLS,
    committed_module_map,
    first_sentence,
    load,
    module_map,
)


def test_the_committed_module_map_is_the_one_the_source_gives() -> None:
    committed = committed_module_map(ARCHITECTURE.read_text())
    generated = module_map(load())
    diff = "\n".join(
        list(
            difflib.unified_diff(
                committed.splitlines(),
                generated.splitlines(),
                "docs/ARCHITECTURE.md",
                "the source",
                lineterm="",
            )
        )[:40]
    )
    assert committed == generated, (
        f"docs/ARCHITECTURE.md's module map differs from the source; run `{MAP_COMMAND}` "
        f"and commit the result:\n{diff}"
    )


def test_the_map_names_every_module_once() -> None:
    mods = load()
    text = module_map(mods)
    assert text.startswith(MAP_START) and text.endswith(MAP_END)
    library, tools = text.split(f"**`{TOOLS}/`**")
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) == len(mods)
    for name, m in mods.items():
        root, part = (LIBRARY, library) if name.split(".")[0] == LIBRARY else (TOOLS, tools)
        path = m.path.relative_to(SRC / root).as_posix()
        assert part.count(f"| `{path}` |") == 1, name


def test_the_layers_come_from_the_bottom() -> None:
    text = module_map(load())
    order = [
        text.index(f"| `{p}` |")
        for p in (
            "errors.py",
            "format/manifest.py",
            "layout/plan.py",
            "storage/local.py",
            "commit/parts.py",
            "ranks/exchange.py",
            "manager/manager.py",
            "cli/main.py",
        )
    ]
    assert order == sorted(order)


def test_a_description_is_the_docstrings_first_sentence() -> None:
    doc = "Stage: copy tensors, e.g. weights, into a pool.\nMore.\n\nDetails."
    assert first_sentence(doc) == "Stage: copy tensors, e.g. weights, into a pool."
    assert first_sentence(None) == "(no docstring)"
    assert first_sentence("A | B.") == "A \\| B."


def test_a_long_description_is_cut_at_a_word_outside_a_literal() -> None:
    doc = "Words " * 20 + "``a literal with spaces`` and more words after it"
    cut = first_sentence(doc, width=130)
    assert cut.endswith(" …") and len(cut) <= 132
    assert cut.count("``") % 2 == 0
    assert cut == ("Words " * 20).rstrip() + " …"
