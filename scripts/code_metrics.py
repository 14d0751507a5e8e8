"""Size and shape of the thdpack package: the figures issue 14 asks for, from any checkout.

    python scripts/code_metrics.py [REPO_DIR]      # default: this repository

Prints the number of modules and lines, the largest modules, the import cycles (strongly
connected components of the import graph, every import counted, as in
``tests/test_import_graph.py``, whose graph code this reuses) and the core modules that
import ``thdpack.vlm``. Duplicated blocks are counted by the ``duplicates`` tool
(``duplicates --repo thdpack``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def _graph_module():
    spec = importlib.util.spec_from_file_location("import_graph", HERE / "tests" / "test_import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(repo: Path) -> None:
    files = sorted((repo / "thdpack").rglob("*.py"))
    sizes = sorted(((len(p.read_text().splitlines()), p.relative_to(repo)) for p in files), reverse=True)
    print(f"{len(files)} modules, {sum(n for n, _ in sizes)} lines; largest: "
          + ", ".join(f"{p} {n}" for n, p in sizes[:5]))
    graph_code = _graph_module()
    graph_code.PACKAGE_DIR = repo / "thdpack"
    graph = graph_code.import_graph()
    cycles = graph_code._cycles(graph)
    print(f"{len(cycles)} import cycle(s)" + "".join(f"\n  {' <-> '.join(c)}" for c in cycles))
    not_core = getattr(graph_code, "NOT_CORE", ("thdpack.vlm", "thdpack.offline", "thdpack.integrations", "thdpack.demo"))
    vlm = sorted((m, t) for m, targets in graph.items() if not m.startswith(not_core) and m != "thdpack.__init__"
                 for t in targets if t.startswith("thdpack.vlm"))
    print(f"{len(vlm)} core import(s) of thdpack.vlm" + "".join(f"\n  {m} -> {t}" for m, t in vlm))


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else HERE)
