"""The fault suite's figures are measured: no constant is recorded as a measurement.

docs/RELIABILITY.md is generated from ``tests.faults.figures.FIGURES``. A figure is either
observed by the run (counted, sampled, timed, read back from the daemon) or a setting the test
chose, recorded with ``FIGURES.setting`` and shown as one. This reads the fault suite's source
(an AST walk) and refuses a ``FIGURES.set/add/peak/low`` whose value is a constant: a literal, a
module-level constant, or an expression or f-string built only from those.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.faults.figures import Figures
from tests.faults.write_report import render

FAULTS = Path(__file__).resolve().parents[1] / "faults"
RECORDERS = {"set", "add", "peak", "low"}


def _constant(node: ast.expr, module_constants: set[str]) -> bool:
    """True when ``node`` can only ever have one value, whatever the run did."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Name):
        return node.id in module_constants
    if isinstance(node, ast.JoinedStr):
        return all(_constant(v.value if isinstance(v, ast.FormattedValue) else v, module_constants)
                   for v in node.values)
    if isinstance(node, ast.BinOp):
        return _constant(node.left, module_constants) and _constant(node.right, module_constants)
    if isinstance(node, ast.UnaryOp):
        return _constant(node.operand, module_constants)
    if isinstance(node, (ast.Tuple, ast.List)):
        return all(_constant(e, module_constants) for e in node.elts)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):  # " < ".join(("a",))
        return (_constant(node.func.value, module_constants) and not node.keywords
                and all(_constant(a, module_constants) for a in node.args))
    return False


def _module_constants(tree: ast.Module) -> set[str]:
    """Names bound once at module level to a constant value (``KILLS = 50``, ``BUDGET = 16 *
    MIB``); a value read from the environment is a setting too."""
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            names = ([target] if isinstance(target, ast.Name) else
                     [t for t in target.elts if isinstance(t, ast.Name)]
                     if isinstance(target, ast.Tuple) else [])
            for name in names:
                if name.id.isupper():
                    found.add(name.id)
    return found


def constant_figures(source: str, filename: str) -> list[str]:
    tree = ast.parse(source, filename)
    constants = _module_constants(tree)
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "FIGURES"
                and node.func.attr in RECORDERS and len(node.args) >= 2):
            continue
        value = node.args[1]
        if node.func.attr == "add" and isinstance(value, ast.Constant) and value.value == 0:
            continue  # declares a counter that events add to
        if _constant(value, constants):
            out.append(f"{filename}:{node.lineno}: FIGURES.{node.func.attr}({ast.unparse(node.args[0])}, "
                       f"{ast.unparse(value)}) records a constant; count it, or use FIGURES.setting")
    return out


def test_no_figure_of_the_fault_suite_is_a_constant() -> None:
    files = sorted(FAULTS.glob("*.py"))
    assert len([f for f in files if f.name.startswith("test_s")]) >= 16
    found = [v for f in files for v in constant_figures(f.read_text(), f"tests/faults/{f.name}")]
    assert not found, "\n".join(found)


def test_the_checker_catches_constants_and_passes_counts() -> None:
    source = (
        "KILLS = 50\nMIB = 1 << 20\nBUDGET = 16 * MIB\n"
        "def t(hub, n):\n"
        "    FIGURES.set('a.kills', KILLS)\n"
        "    FIGURES.set('a.budget', BUDGET)\n"
        "    FIGURES.add('a.cut', 2)\n"
        "    FIGURES.set('a.text', 'ok, no restart')\n"
        "    FIGURES.set('a.fmt', f'{KILLS} kills')\n"
        "    FIGURES.set('a.counted', n)\n"
        "    FIGURES.add('a.event')\n"
        "    FIGURES.add('a.zero', 0)\n"
        "    FIGURES.peak('a.gets', hub.count('cdn_get'))\n"
        "    FIGURES.set('a.fmt2', f'exit {n}')\n"
        "    FIGURES.setting('a.limit', BUDGET)\n"
        "    FIGURES.set('a.order', ' < '.join(('fsync', 'rename')))\n"
        "    FIGURES.set('a.seen', ' < '.join(n))\n"
    )
    found = constant_figures(source, "x.py")
    assert [line.split(":")[1] for line in found] == ["5", "6", "7", "8", "9", "16"], found


def test_settings_are_marked_in_the_report() -> None:
    fig = Figures()
    fig.setting("s07.budget_bytes", 16 << 20)
    fig.set("s07.peak_blobs_bytes", 1234)
    text = render(fig, 1.0, Path("/nonexistent"))
    assert "budget_bytes = 16,777,216 (setting)" in text
    assert "peak_blobs_bytes = 1,234;" in text or "peak_blobs_bytes = 1,234 |" in text
    assert "peak_blobs_bytes = 1,234 (setting)" not in text
