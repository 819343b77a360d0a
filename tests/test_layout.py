"""The package's layers (docs/layout.md) hold on every import, and every test file has its line.

The layer table is read from docs/layout.md itself, so the page and this check cannot drift apart.
Imports are read from the syntax tree of every module (module level and inside functions, which is
where the package defers its heavy imports), resolved to the module they name.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "wan_sharding"
LAYOUT = (ROOT / "docs" / "layout.md").read_text()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports() -> list[tuple[str, str, str]]:
    """(importing module, imported module, the name taken) for every import of a package module."""
    out = []
    for name, path in MODULES.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    out.append((name, full if full in MODULES else target, alias.name))
            elif isinstance(node, ast.Import):
                out += [(name, alias.name, "") for alias in node.names]
    return [(a, b, n) for a, b, n in out if b.split(".")[0] == "wan_sharding" and a != b]


IMPORTS = _imports()


def _layers() -> dict[str, int]:
    """Top-level module or subpackage -> its layer, from the table in docs/layout.md."""
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", LAYOUT, flags=re.M)
    assert rows, "docs/layout.md has no layer table"
    return {m: int(layer) for layer, cell in rows for m in re.findall(r"`([a-z_]+)`", cell)}


LAYERS = _layers()


def _layer_of(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in MODULES if m != "wan_sharding" and _layer_of(m) is None)
    assert not unplaced, f"modules docs/layout.md's layer table does not place: {unplaced}"
    assert set(LAYERS) == {m.split(".")[1] for m in MODULES if m != "wan_sharding"}, \
        "the layer table names a module that does not exist"


def test_no_import_runs_up_a_layer():
    upward = sorted({f"{a} (layer {_layer_of(a)}) imports {b} (layer {_layer_of(b)})"
                     for a, b, _ in IMPORTS if a != "wan_sharding" and b != "wan_sharding"
                     and _layer_of(b) > _layer_of(a)})
    assert not upward, "\n".join(upward)


def test_no_module_imports_the_package_front():
    """``wan_sharding/__init__.py`` hands the public API on; a module that imported it would import
    every layer at once."""
    assert not sorted({a for a, b, _ in IMPORTS if b == "wan_sharding"})


def test_no_module_takes_another_modules_private_name():
    private = sorted({f"{a} takes {n} from {b}" for a, b, n in IMPORTS
                      if n.startswith("_") and not n.startswith("__") and b != a})
    assert not private, "\n".join(private)


def test_the_import_graph_has_no_circle():
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b, _ in IMPORTS:
        if b in MODULES:
            graph[a].add(b)
    # Tarjan's strongly connected components: any component of two or more modules is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(MODULES):
        if module not in index:
            visit(module)
    assert not circles, circles


def test_the_checks_see_what_they_should():
    """The walk finds the imports it must judge (so the tests above cannot pass on an empty list)."""
    found = {(a, b) for a, b, _ in IMPORTS}
    assert ("wan_sharding.pipeline.shard", "wan_sharding.compose") in found
    assert ("wan_sharding.backends.tt_norms", "wan_sharding.hooks") in found  # a function-level one too
    assert ("wan_sharding.jobs.check", "wan_sharding.compose") in found
    assert _layer_of("wan_sharding.cli.validate") > _layer_of("wan_sharding.jobs.requests") > \
        _layer_of("wan_sharding.compose") > _layer_of("wan_sharding.backends.tt") > _layer_of("wan_sharding.hooks")


def test_every_test_file_has_its_line_in_the_layout_page():
    rows = dict(re.findall(r"^\| `(tests/test_[a-z0-9_]+\.py)` \| (.+) \|$", LAYOUT, flags=re.M))
    files = sorted(f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py"))
    assert sorted(rows) == files, "docs/layout.md's test table and tests/ differ"
    for test, cell in rows.items():
        for named in re.findall(r"`([a-z_/]+(?:\.py|/))`", cell):
            assert (PACKAGE / named).exists(), f"{test}'s line names {named}, which is not a module of the package"


@pytest.mark.parametrize("name", ["shard_pipeline", "shard_dit", "shard_dit_specs", "apply_dit_sp_activation_sharding",
                                  "get_backend", "MeshSpec", "ShardingPlan"])
def test_the_public_api_is_one_import_away(name):
    import wan_sharding

    assert name in wan_sharding.__all__ and getattr(wan_sharding, name) is not None
