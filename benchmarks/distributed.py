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
3. **A 100M-row build on 8 nodes x 32 CPUs, on paper** (``--build-json``: one or more JSONs of
   ``benchmarks/build.py --engine local ray --json``): tokenizing rows/s per CPU and pack-writing
   tokens/s per CPU from the measured local build's stage lines (the chat run), planning from (1); the
   driver's share from the ``engine: ray`` runs of ``--kind tokenized`` at two sizes (200k and 2M rows):
   its CPU seconds and peak RSS grow linearly between them (the slope is what each row costs the driver),
   extrapolated to 100M, planning's ``n log n`` beyond linear added. The estimate is tokenize + write
   (each stage's work over the cluster's CPUs) + the driver's share, and says which part is the bottleneck.

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


def _runs(builds: list[dict], kind: str, engine: str) -> list[dict]:
    return [b["runs"][kind][engine] for b in builds if engine in b["runs"].get(kind, {})]


def driver_share(builds: list[dict]) -> dict | None:
    """The driver's CPU seconds and peak RSS per million rows from the ``engine: ray`` runs of ``--kind
    tokenized`` at two sizes (the slope between the smallest and the largest), or None."""
    runs = sorted(_runs(builds, "tokenized", "thdpack-ray"), key=lambda r: r["rows"])
    if len(runs) < 2 or runs[0]["rows"] == runs[-1]["rows"]:
        return None
    a, b = runs[0], runs[-1]
    per_m = 1e6 / (b["rows"] - a["rows"])
    # a slope below 0 is noise (a shared machine): counted as 0
    return {"rows": [a["rows"], b["rows"]], "rss_mb": [a["driver_peak_rss_mb"], b["driver_peak_rss_mb"]],
            "cpu_s": [a["driver_cpu_s"], b["driver_cpu_s"]],
            "rss_mb_per_million_rows": max(0.0, (b["driver_peak_rss_mb"] - a["driver_peak_rss_mb"]) * per_m),
            "cpu_s_per_million_rows": max(0.0, (b["driver_cpu_s"] - a["driver_cpu_s"]) * per_m)}


def estimate(builds: list[dict], plan: list[dict], plan_100m_s: float, nodes: int, cpus: int) -> dict | None:
    """The 100M-row estimate from ``benchmarks/build.py --json`` results (see the module docstring)."""
    local = next((r for b in builds for kind in ("chat", "text") for r in _runs([b], kind, "thdpack")), None)
    if not local:
        return None
    stages = " ".join(local.get("stages", []))
    tok = re.search(r"tokenized ([\d,]+) rows .*?: ([\d,]+) tokens in ([\d.]+)s", stages)
    wrote = re.search(r"in ([\d.]+)s \(total", stages)
    if not tok or not wrote:
        return None
    rows, tokens, tok_s = int(tok[1].replace(",", "")), int(tok[2].replace(",", "")), float(tok[3])
    procs = next(b["num_proc"] for b in builds if any("thdpack" in row for row in b["runs"].values()))
    rows_per_cpu_s = rows / tok_s / procs
    write_tokens_per_s = tokens / float(wrote[1])  # the local build writes in one process
    total_cpus = nodes * cpus
    n = 100e6
    tokenize_s = n / (rows_per_cpu_s * total_cpus)
    write_s = n * tokens / rows / (write_tokens_per_s * total_cpus)
    out = {"rows_per_cpu_s_tokenize": rows_per_cpu_s, "tokens_per_cpu_s_write": write_tokens_per_s,
           "cluster": f"{nodes} nodes x {cpus} CPUs", "tokenize_s": tokenize_s, "plan_s": plan_100m_s,
           "write_s": write_s}
    share = driver_share(builds)
    if share is None:  # the driver's share is planning alone
        out.update(driver_s=plan_100m_s, driver_measured=False)
    else:  # linear from the two sizes, plus planning's n log n beyond linear (from the largest planned size)
        big = plan[-1]
        beyond = max(0.0, plan_100m_s - big["seconds"] * n / big["lengths"])
        out.update(driver=share, driver_measured=True,
                   driver_s=share["cpu_s"][1] + share["cpu_s_per_million_rows"] * (n - share["rows"][1]) / 1e6 + beyond,
                   driver_rss_mb=share["rss_mb"][1] + share["rss_mb_per_million_rows"] * (n - share["rows"][1]) / 1e6)
    out["total_s"] = tokenize_s + write_s + out["driver_s"]
    out["driver_bound"] = out["driver_s"] > max(tokenize_s, write_s)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--slices", type=int, nargs="+", default=[8, 64])
    p.add_argument("--build-json", nargs="+", help="benchmarks/build.py --json output(s), for the 100M-row "
                   "estimate (a chat run; tokenized engine-ray runs at two sizes for the driver's share)")
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
        builds = [json.loads(Path(p).read_text()) for p in args.build_json]
        res["estimate_100m"] = estimate(builds, res["plan"], res["plan_100m_s"], args.nodes, args.cpus_per_node)
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
        d = est.get("driver")
        if d:
            print(f"driver (engine ray, tokenized rows, measured at {d['rows'][0]:,} and {d['rows'][1]:,} rows): peak RSS "
                  f"{d['rss_mb'][0]:.0f} and {d['rss_mb'][1]:.0f} MB ({d['rss_mb_per_million_rows']:.0f} MB per million "
                  f"rows), CPU {d['cpu_s'][0]:.1f} and {d['cpu_s'][1]:.1f} s ({d['cpu_s_per_million_rows']:.1f} s per "
                  f"million rows); at 100M rows, extrapolated linearly: {est['driver_rss_mb'] / 1024:.1f} GB")
        print(f"100M rows on {est['cluster']} (from the measured builds): tokenize {est['tokenize_s']:.0f} s + write "
              f"{est['write_s']:.0f} s on the cluster + the driver {est['driver_s']:.0f} s "
              f"({'measured share' if est['driver_measured'] else 'planning alone'}, planning {est['plan_s']:.0f} s "
              f"of it) = {est['total_s'] / 60:.1f} min; "
              f"{'the driver is' if est['driver_bound'] else 'the cluster stages are'} the bottleneck")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
