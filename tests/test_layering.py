"""The package is a house of floors: a module imports only from its own package and from lower
floors, deferred imports (inside functions) included, so no package knot can grow back.

    errors < run < config < wire < obs < {hf, transport, data} < {dispatch, target, drafter}
           < export < decode < {eval, regenerate} < {builtin, supervise, report} < bench < cli

Packages on one floor never import each other (the target and the drafter share only what
lies below them, in hf/); the only loose modules at the top are the package's entry and its
errors.
"""

import ast
import os

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dflash_ipc")


def module_files() -> dict[str, str]:
    out = {}
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                out[dotted.removesuffix(".__init__")] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its body (relative imports too)."""
    files = module_files()

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in files.items():
        here = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Import):
                deps |= {known(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = here
                    for _ in range(node.level - 1):
                        parent = parent.rpartition(".")[0]
                    base = f"{parent}.{base}" if base else parent
                deps |= {known(f"{base}.{a.name}") if f"{base}.{a.name}" in files else known(base) for a in node.names}
        graph[module] = {d for d in deps if d and d != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


FLOORS = [
    {"errors"},
    {"run"},                            # the run directory: files, checkpoints, child contract, logs
    {"config"},                         # the job config, its loading, dtypes, machine checks
    {"wire"},                           # messages (the typed job status among them) and links
    {"obs"},                            # timelines, sinks, progress lines: they read the job status
    {"hf", "transport", "data"},        # an HF checkpoint's anatomy; slot pools; datasets
    {"dispatch", "target", "drafter"},  # the three kinds of worker
    {"export"},                         # publishing: model card, Hub code
    {"decode"},                         # the decoding core: a target over a static row cache, batched steps
    {"eval", "regenerate"},             # decoding with a target (and a drafter)
    {"builtin", "supervise", "report"},  # the embedded default's assets; the supervisor; reports
    {"bench"},
    {"cli"},
]
LOOSE_MODULES = {"dflash_ipc", "dflash_ipc.errors"}


def package_of(module: str) -> str:
    """`dflash_ipc.drafter.model` -> `drafter`; a loose module -> its own name."""
    return module.split(".")[1] if module.count(".") else module


def floor_of(package: str) -> int:
    return next(i for i, floor in enumerate(FLOORS) if package in floor)


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that goes up a floor or sideways to another package of the same floor."""
    out = []
    for module, deps in sorted(graph.items()):
        if module == "dflash_ipc":
            continue
        here = package_of(module)
        for dep in sorted(deps):
            there = package_of(dep)
            if there == here or dep == "dflash_ipc":
                continue
            if floor_of(there) >= floor_of(here):
                out.append(f"{module} -> {dep}")
    return out


def test_the_layering_check_finds_a_planted_knot():
    graph = {"dflash_ipc.drafter.worker": {"dflash_ipc.target.capture"},   # sideways
             "dflash_ipc.data.reader": {"dflash_ipc.supervise.status_query"},  # up
             "dflash_ipc.target.worker": {"dflash_ipc.hf.text_stack", "dflash_ipc.errors"}}  # fine
    assert layering_violations(graph) == ["dflash_ipc.data.reader -> dflash_ipc.supervise.status_query",
                                          "dflash_ipc.drafter.worker -> dflash_ipc.target.capture"]


def test_every_package_sits_on_one_floor_and_nothing_else_is_loose():
    packages = {package_of(m) for m in import_graph()} - {"dflash_ipc"}
    assert sorted(p for p in packages if not any(p in floor for floor in FLOORS)) == []
    loose = sorted(m for m, path in module_files().items()
                   if m.count(".") == 1 and not path.endswith("__init__.py") and m not in LOOSE_MODULES)
    assert loose == []


def test_no_package_imports_from_a_higher_floor_or_a_neighbour():
    graph = import_graph()
    assert "dflash_ipc.transport.slots" in graph["dflash_ipc.transport.shm"]  # the graph sees imports
    assert layering_violations(graph) == []


def test_the_cycle_finder_finds_a_planted_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_package_imports_itself_through_others():
    graph = import_graph()
    assert "dflash_ipc.transport.slots" in graph["dflash_ipc.transport.shm"]  # the graph sees imports
    assert cycles(graph) == []
