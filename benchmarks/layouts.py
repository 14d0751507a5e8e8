"""Benchmark: the attention layouts of a pack (thdpack.attention), side by side with their consumers' own way.

    python benchmarks/layouts.py                                   # every section, a 32k-token pack
    python benchmarks/layouts.py --sections block_mask --no-compile
    python benchmarks/layouts.py --tokens 4096 --repeats 1 --no-compile --json out.json

One pack of ``--tokens`` tokens: ``numpy.random.default_rng(seed).lognormal(6, 1)`` lengths clipped
to [1, 4096] (the last cut to fit), built with ``build_thd_batch(..., pad_multiple=, pad_to=tokens)``.

Sections (``--sections``; :data:`SECTIONS` maps each name to a function ``(args, batch) -> rows``,
a row ``{"section", "case", "seconds", "ratio", "equal"}``; add a section by adding a function):

* ``ulysses``: ``shard(batch, sp_size=, sp_rank=)`` of one rank, the tail rank, all ranks, under ring CP and through
  the collator, each against building the pack (``ratio``: the shard's cost over the build's; the
  target: at most 1.2x), checked to be the padded stream (benchmarks/layouts_ulysses.py).
* ``block_mask``: the document-causal FlexAttention ``BlockMask``. thdpack's ``block_mask(batch)``
  (tiles from the offsets, ``BlockMask.from_kv_blocks``) against torchtitan's way: its
  ``get_causal_mask_mod`` and ``get_document_mask_mod(positions)`` (from ``batch.position_ids``) through
  torch's ``create_block_mask``, eager, and compiled as torchtitan's ``create_attention_mask`` runs it
  (``torch.compile(create_block_mask)``, timed after a warm-up call; ``--no-compile`` skips it: its
  first compile takes about a minute on a CPU). ``equal``: every table (kv and q, partial and full)
  equal to thdpack's. The target: thdpack at least 10x faster than each.

``seconds`` is the best of ``--repeats`` calls (a torchtitan eager call at 32k tokens takes tens of
seconds: it is called ``min(repeats, 2)`` times). ``ratio`` is seconds over thdpack's. Exits 1 when an
output differs from thdpack's.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import sys
import time
import types

import numpy as np
import torch

import thdpack
from thdpack import build_thd_batch
from thdpack.batching import block_mask

BLOCK_MASK_TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def make_pack(tokens: int, seed: int, pad_multiple: int) -> thdpack.ThdBatch:
    """One pack of exactly ``tokens`` slots: lognormal(6, 1) lengths in [1, 4096], the last cut to fit."""
    rng = np.random.default_rng(seed)
    lengths, room = [], tokens
    while room >= pad_multiple:
        n = min(int(np.clip(rng.lognormal(6.0, 1.0), 1, 4096)), room // pad_multiple * pad_multiple)
        lengths.append(n)
        room -= -(-n // pad_multiple) * pad_multiple
    samples = [{"input_ids": rng.integers(1, 32000, n)} for n in lengths]
    return build_thd_batch(samples, pad_multiple=pad_multiple, pad_to=tokens)


def best_time(fn, repeats: int):
    """``(best seconds, last result)`` of ``repeats`` calls."""
    best, out = math.inf, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def torchtitan_mask_mods():
    """torchtitan's ``get_causal_mask_mod`` / ``get_document_mask_mod``, imported without
    ``torchtitan.models.common``'s ``__init__`` (it pulls triton, which a CPU build of torch lacks;
    tests/torchtitan_env.py does the same); None when torchtitan is not installed."""
    try:
        import torchtitan
        import torchtitan.models
    except ImportError:
        return None
    if "torchtitan.models.common" not in sys.modules:
        package = types.ModuleType("torchtitan.models.common")
        package.__path__ = [str(pathlib.Path(torchtitan.__file__).parent / "models" / "common")]
        sys.modules["torchtitan.models.common"] = package
    from torchtitan.models.common.attention import get_causal_mask_mod, get_document_mask_mod

    return get_causal_mask_mod, get_document_mask_mod


def same_block_mask(a, b) -> bool:
    return a.shape == b.shape and a.BLOCK_SIZE == b.BLOCK_SIZE and all(
        torch.equal(getattr(a, name), getattr(b, name)) for name in BLOCK_MASK_TABLES)


def block_mask_section(args, batch) -> list[dict]:
    from torch.nn.attention.flex_attention import and_masks, create_block_mask

    mods = torchtitan_mask_mods()
    if mods is None:
        print("block_mask: torchtitan is not installed (pip install torchtitan --no-deps); section skipped")
        return []
    causal, document = mods
    T = batch.num_padded_tokens
    mask_mod = and_masks(causal(), document(batch.position_ids[None]))
    mine_s, mine = best_time(lambda: block_mask(batch, args.block_size), args.repeats)
    rows = [{"section": "block_mask", "case": "thdpack block_mask(batch)", "seconds": mine_s, "ratio": 1.0,
             "equal": True}]
    peers = [("torchtitan mask_mods, create_block_mask", create_block_mask, min(args.repeats, 2))]
    if not args.no_compile:
        compiled = torch.compile(create_block_mask)  # torchtitan's create_attention_mask
        compiled(mask_mod, 1, None, T, T, device="cpu", BLOCK_SIZE=args.block_size)  # compile once, untimed
        peers.append(("torchtitan create_attention_mask (compiled, warm)", compiled, args.repeats))
    for name, fn, repeats in peers:
        seconds, theirs = best_time(lambda: fn(mask_mod, 1, None, T, T, device="cpu", BLOCK_SIZE=args.block_size),
                                    repeats)
        rows.append({"section": "block_mask", "case": name, "seconds": seconds, "ratio": seconds / mine_s,
                     "equal": same_block_mask(mine, theirs)})
    return rows


def ulysses_section(args, batch) -> list[dict]:
    """benchmarks/layouts_ulysses.py's cases (its own pack of ``args.tokens`` tokens, one short so that the
    stream needs a tail): each shard's cost over the build's (``ratio``: shard / build)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from layouts_ulysses import SPEED_TARGET, bench_ulysses

    rows, same = bench_ulysses(argparse.Namespace(sp=args.sp, tokens=args.tokens, seed=args.seed,
                                                  repeats=max(args.repeats, 3), inner=args.inner))
    out = []
    for row in rows:
        ratio = 1.0 if row["vs"] is None else row["shard_vs_build"]
        case = row["case"] + ("" if row["vs"] is None else f" / {row['vs']}")
        if row["judged"]:
            case += f" (target <= {SPEED_TARGET}x)"
        out.append({"section": f"ulysses sp={args.sp}", "case": case, "seconds": row["us"] / 1e6, "ratio": ratio,
                    "equal": same})
    return out


SECTIONS = {"block_mask": block_mask_section, "ulysses": ulysses_section}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", nargs="+", choices=sorted(SECTIONS), default=list(SECTIONS),
                    help="sections to run (default: all)")
    ap.add_argument("--tokens", type=int, default=32768, help="stream length of the pack (default 32768)")
    ap.add_argument("--pad-multiple", type=int, default=8, help="alignment of every sample (default 8)")
    ap.add_argument("--block-size", type=int, default=128, help="BlockMask tile size (default 128)")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per case; the best is kept (default 5)")
    ap.add_argument("--no-compile", action="store_true", help="block_mask: skip the compiled create_block_mask")
    ap.add_argument("--sp", type=int, default=4, help="ulysses: the SP size (default 4)")
    ap.add_argument("--inner", type=int, default=20, help="ulysses: calls per timed pass (default 20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    batch = make_pack(args.tokens, args.seed, args.pad_multiple)
    print(f"thdpack {thdpack.__version__}, torch {torch.__version__}, python {platform.python_version()}, "
          f"{platform.machine()}, torch threads {torch.get_num_threads()}")
    print(f"one pack: {batch.num_padded_tokens} tokens, {batch.num_samples} samples (lognormal(6, 1) lengths, "
          f"max {batch.max_seqlen}), pad_multiple {args.pad_multiple}, seed {args.seed}, best of {args.repeats}\n")
    rows = [row for name in args.sections for row in SECTIONS[name](args, batch)]
    print(f"{'section':<13} {'case':<60} {'seconds':>10} {'ratio':>8} {'equal':>6}")
    for row in rows:
        print(f"{row['section']:<13} {row['case']:<60} {row['seconds']:>10.6f} {row['ratio']:>7.2f}x "
              f"{'yes' if row['equal'] else 'NO':>6}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
        print(f"\nwrote {args.json}")
    differ = [row["case"] for row in rows if not row["equal"]]
    if differ:
        print(f"\noutputs differ from thdpack's: {', '.join(differ)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
