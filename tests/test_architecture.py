"""The layout holds: no import cycle among the project's modules, and each process imports
only its own folder and the shared modules, even lazily: nothing outside the worker reaches the
worker (Celery imports it in the worker process only); nothing outside the web's folders reaches
them (the worker loads the apps, so what apps load must be shared); protocol/ imports only
itself; the engine reaches no Django, Celery or Redis."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("inference", "billing", "tokstream_site")
WORKER = "inference.worker"
WEB = ("inference.gateway", "inference.chat")
ENGINE = "inference.worker.engine"
PROTOCOL = "inference.protocol"
SERVICES = {"django", "celery", "redis", "channels", "daphne", "rest_framework"}


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


def imported_names(path, name, modules):
    """Every module `path` imports, at any depth of its code: the project's by full name, the
    others by their first part."""
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
    return {m if m in modules else m.split(".")[0] for m in found if m != name and (m in modules or not m.startswith(PACKAGES))}


def import_graph(external=False):
    """Module -> the project modules it imports (and, if `external`, the other packages' names)."""
    modules = project_modules()
    names = {name: imported_names(path, name, modules) for name, path in modules.items()}
    return {name: {m for m in found if external or m in modules} for name, found in names.items()}


def reachable(graph, start):
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
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
    assert "inference.worker.engines" in graph["inference.worker.local"]
    assert "inference.replies" in graph["inference.apps"]


def in_folder(name, folders):
    return any(name == folder or name.startswith(folder + ".") for folder in folders)


# The site's entry points route to both processes' code: the URLs and ASGI app are the web's,
# the Celery app the worker's (it names tasks by string, so it imports neither).
WEB_ENTRY_POINTS = {"tokstream_site.urls", "tokstream_site.asgi"}


def test_only_the_web_imports_the_web():
    graph = import_graph()
    outside = [name for name in graph if not in_folder(name, WEB) and name not in WEB_ENTRY_POINTS]
    assert {"inference.worker.tasks", "inference.apps", "inference.lifecycle", "inference.replies"} <= set(outside)
    for name in outside:
        web_side = sorted(m for m in reachable(graph, name) if in_folder(m, WEB))
        assert not web_side, f"{name} reaches {web_side}"


def test_the_protocol_imports_only_itself():
    graph = import_graph()
    for name in (m for m in graph if in_folder(m, [PROTOCOL])):
        others = sorted(m for m in reachable(graph, name) if not in_folder(m, [PROTOCOL]))
        assert not others, f"{name} reaches {others}"


def test_the_engine_reaches_no_django_celery_or_redis():
    graph = import_graph(external=True)
    engine = [name for name in graph if in_folder(name, [ENGINE])]
    assert "torch" in reachable(graph, "inference.worker.engine.engine")  # it does see other packages
    for name in engine:
        services = sorted(reachable(graph, name) & SERVICES)
        assert not services, f"{name} reaches {services}"


# The engine thread's own module makes Requests (EngineLoop.submit) and steps them; every other
# reader of the engine sees only its Outputs, so no Celery thread reads or writes a Request the
# engine thread is changing.
REQUEST_OWNERS = {"inference.worker.engines"}


def names_taken_from_the_engine(path):
    tree = ast.parse(path.read_text())
    return {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(ENGINE) for alias in node.names}


def test_only_the_engine_and_its_thread_hold_its_requests():
    modules = project_modules()
    holders = {name for name, path in modules.items() if not in_folder(name, [ENGINE]) and {"Request", "choices"} & names_taken_from_the_engine(path)}
    assert holders == REQUEST_OWNERS, f"outside the engine, {sorted(holders - REQUEST_OWNERS)} take its Request"
