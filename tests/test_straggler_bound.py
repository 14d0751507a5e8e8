"""Balanced plans when the budget is almost full (issue 37), in one process.

* ``rank_floor`` is a true lower bound: on tiny inputs no assignment of the items to ranks' micro-batches
  (every one within the budget, an empty one running the cheapest piece as a filler) has a costliest rank
  below it (exhaustive search).
* ``plan_balanced`` and ``TokenBudgetBatchSampler(balance="compute")`` on skewed inputs (rank sizes, length
  ranges, budgets, micro-batches, CP alignment, a quadratic cost): the ranks' straggler over the plan is
  at most ``max(1.02, 1.02 × straggler_bound)``, the bound never above it, every sample planned once; with
  groups and shared prefixes through ``plan_balanced(fillers=True)``, groups kept on one rank per step.
* The issue's case (40 rollouts of 50–900 tokens and 10 of 50–100, pack 2048, 2 ranks × 2 micro-batches:
  best-fit decreasing leaves a 233-token runt, straggler 1.078) at <= 1.02.
* The pieces: the slack re-cut, the rank relabelling, the rank-by-rank fill.

``skewed_cases`` draws the parameters; the lengths come from a seeded numpy generator (``Skewed``), so that
an example is cheap and the same in the one-process and the gloo tests (tests/test_rebalance_straggler.py).
Integrality can keep any plan over 1.02 × the bound on rare inputs (a few lumpy groups in packs over 95%
full), so the quality tests run a fixed, derandomised set of examples.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thdpack import CostModel, TokenBudgetBatchSampler, plan_balanced, plan_packs
from thdpack.planning.rank_fill import rank_floor, relabel, straggler, straggler_bound

QUALITY = settings(max_examples=30, deadline=None, derandomize=True)
TARGET = 1.02


@dataclass(frozen=True)
class Skewed:
    """A skewed step: rank 0 made ``counts[0]`` long rollouts (``long/16 .. long`` tokens), every other rank
    ``counts[r]`` short ones (``1 .. long/8``); ``members`` rollouts per group (``mode`` "groups" or
    "share": a group's rollouts start with one prompt of about half the shortest); CP alignment 4 with
    ``cp``; a cost with attention's ``Σ s² / pack_size`` with ``quadratic``."""

    world: int
    micro_batches: int
    pack_size: int
    long: int
    counts: tuple
    mode: str = "plain"
    members: int = 1
    cp: bool = False
    quadratic: bool = False
    seed: int = 0
    given: tuple = ()  # every rank's lengths, when given (not drawn)

    def lengths(self, rank: int) -> np.ndarray:
        if self.given:
            return np.asarray(self.given[rank], np.int64)
        rng = np.random.default_rng([self.seed, rank])
        low, high = (max(1, self.long // 16), self.long) if rank == 0 else (1, max(2, self.long // 8))
        return rng.integers(low, high + 1, self.counts[rank]).astype(np.int64)

    def groups(self, rank: int) -> np.ndarray | None:
        return None if self.mode == "plain" else np.arange(self.counts[rank]) // self.members

    def prefix(self, rank: int) -> np.ndarray | None:
        """The prompt each rollout shares with its group (0 alone), in "share" mode."""
        if self.mode != "share":
            return None
        lengths, groups = self.lengths(rank), self.groups(rank)
        low = np.full(groups.max() + 1, np.iinfo(np.int64).max)
        np.minimum.at(low, groups, lengths)
        return np.where(np.bincount(groups)[groups] > 1, low[groups] // 2, 0)

    @property
    def cost(self) -> CostModel:
        return CostModel(1.0, 1.0 / self.pack_size if self.quadratic else 0.0)

    @property
    def align(self) -> int:
        return 4 if self.cp else 1

    def flat(self):
        """``(lengths, groups, prefix)`` of all ranks, groups numbered apart per rank."""
        lengths = np.concatenate([self.lengths(r) for r in range(self.world)])
        if self.mode == "plain":
            return lengths, None, None
        groups = np.concatenate([self.groups(r) + 1000 * r for r in range(self.world)])
        prefix = None if self.mode != "share" else np.concatenate([self.prefix(r) for r in range(self.world)])
        return lengths, groups, prefix


@st.composite
def skewed_cases(draw, modes=("plain", "groups", "share"), quadratic=(False, True), micro_batches=(1, 3),
                 longest=(4, 2)):
    """A :class:`Skewed` step: 2–4 ranks, ``micro_batches`` (a range), packs of 512–2048 tokens, the
    longest rollout between ``1/longest[0]`` and ``1/longest[1]`` of a pack, 10–40 rollouts per rank."""
    world = draw(st.integers(2, 4))
    micro_batches = draw(st.integers(*micro_batches))
    pack_size = draw(st.sampled_from([512, 1024, 2048]))
    mode = draw(st.sampled_from(modes))
    members = 1 if mode == "plain" else draw(st.integers(1, min(3, 2 * micro_batches)))
    long = draw(st.integers(pack_size // longest[0], pack_size // longest[1]))
    return Skewed(world, micro_batches, pack_size, long=long,
                  counts=tuple(draw(st.integers(10, 40)) for _ in range(world)), mode=mode, members=members,
                  cp=mode != "share" and draw(st.booleans()), quadratic=draw(st.sampled_from(quadratic)),
                  seed=draw(st.integers(0, 2**16)))


def issue_case(seed: int = 22158) -> tuple[np.ndarray, np.ndarray]:
    """Rank 0's 40 rollouts of 50–900 tokens and rank 1's 10 of 50–100 (seed 22158: 22,635 tokens in all,
    the issue's total)."""
    rng = np.random.default_rng(seed)
    return rng.integers(50, 901, 40), rng.integers(50, 101, 10)


def issue_step(seed: int = 22158) -> Skewed:
    """:func:`issue_case` as a step: 2 ranks × 2 micro-batches of 2048 tokens, tokens as the cost."""
    mine, theirs = issue_case(seed)
    return Skewed(2, 2, 2048, 900, (40, 10), seed=seed, given=(tuple(mine.tolist()), tuple(theirs.tolist())))


def assert_balanced(value: float, bound: float, what) -> None:
    assert bound <= value + 1e-9, (what, value, bound)  # a lower bound
    assert value <= max(TARGET, TARGET * bound), (what, value, bound)


# --------------------------------------------------------------------------- the bound is a lower bound


def best_max(costs, sizes, num_ranks, slots, pack_size, filler):
    """The least costliest-rank cost of any assignment of the items to ``num_ranks × slots`` packs of
    ``pack_size``, an empty pack running a ``filler`` (exhaustive)."""
    best = np.inf
    for where in itertools.product(range(num_ranks * slots), repeat=len(costs)):
        fill = np.bincount(where, weights=sizes, minlength=num_ranks * slots)
        if (fill > pack_size).any():
            continue
        load = np.bincount(where, weights=costs, minlength=num_ranks * slots)
        load[np.bincount(where, minlength=num_ranks * slots) == 0] = filler
        best = min(best, load.reshape(num_ranks, slots).sum(axis=1).max())
    return best


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=6), st.integers(2, 3), st.integers(1, 2),
       st.integers(20, 40), st.booleans())
def test_rank_floor_is_a_lower_bound(sizes, num_ranks, slots, pack_size, quadratic):
    sizes = np.array(sizes, np.int64)
    costs = sizes + (sizes.astype(np.float64) ** 2 / 8 if quadratic else 0.0)
    floor = rank_floor(costs, np.ones(sizes.size, np.int64), float(costs.min()), num_ranks, slots)
    assert floor <= best_max(costs, sizes, num_ranks, slots, pack_size, float(costs.min())) + 1e-9


def test_rank_floor_terms():
    """The mean with forced fillers, the costliest item beside the cheapest piece in each other
    micro-batch, a bundle filling M of them, the pigeonhole."""
    one = np.ones(3, np.int64)
    assert rank_floor(np.array([9.0, 1.0, 1.0]), one, 1.0, 2, 1) == 9.0
    assert rank_floor(np.array([9.0, 1.0, 1.0]), one, 1.0, 2, 3) == 11.0  # 9 and two more micro-batches
    assert rank_floor(np.array([9.0, 1.0, 1.0]), np.array([3, 1, 1]), 1.0, 2, 3) == 9.0  # a bundle of 3
    assert rank_floor(np.array([4.0, 4.0, 4.0]), one, 0.5, 2, 2) == 8.0  # two of three on one rank
    assert rank_floor(np.array([2.0, 2.0]), np.ones(2, np.int64), 1.0, 2, 3) == 4.0  # (4 + 4 fillers) / 2
    assert rank_floor(np.zeros(0), np.zeros(0, np.int64), 0.0, 2, 3) == 0.0
    assert straggler(np.array([3.0, 1.0])) == 1.5 and straggler(np.zeros(2)) == 1.0
    assert straggler_bound(3.0, np.array([3.0, 1.0])) == 1.5 and straggler_bound(1.0, np.array([3.0, 1.0])) == 1.0


# --------------------------------------------------------------------------- plan_balanced and the sampler


def test_issue_case_plan_balanced():
    """Best-fit decreasing gives 12 packs, the last of 233 tokens: the cheapest step is re-cut evenly."""
    mine, theirs = issue_case()
    lengths = np.concatenate([mine, theirs])
    assert int(lengths.sum()) == 22635 and len(plan_packs(lengths, 2048)) == 12
    for fillers in (False, True):
        bp = plan_balanced(lengths, 2048, num_replicas=2, micro_batches=2, shuffle_steps=False, fillers=fillers)
        assert bp.steps.shape == (3, 2, 2) and bp.repeated_packs == 0
        assert sorted(bp.plan.sample_index.tolist()) == list(range(50))
        assert bp.straggler <= 1.02 and bp.straggler_bound == 1.0
        assert bp.step_straggler.max() <= 1.02  # the last step too: no runt in it


@pytest.mark.parametrize("seed", [22158, 0, 1, 2, 3, 4])
def test_issue_shape_plan_balanced(seed):
    lengths = np.concatenate(issue_case(seed))
    bp = plan_balanced(lengths, 2048, num_replicas=2, micro_batches=2, shuffle_steps=False)
    assert_balanced(bp.straggler, bp.straggler_bound, seed)


# Without fillers only the cheapest packs may be re-cut (tests/test_balance.py pins the others as best-fit
# decreasing's): the slack is spread over the pieces of those packs, so these inputs keep them fine enough
# (two micro-batches or more, rollouts up to a quarter of a pack) and the cost tokens (full packs cost alike).
COPIES = dict(modes=("plain",), quadratic=(False,), micro_batches=(2, 3), longest=(8, 4))


@QUALITY
@given(skewed_cases(**COPIES))
def test_plan_balanced_skewed(case):
    lengths, _, _ = case.flat()
    bp = plan_balanced(lengths, case.pack_size, num_replicas=case.world, micro_batches=case.micro_batches,
                       cost=case.cost, align=case.align, seed=case.seed)
    assert sorted(bp.plan.sample_index.tolist()) == list(range(lengths.size))
    assert bp.repeated_packs == 0 or len(bp.plan) < case.world * case.micro_batches
    assert_balanced(bp.straggler, bp.straggler_bound, case)
    np.testing.assert_allclose(bp.rank_totals, bp.costs[bp.steps].sum(axis=(0, 2)))


@QUALITY
@given(skewed_cases())
def test_plan_balanced_skewed_with_fillers(case):
    """``fillers=True``, as rebalance plans (groups and shared prompts, counted once, too): every sample
    once, a group on one rank in one step."""
    lengths, groups, prefix = case.flat()
    bp = plan_balanced(lengths, case.pack_size, num_replicas=case.world, micro_batches=case.micro_batches,
                       cost=case.cost, align=case.align, groups=groups, shared_prefix=prefix, fillers=True,
                       shuffle_steps=False)
    assert sorted(bp.plan.sample_index.tolist()) == list(range(lengths.size))
    real = ~bp.filler
    where = {}
    for s, r, m in zip(*np.nonzero(real)) if groups is not None else ():
        for g in groups[bp.plan.pack(int(bp.steps[s, r, m]))].tolist():
            where.setdefault(g, set()).add((int(s), int(r), int(bp.steps[s, r, m])))
    for g, places in where.items():
        assert len({(s, r) for s, r, _ in places}) == 1, g
    assert_balanced(bp.straggler, bp.straggler_bound, case)


@QUALITY
@given(skewed_cases(**COPIES), st.booleans())
def test_sampler_skewed(case, shuffle):
    """The balanced sampler's ranks: the cost of the packs each yields over the epoch."""
    lengths, _, _ = case.flat()
    kw = dict(num_replicas=case.world, balance="compute", micro_batches=case.micro_batches, cost=case.cost,
              align=case.align, seed=case.seed, shuffle=shuffle)
    ranks = [TokenBudgetBatchSampler(lengths, case.pack_size, rank=r, **kw) for r in range(case.world)]
    bp = ranks[0].balanced_plan()
    batches = [list(s) for s in ranks]
    seen = sorted(i for b in batches for pack in b for i in pack)
    if bp.repeated_packs == 0:
        assert seen == list(range(lengths.size))
    s = lengths.astype(np.float64)
    totals = np.array([sum(case.cost.linear * s[p].sum() + case.cost.quadratic * (s[p] ** 2).sum() for p in b)
                       for b in batches])
    np.testing.assert_allclose(totals, bp.rank_totals)
    assert_balanced(straggler(totals), bp.straggler_bound, case)
    assert TokenBudgetBatchSampler(lengths, case.pack_size, rank=0, num_replicas=case.world).balanced_plan() is None


# --------------------------------------------------------------------------- the pieces


def test_relabel_evens_the_ranks_totals():
    """Every step gives rank 0 the costliest share (each step dealt alone); relabelled, the totals even out
    and every step keeps its shares."""
    loads = np.array([[5.0, 3.0], [5.0, 3.0], [4.0, 4.0], [6.0, 2.0]])
    perm = relabel(loads)
    moved = np.take_along_axis(loads, perm, axis=1)
    assert (np.sort(moved, axis=1) == np.sort(loads, axis=1)).all()
    assert loads.sum(axis=0).tolist() == [20.0, 12.0] and moved.sum(axis=0).tolist() == [16.0, 16.0]


def test_one_rank_with_the_long_sample_gets_small_packs_beside_it():
    """4 ranks × 3 micro-batches, one step: a long sample's rank gets the short ones beside it (packs of
    even cost would give it two average packs more)."""
    rng = np.random.default_rng(5)
    lengths = np.concatenate([[197, 151, 128], rng.integers(50, 80, 6), rng.integers(5, 22, 40)])
    bp = plan_balanced(lengths, 512, num_replicas=4, micro_batches=3, cost=(1.0, 1 / 512), fillers=True)
    assert_balanced(bp.straggler, bp.straggler_bound, "long")
    assert bp.straggler < 1.02


def test_grouped_plan_without_fillers_keeps_plan_packs_packs():
    """Groups that fit a pack, without fillers: plan_packs' packs, as tests/test_plan_groups.py pins them."""
    lengths, groups = np.arange(1, 41) % 13 + 3, np.arange(40) // 3
    bp = plan_balanced(lengths, 48, num_replicas=3, micro_batches=2, groups=groups, shuffle_steps=False)
    np.testing.assert_array_equal(bp.plan.sample_index, plan_packs(lengths, 48, groups=groups).sample_index)
    assert bp.filler is None and bp.filler_costs is None


def groups_on_one_rank_per_step(bp, groups) -> bool:
    """Every group's samples in non-filler slots of one (step, rank)."""
    where = {}
    for s, r, m in zip(*np.nonzero(~bp.filler)):
        for g in groups[bp.plan.pack(int(bp.steps[s, r, m]))].tolist():
            where.setdefault(g, set()).add((int(s), int(r)))
    return all(len(places) == 1 for places in where.values())


def test_bundles_are_filled_around_rank_by_rank(monkeypatch):
    """Groups of 3 rollouts over one pack (bundles of 2 packs of one rank in one step), with fillers: the
    step-rank bins of ``_bundle_steps`` are off by 9%; filled rank by rank around the bundles (their packs
    taking other groups' rollouts too), within 1.02, every group still on one rank in one step."""
    from thdpack.planning import balance

    case = Skewed(3, 3, 1024, 437, (22, 15, 12), mode="groups", members=3, seed=58112)
    lengths, groups, _ = case.flat()
    assert any(lengths[groups == g].sum() > 1024 for g in np.unique(groups))
    kw = dict(num_replicas=3, micro_batches=3, groups=groups, fillers=True)
    monkeypatch.setattr(balance, "REPAIR_AT", np.inf)
    dealt = plan_balanced(lengths, 1024, **kw)
    monkeypatch.undo()
    bp = plan_balanced(lengths, 1024, **kw)
    assert dealt.straggler > 1.05 and bp.straggler <= 1.02 and bp.straggler_bound == 1.0
    assert sorted(bp.plan.sample_index.tolist()) == list(range(lengths.size))
    assert groups_on_one_rank_per_step(dealt, groups) and groups_on_one_rank_per_step(bp, groups)
    assert all(int(lengths[bp.plan.pack(k)].sum()) <= 1024 for k in range(len(bp.plan)))


def test_fill_keeps_fixed_items_on_their_rank():
    """A bundle's two packs (fixed to rank 0, 10 in all) stay there though moving one would even the ranks."""
    from thdpack.planning.rank_fill import fill_ranks
    from thdpack.planning.spread import Items

    n = 4
    cost = np.array([6.0, 4.0, 1.0, 1.0])
    items = Items(np.arange(n), np.full(n, 10, np.int64), np.zeros(n, np.int64), np.ones(n, np.int64), cost)
    order = np.arange(n)
    slot, _ = fill_ranks(order, items, np.zeros(2), 2, 100, 0, fixed=np.array([0, 0, -1, -1]))
    assert (slot[:2] // 2 == 0).all() and (slot[2:] // 2 == 1).all()
