"""The package layout's rules (docs/architecture.md, "Where the code lives"), read from the source:
nothing outside ``fovea.testing`` imports it, the kernels import nothing else of fovea, and the structured
outputs know no scheduler."""

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


def test_a_kernel_module_imports_no_engine_objects():
    """engine/kernels holds the Triton kernels and their launchers only: they take tensors and
    plain values, so nothing there imports the rest of fovea (the scheduler, the runner, the
    models), at the top or inside a function, and a kernel can be checked on its own."""
    found = {p.name: [n for n in within(imported(p), "fovea") if not within({n}, "fovea.engine.kernels")]
             for p in (SRC / "engine" / "kernels").glob("*.py")}
    assert {k: v for k, v in found.items() if v} == {}


def runtime_imports(path: Path) -> set[str]:
    """``imported``, without what ``if TYPE_CHECKING:`` blocks import (type hints only)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_adapters_do_not_import_the_loading_that_imports_them():
    """fovea.loading reads a directory through the adapters of fovea.models; an adapter that imported
    fovea.loading back would make the two packages a circle (it was one, through model/vision.py)."""
    found = {str(p.relative_to(SRC)): within(runtime_imports(p), "fovea.loading")
             for p in (SRC / "models").glob("*.py")}
    assert {k: v for k, v in found.items() if v} == {}
    assert within(runtime_imports(SRC / "loading" / "loader.py"), "fovea.models")  # the direction that stays
