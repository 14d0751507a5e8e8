"""Benchmark: dataset mixtures: the blend, and packs that keep it in every step against whole-dataset BFD.

    python benchmarks/mixture.py                        # 4 sources, 400,000 samples, packs of 4096
    python benchmarks/mixture.py --weight-by tokens     # the weights are shares of tokens
    python benchmarks/mixture.py --steps 1 8 64 --json out.json

Sources (lognormal lengths clipped to [1, ``--pack-size``], weights 0.4 / 0.3 / 0.2 / 0.1):
``chat`` lognormal(6.0, 0.8), ``math`` (7.0, 0.6), ``code`` (6.5, 0.9), ``tools`` (5.0, 0.5), with
``--samples`` rows in all (in the proportion 3 : 1 : 1.5 : 2). ``plan_mixture`` blends them
(``stopping="first_exhausted"``); its time and the requested / realized shares are printed first.

Then, over the blend's lengths, side by side:

* ``BFD (plan order)``: :func:`thdpack.plan_packs`, best fit decreasing over the whole dataset, packs in the
  order it makes them (longest samples first), cut into steps of ``n`` packs;
* ``BFD (shuffled)``: the same packs in a seeded random order, as ``TokenBudgetBatchSampler(shuffle=True)``
  deals them;
* ``stratified n``: :func:`thdpack.planning.mixture.plan_stratified` with ``step_packs=n``.

Columns: ``packs`` (lower bound: ``ceil(aligned tokens / pack_size)``), ``eff`` real tokens / (packs ×
pack_size), ``Δeff`` its loss against BFD, ``drift`` per step of ``n`` packs the total variation distance
between the step's source shares (of samples, or tokens with ``--weight-by tokens``) and the blend's,
mean / 95th percentile / max over the steps but the last, and ``time`` the planning wall time (warm: numba
compiled by a first call).

The script measures and prints; it exits non-zero only if a plan is invalid (a pack over ``--pack-size``,
a sample lost or placed twice).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import numpy as np

from thdpack import plan_packs
from thdpack.planning.mixture import plan_mixture, plan_stratified, step_shares

SOURCES = (("chat", 6.0, 0.8, 3.0, 0.4), ("math", 7.0, 0.6, 1.0, 0.3), ("code", 6.5, 0.9, 1.5, 0.2),
           ("tools", 5.0, 0.5, 2.0, 0.1))  # name, lognormal mu, sigma, rows (relative), weight


def make_sources(samples: int, pack_size: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    parts = np.array([s[3] for s in SOURCES])
    rows = np.maximum((samples * parts / parts.sum()).astype(int), 1)
    return [{"name": name, "num_rows": int(n), "weight": w,
             "lengths": np.clip(rng.lognormal(mu, sigma, int(n)), 1, pack_size).astype(np.int64)}
            for (name, mu, sigma, _, w), n in zip(SOURCES, rows)]


def timed(fn, repeats: int):
    fn()  # warm: numba compiled
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return out, best


def check(plan, n: int, pack_size: int) -> None:
    fill = np.add.reduceat(plan.length, plan.pack_offsets[:-1])
    if fill.max() > pack_size or sorted(plan.sample_index.tolist()) != list(range(n)):
        sys.exit(f"invalid plan ({plan.algorithm}): a pack over {pack_size} tokens, or samples lost or duplicated")


def drift(plan, order, sources, share, step_packs: int, weight_by: str) -> np.ndarray:
    """Total variation distance of every step's shares (but the last) from the blend's."""
    if order is not None:
        parts = [plan.pack_slice(int(k)) for k in order]
        take = np.concatenate([np.arange(s.start, s.stop) for s in parts])
        offsets = np.concatenate([[0], np.cumsum([s.stop - s.start for s in parts])])
        from dataclasses import replace

        plan = replace(plan, sample_index=plan.sample_index[take], length=plan.length[take], pack_offsets=offsets)
    shares = step_shares(plan, sources, step_packs, weight_by=weight_by, num_sources=share.size)
    return 0.5 * np.abs(shares[:-1] - share).sum(1) if len(shares) > 1 else np.zeros(1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=400_000)
    parser.add_argument("--pack-size", type=int, default=4096)
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 8, 64], help="packs per step (n)")
    parser.add_argument("--weight-by", choices=["samples", "tokens"], default="samples")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    sources = make_sources(args.samples, args.pack_size, args.seed)
    blend, blend_time = timed(lambda: plan_mixture(sources, weight_by=args.weight_by, seed=args.seed), args.repeats)
    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}")
    print(f"plan_mixture: {blend_time:.3f} s for {len(blend):,} samples of {sum(s['num_rows'] for s in sources):,} "
          f"rows\n{blend}\n")
    n, share = len(blend), blend.realized_share
    bfd, bfd_time = timed(lambda: plan_packs(blend.lengths, args.pack_size), args.repeats)
    check(bfd, n, args.pack_size)
    shuffled = np.random.default_rng(args.seed).permutation(len(bfd))
    results = {"samples": n, "weight_by": args.weight_by, "bfd": {}, "stratified": {}}
    print(f"packs of {args.pack_size} tokens; lower bound {bfd.stats.lower_bound:,} packs; drift: total variation "
          f"distance of a step's {args.weight_by} shares from the blend's (mean / p95 / max)")
    print(f"{'plan':<22} {'n':>4} {'packs':>9} {'eff':>8} {'Δeff':>8} {'drift mean':>10} {'p95':>7} {'max':>7} "
          f"{'time':>8}")
    for step in args.steps:
        strat, strat_time = timed(lambda: plan_stratified(blend.lengths, blend.source, args.pack_size,
                                                          step_packs=step, weight_by=args.weight_by), args.repeats)
        check(strat, n, args.pack_size)
        for name, plan, order, took in (("BFD (plan order)", bfd, None, bfd_time),
                                        ("BFD (shuffled)", bfd, shuffled, bfd_time),
                                        ("stratified", strat, None, strat_time)):
            d = drift(plan, order, blend.source, share, step, args.weight_by)
            loss = bfd.stats.efficiency - plan.stats.efficiency
            print(f"{name:<22} {step:>4} {len(plan):>9,} {plan.stats.efficiency:>8.4f} {loss:>8.4f} {d.mean():>10.4f} "
                  f"{np.percentile(d, 95):>7.4f} {d.max():>7.4f} {took:>7.3f}s")
            key = "stratified" if name == "stratified" else "bfd"
            results[key].setdefault(name, {})[step] = {
                "packs": len(plan), "efficiency": plan.stats.efficiency, "drift_mean": float(d.mean()),
                "drift_p95": float(np.percentile(d, 95)), "drift_max": float(d.max()), "time_s": took}
        print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
