"""The import architecture: the contracts of pyproject.toml's [tool.importlinter] hold (layers, the trainers'
independence, models/ below training/, the shared loop free of trainers, serving meeting generation through its
protocol, agents' chat-template side free of engines, models and tool runners), and no posttrain module imports itself
through others: there is no import cycle at all.

Both read the import graph import-linter builds (grimp): every import counts, those inside functions included."""

import os
import subprocess
import sys

import pytest

if os.environ.get("CI") == "true":  # CI installs the dev extra: a missing linter there is a failure, not a skip
    import grimp
    import importlinter  # noqa: F401
else:
    pytest.importorskip("importlinter", reason="import-linter is not installed (pip install 'posttrain[dev]')")
    grimp = pytest.importorskip("grimp", reason="grimp (installed with import-linter) is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True))")


def test_the_import_contracts_hold():
    # in a process of its own: lint_imports reconfigures logging, and puts the working directory first on sys.path
    run = subprocess.run([sys.executable, "-c", LINT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"lint-imports found broken contracts:\n{run.stdout}\n{run.stderr}"
    assert "0 broken" in run.stdout, run.stdout


def _cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative): each holds a cycle."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            module, imported = work[-1]
            step = next(imported, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph.find_modules_directly_imported_by(step)))))
                elif step in on_stack:
                    low[module] = min(low[module], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(graph, component: list[str]) -> str:
    lines = []
    for importer in component:
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            if imported in component:
                at = sorted({d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported)})
                lines.append(f"    {importer} -> {imported} (line {', '.join(map(str, at))})")
    return "\n".join(lines)


def test_no_import_cycle():
    graph = grimp.build_graph("posttrain", cache_dir=None)
    assert "posttrain.training.trainer" in graph.modules  # the graph is posttrain's own
    cycles = _cycles(graph)
    assert not cycles, "import cycles among posttrain's modules:\n" + "\n".join(
        f"  {' <-> '.join(c)}:\n{_describe(graph, c)}" for c in cycles)


def test_the_cycle_finder_finds_one():
    """The finder itself: a two-module cycle and a three-module one are found, a chain is not."""

    class Graph:
        edges = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"g"}, "g": set()}
        modules = set(edges)

        def find_modules_directly_imported_by(self, module):
            return self.edges[module]

    assert _cycles(Graph()) == [["a", "b"], ["c", "d", "e"]]
