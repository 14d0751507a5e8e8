"""Benchmark: what one global plan costs and gains at cluster scale, and a 100M-row build on paper.

    python benchmarks/distributed.py                               # plan 1M and 10M lengths; slices vs global
    python benchmarks/distributed.py --build-json build.json       # + the estimate from a measured build
    python benchmarks/distributed.py --sizes 1000000 --slices 8 64 --json out.json

1. **Planning on the driver**: ``plan_packs`` (best-fit decreasing, pack 4096) over 1M and 10M
   lognormal SFT-like lengths (median ~600 tokens, clipped to the pack), timed in this process,
   with the driver's memory for them (lengths + plan arrays); 100M extrapolated as ``n log n`` from 10M.
2. **Global vs slice-local plans** on the same 1M lengths: one plan over all (``engine: ray``) vs
   ``--slice i/N`` + ``merge`` (each slice of contiguous rows planned on its own, N = 8 and 64): packs
   and efficiency (real tokens / (packs x pack)).
3. **A 100M-row build on 8 nodes x 32 CPUs, on paper** (``--build-json``: the JSON of
   ``benchmarks/build.py --engine local ray --json``): tokenizing rows/s per CPU and pack-writing
   tokens/s per CPU from the measured local build's stage lines, planning from (1); the estimate is
   tokenize + plan + write, each stage's work over the cluster's CPUs, and says which stage the
   driver (planning, one process) holds up first.

No assertions: the script measures and prints.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from thdpack.planning.plan import plan_packs  # noqa: E402

PACK = 4096


def lengths(n: int, seed: int = 0) -> np.ndarray:
    """int64 ``[n]`` lognormal SFT-like lengths (median ~600), clipped to ``[1, PACK]``."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(math.log(600), 0.9, n), 1, PACK).astype(np.int64)


def time_plan(n: int) -> dict:
    x = lengths(n)
    t0 = time.perf_counter()
    plan = plan_packs(x, PACK)
    seconds = time.perf_counter() - t0
    arrays = sum(a.nbytes for a in (x, plan.sample_index, plan.start, plan.length, plan.pack_offsets))
    return {"lengths": n, "seconds": seconds, "packs": len(plan), "efficiency": plan.stats.efficiency,
            "driver_mb": arrays / 2**20}


def slices_vs_global(n: int, slices: list[int]) -> dict:
    x = lengths(n, seed=1)
    real = int(x.sum())
    out = {"global": {"packs": len(plan_packs(x, PACK))}}
    for k in slices:
        bounds = np.linspace(0, n, k + 1).astype(np.int64)
        out[f"{k} slices"] = {"packs": int(sum(len(plan_packs(x[a:b], PACK)) for a, b in zip(bounds[:-1], bounds[1:])))}
    for v in out.values():
        v["efficiency"] = real / (v["packs"] * PACK)
        v["extra_packs_vs_global"] = v["packs"] / out["global"]["packs"] - 1
    return out


def estimate(build: dict, plan_100m_s: float, nodes: int, cpus: int) -> dict | None:
    """The 100M-row estimate from a ``benchmarks/build.py --json`` result (see the module docstring)."""
    run = next(iter(build["runs"].values()))
    local = run.get("thdpack")
    if not local:
        return None
    stages = " ".join(local.get("stages", []))
    tok = re.search(r"tokenized ([\d,]+) rows .*?: ([\d,]+) tokens in ([\d.]+)s", stages)
    wrote = re.search(r"in ([\d.]+)s \(total", stages)
    if not tok or not wrote:
        return None
    rows, tokens, tok_s = int(tok[1].replace(",", "")), int(tok[2].replace(",", "")), float(tok[3])
    procs = build["num_proc"]
    rows_per_cpu_s = rows / tok_s / procs
    write_tokens_per_s = tokens / float(wrote[1])  # the local build writes in one process
    total_cpus = nodes * cpus
    n = 100e6
    tokenize_s = n / (rows_per_cpu_s * total_cpus)
    write_s = n * tokens / rows / (write_tokens_per_s * total_cpus)
    return {"rows_per_cpu_s_tokenize": rows_per_cpu_s, "tokens_per_cpu_s_write": write_tokens_per_s,
            "cluster": f"{nodes} nodes x {cpus} CPUs", "tokenize_s": tokenize_s, "plan_s": plan_100m_s,
            "write_s": write_s, "total_s": tokenize_s + plan_100m_s + write_s,
            "driver_bound": plan_100m_s > max(tokenize_s, write_s)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--slices", type=int, nargs="+", default=[8, 64])
    p.add_argument("--build-json", help="benchmarks/build.py --json output, for the 100M-row estimate")
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--cpus-per-node", type=int, default=32)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    plan_packs(lengths(1000), PACK)  # compile once, outside the timings
    res = {"plan": [time_plan(n) for n in args.sizes]}
    big = res["plan"][-1]
    n = big["lengths"]
    res["plan_100m_s"] = big["seconds"] * (1e8 * math.log(1e8)) / (n * math.log(n))
    res["slices_vs_global"] = slices_vs_global(1_000_000, args.slices)
    if args.build_json:
        res["estimate_100m"] = estimate(json.loads(Path(args.build_json).read_text()), res["plan_100m_s"],
                                        args.nodes, args.cpus_per_node)
    print(f"planning on the driver (bfd, pack {PACK}):")
    for r in res["plan"]:
        print(f"  {r['lengths']:>12,} lengths  {r['seconds']:7.2f} s  {r['packs']:>10,} packs  efficiency "
              f"{r['efficiency']:.4f}  driver arrays {r['driver_mb']:.0f} MB")
    print(f"  {100_000_000:>12,} lengths  {res['plan_100m_s']:7.1f} s  (extrapolated n log n)")
    print("global plan vs slice-local plans (slices + merge), 1,000,000 lengths:")
    for name, v in res["slices_vs_global"].items():
        print(f"  {name:<10} {v['packs']:>9,} packs  efficiency {v['efficiency']:.4f}  "
              f"{100 * v['extra_packs_vs_global']:+.2f}% packs")
    est = res.get("estimate_100m")
    if est:
        print(f"100M rows on {est['cluster']} (from the measured build): tokenize {est['tokenize_s']:.0f} s + plan "
              f"{est['plan_s']:.0f} s + write {est['write_s']:.0f} s = {est['total_s'] / 60:.1f} min; "
              f"{'the driver (planning) is' if est['driver_bound'] else 'the cluster stages are'} the bottleneck")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
