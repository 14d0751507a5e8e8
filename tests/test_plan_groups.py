"""plan_packs(groups=...): a group's samples land in one pack, budgets kept, groups too
large are errors naming them; the sampler plans with groups too (issue 15 point 3)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thdpack import SampleError, TokenBudgetBatchSampler, plan_balanced, plan_packs
from thdpack.planning.options import ALGORITHMS
from thdpack.integrations import to_hf_kwargs


def round_up(x, m):
    return -(-x // m) * m


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    lengths=st.lists(st.integers(1, 20), min_size=0, max_size=40),
    algorithm=st.sampled_from(ALGORITHMS),
    align=st.sampled_from([1, 2, 4]),
)
def test_groups_share_a_pack_and_budgets_hold(data, lengths, algorithm, align):
    n = len(lengths)
    groups = data.draw(st.lists(st.integers(0, max(n // 2, 1)), min_size=n, max_size=n))
    pack_size = 64
    totals = {}
    for s, g in zip(lengths, groups):
        totals[g] = totals.get(g, 0) + round_up(s, align)
    if any(t > pack_size for t in totals.values()):
        with pytest.raises(ValueError, match=r"group \d+ \(samples .*\) has \d+ tokens \(aligned\), more than pack_size=64"):
            plan_packs(lengths, pack_size, groups=groups, algorithm=algorithm, align=align)
        return
    plan = plan_packs(lengths, pack_size, groups=groups, algorithm=algorithm, align=align, seed=3)
    assert sorted(plan.sample_index.tolist()) == list(range(n))  # every sample exactly once, whole
    assert plan.length.tolist() == [lengths[i] for i in plan.sample_index.tolist()]
    assert not plan.start.any()
    pack_of_group = {}
    for k, pack in enumerate(plan.packs):
        assert pack.tolist() == sorted(pack.tolist())  # input order within a pack
        assert sum(round_up(lengths[i], align) for i in pack) <= pack_size
        for i in pack.tolist():
            assert pack_of_group.setdefault(groups[i], k) == k, f"group {groups[i]} split over packs"
    # exactly the packs of planning each group as one item, in the same order
    order = list(dict.fromkeys(groups))
    outer = plan_packs([totals[g] for g in order], pack_size, algorithm=algorithm, seed=3)
    assert len(plan) == len(outer) == plan.stats.num_packs
    for k, pack in enumerate(outer.packs):
        assert set(plan.pack(k).tolist()) == {i for i in range(n) if groups[i] in {order[j] for j in pack.tolist()}}
    assert plan.stats.real_tokens == sum(lengths)
    assert plan.stats.aligned_tokens == sum(round_up(s, align) for s in lengths)


def test_group_errors_name_the_group_and_argument():
    with pytest.raises(ValueError, match=r"group 7 \(samples 1, 2\) has 40 tokens \(aligned\), more than pack_size=32"):
        plan_packs([5, 20, 20, 3], 32, groups=[0, 7, 7, 1])
    with pytest.raises(ValueError, match=r"groups must be integers with one group id per sample \(4\)"):
        plan_packs([5, 20, 20, 3], 32, groups=[0, 7, 7])
    with pytest.raises(ValueError, match="max_samples_per_pack is not available with groups"):
        plan_packs([5, 20], 32, groups=[0, 0], max_samples_per_pack=2)
    with pytest.raises(ValueError, match=r"group 0 \(samples 0, 1\) has 9 vision patches, more than vision_budget=8"):
        plan_packs([5, 6], 32, groups=[0, 0], vision_lengths=[4, 5], vision_budget=8)


def test_vision_budget_with_groups():
    plan = plan_packs([5, 6, 4, 4], 32, groups=[0, 0, 1, 1], vision_lengths=[4, 4, 3, 3], vision_budget=10)
    assert [sorted(p.tolist()) for p in plan.packs] in ([[0, 1], [2, 3]], [[2, 3], [0, 1]])
    assert plan.stats.max_pack_vision == 8


def test_sampler_keeps_groups_in_one_pack():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 30, 60)
    groups = np.arange(60) // 2
    for r in range(2):
        sampler = TokenBudgetBatchSampler(lengths, 64, groups=groups, num_replicas=2, rank=r, seed=1)
        for pack in sampler:
            assert sorted(set(groups[pack].tolist())) == sorted(groups[pack].tolist()[::2]) and len(pack) % 2 == 0
            for g in set(groups[pack].tolist()):
                assert set(np.flatnonzero(groups == g).tolist()) <= set(pack)


def test_groups_are_planned_with_aligned_lengths():
    # aligned to 4, two groups of one 3-token sample each take 8 slots: more than pack_size=7
    plan = plan_packs([3, 3], 7, groups=[0, 1], align=4)
    assert [p.tolist() for p in plan.packs] == [[0], [1]]
    assert plan.stats.aligned_tokens == 8
    with pytest.raises(ValueError, match=r"group 0 \(samples 0, 1\) has 8 tokens \(aligned\), more than pack_size=7"):
        plan_packs([3, 3], 7, groups=[0, 0], align=4)


def test_plan_balanced_keeps_groups_on_one_rank_and_balance():
    """RL groups (GRPO completions of one prompt) on one data-parallel rank, compute balance kept."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6, 1, 4000), 1, 4096).astype(np.int64)
    groups = np.arange(lengths.size) // 4
    balanced = plan_balanced(lengths, 16384, num_replicas=8, micro_batches=2, groups=groups)
    assert balanced.straggler_ratio <= 1.02
    for step in balanced.steps:
        rank_of_group = {}
        for rank, packs in enumerate(step):
            for k in packs.tolist():
                for g in set(groups[balanced.plan.pack(k)].tolist()):
                    assert rank_of_group.setdefault(g, rank) == rank, f"group {g} on two ranks in one step"
    for k in range(len(balanced.plan)):  # stronger: a group's samples are in one pack
        pack = balanced.plan.pack(k)
        for g in set(groups[pack].tolist()):
            assert set(np.flatnonzero(groups == g).tolist()) <= set(pack.tolist())
    sampler = TokenBudgetBatchSampler(lengths[:200], 16384, groups=groups[:200], balance="compute", num_replicas=2,
                                      micro_batches=2)
    for pack in sampler:
        for g in set(groups[pack].tolist()):
            assert set(np.flatnonzero(groups[:200] == g).tolist()) <= set(pack)


def test_collator_keeps_groups_in_one_pack():
    from thdpack import ThdCollator

    rng = np.random.default_rng(3)
    rows = [{"input_ids": rng.integers(1, 50, int(rng.integers(1, 20))), "pair": i // 2} for i in range(30)]
    packs = ThdCollator(pack_size=48, group_field="pair")(rows)
    assert len(packs) > 1
    for batch in packs:
        pairs = [rows[i]["pair"] for i in batch.sample_index.tolist()]
        assert all(pairs.count(p) == 2 for p in pairs), pairs  # both rows of every pair in the pack
    with pytest.raises(SampleError, match="sample 0 has no 'pair' field"):
        ThdCollator(pack_size=48, group_field="pair")([{"input_ids": [1, 2]}])


# --------------------------------------------------------------------------
# plan_balanced: groups larger than one pack (bundles of k <= M packs on one rank, one step)
# --------------------------------------------------------------------------
def ref_ffd_count(sizes, cap):
    """Packs first-fit decreasing needs for ``sizes`` (each <= cap), plain Python."""
    bins = []
    for s in sorted(sizes, reverse=True):
        for b in range(len(bins)):
            if bins[b] + s <= cap:
                bins[b] += s
                break
        else:
            bins.append(s)
    return len(bins)


def ref_deal_units(unit_costs, unit_slots, num_bins, slots_per_bin):
    """Units in order, each to the least-loaded bin (ties: lowest) with enough free slots; -1 if none."""
    load, free, out = [0.0] * num_bins, [slots_per_bin] * num_bins, []
    for c, k in zip(unit_costs, unit_slots):
        fits = [b for b in range(num_bins) if free[b] >= k]
        if not fits:
            out.append(-1)
            continue
        b = min(fits, key=lambda b: (load[b], b))
        out.append(b)
        free[b] -= k
        load[b] += float(c)
    return out


def ref_bundle_steps(singles, bundles, costs, R, M):
    """Bundles (by decreasing cost), then single packs and fill copies (of the cheapest singles, or
    packs) by decreasing cost, dealt over the fewest steps' (step, rank) bins that take every bundle;
    bins sorted by decreasing load, cut into steps of R. Returns ([S][R][M] pack ids, copies)."""
    bundle_cost = [sum(float(costs[p]) for p in b) for b in bundles]
    border = sorted(range(len(bundles)), key=lambda b: -bundle_cost[b])  # stable
    n = len(singles) + sum(len(b) for b in bundles)
    S = max(-(-n // (R * M)), -(-sum(2 * len(b) > M for b in bundles) // R))
    while -1 in ref_deal_units([bundle_cost[b] for b in border], [len(bundles[b]) for b in border], S * R, M):
        S += 1
    copies = S * R * M - n
    pool = sorted(singles if len(singles) else range(len(costs)), key=lambda p: float(costs[p]))
    fill = sorted(list(singles) + [pool[i % len(pool)] for i in range(copies)], key=lambda p: -float(costs[p]))
    units = [list(bundles[b]) for b in border] + [[p] for p in fill]
    unit_costs = [bundle_cost[b] for b in border] + [float(costs[p]) for p in fill]
    bins = ref_deal_units(unit_costs, [len(u) for u in units], S * R, M)
    contents, load = [[] for _ in range(S * R)], [0.0] * (S * R)
    for u, c, b in zip(units, unit_costs, bins):
        contents[b] += [int(p) for p in u]
        load[b] += c
    by_load = sorted(range(S * R), key=lambda b: -load[b])
    return [[contents[b] for b in by_load[s * R:(s + 1) * R]] for s in range(S)], copies


def plan_bundles(bp, groups):
    """(singles, bundles) of a balanced plan: packs holding a group of several packs, per group."""
    pack_groups = [set(np.asarray(groups)[bp.plan.pack(k)].tolist()) for k in range(len(bp.plan))]
    packs_of = {}
    for k, gs in enumerate(pack_groups):
        for g in gs:
            packs_of.setdefault(g, []).append(k)
    bundles = [tuple(ps) for ps in packs_of.values() if len(ps) > 1]
    in_bundle = {k for b in bundles for k in b}
    return [k for k in range(len(bp.plan)) if k not in in_bundle], [list(b) for b in dict.fromkeys(bundles)]


def assert_groups_on_one_rank_per_step(bp, groups, lengths, pack_size, align=1):
    """Every group has a (step, rank) that runs all of its samples; every sample scheduled (once
    unless copies fill the last slots); every pack within pack_size; steps [S, R, M]."""
    groups, lengths = np.asarray(groups), np.asarray(lengths)
    assert sorted(bp.plan.sample_index.tolist()) == list(range(len(lengths)))  # each sample in one pack, whole
    for k in range(len(bp.plan)):
        assert int(round_up(lengths[bp.plan.pack(k)], align).sum()) <= pack_size
    for g in set(groups.tolist()):
        members = set(np.flatnonzero(groups == g).tolist())
        assert any(members <= {i for k in bp.steps[s, r].tolist() for i in bp.plan.pack(k).tolist()}
                   for s in range(bp.num_steps) for r in range(bp.steps.shape[1])), f"group {g} parted"
    counts = np.bincount(bp.steps.reshape(-1), minlength=len(bp.plan))
    assert counts.size == len(bp.plan) and counts.min() >= 1
    assert int((counts - 1).sum()) == bp.repeated_packs
    per_rank = bp.costs[bp.steps].sum(2)  # [S, R]
    mean = per_rank.mean(1)
    np.testing.assert_allclose(bp.step_straggler, np.where(mean > 0, per_rank.max(1) / np.where(mean > 0, mean, 1), 1))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), R=st.integers(1, 4), M=st.integers(1, 4), align=st.sampled_from([1, 2, 4]),
       cost=st.tuples(st.floats(0, 10), st.floats(0, 1)))
def test_plan_balanced_groups_over_one_pack(data, R, M, align, cost):
    lengths = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=40))
    n = len(lengths)
    groups = data.draw(st.lists(st.integers(0, max(n // 3, 1)), min_size=n, max_size=n))
    pack_size = 48
    kw = dict(num_replicas=R, micro_batches=M, cost=cost, align=align, shuffle_steps=False)
    sizes = {}
    for s, g in zip(lengths, groups):
        sizes.setdefault(g, []).append(int(round_up(s, align)))
    over = [g for g in dict.fromkeys(groups) if sum(sizes[g]) > pack_size and ref_ffd_count(sizes[g], pack_size) > M]
    if over:  # the first group (by first appearance) needing more than M packs is named
        g = over[0]
        with pytest.raises(ValueError, match=rf"group {g} \(samples .*\) has {sum(sizes[g])} tokens \(aligned\) and "
                                             rf"needs \d+ packs of pack_size=48, more than micro_batches={M}; .*"
                                             r"raise micro_batches or pack_size"):
            plan_balanced(lengths, pack_size, groups=groups, **kw)
        return
    bp = plan_balanced(lengths, pack_size, groups=groups, **kw)
    assert bp.steps.shape[1:] == (R, M)
    assert_groups_on_one_rank_per_step(bp, groups, lengths, pack_size, align)
    singles, bundles = plan_bundles(bp, groups)
    for g in set(groups):  # a multi-pack group uses as few packs as first-fit decreasing finds
        if sum(sizes[g]) > pack_size:
            ks = {len(b) for b in bundles if set(groups[i] for i in bp.plan.pack(b[0]).tolist()) == {g}}
            assert ks == {ref_ffd_count(sizes[g], pack_size)}
    if bundles:
        want, copies = ref_bundle_steps(singles, bundles, bp.costs, R, M)
        assert bp.steps.tolist() == want and bp.repeated_packs == copies
    else:  # every group fits one pack: today's plan, packs planned as plan_packs(groups=) does
        np.testing.assert_array_equal(bp.plan.sample_index, plan_packs(lengths, pack_size, groups=groups,
                                                                       align=align).sample_index)
    shuffled = plan_balanced(lengths, pack_size, groups=groups, **{**kw, "shuffle_steps": True})
    assert sorted(map(str, shuffled.steps.tolist())) == sorted(map(str, bp.steps.tolist()))


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.data())
def test_deal_units_matches_reference(num_bins, slots, data):
    from thdpack.planning.balance import _deal_units

    n = data.draw(st.integers(0, num_bins * slots + 2))
    costs = data.draw(st.lists(st.one_of(st.integers(0, 4).map(float), st.floats(0, 1e6)), min_size=n, max_size=n))
    sizes = data.draw(st.lists(st.integers(1, slots), min_size=n, max_size=n))
    got = _deal_units(np.array(costs, np.float64), np.array(sizes, np.int64), num_bins, slots)
    assert got.dtype == np.int64 and got.tolist() == ref_deal_units(costs, sizes, num_bins, slots)


def test_deal_units_small_cases_exactly():
    from thdpack.planning.balance import _deal_units

    # a bundle of 3 takes 3 of rank 0's 4 slots; 5 and 4 go to the lighter rank 1; at 9 vs 9 the tie
    # sends the last pack to rank 0
    assert _deal_units(np.array([9.0, 5.0, 4.0, 1.0]), np.array([3, 1, 1, 1]), 2, 4).tolist() == [0, 1, 1, 0]
    assert _deal_units(np.array([9.0, 8.0, 1.0]), np.array([3, 3, 2]), 2, 4).tolist() == [0, 1, -1]  # no room for 2


def test_grpo_groups_of_8_over_one_pack_keep_balance():
    """4000 rollouts in groups of 8 (lognormal lengths, most groups over one 4096 pack), 8 ranks × 4
    micro-batches, Qwen3-8B cost: every group on one rank in one step, straggler <= 1.02."""
    from test_balance import QWEN3_8B

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6, 1, 4000), 1, 4096).astype(np.int64)
    groups = np.arange(lengths.size) // 8
    bp = plan_balanced(lengths, 4096, num_replicas=8, micro_batches=4, groups=groups, cost=QWEN3_8B, seed=1)
    singles, bundles = plan_bundles(bp, groups)
    assert len(bundles) > 300 and max(len(b) for b in bundles) >= 3  # the case the single-pack rule refused
    assert_groups_on_one_rank_per_step(bp, groups, lengths, 4096)
    assert bp.straggler_ratio <= 1.02, bp.straggler_ratio
    assert bp.repeated_packs < 8 * 4


def test_group_over_micro_batches_is_named():
    # 8 rollouts × 1,500 tokens: 4 packs of 4096 (two each); fine with M=4, an error with M=2
    lengths, groups = [300] + [1500] * 8, [5] + [9] * 8
    bp = plan_balanced(lengths, 4096, num_replicas=2, micro_batches=4, groups=groups)
    assert sorted(len(p) for p in bp.plan.packs) == [1, 2, 2, 2, 2]
    assert_groups_on_one_rank_per_step(bp, groups, lengths, 4096)
    with pytest.raises(ValueError, match=r"^group 9 \(samples 1, 2, 3, 4, 5, 6, 7, 8\) has 12000 tokens \(aligned\) "
                                         r"and needs 4 packs of pack_size=4096, more than micro_batches=2; a group's "
                                         r"packs run on one rank in one step: raise micro_batches or pack_size"):
        plan_balanced(lengths, 4096, num_replicas=2, micro_batches=2, groups=groups)
    with pytest.raises(ValueError, match=r"^sample 2 of group 9 \(samples 1, 2\) has 5000 tokens \(aligned\), more "
                                         r"than pack_size=4096; a group's samples are never cut: raise pack_size"):
        plan_balanced([300, 1500, 5000], 4096, num_replicas=2, micro_batches=4, groups=[5, 9, 9])


def test_sampler_compute_balance_runs_a_group_over_one_pack_on_one_rank():
    lengths = np.array([1500] * 8 + [700] * 8 + [200] * 6)
    groups = np.array([0] * 8 + [1] * 8 + [2, 2, 3, 3, 4, 4])
    ranks = [list(TokenBudgetBatchSampler(lengths, 4096, groups=groups, balance="compute", num_replicas=2, rank=r,
                                          micro_batches=4, seed=0)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) and len(ranks[0]) % 4 == 0
    for g in range(5):
        members = set(np.flatnonzero(groups == g).tolist())
        assert any(members <= {i for b in rank[s:s + 4] for i in b} for rank in ranks for s in range(0, len(rank), 4))


@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_policy_gradient_with_groups_over_one_pack_equals_unpacked(reduction):
    """GRPO groups over one pack (balance="compute", R=2 x M=2): each rank's step holds whole groups,
    and the packed policy-gradient gradient with the sampler's normaliser equals the unpacked one."""
    from test_losses import REL_TOL, grads, make_rl_rows, reference_pg, rel_err, row_targets, tiny_model

    from thdpack import build_thd_batch
    from thdpack.losses import policy_gradient_loss

    model = tiny_model()
    lengths = [20, 25, 18, 9, 14, 5, 30, 12, 8, 4, 13, 8]  # groups of 3: 63 and 50 tokens need two packs of 40
    rows = make_rl_rows(lengths, seed=5)
    groups = [r["group"] for r in rows]
    R, M = 2, 2
    samplers = [TokenBudgetBatchSampler(lengths, 40, groups=groups, balance="compute", num_replicas=R, rank=r,
                                        micro_batches=M, seed=1) for r in range(R)]
    num_items = samplers[0].step_items(0, row_targets(rows)).num_items(reduction)
    model.zero_grad()
    step_rows = []
    for sampler in samplers:
        packs = list(sampler)[:M]
        step_groups = [groups[i] for pack in packs for i in pack]
        assert all(step_groups.count(g) == 3 for g in step_groups)  # whole groups on this rank in this step
        for pack in packs:
            batch = build_thd_batch([rows[i] for i in pack], sample_index=pack, sample_values=["advantage"])
            logits = model(**to_hf_kwargs(batch, include_labels=False), use_cache=False).logits
            policy_gradient_loss(logits, batch, batch.token_values("advantage"), reduction, num_items).backward()
            step_rows += [rows[i] for i in pack]
    spanning = [g for s in samplers for g in set(groups) if sum(g in {groups[i] for i in p} for p in list(s)[:M]) > 1]
    assert spanning, "the step should hold a group over two packs"
    got = grads(model).clone()
    model.zero_grad()
    reference_pg(model, step_rows, reduction, False).backward()
    assert rel_err(got, grads(model)) < REL_TOL


def test_group_over_the_vision_budget_spans_packs_within_both_budgets():
    # group 0 fits pack_size in tokens (30 <= 64) but not vision_budget (18 > 12): two packs on one rank
    lengths, groups, patches = [10, 10, 10, 5], [0, 0, 0, 1], [6, 6, 6, 1]
    bp = plan_balanced(lengths, 64, num_replicas=1, micro_batches=2, groups=groups, vision_lengths=patches,
                       vision_budget=12)
    assert_groups_on_one_rank_per_step(bp, groups, lengths, 64)
    assert [sum(patches[i] for i in p) for p in bp.plan.packs] == [1, 12, 6]
    assert bp.plan.pack_vision(1).tolist() == [6, 6] and bp.plan.stats.max_pack_vision == 12
    with pytest.raises(ValueError, match=r"^sample 1 of group 0 \(samples 0, 1\) has 13 vision patches, more than "
                                         r"vision_budget=12; a group's samples are never cut"):
        plan_balanced([10, 10], 64, num_replicas=1, micro_batches=2, groups=[0, 0], vision_lengths=[1, 13],
                      vision_budget=12)
