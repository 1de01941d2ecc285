"""The package's import graph, read from the source (ast, nothing imported): no import cycles among
`libra` modules, no import from a lower layer to a higher one (the order is the `layers` block of
docs/layers.md), and a controller process that loads no torch.

Imports inside functions count: a deferred import still couples the two modules. Imports under
`if TYPE_CHECKING:` count for cycles (the review that started this test found one closed only by
annotations) but not for layers: an annotation may name a type of the layer that composes it
(`LibraConfig` in the controller), which is no import at run time."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "libra"
LAYERS_DOC = ROOT / "docs" / "layers.md"


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    type_checking: bool

    def __str__(self) -> str:
        where = f"{self.source.replace('.', '/')}.py:{self.line}"
        return f"{self.source} -> {self.target} ({where}{', TYPE_CHECKING' if self.type_checking else ''})"


@cache
def modules() -> dict[str, Path]:
    """Every source module of the package by dotted name (a package by its `__init__.py`)."""
    found = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for statement in node.body:
                inside.update(id(n) for n in ast.walk(statement))
    return inside


def _resolve(name: str) -> str | None:
    """The source module an imported dotted name loads, or None for a generated or compiled one
    (`libra.v1`, `libra._native`) and for anything outside the package."""
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return None
    while name not in modules():
        name = name.rpartition(".")[0]
    return name if name != PACKAGE else None


def _imports_of(module: str, path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(), str(path))
    type_checking = _type_checking_nodes(tree)
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [_resolve(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import name` loads the submodule pkg.name if there is one, else pkg itself.
            targets = [
                _resolve(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules() else base)
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            if target is not None and target != module:
                found.append(Import(module, target, node.lineno, id(node) in type_checking))
    return found


@cache
def imports() -> tuple[Import, ...]:
    """Every import statement's link from one module to another (once per statement and target)."""
    found = (i for module, path in modules().items() for i in _imports_of(module, path))
    return tuple(dict.fromkeys(found))


def component(module: str) -> str:
    """`libra.control.controller` -> `control`, `libra.trace` -> `trace`; a module placed in a layer
    of its own by its dotted name -> that name (`libra.job.config` -> `job.config`), and so is its
    package, which Python runs whenever the module is imported (`libra.job` -> `job.config`)."""
    name = module.removeprefix(PACKAGE + ".")
    layer_of, _ = read_layers()
    placed = [
        c
        for c in layer_of
        if "." in c and (name == c or name.startswith(c + ".") or c.startswith(name + "."))
    ]
    return min(placed, key=layer_of.get) if placed else name.split(".")[0]


@cache
def read_layers() -> tuple[dict[str, int], set[tuple[str, str]]]:
    """The layer index of each component (0 at the bottom) and the peer imports allowed."""
    block = re.search(r"```layers\n(.*?)```", LAYERS_DOC.read_text(), re.S)
    assert block, f"{LAYERS_DOC} has no ```layers block"
    lines = [line.strip() for line in block.group(1).splitlines() if line.strip()]
    layer_of: dict[str, int] = {}
    for index, line in enumerate(line for line in lines if "->" not in line):
        for name in (n.strip() for n in line.split(",")):
            assert name not in layer_of, f"{LAYERS_DOC}: {name} is in two layers"
            layer_of[name] = index
    allowed = set()
    for line in (line for line in lines if "->" in line):
        source, target = (part.strip() for part in line.split("->"))
        assert layer_of.get(source) == layer_of.get(target), f"{LAYERS_DOC}: {line} is not between peers"
        allowed.add((source, target))
    return layer_of, allowed


def find_cycle(edges: dict[str, list[Import]]) -> list[Import] | None:
    """One import cycle of the graph, as its imports in order, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[Import] = []

    def visit(module: str) -> list[Import] | None:
        state[module] = 1
        for edge in edges.get(module, []):
            if state.get(edge.target) == 1:
                start = next(i for i, e in enumerate(path) if e.source == edge.target) if path else 0
                if edge.target == module:
                    return [edge]
                return path[start:] + [edge]
            if edge.target not in state:
                path.append(edge)
                cycle = visit(edge.target)
                if cycle:
                    return cycle
                path.pop()
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_no_import_cycles():
    edges: dict[str, list[Import]] = {}
    for i in imports():
        edges.setdefault(i.source, []).append(i)
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle:\n  " + "\n  ".join(str(i) for i in cycle)


def test_the_cycle_finder_reports_the_cycle():
    a_b, b_c, c_a = Import("a", "b", 1, False), Import("b", "c", 2, True), Import("c", "a", 3, False)
    assert find_cycle({"a": [a_b], "b": [b_c], "c": [c_a]}) == [a_b, b_c, c_a]
    assert find_cycle({"a": [a_b], "b": [b_c]}) is None


def test_a_module_placed_apart_takes_its_package_init_along():
    """`job.config` sits below the root config that composes it: importing it runs
    `libra/job/__init__.py`, so that file counts in `job.config`'s layer too (were it to import
    the job's loop, the root config would load the whole job, and import itself in a circle)."""
    layer_of, _ = read_layers()
    assert component("libra.job.config") == component("libra.job") == "job.config"
    assert component("libra.job.loop") == "job" and component("libra.control.config") == "control"
    assert layer_of["job.config"] < layer_of["config"] < layer_of["job"]


def test_every_component_has_a_layer():
    layer_of, _ = read_layers()
    components = {component(m) for m in modules() if m != PACKAGE}
    unplaced, gone = components - set(layer_of), set(layer_of) - components
    gone |= {c for c in layer_of if "." in c and f"{PACKAGE}.{c}" not in modules()}
    assert not unplaced, f"place {sorted(unplaced)} in the layers of {LAYERS_DOC}"
    assert not gone, f"{LAYERS_DOC} names {sorted(gone)}, which are not in {PACKAGE}/"


def test_imports_point_down_the_layers():
    layer_of, allowed = read_layers()
    upward = []
    for i in imports():
        source, target = component(i.source), component(i.target)
        if source == target or i.type_checking:
            continue
        if layer_of[target] > layer_of[source] or (
            layer_of[target] == layer_of[source] and (source, target) not in allowed
        ):
            upward.append(f"{i}: {source} (layer {layer_of[source]}) -> {target} (layer {layer_of[target]})")
    assert not upward, f"imports against the layers of {LAYERS_DOC}:\n  " + "\n  ".join(upward)


def test_the_controller_process_loads_no_torch():
    """`libra controller` (the CLI, which loads the root config) and the controller module itself
    start without torch: seconds of import and hundreds of MB the control plane never uses."""
    for module in ("libra.control.controller", "libra.cli"):
        loaded = subprocess.run(
            [sys.executable, "-c", f"import sys, {module}; print('torch' in sys.modules)"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            check=True,
        ).stdout.strip()
        assert loaded == "False", f"importing {module} imports torch"
