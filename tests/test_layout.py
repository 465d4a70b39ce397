"""The house's rules, checked on the source: no import circles, imports at the top of the orchestrator's files,
`commands/` used by nothing but the command line, one owner of the page allocator, rooms of a readable size."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "orchestrator", "pagefleet")
MAX_LINES = 400
LAZY_BY_DESIGN = {
    # the chosen command's module, imported after torch is hidden (cli.py's table of commands)
    "orchestrator/commands/cli.py",
    # `import pagefleet` stays cheap: its public names load on first use (PEP 562)
    "pagefleet/__init__.py",
}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _where(tree: ast.AST) -> dict[int, str]:
    """'function' or 'type_checking' for the ids of nodes inside a function or under `if TYPE_CHECKING:`."""
    where = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            where.update((id(n), "type_checking") for n in ast.walk(node) if n is not node)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            where.update((id(n), "function") for n in ast.walk(node) if n is not node)
    return where


def imports(name: str, path: Path) -> list[tuple[int, list[str], str]]:
    """(line, the project modules the statement may import, 'top' | 'function' | 'type_checking')."""
    tree = ast.parse(path.read_text())
    where = _where(tree)
    parts = name.split(".") + (["__init__"] if path.name == "__init__.py" else [])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = ".".join(parts[:-node.level] + ([node.module] if node.module else [])) if node.level else node.module
            targets = [module] + [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        targets = [t for t in targets if t.split(".")[0] in PACKAGES]
        if targets:
            out.append((node.lineno, targets, where.get(id(node), "top")))
    return out


def test_no_module_imports_itself_back_through_others():
    mods = modules()
    edges = {m: sorted({t for _, ts, w in imports(m, p) if w != "type_checking" for t in ts if t in mods and t != m})
             for m, p in mods.items()}
    circles, done = [], set()

    def visit(m: str, path: list[str]) -> None:
        for t in edges[m]:
            if t in path:
                circles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in done:
                visit(t, path + [t])
        done.add(m)

    for m in sorted(mods):
        if m not in done:
            visit(m, [m])
    assert not circles, "import circles:\n" + "\n".join(sorted(set(circles)))


def test_the_orchestrator_imports_the_project_at_the_top_of_each_file():
    late = [f"{p.relative_to(ROOT)}:{line} imports {targets[0]} inside a function"
            for m, p in modules().items() if m.split(".")[0] in ("orchestrator", "pagefleet")
            and p.relative_to(ROOT).as_posix() not in LAZY_BY_DESIGN
            for line, targets, where in imports(m, p) if where == "function"]
    assert not late, "\n".join(late)


def test_commands_are_imported_by_the_command_line_alone():
    users = [f"{p.relative_to(ROOT)}:{line} imports {ts[0]}" for m, p in modules().items()
             if not m.startswith("orchestrator.commands") and m != "orchestrator.__main__"
             for line, ts, _ in imports(m, p) if ts[0].startswith("orchestrator.commands")]
    assert not users, "\n".join(users)


def test_only_the_kv_cache_manager_folder_holds_the_page_allocator():
    users = [str(p.relative_to(ROOT)) for m, p in modules().items() if not m.startswith("engine.kv")
             for _, ts, _ in imports(m, p) if any(t.startswith("engine.kv.page_allocator") for t in ts)]
    assert not users, users


def test_no_room_is_too_big_to_read():
    big = [f"{p.relative_to(ROOT)}: {n} lines" for m, p in modules().items() if m.split(".")[0] in ("engine", "orchestrator")
           and (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not big, "\n".join(big)
