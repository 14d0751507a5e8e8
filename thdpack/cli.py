"""The ``thdpack`` command: ``build``, ``stats`` and ``inspect``.

::

    thdpack build --config configs/demo.yaml --output out/demo
    thdpack stats out/demo                       # a packed dataset
    thdpack stats data.jsonl --tokenizer DIR --pack-size 4096   # or raw data: plan without writing
    thdpack inspect out/demo --pack 0
    thdpack build --config C.yaml --slice 3/8 --output out/parts/{slice}   # one input slice of 8 (or --slice auto)
    thdpack merge out/full out/parts/*           # combine the slices (thdpack/offline/merge.py)
    thdpack export out/demo --to megatron-bridge out/bridge   # Megatron-Bridge's packed Parquet (offline/bridge.py)

Every build option is a YAML key of ``--config`` and a flag that overrides it
(``pack_size`` / ``--pack-size``). Nothing is downloaded: the tokenizer is a local
directory or a name already in the Hugging Face cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import warnings
from pathlib import Path

from thdpack.offline.config import RENAMED, BuildConfig
from thdpack.offline.errors import OfflineError
from thdpack.offline.log import cli_logging
from thdpack.offline.procs import Interrupted, signals_interrupt
from thdpack.samples import IGNORE_INDEX

_STATS_ALIGN_FLAGS = ("cp_size", "tp_size", "sequence_parallel", "pad_multiple")


def _add_config_flags(p: argparse.ArgumentParser, only: tuple[str, ...] | None = None, skip=()) -> None:
    """One flag per :class:`BuildConfig` field; default None = "not given" (the config's value stays)."""
    g = p.add_argument_group("build options (override the --config file)")
    for f in dataclasses.fields(BuildConfig):
        if f.metadata.get("internal") or f.name in skip or (only and f.name not in only):
            continue
        flag = "--" + f.name.replace("_", "-")
        kw = dict(default=None, help=_literal_help(f.metadata.get("help")), dest=f.name)
        if f.metadata.get("choices"):
            kw["choices"] = f.metadata["choices"]
        if f.name == "input":
            kw["nargs"] = "+"
            kw["metavar"] = "PATH"
        if isinstance(f.default, bool):
            g.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        if f.metadata.get("type") is float:
            kw["type"] = float
            kw["metavar"] = "X"
        elif f.type in ("int", "int | None") or isinstance(f.default, int):
            kw["type"] = int
            kw["metavar"] = "N"
        g.add_argument(flag, **kw)
    for old, new in RENAMED.items():  # the old flag names, still accepted
        if not (new in skip or (only and new not in only)):
            g.add_argument("--" + old.replace("_", "-"), action=_Deprecated, dest=new, type=float, help=argparse.SUPPRESS)


class _Deprecated(argparse.Action):
    """A flag's old name (``--shard``, ``--shard-size-mb``): stores under the new one's ``dest``, with a FutureWarning."""

    def __call__(self, parser, namespace, values, option_string=None):
        warnings.warn(f"{option_string} is deprecated, use --{self.dest.replace('_', '-')}", FutureWarning, stacklevel=2)
        setattr(namespace, self.dest, values)


def _literal_help(text: str | None) -> str | None:
    """``text`` as argparse help: argparse %-formats help strings, so a literal ``%``
    (``{% generation %}`` in the chat_template help) must be doubled."""
    return None if text is None else text.replace("%", "%%")


def _config(args, *, input_override=None) -> BuildConfig:
    cfg = BuildConfig.from_yaml(args.config) if args.config else BuildConfig()
    changes = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(BuildConfig) if not f.metadata.get("internal")}
    if input_override is not None:
        changes["input"] = input_override
    return cfg.override(**changes)


# ---------------------------------------------------------------------------- commands


def _progress(args) -> bool:
    """Progress bars only on a terminal: in a log file their ``\\r`` redraws run together into one line
    (the stage lines still print)."""
    return not args.quiet and sys.stderr.isatty()


def cmd_build(args) -> int:
    from thdpack.offline.build import build_packed, written_line

    cfg = _config(args)
    if not args.output:
        raise OfflineError("give the output directory: --output DIR")
    part, output = None, args.output
    if args.slice:  # one slice of the input rows (thdpack/offline/input_slice.py)
        from thdpack.offline.input_slice import parse_slice

        part = parse_slice(args.slice)
        output = part.format_output(args.output)
    result = build_packed(cfg, output, overwrite=args.overwrite, progress=_progress(args), input_slice=part)
    meta = result.metadata
    skipped = meta["counts"]["skipped_rows"]
    if skipped:
        print(f"skipped {skipped} bad row(s):", file=sys.stderr)
        for e in meta["skipped_examples"][:10]:
            print(f"  {e['where']}: {e['error']}", file=sys.stderr)
        if skipped > 10:
            print(f"  ... ({skipped - 10} more; the first {len(meta['skipped_examples'])} are in metadata.json)", file=sys.stderr)
    if not args.quiet:
        print(written_line(result.path, result.summary))
    return 0


def cmd_stats(args) -> int:
    from thdpack.offline.stats import BUILD_COUNTS, format_summary, plot_summary, summarize

    path = Path(args.path)
    eval_multiple = None
    if any(getattr(args, k) is not None for k in _STATS_ALIGN_FLAGS):
        from thdpack.align import resolve_pad_multiple

        eval_multiple = resolve_pad_multiple(
            args.cp_size or 1, args.tp_size or 1, bool(args.sequence_parallel), args.pad_multiple
        )
    if path.is_dir() and (path / "metadata.json").exists():
        from thdpack.offline.dataset import load_packed

        ds = load_packed(path, verify=args.verify)
        meta = ds.metadata
        seq_lens, offsets = ds.all_seq_lens()
        stored = meta.get("stats", {})
        counts = {k: stored[k] for k in BUILD_COUNTS if k in stored}
        from thdpack.offline.model_config import packed_model_config

        summary = summarize(seq_lens, offsets, meta["pack_size"], meta["align"], eval_multiple=eval_multiple, counts=counts,
                            **packed_model_config(ds, args.model_config))
        if "lengths" in stored:  # the input-length histogram recorded at build time
            summary["lengths"] = stored["lengths"]
        title = (f"{path}: packed dataset, {len(ds)} packs in {len(meta['files'])} {meta['file_format']} data file(s); "
                 f"source {', '.join(f['path'] for f in meta['source']['files'])} ({meta['source']['format']})")
    else:
        from thdpack.offline.build import analyze

        if not path.exists() and not args.config:
            raise OfflineError(f"{path} does not exist")
        cfg = _config(args, input_override=str(path) if str(path) != "-" else None)
        summary = analyze(cfg, eval_multiple=eval_multiple, progress=_progress(args))
        title = f"{path}: raw dataset, planned (not written) with pack_size {cfg.pack_size}, {cfg.algorithm}"
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary, title=title))
    if args.plot:
        plot_summary(summary, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def cmd_inspect(args) -> int:
    from thdpack.offline.dataset import load_packed

    ds = load_packed(args.path)
    n = len(ds)
    if not -n <= args.pack < n:
        raise OfflineError(f"--pack {args.pack} is out of range: the dataset has {n} packs (0..{n - 1})")
    row = ds[args.pack]
    samples = ds.samples(args.pack)
    meta = ds.metadata
    decode = None if args.ids else _decoder(args.tokenizer or ds.tokenizer_path, meta)
    total = int(row["input_ids"].size)
    print(f"pack {args.pack % n} of {n}: {len(samples)} samples, {total} tokens "
          f"(fill {total / meta['pack_size']:.3f} of {meta['pack_size']}), targets: {meta['targets']}")
    if decode is not None:
        print("target tokens (trained on) are shown between « and »")
    for j, s in enumerate(samples):
        ids = s["input_ids"]
        is_t = s["loss_mask"] if "loss_mask" in s else s["labels"] != IGNORE_INDEX
        is_t = is_t.astype(bool).copy()
        is_t[0] = False  # a sample's first token is never a target
        start = int(row["sample_start"][j])
        print(f"\n── sample {j}: input row {int(row['sample_index'][j])}"
              + (f", tokens {start}..{start + ids.size}" if start else "")
              + f", {ids.size} tokens, {int(is_t.sum())} targets ──")
        shown = ids if args.max_tokens is None else ids[: args.max_tokens]
        if decode is None:
            marks = ["*" if t else "" for t in is_t[: shown.size]]
            print(" ".join(f"{int(i)}{m}" for i, m in zip(shown, marks)) + ("  (* = target)" if is_t.any() else ""))
        else:
            print(_decode_marked(decode, shown, is_t[: shown.size]))
        if shown.size < ids.size:
            print(f"... ({ids.size - shown.size} more tokens)")
    return 0


def _decoder(tokenizer, meta):
    if tokenizer is None:
        name = (meta.get("tokenizer") or {}).get("name_or_path")
        if not name:
            return None
        tokenizer = name
    path = Path(tokenizer)
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        return lambda ids: tok.decode([int(i) for i in ids], skip_special_tokens=False)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    except Exception:  # noqa: BLE001 - fall back to ids
        print(f"note: tokenizer {tokenizer} not available offline; showing token ids", file=sys.stderr)
        return None
    return lambda ids: tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _decode_marked(decode, ids, is_target) -> str:
    """Decode runs of target / non-target tokens, wrapping target runs in « »."""
    import numpy as np

    out, a = [], 0
    change = np.flatnonzero(np.diff(is_target.astype(np.int8))) + 1
    for b in list(change) + [ids.size]:
        text = decode(ids[a:b])
        out.append(f"«{text}»" if is_target[a] else text)
        a = b
    return "".join(out)


# ---------------------------------------------------------------------------- parser


def _version() -> str:
    from thdpack import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="thdpack", description="Compact THD packed training data: build, inspect and measure packed datasets."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--version", action="version", version=f"thdpack {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{build,stats,inspect,merge,export}")

    b = sub.add_parser(
        "build",
        help="read, tokenize, pack and write a packed dataset",
        description="Read a dataset, tokenize it, plan packs and write them (Arrow/Parquet data files + metadata.json), atomically.",
    )
    b.add_argument("--config", help="YAML file of build options (see configs/)")
    b.add_argument("--output", "-o", help="output directory (written atomically)")
    b.add_argument("--overwrite", action="store_true", help="replace an existing packed dataset at --output")
    b.add_argument("--quiet", "-q", action="store_true", help="no progress bars, stage lines or summary (errors and skipped rows still print)")
    b.add_argument("--slice", metavar="I/N|auto",
                   help="build only input slice I of N (contiguous input rows; merge the slices with thdpack merge); "
                   "auto: from torchrun's RANK/WORLD_SIZE or a Slurm array. --output may contain {slice}")
    b.add_argument("--shard", action=_Deprecated, dest="slice", help=argparse.SUPPRESS)  # the old name of --slice
    _add_config_flags(b)
    b.set_defaults(func=cmd_build)

    s = sub.add_parser(
        "stats",
        help="statistics of a packed dataset, or of planning a raw one",
        description="Length histogram, packs, lower bound, efficiency, pad fraction at a CP/TP alignment, "
        "truncated/dropped tokens and the attention-FLOPs over-count of counting packs as single sequences "
        "(and the whole-model one with --model-config; a packed dataset uses the copy saved with it). "
        "PATH is a packed dataset, or raw input (then give --tokenizer/--pack-size or a --config).",
    )
    s.add_argument("path", help="packed dataset directory, or raw input file/directory")
    s.add_argument("--config", help="YAML build options (for raw input)")
    s.add_argument("--plot", metavar="PNG", help="draw the length histogram and pack fill (needs matplotlib)")
    s.add_argument("--json", action="store_true", help="print the statistics as JSON")
    s.add_argument("--verify", action="store_true", help="packed dataset: check data file checksums")
    s.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    _add_config_flags(s, skip=("input",))
    s.set_defaults(func=cmd_stats)

    i = sub.add_parser("inspect", help="show one pack decoded, sample by sample",
                       description="Show one pack of a packed dataset decoded, sample by sample, targets marked.")
    i.add_argument("path", help="packed dataset directory")
    i.add_argument("--pack", type=int, default=0, help="pack number (negative counts from the end)")
    i.add_argument("--tokenizer", help="tokenizer to decode with (default: the copy saved with the dataset)")
    i.add_argument("--max-tokens", type=int, default=None, metavar="N", help="show at most N tokens per sample")
    i.add_argument("--ids", action="store_true", help="show token ids instead of text")
    i.set_defaults(func=cmd_inspect)

    from thdpack.offline.merge import add_merge_parser

    add_merge_parser(sub)  # thdpack merge OUT SLICE...
    from thdpack.offline.bridge import add_export_parser

    add_export_parser(sub)  # thdpack export PATH --to megatron-bridge OUT
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the network
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with signals_interrupt(), cli_logging(getattr(args, "quiet", False)):  # signals unwind the command, which removes its temporary files
            code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit flush
        return code
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except KeyboardInterrupt as exc:  # Interrupted (a signal), or Ctrl-C where signals_interrupt cannot listen
        outcome = getattr(exc, "outcome", None) or "nothing was written at the output path"
        print(f"thdpack {args.command}: {exc if isinstance(exc, Interrupted) else 'interrupted'}; {outcome}",
              file=sys.stderr)
        return exc.exit_code if isinstance(exc, Interrupted) else 130
    except (OfflineError, ValueError, OSError) as exc:  # OSError: a file the command could not read or write
        if args.debug or os.environ.get("THDPACK_DEBUG"):
            raise
        print(f"thdpack {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _quiet_broken_pipe() -> int:
    """The reader of stdout went away (``thdpack stats ... | head -1``): stop quietly, as Unix tools
    do, with the status of a process ended by SIGPIPE (128 + 13)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # the interpreter's exit flush must not raise again
    os.close(devnull)
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
