"""The import structure, checked: dependencies point one way only and no module imports
itself in a circle (imports inside functions count: a lazy import is still a dependency).

    kernels, transfer  ->  kvstore core  ->  kvstore services  ->  engine_adapter  ->  kvtier
                                           (daemon, client,                            (app)
                                            cluster, scheduler)
bench/ may import anything; nothing imports bench (the CLI runs it by module name).
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("kernels", "transfer", "kvstore", "engine_adapter", "kvtier", "bench")
SERVICES = ("kvstore.daemon", "kvstore.client", "kvstore.cluster", "kvstore.scheduler")
RANK = {"kernels": 0, "transfer": 0, "kvstore": 1, "services": 2, "engine_adapter": 3,
        "kvtier": 4, "bench": 5}


def layer(module: str) -> str:
    # `kvstore` itself is the package's facade: `kvstore.connect` / `kvstore.Client`
    if module.startswith(SERVICES) or module == "kvstore":
        return "services"
    return module.split(".")[0]


def modules() -> dict[str, pathlib.Path]:
    """Every project module by name: the Python ones, and the C extensions (their sources,
    built as modules of the same name: `kvstore/_slotdir.c` is `kvstore._slotdir`)."""
    out = {}
    for pkg in PACKAGES:
        for path in [*(ROOT / pkg).rglob("*.py"), *(ROOT / pkg).rglob("*.c")]:
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Project modules `name` imports (resolved to the longest known module name)."""
    found = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(m, p, set(mods)) if p.suffix == ".py" else set()  # (C imports none)
            for m, p in mods.items()}


def test_no_module_imports_a_higher_layer():
    wrong = [f"{m} -> {t}" for m, deps in graph().items() for t in deps
             if RANK[layer(t)] > RANK[layer(m)]
             or (layer(m) != layer(t) and RANK[layer(m)] == RANK[layer(t)])]
    assert not wrong, "upward or sideways imports:\n" + "\n".join(sorted(wrong))


def test_no_import_circles():
    g = graph()
    # a package imports its own submodules (re-exports): those edges are not circles
    edges = {m: {t for t in deps if not t.startswith(m + ".")} for m, deps in g.items()}
    seen, stack, cycles = set(), [], []

    def visit(m: str) -> None:
        if m in stack:
            cycles.append(" -> ".join(stack[stack.index(m):] + [m]))
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            visit(t)
        stack.pop()

    for m in sorted(edges):
        visit(m)
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_the_checker_sees_a_violation():
    assert RANK[layer("engine_adapter.engine")] > RANK[layer("kvstore.store")]
    assert layer("kvstore.client.sync") == "services" and layer("kvstore.keys") == "kvstore"


SERVER_SIDE = ("kvstore.daemon", "kvstore.store", "kvstore.tiers", "kvstore.tiermap",
               "kvstore.grants", "kvstore.reads")


def test_the_sdk_imports_none_of_the_server():
    """A client reaches the daemon's shared memory through the layouts both sides share
    (kvstore.arena_layout, kvstore.slotdir, kvstore.putring), never through its tiers."""
    g = graph()
    seen, todo = set(), ["kvstore.client"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += g.get(m, ())
    wrong = sorted(m for m in seen if m.startswith(SERVER_SIDE))
    assert not wrong, "the SDK pulls in server modules: " + ", ".join(wrong)
