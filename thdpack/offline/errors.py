"""Errors of the offline pipeline. The command line prints them without a traceback."""

from __future__ import annotations

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
