"""Where an offline build's config is handed: a static call walk from ``build_packed`` (issue 44's metric).

    python scripts/config_walk.py REPO_DIR [--verbose]   # one JSON object on stdout; --verbose: the walk on stderr

Parses (never imports) the modules under ``REPO_DIR/thdpack`` with :mod:`ast` and walks depth-first, in
execution order (a call's arguments before the call), from ``build_packed`` in
``thdpack/offline/commands/build_packs.py``; each function is entered once. The heuristics:

* a call is resolved through its module's (and its function's own) ``import X`` / ``from X import Y``
  statements, followed through re-exports: a module-level function, ``Cls(...)`` / ``cls(...)``
  (``__init__``, else ``__post_init__``, else a body-less ``Cls.<init>`` leaf, counted as a function and
  also in ``init_leaves``), ``Cls.method``, ``module.name``, ``self.method`` / ``cls.method``, and
  ``x.method`` where ``x``'s class is known: a parameter's annotation, a field's or property's annotation
  (``stages.planning``), ``x = Cls(...)`` or a call's return annotation; untyped locals are not followed;
* it is followed only when an argument (or, for ``x.method``, the receiver ``x``) mentions the config or a
  part of it: a name or attribute ``cfg``, ``config``, ``stages``, ``opts``, ``options``, ``planning``,
  ``store``, ``vision``, ``tokenize``, ``inputs``, ``spec`` or ``ray`` (``self`` alone does not);
* not walked: nested ``def``/``lambda`` bodies (they run later, if at all), ``raise X(...)``'s call (an
  error message is not the config travelling), callables passed along (``functools.partial(f, ...)``);
* a module is its file path;
* ``module_returns`` counts, along the walk's cross-module call edges (the DFS tree: calls into a function
  not yet entered), the edges into a module already entered; ``config_module_bounces`` the tree edges
  between ``thdpack/offline/config.py`` and ``thdpack/offline/stages.py``, either way.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

CONFIG_NAMES = frozenset({"cfg", "config", "stages", "opts", "options", "planning", "store", "vision", "tokenize",
                          "inputs", "spec", "ray"})
START = ("thdpack.offline.commands.build_packs", "build_packed")
BOUNCE_PAIR = frozenset({"thdpack/offline/config.py", "thdpack/offline/stages.py"})


class Module:
    """One parsed module: its functions, classes (methods, attribute annotations, bases) and imports."""

    def __init__(self, name: str, path: Path, rel: str, is_package: bool):
        self.name, self.rel = name, rel
        self.package = name if is_package else name.rpartition(".")[0]
        self.tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        self.functions: dict[str, ast.AST] = {}
        self.classes: dict[str, ast.ClassDef] = {}
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
        self.imports = import_names(self.tree.body, self.package)


def import_names(statements, package: str, *, deep: bool = False) -> dict:
    """``{local name: ("module", dotted) | ("from", dotted, name)}`` of the import statements in ``statements``
    (``deep``: anywhere inside them, e.g. a function's own imports)."""
    nodes = [n for s in statements for n in (ast.walk(s) if deep else [s])]
    out = {}
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.partition(".")[0]] = ("module", a.name if a.asname else a.name.partition(".")[0])
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for a in node.names:
                out[a.asname or a.name] = ("from", base, a.name)
    return out


class Index:
    """Every thdpack module of a checkout, and the name resolution over them."""

    def __init__(self, repo: Path):
        self.modules: dict[str, Module] = {}
        for path in sorted((repo / "thdpack").rglob("*.py")):
            rel = path.relative_to(repo).as_posix()
            parts = rel[:-3].split("/")
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            self.modules[name] = Module(name, path, rel, is_package)

    def symbol(self, module: str, name: str, depth: int = 0):
        """What ``name`` is in ``module``: ("func", mod, node) / ("class", mod, node) / ("module", mod) / None."""
        mod = self.modules.get(module)
        if mod is None or depth > 10:
            return None
        if name in mod.functions:
            return ("func", module, mod.functions[name])
        if name in mod.classes:
            return ("class", module, mod.classes[name])
        if name in mod.imports:
            return self.imported(mod.imports[name], depth + 1)
        if f"{module}.{name}" in self.modules:
            return ("module", f"{module}.{name}")
        return None

    def imported(self, entry, depth: int = 0):
        """The symbol an import entry (:func:`import_names`) names."""
        if entry[0] == "module":
            return ("module", entry[1]) if entry[1].startswith("thdpack") else None
        _, base, name = entry
        if f"{base}.{name}" in self.modules:
            return ("module", f"{base}.{name}")
        return self.symbol(base, name, depth)


class Scope:
    """A function being walked: its module, its class (for ``self``), its own imports and the known classes
    of its local names."""

    def __init__(self, index: Index, module: str, cls, fn):
        self.index, self.module, self.cls, self.fn = index, module, cls, fn
        self.own_imports = import_names(fn.body, index.modules[module].package, deep=True)
        self.types: dict[str, tuple] = {}
        args = fn.args
        for i, a in enumerate(args.posonlyargs + args.args + args.kwonlyargs):
            if i == 0 and cls is not None and a.arg in ("self", "cls"):
                self.types[a.arg] = cls
            elif a.annotation is not None:
                t = annotation_class(index, module, a.annotation)
                if t:
                    self.types[a.arg] = t

    def name(self, name: str):
        """The symbol a bare name is in this function (its own imports first)."""
        if name in self.own_imports:
            return self.index.imported(self.own_imports[name])
        return self.index.symbol(self.module, name)

    def note_assign(self, node: ast.Assign) -> None:
        """``x = <expr of a known class>``: remember ``x``'s class (the first one seen)."""
        if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) and node.targets[0].id not in self.types:
            t = self.type_of(node.value)
            if t:
                self.types[node.targets[0].id] = t

    def type_of(self, expr):
        """("class", module, ClassDef) of ``expr`` when known, else None."""
        if isinstance(expr, ast.Name):
            return self.types.get(expr.id)
        if isinstance(expr, ast.Attribute):
            owner = self.type_of(expr.value)
            return attribute_class(self.index, owner, expr.attr) if owner else None
        if isinstance(expr, ast.Call):
            target = self.resolve(expr.func)[0]
            if target and target[0] == "class":
                return target
            if target and target[0] == "func" and target[2].returns is not None:
                return annotation_class(self.index, target[1], target[2].returns)
        return None

    def resolve(self, func):
        """(symbol, receiver) of a call's ``func``: the receiver is the instance expression of ``x.method``."""
        if isinstance(func, ast.Name):
            return (self.types["cls"] if func.id == "cls" and "cls" in self.types else self.name(func.id)), None
        if not isinstance(func, ast.Attribute):
            return None, None
        owner = self.owner(func.value)
        if owner and owner[0] == "module":
            return self.index.symbol(owner[1], func.attr), None
        if owner and owner[0] == "class":
            return method_of(self.index, owner, func.attr), None
        t = self.type_of(func.value)
        if t:
            is_self = isinstance(func.value, ast.Name) and func.value.id in ("self", "cls")
            return method_of(self.index, t, func.attr), (None if is_self else func.value)
        return None, None

    def owner(self, expr):
        """``expr`` as a module or class symbol (``sp``, ``thdpack.x.y``, ``BuildConfig``), else None."""
        if isinstance(expr, ast.Name):
            s = self.name(expr.id)
            return s if s and s[0] in ("module", "class") else None
        if isinstance(expr, ast.Attribute):
            s = self.owner(expr.value)
            if s and s[0] == "module":
                s = self.index.symbol(s[1], expr.attr)
                return s if s and s[0] in ("module", "class") else None
        return None


def annotation_class(index: Index, module: str, ann):
    """The thdpack class an annotation names (``X``, ``"X"``, ``X | None``, ``Optional[X]``), else None."""
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        try:
            ann = ast.parse(ann.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(ann, ast.BinOp):
        return annotation_class(index, module, ann.left) or annotation_class(index, module, ann.right)
    if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Optional":
        return annotation_class(index, module, ann.slice)
    if isinstance(ann, ast.Name):
        s = index.symbol(module, ann.id)
        return s if s and s[0] == "class" else None
    if isinstance(ann, ast.Attribute) and isinstance(ann.value, ast.Name):
        s = index.symbol(module, ann.value.id)
        if s and s[0] == "module":
            s = index.symbol(s[1], ann.attr)
            return s if s and s[0] == "class" else None
    return None


def class_chain(index: Index, cls, depth: int = 0):
    """``cls`` and its thdpack base classes."""
    yield cls
    if depth < 5:
        for base in cls[2].bases:
            b = annotation_class(index, cls[1], base)
            if b:
                yield from class_chain(index, b, depth + 1)


def method_of(index: Index, cls, name: str):
    """("func", module, node) of method ``name`` of class ``cls`` (or a base), else None."""
    for c in class_chain(index, cls):
        for node in c[2].body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return ("func", c[1], node, c)
    return None


def attribute_class(index: Index, cls, name: str):
    """The class of attribute ``name`` of a ``cls`` instance: a field's annotation or a property's return."""
    for c in class_chain(index, cls):
        for node in c[2].body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                return annotation_class(index, c[1], node.annotation)
            if isinstance(node, ast.FunctionDef) and node.name == name and node.returns is not None:
                return annotation_class(index, c[1], node.returns)
    return None


def mentions_config(expr) -> bool:
    """Whether ``expr`` names the config or a part of it (a name or an attribute in :data:`CONFIG_NAMES`)."""
    return any((isinstance(n, ast.Name) and n.id in CONFIG_NAMES)
               or (isinstance(n, ast.Attribute) and n.attr in CONFIG_NAMES) for n in ast.walk(expr))


def calls_in_order(fn):
    """The calls and simple assignments of ``fn``'s body in execution order (arguments before their call,
    an assignment after its value), nested ``def``/``lambda``/``class`` bodies and ``raise X(...)``'s own
    call (an error message is not the config travelling) left out."""
    out, raised = [], set()

    def visit(node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            return
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            raised.add(id(node.exc))
        for child in ast.iter_child_nodes(node):
            visit(child)
        if isinstance(node, (ast.Call, ast.Assign)) and id(node) not in raised:
            out.append(node)

    for stmt in fn.body:
        visit(stmt)
    return out


def target_of(index: Index, symbol):
    """(key, module, node or None, class) the walk enters for a resolved call's symbol, else None."""
    if symbol is None:
        return None
    if symbol[0] == "func":
        cls = symbol[3] if len(symbol) > 3 else None
        qual = f"{cls[2].name}.{symbol[2].name}" if cls else symbol[2].name
        return (f"{symbol[1]}:{qual}", symbol[1], symbol[2], cls)
    if symbol[0] == "class":
        for init in ("__init__", "__post_init__"):
            m = method_of(index, symbol, init)
            if m:
                return target_of(index, m)
        return (f"{symbol[1]}:{symbol[2].name}.<init>", symbol[1], None, symbol)
    return None


class Walk:
    """The depth-first walk and what it records."""

    def __init__(self, index: Index):
        self.index = index
        self.visited: dict[str, str] = {}  # key -> module, in entering order
        self.tree_edges: list[tuple[str, str]] = []
        self.log: list[str] = []

    def enter(self, key: str, module: str, fn, cls, depth: int) -> None:
        self.visited[key] = module
        self.log.append(f"{'  ' * depth}{self.index.modules[module].rel}:{key.partition(':')[2]}")
        if fn is None:
            return
        scope = Scope(self.index, module, cls, fn)
        for node in calls_in_order(fn):
            if isinstance(node, ast.Assign):
                scope.note_assign(node)
                continue
            symbol, receiver = scope.resolve(node.func)
            target = target_of(self.index, symbol)
            if target is None:
                continue
            handed = [*node.args, *(k.value for k in node.keywords)] + ([receiver] if receiver is not None else [])
            if not any(mentions_config(a) for a in handed) or target[0] in self.visited:
                continue
            self.tree_edges.append((key, target[0]))
            self.enter(*target, depth + 1)


def report(repo: Path, walk: Walk) -> dict:
    """The JSON object: modules and functions entered, module returns, config.py <-> stages.py bounces."""
    rel = {name: m.rel for name, m in walk.index.modules.items()}
    modules = list(dict.fromkeys(rel[m] for m in walk.visited.values()))
    transitions = [(rel[walk.visited[a]], rel[walk.visited[b]]) for a, b in walk.tree_edges
                   if walk.visited[a] != walk.visited[b]]
    seen, returns = {rel[START[0]]}, 0
    for _, callee in transitions:
        returns += callee in seen
        seen.add(callee)
    bounces = sum(1 for a, b in transitions if {a, b} == BOUNCE_PAIR)
    try:
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {"repo": str(repo), "commit": commit, "start": f"{rel[START[0]]}:{START[1]}",
            "modules_entered_count": len(modules), "modules_entered": modules,
            "functions_entered": len(walk.visited),
            "init_leaves": sum(k.endswith(".<init>") for k in walk.visited), "module_transitions": len(transitions),
            "module_returns": returns, "config_module_bounces": bounces}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("repo", type=Path, help="a checkout of thdpack (its thdpack/ is parsed, not imported)")
    parser.add_argument("--verbose", action="store_true", help="print the walk (indented by depth) on stderr")
    args = parser.parse_args(argv)
    repo = args.repo.resolve()
    index = Index(repo)
    start = index.symbol(*START)
    if start is None or start[0] != "func":
        parser.error(f"{repo}: no function {START[1]} in {START[0]}")
    walk = Walk(index)
    walk.enter(f"{START[0]}:{START[1]}", START[0], start[2], None, 0)
    if args.verbose:
        print("\n".join(walk.log), file=sys.stderr)
    print(json.dumps(report(repo, walk), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
