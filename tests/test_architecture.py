"""The layers the README's Architecture section lists are the layers the code's imports follow."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "simadmit"


def documented_layers() -> dict[str, set[str]]:
    """`- `layer`: a, b — what` lines between the README's layers markers: layer -> what it may import."""
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- layers:")[1].split("<!-- /layers -->")[0]
    layers = {}
    for m in re.finditer(r"^- `(\w+)`: ([^—]*)—", block, flags=re.M):
        allowed = {x.strip() for x in m.group(2).split(",") if x.strip() and x.strip() != "(nothing)"}
        layers[m.group(1)] = allowed
    return layers


def imported_layers(path: Path) -> set[str]:
    """Sub-packages of simadmit a module imports, lazily or not."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "simadmit" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_every_import_follows_the_documented_layers() -> None:
    layers = documented_layers()
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(layers), "every sub-package is a documented layer, and only those"
    breaches = []
    for module in PACKAGE.rglob("*.py"):
        layer = module.relative_to(PACKAGE).parts[0]
        if layer not in layers:
            assert module.parent == PACKAGE, f"{module} lies outside every layer"
            continue
        for other in imported_layers(module) - {layer} - layers[layer]:
            breaches.append(f"{module.relative_to(ROOT)} ({layer}) imports {other}")
    assert not breaches, "\n".join(breaches)


def test_the_documented_layers_form_no_cycle() -> None:
    layers = documented_layers()
    done: set[str] = set()

    def visit(layer: str, path: tuple[str, ...]) -> None:
        assert layer not in path, f"cycle: {' -> '.join((*path, layer))}"
        if layer not in done:
            for below in layers[layer]:
                visit(below, (*path, layer))
            done.add(layer)

    for layer in layers:
        visit(layer, ())
