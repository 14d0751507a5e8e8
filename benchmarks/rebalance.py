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
then ``handle.restore(values)`` of one float per rollout; and, for comparison, ``ThdCollator(pack_size=...)``
packing the rank's own rollouts (what a rank does without rebalancing: ``rebalance`` minus it is the overhead).

The step it saves, from the cost model: ``CostModel.from_config(Qwen3-8B)`` (training FLOPs,
``a·Σ s + b·Σ s²``) of every rank's packs, divided by ``--tflops`` (default 400 TFLOP/s per GPU,
bf16 at ~40% MFU on an H100). Without rebalancing each rank packs its own rollouts (best-fit
decreasing, ``plan_packs``) and the step waits for the most loaded rank; with it, for the most
loaded rank of the balanced plan. ``saved`` = before − after; ``saved / cost`` compares that
with the time ``rebalance`` + ``restore`` took here (gloo over loopback on a CPU: an upper bound
next to NCCL on a GPU node, where the bytes move over NVLink / InfiniBand).

Prints the table; no assertions.
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
        cost = CostModel.from_config(QWEN3_8B)
        lengths = rollout_lengths(world * args.samples_per_rank, args.pack_size, args.seed)
        results = {}
        for how in ("random", "skewed"):
            mine = deal(lengths, world, how, args.seed)[rank]
            samples = make_samples(mine, args.seed + rank)
            run = lambda: rebalance(samples, args.pack_size, micro_batches=args.micro_batches, cost=cost)  # noqa: E731
            seconds, (batches, handle) = timed(run, args.repeats, dist.barrier)
            values = torch.randn(handle.sample_ids.size, dtype=torch.float32)
            restore_seconds, _ = timed(lambda: handle.restore(values), args.repeats, dist.barrier)
            collate = ThdCollator(pack_size=args.pack_size)
            collate_seconds, _ = timed(lambda: collate(samples), args.repeats, dist.barrier)
            sent = int(sum(s["input_ids"].nbytes + s["labels"].nbytes for s in samples))
            results[how] = dict(seconds=seconds, restore=restore_seconds, collate=collate_seconds,
                                after=handle.rank_costs.tolist(),
                                before=own_packs_cost(mine, args.pack_size, cost), bytes=sent,
                                micro_batches=len(batches), samples=int(mine.size))
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


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
                         restore_ms=1e3 * restore, collate_ms=1e3 * collate,
                         straggler_before=before.max() / before.mean(),
                         straggler_after=after.max() / after.mean(), step_before_s=step_before,
                         step_after_s=step_after, saved_s=saved, saved_per_cost=saved / (seconds + restore),
                         micro_batches=runs[0]["micro_batches"]))
    return rows


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
    print(f"thdpack {thdpack.__version__}, torch {torch.__version__}, python {platform.python_version()}, "
          f"{platform.machine()}; {args.ranks} gloo ranks on this CPU, 1 torch thread each")
    print(f"{args.samples_per_rank} rollouts per rank, prompt lognormal(6, 0.6) + completion lognormal(6.5, 1), "
          f"pack {args.pack_size}, micro_batches {args.micro_batches}; Qwen3-8B cost at {args.tflops:.0f} TFLOP/s; "
          f"median of {args.repeats}\n")
    print(f"{'input':<7} {'samples':>7} {'MB':>7} {'rebalance':>10} {'/1000':>8} {'restore':>8} {'collate':>8} "
          f"{'straggler':>16} {'step before':>12} {'after':>8} {'saved':>8} {'saved/cost':>11}")
    for r in rows:
        print(f"{r['input']:<7} {r['samples']:>7} {r['megabytes']:>7.1f} {r['rebalance_ms']:>8.1f}ms "
              f"{r['per_1000_ms']:>6.1f}ms {r['restore_ms']:>6.1f}ms {r['collate_ms']:>6.1f}ms "
              f"{r['straggler_before']:>7.3f} -> {r['straggler_after']:>5.3f} {r['step_before_s']:>11.3f}s "
              f"{r['step_after_s']:>7.3f}s {r['saved_s']:>7.3f}s {r['saved_per_cost']:>10.1f}x")
    print("\nrebalance: gather, plan, all-to-all and the rank's packs built; collate: the rank packing its own "
          "rollouts (ThdCollator), what it does without rebalancing\nsaved: step time of the most loaded rank, "
          "without minus with rebalancing (cost model); saved/cost: that over rebalance + restore time here")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
