"""``thdpack stats``: statistics of a packed dataset, or of planning a raw one without writing it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from thdpack.cli.config_flags import add_config_flags, build_config
from thdpack.cli.output import show_progress
from thdpack.offline.errors import NotPackedError, OfflineError

ALIGN_FLAGS = ("cp_size", "tp_size", "sequence_parallel", "pad_multiple")  # given: the pad fraction at that alignment


def add_parser(sub) -> None:
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
    add_config_flags(s, skip=("input",))
    s.set_defaults(func=run, writes=False)


def run(args) -> int:
    from thdpack.offline.commands.pack_stats import BUILD_COUNTS, format_summary, plot_summary, summarize

    path = Path(args.path)
    eval_multiple = None
    if any(getattr(args, k) is not None for k in ALIGN_FLAGS):
        from thdpack.common.align import resolve_pad_multiple

        eval_multiple = resolve_pad_multiple(
            args.cp_size or 1, args.tp_size or 1, bool(args.sequence_parallel), args.pad_multiple
        )
    if path.is_dir() and (path / "metadata.json").exists():
        from thdpack.offline.store.dataset import load_packed

        ds = load_packed(path, verify=args.verify)
        meta = ds.metadata
        seq_lens, offsets = ds.all_seq_lens(stream=True)  # a share_prefix build: each prefix once
        stored = meta.get("stats", {})
        counts = {k: stored[k] for k in BUILD_COUNTS if k in stored}
        from thdpack.offline.commands.model_record import packed_model_config

        summary = summarize(seq_lens, offsets, meta["pack_size"], meta["align"], eval_multiple=eval_multiple, counts=counts,
                            **packed_model_config(ds, args.model_config))
        if "lengths" in stored:  # the input-length histogram recorded at build time
            summary["lengths"] = stored["lengths"]
        if "mixture" in meta:  # the per-source counts of a mixture build
            summary["mixture"] = meta["mixture"]
        title = (f"{path}: packed dataset, {len(ds)} packs in {len(meta['files'])} {meta['file_format']} data file(s); "
                 f"source {', '.join(f['path'] for f in meta['source']['files'])} ({meta['source']['format']})")
    else:
        from thdpack.offline.commands.build_packs import analyze
        from thdpack.offline.store.schema import looks_packed

        if not path.exists() and not args.config:
            raise OfflineError(f"{path} does not exist")
        if looks_packed(path):
            raise NotPackedError(
                f"{path} is not a packed dataset: it holds data files of one but no metadata.json (its build did not "
                f"complete, or the file was removed); rebuild it (thdpack build ... --output {path}, after removing "
                "the directory), or plan raw input: thdpack stats DATA.jsonl --tokenizer DIR --pack-size N"
            )
        cfg = build_config(args, input_override=str(path) if str(path) != "-" else None)
        summary = analyze(cfg, eval_multiple=eval_multiple, progress=show_progress(args))
        title = f"{path}: raw dataset, planned (not written) with pack_size {cfg.planning.pack_size}, {cfg.planning.algorithm}"
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary, title=title))
    if args.plot:
        plot_summary(summary, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
