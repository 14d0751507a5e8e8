"""Benchmark: hybrid (per-sample) context parallelism: static CP, megatron-core's BalancedCPScheduler and
thdpack's plan on the same global batch, side by side.

    python benchmarks/hybrid_cp.py                         # 8 and 64 ranks, 500 short samples per rank
    python benchmarks/hybrid_cp.py --ranks 8 --samples-per-rank 100
    python benchmarks/hybrid_cp.py --json out.json

The global batch of ``R`` data-parallel × CP ranks: ``--samples-per-rank`` × ``R`` chats of uniform
0.5k–4k tokens and, for every 500 of them, one document of uniform 32k–128k tokens (at least one), from
``numpy.random.default_rng(--seed)``. A rank holds at most ``--max-tokens-per-rank`` (16384) tokens of a
micro-batch: a 128k document needs 8 ranks.

Schedules:

* ``static CP``: every sample split over all ``R`` ranks (cp = R, dp = 1), padded to ``2R``;
* ``BalancedCPScheduler``: megatron-core 0.19.2's own ``get_groups_and_subsamples`` (run in a subprocess from
  the wheel tests/megatron_env.py unpacks; its ``dp_cp_group`` is an object with ``size() = R``, the one thing
  it reads of it), each sample padded to ``2k`` for its ``k`` (megatron-core's own dataset pads every sample
  to ``2·R``: given as ``pad 2R``);
* ``thdpack``: :func:`thdpack.plan_hybrid_cp` with ``CostModel.from_config(Qwen3-8B)``.

Columns: ``straggler`` Σ over groups of the busiest rank's load / the mean rank's load (1.0: no rank waits;
groups end at a barrier), by megatron-core's own estimate ``s²/k`` and by Qwen3-8B training FLOPs
(``a·s + b·s²``, split ``1/k`` per rank); ``groups``; ``CP tokens`` ``Σ s·(k − 1)``, the tokens whose K/V
travel to other ranks (communication); ``padding`` pad slots the schedule needs, % of the real tokens;
``time`` the planning wall time. Measures and prints; no assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from thdpack import CostModel, plan_hybrid_cp  # noqa: E402
from thdpack.common.align import cp_pad_multiple, round_up  # noqa: E402
from thdpack.planning.hybrid_cp import schedule_cost  # noqa: E402

QWEN3_8B = json.loads((ROOT / "configs" / "models" / "qwen3-8b.json").read_text())

# run in a subprocess with megatron-core's wheel on PYTHONPATH: its BalancedCPScheduler on every case
_MEGATRON = r"""
import json, sys, time, types
from pathlib import Path
import megatron
root = Path(list(megatron.__path__)[0]).parent
for name in ("megatron.core", "megatron.core.pipeline_parallel"):  # their __init__ import the model zoo / Triton
    module = types.ModuleType(name); module.__path__ = [str(root / name.replace(".", "/"))]; sys.modules[name] = module
from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
class Group:  # what the scheduler reads of dp_cp_group
    def __init__(self, n): self.n = n
    def size(self): return self.n
out = []
for case in json.loads(sys.stdin.read()):
    start = time.perf_counter()
    scheduler = BalancedCPScheduler(max_seq_len_per_rank=case["budget"], dp_cp_group=Group(case["ranks"]))
    _, groups = scheduler.get_groups_and_subsamples(list(enumerate(case["lengths"])), None)
    out.append({"groups": groups, "seconds": time.perf_counter() - start})
print(json.dumps(out))
"""


def lengths_of(ranks: int, per_rank: int, seed: int, budget: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    short = rng.integers(512, 4097, ranks * per_rank)
    longest = min(131072, budget * ranks) - 2 * ranks  # fits the whole budget after padding
    long = rng.integers(32768, max(32769, longest), max(1, ranks * per_rank // 500))
    return np.concatenate([short, long])


def megatron_schedules(cases: list[dict]) -> list[dict] | str:
    sys.path.insert(0, str(ROOT / "tests"))
    import megatron_env

    site = megatron_env.bridge_site()
    if isinstance(site, str):
        return f"megatron-core 0.19.2 not available: {site}"
    env = dict(os.environ, PYTHONPATH=str(site), PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", _MEGATRON], input=json.dumps(cases), capture_output=True, text=True,
                          env=env, timeout=3600)
    if done.returncode:
        return f"BalancedCPScheduler failed: {done.stderr.strip().splitlines()[-1] if done.stderr else done.returncode}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def padding_of(groups, lengths: np.ndarray, multiple) -> int:
    """Pad slots of a schedule: each sample rounded up to ``multiple(k)`` for its ``k`` in its group."""
    pad = 0
    for group in groups:
        counts: dict[int, int] = {}
        for ids in group:
            for i in ids:
                counts[int(i)] = counts.get(int(i), 0) + 1
        for i, k in counts.items():
            pad += int(round_up(np.array([lengths[i]]), multiple(k))[0] - lengths[i])
    return pad


def row(name: str, groups, lengths: np.ndarray, flops: CostModel, seconds: float, multiple) -> dict:
    mine, theirs = schedule_cost(groups, lengths), schedule_cost(groups, lengths, flops)
    return {"schedule": name, "straggler_s2": mine["straggler"], "straggler_flops": theirs["straggler"],
            "groups": mine["groups"], "cp_tokens": mine["cp_tokens"],
            "padding": padding_of(groups, lengths, multiple) / float(lengths.sum()), "seconds": seconds}


def run(ranks: int, per_rank: int, seed: int, budget: int, megatron: dict | str) -> list[dict]:
    lengths = lengths_of(ranks, per_rank, seed, budget)
    flops = CostModel.from_config(QWEN3_8B)
    rows = [row("static CP", [[list(range(lengths.size))] * ranks], lengths, flops, 0.0, cp_pad_multiple)]
    if isinstance(megatron, str):
        rows.append({"schedule": "BalancedCPScheduler", "skipped": megatron})
    else:
        rows.append(row("BalancedCPScheduler", megatron["groups"], lengths, flops, megatron["seconds"],
                        cp_pad_multiple))
        rows[-1]["padding_2R"] = padding_of(megatron["groups"], lengths, lambda k: 2 * ranks) / float(lengths.sum())
    start = time.perf_counter()
    plan = plan_hybrid_cp(lengths, ranks, budget, cost=flops)
    seconds = time.perf_counter() - start
    rows.append(row("thdpack plan_hybrid_cp", plan.sample_id_groups(), lengths, flops, seconds, cp_pad_multiple))
    for r in rows:
        r.update(ranks=ranks, samples=int(lengths.size), long=int((lengths >= 32768).sum()))
    return rows


def show(rows: list[dict]) -> None:
    head = (f"{'ranks':>5} {'samples':>7} {'schedule':<24} {'straggler s2/k':>14} {'straggler FLOPs':>15} "
            f"{'groups':>6} {'CP tokens':>12} {'padding':>8} {'time s':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "skipped" in r:
            print(f"{r['ranks']:>5} {r['samples']:>7} {r['schedule']:<24} skipped: {r['skipped']}")
            continue
        extra = f"  (its dataset pads to 2R: {100 * r['padding_2R']:.2f}%)" if "padding_2R" in r else ""
        print(f"{r['ranks']:>5} {r['samples']:>7} {r['schedule']:<24} {r['straggler_s2']:>14.4f} "
              f"{r['straggler_flops']:>15.4f} {r['groups']:>6} {r['cp_tokens']:>12,} {100 * r['padding']:>7.2f}% "
              f"{r['seconds']:>7.3f}{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--samples-per-rank", type=int, default=500)
    parser.add_argument("--max-tokens-per-rank", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cases = [{"ranks": r, "budget": args.max_tokens_per_rank,
              "lengths": lengths_of(r, args.samples_per_rank, args.seed, args.max_tokens_per_rank).tolist()}
             for r in args.ranks]
    megatron = megatron_schedules(cases)
    rows = []
    for i, r in enumerate(args.ranks):
        rows += run(r, args.samples_per_rank, args.seed, args.max_tokens_per_rank,
                    megatron if isinstance(megatron, str) else megatron[i])
    print(f"python {platform.python_version()}, numpy {np.__version__}; lengths: uniform 0.5k-4k chats, one 32k-128k "
          f"document per 500; max_tokens_per_rank={args.max_tokens_per_rank}; FLOPs: Qwen3-8B")
    show(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
