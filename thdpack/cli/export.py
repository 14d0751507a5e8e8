"""``thdpack export``: a packed dataset in another trainer's format (Megatron-Bridge's packed Parquet,
:func:`thdpack.offline.commands.bridge_export.export_bridge`)."""

from __future__ import annotations

from pathlib import Path


def add_parser(sub) -> None:
    from thdpack.offline.commands.bridge_export import FORMAT, METADATA

    e = sub.add_parser(
        "export", help="convert a packed dataset for another trainer (Megatron-Bridge's packed Parquet)",
        description="Write the packs of a thdpack dataset in Megatron-Bridge's packed SFT format: *.idx.parquet "
        f"files (input_ids, loss_mask, seq_start_id) and {METADATA} (Bridge's metadata list); point "
        "packed_train_data_path at OUT and packed_metadata_path at OUT/" + METADATA + ". Written atomically.",
    )
    e.add_argument("path", help="packed dataset directory (thdpack build)")
    e.add_argument("output", metavar="OUT", help="output directory")
    e.add_argument("--to", required=True, choices=[FORMAT], help="target format")
    e.add_argument("--pad-seq-to-mult", type=int, default=None, metavar="M",
                   help="Bridge's pad_seq_to_mult (2*cp with context parallelism); default: the build's alignment "
                   "multiple")
    e.add_argument("--pad-id", type=int, default=None, metavar="ID",
                   help="token id of the pre-padding (Bridge's tokenizer EOS id), within the tokenizer's vocabulary; "
                   "default: the one the build recorded")
    e.add_argument("--overwrite", action="store_true", help="replace an earlier export at OUT")
    e.add_argument("--quiet", "-q", action="store_true", help="no summary line")
    e.set_defaults(func=run)


def run(args) -> int:
    from thdpack.offline.commands.bridge_export import METADATA, export_bridge

    record = export_bridge(args.path, args.output, pad_seq_to_mult=args.pad_seq_to_mult, pad_id=args.pad_id,
                           overwrite=args.overwrite)
    if not args.quiet:
        print(f"{args.output}: {sum(f['num_packs'] for f in record['files'])} packs in {len(record['files'])} "
              f"Megatron-Bridge file(s), pad_seq_to_mult {record['pad_seq_to_mult']}, efficiency "
              f"{record['packing_efficiency']:.2f}% of {record['pack_size']}; metadata {Path(args.output) / METADATA}")
    return 0
