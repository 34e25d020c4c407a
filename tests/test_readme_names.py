"""Every quicksave name the README and docs/ show can be imported as shown.

A user copies ``from quicksave import StorageOptions`` from what the README names; it
used to fail. This reads the Markdown: Python code blocks (``from quicksave... import``
and ``quicksave.X`` attribute chains), inline code (``quicksave.X.Y`` references), and,
in the README, every ``Name(...)`` call a user would write, which must come from
``quicksave`` itself unless listed in ``ELSEWHERE`` with the module it comes from.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import quicksave

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, ROOT / "examples" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# README calls of names that are not quicksave's top-level ones: name -> its module.
ELSEWHERE = {
    "Trainer": "lightning.pytorch",
    "QuicksaveCheckpointIO": "quicksave.integrations.lightning",
    "LlamaConfig": "transformers",
    "LlamaForCausalLM": "transformers",
    "SummaryWriter": "torch.utils.tensorboard",
}

_FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```", re.S | re.M)
_DOTTED = re.compile(r"(?<![\w./-])quicksave(?:\.[A-Za-z_]\w*)+")
_CALL = re.compile(r"(?<![\w.])([A-Z]\w*)\(")


def _blocks(text: str) -> list[str]:
    """The Python code blocks (fences marked ``python`` or unmarked)."""
    return [body for lang, body in _FENCE.findall(text) if lang in ("", "python", "py")]


def _spans(text: str) -> list[str]:
    """Inline code spans outside the fenced blocks, line breaks inside them joined."""
    prose = _FENCE.sub("", text)
    return [re.sub(r"\s*\n\s*", " ", s) for s in re.findall(r"`([^`]+)`", prose)]


def _statements(block: str) -> list[ast.AST]:
    """The block parsed as Python; a block that is not valid Python as a whole (output,
    ``...`` placeholders in odd places) is parsed line by line, keeping what parses."""
    try:
        return [ast.parse(block)]
    except SyntaxError:
        trees = []
        for line in block.splitlines():
            try:
                trees.append(ast.parse(line.strip()))
            except SyntaxError:
                continue
        return trees


def _code_references(block: str) -> set[str]:
    """``quicksave.a.b:name`` for each name imported from a quicksave module, and
    ``quicksave.x.y`` for each attribute chain rooted at the name ``quicksave``."""
    refs: set[str] = set()
    for tree in _statements(block):
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == (
                "quicksave"
            ):
                refs.update(f"{node.module}:{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                refs.update(a.name for a in node.names if a.name.split(".")[0] == "quicksave")
            elif isinstance(node, ast.Attribute):
                chain = []
                value: ast.AST = node
                while isinstance(value, ast.Attribute):
                    chain.append(value.attr)
                    value = value.value
                if isinstance(value, ast.Name) and value.id == "quicksave":
                    refs.add(".".join(["quicksave", *reversed(chain)]))
    return refs


def _resolve(ref: str) -> object:
    """Import ``quicksave.mod:name`` or follow ``quicksave.a.b`` (attribute, else
    submodule, at each step), as a user's code would."""
    if ":" in ref:
        module, name = ref.split(":")
        return getattr(importlib.import_module(module), name)
    parts = ref.split(".")
    obj: object = importlib.import_module(parts[0])
    for i in range(1, len(parts)):
        try:
            obj = getattr(obj, parts[i])
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


def _all_references() -> list[tuple[str, str]]:
    found: dict[str, str] = {}
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        where = str(doc.relative_to(ROOT))
        for block in _blocks(text):
            for ref in _code_references(block):
                found.setdefault(ref, where)
        for span in _spans(text):
            refs = set(_DOTTED.findall(span))
            if span.startswith(("from quicksave", "import quicksave")):
                refs |= _code_references(span)  # an import shown inline
            for ref in refs:
                found.setdefault(ref, where)
    return sorted(found.items())


def _readme_calls() -> list[str]:
    """The names the README calls, less the classes its blocks define themselves."""
    text = README.read_text(encoding="utf-8")
    names = set()
    defined = set()
    for piece in _spans(text) + _blocks(text):
        names.update(_CALL.findall(piece))
        for tree in _statements(piece):
            defined.update(n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef))
    return sorted(names - defined)


def test_the_docs_reference_quicksave_names_at_all() -> None:
    """The parsers find what the README shows (so the checks below check something)."""
    refs = dict(_all_references())
    for ref in ("quicksave:CheckpointManager", "quicksave.save", "quicksave.load_state"):
        assert refs.get(ref) == "README.md", ref
    assert {"StorageOptions", "S3Options", "CheckpointConfig"} <= set(_readme_calls())
    assert refs.get("quicksave:StorageOptions") == "README.md"  # shown as an inline import


@pytest.mark.parametrize(("ref", "doc"), _all_references())
def test_each_referenced_name_imports(ref: str, doc: str) -> None:
    try:
        _resolve(ref)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{doc} shows {ref!r}, which does not import: {e}")


@pytest.mark.parametrize("name", _readme_calls())
def test_each_readme_call_imports_from_quicksave(name: str) -> None:
    module = ELSEWHERE.get(name, "quicksave")
    assert hasattr(importlib.import_module(module), name), (
        f"the README calls {name}(...), which `from {module} import {name}` cannot import"
    )
    if module == "quicksave":
        assert name in quicksave.__all__


def test_the_readme_names_of_issue_20_import() -> None:
    from quicksave import S3Options, StorageOptions, verify_checkpoint

    assert StorageOptions(s3=S3Options(region="us-east-1")).s3.region == "us-east-1"
    assert verify_checkpoint.__module__ == "quicksave.loading.verify"
