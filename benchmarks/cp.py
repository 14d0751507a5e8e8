"""Benchmark: the cost of context-parallel (CP) building and sharding, and the padding CP adds.

    python benchmarks/cp.py                  # 2000 packs of 8 samples, cp=8
    python benchmarks/cp.py --packs 500      # quicker
    python benchmarks/cp.py --json out.json

Part 1, time per pack (best of ``--repeats`` passes over all packs, cases timed
round-robin after a warm-up):

* ``build``                 ``build_thd_batch(samples)`` (no CP)
* ``build cp``              ``build_thd_batch(samples, cp_size=cp)``
* ``build cp + shard 1``    the same, then ``thdpack.shard(batch, cp_size=cp, cp_rank=0)`` (sharding a
                            whole batch that already exists)
* ``build cp, cp_rank``     ``build_thd_batch(pack, cp_size=cp, cp_rank=0)``: the rank's
                            shard assembled directly (what ``ThdCollator(cp_rank=...)`` does)
* ``build cp + shard all``  the same, then all ``cp`` shards

each with samples given as numpy arrays and as Python lists. The ratio column is
against ``build`` with the same sample type; the target for one rank is <= 1.3x.

Part 2, padding: over ``--pad-samples`` samples, the fraction of stream slots that
are alignment padding when each sample is padded to ``thdpack.cp_pad_multiple``
(cp in 2, 4, 8; tp=1 and tp=2/4 with sequence parallel), next to padding to
``lcm(16, multiple)`` (16 is a common default alignment; the lcm keeps it CP-valid).

Lengths: ``numpy.random.default_rng(seed).lognormal(6, 1)`` clipped to [1, 4096].
Measures and prints only; no assertions.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time

import numpy as np
import torch

import thdpack
from thdpack import build_thd_batch, cp_pad_multiple


def make_lengths(n: int, rng: np.random.Generator) -> np.ndarray:
    return np.clip(rng.lognormal(mean=6.0, sigma=1.0, size=n), 1, 4096).astype(np.int64)


def make_packs(num_packs: int, per_pack: int, seed: int, as_lists: bool) -> list[list[dict]]:
    rng = np.random.default_rng(seed)
    packs = []
    for _ in range(num_packs):
        pack = []
        for n in make_lengths(per_pack, rng):
            ids = rng.integers(1, 32000, size=int(n), dtype=np.int64)
            labels = ids.copy()
            labels[: max(1, int(n) // 4)] = -100  # a prompt without loss
            if as_lists:
                pack.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
            else:
                pack.append({"input_ids": ids, "labels": labels})
        packs.append(pack)
    return packs


def time_cases(cases, packs, repeats: int) -> list[float]:
    """Best-of-``repeats`` seconds per pack of each ``fn(pack)`` over all packs.

    The cases are timed round-robin (case 1, case 2, ..., then again) so that a
    drift of the machine (allocator state, clock) affects them alike.
    """
    for _, fn in cases:  # warm-up
        for pack in packs[: min(len(packs), 100)]:
            fn(pack)
    best = [math.inf] * len(cases)
    for _ in range(repeats):
        for k, (_, fn) in enumerate(cases):
            t0 = time.perf_counter()
            for pack in packs:
                fn(pack)
            best[k] = min(best[k], (time.perf_counter() - t0) / len(packs))
    return best


def timing_table(packs_by_kind: dict, cp: int, repeats: int) -> list[dict]:
    def build(pack):
        return build_thd_batch(pack)

    def build_cp(pack):
        return build_thd_batch(pack, cp_size=cp)

    def build_shard_one(pack):
        return thdpack.shard(build_thd_batch(pack, cp_size=cp), cp_size=cp, cp_rank=0)

    def build_direct(pack):  # what ThdCollator(cp_size, cp_rank) does: only this rank's tokens
        return build_thd_batch(pack, cp_size=cp, cp_rank=0)

    def build_shard_all(pack):
        batch = build_thd_batch(pack, cp_size=cp)
        return [thdpack.shard(batch, cp_size=cp, cp_rank=r) for r in range(cp)]

    cases = [
        ("build", build),
        (f"build cp={cp}", build_cp),
        (f"build cp={cp} + shard 1 rank", build_shard_one),
        (f"build cp={cp}, cp_rank=0 (direct)", build_direct),
        (f"build cp={cp} + shard all {cp} ranks", build_shard_all),
    ]
    rows = []
    for kind, packs in packs_by_kind.items():
        times = time_cases(cases, packs, repeats)
        for (name, _), t in zip(cases, times):
            rows.append({"samples": kind, "case": name, "us_per_pack": t * 1e6, "ratio": t / times[0]})
    return rows


def padding_table(lengths: np.ndarray) -> list[dict]:
    rows = []
    real = int(lengths.sum())
    for cp in (2, 4, 8):
        for tp, sp in ((1, False), (2, True), (4, True)):
            m = cp_pad_multiple(cp, tp, sp)
            m16 = math.lcm(16, m)
            padded = int((-(-lengths // m) * m).sum())
            padded16 = int((-(-lengths // m16) * m16).sum())
            rows.append({
                "cp": cp, "tp": tp, "sp": sp, "multiple": m,
                "pad_frac": (padded - real) / padded,
                "multiple_16": m16,
                "pad_frac_16": (padded16 - real) / padded16,
            })
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--packs", type=int, default=2000, help="packs timed (default 2000)")
    ap.add_argument("--per-pack", type=int, default=8, help="samples per pack (default 8)")
    ap.add_argument("--cp", type=int, default=8, help="CP size timed (default 8)")
    ap.add_argument("--repeats", type=int, default=5, help="timed passes; the best is kept (default 5)")
    ap.add_argument("--pad-samples", type=int, default=1_000_000, help="samples for the padding table")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1, as in a DataLoader worker)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    packs_by_kind = {
        "numpy": make_packs(args.packs, args.per_pack, args.seed, as_lists=False),
        "lists": make_packs(args.packs, args.per_pack, args.seed, as_lists=True),
    }
    tokens = np.mean([sum(len(s["input_ids"]) for s in p) for p in packs_by_kind["numpy"]])
    print(f"thdpack {thdpack.__version__}, torch {torch.__version__}, numpy {np.__version__}, "
          f"python {platform.python_version()}, {platform.machine()}, torch threads {torch.get_num_threads()}")
    print(f"{args.packs} packs x {args.per_pack} samples, lognormal(6, 1) lengths clipped to [1, 4096], "
          f"mean {tokens:.0f} tokens/pack, seed {args.seed}, best of {args.repeats}\n")

    timing = timing_table(packs_by_kind, args.cp, args.repeats)
    print(f"{'samples':<8} {'case':<34} {'us/pack':>10} {'vs build':>9}")
    for row in timing:
        print(f"{row['samples']:<8} {row['case']:<34} {row['us_per_pack']:>10.1f} {row['ratio']:>8.2f}x")

    lengths = make_lengths(args.pad_samples, np.random.default_rng(args.seed + 1))
    padding = padding_table(lengths)
    print(f"\nalignment padding over {args.pad_samples} samples (pad slots / stream slots)")
    print(f"{'cp':>3} {'tp':>3} {'SP':>5} {'multiple':>9} {'pad %':>8}   {'lcm(16,m)':>9} {'pad %':>8}")
    for row in padding:
        print(f"{row['cp']:>3} {row['tp']:>3} {str(row['sp']):>5} {row['multiple']:>9} {100 * row['pad_frac']:>7.3f}%"
              f"   {row['multiple_16']:>9} {100 * row['pad_frac_16']:>7.3f}%")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "mean_tokens_per_pack": float(tokens), "timing": timing, "padding": padding},
                      f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
