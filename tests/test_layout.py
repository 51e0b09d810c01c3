"""The greqprof package's layout: no import cycle among its modules.

Every import counts, those inside functions too: a cycle hidden in a
function is still two modules that cannot be read (or loaded) one before
the other."""
import ast
import os

import greqprof

PKG_DIR = os.path.dirname(os.path.abspath(greqprof.__file__))


def _modules():
    """{module name: source path} of greqprof's Python modules."""
    mods = {}
    for dirpath, _dirs, files in os.walk(PKG_DIR):
        rel = os.path.relpath(dirpath, PKG_DIR)
        parts = ["greqprof"] + ([] if rel == "." else rel.split(os.sep))
        for f in files:
            if not f.endswith(".py"):
                continue
            stem = f[:-3]
            name = ".".join(parts if stem == "__init__" else parts + [stem])
            mods[name] = os.path.join(dirpath, f)
    return mods


def _resolve(module, level, current, is_package):
    """The absolute name of `from <level dots><module> import ...`."""
    if level == 0:
        return module
    base = current.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[:-(level - 1)]
    return ".".join(base + ([module] if module else []))


def import_graph():
    """{module: set of greqprof modules it imports}, from every import
    statement anywhere in its source."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        is_package = path.endswith("__init__.py")
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node.module, node.level, name, is_package)
                # `from . import x` imports the module x when there is one
                targets = [base] + ["%s.%s" % (base, a.name)
                                    for a in node.names]
            else:
                continue
            for t in targets:
                # a submodule import loads its packages first
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t.startswith("greqprof"):
                    deps.add(t)
        deps.discard(name)
        # (a package's own __init__ runs before any of its modules: the
        # edge to it from inside is not a cycle of its own making)
        graph[name] = {d for d in deps
                       if not (d != name and name.startswith(d + "."))}
    return graph


def find_cycle(graph):
    """One cycle (a list of modules, the first repeated at the end) or
    None."""
    state = {}   # module -> 1 while on the path, 2 once done
    path = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_graph_sees_the_package():
    graph = import_graph()
    assert "greqprof.middleware" in graph
    assert "greqprof.engine" in graph["greqprof.middleware"]


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == \
        ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
