"""No function in thdpack/ is longer than 80 lines (issue 20 point 5).

A function's length runs from its first decorator line (or its ``def`` line
when it has none) to its last line, docstring included, as the AST gives it.
Every ``def`` and ``async def`` counts: module-level functions, methods and
nested functions alike, numba kernels too (split one into ``@njit`` helpers
called from the kernel).
"""

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "thdpack"

MAX_FUNCTION_LINES = 80


def function_lengths(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, length in lines) of every function in ``source``, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            found.append((node.name, first, node.end_lineno - first + 1))
    return found


def too_long_functions(package_dir: Path = PACKAGE_DIR, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``file:line name (N lines)`` for every function under ``package_dir`` longer than ``limit``."""
    offenders = []
    for path in sorted(package_dir.rglob("*.py")):
        relative = path.relative_to(package_dir.parent)
        for name, line, length in function_lengths(path.read_text(encoding="utf-8")):
            if length > limit:
                offenders.append(f"{relative}:{line} {name} ({length} lines)")
    return offenders


def test_no_function_is_longer_than_80_lines():
    offenders = too_long_functions()
    assert not offenders, (
        f"functions longer than {MAX_FUNCTION_LINES} lines (decorators and docstring included); "
        "split each into named steps:\n  " + "\n  ".join(offenders))


def test_length_counts_decorators_docstring_methods_and_nested_functions():
    body = "\n".join(f"    x{i} = {i}" for i in range(77))
    source = (
        "@decorator\n"
        "@other(1)\n"
        "def top():\n"
        '    """Docstring."""\n'
        f"{body}\n"
        "class C:\n"
        "    async def method(self):\n"
        "        def inner():\n"
        "            return 1\n"
        "        return inner\n")
    lengths = {name: (line, length) for name, line, length in function_lengths(source)}
    assert lengths["top"] == (1, 81)
    assert lengths["method"] == (83, 4)
    assert lengths["inner"] == (84, 2)


def test_offender_names_file_line_and_length(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "sub" / "mod.py").write_text("x = 1\n\ndef long():\n" + "    y = 0\n" * 80)
    (package / "short.py").write_text("def short():\n    return 0\n")
    assert too_long_functions(package) == ["pkg/sub/mod.py:3 long (81 lines)"]
