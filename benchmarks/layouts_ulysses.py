"""Benchmark: the cost of Ulysses sequence-parallel shards next to the cost of building the pack.

    python benchmarks/layouts_ulysses.py                      # a 32k-token pack, sp=4
    python benchmarks/layouts_ulysses.py --tokens 131072 --sp 8

One pack of about ``--tokens`` tokens (lognormal(6, 1) lengths clipped to [1, 4096], numpy samples,
one token short so that the stream needs a tail), timed best of ``--repeats`` passes of
``--inner`` calls each, cases round-robin after a warm-up:

* ``build``                 ``build_thd_batch(samples)`` (the reference cost)
* ``shard rank 0``          ``thdpack.shard(batch, sp_size=sp, sp_rank=0)`` of the built batch (views)
* ``shard rank sp-1``       the rank holding the stream tail (new tensors: its slice and the tail)
* ``shard all sp ranks``    every rank's shard (no process needs them all; for scale)
* ``cp=2: shard rank 0``    ``thdpack.shard(..., cp_size=2, cp_rank=0)`` of a batch built with
                            ``cp_size=2`` (Ulysses x ring: a gather, not a slice), against ``build cp=2``
* ``collate, rank r``       ``ThdCollator(ulysses_sp_size=sp, ulysses_rank=r)`` against ``ThdCollator()``
                            (the builder writes the tail there, through ``pad_to``)

Columns: the shard's own cost over the build's, and build plus shard over the build (the collate
rows: the Ulysses collator's extra over a plain ``ThdCollator``). What one process pays, the four
one-rank text rows, must cost at most 1.2x the build (issue 23, Speed); the other rows are for scale. On a loaded machine the many small tensor
operations of a shard suffer more than the build's one compiled pass, so the times are this
process's CPU time. The script checks that the shards, concatenated, are the pack padded by the builder itself
(``pad_to``) and exits 1 when they are not. ``bench_ulysses(args)`` is the part that
benchmarks/layouts.py runs beside its other layouts.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time

import numpy as np
import torch

import thdpack
from thdpack import ThdCollator, build_thd_batch

SPEED_TARGET = 1.2  # a shard row costs at most this times the build


def make_pack(tokens: int, seed: int) -> list[dict]:
    """Samples of lognormal lengths summing to ``tokens - 1`` (the stream then needs a tail for any sp > 1)."""
    rng = np.random.default_rng(seed)
    lengths, total = [], 0
    while total < tokens - 1:
        n = int(min(np.clip(rng.lognormal(6.0, 1.0), 1, 4096), tokens - 1 - total))
        lengths.append(n)
        total += n
    out = []
    for n in lengths:
        ids = rng.integers(1, 32000, size=n, dtype=np.int64)
        labels = ids.copy()
        labels[: max(1, n // 4)] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def best_of(cases, repeats: int, inner: int) -> list[float]:
    """Best-of-``repeats`` CPU seconds of this process per call of each ``fn()``, the cases timed
    round-robin. CPU time (``time.process_time``), not wall time: time the process waits for a core
    on a shared machine is not counted, and one intra-op thread makes the two equal otherwise."""
    for _, fn in cases:  # warm-up (numba, allocator)
        fn()
    best = [math.inf] * len(cases)
    for _ in range(repeats):
        for k, (_, fn) in enumerate(cases):
            t0 = time.process_time()
            for _ in range(inner):
                fn()
            best[k] = min(best[k], (time.process_time() - t0) / inner)
    return best


def check_shards(samples, batch, sp: int) -> bool:
    """The ``sp`` shards concatenated are the stream as ``build_thd_batch(pad_to=...)`` pads it."""
    shards = [thdpack.shard(batch, sp_size=sp, sp_rank=r) for r in range(sp)]
    total = -(-batch.num_padded_tokens // sp) * sp
    ref = build_thd_batch(samples, pad_to=total)
    return all(torch.equal(torch.cat([getattr(s, f) for s in shards]), getattr(ref, f))
               for f in ("input_ids", "labels", "loss_mask", "position_ids")) and all(
        torch.equal(s.cu_seqlens_padded, ref.cu_seqlens_padded) for s in shards)


def bench_ulysses(args) -> tuple[list[dict], bool]:
    """Time the Ulysses shards of one ``args.tokens`` pack at ``args.sp`` (``args.repeats``,
    ``args.inner``, ``args.seed``); returns the rows and whether the shards are the padded stream."""
    sp = args.sp
    samples = make_pack(args.tokens, args.seed)
    batch = build_thd_batch(samples)
    batch_cp = build_thd_batch(samples, cp_size=2)
    plain = ThdCollator()
    first, last = ThdCollator(ulysses_sp_size=sp, ulysses_rank=0), ThdCollator(ulysses_sp_size=sp, ulysses_rank=sp - 1)
    cases = [
        ("build", lambda: build_thd_batch(samples)),
        ("shard rank 0", lambda: thdpack.shard(batch, sp_size=sp, sp_rank=0)),
        (f"shard rank {sp - 1} (the tail)", lambda: thdpack.shard(batch, sp_size=sp, sp_rank=sp - 1)),
        (f"shard all {sp} ranks", lambda: [thdpack.shard(batch, sp_size=sp, sp_rank=r) for r in range(sp)]),
        ("build cp=2", lambda: build_thd_batch(samples, cp_size=2)),
        ("cp=2: shard rank 0", lambda: thdpack.shard(batch_cp, sp_size=sp, sp_rank=0, cp_size=2, cp_rank=0)),
        ("collate", lambda: plain(samples)),
        ("collate, rank 0", lambda: first(samples)),
        (f"collate, rank {sp - 1}", lambda: last(samples)),
    ]
    times = dict(zip((name for name, _ in cases), best_of(cases, args.repeats, args.inner)))
    against = {name: "build" for name, _ in cases[1:4]}
    against.update({"cp=2: shard rank 0": "build cp=2", "collate, rank 0": "collate", f"collate, rank {sp - 1}": "collate"})
    judged = ("shard rank 0", f"shard rank {sp - 1} (the tail)", "collate, rank 0", f"collate, rank {sp - 1}")
    rows = []
    for name, t in times.items():
        base = against.get(name)
        extra = None if base is None else (t - times[base] if name.startswith("collate") else t)  # the shard's cost
        rows.append({"case": name, "us": t * 1e6, "vs": base, "judged": name in judged,
                     "shard_vs_build": None if base is None else extra / times[base],
                     "with_build": None if base is None else (times[base] + extra) / times[base]})
    return rows, check_shards(samples, batch, sp)


def print_rows(rows: list[dict], args) -> bool:
    """The table; True when every one-rank text row's shard costs at most :data:`SPEED_TARGET` x the build."""
    print(f"Ulysses shards of a {args.tokens}-token pack (one token short), sp={args.sp}; "
          f"best of {args.repeats} x {args.inner} calls, CPU time")
    print(f"{'case':<26} {'us/call':>9}  {'shard / build':>13}  {'(build + shard) / build':>23}  against")
    ok = True
    for row in rows:
        if row["vs"] is None:
            print(f"{row['case']:<26} {row['us']:>9.1f}")
            continue
        ok &= not row["judged"] or row["shard_vs_build"] <= SPEED_TARGET
        print(f"{row['case']:<26} {row['us']:>9.1f}  {row['shard_vs_build']:>12.3f}x  {row['with_build']:>22.3f}x  "
              f"{row['vs']}")
    print(f"one rank's shard <= {SPEED_TARGET}x the build (issue 23, Speed): {'ok' if ok else 'OVER'}")
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768, help="tokens in the pack (default 32768)")
    ap.add_argument("--sp", type=int, default=4, help="Ulysses SP size (default 4)")
    ap.add_argument("--repeats", type=int, default=25, help="timed passes; the best is kept (default 25)")
    ap.add_argument("--inner", type=int, default=20, help="calls per timed pass (default 20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1, as in a DataLoader worker)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"thdpack {thdpack.__version__}, torch {torch.__version__}, numpy {np.__version__}, "
          f"python {platform.python_version()}, {platform.machine()}, torch threads {torch.get_num_threads()}\n")
    rows, same = bench_ulysses(args)
    print_rows(rows, args)
    print("\nshards concatenated == the pack padded by build_thd_batch(pad_to=...):", "same output" if same else "DIFFERENT")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
