"""The messages thdpack logs while a block runs (what ``build_packed(log=...)`` received in 0.1.0).

    from log_capture import thdpack_messages   # tests/ is on sys.path under pytest
    with thdpack_messages() as lines:
        build_packed(cfg, out, progress=False)
    assert any("through tiktoken" in line for line in lines)
"""

from __future__ import annotations

import logging
from contextlib import contextmanager


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]):
        super().__init__(logging.INFO)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def thdpack_messages():
    """Yields a list that receives the text of every INFO (or higher) message logged under
    ``"thdpack"`` inside the block; the logger's handlers and level are restored after it."""
    root = logging.getLogger("thdpack")
    lines: list[str] = []
    handler, level = _Lines(lines), root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
