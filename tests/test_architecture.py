"""The shape of the package: which module may import which, how long a function is, and
that each rule (a chip's figures, a kernel's tiles) is defined once.

Read from the source with `ast`, so imports inside functions count too; the rules of one
definition ask the package only for the names and numbers they look for.
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
            # `from ._pallas import _tiles` names a module; `from ._masks import Causal`
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
    assert "ringeqx._masks._base" in graph["ringeqx._kernels._tiling"]
    assert "ringeqx._kernels._pallas._tiles" in graph["ringeqx._kernels._triton._kernel"]
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
    private *module* (`from ._pallas import _tiles`) is how the package is built; taking
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
        "from ._pallas import _tiles as tiles\n"
        "def f():\n    return tiles._secret, tiles.public, tiles.__name__\n"
    )
    found = _private_uses("ringeqx._kernels._made_up", source, False, modules)
    assert found == [
        "ringeqx._kernels._made_up: from ringeqx._ring import _constrain",
        "ringeqx._kernels._made_up: ringeqx._kernels._pallas._tiles._secret",
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
    for folder in ("_ring", "_masks", "_layout", "_inference", "_cli", "_util", "_kernels"):
        for path in sorted((SRC / PACKAGE / folder).rglob("_*.py")):
            if path.name == "__init__.py":
                continue
            where = path.relative_to(SRC / PACKAGE)
            assert path.name in design, f"docs/design.md's tree does not name {where}"


# One definition of each rule (issue 44). A question about a kernel is the kernel's method,
# so nothing outside `_kernels/` switches on the package's own kernel classes; the chips
# are described once, in the hardware table; a kernel's default tiles are written once, in
# its own module. The first rule is read from the source alone; the other two ask the
# package for the names and numbers they look for (the table's, the kernels' tiles).
KERNELS = f"{PACKAGE}._kernels"
HARDWARE_TABLE = f"{PACKAGE}.tools._hardware"


def _kernel_classes(modules) -> dict[str, str]:
    """The package's concrete kernels, by class name -> the module defining it: the
    classes in `_kernels/` whose bases name `AbstractAttentionKernel`."""
    found = {}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                _named(base) == "AbstractAttentionKernel" for base in node.bases
            ):
                found[node.name] = name
    return {k: m for k, m in found.items() if m.startswith(KERNELS + ".")}


def _named(node: ast.AST) -> str | None:
    """`X` for `X` or `a.b.X`."""
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def _kernel_switches(name: str, source: str, kernels) -> list[str]:
    """Where module `name` asks which of `kernels` an object is: `isinstance` or
    `issubclass` naming one (alone or in a tuple), or a `case Kernel(...)` pattern."""
    found = []
    for node in ast.walk(ast.parse(source)):
        classes = []
        if isinstance(node, ast.Call) and _named(node.func) in ("isinstance", "issubclass"):
            if len(node.args) == 2:
                arg = node.args[1]
                classes = arg.elts if isinstance(arg, ast.Tuple) else [arg]
        elif isinstance(node, ast.MatchClass):
            classes = [node.cls]
        hits = sorted({c for c in map(_named, classes) if c in kernels})
        found += [f"{name}:{node.lineno} switches on {c}" for c in hits]
    return found


def test_kernel_switches_are_read_correctly():
    kernels = {"XlaKernel", "PallasTpuKernel"}
    source = (
        "def f(k):\n"
        "    if isinstance(k, (int, rx.PallasTpuKernel)):\n        return 1\n"
        "    match k:\n        case XlaKernel(block_q=8):\n            return 2\n"
        "    return isinstance(k, AbstractAttentionKernel)\n"
    )
    assert _kernel_switches("m", source, kernels) == [
        "m:2 switches on PallasTpuKernel",
        "m:5 switches on XlaKernel",
    ]
    classes = _kernel_classes(_modules())
    assert set(classes) == {"XlaKernel", "PallasGpuKernel", "PallasTpuKernel"}
    assert classes["XlaKernel"] == f"{KERNELS}._xla"


def test_nothing_outside_the_kernels_switches_on_a_kernel_class():
    # The planner and the schedule once asked `isinstance(kernel, PallasTpuKernel)` for
    # its tiles; they ask `kernel.tiles(dtype, head_dim)`, which a user's kernel answers
    # too.
    modules = _modules()
    kernels = _kernel_classes(modules)
    found = [
        switch
        for name, path in modules.items()
        if not name.startswith(KERNELS + ".")
        for switch in _kernel_switches(name, path.read_text(), kernels)
    ]
    assert not found, "switches on a kernel class outside _kernels/:\n" + "\n".join(found)


def _chip_names() -> set[str]:
    """The names the hardware table gives chips: its keys (`"tpu-v5e"`), its targets
    (`"v5e"`, `"h100"`) and each key's generation (`"v4"`, `"a100"`)."""
    from ringeqx.tools._hardware import HARDWARE, TARGETS

    generations = {key.removeprefix("tpu-").split("-")[0] for key in HARDWARE}
    return set(HARDWARE) | set(TARGETS) | generations


def _chip_tables(name: str, source: str, chips: set[str]) -> list[str]:
    """Module-level assignments of `name` that spell a chip's name (a table of chips)."""
    found = []
    for node in ast.parse(source).body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        named = sorted(
            {
                c.value
                for c in ast.walk(node.value)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
                and c.value.lower() in chips
            }
        )  # fmt: skip
        if named:
            found.append(f"{name}:{node.lineno} names {named}")
    return found


def test_chip_tables_are_read_correctly():
    chips = _chip_names()
    assert {"tpu-v5e", "v5e", "v4", "a100", "h200"} <= chips and "tpu" not in chips
    source = (
        'TPUS = ("v5e", "v5p")\nOK = {"tpu": 1}\nX: dict = {"H100": 2}\n'
        'def f():\n    return {"v5e": 1}\n'
    )
    assert _chip_tables("m", source, chips) == [
        "m:1 names ['v5e', 'v5p']",
        "m:3 names ['H100']",
    ]


def test_one_hardware_table():
    # `_targets.TPUS`, its GPUs' figures and the planner's target -> profile map were
    # written out beside `HARDWARE`; they are read from it, so a chip is one row.
    chips = _chip_names()
    found = [
        table
        for name, path in _modules().items()
        if name != HARDWARE_TABLE
        for table in _chip_tables(name, path.read_text(), chips)
    ]
    assert not found, "tables of chips outside the hardware table:\n" + "\n".join(found)


def _default_tiles() -> dict[tuple[int, int], set[str]]:
    """Each default `(block_q, block_kv)` of the package's kernels (by name on every
    device, for each dtype and head_dim they take) -> the modules of the kernels that
    default to it."""
    import jax.numpy as jnp

    import ringeqx as rx

    found: dict[tuple[int, int], set[str]] = {}
    for name in ("xla", "pallas_gpu", "pallas_tpu"):
        for device in ("cpu", "gpu", "tpu"):
            kernel = rx.select_kernel(name, device, interpret=True)
            for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
                for head_dim in (64, 128, 256):
                    pair = kernel.tiles(dtype, head_dim)
                    found.setdefault(pair, set()).add(type(kernel).__module__)
    return found


def _tile_literals(name: str, source: str, pairs) -> list[str]:
    """Where module `name` writes one of `pairs` as a literal `(block_q, block_kv)`, or
    an integer `block_q=` / `block_kv=` keyword."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Tuple) and len(node.elts) == 2:
            values = tuple(e.value if isinstance(e, ast.Constant) else None for e in node.elts)
            if values in pairs:
                found.append(f"{name}:{node.lineno} writes {values}")
        elif isinstance(node, ast.keyword) and node.arg in ("block_q", "block_kv"):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, int):
                found.append(f"{name}:{node.value.lineno} writes {node.arg}={node.value.value}")
    return found


def test_tile_literals_are_read_correctly():
    tiles = _default_tiles()
    assert {(256, 256), (512, 1024), (1024, 4096), (64, 64), (32, 32)} <= set(tiles)
    assert tiles[256, 256] == {f"{KERNELS}._xla"}
    source = (
        '_BLOCKS = {("xla", "cpu"): (256, 256)}\n'
        "k = XlaKernel(block_q=512, block_kv=n)\nshape = (256, 3)\n"
    )
    assert _tile_literals("m", source, tiles) == [
        "m:1 writes (256, 256)",
        "m:2 writes block_q=512",
    ]


def test_each_kernels_default_tiles_are_written_once():
    # `select_kernel` once held XlaKernel's tiles per device (`_BLOCKS`) and the planner
    # and the schedule read a kernel's defaults their own ways; now a kernel's module
    # alone writes them, and everything else asks `kernel.tiles(dtype, head_dim)`. A
    # module that defines a kernel may write what it likes (its candidates, its table).
    modules = _modules()
    owners = set(_kernel_classes(modules).values())
    tiles = _default_tiles()
    found = [
        literal
        for name, path in modules.items()
        if name not in owners
        for literal in _tile_literals(name, path.read_text(), tiles)
    ]
    assert not found, "a kernel's default tiles written outside its module:\n" + "\n".join(found)
