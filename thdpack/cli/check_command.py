"""``thdpack check``: a model run on packs of your data and on each of their samples alone, compared layer by
layer (:mod:`thdpack.check`); exit status 0 when every check holds, 1 when one does not (the first failure is
the last line), 2 for an error."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from thdpack.cli.config_flags import add_config_flags, build_config, integer_at_least
from thdpack.cli.output import show_progress
from thdpack.offline.config import options
from thdpack.offline.errors import ConfigError, NotPackedError, OfflineError

logger = logging.getLogger(__name__)

# build options that say where and how a build writes, not which packs it plans: no flags here
NOT_PLANNING = ("input", "seed", "shuffle_packs", "output_format", "file_size_mb", "save_tokenizer", "engine",
                *(o.name for o in options() if o.section == "ray"))


def add_parser(sub) -> None:
    c = sub.add_parser(
        "check",
        help="prove packing exact on your model and data, layer by layer",
        description="Run a model on packs of your data and on each of their samples alone, and compare every "
        "decoder layer, sequence mixer (attention, linear attention, SSM, convolution), the logits, the loss "
        "and (--grad) the gradients. Prints a table whose last line is OK or the first failure: the first "
        "module where a sample differs and what it reads to keep samples apart. Exit status 0: every check "
        "holds; 1: one does not; 2: an error. PATH is a packed build (its packs as built) or raw input "
        "(a JSON Lines file of input_ids and labels or loss_mask, planned with --pack-size), or give --config. "
        "Nothing is downloaded. docs/check.md.",
    )
    c.add_argument("path", nargs="?", help="packed build directory, or raw input (planned, nothing written)")
    c.add_argument("--model", required=True, metavar="DIR",
                   help="a local Hugging Face model directory (its saved weights), or a config.json / a directory "
                   "without weights (random weights)")
    c.add_argument("--config", help="YAML build config: its packs planned on the fly, as thdpack build plans them")
    c.add_argument("--random-weights", action="store_true", default=None,
                   help="random weights from the model's config even where weights are saved (the default "
                   "without them); seeded with --seed")
    c.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    c.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    c.add_argument("--attn", metavar="NAME", help="attention implementation: any transformers knows (sdpa, eager, "
                   "flex_attention, flash_attention_2, ...) or thdpack_varlen; default: the model config's")
    c.add_argument("--packs", type=integer_at_least(1), default=3, metavar="N", help="packs to check (default 3)")
    c.add_argument("--seed", type=int, default=0,
                   help="seeds which packs are drawn and the random weights (default 0)")
    c.add_argument("--grad", action="store_true", help="compare every parameter's gradient too")
    c.add_argument("--no-flops", action="store_true", help="skip the FLOPs count of each pack's step")
    c.add_argument("--tolerance", type=float, metavar="X",
                   help="max |packed - alone| / max |alone| per tensor (default by dtype: docs/check.md)")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.add_argument("--quiet", "-q", action="store_true", help="no progress bars or stage lines")
    add_config_flags(c, skip=NOT_PLANNING)
    c.set_defaults(func=run, writes=False, interrupted="the check stopped before its report")


def run(args) -> int:
    from thdpack.check.dataset_check import check_packs
    from thdpack.check.model_loading import load_model
    from thdpack.check.pack_sources import read_packs

    data = _data(args)
    loaded = load_model(args.model, random_weights=args.random_weights, dtype=args.dtype, device=args.device,
                        attn=args.attn, seed=args.seed)
    logger.info(f"model     {loaded.source}")
    chosen = read_packs(data, count=args.packs, seed=args.seed, progress=show_progress(args))
    logger.info(f"data      {chosen.description}; checking {len(chosen.packs)}: "
                f"{', '.join(str(p.index) for p in chosen.packs)}")
    report = check_packs(loaded.model, chosen, grad=args.grad, flops=not args.no_flops, tolerance=args.tolerance,
                         progress=show_progress(args), on_pack=_log_pack)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        if not report.ok:
            print(f"FAIL: {report.first_failure()}", file=sys.stderr)
    else:
        print(report.table())
    return 0 if report.ok else 1


def _data(args):
    """What to read packs from: a packed build's directory as it is, else the build config of ``--config`` and
    the flags (raw ``path`` as its input); ``OfflineError`` for a build given build options, or no data."""
    given = [f"--{o.name.replace('_', '-')}" for o in options()
             if o.name not in NOT_PLANNING and getattr(args, o.name, None) is not None]
    path = Path(args.path) if args.path else None
    if path is not None and path.is_dir() and (path / "metadata.json").is_file():
        if args.config or given:
            raise ConfigError(f"{path} is a packed build: its packs are checked as built, with the layout it "
                              f"recorded; {args.config and '--config' or ' '.join(given)} applies to raw input")
        return path
    if path is None and not args.config:
        raise ConfigError("give the data: a packed build directory, a raw input file (a JSON Lines file of "
                          "input_ids; --pack-size N) or --config FILE.yaml")
    if path is not None and not path.exists():
        raise OfflineError(f"{path} does not exist")
    from thdpack.offline.store.schema import looks_packed

    if path is not None and looks_packed(path):
        raise NotPackedError(f"{path} holds a packed build's data files but no metadata.json: its build did not "
                             "complete; rebuild it")
    return build_config(args, input_override=str(path) if path is not None else None)


def _log_pack(pack) -> None:
    tokens = sum(s.length for s in pack.samples)
    logger.info(f"pack {pack.pack:<5} {len(pack.samples)} sample{'s' if len(pack.samples) != 1 else ''}, {tokens} tokens: "
                f"{'ok' if pack.ok else 'FAIL'}")
