"""The import graph of thdpack/ follows the layers, has no cycles, and the core does not import vlm/.

The layers (:data:`LAYERS`, mirrored in docs/architecture.md): a module may import only from its
own layer and lower layers (one word each way: *lower* layers come first in the table, *higher* ones later).

Every ``import`` in a module counts as an edge, at module level or inside a
function (an import hidden in a function is still a dependency).
``from thdpack.x import y`` is an edge to ``thdpack.x.y`` when that is a
module, else to ``thdpack.x``: importing a submodule always runs its package's
``__init__`` first, so that implicit edge is not counted (it would put every
package in a cycle with its submodules). Relative imports are resolved
against the package.
"""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "thdpack"

# The layers, lowest first: (name, the module prefixes in it). A module belongs to the first layer
# one of whose prefixes it is or lies under; it may import from that layer and any lower layer (earlier
# in this list), never from a higher one (later). docs/architecture.md draws the same table.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("common", ("thdpack.common",)),
    ("demo, parallel, attention", ("thdpack.demo", "thdpack.parallel", "thdpack.attention")),
    ("flops", ("thdpack.flops",)),
    ("planning", ("thdpack.planning",)),
    ("batching", ("thdpack.batching",)),
    ("loaders, losses", ("thdpack.loaders", "thdpack.losses")),
    ("vlm", ("thdpack.vlm",)),
    ("integrations", ("thdpack.integrations",)),
    ("offline base", ("thdpack.offline.errors", "thdpack.offline.stage_options", "thdpack.offline.config",
                      "thdpack.offline.procs", "thdpack.offline.stages")),
    ("offline cluster", ("thdpack.offline.cluster",)),
    ("offline store", ("thdpack.offline.store",)),
    ("offline inputs", ("thdpack.offline.inputs",)),
    ("offline tokenizing", ("thdpack.offline.tokenizing",)),
    ("offline vision", ("thdpack.offline.vision",)),
    ("offline commands", ("thdpack.offline.commands", "thdpack.offline.__init__")),
    ("check", ("thdpack.check",)),
    ("cli", ("thdpack.cli",)),
    ("package", ("thdpack.__init__", "thdpack.__main__")),
]

# Cycles known and not yet broken, as sorted tuples of module names, each with
# the reason. The test fails on any cycle not listed here.
KNOWN_CYCLES: dict[tuple[str, ...], str] = {}

# Core modules that still import thdpack.vlm, with the reason; to be replaced by the
# family handed in (``vlm=``). The test fails on any import not listed.
KNOWN_CORE_VLM_IMPORTS: dict[tuple[str, str], str] = {}

# Packages outside the core: the model families themselves, the offline pipeline (its VLM
# builds use a family), framework integrations and the demo. Everything else — top-level
# modules and core packages such as thdpack.flops — is core.
NOT_CORE = ("thdpack.vlm", "thdpack.offline", "thdpack.integrations", "thdpack.demo")

# Core modules allowed to import thdpack.vlm, with the reason: none (the family is handed in, issue 44 point 5).
VLM_INTEGRATION_POINTS: dict[str, str] = {}


def _module_name(path: Path) -> str:
    """Dotted module name of a file under PACKAGE_DIR (package: its __init__)."""
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    return {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _resolve(name: str, module: str, level: int, is_package: bool) -> str:
    """Absolute name of ``from <level dots><name> import ...`` inside ``module``."""
    if level == 0:
        return name
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """The module an import name lands on (a package's __init__), or None if outside."""
    if name in modules:
        return name
    if name + ".__init__" in modules:
        return name + ".__init__"
    return None


def _from_target(base: str, name: str, modules: dict[str, Path]) -> str:
    """What ``from <base> import <name>`` depends on: the submodule if it is one, else base."""
    sub = f"{base}.{name}"
    return sub if _target(sub, modules) is not None else base


def _edges(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of the package that ``module`` imports anywhere in its file."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", module, node.level, is_package)
            names = [_from_target(base, alias.name, modules) for alias in node.names]
        for name in names:
            target = _target(name, modules)
            if target is not None and target != module:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    """Edges module -> imported modules, over every module of thdpack/."""
    modules = _modules()
    return {m: _edges(m, p, modules) for m, p in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Strongly connected components of more than one module."""
    return sorted(tuple(c) for c in strongly_connected(graph) if len(c) > 1)


def test_tarjan_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [("a", "b", "c")]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_function_level_and_relative_imports_are_edges(tmp_path):
    modules = {"thdpack.x": tmp_path / "x.py", "thdpack.y": tmp_path / "y.py",
               "thdpack.z": tmp_path / "z.py"}
    modules["thdpack.x"].write_text("def f():\n    from .y import g\n    import thdpack.z\n")
    assert _edges("thdpack.x", modules["thdpack.x"], modules) == {"thdpack.y", "thdpack.z"}
    modules["thdpack.__init__"] = tmp_path / "__init__.py"
    modules["thdpack.x"].write_text("from thdpack import y\nfrom thdpack import VERSION\n")
    assert _edges("thdpack.x", modules["thdpack.x"], modules) == {"thdpack.y", "thdpack.__init__"}


def test_no_new_import_cycles():
    cycles = _cycles(import_graph())
    new = [c for c in cycles if c not in KNOWN_CYCLES]
    assert not new, f"import cycles in thdpack/ (move the shared piece to the module that owns it): {new}"


def test_known_exceptions_still_exist():
    graph = import_graph()
    cycles = set(_cycles(graph))
    gone = [c for c in KNOWN_CYCLES if c not in cycles]
    gone += [e for e in KNOWN_CORE_VLM_IMPORTS if e[1] not in graph[e[0]]]
    assert not gone, f"exceptions no longer needed: remove them from {__file__}: {gone}"


def test_core_does_not_import_vlm():
    graph = import_graph()
    core = [m for m in graph if not m.startswith(NOT_CORE) and m not in VLM_INTEGRATION_POINTS]
    bad = {m: sorted(t for t in graph[m] if t.startswith("thdpack.vlm")
                     and (m, t) not in KNOWN_CORE_VLM_IMPORTS)
           for m in core}
    bad = {m: t for m, t in bad.items() if t}
    assert not bad, f"core modules import thdpack.vlm (pass family behaviour in instead): {bad}"


def test_no_import_for_its_side_effect():
    """The VLM family is an object handed to the builder (``vlm=thdpack.vlm.get_family(cfg)``), not a hook an
    import registers: no extension table in the core, and ``import thdpack`` loads no part of thdpack.vlm."""
    assert not (PACKAGE_DIR / "common" / "extensions.py").exists()
    for path in PACKAGE_DIR.rglob("*.py"):
        assert "register_vision" not in path.read_text(encoding="utf-8"), path
    code = "import sys, thdpack; print(sorted(m for m in sys.modules if m.startswith('thdpack.vlm')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr or out.stdout


def layer_of(module: str) -> int:
    """Index in :data:`LAYERS` of the layer ``module`` belongs to (KeyError: a module no layer names)."""
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise KeyError(f"{module} is in no layer of LAYERS: add its package to the table (and docs/architecture.md)")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a layer higher than its own, as 'module (layer) -> target (layer)'."""
    return [f"{m} ({LAYERS[layer_of(m)][0]}) -> {t} ({LAYERS[layer_of(t)][0]})"
            for m in sorted(graph) for t in sorted(graph[m]) if layer_of(t) > layer_of(m)]


def test_a_planted_import_from_a_higher_layer_breaks_the_layers():
    graph = {"thdpack.common.samples": {"thdpack.planning.plan"}, "thdpack.planning.plan": {"thdpack.common.align"},
             "thdpack.common.align": set(), "thdpack.offline.store.writer": {"thdpack.offline.tokenizing.row_conversions"},
             "thdpack.offline.tokenizing.row_conversions": {"thdpack.offline.store.schema"},
             "thdpack.offline.store.schema": {"thdpack.offline.errors"}, "thdpack.offline.errors": set()}
    assert layer_violations(graph) == [
        "thdpack.common.samples (common) -> thdpack.planning.plan (planning)",
        "thdpack.offline.store.writer (offline store) -> thdpack.offline.tokenizing.row_conversions (offline tokenizing)",
    ]


def test_every_module_is_in_a_layer():
    missing = []
    for m in import_graph():
        try:
            layer_of(m)
        except KeyError as exc:
            missing.append(str(exc))
    assert not missing, missing


def test_modules_import_only_their_own_layer_and_lower_ones():
    bad = layer_violations(import_graph())
    assert not bad, ("imports from a higher layer (move the shared piece down to the layer that owns it; "
                     f"the layers are LAYERS in {__file__}): {bad}")


def test_at_most_twelve_modules_per_folder():
    per_folder: dict[Path, int] = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        if path.name != "__init__.py":
            per_folder[path.parent] = per_folder.get(path.parent, 0) + 1
    crowded = {str(d.relative_to(PACKAGE_DIR.parent)): n for d, n in per_folder.items() if n > 12}
    assert not crowded, f"folders of more than 12 modules (split them by stage): {crowded}"


def test_module_names_do_not_collide_across_folders():
    seen: dict[str, list[str]] = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.stem, []).append(str(path.relative_to(PACKAGE_DIR.parent)))
    folders = {p.parent.name for p in PACKAGE_DIR.rglob("__init__.py")}  # packages (not data folders)
    twice = {name: paths for name, paths in seen.items() if len(paths) > 1 or name in folders}
    assert not twice, f"module names used twice (or also a folder's name): {twice}"


def test_no_module_re_exports_another_modules_name():
    """A name lives where it is defined and is imported from there: a module other than a package's ``__init__``
    that imports a thdpack name only to hand it on (an import at module level kept with ``noqa: F401``) is a
    re-export module, refused. (``__init__`` files are the public names; registration imports inside a
    function are not re-exports.)"""
    found = []
    for name, path in _modules().items():
        if name.endswith("__init__"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("thdpack") \
                    and "noqa: F401" in lines[node.end_lineno - 1]:
                found.append(f"{name}:{node.lineno}")
    assert not found, f"re-exports (import the name from the module that defines it): {found}"
