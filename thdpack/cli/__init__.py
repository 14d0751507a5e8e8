"""The ``thdpack`` command: one module per subcommand.

::

    thdpack build --config configs/demo.yaml --output out/demo                 # cli/build.py
    thdpack build --config C.yaml --slice 3/8 --output out/parts/{slice}     # one input slice of 8 (or --slice auto)
    thdpack stats out/demo                                                   # cli/stats.py: a packed dataset
    thdpack stats data.jsonl --tokenizer DIR --pack-size 4096                # or raw data: plan without writing
    thdpack inspect out/demo --pack 0                                        # cli/inspect.py
    thdpack merge out/full out/parts/*                                       # cli/merge.py: combine the slices
    thdpack export out/demo --to megatron-bridge out/bridge                  # cli/export.py: Megatron-Bridge's Parquet
    thdpack check out/demo --model DIR                                       # cli/check_command.py: packing exact on a model

Every build option is a YAML key of ``--config`` and a flag that overrides it
(``pack_size`` / ``--pack-size``; cli/config_flags.py derives the flags from
:class:`~thdpack.offline.config.BuildConfig`). What the commands share on their way out
(logging, progress bars, the written line) is in cli/output.py. Nothing is downloaded: the
tokenizer is a local directory or a name already in the Hugging Face cache.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

from thdpack.cli import build, check_command, export, inspect, merge, stats
from thdpack.cli.config_flags import ThdpackParser
from thdpack.cli.output import cli_logging
from thdpack.offline.errors import OfflineError, read_error
from thdpack.offline.procs import Interrupted, signals_interrupt, signals_raise

COMMANDS = (build, stats, inspect, merge, export, check_command)  # in the order --help lists them


def _version() -> str:
    from thdpack.common.version import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = ThdpackParser(
        prog="thdpack", description="Compact THD packed training data: build, inspect and measure packed datasets, and "
        "check that packing is exact on a model."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--version", action="version", version=f"thdpack {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{build,stats,inspect,merge,export,check}")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` (default: the process's arguments); the exit status: 0, 1 where ``thdpack check``
    finds packing inexact, 2 for an error (one line), 130 / 143 after SIGINT / SIGTERM (one line saying what
    became of the output)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the network
    parser = build_parser()
    args = parser.parse_args(argv)
    listener = None
    try:
        # signals are recorded and stop the command at its checkpoints, which removes its temporary files
        with signals_interrupt() as listener, cli_logging(getattr(args, "quiet", False)):
            # a command that writes nothing has nothing to clean up: a signal may stop it anywhere
            with signals_raise() if not getattr(args, "writes", True) else contextlib.nullcontext():
                code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit flush
        return code
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except KeyboardInterrupt as exc:  # Interrupted (a signal), or Ctrl-C where signals_interrupt cannot listen
        outcome = (getattr(exc, "outcome", None) or getattr(listener, "outcome", None)
                   or getattr(args, "interrupted", None) or "nothing was written at the output path")
        # a plain KeyboardInterrupt is Python's own SIGINT handler's (a Ctrl-C before the listener was set)
        print(f"thdpack {args.command}: {exc if isinstance(exc, Interrupted) else 'interrupted by SIGINT'}; {outcome}",
              file=sys.stderr)
        return exc.exit_code if isinstance(exc, Interrupted) else 130
    except (OfflineError, ValueError, OSError) as exc:  # OSError: a file the command could not read or write
        if args.debug or os.environ.get("THDPACK_DEBUG"):
            raise
        if isinstance(exc, OSError) and not isinstance(exc, OfflineError) and exc.filename is not None:
            exc = read_error(exc)  # outside a staged output, every file a command opens is one it reads
        print(f"thdpack {args.command}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if argv is None:  # the process's own command: a signal from here on ends it as that signal does
            for s in (signal.SIGINT, signal.SIGTERM):
                signal.signal(s, signal.SIG_DFL)


def _quiet_broken_pipe() -> int:
    """The reader of stdout went away (``thdpack stats ... | head -1``): stop quietly, as Unix tools
    do, with the status of a process ended by SIGPIPE (128 + 13)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # the interpreter's exit flush must not raise again
    os.close(devnull)
    return 128 + signal.SIGPIPE
