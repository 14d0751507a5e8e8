"""``thdpack merge``: the input slices of ``thdpack build --slice I/N`` as one packed dataset
(:func:`thdpack.offline.commands.slice_merge.merge_slices`)."""

from __future__ import annotations

from thdpack.cli.output import written_line


def add_parser(sub) -> None:
    m = sub.add_parser(
        "merge",
        help="combine the outputs of thdpack build --slice I/N into one packed dataset",
        description="Check that the slice builds belong together (same options and input, every index 0..N-1 "
        "once), then write one packed dataset: the slices' packs in slice order, metadata recomputed. "
        "Written atomically, like build.",
    )
    m.add_argument("output", help="merged dataset directory (written atomically)")
    m.add_argument("slices", nargs="+", metavar="SLICE",
                   help="slice directories, a glob such as 'out/parts/*', or their parent directory")
    m.add_argument("--overwrite", action="store_true", help="replace an existing packed dataset at OUTPUT")
    m.add_argument("--link", action="store_true",
                   help="hard-link the data files instead of copying them (same file system; checksums still checked)")
    m.add_argument("--quiet", "-q", action="store_true", help="no summary")
    m.set_defaults(func=run)


def run(args) -> int:
    from thdpack.offline.commands.slice_merge import merge_slices

    result = merge_slices(args.slices, args.output, overwrite=args.overwrite, link=args.link)
    if not args.quiet:
        print(written_line(result.path, result.summary))
    return 0
