"""Every module name dynspec-patch spells as a string resolves in the installed package.

    python -I tests/packaging/module_names.py [SOURCE_DIR]

tests/run.sh runs it with the test virtualenv's interpreter, isolated (``-I``: neither this
script's directory, PYTHONPATH nor the user site is on sys.path), from a directory outside the
checkout, so a name resolves only where an installed user's would. It parses the sources the
installed ``dynspec-patch`` distribution put on disk (or every ``*.py`` under SOURCE_DIR, for
its tests) and resolves, with importlib, each module name given as a string literal (or as a
name bound to string literals in the same function or module: ``for package in ("a", "b")``,
``PACKAGE = "a"``) to:

- ``importlib.resources`` (``files``, ``read_text``, ...) and
  ``pkgutil.get_data``: must be a package;
- ``importlib.import_module``, ``__import__``, ``importlib.util.find_spec``;
- ``-m`` in an argv list (``[sys.executable, "-m", "pip", ...]``) and ``python3 -m NAME`` in a
  string (a command line run here or shipped to a host);
- the distribution's entry points (``module:attr``), which are loaded.

Names of SGLang (``sglang`` and below) belong to the GPU host's interpreter, not this one: they
are listed, not resolved. One line per name; exit 1 if any does not resolve (or none was found,
which would mean the scan itself is broken).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import itertools
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

DISTRIBUTION = "dynspec-patch"
HOST_SIDE = "sglang"  # the server's package: resolved on the host, never here
# qualified callee -> what its first argument must resolve to
CALLS = {
    **{f"importlib.resources.{name}": "package" for name in (
        "files", "read_text", "read_binary", "open_text", "open_binary", "path", "contents",
        "is_resource")},
    "pkgutil.get_data": "package",
    "importlib.import_module": "module",
    "importlib.util.find_spec": "module",
    "__import__": "module",
}
PYTHON_M = re.compile(r"(?:^|[\s/'\"`(])python[\d.]*\s+-m\s+([A-Za-z_][\w.]*)")


@dataclass(frozen=True, order=True)
class Use:
    file: str
    line: int
    kind: str  # "package" | "module"
    name: str

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the dotted name it was imported as (``from importlib import resources``
    makes ``resources`` -> ``importlib.resources``)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([aliases.get(node.id, node.id), *reversed(parts)])


def _string(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _bind(target: ast.expr, value: ast.expr, into: dict[str, set[str]]) -> None:
    """Record the string literals ``value`` gives the names in ``target``."""
    if isinstance(target, ast.Name) and (text := _string(value)) is not None:
        into.setdefault(target.id, set()).add(text)
    elif (isinstance(target, ast.Tuple | ast.List) and isinstance(value, ast.Tuple | ast.List)
          and len(target.elts) == len(value.elts)):
        for name, item in zip(target.elts, value.elts, strict=True):
            _bind(name, item, into)


def _bindings(nodes: Iterable[ast.AST]) -> dict[str, set[str]]:
    """Names bound to string literals by ``nodes``: ``name = "x"``, and the targets of
    ``for a, b in (("x", ...), ...)`` loops and comprehensions, element by element."""
    found: dict[str, set[str]] = {}
    for node in nodes:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                _bind(target, node.value, found)
        elif isinstance(node, ast.For | ast.comprehension) and isinstance(
                node.iter, ast.Tuple | ast.List | ast.Set):
            for item in node.iter.elts:
                _bind(node.target, item, found)
    return found


def _names(node: ast.expr | None, *scopes: dict[str, set[str]]) -> list[str]:
    """The string literal ``node`` is, or those the name ``node`` is bound to in the nearest
    scope that binds it."""
    if (text := _string(node)) is not None:
        return [text]
    if isinstance(node, ast.Name):
        for scope in scopes:
            if node.id in scope:
                return sorted(scope[node.id])
    return []


def uses_in(path: Path, label: str) -> Iterator[Use]:
    tree = ast.parse(path.read_bytes(), filename=label)
    aliases = _aliases(tree)
    scopes: dict[int, list[ast.AST]] = {}  # the module and each function: its own nodes
    stack: list[tuple[ast.AST, ast.AST]] = [(tree, tree)]
    while stack:
        node, scope = stack.pop()
        scopes.setdefault(id(scope), []).append(node)
        inner = node if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) \
            else scope
        stack.extend((child, inner) for child in ast.iter_child_nodes(node))
    module_names = _bindings(scopes[id(tree)])
    for scope_id, nodes in scopes.items():
        local_names = {} if scope_id == id(tree) else _bindings(nodes)
        for node in nodes:
            yield from _uses_at(node, label, aliases, local_names, module_names)


def _uses_at(node: ast.AST, label: str, aliases: dict[str, str],
             local_names: dict[str, set[str]], module_names: dict[str, set[str]],
             ) -> Iterator[Use]:
    where = (label, getattr(node, "lineno", 0))
    if isinstance(node, ast.Call):
        kind = CALLS.get(_dotted(node.func, aliases) or "")
        if kind and node.args:
            for name in _names(node.args[0], local_names, module_names):
                yield Use(*where, kind, name)
    elif isinstance(node, ast.List | ast.Tuple):
        items = node.elts
        program = _string(items[0]) if items else None
        if program is not None and "python" not in Path(program).name:
            return  # ["docker", "commit", "-m", MESSAGE, ...]: this -m is not Python's
        for flag, value in itertools.pairwise(items):
            if _string(flag) == "-m":
                for name in _names(value, local_names, module_names):
                    yield Use(*where, "module", name)
    elif text := _string(node):
        for match in PYTHON_M.finditer(text):
            yield Use(*where, "module", match.group(1).rstrip("."))


def resolve(use: Use) -> str:
    """Where the name resolves here; raises LookupError when it does not."""
    try:
        spec = importlib.util.find_spec(use.name)
    except (ImportError, ValueError) as exc:  # a missing parent package
        raise LookupError(f"{type(exc).__name__}: {exc}") from None
    if spec is None:
        raise LookupError("no such module")
    if use.kind == "package" and spec.submodule_search_locations is None:
        raise LookupError(f"{spec.origin} is a module, not a package")
    return spec.origin or ", ".join(spec.submodule_search_locations or [])


def installed_sources() -> tuple[list[tuple[Path, str]], list[importlib.metadata.EntryPoint]]:
    dist = importlib.metadata.distribution(DISTRIBUTION)
    sources = [(Path(str(dist.locate_file(f))), f.as_posix())
               for f in dist.files or () if f.suffix == ".py"]
    return sources, list(dist.entry_points)


def main(argv: list[str]) -> int:
    if argv:
        root = Path(argv[0])
        sources = [(p, p.relative_to(root).as_posix()) for p in sorted(root.rglob("*.py"))]
        entry_points: list[importlib.metadata.EntryPoint] = []
    else:
        sources, entry_points = installed_sources()
    failed = checked = 0
    for use in sorted({u for path, label in sources for u in uses_in(path, label)}):
        checked += 1
        if use.name == HOST_SIDE or use.name.startswith(HOST_SIDE + "."):
            print(f"{use.where}: {use.kind} {use.name}: on the GPU host (not resolved here)")
            continue
        try:
            print(f"{use.where}: {use.kind} {use.name} -> {resolve(use)}")
        except LookupError as exc:
            failed += 1
            print(f"{use.where}: {use.kind} {use.name} DOES NOT RESOLVE ({exc})")
    for entry in entry_points:
        checked += 1
        try:
            entry.load()
            print(f"entry point {entry.name}: {entry.value} -> loaded")
        except (ImportError, AttributeError) as exc:
            failed += 1
            print(f"entry point {entry.name}: {entry.value} DOES NOT RESOLVE ({exc})")
    if not checked:
        print("no module name found in any source: the scan is broken")
        return 1
    print(f"{checked} module names checked, {failed} do not resolve")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
