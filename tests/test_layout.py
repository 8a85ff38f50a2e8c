"""The package's shape: which part may import which, no cycles, short modules (docs/architecture.md).

Every import counts, also those inside functions and under ``TYPE_CHECKING``: a lazy import is still a
dependency, and a cycle through one still means two modules that cannot be read apart.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "poros_lightning"
MAX_LINES = 450
MAX_TOP_LEVEL_MODULES = 8

# The part each module belongs to: its folder, or the module itself at the top of the package.
# Allowed imports per part (besides its own modules). Read it bottom-up: the engine knows only torch.
# The leaves (errors, the logging helpers, the warning filters) import nothing of the package; every part may use them.
LEAVES = {"errors", "_logging", "_quiet"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "_logging": set(),
    "_quiet": set(),
    "engine": {"errors"},
    "arch": {"errors"},
    "memory": {"arch", "errors"},
    "quant": {"arch", "errors"},
    "api": {"engine", "arch", "quant", "errors"},
    "training": {"engine", "arch", "quant", "api", "errors"},
    "lightning": {"engine", "arch", "quant", "memory", "api", "training", "errors"},
    "tools": {"engine", "arch", "quant", "memory", "api", "training", "lightning", "errors"},
    "cli": {"engine", "arch", "quant", "memory", "api", "training", "lightning", "tools", "errors", "package"},
    "package": {"errors", "lightning", "api", "training"},  # __init__: public names, lazily
}
# Third-party imports the torch-only parts may make.
PURE = {"engine": {"torch"}, "memory": set(), "arch": set(), "_logging": set(), "_quiet": set()}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every module of the package and every third-party top-level name that ``name`` imports."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            submodules = {f"{module}.{alias.name}" for alias in node.names} & MODULES.keys()
            # `from poros_lightning import quant` imports the module quant, not the package's __init__ names.
            found.update(submodules if len(submodules) == len(node.names) else {module, *submodules})
    resolved = set()
    for module in found:
        if module.startswith("poros_lightning"):
            while module not in MODULES:  # `from poros_lightning.x import name`: the module is x
                module = module.rpartition(".")[0]
            if module != name:
                resolved.add(module)
        else:
            resolved.add(module.split(".")[0])
    return resolved


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _part(module: str) -> str:
    parts = module.split(".")
    return "package" if len(parts) == 1 else parts[1]


def test_no_import_cycle() -> None:
    internal = {name: {d for d in deps if d in MODULES} for name, deps in GRAPH.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(internal[node]):
            # A package's __init__ importing its own submodules is not a cycle of two readers.
            if dep.startswith(node + "."):
                continue
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep] if dep in stack else [node, dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for name in sorted(internal):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_parts_import_downward(part: str) -> None:
    wrong = []
    for name, deps in GRAPH.items():
        if _part(name) != part:
            continue
        for dep in deps:
            if dep in MODULES and _part(dep) != part and _part(dep) not in ALLOWED[part] | LEAVES:
                wrong.append(f"{name} imports {dep}")
    assert not wrong, f"'{part}' may import only {sorted(ALLOWED[part])}: " + "; ".join(sorted(wrong))


@pytest.mark.parametrize("part", sorted(PURE))
def test_pure_parts_import_no_other_library(part: str) -> None:
    allowed = PURE[part] | set(sys.stdlib_module_names) | {"poros_lightning", "__future__"}
    wrong = [
        f"{name} imports {dep}"
        for name, deps in GRAPH.items()
        if _part(name) == part
        for dep in deps
        if dep not in MODULES and dep.split(".")[0] not in allowed
    ]
    assert not wrong, "; ".join(sorted(wrong))


def test_every_module_is_in_a_known_part() -> None:
    assert {_part(name) for name in MODULES} <= set(ALLOWED)


def test_modules_stay_short() -> None:
    long = {
        str(path.relative_to(PACKAGE.parent)): n
        for path in MODULES.values()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them along a seam): {long}"


def test_few_modules_at_the_top() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_no_strategy_imports_a_tool() -> None:
    strategies = [n for n in MODULES if n.startswith("poros_lightning.lightning.")]
    assert strategies
    for name in strategies:
        assert not {d for d in GRAPH[name] if d.startswith("poros_lightning.tools")}, name


def test_pyproject_lists_every_package() -> None:
    """pyproject.toml lists the packages (configs/ ships as poros_lightning.configs): a new folder must be added."""
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(PACKAGE.parent).parts) for p in PACKAGE.rglob("__init__.py")}
    assert listed == found | {"poros_lightning.configs"}
