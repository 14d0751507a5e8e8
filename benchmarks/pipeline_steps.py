"""Benchmark: one pipeline-parallel step planned five ways, simulated with megatron-core's schedules.

    python benchmarks/pipeline_steps.py                 # 16 configurations (SFT, RL x PP 4/8 x DP 8/64 x VPP 1/2)
    python benchmarks/pipeline_steps.py --quick         # 4 small configurations (CI smoke, a few seconds)
    python benchmarks/pipeline_steps.py --configs rl:pp8  # only configurations whose name holds every ':' part
    python benchmarks/pipeline_steps.py --seed 1

Every configuration draws one global batch (seeded) and plans it for ``DP`` pipelines of ``PP`` stages
(``VPP`` model chunks per stage, ``vpp_group = PP``) under one token cap per micro-batch
(``--cap``, 16384 tokens). Each rank's micro-batch costs, in run order, are simulated op by op with
:func:`thdpack.planning.pipeline_parallel.simulate.step_time` (megatron-core's 1F1B / interleaved 1F1B, dataflow model).

Lengths (seeded, numpy ``default_rng``):

- ``sft``: ``--per-rank`` (48) samples per DP rank, lognormal (median 1500 tokens, sigma 1.0), clipped to
  [32, cap]: long-tailed, a few at the cap.
- ``rl``: GRPO-style, ``--per-rank`` / 8 prompts per DP rank with ``G = 8`` rollouts each: prompt lognormal
  (median 400, sigma 0.5, <= 2048) shared by its rollouts' lengths, response lognormal (median 2000, sigma 1.0),
  clipped to 8192 (the max response length: ~9% hit it). No ``groups`` are passed to any strategy (GRPO's loss
  does not need a group on one rank).

Cost model (a ~8B dense model, Llama-3-8B shapes: 32 layers, hidden 4096): forward + backward FLOPs of a sample
of ``s`` tokens ~ ``6·8e9·s + 6·32·4096·s²`` (causal attention); in units of the linear term
``CostModel(linear=1, quadratic=1.64e-5)``: attention is ~21% of a sample at the cap (16384), ~3% at 2000.

Strategies, on the SAME global batch and cap (``n`` samples in dataset order):

- ``fixed``: the naive baseline. Rank ``r`` gets the ``r``-th consecutive chunk of ``n / DP`` samples, cut in
  dataset order greedily into micro-batches of <= cap tokens; ``m`` = the most any rank needs, rounded up to the
  VPP multiple; a rank with fewer runs fillers in its last slots, each the cheapest thing that can run: one copy of
  its shortest sample with no targets (the same filler :func:`thdpack.planning.plan_steps` uses; it costs).
- ``verl``: volcengine/verl (mirror at commit b178a3c, 2026-01), with ``balance_batch`` and ``use_dynamic_bsz``:
  (1) ``RayPPOTrainer._balance_batch`` (verl/trainer/ppo/ray_trainer.py): samples dealt to DP ranks by
  ``get_seqlen_balanced_partitions(workload, dp, equal_size=True)`` (Karmarkar-Karp largest differencing,
  ``karmarkar_karp`` in verl/utils/seqlen_balancing.py), the workload ``calculate_workload`` =
  ``24576·s + s²`` (their 7B calibration, not our cost model); (2) per rank
  ``rearrange_micro_batches`` (verl/utils/seqlen_balancing.py): ``m = min(n_rank, ceil(tokens / cap))``,
  all-reduced MAX over ranks, then ``roundup_divisible(m, microbatch_group_size_per_vp_stage)`` when VPP > 1
  (``num_batches_divided_by``, verl/workers/actor/megatron_actor.py); micro-batches =
  ``get_seqlen_balanced_partitions(workload, m, equal_size=False)`` (KK on the workload: the token cap is NOT
  enforced, a micro-batch may exceed it: column ``max/cap``); (3) ``use_dynamic_bsz_balance``: micro-batches
  sorted by workload descending, then ``idx[::2][::-1] + idx[1::2]`` (the smaller ones at both ends).
  (verl #2452 is sometimes described as "ordered by sum s²"; the code read sorts by the workload sum,
  ``24576·s + s²`` summed, and puts small ones at both ends: that is what is implemented.)
- ``slime``: THUDM/slime (mirror at commit 624b824), ``build_dp_schedule`` in slime/utils/dp_schedule.py
  ("pack first, distribute second") with ``use_dynamic_batch_size`` and ``balance_data``: (1) the step's samples
  packed in dataset order by ``first_fit_pack`` (slime/utils/seqlen_balancing.py, cap enforced); (2) the bin
  count raised to a multiple of ``DP · (microbatch_group_size_per_vp_stage if VPP > 1 else 1)`` by
  ``expand_bins_by_splitting`` (split the bin with the most tokens into two halves, LPT by tokens); (3) bins dealt
  to ranks by ``get_seqlen_balanced_partitions(bin FLOPs, DP, equal_size=True)`` (KK; FLOPs by
  ``calculate_fwd_flops``, i.e. the model's real FLOPs: our cost model); (4) a rank runs its bins in bin-index
  order (the partition lists come back sorted; no reordering). The KK-over-ranks-by-FLOPs (#2017/#2029) and
  VPP-multiple (#1926) rules of the brief are these steps.
- ``megatron``: NVIDIA/Megatron-LM main, ``DpBalancedScheduler`` in megatron/core/datasets/data_schedule.py
  (merged in #6626/#6684; in no megatron-core release yet, so not run here: re-implemented from the source read),
  ``sequence_packing_scheduler = "dp_balanced"``, ``cp_size = 1``: (1) ``get_groups_and_subsamples`` walks the
  global batch (every DP rank's samples gathered in rank order: our dataset order) and appends a sample to the
  current pack while ``sum + s <= max_seq_len_all_ranks`` (``max_seqlen_per_dp_cp_rank · cp_size``: the cap) and,
  where ``thd_max_packed_sequences`` is set, the pack holds fewer than ``max_num_seqs`` (unset here: no limit),
  else starts a new pack (cap enforced; a sample is never split); (2) while the pack count is not a multiple of
  ``dp_size · microbatch_group_size_per_vp_stage`` (the group only when VPP is configured, else ``dp_size``), it
  walks back from the last original pack, popping the last sample of a pack with more than one sample into a
  new single-sample pack appended at the end (``assert i >= 0, "Not enough samples to move"``; an older revision
  asserts ``i > 0``, never splitting pack 0): when that assert would fire the row says ``refused``; (3)
  ``num_micro_batches = packs / dp_size`` and micro-batch ``i`` of DP rank ``j`` is pack ``i·dp_size + j``
  (round-robin in pack order: no cost balancing across ranks, no reordering within one). Its FLOPs statistics
  (``seqlen_sum`` / ``seqlen_squared_sum`` of the global batch) do not change the plan.
- ``thdpack``: :func:`thdpack.planning.plan_steps` (default ``order_budget``).

Karmarkar-Karp is re-implemented here from the algorithm (largest differencing for k sets: every state is k
sums, the two states of largest spread merge largest-with-smallest; ``equal_size`` seeds states with k items
of consecutive sorted rank), with verl's tie rules as far as they matter; no code is copied.

Columns: ``m`` micro-batches per rank; ``step`` the simulated step time (its slowest rank; unit: the linear cost
of one token, over all stages); ``bubble`` of the slowest rank (``1 − (its cost / P) / its step time``);
``strag`` max / mean of the ranks' SIMULATED step times; ``max/cap`` the largest micro-batch's tokens over the cap
(``!`` over 1: that plan would not fit in memory); ``bound`` :attr:`thdpack.planning.StepPlan.step_time_bound`
(depends only on the samples: valid for every strategy); ``/thd`` step time over thdpack's. Every plan is checked:
every sample in exactly one micro-batch (assert), and for fixed, slime, megatron and thdpack no micro-batch over
the cap (assert; verl's rule does not promise it, so it is reported instead). A strategy whose own code would assert on the
batch (only with tiny batches, e.g. ``--per-rank 2``: verl's ``num_micro_batches`` over a rank's samples, slime's
split with no bin left to split, megatron's "Not enough samples to move") prints ``refused`` and is left out of the
comparison (listed at the end).

Then once, the order effect: one rank's micro-batches simulated in thdpack's order, sorted descending, and
in dataset order (by their first sample).

Measured on this 2-CPU machine (``python benchmarks/pipeline_steps.py``, seed 0): see docs/rl.md, section
"Pipeline parallelism: the benchmark".
"""

from __future__ import annotations

import argparse
import heapq
import sys
import time

import numpy as np

from thdpack import CostModel
from thdpack.planning.pipeline_parallel.simulate import PipelineShape, step_time
from thdpack.planning.pipeline_parallel.steps import order_micro_batches, plan_steps

LINEAR, QUADRATIC = 1.0, 6 * 32 * 4096 / (6 * 8e9)  # ~1.64e-5: a ~8B dense model (module docstring)
COST = CostModel(LINEAR, QUADRATIC)
STRATEGIES = ("fixed", "verl", "slime", "megatron", "thdpack")


def sample_costs(lengths) -> np.ndarray:
    s = np.asarray(lengths, np.float64)
    return LINEAR * s + QUADRATIC * s * s


def verl_workload(lengths) -> np.ndarray:
    """verl's ``calculate_workload``: ``24576·s + s²``."""
    s = np.asarray(lengths, np.int64)
    return 24576 * s + s * s


# ---------------------------------------------------------------- lengths


def sft_lengths(rng, n: int, cap: int) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(np.log(1500), 1.0, n)), 32, cap).astype(np.int64)


def rl_lengths(rng, n: int, cap: int, group: int = 8, max_response: int = 8192) -> np.ndarray:
    prompts = max(1, n // group)
    prompt = np.clip(np.round(rng.lognormal(np.log(400), 0.5, prompts)), 16, 2048).astype(np.int64)
    response = np.clip(np.round(rng.lognormal(np.log(2000), 1.0, prompts * group)), 1, max_response).astype(np.int64)
    return np.minimum(np.repeat(prompt, group) + response, cap)


# ---------------------------------------------------------------- Karmarkar-Karp (largest differencing)


def karmarkar_karp(values, k: int, equal_size: bool) -> list[list[int]]:
    """Partition item indices into ``k`` lists of near-equal value sums (largest differencing method). A state is
    ``k`` (sum, items) sets, largest first; the two states of largest spread merge, the first's largest set with
    the second's smallest. ``equal_size``: states are seeded with ``k`` items of consecutive sorted rank (every
    list then holds ``len / k`` items). Each list comes back sorted (as ``get_seqlen_balanced_partitions``)."""
    vals = [int(v) for v in values]
    order = sorted(range(len(vals)), key=lambda i: (vals[i], i))
    heap, tick = [], 0

    def push(sets):
        nonlocal tick
        sets.sort(key=lambda s: (s[0], len(s[1])), reverse=True)
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), -sets[0][0], tick, sets))
        tick += 1

    if equal_size:
        assert len(vals) % k == 0, (len(vals), k)
        for lo in range(0, len(order), k):
            push([[vals[i], [i]] for i in order[lo:lo + k]])
    else:
        for i in order:
            push([[vals[i], [i]]] + [[0, []] for _ in range(k - 1)])
    while len(heap) > 1:
        a = heapq.heappop(heap)[3]
        b = heapq.heappop(heap)[3]
        push([[a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]] for j in range(k)])
    return [sorted(s[1]) for s in heap[0][3]]


# ---------------------------------------------------------------- strategies: list[rank] of list[micro-batch index arrays]


def _filler(rank_samples, lengths):
    return np.array([min(rank_samples, key=lambda i: (lengths[i], i))], np.int64)


def plan_fixed(lengths, dp: int, cap: int, multiple: int):
    n = lengths.size
    bounds = np.linspace(0, n, dp + 1).round().astype(int)
    ranks = []
    for r in range(dp):
        mbs, cur, tok = [], [], 0
        for i in range(bounds[r], bounds[r + 1]):
            if cur and tok + lengths[i] > cap:
                mbs.append(np.array(cur, np.int64))
                cur, tok = [], 0
            cur.append(i)
            tok += int(lengths[i])
        if cur:
            mbs.append(np.array(cur, np.int64))
        ranks.append(mbs)
    m = -(-max(len(x) for x in ranks) // multiple) * multiple
    fill = [[False] * len(x) + [True] * (m - len(x)) for x in ranks]
    ranks = [x + [_filler(range(bounds[r], bounds[r + 1]), lengths)] * (m - len(x)) for r, x in enumerate(ranks)]
    return ranks, fill


def plan_verl(lengths, dp: int, cap: int, multiple: int):
    work = verl_workload(lengths)
    parts = karmarkar_karp(work, dp, equal_size=True)  # _balance_batch
    # _balance_batch then reorders each partition (small at both ends); rearrange_micro_batches re-partitions it,
    # so only the membership matters here.
    m = max(min(len(p), -(-int(lengths[p].sum()) // cap)) for p in parts)  # all_reduce MAX
    m = -(-m // multiple) * multiple  # roundup_divisible(m, microbatch_group_size_per_vp_stage)
    ranks = []
    for p in parts:
        p = np.array(p, np.int64)
        if m > p.size:
            raise Refused("verl asserts num_micro_batches <= the rank's samples")
        mbs = [p[np.array(q, np.int64)] for q in karmarkar_karp(work[p], m, equal_size=False)]
        w = [int(work[q].sum()) for q in mbs]
        idx = sorted(range(m), key=lambda j: (w[j], int(mbs[j][0]) if mbs[j].size else 0), reverse=True)
        idx = idx[::2][::-1] + idx[1::2]
        ranks.append([mbs[j] for j in idx])
    return ranks, [[False] * m for _ in range(dp)]


def plan_slime(lengths, dp: int, cap: int, multiple: int):
    bins, sums = [], []
    for i, s in enumerate(lengths.tolist()):  # first_fit_pack
        for j in range(len(bins)):
            if sums[j] + s <= cap:
                bins[j].append(i)
                sums[j] += s
                break
        else:
            bins.append([i])
            sums.append(s)
    align = dp * multiple
    target = max(-(-len(bins) // align) * align, align)
    while len(bins) < target:  # expand_bins_by_splitting
        cands = [(int(lengths[b].sum()), j) for j, b in enumerate(bins) if len(b) > 1]
        if not cands:
            raise Refused("slime: too few samples to split into the aligned bin count")
        _, j = max(cands)
        halves, hs = [[], []], [0, 0]
        for i in sorted(bins[j], key=lambda i: -lengths[i]):
            h = 0 if hs[0] <= hs[1] else 1
            halves[h].append(i)
            hs[h] += int(lengths[i])
        bins[j] = halves[0]
        bins.append(halves[1])
    costs = sample_costs(lengths)
    flops = [int(round(costs[b].sum())) for b in bins]
    parts = karmarkar_karp(flops, dp, equal_size=True)
    ranks = [[np.array(bins[j], np.int64) for j in p] for p in parts]
    return ranks, [[False] * len(p) for p in parts]


class Refused(Exception):
    """The strategy's own code would assert on this batch (no plan)."""


def plan_megatron(lengths, dp: int, cap: int, multiple: int, max_num_seqs: int | None = None):
    """Megatron-LM's ``DpBalancedScheduler.get_groups_and_subsamples`` (``cp_size = 1``; module docstring)."""
    packs, cur, tok = [], [], 0
    for i, s in enumerate(lengths.tolist()):  # dataset order, cap (and max_num_seqs when set)
        if tok + s <= cap and (max_num_seqs is None or len(cur) < max_num_seqs):
            cur.append(i)
            tok += s
        else:
            packs.append(cur)
            cur, tok = [i], s
    if cur:
        packs.append(cur)
    align = dp * multiple  # dp_size * microbatch_group_size_per_vp_stage (group only with VPP)
    short = -len(packs) % align
    j = len(packs) - 1
    while short > 0:  # single samples popped off the tail of the last multi-sample packs, appended at the end
        if j < 0:
            raise Refused("Not enough samples to move")
        if len(packs[j]) > 1:
            packs.append([packs[j].pop()])
            short -= 1
        else:
            j -= 1
    m = len(packs) // dp
    ranks = [[np.array(packs[i * dp + r], np.int64) for i in range(m)] for r in range(dp)]  # round-robin
    return ranks, [[False] * m for _ in range(dp)]


def plan_thdpack(lengths, dp: int, cap: int, shape: PipelineShape):
    plan = plan_steps(lengths, dp_size=dp, max_tokens_per_micro_batch=cap, pp_size=shape.pp_size,
                      vpp_size=shape.vpp_size, vpp_group=shape.vpp_group, cost=COST)
    return plan


# ---------------------------------------------------------------- checks and simulation


def check(name, ranks, fill, lengths, cap, m, enforce_cap: bool) -> float:
    assert all(len(r) == m for r in ranks), f"{name}: ranks run different micro-batch counts"
    seen = np.concatenate([mb for r, f in zip(ranks, fill) for mb, fl in zip(r, f) if not fl])
    assert seen.size == lengths.size and np.array_equal(np.sort(seen), np.arange(lengths.size)), \
        f"{name}: a sample is missing or scored twice"
    assert all(mb.size > 0 for r in ranks for mb in r), f"{name}: an empty micro-batch"
    worst = max(int(lengths[mb].sum()) for r in ranks for mb in r) / cap
    if enforce_cap:
        assert worst <= 1.0, f"{name}: a micro-batch over the cap ({worst:.3f} x cap)"
    return worst


def simulate(ranks, lengths, shape):
    costs = [np.array([sample_costs(lengths[mb]).sum() for mb in r]) for r in ranks]
    times = np.array([step_time(c, shape) for c in costs])
    r = int(np.argmax(times))
    bubble = 1.0 - costs[r].sum() / shape.pp_size / times[r]
    return float(times.max()), float(bubble), float(times.max() / times.mean()), costs


def run_config(data, pp, dp, vpp, args, rng):
    n = dp * args.per_rank
    lengths = sft_lengths(rng, n, args.cap) if data == "sft" else rl_lengths(rng, n, args.cap)
    shape = PipelineShape(pp, vpp, pp)
    mult = shape.micro_batch_multiple()
    t0 = time.perf_counter()
    plan = plan_thdpack(lengths, dp, args.cap, shape)
    plan_s = time.perf_counter() - t0
    results = {}
    for name in STRATEGIES:
        if name == "thdpack":
            ranks, fill = plan.micro_batches, plan.filler.tolist()
        else:
            try:
                ranks, fill = {"fixed": plan_fixed, "verl": plan_verl, "slime": plan_slime,
                               "megatron": plan_megatron}[name](lengths, dp, args.cap, mult)
            except Refused as e:
                results[name] = dict(refused=str(e))
                continue
        m = len(ranks[0])
        over = check(name, ranks, fill, lengths, args.cap, m, enforce_cap=(name != "verl"))
        t, bubble, strag, costs = simulate(ranks, lengths, shape)
        if name == "thdpack":
            assert abs(t - plan.step_time) <= 1e-9 * t, "thdpack: simulated step differs from StepPlan.step_time"
        results[name] = dict(m=m, t=t, bubble=bubble, strag=strag, over=over, fillers=int(np.sum(fill)))
    return lengths, shape, plan, plan_s, results


def order_demo(lengths, shape, plan, cap):
    """One rank's micro-batches in three run orders: thdpack's slowest rank (its packs are balanced, so order
    matters little), then the ``fixed`` strategy's slowest rank (uneven packs) ordered by
    :func:`thdpack.planning.pipeline_parallel.steps.order_micro_batches` (what plan_steps runs on a rank's costs)."""
    r = int(np.argmax(plan.rank_step_times))
    cases = [(f"thdpack's rank {r}", plan.micro_batches[r], plan.micro_batch_costs[r], None)]
    ranks, _ = plan_fixed(lengths, plan.dp_size, cap, shape.micro_batch_multiple())
    costs = [np.array([sample_costs(lengths[mb]).sum() for mb in rk]) for rk in ranks]
    f = int(np.argmax([step_time(c, shape) for c in costs]))
    cases.append((f"fixed's rank {f}", ranks[f], costs[f], order_micro_batches(costs[f], shape)[0]))
    print(f"\norder effect, PP {shape.pp_size} VPP {shape.vpp_size}: one rank's micro-batches in three run orders")
    for title, mbs, c, order in cases:
        chosen = c if order is None else c[order]
        dataset = np.argsort([int(mb.min()) for mb in mbs], kind="stable")
        rows = [("plan_steps order", chosen), ("sorted descending", np.sort(c)[::-1]), ("dataset order", c[dataset])]
        print(f"  {title} ({c.size} micro-batches, costs in thousands):")
        base = step_time(chosen, shape)
        for label, cc in rows:
            t = step_time(cc, shape)
            print(f"    {label:<18} step {t:8.0f}  x{t / base:.3f}   {' '.join(f'{x / 1e3:.0f}' for x in cc)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default="",
                    help="comma-separated filters; a configuration (e.g. rl:pp8:dp64:vpp2) runs when its name holds "
                         "every ':'-part of some filter (e.g. 'rl:pp8,sft:dp8:vpp1')")
    ap.add_argument("--cap", type=int, default=16384, help="tokens per micro-batch (and the longest sample)")
    ap.add_argument("--per-rank", type=int, default=48, help="samples per DP rank in the global batch")
    ap.add_argument("--quick", action="store_true", help="PP 4, DP 8, 16 samples per rank (CI smoke)")
    args = ap.parse_args(argv)
    if args.quick:
        args.per_rank = 16
        grid = [(d, 4, 8, v) for d in ("sft", "rl") for v in (1, 2)]
    else:
        grid = [(d, p, r, v) for d in ("sft", "rl") for p in (4, 8) for r in (8, 64) for v in (1, 2)]
    if args.configs:
        filters = [f.split(":") for f in args.configs.split(",") if f]
        grid = [g for g in grid if any(all(part in f"{g[0]}:pp{g[1]}:dp{g[2]}:vpp{g[3]}".split(":") for part in f)
                                       for f in filters)]
    if not grid:
        print("no configuration matches --configs", file=sys.stderr)
        return 2
    print(f"cost: linear 1, quadratic {QUADRATIC:.3g} per token (~8B dense); cap {args.cap} tokens; "
          f"{args.per_rank} samples per DP rank; seed {args.seed}")
    print("step, bound: simulated step time (linear-token units); strag: max/mean of the ranks' simulated step "
          "times; max/cap: largest micro-batch tokens / cap")
    head = f"{'config':<20} {'strategy':<8} {'m':>3} {'step':>10} {'bubble':>7} {'strag':>6} {'max/cap':>8} {'bound':>10} {'/thd':>6}"
    print(head)
    print("-" * len(head))
    losses, refusals, demo = [], [], None
    for data, pp, dp, vpp in grid:
        rng = np.random.default_rng([args.seed, pp, dp, vpp, 0 if data == "sft" else 1])
        lengths, shape, plan, plan_s, res = run_config(data, pp, dp, vpp, args, rng)
        name = f"{data}:pp{pp}:dp{dp}:vpp{vpp}"
        bound, thd = plan.step_time_bound, res["thdpack"]["t"]
        for k, s in enumerate(STRATEGIES):
            x = res[s]
            bound_s = f"{bound:.0f}" if k == 0 else ""
            if "refused" in x:
                print(f"{name if k == 0 else '':<20} {s:<8}  {'refused':<38} {bound_s:>10} {'':>6}")
                refusals.append(f"{name}: {s} ({x['refused']})")
                continue
            flag = "!" if x["over"] > 1.0 else " "
            print(f"{name if k == 0 else '':<20} {s:<8} {x['m']:>3} {x['t']:>10.0f} {x['bubble']:>7.3f} "
                  f"{x['strag']:>6.3f} {x['over']:>7.3f}{flag} {bound_s:>10} {x['t'] / thd:>6.3f}")
            if s != "thdpack" and x["t"] < thd * (1 - 1e-9):
                losses.append(f"{name}: {s} {x['t']:.0f} < thdpack {thd:.0f} ({x['t'] / thd:.3f})"
                              + (" (over the cap)" if x["over"] > 1 else ""))
        print(f"{'':<20} (n={lengths.size}, {lengths.sum()} tokens, plan_steps {plan_s:.2f} s)")
        if demo is None or (pp, vpp) == (8, 2):
            demo = (lengths, shape, plan)
    order_demo(*demo, args.cap)
    if refusals:
        print("\nrefused (no plan, left out of the comparison):")
        for line in refusals:
            print("  " + line)
    if losses:
        print("\nthdpack is beaten in:")
        for line in losses:
            print("  " + line)
    else:
        print("\nthdpack's step time is the lowest in every configuration"
              + (" (among the strategies that produced a plan)" if refusals else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
