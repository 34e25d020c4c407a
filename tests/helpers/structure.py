"""The package's structure, measured from the source: the import graph (imports inside
functions included), module sizes, and who talks to other ranks.

``tests/test_layering.py`` holds the rules; ``python tests/helpers/structure.py`` prints the
numbers (cycles, modules over the size limit, line counts, collective call sites).
``python tests/helpers/structure.py --module-map`` rewrites the module map of
docs/ARCHITECTURE.md from the modules' docstrings (``tests/test_module_map.py`` fails
when the committed map differs from the source).
Nothing here imports the package: everything is read with :mod:`ast`.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
LIBRARY = "quicksave"
TOOLS = "quicksave_tools"  # benchmarks, demo, test servers: shipped beside the library
MAX_LINES = 600

# torch.distributed functions that talk to other ranks
COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_object",
        "all_gather_into_tensor",
        "all_to_all",
        "barrier",
        "monitored_barrier",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "reduce",
        "reduce_scatter",
        "scatter",
        "scatter_object_list",
        "send",
        "recv",
        "isend",
        "irecv",
    }
)
DIST_NAMES = frozenset({"dist", "torch.distributed", "c10d"})


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    lines: int
    tree: ast.Module
    imports: set[str] = field(default_factory=set)  # modules of the package it imports
    external: set[str] = field(default_factory=set)  # top-level names of other imports
    top_level_external: set[str] = field(default_factory=set)  # ... at module level only


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def load(src: Path = SRC, packages: tuple[str, ...] = (LIBRARY, TOOLS)) -> dict[str, Module]:
    """Every module of ``packages`` under ``src``, with the package modules it imports."""
    mods: dict[str, Module] = {}
    for pkg in packages:
        for path in sorted((src / pkg).rglob("*.py")):
            parts = list(path.relative_to(src).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            text = path.read_text()
            mods[".".join(parts)] = Module(
                ".".join(parts), path, is_package, text.count("\n"), ast.parse(text)
            )
    for m in mods.values():
        _resolve_imports(m, mods)
    return mods


def _module_of(name: str, mods: dict[str, Module]) -> str | None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in mods:
            return ".".join(parts[:i])
    return None


def _resolve_imports(m: Module, mods: dict[str, Module]) -> None:
    top_level = {id(n) for n in m.tree.body}
    for node in ast.walk(m.tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = m.name.split(".")
                if not m.is_package:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from a import b` imports the module a.b when there is one, else a
            targets = [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            found = _module_of(t, mods)
            if found is None:
                root = t.split(".")[0]
                m.external.add(root)
                if id(node) in top_level:
                    m.top_level_external.add(root)
            elif found != m.name and not m.name.startswith(found + "."):
                # importing a parent package is implied by importing any module
                m.imports.add(found)


def cycles(mods: dict[str, Module]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        for w in sorted(mods[v].imports):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 10_000))
    try:
        for v in sorted(mods):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(old)
    return out


def collective_calls(m: Module) -> list[tuple[int, str]]:
    """``(line, call)`` of every torch.distributed collective that ``m`` calls."""
    found = []
    for node in ast.walk(m.tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in COLLECTIVES and _dotted(node.func.value) in DIST_NAMES:
                found.append((node.lineno, f"{_dotted(node.func.value)}.{node.func.attr}"))
    return found


# What asks which backend it has: a location's ``is_local`` / ``scheme``, a backend's
# ``atomic_rename``, ``isinstance(..., LocalBackend)``. Outside the storage and commit
# layers each one is a branch on the backend that the commit strategy should answer.
BACKEND_QUESTIONS = frozenset({"is_local", "atomic_rename", "scheme"})
# The layers where the answer lives.
BACKEND_LAYERS = ("quicksave.storage", "quicksave.commit")


def backend_branches(m: Module) -> list[tuple[int, str]]:
    """``(line, what)`` of every place ``m`` asks which backend it has."""
    found = []
    for node in ast.walk(m.tree):
        if isinstance(node, ast.Attribute) and node.attr in BACKEND_QUESTIONS:
            found.append((node.lineno, f".{node.attr}"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and any("LocalBackend" in ast.unparse(a) for a in node.args[1:])
        ):
            found.append((node.lineno, "isinstance(..., LocalBackend)"))
    return found


def _called(node: ast.AST) -> set[str]:
    """Names of the functions and methods called anywhere under ``node``."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            out.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return out


def plan_exchanges(m: Module) -> list[tuple[int, str]]:
    """``(line, function)`` of every function of ``m`` that exchanges plans: it gathers
    to one rank and scatters back (``gather_object`` and ``scatter_object``, directly or
    through the collectives module), or calls DCP's ``reduce_scatter``."""
    found = []
    for node in ast.walk(m.tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            called = _called(node)
            gathers = called & {"gather_object", "gather"}
            scatters = called & {"scatter_object", "scatter_object_list", "scatter"}
            if (gathers and scatters) or "reduce_scatter" in called:
                found.append((node.lineno, node.name))
    return found


def plan_caches(m: Module) -> list[tuple[int, str, bool]]:
    """``(line, class, is a view)`` of every class of ``m`` that caches plans (named
    ``...PlanCache``, ``...MetadataCache`` or ``...Plans``); a view holds a ``PlanCache``
    instead of caching itself."""
    found = []
    for node in ast.walk(m.tree):
        if isinstance(node, ast.ClassDef) and (
            node.name.endswith(("PlanCache", "MetadataCache")) or node.name.endswith("Plans")
        ):
            found.append((node.lineno, node.name, "PlanCache" in _called(node)))
    return found


def manifest_builds(m: Module) -> list[tuple[int, str]]:
    """``(line, function)`` of every place in ``m`` that constructs a ``Manifest`` (the
    parser of ``manifest.json`` in format/ reads one; every save builds one through
    ``saving.skeleton``)."""
    found = []
    for node in ast.walk(m.tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for n in ast.walk(node):
                if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Manifest":
                    found.append((n.lineno, node.name))
    return found


# Allocations of shared memory that a save stages tensors into (a memfd named a pool,
# torch's shared storage); the worker's heartbeat memfd is not one.
SHARED_ALLOCATIONS = frozenset({"_new_shared", "share_memory_", "memfd_create"})


def staging_allocations(m: Module) -> list[tuple[int, str]]:
    """``(line, call)`` of every allocation of staging memory in ``m``."""
    found = []
    for node in ast.walk(m.tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in SHARED_ALLOCATIONS and "heartbeat" not in ast.unparse(node):
                found.append((node.lineno, node.func.attr))
    return found


def in_layer(name: str, layer: str) -> bool:
    return name == layer or name.startswith(layer + ".")


# The library's layers from the bottom (docs/ARCHITECTURE.md, "Layering rules"): a module
# imports only from its own layer or below, and two packages of one layer never import
# each other. Top-level modules (``quicksave.api``) are packages of their own here.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "checksum", "trace"),
    ("format",),
    ("layout",),
    ("storage",),
    ("commit",),
    ("stage", "worker"),
    ("ranks",),
    ("saving", "loading"),
    ("tiers",),
    ("adapters", "api", "compat", "async_api"),
    ("manager",),
    ("integrations", "tools", "cli"),
)


def package_of(name: str) -> str | None:
    """The first-level package (or top-level module) of a library module; ``None`` for
    the package itself (``quicksave/__init__.py`` re-exports the API) and ``__main__``."""
    parts = name.split(".")
    if parts[0] != LIBRARY or len(parts) == 1 or parts[1] == "__main__":
        return None
    return parts[1]


def layer_of(package: str) -> int:
    for i, group in enumerate(LAYERS):
        if package in group:
            return i
    raise KeyError(f"package {package!r} is in no layer of LAYERS: add it")


def upward_imports(mods: dict[str, Module]) -> list[tuple[str, str]]:
    """``(importer, imported)`` for every import from a lower layer into a higher one."""
    found = []
    for n, m in sorted(mods.items()):
        a = package_of(n)
        if a is None:
            continue
        for i in sorted(m.imports):
            b = package_of(i)
            if b is not None and b != a and layer_of(b) > layer_of(a):
                found.append((n, i))
    return found


def package_pairs(mods: dict[str, Module]) -> list[tuple[str, str]]:
    """Pairs of packages that import each other (function-level imports count)."""
    edges = set()
    for n, m in mods.items():
        a = package_of(n)
        for i in m.imports:
            b = package_of(i)
            if a is not None and b is not None and a != b:
                edges.add((a, b))
    return sorted((a, b) for a, b in edges if a < b and (b, a) in edges)


def report() -> None:
    mods = load()
    lib = {n: m for n, m in mods.items() if in_layer(n, LIBRARY)}
    print(f"library: {len(lib)} modules, {sum(m.lines for m in lib.values())} lines")
    tools = {n: m for n, m in mods.items() if in_layer(n, TOOLS)}
    print(f"tools: {len(tools)} modules, {sum(m.lines for m in tools.values())} lines")
    cyc = cycles(mods)
    print(f"import cycles: {len(cyc)}")
    for c in cyc:
        print("  ", " ".join(c))
    up = upward_imports(lib)
    print(f"imports from a lower layer into a higher one: {len(up)}")
    for a, b in up:
        print(f"   {a} -> {b}")
    pairs = package_pairs(lib)
    print(f"pairs of packages importing each other: {len(pairs)}")
    for a, b in pairs:
        print(f"   {a} <-> {b}")
    big = sorted(((m.lines, n) for n, m in mods.items() if m.lines > MAX_LINES), reverse=True)
    print(f"modules over {MAX_LINES} lines: {len(big)}")
    for lines, n in big:
        print(f"   {lines:5d} {n}")
    branches = {
        n: backend_branches(m)
        for n, m in lib.items()
        if not any(in_layer(n, layer) for layer in BACKEND_LAYERS)
    }
    branches = {n: b for n, b in branches.items() if b}
    print(f"backend branches outside storage/ and commit/: {sum(map(len, branches.values()))}")
    for n, found in sorted(branches.items()):
        print(f"   {n}: " + ", ".join(f"{what} (line {line})" for line, what in found))
    talkers = {n: collective_calls(m) for n, m in lib.items()}
    talkers = {n: c for n, c in talkers.items() if c}
    print(f"modules calling collectives: {len(talkers)}")
    for n, calls in sorted(talkers.items()):
        print(f"   {n}: {', '.join(sorted({c for _, c in calls}))}")
    for title, find in (
        ("plan exchanges", plan_exchanges),
        ("staging allocations", staging_allocations),
        ("manifest builders", manifest_builds),
    ):
        found = {n: f for n, m in lib.items() if (f := find(m))}
        print(f"{title}: {sum(map(len, found.values()))}")
        for n, f in sorted(found.items()):
            print(f"   {n}: " + ", ".join(f"{what} (line {line})" for line, what in f))
    caches = {n: c for n, m in lib.items() if (c := plan_caches(m))}
    own = sum(1 for c in caches.values() for _, _, view in c if not view)
    print(f"plan caches: {own} (views of one: {sum(map(len, caches.values())) - own})")
    for n, c in sorted(caches.items()):
        print(f"   {n}: " + ", ".join(f"{cls}{' (view)' if v else ''}" for _, cls, v in c))


# The module map of docs/ARCHITECTURE.md ("Module map"): written between these markers
# by ``python tests/helpers/structure.py --module-map``, never by hand.
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
MAP_COMMAND = "python tests/helpers/structure.py --module-map"
MAP_START = f"<!-- module map: generated by `{MAP_COMMAND}`; do not edit by hand -->"
MAP_END = "<!-- end of the module map -->"
# a description longer than this is cut at a word, with an ellipsis
MAP_WIDTH = 160
# the end of a sentence: a full stop (not that of "e.g.", "i.e.", ...) before a space
_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\betc)(?<!\bvs)(?<!\bcf)[.!?](?=\s)")


def first_sentence(doc: str | None, width: int = MAP_WIDTH) -> str:
    """The first sentence of a docstring's first paragraph on one line, cut at a word
    (never inside a ````literal````) with `` …`` when longer than ``width``; ``|`` escaped
    for a Markdown table."""
    if not doc:
        return "(no docstring)"
    text = " ".join(doc.strip().split("\n\n")[0].split())
    end = _SENTENCE_END.search(text + " ")
    if end:
        text = text[: end.end()]
    if len(text) > width:
        cuts = [i for i, c in enumerate(text[: width + 1]) if c == " "]
        cuts = [i for i in cuts if text[:i].count("``") % 2 == 0]
        text = (text[: cuts[-1]] if cuts else text[:width]).rstrip(" ,;:(") + " …"
    return text.replace("|", "\\|")


def _map_rows(mods: list[Module], root: str) -> list[str]:
    rows = ["| module | what it is |", "|---|---|"]
    for m in sorted(mods, key=lambda m: m.name):
        path = m.path.relative_to(SRC / root).as_posix()
        rows.append(f"| `{path}` | {first_sentence(ast.get_docstring(m.tree))} |")
    return rows


def module_map(mods: dict[str, Module]) -> str:
    """The module map: every module of the library, layer by layer from the bottom
    (``LAYERS``), then the package itself, then ``quicksave_tools``; each with the first
    sentence of its docstring. No line counts: an edit inside a module leaves the map
    true."""
    lib = {n: m for n, m in mods.items() if in_layer(n, LIBRARY)}
    out = [
        MAP_START,
        "",
        f"Every module of `{LIBRARY}` and of `{TOOLS}` with the first sentence of its "
        "docstring: the library layer by layer from the bottom (`LAYERS` in "
        "`tests/helpers/structure.py`), each layer's packages in that order.",
    ]
    for i, group in enumerate(LAYERS):
        members = [m for n, m in lib.items() if package_of(n) in group]
        names = ", ".join(f"`{g}/`" if (SRC / LIBRARY / g).is_dir() else f"`{g}.py`" for g in group)
        out += ["", f"**Layer {i}: {names}**", ""]
        for g in group:
            out += _map_rows([m for m in members if package_of(m.name) == g], LIBRARY)[
                (0 if g == group[0] else 2) :
            ]
    top = [m for n, m in lib.items() if package_of(n) is None]
    out += ["", f"**`{LIBRARY}/` itself** (the public names, above every layer)", ""]
    out += _map_rows(top, LIBRARY)
    out += ["", f"**`{TOOLS}/`** (beside the library, never imported by it)", ""]
    out += _map_rows([m for n, m in mods.items() if in_layer(n, TOOLS)], TOOLS)
    out += ["", MAP_END]
    return "\n".join(out)


def committed_module_map(text: str) -> str:
    """The module map in the text of docs/ARCHITECTURE.md, markers included."""
    if text.count(MAP_START) != 1 or text.count(MAP_END) != 1:
        raise ValueError(
            f"{ARCHITECTURE} must hold each module map marker once: {MAP_START!r}, {MAP_END!r}"
        )
    start = text.index(MAP_START)
    return text[start : text.index(MAP_END) + len(MAP_END)]


def write_module_map(path: Path = ARCHITECTURE) -> bool:
    """Rewrite the module map of ``path`` from the source; ``True`` if it changed."""
    text = path.read_text()
    new = text.replace(committed_module_map(text), module_map(load()))
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":
    if sys.argv[1:] == ["--module-map"]:
        changed = write_module_map()
        print(f"{ARCHITECTURE}: module map {'rewritten' if changed else 'already current'}")
    elif sys.argv[1:]:
        sys.exit("usage: python tests/helpers/structure.py [--module-map]")
    else:
        report()
