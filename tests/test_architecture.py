"""The package's import structure, read from its source with ``ast`` (the package is not imported).

Four checks:

* no module imports a private name (leading underscore) from another package module, nor reads
  one as an attribute of an imported package module (``patching._helper``);
* no module imports from a higher layer (``LAYERS``), counting lazy imports inside functions and
  imports under ``if TYPE_CHECKING:``;
* no import circle between modules (module-level imports and lazy ones inside functions: a lazy
  import only hides a circle; a package ``__init__`` that re-exports its children is not a
  circle with them);
* no package folder holds more than ``MAX_MODULES_PER_FOLDER`` modules directly.
"""
import ast
from pathlib import Path

import pytest

PACKAGE = "captum_transformers"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# Lowest first. A module may import from its own layer or a lower one. A layer is named by a
# subpackage or module of the package (the longest name that contains a module decides: Captum
# Insights' bridge serves the explorer, the other integrations sit below the tasks that use them);
# the package root ``__init__`` may import anything.
LAYERS = (
    ("errors", "functional", "models"),
    ("model_state",),
    ("capture",),
    ("compat",),
    ("propagation",),
    ("adapters",),
    ("engine",),
    ("methods",),
    ("generation",),
    ("evaluation",),
    ("visualization",),
    ("integrations",),
    ("tasks",),
    ("model_loading",),
    ("corpus",),
    ("explorer",),
    ("integrations.insights",),
    ("cli", "__main__"),
)

MAX_MODULES_PER_FOLDER = 16

# (importing file relative to the package folder, private name) pairs still waiting for their
# owners. Empty it as they are fixed; the test fails on any pair not listed here and on any listed
# pair that no longer occurs, so the list only ever shrinks.
PRIVATE_IMPORTS_ALLOWED = frozenset()

# (importing module, imported module) pairs of upward imports still waiting for a decision; the
# test fails on any other upward import and on any listed pair that no longer occurs.
LAYER_VIOLATIONS_ALLOWED = frozenset()

# Strongly connected components (as sorted tuples of module names) still waiting for their owners.
CIRCLES_ALLOWED = frozenset()


def _module_name(path):
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources():
    """{module name: (path, parsed tree, is a package)} for every module of the package."""
    modules = {}
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        modules[_module_name(path)] = (path, tree, path.name == "__init__.py")
    return modules


SOURCES = _sources()


def _relative(path):
    return path.relative_to(ROOT).as_posix()


def _base(module, is_package, node):
    """The absolute module a ``from ... import`` names, or None when it is outside the package."""
    if node.level == 0:
        name = node.module or ""
        return name if name == PACKAGE or name.startswith(PACKAGE + ".") else None
    anchor = module.split(".") if is_package else module.split(".")[:-1]
    anchor = anchor[:len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def _imports(module, *, module_level_only):
    """(line, imported module, imported name or None) for each package import in ``module``.

    ``from a.b import c`` yields ``a.b.c`` when that is a module, else ``a.b`` with name ``c``.
    With ``module_level_only``, imports inside functions are skipped (those under ``if`` or
    ``try`` at module level are kept, ``if TYPE_CHECKING:`` included).
    """
    _path, tree, is_package = SOURCES[module]
    if module_level_only:
        nodes = []
        pending = list(tree.body)
        while pending:
            node = pending.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            nodes.append(node)
            pending.extend(ast.iter_child_nodes(node))
    else:
        nodes = ast.walk(tree)
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    found.append((node.lineno, alias.name, None))
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, is_package, node)
            if base is None:
                continue
            for alias in node.names:
                child = f"{base}.{alias.name}"
                if child in SOURCES:
                    found.append((node.lineno, child, None))
                else:
                    found.append((node.lineno, base, alias.name))
    return sorted(found)


def _defining_module(module, name, seen=()):
    """The module that defines ``name`` as imported from ``module``: a package ``__init__`` that
    only re-exports the name from one of its submodules hands it on to that submodule."""
    if module not in SOURCES or not SOURCES[module][2] or module in seen:
        return module
    for _line, source, imported in _imports(module, module_level_only=True):
        if imported == name and source.startswith(module + "."):
            return _defining_module(source, name, seen + (module,))
    return module


def _layer(module):
    parts = module.split(".")
    if len(parts) == 1:
        return None  # the package root __init__
    matches = [(len(name), rank) for rank, layer in enumerate(LAYERS) for name in layer
               if module == f"{PACKAGE}.{name}" or module.startswith(f"{PACKAGE}.{name}.")]
    if matches:
        return max(matches)[1]
    raise AssertionError(f"{module}: its top-level part {parts[1]!r} is in no layer of LAYERS; "
                         "add it to tests/test_architecture.py's LAYERS in its place")


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_attributes(module):
    """(line, imported module, name) for each ``alias._name`` read in ``module`` where ``alias``
    is a package module it imported (``from ..model_state import patching``, ``import a.b as c``)."""
    _path, tree, is_package = SOURCES[module]
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _base(module, is_package, node)
            for alias in node.names if base is not None else ():
                if f"{base}.{alias.name}" in SOURCES:
                    aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in SOURCES:
                    aliases[alias.asname] = alias.name
    return [(node.lineno, aliases[node.value.id], node.attr) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
            and aliases[node.value.id] != module and _private(node.attr)]


def test_no_private_name_crosses_modules():
    found = set()
    lines = {}
    for module, (path, _tree, _is_package) in SOURCES.items():
        for line, source, name in _imports(module, module_level_only=False):
            if name is not None and _private(name):
                key = (_relative(path), name)
                found.add(key)
                lines.setdefault(key, f"{PACKAGE}/{key[0]}:{line}: imports {name} from {source}")
        for line, source, name in _private_attributes(module):
            key = (_relative(path), name)
            found.add(key)
            lines.setdefault(key, f"{PACKAGE}/{key[0]}:{line}: reads {source}.{name}")
    new = sorted(found - PRIVATE_IMPORTS_ALLOWED)
    assert not new, (
        "Private names imported from another module (a helper used across modules is public: drop "
        "the underscore and give it a docstring in the module that owns the concept, and update every user, "
        "tests included):\n" + "\n".join(lines[key] for key in new))
    fixed = sorted(PRIVATE_IMPORTS_ALLOWED - found)
    assert not fixed, ("These private imports are gone; remove them from PRIVATE_IMPORTS_ALLOWED in "
                       "tests/test_architecture.py:\n" + "\n".join(f"{file}: {name}" for file, name in fixed))


def test_no_module_imports_from_a_higher_layer():
    found = {}
    for module, (path, _tree, _is_package) in SOURCES.items():
        rank = _layer(module)
        if rank is None:
            continue
        for line, source, _name in _imports(module, module_level_only=False):
            target = _layer(source)
            if target is not None and target > rank and (module, source) not in LAYER_VIOLATIONS_ALLOWED:
                found.setdefault((module, source), f"{PACKAGE}/{_relative(path)}:{line}: imports {source} "
                                 f"(layer {'/'.join(LAYERS[target])} is above {'/'.join(LAYERS[rank])})")
    assert not found, (
        "Modules importing from a higher layer (lazy and TYPE_CHECKING imports count; the layer order is "
        "LAYERS in tests/test_architecture.py). Move the shared code down into the lower layer, or pass "
        "what is needed in from above:\n" + "\n".join(found[key] for key in sorted(found)))
    stale = sorted(LAYER_VIOLATIONS_ALLOWED - {
        (module, source) for module in SOURCES for _line, source, _name in _imports(module, module_level_only=False)})
    assert not stale, "Remove these from LAYER_VIOLATIONS_ALLOWED, they no longer occur:\n" + "\n".join(map(str, stale))


def _graph():
    """{module: set of modules it imports}, at module level or inside a function; a name imported
    from a package is resolved to the submodule the package re-exports it from."""
    graph = {module: set() for module in SOURCES}
    for module in SOURCES:
        for _line, source, name in _imports(module, module_level_only=False):
            target = source if name is None else _defining_module(source, name)
            if target in SOURCES and target != module:
                graph[module].add(target)
    return graph


def _strongly_connected(graph):
    """Tarjan's algorithm, iterative; yields each component as a sorted tuple."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
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
                    components.append(tuple(sorted(component)))
    return components


def _edges(graph, component, shown=24):
    edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a]) if b in component]
    return "; ".join(edges[:shown]) + (f"; ... ({len(edges) - shown} more)" if len(edges) > shown else "")


def test_no_import_circle():
    graph = _graph()
    circles = [component for component in _strongly_connected(graph)
               if len(component) > 1 and component not in CIRCLES_ALLOWED]
    assert not circles, (
        "Import circles between modules (lazy imports inside functions count; each group imports itself through "
        "the others). Move what both sides need into a module below them, or merge them:\n" + "\n".join(
            "  " + ", ".join(component) + "\n    edges: " + _edges(graph, component) for component in circles))
    stale = sorted(CIRCLES_ALLOWED - set(_strongly_connected(graph)))
    assert not stale, "Remove these from CIRCLES_ALLOWED, they are no longer circles:\n" + "\n".join(map(str, stale))


def test_no_folder_holds_too_many_modules():
    crowded = {}
    for path, *_ in SOURCES.values():
        crowded.setdefault(path.parent, []).append(path.name)
    crowded = {folder: names for folder, names in crowded.items() if len(names) > MAX_MODULES_PER_FOLDER}
    assert not crowded, (
        f"Package folders with more than {MAX_MODULES_PER_FOLDER} modules; split each by concept into subpackages:\n"
        + "\n".join(f"  {folder.relative_to(ROOT.parent).as_posix()}: {len(names)} modules" for folder, names in
                    sorted(crowded.items())))


@pytest.mark.parametrize("module", [f"{PACKAGE}.capture.replayed_rows", f"{PACKAGE}.tasks.runner"])
def test_checks_see_the_modules(module):
    # Guards the checks against reading nothing (a wrong ROOT would make every check pass).
    assert module in SOURCES and _imports(module, module_level_only=False)
