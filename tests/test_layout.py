"""The package layout's rules (docs/architecture.md, "Where the code lives"), read from the source:
nothing outside ``fovea.testing`` imports it, and the structured outputs know no scheduler."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "fovea"


def imported(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function (``from a import b``: a and a.b)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def within(names: set[str], *packages: str) -> list[str]:
    return sorted(n for n in names if any(n == p or n.startswith(p + ".") for p in packages))


def test_nothing_outside_fovea_testing_imports_it():
    offenders = {str(p.relative_to(SRC)): within(imported(p), "fovea.testing") for p in SRC.rglob("*.py")
                 if p.relative_to(SRC).parts[0] != "testing"}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_structured_outputs_know_no_scheduler():
    found = {p.name: within(imported(p), "fovea.engine.core", "fovea.engine.runner", "fovea.engine.engine")
             for p in (SRC / "engine" / "structured").glob("*.py")}
    assert {k: v for k, v in found.items() if v} == {}
