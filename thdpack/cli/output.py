"""What every ``thdpack`` subcommand shares on its way out: logging, progress bars, the written line."""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from pathlib import Path

from thdpack.offline.errors import MAX_ERRORS_LISTED

ROOT_LOGGER = "thdpack"


@contextmanager
def cli_logging(quiet: bool):
    """The ``thdpack`` command's logging: each message's text alone on stderr, INFO unless ``quiet``
    (then warnings and errors only). Undone when the command returns.

    Every offline module logs its stage lines at INFO through ``logging.getLogger(__name__)``; a
    Python caller sees them only once it configures logging, as with any library."""
    root = logging.getLogger(ROOT_LOGGER)
    handler, level = logging.StreamHandler(sys.stderr), root.level
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.WARNING if quiet else logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def show_progress(args) -> bool:
    """Progress bars only on a terminal: in a log file their ``\\r`` redraws run together into one line
    (the stage lines still print)."""
    return not args.quiet and sys.stderr.isatty()


def written_line(path: Path, summary: dict) -> str:
    """The one line ``thdpack build`` and ``thdpack merge`` print on stdout: what was written and where
    the statistics are (``thdpack stats PATH`` prints them; printing them here as well showed the
    same block twice in ``build && stats``)."""
    return (f"{path}: {summary['packs']} packs, efficiency {summary['efficiency']:.4f}; "
            f"statistics: thdpack stats {path}")


def print_skipped(meta: dict) -> None:
    """The bad rows a build skipped, on stderr: the count and the first :data:`MAX_ERRORS_LISTED`."""
    skipped = meta["counts"]["skipped_rows"]
    if not skipped:
        return
    print(f"skipped {skipped} bad row(s):", file=sys.stderr)
    for e in meta["skipped_examples"][:MAX_ERRORS_LISTED]:
        print(f"  {e['where']}: {e['error']}", file=sys.stderr)
    if skipped > MAX_ERRORS_LISTED:
        print(f"  ... ({skipped - MAX_ERRORS_LISTED} more; the first {len(meta['skipped_examples'])} are in "
              "metadata.json)", file=sys.stderr)
