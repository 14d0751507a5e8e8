"""``thdpack build``: read, tokenize, plan and write a packed dataset (:func:`thdpack.offline.build_packed`)."""

from __future__ import annotations

from thdpack.cli.config_flags import add_config_flags, build_config
from thdpack.cli.output import print_skipped, show_progress, written_line
from thdpack.offline.errors import OfflineError


def add_parser(sub) -> None:
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
    add_config_flags(b)
    b.set_defaults(func=run)


def run(args) -> int:
    from thdpack.offline.commands.build_packs import build_packed

    cfg = build_config(args)
    if not args.output:
        raise OfflineError("give the output directory: --output DIR")
    part, output = None, args.output
    if args.slice:  # one slice of the input rows (thdpack/offline/inputs/input_slice.py)
        from thdpack.offline.inputs.input_slice import parse_slice

        part = parse_slice(args.slice)
        output = part.format_output(args.output)
    result = build_packed(cfg, output, overwrite=args.overwrite, progress=show_progress(args), input_slice=part)
    print_skipped(result.metadata)
    if not args.quiet:
        print(written_line(result.path, result.summary))
    return 0
