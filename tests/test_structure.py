"""Structure rules for the `jaxkv` package (issue 37): no import cycles, no back arrows
across layers, no function over 100 lines outside the attention kernels, no module over
800 lines without a stated reason.

Everything is read from the source with `ast`; no `jaxkv` module is imported, so the
test is fast and does not need JAX.

What counts as an import arrow (module A -> module B):

- every `import` / `from ... import` anywhere in A's source: module level, under
  `if TYPE_CHECKING:` (a type-only import is still a circle: the two modules cannot
  be understood, moved or split apart), and inside functions (a function-local import
  that exists to break a cycle is the same arrow, only deferred);
- `from P import x` is an arrow to `P.x` when `P.x` is a module of the package,
  otherwise to `P` itself (for a package, its `__init__.py`);
- `import P.Q.R` is an arrow to `P.Q.R` only. Importing a submodule runs its parent
  packages' `__init__` too, but that is Python's loading order, not a dependency
  written by the importer: a package's `__init__` importing (re-exporting) its own
  submodules is not a back arrow. A submodule that imports its package's `__init__`
  by name (`from jaxkv import X`) gets an arrow to the `__init__`, and that is a
  cycle only when the `__init__` really imports the submodule back.

Names that `jaxkv._lazy.lazy_getattr` loads on first use (strings in an exports
table) are not import statements and are not arrows.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "jaxkv"
PACKAGE_DIR = ROOT / PACKAGE

MAX_FUNCTION_LINES = 100
MAX_MODULE_LINES = 800

# Functions allowed over MAX_FUNCTION_LINES, "module:qualified.name" -> reason.
# Only the attention kernels: each is one traced program whose body is the kernel (the
# block loop, the masks and the online softmax share their loop-carried state, and the
# Pallas kernels' refs, grids and DMA descriptors are set up where they are used);
# splitting them into helpers would scatter one computation over several functions.
_KERNEL = "attention kernel: one traced program (see the comment above)"
FUNCTION_LENGTH_ALLOWED: dict[str, str] = {
    "jaxkv.device.attention:_blockwise": _KERNEL,
    "jaxkv.device.pallas_gpu_prefill:paged_prefill_gpu": _KERNEL,
    "jaxkv.device.pallas_tpu:_tiles_kernel": _KERNEL,
    "jaxkv.device.pallas_tpu:paged_attention_tiles_tpu": _KERNEL,
}

# Layering: modules under the first prefix import nothing under the second.
DEVICE_FORBIDDEN = ("jaxkv.engine", "jaxkv.models", "jaxkv.cli", "jaxkv.demo")
HOST_CORE = (
    "jaxkv.hashing",
    "jaxkv.request_hashing",
    "jaxkv.mm_hashing",
    "jaxkv.blocks",
    "jaxkv.block_pool",
    "jaxkv.prefix_index",
    "jaxkv.block_table",
    "jaxkv.kv_cache_interface",
    "jaxkv.kv_cache_utils",
    "jaxkv.kv_cache_manager",
    "jaxkv.kv_cache_coordinator",
    "jaxkv.single_type_base",
    "jaxkv.single_type_kv_cache_manager",
    "jaxkv.mamba_manager",
    "jaxkv.encoder_cache_manager",
    "jaxkv.host_tier",
)
HOST_CORE_FORBIDDEN = ("jaxkv.engine", "jaxkv.models", "jaxkv.cli", "jaxkv.demo")


# --------------------------------------------------------------------------- source


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _sources() -> dict[str, tuple[Path, str, ast.Module]]:
    """Module name -> (path, source text, parsed tree) for every module of the package."""
    out = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        out[_module_name(path)] = (path, text, ast.parse(text, filename=str(path)))
    return out


def _is_package(name: str) -> bool:
    path = _sources()[name][0]
    return path.name == "__init__.py"


def _in(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


# --------------------------------------------------------------------------- imports


def _resolve_from(module: str, node: ast.ImportFrom) -> str:
    """The absolute module name of `from <node.module> import ...` written in `module`."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not _is_package(module):
        base = base[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(module: str, node: ast.AST) -> list[str]:
    """The package modules that the import statement `node` in `module` points at."""
    modules = _sources()
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in modules]
    assert isinstance(node, ast.ImportFrom)
    source = _resolve_from(module, node)
    if not _in(source, (PACKAGE,)):
        return []
    out = []
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        if sub in modules:
            out.append(sub)
        elif source in modules:
            out.append(source)
    return out


@cache
def import_graph() -> dict[str, dict[str, int]]:
    """Module -> {imported module: line of the first import} for the whole package."""
    graph: dict[str, dict[str, int]] = {}
    for module, (_, _, tree) in _sources().items():
        edges: dict[str, int] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _targets(module, node):
                    if target != module:
                        edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def _find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of `graph` as a path [a, b, ..., a], or None (iterative DFS)."""
    white, grey, black = 0, 1, 2
    color = dict.fromkeys(graph, white)
    for start in sorted(graph):
        if color[start] != white:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        color[start] = grey
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                color[node] = black
                stack.pop()
                path.pop()
            elif color.get(child, black) == grey:
                return path[path.index(child) :] + [child]
            elif color.get(child, black) == white:
                color[child] = grey
                path.append(child)
                stack.append((child, iter(sorted(graph[child]))))
    return None


def _describe(cycle: list[str]) -> str:
    graph = import_graph()
    steps = [
        f"  {a} -> {b}  ({_sources()[a][0].relative_to(ROOT)}:{graph[a][b]})"
        for a, b in zip(cycle, cycle[1:], strict=False)
    ]
    return "\n".join(steps)


def _reachable(start: str) -> dict[str, list[str]]:
    """Every module reachable from `start`, with one import path to it."""
    graph = import_graph()
    seen = {start: [start]}
    todo = [start]
    while todo:
        node = todo.pop()
        for child in sorted(graph[node]):
            if child not in seen:
                seen[child] = seen[node] + [child]
                todo.append(child)
    return seen


def _layer_violations(sources: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for module in sorted(_sources()):
        if not _in(module, sources):
            continue
        for target, path in sorted(_reachable(module).items()):
            # Reported where the path first enters the forbidden layer.
            if _in(target, forbidden) and not any(_in(m, forbidden) for m in path[:-1]):
                out.append(" -> ".join(path))
    return out


# --------------------------------------------------------------------------- lengths


def _functions(tree: ast.Module):
    """(qualified name, node) for every function and method, nested ones included."""

    def walk(node: ast.AST, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                yield name, child
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def long_functions() -> dict[str, int]:
    """'module:qualname' -> length, for every function over MAX_FUNCTION_LINES."""
    out = {}
    for module, (_, _, tree) in _sources().items():
        for name, node in _functions(tree):
            length = node.end_lineno - node.lineno + 1  # `def` line to end; no decorators
            if length > MAX_FUNCTION_LINES:
                out[f"{module}:{name}"] = length
    return out


# --------------------------------------------------------------------------- tests


def test_the_package_is_found():
    assert "jaxkv" in _sources() and "jaxkv.kv_cache_manager" in _sources()
    assert import_graph()["jaxkv"], "jaxkv/__init__.py imports nothing?"


def test_type_only_and_function_local_imports_are_arrows():
    graph = import_graph()
    # `if TYPE_CHECKING: from jaxkv.request import Request` in jaxkv/block_pool.py
    assert "jaxkv.request" in graph["jaxkv.block_pool"]
    # `from jaxkv.engine import EngineConfig, LLMEngine` inside a function of jaxkv/cli.py
    assert "jaxkv.engine" in graph["jaxkv.cli"]
    # `from jaxkv import demo` (a submodule): an arrow to it, not to jaxkv/__init__.py
    assert "jaxkv.demo" in graph["jaxkv.cli"]


def test_no_import_cycles():
    cycle = _find_cycle(import_graph())
    assert cycle is None, "import cycle:\n" + _describe(cycle)


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}
    cycle = _find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}
    assert _find_cycle({"a": {"b": 1}, "b": {}, "c": {"a": 1, "b": 1}}) is None


def test_device_imports_no_engine_or_models():
    bad = _layer_violations(("jaxkv.device",), DEVICE_FORBIDDEN)
    assert not bad, "jaxkv.device reaches the engine/models/cli:\n" + "\n".join(bad)


def test_host_core_imports_no_engine_or_models():
    bad = _layer_violations(HOST_CORE, HOST_CORE_FORBIDDEN)
    assert not bad, "host core reaches the engine/models/cli/demo:\n" + "\n".join(bad)


def test_no_function_over_100_lines():
    bad = {name: n for name, n in long_functions().items() if name not in FUNCTION_LENGTH_ALLOWED}
    assert not bad, f"functions over {MAX_FUNCTION_LINES} lines: " + ", ".join(
        f"{name} ({n})" for name, n in sorted(bad.items())
    )


def test_allow_lists_are_current():
    """An allow-listed function that is now short enough (or gone) leaves the list."""
    long = long_functions()
    stale = [name for name in FUNCTION_LENGTH_ALLOWED if name not in long]
    assert not stale, f"no longer over {MAX_FUNCTION_LINES} lines: {stale}"


def _module_size_reason(tree: ast.Module) -> str | None:
    doc = ast.get_docstring(tree) or ""
    for line in doc.splitlines():
        if line.strip().startswith("Size:"):
            return line.strip()[len("Size:") :].strip() or None
    return None


def test_no_module_over_800_lines_without_a_reason():
    bad = []
    for path, text, tree in _sources().values():
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES and _module_size_reason(tree) is None:
            bad.append(f"{path.relative_to(ROOT)} ({lines})")
    assert not bad, (
        f"modules over {MAX_MODULE_LINES} lines with no 'Size:' line in the docstring: "
        + ", ".join(bad)
    )
