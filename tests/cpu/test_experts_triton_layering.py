"""The import layering of `epmoe.experts.triton` (read from the sources with ast, imports inside
functions included): a module imports only modules listed below it in the package docstring's layers,
so the package's import graph has no cycle; nothing in the package imports upwards out of experts/,
and the other experts modules do not import the package."""

import ast
import pathlib

import epmoe.experts.triton as package

PACKAGE = "epmoe.experts.triton"
ROOT = pathlib.Path(package.__file__).parent
EXPERTS = ROOT.parent
# Outside the package, its modules may import these (the experts base, quant, core, config).
ALLOWED_OUTSIDE = ("epmoe.experts.base", "epmoe.experts.activation", "epmoe.quant", "epmoe.core", "epmoe.config")


def _imports(path: pathlib.Path) -> set:
    """Every epmoe module `path` imports, anywhere in the file: "epmoe.x.y" (for `from epmoe.x import y`
    where y is a module: "epmoe.x.y"; where y is a name: "epmoe.x")."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("epmoe"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("epmoe"):
            for a in node.names:
                sub = EXPERTS.parent.parent / f"{node.module}.{a.name}".replace(".", "/")
                is_module = sub.with_suffix(".py").exists() or (sub / "__init__.py").exists()
                found.add(f"{node.module}.{a.name}" if is_module else node.module)
    return found


def _modules() -> dict:
    return {p.stem: p for p in sorted(ROOT.glob("*.py")) if p.stem != "__init__"}


def _graph() -> dict:
    """module name -> the package modules it imports."""
    names = _modules()
    graph = {}
    for name, path in names.items():
        graph[name] = {m[len(PACKAGE) + 1:].split(".")[0] for m in _imports(path) if m.startswith(PACKAGE + ".")}
        assert graph[name] <= set(names), (name, graph[name])
    return graph


def _documented_order() -> list:
    """The package modules in the order the docstring's layer block lists them (top first)."""
    names = set(_modules())
    order = []
    for line in package.__doc__.splitlines():
        for token in line.split()[:2]:
            if token in names and token not in order:
                order.append(token)
                break
    return order


def test_docstring_lists_every_module_once():
    assert sorted(_documented_order()) == sorted(_modules()), "add the new module to the layers in __init__'s docstring"


def test_modules_import_only_modules_below_them():
    order = _documented_order()
    graph = _graph()
    for name, deps in graph.items():
        above = {m for m in deps if order.index(m) <= order.index(name)}
        assert not above, f"{name} imports {sorted(above)}, listed at or above it in {PACKAGE}'s layers"


def _in_cycles(graph: dict) -> set:
    """The modules Kahn's algorithm cannot remove from `graph` (module -> modules it imports): those on
    or behind an import cycle; empty for a DAG."""
    indegree = {m: 0 for m in graph}
    for deps in graph.values():
        for d in deps:
            indegree[d] += 1
    ready = [m for m, n in indegree.items() if n == 0]
    left = set(graph)
    while ready:
        m = ready.pop()
        left.discard(m)
        for d in graph[m]:
            indegree[d] -= 1
            if indegree[d] == 0:
                ready.append(d)
    return left


def test_import_graph_is_acyclic():
    assert not _in_cycles(_graph()), f"import cycle among {sorted(_in_cycles(_graph()))}"


def test_cycle_check_finds_a_planted_cycle():
    """The check above, on the package's graph with the old cycle put back (launch -> triton_experts)."""
    planted = _graph()
    planted["launch"] = planted["launch"] | {"triton_experts"}
    assert {"launch", "triton_experts"} <= _in_cycles(planted)


def test_package_imports_nothing_above_experts():
    for name, path in _modules().items():
        outside = {m for m in _imports(path) if not m.startswith(PACKAGE + ".") and m != PACKAGE}
        bad = {m for m in outside if not m.startswith(ALLOWED_OUTSIDE)}
        assert not bad, f"{PACKAGE}.{name} imports {sorted(bad)}; it may import only {ALLOWED_OUTSIDE}"


def test_other_experts_modules_do_not_import_the_package():
    for path in sorted(EXPERTS.glob("*.py")):
        if path.stem == "__init__":  # the registry names the backends as strings only
            continue
        bad = {m for m in _imports(path) if m == PACKAGE or m.startswith(PACKAGE + ".")}
        assert not bad, f"epmoe.experts.{path.stem} imports {sorted(bad)}"
