"""``-100`` (no loss) is written once, as ``thdpack.common.samples.IGNORE_INDEX``, and imported elsewhere."""

import ast
from pathlib import Path

import thdpack.common.samples

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "thdpack"
OWNER = PACKAGE_DIR / "common" / "samples.py"


def _minus_100_literals(tree: ast.AST) -> list[int]:
    """Line numbers of every ``-100`` literal in code (docstrings and comments excluded)."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
            and isinstance(node.operand, ast.Constant) and node.operand.value == 100]


def _defines_ignore_index(tree: ast.AST) -> list[int]:
    """Line numbers of assignments to a name ``IGNORE_INDEX``."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Name) and target.id == "IGNORE_INDEX"]


def test_the_literal_is_written_once():
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        found += [f"{path.relative_to(PACKAGE_DIR.parent)}:{line}"
                  for line in _minus_100_literals(tree) + _defines_ignore_index(tree)]
    owner = str(OWNER.relative_to(PACKAGE_DIR.parent))
    assert len(found) == 2 and all(f.startswith(owner + ":") for f in found), (
        f"-100 / IGNORE_INDEX written outside {owner}: {found}; import thdpack.common.samples.IGNORE_INDEX instead")


def test_the_value():
    assert thdpack.common.samples.IGNORE_INDEX == -100
