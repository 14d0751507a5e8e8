"""Benchmark: compute-balanced data-parallel packing, and streaming packing vs buffer size.

    python benchmarks/balance.py                      # 64 ranks, 200,000 lognormal(6, 1) lengths
    python benchmarks/balance.py --heavy              # heavier tail: sigma 1.5, clipped to 4096
    python benchmarks/balance.py --micro-batches 1 4  # one table per micro-batch count
    python benchmarks/balance.py --json out.json

A simulated data-parallel job: ``--replicas`` ranks (64), packs of ``--pack-size``
tokens (4096), ``M`` packs per rank per optimizer step (``--micro-batches``, 1).
Lengths: ``numpy.random.default_rng(seed).lognormal(6, sigma, N)`` clipped to
[1, ``--max-len``], as int.

Cost of a pack (or of a rank's share of a step): ``a·Σ sᵢ + b·Σ sᵢ²``, the
Qwen3-8B training cost model. With ``thdpack.flops.model_flops`` available it is
``CostModel.from_config(QWEN3_8B)``; otherwise ``a`` and ``b`` are derived here by
hand (printed as such): ``a = 6·(non-embedding params + lm_head params)`` FLOPs
per token, ``b = 6·L·n_heads·head_dim`` FLOPs per unit of ``Σ s²`` (causal
attention: half of the ``s×s`` score and value products, ×3 for training).

Schedules compared, all over the same lengths:

* ``thdpack balanced``: :func:`thdpack.plan_balanced` (BFD packs, cost-sorted steps,
  greedy dealing inside a step).
* ``BFD round-robin``: the BFD packs dealt to ranks in BFD order
  (``TokenBudgetBatchSampler(balance=None, shuffle=False)``); the last step is
  filled by repeating the first packs (its ``drop_last=False``).
* ``BFD round-robin shuffled``: the same in a seeded random order (what the
  sampler does with ``shuffle=True``; NeMo-RL style dealing of bins).
* ``token balancing``: BFD packs sorted by token count, cut into steps of R·M,
  dealt inside a step to the rank with the fewest tokens (M packs each).
* ``Karmarkar-Karp``: the samples of each step of the shuffled round-robin
  schedule (a random global batch of whole packs) partitioned into R ranks by
  cost with the largest differencing method, with no token cap (verl style).
  A rank may then get more than ``M·pack_size`` tokens: how often and by how much
  is reported.

Columns: ``straggler`` mean over steps of max/mean per-rank cost; ``worst`` the
largest per-step ratio; ``slowdown`` Σ_steps max / Σ_steps mean per-rank cost
(the run's time over an ideally balanced run's: cheap steps weigh less); ``eff`` real tokens / (scheduled pack slots × pack_size),
slots = steps × R × M, so repeated or extra (split) packs count as waste; for
Karmarkar-Karp the same slots as the shuffled schedule whose samples it
partitions (nominal: ranks over the cap would need more); ``packs`` scheduled
slots; ``time`` planning wall time (the BFD plan included for every method).

Streaming: :class:`thdpack.StreamingPacker` efficiency (real tokens / (packs ×
pack_size)) against buffer size, next to global BFD; samples are tiny dicts with a
``length_fn``, so the time is the packer's own.

The script measures and prints; it makes no assertions.
"""

from __future__ import annotations

import argparse
import heapq
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

import thdpack
from thdpack import CostModel, StreamingPacker, plan_balanced, plan_packs

# the model config the repository ships for FLOPs figures (also used by `thdpack stats --model-config`)
QWEN3_8B = json.loads((Path(__file__).resolve().parents[1] / "configs" / "models" / "qwen3-8b.json").read_text())


# ---------------------------------------------------------------- inputs ----
def make_lengths(n: int, seed: int, sigma: float, max_len: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=6.0, sigma=sigma, size=n), 1, max_len).astype(np.int64)


def cost_model(cfg: dict) -> tuple[CostModel, str]:
    try:
        from thdpack.flops import model_flops  # noqa: F401
    except ImportError:
        pass
    else:
        return CostModel.from_config(cfg), "thdpack.flops.model_flops (CostModel.from_config)"
    h, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    attn = h * nh * hd + 2 * h * nkv * hd + nh * hd * h  # q, k, v, o projections
    mlp = 3 * h * cfg["intermediate_size"]  # gate, up, down
    logits = h * cfg["vocab_size"]  # lm_head (untied in Qwen3-8B); the embedding lookup costs no FLOPs
    linear = 6.0 * (L * (attn + mlp) + logits)
    quadratic = 6.0 * L * nh * hd  # causal: 2·s²·nh·hd forward per layer (QKᵀ and PV, halved), ×3 training
    return CostModel(linear, quadratic), "derived by hand (thdpack.flops not available)"


# ------------------------------------------------------------- schedules ----
def straggler(per_rank: np.ndarray) -> np.ndarray:
    """``[S, R]`` per-rank costs -> ``[S]`` max/mean."""
    mean = per_rank.mean(axis=1)
    return np.divide(per_rank.max(axis=1), mean, out=np.ones_like(mean), where=mean > 0)


def round_robin(num_packs: int, R: int, M: int, order: np.ndarray) -> np.ndarray:
    """``[S, R, M]``: sampler step ``t`` gives rank ``r`` pack ``order[t·R + r]``;
    optimizer step ``s`` is sampler steps ``s·M .. s·M+M-1``; the last step repeats the first packs."""
    S = -(-num_packs // (R * M))
    padded = order[np.arange(S * R * M) % num_packs]
    return padded.reshape(S, M, R).transpose(0, 2, 1)


def token_balanced(tokens: np.ndarray, R: int, M: int) -> np.ndarray:
    """Sort packs by tokens, cut into steps of R·M, deal to the rank with fewest tokens (M each)."""
    n = tokens.size
    order = np.argsort(-tokens, kind="stable")
    S = -(-n // (R * M))
    order = order[np.arange(S * R * M) % n]
    steps = np.empty((S, R, M), np.int64)
    for s in range(S):
        load = np.zeros(R)
        filled = np.zeros(R, np.int64)
        for k in order[s * R * M : (s + 1) * R * M]:
            cand = np.flatnonzero(filled < M)
            r = cand[np.argmin(load[cand])]
            steps[s, r, filled[r]] = k
            filled[r] += 1
            load[r] += tokens[k]
    return steps


def karmarkar_karp(costs: np.ndarray, tokens: np.ndarray, R: int) -> tuple[np.ndarray, np.ndarray]:
    """Largest differencing method for R-way partitioning (Karmarkar-Karp, multiway).

    Every item starts as an R-tuple of subset sums ``(c, 0, ..., 0)``; repeatedly the
    two tuples with the largest spread (max - min) are merged, pairing the largest
    subset of one with the smallest of the other. Returns per-subset (cost, tokens).
    """
    heap = []
    for i in range(costs.size):
        c = np.zeros(R)
        t = np.zeros(R, np.int64)
        c[0], t[0] = costs[i], tokens[i]
        heap.append((-float(costs[i]), i, c, t))
    heapq.heapify(heap)
    counter = costs.size
    while len(heap) > 1:
        _, _, c1, t1 = heapq.heappop(heap)
        _, _, c2, t2 = heapq.heappop(heap)
        c = c1 + c2[::-1]
        t = t1 + t2[::-1]
        o = np.argsort(-c, kind="stable")
        c, t = c[o], t[o]
        heapq.heappush(heap, (-(float(c[0] - c[-1])), counter, c, t))
        counter += 1
    if not heap:
        return np.zeros(R), np.zeros(R, np.int64)
    return heap[0][2], heap[0][3]


def row(name, per_rank_cost, real_tokens, slots, pack_size, seconds, **extra):
    ratios = straggler(per_rank_cost)
    return {
        "method": name,
        "straggler": float(ratios.mean()) if ratios.size else 1.0,
        "worst": float(ratios.max()) if ratios.size else 1.0,
        # the whole run waits for the slowest rank of every step: total time / ideal time
        "slowdown": float(per_rank_cost.max(axis=1).sum() / per_rank_cost.mean(axis=1).sum())
        if per_rank_cost.size else 1.0,
        "efficiency": real_tokens / (slots * pack_size) if slots else 0.0,
        "packs": int(slots),
        "steps": int(per_rank_cost.shape[0]),
        "seconds": seconds,
        **extra,
    }


def compare(lengths, pack_size, R, M, cost: CostModel, seed: int, kk: bool) -> list[dict]:
    rows = []
    real = int(lengths.sum())
    lin, quad = cost.linear, cost.quadratic

    t0 = time.perf_counter()
    bp = plan_balanced(lengths, pack_size, num_replicas=R, micro_batches=M, cost=cost, seed=seed)
    dt = time.perf_counter() - t0
    rows.append(row("thdpack balanced", bp.costs[bp.steps].sum(axis=2), real, bp.steps.size, pack_size, dt,
                    repeated_packs=bp.repeated_packs, distinct_packs=len(bp.plan)))

    t0 = time.perf_counter()
    bfd = plan_packs(lengths, pack_size, algorithm="bfd", seed=seed)
    t_bfd = time.perf_counter() - t0
    costs = cost.pack_costs(bfd)
    tokens = np.add.reduceat(bfd.length, bfd.pack_offsets[:-1]) if len(bfd) else np.zeros(0, np.int64)
    rows.append(row("BFD (unscheduled)", np.zeros((0, R)), real, len(bfd), pack_size, t_bfd))
    rows[-1].update(straggler=float("nan"), worst=float("nan"), slowdown=float("nan"), steps=0)

    t0 = time.perf_counter()
    steps = round_robin(len(bfd), R, M, np.arange(len(bfd)))
    dt = t_bfd + time.perf_counter() - t0
    rows.append(row("BFD round-robin", costs[steps].sum(axis=2), real, steps.size, pack_size, dt))

    t0 = time.perf_counter()
    order = np.random.default_rng([seed, 0]).permutation(len(bfd))  # as TokenBudgetBatchSampler(shuffle=True)
    shuffled = round_robin(len(bfd), R, M, order)
    dt = t_bfd + time.perf_counter() - t0
    rows.append(row("BFD round-robin shuffled", costs[shuffled].sum(axis=2), real, shuffled.size, pack_size, dt))

    t0 = time.perf_counter()
    steps = token_balanced(tokens, R, M)
    dt = t_bfd + time.perf_counter() - t0
    rows.append(row("token balancing", costs[steps].sum(axis=2), real, steps.size, pack_size, dt))

    if kk:
        t0 = time.perf_counter()
        cap = M * pack_size
        per_rank_cost = np.empty((len(shuffled), R))
        per_rank_tokens = np.empty((len(shuffled), R), np.int64)
        seen = np.zeros(len(bfd), bool)
        for s, step in enumerate(shuffled):
            packs = np.unique(step.reshape(-1))  # the repeats that fill the last step are not run twice here
            packs = packs[~seen[packs]]
            seen[packs] = True
            idx = np.concatenate([bfd.pack(int(k)) for k in packs]) if packs.size else np.zeros(0, np.int64)
            s_len = lengths[idx].astype(np.float64)
            c, t = karmarkar_karp(lin * s_len + quad * s_len * s_len, lengths[idx], R)
            per_rank_cost[s], per_rank_tokens[s] = c, t
        dt = t_bfd + time.perf_counter() - t0
        over = per_rank_tokens > cap
        excess = np.where(over, per_rank_tokens - cap, 0)
        rows.append(row(
            "Karmarkar-Karp (no cap)", per_rank_cost, real, shuffled.size, pack_size, dt,
            over_cap_rank_steps=float(over.mean()),
            over_cap_steps=float(over.any(axis=1).mean()),
            max_overshoot_tokens=int(excess.max()) if excess.size else 0,
            mean_overshoot_tokens=float(excess[over].mean()) if over.any() else 0.0,
        ))
    return rows


def streaming(lengths, pack_size, buffers) -> list[dict]:
    samples = [{"n": int(n)} for n in lengths]
    total = int(lengths.sum())
    t0 = time.perf_counter()
    bfd = plan_packs(lengths, pack_size)
    rows = [{"method": "global BFD", "buffer": None, "efficiency": bfd.stats.efficiency, "packs": len(bfd),
             "seconds": time.perf_counter() - t0}]
    for b in buffers:
        packer = StreamingPacker(samples, pack_size, buffer_size=b, length_fn=lambda s, i: s["n"])
        t0 = time.perf_counter()
        n = sum(1 for _ in packer)
        dt = time.perf_counter() - t0
        rows.append({"method": "StreamingPacker", "buffer": b, "efficiency": total / (n * pack_size),
                     "packs": n, "seconds": dt})
    return rows


# ----------------------------------------------------------------- output ----
def print_table(rows, R, M, pack_size):
    print(f"\n## {R} ranks, micro_batches={M}, pack_size={pack_size}")
    print(f"{'method':<28}{'straggler':>10}{'worst':>9}{'slowdown':>10}{'eff':>9}{'packs':>9}{'time s':>9}")
    for r in rows:
        fmt = lambda key, spec: "-" if r[key] != r[key] else format(r[key], spec)
        print(f"{r['method']:<28}{fmt('straggler', '.4f'):>10}{fmt('worst', '.3f'):>9}{fmt('slowdown', '.4f'):>10}"
              f"{r['efficiency']:>9.4f}{r['packs']:>9}{r['seconds']:>9.3f}")
    for r in rows:
        if "over_cap_rank_steps" in r:
            print(f"  Karmarkar-Karp: {100 * r['over_cap_rank_steps']:.1f}% of rank-steps over {M}x{pack_size} tokens "
                  f"({100 * r['over_cap_steps']:.1f}% of steps have one); overshoot mean "
                  f"{r['mean_overshoot_tokens']:.0f}, max {r['max_overshoot_tokens']} tokens")
        if r["method"] == "thdpack balanced" and r.get("repeated_packs"):
            print(f"  thdpack balanced repeated {r['repeated_packs']} packs to fill the last step")
    bal = next(r for r in rows if r["method"] == "thdpack balanced")
    bfd = next(r for r in rows if r["method"] == "BFD (unscheduled)")
    print(f"  balanced efficiency vs unscheduled BFD: {100 * (bal['efficiency'] - bfd['efficiency']):+.3f} points "
          f"({bal['distinct_packs'] - bfd['packs']} extra packs to fill whole steps)")


def print_stream(rows, pack_size):
    print(f"\n## StreamingPacker vs global BFD, pack_size={pack_size}")
    print(f"{'method':<20}{'buffer':>8}{'eff':>9}{'packs':>9}{'time s':>9}")
    for r in rows:
        b = "-" if r["buffer"] is None else str(r["buffer"])
        print(f"{r['method']:<20}{b:>8}{r['efficiency']:>9.4f}{r['packs']:>9}{r['seconds']:>9.3f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=64)
    p.add_argument("--num-samples", type=int, default=200_000)
    p.add_argument("--pack-size", type=int, default=4096)
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1])
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma (mean 6)")
    p.add_argument("--max-len", type=int, default=None, help="clip lengths to this (default: pack size)")
    p.add_argument("--heavy", action="store_true", help="heavier tail: sigma 1.5, clipped to 4096")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-kk", action="store_true", help="skip the (pure Python) Karmarkar-Karp baseline")
    p.add_argument("--stream-samples", type=int, default=None, help="samples for the streaming section (default: all)")
    p.add_argument("--buffers", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)

    sigma = 1.5 if args.heavy else args.sigma
    max_len = 4096 if args.heavy and args.max_len is None else (args.max_len or args.pack_size)
    lengths = make_lengths(args.num_samples, args.seed, sigma, max_len)
    cost, cost_source = cost_model(QWEN3_8B)

    plan_packs(lengths[:1000], args.pack_size)  # warm up (numba compile / cache load), not timed
    plan_balanced(lengths[:1000], args.pack_size, num_replicas=2, cost=cost)

    print(f"thdpack {thdpack.__version__}, Python {platform.python_version()}, numpy {np.__version__}")
    print(f"lengths: N={lengths.size}, lognormal(6, {sigma}) clipped to [1, {max_len}], seed {args.seed}; "
          f"mean {lengths.mean():.1f}, p99 {np.percentile(lengths, 99):.0f}, max {lengths.max()}, "
          f"{lengths.sum()} tokens")
    print(f"cost model Qwen3-8B: a = {cost.linear:.4e} FLOPs/token, b = {cost.quadratic:.4e} FLOPs per s^2 "
          f"(a/b = {cost.linear / cost.quadratic:.0f}); {cost_source}")

    result = {"args": vars(args), "sigma": sigma, "max_len": max_len,
              "cost": {"linear": cost.linear, "quadratic": cost.quadratic, "source": cost_source}, "tables": []}
    for M in args.micro_batches:
        rows = compare(lengths, args.pack_size, args.replicas, M, cost, args.seed, not args.no_kk)
        print_table(rows, args.replicas, M, args.pack_size)
        result["tables"].append({"replicas": args.replicas, "micro_batches": M, "rows": rows})
    if not args.no_stream:
        ls = lengths if args.stream_samples is None else lengths[: args.stream_samples]
        srows = streaming(ls, args.pack_size, args.buffers)
        print_stream(srows, args.pack_size)
        result["streaming"] = {"num_samples": int(ls.size), "rows": srows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=float)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
