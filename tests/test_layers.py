"""The package's import layers: no module imports from a layer above its own, and no modules import
each other in a loop. Every ``import`` counts, at module level, inside a function or under
``if TYPE_CHECKING:`` (read from the source with ``ast``; nothing is imported).

Layers, lowest first (a module may import its own layer and those below):

* ``core``, with ``recipes``: it imports nothing of the package (``text`` reads
  ``recipes.find_file``);
* ``text``;
* ``model`` and ``tools``;
* ``agent``;
* ``rl``;
* ``data``: question sets and scripted conversations, over ``agent`` / ``tools`` / ``text``;
* ``config``: the run's config dataclasses over every library layer, and ``config_loader``, which
  parses gin into them; ``run`` reads both;
* ``run``;
* ``commands``: every command's argument parsing and ``main()``.

An entry may be dotted, placing one module; the longest matching entry wins.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = "mempo_jax"
ROOT = pathlib.Path(__file__).resolve().parents[1] / PACKAGE

LAYERS = (
    ("core", "recipes"),
    ("text",),
    ("model", "tools"),
    ("agent",),
    ("rl",),
    ("data",),
    ("config", "config_loader"),
    ("run",),
    ("commands",),
)


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> list[tuple[str, int]]:
    """``(imported module, line)`` of every import of the package in ``path``, wherever it stands;
    ``from a import b`` names ``a.b`` when that is a module, else ``a``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != PACKAGE:
                continue
            out += [(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base, node.lineno) for a in node.names]
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def layer(name: str) -> int | None:
    """The layer index of module ``name`` (the longest matching ``LAYERS`` entry); ``None`` for the
    package itself."""
    rel = name.split(".")[1:]
    best, found = -1, None
    for i, entries in enumerate(LAYERS):
        for entry in entries:
            parts = entry.split(".")
            if rel[: len(parts)] == parts and len(parts) > best:
                best, found = len(parts), i
    return found


def test_every_module_has_a_layer():
    assert [m for m in MODULES if m != PACKAGE and layer(m) is None] == []


def test_no_module_imports_from_a_higher_layer():
    up = [f"{name}:{line} imports {target} (layer {layer(target)} > {layer(name)})"
          for name, edges in GRAPH.items() if name != PACKAGE
          for target, line in edges if target != PACKAGE and layer(target) > layer(name)]
    assert up == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    graph = {name: {t for t, _ in edges if t != name} for name, edges in GRAPH.items()}
    assert _cycles(graph) == []


def test_the_checks_have_teeth():
    """An upward import and a loop are found (on a made-up graph), so the two tests above can fail."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer(f"{PACKAGE}.core.logprobs") < layer(f"{PACKAGE}.model.forward") < layer(f"{PACKAGE}.rl.step")
    assert layer(f"{PACKAGE}.commands.write_sft_messages") > layer(f"{PACKAGE}.run.experiment") > layer(f"{PACKAGE}.data.world")
    assert layer(f"{PACKAGE}.commands.train") == len(LAYERS) - 1
