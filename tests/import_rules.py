"""DESIGN.md section 1's import rules, checked statically on the source of a tree.

Every way a file can reach another ember module counts: ``import ember.x``, ``from ember.x
import y``, ``from ember import x``, relative imports (``from ..x import y``, ``from .. import
x``), ``importlib.import_module``/``__import__`` with a constant name, and any string that
is exactly a module path (``"ember.x.y"`` or an entry point ``"ember.x.y:Name"``, which code
hands to ``import_module`` later). Each package may import the packages in
:data:`PACKAGE_RULES`; each top-level file (``ember/*.py``) has its own rule in
:data:`TOP_LEVEL_RULES`. Nothing imports ``tests`` or ``benchmarks``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
from collections.abc import Iterator
from pathlib import Path

# package -> the ember packages it may import (besides itself)
PACKAGE_RULES: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "kernels_pallas": frozenset({"core"}),
    "envs": frozenset({"core"}),
    "models": frozenset({"core", "kernels_pallas"}),
    # RL for LMs and training-time samples run the serving engine; serving never imports training.
    "training": frozenset({"core", "kernels_pallas", "models", "envs", "serving"}),
    "serving": frozenset({"core", "kernels_pallas", "models"}),
}


@dataclasses.dataclass(frozen=True)
class TopLevelRule:
    """What a top-level file may import: ``eager`` at module level, ``lazy`` only inside a
    function or as a module-path string resolved when a command runs. The root package
    itself (``import ember``, ``from ember import __version__``) is always allowed."""

    eager: frozenset[str] = frozenset()
    lazy: frozenset[str] = frozenset()


TOP_LEVEL_RULES: dict[str, TopLevelRule] = {
    # `import ember` stays cheap: no subpackage (and so no JAX) until first use.
    "__init__": TopLevelRule(),
    "__main__": TopLevelRule(eager=frozenset({"cli"})),
    # `ember --help` imports no JAX: each subcommand's module is imported only when run,
    # and subcommands belong to the packages a user drives from the shell (`ember info`, which
    # lists the kernels per backend, to kernels_pallas).
    "cli": TopLevelRule(lazy=frozenset({"core", "kernels_pallas", "envs", "training", "serving"})),
}

FORBIDDEN_ROOTS = ("tests", "benchmarks")

_MODULE_PATH = re.compile(r"ember(\.\w+)+(:[\w.]+)?")
_IMPORT_CALLS = ("import_module", "__import__")


@dataclasses.dataclass(frozen=True)
class Reference:
    """One reference from a file to a module: ``module`` is a dotted absolute name (for
    ``from PACKAGE import a, b`` one reference per name, ``PACKAGE.a``); ``eager`` when it
    runs at import time; ``plain_import`` for an ``import a.b.c`` statement."""

    module: str
    line: int
    eager: bool
    plain_import: bool = False


def _module_parts(path: Path, root: Path) -> list[str]:
    """``ember/serving/cli.py`` -> ``["ember", "serving", "cli"]``; a package's
    ``__init__.py`` -> the package's parts."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _resolve_relative(path: Path, root: Path, level: int, module: str | None) -> str | None:
    """The absolute name of a relative import in ``path`` (None if it climbs above ``root``)."""
    package = _module_parts(path, root)
    if path.name != "__init__.py":
        package = package[:-1]
    if level - 1 >= len(package):
        return None
    base = package[: len(package) - (level - 1)]
    return ".".join(base + (module.split(".") if module else []))


class _Collector(ast.NodeVisitor):
    def __init__(self, path: Path, root: Path):
        self.path, self.root = path, root
        self.depth = 0  # function nesting: 0 means the statement runs at import time
        self.references: list[Reference] = []
        self.import_names: set[int] = set()  # ids of string nodes already read as import calls

    def _add(self, module: str | None, node: ast.AST, plain_import: bool = False) -> None:
        if module:
            self.references.append(Reference(module, node.lineno, self.depth == 0, plain_import))

    def _function(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node, plain_import=True)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = _resolve_relative(self.path, self.root, node.level, node.module)
        else:
            base = node.module
        if base is None:
            return
        # `from PACKAGE import a` may name a submodule: record PACKAGE.a (a non-module name
        # resolves back to PACKAGE when the target is looked up).
        for alias in node.names:
            self._add(f"{base}.{alias.name}" if alias.name != "*" else base, node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in _IMPORT_CALLS and node.args and isinstance(node.args[0], ast.Constant):
            target = node.args[0].value
            if isinstance(target, str):
                self.import_names.add(id(node.args[0]))
                package = (
                    node.args[1]
                    if len(node.args) > 1
                    else next((kw.value for kw in node.keywords if kw.arg == "package"), None)
                )
                if target.startswith(".") and isinstance(package, ast.Constant):
                    stripped = target.lstrip(".")
                    level = len(target) - len(stripped)
                    parts = str(package.value).split(".")
                    target = ".".join(parts[: len(parts) - (level - 1)] + ([stripped] if stripped else []))
                self._add(target, node)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and id(node) not in self.import_names and _MODULE_PATH.fullmatch(node.value):
            self.depth += 1  # a string imports nothing by itself: whoever resolves it does, later
            self._add(node.value.split(":")[0], node)
            self.depth -= 1


def references(path: Path, root: Path) -> tuple[Reference, ...]:
    """Every module reference in the file ``path`` of the package tree ``root``."""
    return _references(str(path.relative_to(root.parent)), path.read_text())


@functools.cache
def _references(relative: str, text: str) -> tuple[Reference, ...]:
    # Cached on the file's place and text: the checker's own tests run it on many copies
    # of the tree that differ in one file.
    path = Path("/", relative)
    collector = _Collector(path, Path("/", path.parts[1]))  # the tree's top directory, "/ember"
    collector.visit(ast.parse(text, filename=relative))
    return tuple(collector.references)


def _shadowed_submodules(root: Path) -> set[str]:
    """Dotted names ``pkg.m`` where ``pkg/__init__.py`` binds ``m`` to something that is not
    the submodule ``m`` (e.g. ``kernels_pallas.flash_attention``, the op function)."""
    shadowed = set()
    for init in root.rglob("__init__.py"):
        package = ".".join(_module_parts(init, root))
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    bound = alias.asname or alias.name
                    if (init.parent / f"{bound}.py").is_file() or (init.parent / bound / "__init__.py").is_file():
                        source = _resolve_relative(init, root, node.level, node.module) if node.level else node.module
                        if f"{source}.{alias.name}" != f"{package}.{bound}":  # not `from pkg import m`
                            shadowed.add(f"{package}.{bound}")
    return shadowed


def _ember_target(module: str, root: Path) -> str | None:
    """The top-level ember unit a module path lands in: a package name, a top-level file's
    name, ``"?name"`` if nothing of that name exists, or None for the root package itself."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    name = parts[1]
    if (root / name / "__init__.py").is_file() or (root / f"{name}.py").is_file():
        return name
    return None if len(parts) == 2 else f"?{name}"  # `from ember import __version__` is the root


def _owner(path: Path, root: Path) -> tuple[str, bool]:
    """(the package or top-level file name owning ``path``, whether it is a top-level file)."""
    relative = path.relative_to(root)
    return (relative.parts[0], False) if len(relative.parts) > 1 else (relative.stem, True)


def python_files(root: Path) -> Iterator[Path]:
    return iter(sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts))


def violations(root: Path) -> list[str]:
    """One line per broken rule in the package tree ``root`` (an ``ember/`` directory)."""
    shadowed = _shadowed_submodules(root)
    found = []
    for path in python_files(root):
        owner, top_level = _owner(path, root)
        where = path.relative_to(root.parent)
        if not top_level and owner not in PACKAGE_RULES:
            found.append(f"{where}: package '{owner}' has no import rule (add it to PACKAGE_RULES)")
            continue
        if top_level and owner not in TOP_LEVEL_RULES:
            found.append(f"{where}: top-level file '{owner}' has no import rule (add it to TOP_LEVEL_RULES)")
            continue
        for ref in references(path, root):
            first = ref.module.split(".")[0]
            if first in FORBIDDEN_ROOTS:
                found.append(f"{where}:{ref.line} imports {ref.module}: nothing in ember imports {first}")
                continue
            if first != "ember":
                continue
            if ref.plain_import and any(ref.module == s or ref.module.startswith(s + ".") for s in shadowed):
                found.append(
                    f"{where}:{ref.line} 'import {ref.module}' reaches a name its package rebinds "
                    "(the op function, not the module): use 'from ... import'"
                )
            target = _ember_target(ref.module, root)
            if target is None or target == owner:
                continue
            if target.startswith("?"):
                found.append(f"{where}:{ref.line} imports {ref.module}: no ember package or file '{target[1:]}'")
                continue
            if top_level:
                rule = TOP_LEVEL_RULES[owner]
                allowed = rule.eager if ref.eager else rule.eager | rule.lazy
                if target not in allowed:
                    when = "at import time" if ref.eager else "lazily"
                    found.append(
                        f"{where}:{ref.line} imports {ref.module} {when}; ember/{owner}.py may import "
                        f"{sorted(rule.eager) or 'nothing'} eagerly and {sorted(rule.lazy) or 'nothing else'} lazily"
                    )
            elif target not in PACKAGE_RULES[owner]:
                found.append(
                    f"{where}:{ref.line} imports {ref.module}; {owner} may import only "
                    f"{sorted(PACKAGE_RULES[owner]) or 'nothing from ember'}"
                )
    return found
