"""The engine's layout: no import cycle (module-level or inside functions), every module imports on its own,
no module over ~400 lines without its reason written at its top, and the engine never imports Qt or the app."""

import ast
import subprocess
import sys
from pathlib import Path

import engine

ROOT = Path(engine.__file__).resolve().parent
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every engine module `name` imports, wherever in the file the import statement is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target != "engine":
                found.add(target)
    return found


def test_no_import_cycle_in_the_engine():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # a package imports its own submodules to re-export them; a submodule importing its package's
    # __init__ (a sibling through it) is an edge to that sibling, so packages are left out as targets
    graph = {name: {t for t in targets if not t.startswith(name + ".")} for name, targets in graph.items()}
    cycles = []
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, stack + [target])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_engine_module_imports_on_its_own():
    names = [n for n in _modules() if not n.endswith("__main__")]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'engine' or m.startswith('engine.')]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module(name)\n"
        "    assert not any(m.startswith(('PySide6', 'app')) for m in sys.modules), name\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=ROOT.parent)
    assert done.returncode == 0, done.stderr[-2000:]


def test_no_engine_module_is_long_without_a_reason_at_its_top():
    long = []
    for name, path in _modules().items():
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n")
        if lines > MAX_LINES:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "Why this file is long" not in doc:
                long.append(f"{name} ({lines} lines)")
    assert not long, f"over {MAX_LINES} lines without 'Why this file is long' in the docstring: {long}"
