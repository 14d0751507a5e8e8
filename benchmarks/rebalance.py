"""Benchmark: what run-time rebalancing (``thdpack.rebalance``) costs on 4 gloo ranks, against the
step time it saves.

    python benchmarks/rebalance.py                        # 4 ranks x 250 rollouts (1,000 per step)
    python benchmarks/rebalance.py --samples-per-rank 2500 --tflops 400
    python benchmarks/rebalance.py --json out.json

``--ranks`` processes (forked, one torch thread each) form a real ``gloo`` group on this machine's
CPU. Each rank holds ``--samples-per-rank`` RL rollouts: a prompt of lognormal(6, 0.6) tokens and
a completion of lognormal(6.5, 1) tokens, clipped to ``--pack-size`` (8192) in total, as numpy
``input_ids`` / ``labels``. Two inputs, from the same lengths:

* ``random``: rollouts dealt to ranks at random (rank-to-rank noise only);
* ``skewed``: sorted by length, rank ``r`` holding the ``r``-th quarter (one rank has every long
  rollout: the prompts of one rank were the hard ones).

Timed (median of ``--repeats``, after one untimed call, every rank between barriers; the slowest
rank's time): ``rebalance(samples, pack_size, micro_batches=M, cost=Qwen3-8B)``, i.e. the
gather of lengths, the plan, the all-to-all of the rollouts and the build of the rank's packs;
the plan alone (``plan_route`` of the gathered records, what every rank computes; timed in the
parent process, the ranks done); then
``handle.restore(values)`` of one float per rollout; and, for comparison, ``ThdCollator(pack_size=...)``
packing the rank's own rollouts (what a rank does without rebalancing: ``rebalance`` minus it is the overhead).

A third input, ``near-full`` (issue 37), on the first two ranks: rank 0 with 40 rollouts of 50–900
tokens, rank 1 with 10 of 50–100 (22,635 tokens), packs of 2,048, ``micro_batches=2``, tokens as the
cost: 12 packs for 3 steps × 2 ranks × 2, the last one nearly empty if packs are filled first.

The step it saves, from the cost model: ``CostModel.from_config(Qwen3-8B)`` (training FLOPs,
``a·Σ s + b·Σ s²``) of every rank's packs, divided by ``--tflops`` (default 400 TFLOP/s per GPU,
bf16 at ~40% MFU on an H100). Without rebalancing each rank packs its own rollouts (best-fit
decreasing, ``plan_packs``) and the step waits for the most loaded rank; with it, for the most
loaded rank of the balanced plan. ``saved`` = before − after; ``saved / cost`` compares that
with the time ``rebalance`` + ``restore`` took here (gloo over loopback on a CPU: an upper bound
next to NCCL on a GPU node, where the bytes move over NVLink / InfiniBand).

``straggler`` is before (each rank its own packs) -> after, ``bound`` the ``handle.straggler_bound``
beside it: the least straggler any plan of those rollouts on those ranks could reach.

Prints the tables; no assertions.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import thdpack
from thdpack import CostModel, ThdCollator, plan_packs, rebalance
from thdpack.loaders.routing import RankRecord, plan_route
from thdpack.planning.options import PlanOptions

QWEN3_8B = json.loads((Path(__file__).resolve().parents[1] / "configs" / "models" / "qwen3-8b.json").read_text())


def rollout_lengths(n: int, pack_size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    prompt, completion = rng.lognormal(6.0, 0.6, n), rng.lognormal(6.5, 1.0, n)
    return np.clip(prompt + completion, 8, pack_size).astype(np.int64)


def deal(lengths: np.ndarray, ranks: int, how: str, seed: int) -> list[np.ndarray]:
    """The lengths of every rank: shuffled (``random``) or by sorted quarters (``skewed``)."""
    order = np.random.default_rng(seed).permutation(lengths.size) if how == "random" else np.argsort(lengths)
    return [lengths[part] for part in np.array_split(order, ranks)]


def make_samples(lengths: np.ndarray, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for s in lengths.tolist():
        ids = rng.integers(1, 150_000, s)
        labels = ids.copy()
        labels[: s // 4] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def timed(fn, repeats: int, barrier) -> tuple[float, object]:
    """Median wall time of ``fn()`` over ``repeats`` calls (one untimed call first), between barriers."""
    barrier()
    result = fn()
    times = []
    for _ in range(repeats):
        barrier()
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _worker(rank: int, world: int, init_file: str, out_dir: str, args) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        pair = dist.new_group([0, 1]) if world >= 2 else None
        cost = CostModel.from_config(QWEN3_8B)
        lengths = rollout_lengths(world * args.samples_per_rank, args.pack_size, args.seed)
        results = {}
        for how in ("random", "skewed"):
            parts = deal(lengths, world, how, args.seed)
            results[how] = _timed_input(parts, rank, args, cost, dist.barrier)
        if pair is not None and rank < 2:
            results["near-full"] = _near_full(rank, pair)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _timed_input(parts: list[np.ndarray], rank: int, args, cost: CostModel, barrier) -> dict:
    """One input on every rank: ``rebalance``, the plan alone, ``restore`` and the rank's own collate, timed."""
    mine = parts[rank]
    samples = make_samples(mine, args.seed + rank)
    run = lambda: rebalance(samples, args.pack_size, micro_batches=args.micro_batches, cost=cost)  # noqa: E731
    seconds, (batches, handle) = timed(run, args.repeats, barrier)
    values = torch.randn(handle.sample_ids.size, dtype=torch.float32)
    restore_seconds, _ = timed(lambda: handle.restore(values), args.repeats, barrier)
    collate = ThdCollator(pack_size=args.pack_size)
    collate_seconds, _ = timed(lambda: collate(samples), args.repeats, barrier)
    sent = int(sum(s["input_ids"].nbytes + s["labels"].nbytes for s in samples))
    return dict(seconds=seconds, restore=restore_seconds, collate=collate_seconds,
                after=handle.rank_costs.tolist(), bound=handle.straggler_bound,
                before=own_packs_cost(mine, args.pack_size, cost), bytes=sent, micro_batches=len(batches),
                samples=int(mine.size))


def plan_seconds(args, how: str) -> float:
    """The plan alone (``plan_route`` of every rank's lengths, what each rank computes), in this process:
    median of ``max(repeats, 5)`` after one untimed call."""
    cost = CostModel.from_config(QWEN3_8B)
    parts = deal(rollout_lengths(args.ranks * args.samples_per_rank, args.pack_size, args.seed), args.ranks, how,
                 args.seed)
    records = [RankRecord(p.astype(np.int64), None, np.zeros(p.size, np.int64)) for p in parts]
    options = PlanOptions(args.pack_size)
    return timed(lambda: plan_route(records, options, micro_batches=args.micro_batches, cost=cost),
                 max(args.repeats, 5), lambda: None)[0]


def near_full_lengths(rank: int) -> np.ndarray:
    """Issue 37's step: rank 0's 40 rollouts of 50–900 tokens, rank 1's 10 of 50–100 (22,635 in all)."""
    rng = np.random.default_rng(22158)
    mine, theirs = rng.integers(50, 901, 40), rng.integers(50, 101, 10)
    return (mine, theirs)[rank]


def _near_full(rank: int, pair) -> dict:
    """The near-full step on the first two ranks: tokens as the cost, packs of 2,048, 2 micro-batches."""
    mine = near_full_lengths(rank)
    batches, handle = rebalance(make_samples(mine, rank), 2048, micro_batches=2, group=pair)
    return dict(after=handle.rank_costs.tolist(), bound=handle.straggler_bound, micro_batches=len(batches),
                before=own_packs_cost(mine, 2048, CostModel()), packs=[int(b.num_tokens) for b in batches])


def own_packs_cost(lengths: np.ndarray, pack_size: int, cost: CostModel) -> float:
    """The cost of a rank's own rollouts, packed by itself (BFD), without rebalancing."""
    plan = plan_packs(lengths, pack_size)
    return float(cost.pack_costs(plan).sum())


def table(per_rank: list[dict], args) -> list[dict]:
    rows = []
    total = args.ranks * args.samples_per_rank
    for how in ("random", "skewed"):
        runs = [r[how] for r in per_rank]
        seconds = max(r["seconds"] for r in runs)
        restore = max(r["restore"] for r in runs)
        collate = max(r["collate"] for r in runs)
        before, after = np.array([r["before"] for r in runs]), np.array(runs[0]["after"])
        flops_per_s = args.tflops * 1e12
        step_before, step_after = before.max() / flops_per_s, after.max() / flops_per_s
        saved = step_before - step_after
        rows.append(dict(input=how, samples=total, megabytes=sum(r["bytes"] for r in runs) / 1e6,
                         rebalance_ms=1e3 * seconds, per_1000_ms=1e3 * seconds * 1000 / total,
                         plan_ms=1e3 * plan_seconds(args, how),
                         restore_ms=1e3 * restore, collate_ms=1e3 * collate,
                         straggler_before=before.max() / before.mean(),
                         straggler_after=after.max() / after.mean(), bound=runs[0]["bound"],
                         step_before_s=step_before, step_after_s=step_after, saved_s=saved,
                         saved_per_cost=saved / (seconds + restore), micro_batches=runs[0]["micro_batches"]))
    return rows


def near_full_row(per_rank: list[dict]) -> dict | None:
    """The near-full step's straggler (tokens) before -> after, its bound and every rank's packs."""
    runs = [r["near-full"] for r in per_rank if "near-full" in r]
    if not runs:
        return None
    before, after = np.array([r["before"] for r in runs]), np.array(runs[0]["after"])
    return dict(input="near-full", straggler_before=before.max() / before.mean(),
                straggler_after=after.max() / after.mean(), bound=runs[0]["bound"],
                packs=[r["packs"] for r in runs], micro_batches=runs[0]["micro_batches"])


def print_tables(rows: list[dict], near: dict | None, args) -> None:
    print(f"thdpack {thdpack.__version__}, torch {torch.__version__}, python {platform.python_version()}, "
          f"{platform.machine()}; {args.ranks} gloo ranks on this CPU, 1 torch thread each")
    print(f"{args.samples_per_rank} rollouts per rank, prompt lognormal(6, 0.6) + completion lognormal(6.5, 1), "
          f"pack {args.pack_size}, micro_batches {args.micro_batches}; Qwen3-8B cost at {args.tflops:.0f} TFLOP/s; "
          f"median of {args.repeats}\n")
    print(f"{'input':<9} {'samples':>7} {'MB':>7} {'rebalance':>10} {'/1000':>8} {'plan':>7} {'restore':>8} "
          f"{'collate':>8} {'straggler':>16} {'bound':>6} {'step before':>12} {'after':>8} {'saved':>8} "
          f"{'saved/cost':>11}")
    for r in rows:
        print(f"{r['input']:<9} {r['samples']:>7} {r['megabytes']:>7.1f} {r['rebalance_ms']:>8.1f}ms "
              f"{r['per_1000_ms']:>6.1f}ms {r['plan_ms']:>5.1f}ms {r['restore_ms']:>6.1f}ms {r['collate_ms']:>6.1f}ms "
              f"{r['straggler_before']:>7.3f} -> {r['straggler_after']:>5.3f} {r['bound']:>6.3f} "
              f"{r['step_before_s']:>11.3f}s {r['step_after_s']:>7.3f}s {r['saved_s']:>7.3f}s "
              f"{r['saved_per_cost']:>10.1f}x")
    print("\nrebalance: gather, plan, all-to-all and the rank's packs built; plan: plan_route alone; collate: the "
          "rank packing its own rollouts (ThdCollator), what it does without rebalancing\nstraggler: each rank its "
          "own packs -> rebalanced; bound: the least straggler any plan of those rollouts could reach\nsaved: step "
          "time of the most loaded rank, without minus with rebalancing (cost model); saved/cost: that over "
          "rebalance + restore time here")
    if near is not None:
        print(f"\nnear-full step (issue 37), ranks 0-1: 40 rollouts of 50-900 tokens and 10 of 50-100 (22,635), "
              f"packs of 2048, micro_batches 2, tokens as the cost: straggler {near['straggler_before']:.3f} -> "
              f"{near['straggler_after']:.3f}, bound {near['bound']:.3f}")
        for rank, packs in enumerate(near["packs"]):
            print(f"  rank {rank}: {' '.join(map(str, packs))} tokens")


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4, help="gloo processes (default 4)")
    ap.add_argument("--samples-per-rank", type=int, default=250, help="rollouts per rank (default 250)")
    ap.add_argument("--pack-size", type=int, default=8192)
    ap.add_argument("--micro-batches", type=int, default=1, help="micro-batches per rank per plan step (default 1)")
    ap.add_argument("--tflops", type=float, default=400.0, help="achieved TFLOP/s per GPU of the step (default 400)")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls, the median kept (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(args.ranks, f"{tmp}/init", tmp, args), nprocs=args.ranks, join=True,
                           start_method="fork")
        per_rank = [torch.load(f"{tmp}/rank{r}.pt", weights_only=False) for r in range(args.ranks)]
    rows = table(per_rank, args)
    near = near_full_row(per_rank)
    print_tables(rows, near, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "near_full": near}, f, indent=2)
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
