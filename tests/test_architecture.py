"""The shape of the package: which module may import which, and how long a function is.

Read from the source with `ast` (no import runs), so imports inside functions count too.
"""

import ast
import pathlib

import pytest


SRC = pathlib.Path(__file__).resolve().parent.parent / "src"
PACKAGE = "ringeqx"

# Below the strategies: a strategy produces a Layout, and these never see one. A folder
# stands for every module in it (`_layout` holds the token records too, `_ring` the front
# door, the ring's steps and the algorithm).
NO_STRATEGY = ("_ring", "_kernels", "_masks", "_layout", "_score_mods")
MAX_LINES = 80


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _stem(name: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The module that `from <stem> import ...` in module `name` imports from."""
    if not node.level:
        return node.module or ""
    # `from .x import y` is relative to the package holding the module.
    base = name.split(".")
    base = base[: len(base) - node.level + is_package]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, source: str, is_package: bool, modules) -> set[str]:
    """Modules of the package that `name` imports, anywhere in its source."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            stem = _stem(name, node, is_package)
            # `from . import _pallas_tiles` names a module; `from ._masks import Causal`
            # names a thing in one.
            targets = [
                f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem
                for alias in node.names
            ]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: _imports(name, path.read_text(), path.name == "__init__.py", modules)
        for name, path in modules.items()
    }


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_the_graph_is_read_correctly():
    graph = _graph()
    # Relative imports of both forms, from a package and from a module, and one made
    # inside a function body would all be edges.
    assert "ringeqx._masks._base" in graph["ringeqx._kernels._xla"]
    assert "ringeqx._kernels._pallas_tiles" in graph["ringeqx._kernels._pallas_gpu"]
    assert "ringeqx.nn" in graph["ringeqx"]
    assert "ringeqx._ring._steps" in graph["ringeqx.tools._schedule"]
    source = "def f():\n    from .._ring._call import ring_attention\n"
    found = _imports("ringeqx._kernels._made_up", source, False, _modules())
    assert found == {"ringeqx._ring._call"}
    # The cycle this test was written against: the schedule importing the ring inside a
    # function, the ring importing a strategy, the strategies' base the schedule.
    old = {
        "ringeqx._schedule": {"ringeqx._ring"},
        "ringeqx._ring": {"ringeqx._strategies._uniform"},
        "ringeqx._strategies._uniform": {"ringeqx._strategies._base"},
        "ringeqx._strategies._base": {"ringeqx._schedule"},
    }
    assert _cycle(old) == [
        "ringeqx._ring",
        "ringeqx._strategies._uniform",
        "ringeqx._strategies._base",
        "ringeqx._schedule",
        "ringeqx._ring",
    ]


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("part", NO_STRATEGY)
def test_parts_below_the_strategies_import_none(part):
    graph = _graph()
    name = f"{PACKAGE}.{part}"
    starts = [m for m in graph if m == name or m.startswith(name + ".")]
    assert starts, name
    for start in starts:
        strategies = {m for m in _reachable(graph, start) if "._strategies" in m}
        assert not strategies, f"{start} imports (perhaps through others) {sorted(strategies)}"


# The tools wing (`ringeqx.tools`) answers questions about programs; the core is what
# ring attention and the layers need. These stand outside both: the package's front (it
# exports `tools`), and the command line, `__main__` and every module of `_cli/` (its verbs
# are tools).
OUTSIDE_CORE = ("ringeqx", "ringeqx.__main__", "ringeqx._cli")
TOOLS = f"{PACKAGE}.tools"
# Deprecated aliases that reach a tool from the core, each imported inside the function
# that warns, never when the core is imported. They go in the next release, and this
# list with them.
DEPRECATED_BRIDGES = {("ringeqx._strategies._base", "ringeqx.tools._schedule")}


def _is_tool(name: str) -> bool:
    return name == TOOLS or name.startswith(TOOLS + ".")


def _is_outside_core(name: str) -> bool:
    return name in OUTSIDE_CORE or name.startswith(f"{PACKAGE}._cli.")


def test_the_core_never_imports_the_tools():
    graph = _graph()
    core = [m for m in graph if not (_is_tool(m) or _is_outside_core(m))]
    assert "ringeqx._ring._algorithm" in core and "ringeqx.nn._lm" in core
    assert "ringeqx._cli._plan" not in core and "ringeqx._cli" not in core
    found = sorted(
        f"{name} imports {tool}"
        for name in core
        for tool in graph[name]
        if _is_tool(tool) and (name, tool) not in DEPRECATED_BRIDGES
    )
    assert not found, "the core imports the tools:\n" + "\n".join(found)
    # A module-level import of a tool would be caught too (the graph reads every
    # import); the bridges are checked to be inside functions.
    for name, tool in DEPRECATED_BRIDGES:
        source = _modules()[name].read_text()
        top = [n for n in ast.parse(source).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert not any(_stem(name, n, False) == tool for n in top if isinstance(n, ast.ImportFrom))
        assert tool in graph[name], f"{name} no longer imports {tool}: drop the bridge"


def _docstring_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = node.body[0]
    is_doc = (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    )
    return first.end_lineno - first.lineno + 1 if is_doc else 0


def _long_functions() -> list[tuple[str, int]]:
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1 - _docstring_lines(node)
                if lines > MAX_LINES:
                    long.append((f"{name}:{node.name} (line {node.lineno})", lines))
    return long


def test_no_long_functions():
    # A function longer than a screen is split along its seams. Its docstring does not count:
    # it is the API page's text (`ring_attention`'s is 68 lines), not logic to hold in one's head.
    long = _long_functions()
    assert not long, f"functions over {MAX_LINES} lines: {long}"


def _private_uses(name: str, source: str, is_package: bool, modules) -> list[str]:
    """Private names (`_x`, not dunders) that module `name` takes from another module of
    the package: `from ._m import _x`, or `m._x` on a module it imported. Importing a
    private *module* (`from . import _pallas_tiles`) is how the package is built; taking
    a private name out of one is reaching into its insides."""
    tree = ast.parse(source)
    aliases, found = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            stem = _stem(name, node, is_package)
            for alias in node.names:
                full = f"{stem}.{alias.name}"
                if full in modules:
                    aliases[alias.asname or alias.name] = full
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{name}: from {stem} import {alias.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and f"{aliases[node.value.id]}.{node.attr}" not in modules
        ):
            found.append(f"{name}: {aliases[node.value.id]}.{node.attr}")
    return found


def test_private_uses_are_read_correctly():
    modules = _modules()
    source = (
        "from .._ring import _constrain, run\n"
        "from . import _pallas_tiles as tiles\n"
        "def f():\n    return tiles._secret, tiles.public, tiles.__name__\n"
    )
    found = _private_uses("ringeqx._kernels._made_up", source, False, modules)
    assert found == [
        "ringeqx._kernels._made_up: from ringeqx._ring import _constrain",
        "ringeqx._kernels._made_up: ringeqx._kernels._pallas_tiles._secret",
    ]


def test_no_module_takes_another_modules_private_names():
    modules = _modules()
    found = [
        use
        for name, path in modules.items()
        for use in _private_uses(name, path.read_text(), path.name == "__init__.py", modules)
    ]
    assert not found, "private names used across modules:\n" + "\n".join(found)


# A newcomer places any file from the folder names and docs/design.md's tree: the package's
# top level stays small (issue 44), each entry one concept, and the tree names every one.
MAX_TOP_LEVEL = 15


def _top_level() -> list[str]:
    return sorted(p.name for p in (SRC / PACKAGE).iterdir() if p.name != "__pycache__")


def test_the_package_has_at_most_15_top_level_entries():
    top = _top_level()
    assert len(top) <= MAX_TOP_LEVEL, f"{len(top)} entries in src/{PACKAGE}/: {top}"


def test_the_design_doc_draws_every_top_level_entry_and_module():
    design = (SRC.parent / "docs" / "design.md").read_text()
    missing = [name for name in _top_level() if name != "py.typed" and name not in design]
    assert not missing, f"docs/design.md's tree does not name {missing}"
    # Every module of the core's folders too, by file name, so the tree is the real map.
    for folder in ("_ring", "_masks", "_layout", "_inference", "_cli", "_util"):
        for path in sorted((SRC / PACKAGE / folder).glob("_*.py")):
            assert path.name in design, f"docs/design.md's tree does not name {folder}/{path.name}"
