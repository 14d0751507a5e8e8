"""Errors of the offline pipeline. The command line prints them without a traceback."""

from __future__ import annotations

import errno
import os

# How many bad rows each place names: the one table of these limits (build, merge and the CLI read them).
MAX_ERRORS_RECORDED = 20  # metadata.json's skipped_examples (a merge keeps the first 20 of its slices')
MAX_ERRORS_LISTED = 10  # thdpack build's stderr, one line each
MAX_ERRORS_INLINE = 5  # inside a one-line error message ("... and 9 more")


class OfflineError(ValueError):
    """Base class: a problem the user can fix (bad input, bad config, existing output)."""


class ConfigError(OfflineError):
    """An invalid build configuration (unknown key, wrong type, impossible combination)."""


class InputError(OfflineError):
    """Bad input data; the message names the file and line (JSON Lines) or row."""


class OutputExistsError(OfflineError, FileExistsError):
    """The output directory exists and ``overwrite`` was not given."""


class OutputError(OfflineError):
    """The output cannot be written: another process is writing it, or the file system refused
    (read-only, permission, full disk); the message names the path."""


class ReadError(OfflineError):
    """A file or directory the command must read cannot be read (permission, I/O error); the
    message names the path (:func:`read_error`)."""


_READ_HINTS = {
    errno.EACCES: "no permission to read it: fix its permissions (chmod u+r, and u+x on its directories) or run as its owner",
    errno.EPERM: "no permission to read it: fix its permissions (chmod u+r, and u+x on its directories) or run as its owner",
    errno.ENOENT: "it does not exist: check the path",
    errno.ENOTDIR: "a part of the path is a file, not a directory: check the path",
    errno.EISDIR: "it is a directory, not a file: check the path",
    errno.EIO: "the disk reported an I/O error: copy it again from a good source",
}


def read_error(exc: OSError, path=None) -> ReadError:
    """One line for a failure to read ``path`` (default: the file ``exc`` names): the path, the
    reason and what to do."""
    path = path if path is not None else exc.filename
    reason = os.strerror(exc.errno) if exc.errno else " ".join(str(exc).split()) or type(exc).__name__
    hint = _READ_HINTS.get(exc.errno, "check the path and its permissions")
    return ReadError(f"cannot read {os.fsdecode(path) if path is not None else 'a file'}: {reason}; {hint}")


class NotPackedError(OfflineError):
    """A path that is not a complete packed dataset (missing or partial metadata/data files)."""


def require_hf(what: str):
    """Import and return ``(datasets, transformers)``; a clear message if the ``hf`` extra is missing."""
    missing = []
    try:
        import datasets
    except ImportError:
        missing.append("datasets")
        datasets = None
    try:
        import transformers
    except ImportError:
        missing.append("transformers")
        transformers = None
    if missing:
        raise OfflineError(
            f"{what} needs {' and '.join(missing)} (the 'hf' extra): pip install 'thdpack[hf]'"
        )
    return datasets, transformers


def require_pyarrow(what: str):
    """Import and return ``pyarrow``; a clear message if it is missing."""
    try:
        import pyarrow
    except ImportError:
        raise OfflineError(f"{what} needs pyarrow: pip install pyarrow (or 'thdpack[hf]')") from None
    return pyarrow
