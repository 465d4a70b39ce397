"""The engine's public API is `engine/__init__.py`: nothing outside the engine imports its modules directly."""

from __future__ import annotations

import ast
from pathlib import Path

import engine

REPO = Path(__file__).resolve().parents[2]


def engine_imports(path: Path) -> list[str]:
    """Every `engine.<module>` that `path` imports (`from engine.x import y`, `import engine.x`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("engine."):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [f"{path.relative_to(REPO)}:{node.lineno}: import {a.name}" for a in node.names
                      if a.name.startswith("engine.")]
    return found


def test_the_orchestrator_and_the_package_import_the_engine_only_through_its_public_api():
    sources = sorted((REPO / "orchestrator").rglob("*.py")) + sorted((REPO / "pagefleet").rglob("*.py"))
    assert len(sources) > 40
    assert [line for path in sources for line in engine_imports(path)] == []


def test_every_public_name_resolves():
    for name in engine.__all__:
        assert getattr(engine, name) is not None, name
