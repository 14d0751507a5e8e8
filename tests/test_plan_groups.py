"""plan_packs(groups=...): a group's samples land in one pack, budgets kept, groups too
large are errors naming them; the sampler plans with groups too (issue 15 point 3)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thdpack import SampleError, TokenBudgetBatchSampler, plan_balanced, plan_packs
from thdpack.plan import ALGORITHMS


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
