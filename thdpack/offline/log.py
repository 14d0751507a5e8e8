"""Messages of the offline commands: one ``logging`` tree under ``"thdpack"``.

Every offline module logs its stage lines at INFO through ``logging.getLogger(__name__)``
(``thdpack.offline.pipeline``, ``thdpack.offline.merging``, ...). The ``thdpack`` command prints
them on stderr, message text only (:func:`cli_logging`); a Python caller sees them only once
it configures logging (``logging.basicConfig(level=logging.INFO)``), as with any library.

The ``log=`` callback that :func:`~thdpack.offline.pipeline.build_packed` and
:func:`~thdpack.offline.merging.merge_slices` took before still works for one release
(:func:`deprecated_log`): it warns, and receives the messages of that call.
"""

from __future__ import annotations

import logging
import sys
import warnings
from contextlib import contextmanager, nullcontext

ROOT = "thdpack"
UNSET = object()  # the default of a deprecated ``log=`` parameter: not given


class _Callback(logging.Handler):
    """Hands each record's message to a ``log(msg)`` callback."""

    def __init__(self, log):
        super().__init__(logging.INFO)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        self.log(record.getMessage())


@contextmanager
def _forward(log):
    """While the block runs, the ``thdpack`` INFO messages also go to ``log(msg)``."""
    root = logging.getLogger(ROOT)
    handler, level = _Callback(log), root.level
    root.addHandler(handler)
    if root.getEffectiveLevel() > logging.INFO:
        root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def deprecated_log(log, where: str):
    """The context a call of ``where`` with the deprecated ``log=`` parameter runs in: nothing
    when ``log`` was not given; else a DeprecationWarning, and ``log`` (a callable) receives the
    messages of the call (``None``: no callback, as before)."""
    if log is UNSET:
        return nullcontext()
    warnings.warn(f"{where}(log=...) is deprecated and will be removed in the next release: thdpack logs its "
                  f"messages through logging.getLogger({ROOT!r})", DeprecationWarning, stacklevel=3)
    return nullcontext() if log is None else _forward(log)
