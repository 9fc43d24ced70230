"""The layout holds: no import cycle among the project's modules, and nothing outside the
worker (the web process's code, the shared modules, the site's entry points) reaches the worker
or its engine, even lazily: Celery imports the worker in the worker process only."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("inference", "billing", "tokstream_site")
WORKER = "inference.worker"


def module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules():
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" not in path.parts:
                modules[module_name(path)] = path
    return modules


def imported(path, name, modules):
    """Every project module `path` imports, at any depth of its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names)
    return {m for m in found if m in modules and m != name}


def import_graph():
    modules = project_modules()
    return {name: imported(path, name, modules) for name, path in modules.items()}


def reachable(graph, start):
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_module_imports_itself_in_a_circle():
    graph = import_graph()
    circles = sorted(name for name in graph if name in reachable(graph, name))
    assert not circles, f"modules in an import cycle: {circles}"


# Commands that do a worker's work in a process of their own: measure_weights loads the model and
# measures its weight formats as a starting worker would, so that the worker reads the choice.
WORKER_COMMANDS = {"inference.management.commands.measure_weights"}


def test_only_the_worker_imports_the_worker():
    graph = import_graph()
    outside = [name for name in graph if not name.startswith(WORKER) and name not in WORKER_COMMANDS]
    assert {"inference.gateway.sse", "tokstream_site.asgi", "inference.lifecycle"} <= set(outside)
    for name in outside:
        worker_side = sorted(m for m in reachable(graph, name) if m.startswith(WORKER))
        assert not worker_side, f"{name} reaches {worker_side}"


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()  # a check that found nothing would pass for the wrong reason
    assert "inference.worker.loops" in graph["inference.worker.tasks"]
    assert "inference.chat.conversations" in graph["inference.chat.receivers"]
