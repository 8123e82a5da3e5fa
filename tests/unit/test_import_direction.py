"""The import direction: the folder tree is the architecture, and imports point one way only.

Every import inside cachecd, and from the client and the engine into cachecd, goes from a layer to
one that LAYERS lets it import (docs/architecture.md shows the same table; a test keeps the two
equal), and no two modules or layers import each other, directly or around a loop. Read from the
source with an AST walk (top-level, function-local and TYPE_CHECKING imports, relative ones
resolved), so it imports nothing and sees code paths no other test runs.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Installed package -> source folder (pyproject's package-dir).
SOURCES = {"cachecd": "cachecd", "cachecd_client": "client", "cachecd_engine": "engine"}

_BASE = {"cachecd.errors", "cachecd.constants"}
# The engine's own layers below the rest of it.
ENGINE_LAYERS = {"cachecd_engine.pool", "cachecd_engine.formats"}
# Layer -> the layers it may import. A layer is a subpackage of cachecd, a module at the top of
# cachecd ("cachecd" is its __init__), or the client or the engine (whose pool room and formats are
# layers of their own).
LAYERS: dict[str, set[str]] = {
    "cachecd.errors": set(),
    "cachecd.constants": set(),
    "cachecd.durable": set(),
    "cachecd.sizes": set(),
    "cachecd": {"cachecd.constants"},
    "cachecd.protocol": {"cachecd.errors"},
    "cachecd.hub_errors": {"cachecd.errors"},
    "cachecd.cli_help": set(),
    "cachecd.xet": _BASE,
    "cachecd.manifest": _BASE | {"cachecd.durable", "cachecd.hub_errors", "cachecd.sizes"},
    "cachecd.store": _BASE | {"cachecd.durable"},
    "cachecd.upstream": _BASE | {"cachecd.manifest", "cachecd.xet"},  # a source's check on use
    "cachecd.config": _BASE | {"cachecd.store"},
    "cachecd.report": _BASE | {"cachecd.sizes", "cachecd.config", "cachecd.manifest"},
    "cachecd_client": _BASE | {"cachecd.config", "cachecd.protocol"},
    "cachecd_engine.formats": _BASE | {"cachecd.manifest"},
    # The pool's room: nothing in it imports the model wrapper, the sources or the front doors.
    "cachecd_engine.pool": _BASE | {"cachecd.store", "cachecd_engine.formats"},
    "cachecd_engine": _BASE | {"cachecd.durable", "cachecd.sizes", "cachecd.config", "cachecd.manifest",
                               "cachecd.store", "cachecd_client", "cachecd_engine.formats",
                               "cachecd_engine.pool"},
    "cachecd.daemon": _BASE | {"cachecd.durable", "cachecd.config", "cachecd.protocol",
                               "cachecd.manifest", "cachecd.store", "cachecd.upstream",
                               "cachecd.report"},
    "cachecd.ctl": _BASE | {"cachecd.sizes", "cachecd.config", "cachecd.manifest", "cachecd.store",
                            "cachecd.report", "cachecd_client", "cachecd_engine",
                            "cachecd_engine.pool"},
    "cachecd.service": _BASE | {"cachecd.durable", "cachecd.config", "cachecd.daemon",
                                "cachecd.ctl", "cachecd_client"},
    "cachecd.setup": _BASE | {"cachecd.durable", "cachecd.sizes", "cachecd.config", "cachecd.manifest",
                              "cachecd.upstream", "cachecd.report", "cachecd.service", "cachecd_client",
                              "cachecd_engine"},
    "cachecd.lanhub": _BASE | {"cachecd.manifest", "cachecd.xet"},
    "cachecd.plan": _BASE | {"cachecd.durable", "cachecd.sizes", "cachecd.config", "cachecd.manifest",
                             "cachecd.store", "cachecd.report", "cachecd_client",
                             "cachecd_engine", "cachecd_engine.pool", "cachecd_engine.formats"},
    "cachecd.testbed": _BASE | {"cachecd.sizes", "cachecd.config", "cachecd.manifest", "cachecd_client"},
    "cachecd.cli": _BASE | {"cachecd", "cachecd.hub_errors", "cachecd.cli_help"},  # names its command modules as strings (importlib)
}


@dataclass(frozen=True)
class Edge:
    source: str  # importing module
    target: str  # imported module (a package means its __init__)
    where: str  # path:line


def modules_under(root: Path, sources: Mapping[str, str]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py of the given packages."""
    found: dict[str, Path] = {}
    for package, folder in sources.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imports_of(module: str, path: Path, known: set[str], root: Path) -> Iterable[Edge]:
    """Edges to known packages from every import statement in the file, wherever it sits."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tops = {name.partition(".")[0] for name in known}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from pkg import name`: the submodule if there is one, else pkg itself.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        where = f"{path.relative_to(root)}:{node.lineno}"
        for target in targets:
            if target.partition(".")[0] in tops:
                yield Edge(module, target, where)


def layer_of(module: str, known: set[str]) -> str:
    """The package a module belongs to: cachecd.X for cachecd/X/..., else the module itself."""
    top, _, rest = module.partition(".")
    if top == "cachecd_engine":
        head = ".".join(module.split(".")[:2])
        return head if head in ENGINE_LAYERS else top
    if top != "cachecd":
        return top
    head = f"cachecd.{rest.partition('.')[0]}" if rest else "cachecd"
    is_subpackage = any(name.startswith(head + ".") for name in known)
    return head if is_subpackage or head in known else module


def violations(edges: Iterable[Edge], known: set[str], layers: Mapping[str, set[str]]) -> list[str]:
    out = []
    for e in edges:
        src, dst = layer_of(e.source, known), layer_of(e.target, known)
        if e.target not in known:
            out.append(f"{e.where}: {e.source} imports {e.target}, which does not exist")
        elif src not in layers:
            out.append(f"{e.where}: {src} is not in the layer table")
        elif src != dst and dst not in layers[src]:
            out.append(f"{e.where}: {e.source} imports {e.target}: {src} -> {dst} is not allowed")
    return out


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def graphs(edges: Iterable[Edge], known: set[str]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module graph, layer graph), self-edges left out."""
    modules: dict[str, set[str]] = {}
    layers: dict[str, set[str]] = {}
    for e in edges:
        if e.source != e.target:
            modules.setdefault(e.source, set()).add(e.target)
        src, dst = layer_of(e.source, known), layer_of(e.target, known)
        if src != dst:
            layers.setdefault(src, set()).add(dst)
    return modules, layers


def walk(root: Path, sources: Mapping[str, str]) -> tuple[set[str], list[Edge]]:
    files = modules_under(root, sources)
    known = set(files)
    edges = dict.fromkeys(e for m, p in files.items() for e in imports_of(m, p, known, root))
    return known, list(edges)  # one edge per statement and target


def test_every_import_points_down_the_layer_table() -> None:
    known, edges = walk(ROOT, SOURCES)
    # Not vacuous: the walk saw the whole product and its imports.
    assert len([m for m in known if m.startswith("cachecd.")]) >= 60
    assert len(edges) >= 200
    assert {layer_of(e.source, known) for e in edges} >= set(LAYERS) - {
        "cachecd.errors", "cachecd.constants", "cachecd.durable", "cachecd.sizes", "cachecd.cli_help"}
    found = violations(edges, known, LAYERS)
    assert not found, "imports against the layer table (docs/architecture.md):\n" + "\n".join(found)


def test_no_import_cycles() -> None:
    known, edges = walk(ROOT, SOURCES)
    modules, layers = graphs(edges, known)
    found = [f"{e.where}: {e.source} imports {e.target}" for loop in cycles(modules)
             for e in edges if e.source in loop and e.target in loop and e.source != e.target]
    assert not found, "modules importing each other:\n" + "\n".join(found)
    found = [f"{e.where}: {e.source} imports {e.target}" for loop in cycles(layers)
             for e in edges if {layer_of(e.source, known), layer_of(e.target, known)} <= set(loop)
             and layer_of(e.source, known) != layer_of(e.target, known)]
    assert not found, "layers importing each other:\n" + "\n".join(found)
    assert not cycles(LAYERS), f"the layer table has a loop: {cycles(LAYERS)}"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_checker_catches_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "cachecd/__init__.py": "",
        "cachecd/errors.py": "",
        "cachecd/store/__init__.py": "",
        "cachecd/store/blobs.py": (
            "from ..errors import Oops\n"
            "from . import index\n"
            "def f():\n"
            "    from cachecd.daemon.app import Daemon\n"  # function-local, upward
        ),
        "cachecd/store/index.py": "from cachecd.store.blobs import f\nimport cachecd.nowhere\n",
        "cachecd/daemon/__init__.py": "",
        "cachecd/daemon/app.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                 "    from ..store import blobs\n",
    })
    table = {"cachecd.errors": set(), "cachecd.store": {"cachecd.errors"},
             "cachecd.daemon": {"cachecd.errors", "cachecd.store"}}
    known, edges = walk(root, {"cachecd": "cachecd"})
    assert {(e.source, e.target) for e in edges} == {
        ("cachecd.store.blobs", "cachecd.errors"), ("cachecd.store.blobs", "cachecd.store.index"),
        ("cachecd.store.blobs", "cachecd.daemon.app"), ("cachecd.store.index", "cachecd.store.blobs"),
        ("cachecd.store.index", "cachecd.nowhere"), ("cachecd.daemon.app", "cachecd.store.blobs"),
    }
    assert sorted(violations(edges, known, table)) == [
        "cachecd/store/blobs.py:4: cachecd.store.blobs imports cachecd.daemon.app: "
        "cachecd.store -> cachecd.daemon is not allowed",
        "cachecd/store/index.py:2: cachecd.store.index imports cachecd.nowhere, which does not exist",
    ]
    modules, layers = graphs(edges, known)
    assert cycles(modules) == [["cachecd.daemon.app", "cachecd.store.blobs", "cachecd.store.index"]]
    assert cycles(layers) == [["cachecd.daemon", "cachecd.store"]]


def test_the_doc_shows_the_same_table() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Import direction", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w.]+)` \|(.*)\|\s*$", section, re.M)
    shown = {layer: set(re.findall(r"`([\w.]+)`", allowed)) for layer, allowed in rows}
    assert shown == LAYERS


def test_the_top_stays_small_and_every_subpackage_is_installed() -> None:
    top = sorted(p.name for p in (ROOT / "cachecd").glob("*.py"))
    assert len(top) <= 10, top
    subpackages = {f"cachecd.{p.parent.name}" for p in (ROOT / "cachecd").glob("*/__init__.py")}
    assert subpackages == {layer for layer in LAYERS
                           if layer.startswith("cachecd.") and (ROOT / "cachecd" / layer[8:]).is_dir()}
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # A subpackage missing here is missing from a plain (non-editable) install.
    assert subpackages <= set(pyproject["tool"]["setuptools"]["packages"])


def test_every_command_module_the_cli_names_exists() -> None:
    """The cli loads its commands by name and skips a name that is not there (the engine is
    optional), so a stale name would drop a command without a word."""
    from cachecd.cli import _COMMAND_MODULES

    known = set(modules_under(ROOT, SOURCES))
    assert len(_COMMAND_MODULES) >= 10
    assert [m for m in _COMMAND_MODULES if m not in known] == []


def test_the_lower_layers_load_without_the_daemon() -> None:
    """What the client and the engine import of cachecd pulls in no upper layer when it runs."""
    code = ("import sys, cachecd_client, cachecd.manifest.manifest, cachecd.manifest.build, "
            "cachecd.store.policies\n"
            "print(' '.join(m for m in sys.modules if m.startswith('cachecd.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout.split()
    loaded = {layer_of(m, set(modules_under(ROOT, SOURCES))) for m in out}
    assert {"cachecd.manifest", "cachecd.store", "cachecd.protocol"} <= loaded, out
    assert loaded <= LAYERS["cachecd_client"] | LAYERS["cachecd_engine"], out
