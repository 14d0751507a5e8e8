"""Tests for one pipeline-parallel training step planned by ``plan_steps``: the micro-batch count, the packs
dealt to the data-parallel ranks, fillers, and the run order chosen by simulating the pipeline schedule."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thdpack import CostModel, SampleError, plan_balanced, plan_packs
from thdpack.planning.pipeline_parallel.simulate import PipelineShape, step_time
from thdpack.planning.pipeline_parallel.steps import StepPlan, order_micro_batches, plan_steps

SETTINGS = settings(max_examples=80, deadline=None)


def aligned(x, align):
    return -(-np.asarray(x, dtype=np.int64) // align) * align


@st.composite
def step_cases(draw):
    cap = draw(st.integers(16, 200))
    align = draw(st.sampled_from([1, 1, 2, 4]))
    limit = cap // align * align  # the longest sample whose aligned length fits the cap
    lengths = draw(st.lists(st.integers(1, limit), min_size=1, max_size=40))
    vpp_size = draw(st.integers(1, 2))
    pp_size = draw(st.integers(2 if vpp_size == 2 else 1, 4))
    vpp_group = draw(st.one_of(st.none(), st.integers(pp_size, pp_size + 2)))
    groups = draw(st.one_of(st.none(), st.lists(st.integers(0, 6), min_size=len(lengths), max_size=len(lengths))))
    cost = draw(st.one_of(st.none(), st.tuples(st.floats(0.5, 4.0), st.floats(0.0, 0.05))))
    return dict(
        lengths=lengths,
        dp_size=draw(st.integers(1, 5)),
        max_tokens_per_micro_batch=cap,
        pp_size=pp_size,
        vpp_size=vpp_size,
        vpp_group=vpp_group,
        align=align,
        groups=groups,
        cost=cost,
    )


def slots(plan: StepPlan):
    """(rank, j, samples, is_filler) of every slot."""
    for r in range(plan.dp_size):
        for j in range(plan.num_micro_batches):
            yield r, j, plan.micro_batches[r][j], bool(plan.filler[r, j])


@SETTINGS
@given(step_cases())
def test_plan_steps_invariants(case):
    lengths = np.asarray(case["lengths"], np.int64)
    n, dp, cap, align = lengths.size, case["dp_size"], case["max_tokens_per_micro_batch"], case["align"]
    shape = PipelineShape(case["pp_size"], case["vpp_size"], case["vpp_group"])
    cost = CostModel() if case["cost"] is None else CostModel.of(case["cost"])
    plan = plan_steps(**case)
    m = plan.num_micro_batches

    # the same count on every rank, a multiple of the VPP group, at least the floor
    assert plan.filler.shape == (dp, m)
    assert plan.micro_batch_costs.shape == (dp, m)
    assert len(plan.micro_batches) == dp and all(len(row) == m for row in plan.micro_batches)
    if shape.vpp_size > 1:
        assert m % shape.group == 0, (m, shape)
    assert m >= plan.micro_batch_floor >= 1

    # every sample exactly once over the non-filler slots; no micro-batch over the cap
    scored = Counter()
    where = {}
    for r, j, samples, is_filler in slots(plan):
        assert samples.size >= 1
        assert int(aligned(lengths[samples], align).sum()) <= cap, (r, j, samples.tolist())
        if not is_filler:
            scored.update(samples.tolist())
            for i in samples.tolist():
                where[i] = (r, j)
    assert scored == Counter(range(n)), "every sample is scored exactly once"

    # a filler runs one sample, scored elsewhere in a real micro-batch
    for r, j, samples, is_filler in slots(plan):
        if is_filler:
            assert samples.size == 1, samples
            assert int(samples[0]) in where

    # groups run whole: in one micro-batch when they fit one cap, else on one rank
    if case["groups"] is not None:
        gid = np.asarray(case["groups"])
        for g in np.unique(gid):
            members = np.flatnonzero(gid == g).tolist()
            places = {where[i] for i in members}
            if int(aligned(lengths[members], align).sum()) <= cap:
                assert len(places) == 1, (g, members, places)
            else:
                assert len({r for r, _ in places}) == 1, (g, members, places)

    # costs: each slot's cost is the cost model's of what it runs
    for r, j, samples, _ in slots(plan):
        s = lengths[samples].astype(np.float64)
        want = cost.linear * s.sum() + cost.quadratic * (s * s).sum()
        assert plan.micro_batch_costs[r, j] == pytest.approx(want, rel=1e-9, abs=1e-9), (r, j)

    # the order permutes what plan_balanced deals at this m (pack ids and their filler flags together)
    dealt = plan_balanced(lengths, pack_size=cap, num_replicas=dp, micro_batches=m, cost=cost, shuffle_steps=False,
                          groups=case["groups"], fillers=True, align=align)
    assert dealt.num_steps == 1
    for r in range(dp):
        got = sorted(zip(plan.balanced.steps[0, r].tolist(), plan.filler[r].tolist()))
        want = sorted(zip(dealt.steps[0, r].tolist(), dealt.filler[0, r].tolist()))
        assert got == want, r
        assert sorted(plan.micro_batch_costs[r].tolist()) == pytest.approx(sorted(dealt.slot_costs[0, r].tolist()))

    # the simulated step time is the slowest rank's, and no bound exceeds what it bounds
    times = [step_time(plan.micro_batch_costs[r], shape) for r in range(dp)]
    assert plan.step_time == pytest.approx(max(times), rel=1e-12)
    assert plan.straggler_bound <= plan.straggler + 1e-9
    assert plan.step_time_bound <= plan.step_time * (1 + 1e-9)

    # m is the fewest: never more than a plain best-fit-decreasing packing needs
    if case["groups"] is None and align == 1:
        packs = len(plan_packs(lengths, cap))
        plain = -(-packs // dp)
        multiple = shape.micro_batch_multiple()
        plain = -(-plain // multiple) * multiple
        assert m <= plain, (m, plain, packs)

    # FLOPs statistics: every length once, plus the fillers' lengths
    tokens, squares = plan.seqlen_sums
    filler_lengths = np.array([lengths[s[0]] for _, _, s, f in slots(plan) if f], np.int64)
    assert int(tokens.sum()) == int(lengths.sum() + filler_lengths.sum())
    assert int(squares.sum()) == int((lengths**2).sum() + (filler_lengths**2).sum())
    for r in range(dp):
        run = np.concatenate(plan.micro_batches[r])
        assert int(tokens[r]) == int(lengths[run].sum()) and int(squares[r]) == int((lengths[run] ** 2).sum())


def test_sample_over_the_cap_is_named():
    with pytest.raises(SampleError, match="sample 3") as info:
        plan_steps([5, 6, 7, 101, 3], dp_size=2, max_tokens_per_micro_batch=100, pp_size=2)
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)


def test_sample_over_the_cap_after_alignment_is_named():
    # 97 tokens fit a cap of 98, but aligned to 4 they take 100
    with pytest.raises(ValueError, match="sample 3") as info:
        plan_steps([5, 6, 7, 97, 3], dp_size=2, max_tokens_per_micro_batch=98, align=4)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kw, message", [
    (dict(dp_size=0), "dp_size must be an integer >= 1"),
    (dict(max_tokens_per_micro_batch=0), "max_tokens_per_micro_batch must be an integer >= 1"),
    (dict(order_budget=-1), "order_budget must be an integer >= 0"),
    (dict(vpp_size=2, pp_size=1), "needs pp_size >= 2"),
    (dict(vpp_size=2, pp_size=3, vpp_group=2), "must be at least pp_size=3"),
])
def test_bad_arguments(kw, message):
    args = dict(dp_size=2, max_tokens_per_micro_batch=100)
    args.update(kw)
    with pytest.raises(ValueError, match=message):
        plan_steps([5, 6, 7], **args)


def test_empty_batch():
    with pytest.raises(ValueError, match="no samples"):
        plan_steps([], dp_size=2, max_tokens_per_micro_batch=100)


def rule_orders(c):
    """The rule orders computed independently: ascending (stable), hump, descending (ties by position)."""
    ascending = np.argsort(c, kind="stable")
    hump = np.concatenate([ascending[0::2], ascending[1::2][::-1]])
    descending = np.argsort(-c, kind="stable")
    return {"hump": hump, "ascending": ascending, "descending": descending}


@st.composite
def order_cases(draw):
    vpp = draw(st.integers(1, 2))
    pp = draw(st.integers(2, 4))
    group = draw(st.one_of(st.none(), st.integers(pp, pp + 2)))
    shape = PipelineShape(pp, vpp, group)
    k = draw(st.integers(1, 4 if vpp == 2 else 8))
    m = k * shape.micro_batch_multiple() if vpp == 2 else k
    m = max(m, 2)
    costs = draw(st.lists(st.sampled_from([1.0, 2.0, 3.5, 5.0, 8.0, 13.0]) | st.floats(0.5, 20.0),
                          min_size=m, max_size=m))
    return np.array(costs), shape, draw(st.sampled_from([0, 16, 256]))


@settings(max_examples=80, deadline=None)
@given(order_cases())
def test_order_beats_every_rule(case):
    costs, shape, budget = case
    order, rule = order_micro_batches(costs, shape, budget)
    assert sorted(np.asarray(order).tolist()) == list(range(costs.size))
    again, rule2 = order_micro_batches(costs.copy(), shape, budget)
    assert np.array_equal(order, again) and rule == rule2
    best = step_time(costs[order], shape)
    for name, o in rule_orders(costs).items():
        assert best <= step_time(costs[o], shape) * (1 + 1e-12), name


@pytest.mark.parametrize("pp, vpp, group, m", [(2, 1, None, 5), (4, 1, None, 9), (3, 1, None, 2),
                                               (2, 2, None, 4), (4, 2, None, 8), (3, 2, 4, 8)])
def test_uniform_costs_take_the_classic_1f1b_time(pp, vpp, group, m):
    shape = PipelineShape(pp, vpp, group)
    c = 3.0
    order, _ = order_micro_batches(np.full(m, c), shape)
    assert sorted(order.tolist()) == list(range(m))
    assert step_time(np.full(m, c)[order], shape) == pytest.approx(m * c / pp + (pp - 1) * c / (pp * vpp))


def test_concrete_step():
    # 465 tokens; 2 ranks of cap 100 need 465 / 200 -> at least 3 micro-batches each, and best fit packs
    # 90+10, 80+20, 70+30, 60+40, 50+15: 5 packs fit 2 x 3 slots, so m = 3.
    lengths = [10, 20, 30, 40, 50, 60, 70, 80, 90, 15]
    plan = plan_steps(lengths, dp_size=2, max_tokens_per_micro_batch=100, pp_size=2)
    assert plan.num_micro_batches == 3
    assert plan.micro_batch_floor == 3
    scored = sorted(i for r, _, s, f in slots(plan) if not f for i in s.tolist())
    assert scored == list(range(10))
    for r in range(2):
        c = plan.micro_batch_costs[r]
        assert c[0] <= c[1:-1].min(), (r, c)
    assert plan.step_time_bound <= plan.step_time
    assert plan.step_time == pytest.approx(max(step_time(c, plan.shape) for c in plan.micro_batch_costs))
