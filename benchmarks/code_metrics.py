"""The package's size and shape metrics, read from the source with ``ast`` (nothing is imported):

* ``getattr`` / ``hasattr`` calls;
* functions (and methods) longer than ``--long`` lines (default 60), longest first; also counted
  without their docstrings;
* modules longer than ``--big`` lines (default 500);
* package imports inside functions, per module;
* the fields of the run context (``--context``, a ``module:Class`` dataclass; default
  ``mempo_jax.run.context:RunContext``).

Import circles and upward imports are ``tests/test_layers.py``'s (it fails on any).

    python benchmarks/code_metrics.py [--json FILE] [--long 60] [--big 500] [--list]
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import sys

PACKAGE = "mempo_jax"
ROOT = pathlib.Path(__file__).resolve().parents[1] / PACKAGE


def _sources() -> dict[str, str]:
    """Every module's source by its path relative to the repository root."""
    return {str(p.relative_to(ROOT.parent)): p.read_text() for p in sorted(ROOT.rglob("*.py"))}


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _length(fn: ast.FunctionDef, docstring: bool = True) -> int:
    """Lines of a function from its ``def`` to its last line (``docstring=False``: its docstring not counted)."""
    n = fn.end_lineno - fn.lineno + 1
    if docstring:
        return n
    first = fn.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        n -= first.end_lineno - first.lineno + 1
    return n


def _inner_imports(tree: ast.AST) -> int:
    """Imports of the package written inside a function body."""
    count = 0
    for fn in _functions(tree):
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE) and node.level == 0:
                count += 1
            elif isinstance(node, ast.ImportFrom) and node.level > 0:
                count += 1
            elif isinstance(node, ast.Import):
                count += sum(a.name.startswith(PACKAGE) for a in node.names)
    return count


def _context_fields(spec: str) -> list[str]:
    """The annotated fields of class ``module:Class`` (read from its source)."""
    module, _, name = spec.partition(":")
    path = ROOT.parent / (module.replace(".", "/") + ".py")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    raise SystemExit(f"--context {spec}: no class {name!r} in {path}")


def measure(long: int, big: int, context: str) -> dict:
    """The metrics above as a JSON-ready dict (``long_functions`` / ``long_functions_code``: ``[path:name,
    lines]`` longest first, docstrings counted / not)."""
    attr_calls, long_fns, long_code, big_modules, inner = 0, [], [], [], {}
    for path, src in _sources().items():
        tree = ast.parse(src)
        lines = src.count("\n")
        if lines > big:
            big_modules.append([path, lines])
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
                attr_calls += 1
        for fn in _functions(tree):
            if (n := _length(fn)) > long:
                long_fns.append([f"{path}:{fn.name}", n])
            if (n := _length(fn, docstring=False)) > long:
                long_code.append([f"{path}:{fn.name}", n])
        if (k := _inner_imports(tree)):
            inner[path] = k
    return {
        "getattr_hasattr": attr_calls,
        "long_functions": sorted(long_fns, key=lambda x: -x[1]),
        "long_functions_code": sorted(long_code, key=lambda x: -x[1]),
        "big_modules": sorted(big_modules, key=lambda x: -x[1]),
        "inner_imports": sum(inner.values()),
        "inner_imports_by_module": dict(sorted(inner.items(), key=lambda x: -x[1])),
        "context": context,
        "context_fields": _context_fields(context),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", type=int, default=60, help="a function longer than this many lines is long")
    ap.add_argument("--big", type=int, default=500, help="a module longer than this many lines is big")
    ap.add_argument("--context", default="mempo_jax.run.context:RunContext", help="module:Class of the run context")
    ap.add_argument("--json", help="also write the metrics to this file")
    ap.add_argument("--list", action="store_true", help="list the long functions, big modules and inner imports")
    args = ap.parse_args(argv)
    m = measure(args.long, args.big, args.context)
    print(f"getattr/hasattr calls: {m['getattr_hasattr']}")
    print(f"functions over {args.long} lines: {len(m['long_functions'])} "
          f"({len(m['long_functions_code'])} without their docstrings)")
    print(f"modules over {args.big} lines: {len(m['big_modules'])}")
    print(f"package imports inside functions: {m['inner_imports']}")
    print(f"{m['context']} fields: {len(m['context_fields'])}")
    if args.list:
        for name, n in m["long_functions"] + m["big_modules"]:
            print(f"  {n:5d}  {name}")
        for name, n in m["inner_imports_by_module"].items():
            print(f"  {n:5d}  imports inside functions: {name}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(m, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
