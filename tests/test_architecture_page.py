"""docs/architecture.md and README's Layout stay in step with the code (issue 30 point 4): the page's layer
table is the import test's ``LAYERS``, every module under ``thdpack/`` appears on the page, and README's
Layout names every folder of the package."""

import re
from pathlib import Path

from test_import_graph import LAYERS

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "architecture.md").read_text()
README = (ROOT / "README.md").read_text()


def test_layer_table_is_the_import_tests_layers():
    rows = re.findall(r"^\| ([^|]+?) \| `thdpack/", PAGE, flags=re.M)
    assert rows == [name for name, _ in LAYERS]


def test_every_module_is_on_the_page():
    missing = []
    for path in sorted((ROOT / "thdpack").rglob("*.py")):
        if path.name == "__init__.py":
            continue
        rel = path.relative_to(ROOT / "thdpack").as_posix()
        if rel not in PAGE and path.name not in PAGE:
            missing.append(rel)
    assert not missing, f"modules missing from docs/architecture.md: {missing}"


def test_readme_layout_names_every_folder():
    layout = README.split("## Layout", 1)[1].split("\n## ", 1)[0]
    folders = sorted({p.parent.relative_to(ROOT / "thdpack").as_posix() for p in (ROOT / "thdpack").rglob("*.py")} - {"."})
    missing = [f for f in folders if f"{f.split('/')[-1]}/" not in layout]
    assert not missing, f"folders missing from README's Layout: {missing}"
