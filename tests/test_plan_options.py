"""``PlanOptions``: the planning settings stated once, validated once, and taken alike, one way (keywords), by
``plan_packs``, ``plan_balanced``, ``TokenBudgetBatchSampler``, ``StreamingPacker`` and ``ThdCollator``, which
hold the options their keywords built (``.options``)."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

from thdpack import StreamingPacker, ThdCollator, TokenBudgetBatchSampler, plan_balanced, plan_packs
from thdpack.planning.options import ALGORITHMS, PLAN_FIELDS, PlanOptions

LENGTHS = np.random.default_rng(0).integers(1, 200, 120)
VISION = np.random.default_rng(1).integers(0, 50, 120)
OPTIONS = PlanOptions(256, algorithm="first_fit_shuffle", align=8, overflow="truncate", max_samples_per_pack=6,
                      seed=4, vision_budget=300)
KEYWORDS = {f: getattr(OPTIONS, f) for f in PLAN_FIELDS}


def same_plan(a, b) -> None:
    for name in ("sample_index", "start", "length", "pack_offsets", "dropped"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert (a.pack_size, a.align, a.algorithm, a.overflow, a.seed, a.stats) == (
        b.pack_size, b.align, b.algorithm, b.overflow, b.seed, b.stats)


def test_fields_and_defaults_are_the_planning_keywords_of_before():
    assert PLAN_FIELDS == ("pack_size", "algorithm", "align", "overflow", "max_samples_per_pack", "seed",
                           "vision_budget")
    o = PlanOptions(4096)
    assert (o.algorithm, o.align, o.overflow, o.max_samples_per_pack, o.seed, o.vision_budget) == (
        "bfd", 1, "error", None, 0, None)
    assert PlanOptions(4096, align=6).usable_length == 4092
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.align = 8  # type: ignore[misc]


@pytest.mark.parametrize("keywords, message", [
    (dict(algorithm="best_fit"), r"^algorithm must be one of .*'bfd'.*got 'best_fit'$"),
    (dict(overflow="clip"), r"^overflow must be one of .*got 'clip'$"),
    (dict(pack_size=0), r"^pack_size must be an integer >= 1, got 0$"),
    (dict(pack_size=None), r"^pack_size must be an integer >= 1, got None$"),
    (dict(align=1.5), r"^align must be an integer >= 1, got 1.5$"),
    (dict(max_samples_per_pack=0), r"^max_samples_per_pack must be an integer >= 1, got 0$"),
    (dict(seed=-1), r"^seed must be an integer >= 0, got -1$"),
    (dict(pack_size=4, align=8), r"^pack_size \(4\) is smaller than align \(8\); nothing can fit$"),
    (dict(vision_budget=0), r"^vision_budget must be an integer >= 1, got 0$"),
    (dict(pack_size=2**30, vision_budget=2**26), r"^pack_size · vision_budget must be < 2\*\*56"),
])
def test_validated_once_with_the_messages_of_the_planners(keywords, message):
    keywords = dict(dict(pack_size=64), **keywords)
    with pytest.raises(ValueError, match=message):
        PlanOptions(**keywords)
    pack_size = keywords.pop("pack_size")
    with pytest.raises(ValueError, match=message):  # the keywords build the same PlanOptions
        plan_packs([1, 2], pack_size, **keywords)


def test_plan_packs_and_plan_balanced_take_the_keywords_alike():
    same_plan(plan_packs(LENGTHS, **OPTIONS.keywords(), vision_lengths=VISION),
              plan_packs(LENGTHS, **KEYWORDS, vision_lengths=VISION))
    a = plan_balanced(LENGTHS, num_replicas=2, micro_batches=2, vision_lengths=VISION, **OPTIONS.keywords())
    b = plan_balanced(LENGTHS, num_replicas=2, micro_batches=2, vision_lengths=VISION, **KEYWORDS)
    same_plan(a.plan, b.plan)
    np.testing.assert_array_equal(a.steps, b.steps)
    groups = np.arange(LENGTHS.size) // 2
    grouped = dataclasses.replace(OPTIONS, max_samples_per_pack=None, overflow="error", vision_budget=None)
    same_plan(plan_packs(np.minimum(LENGTHS, 100), groups=groups, **grouped.keywords()),
              plan_packs(np.minimum(LENGTHS, 100), 256, groups=groups, algorithm="first_fit_shuffle", align=8, seed=4))


def test_keywords_are_the_options_fields():
    assert OPTIONS.keywords() == KEYWORDS and PlanOptions(**OPTIONS.keywords()) == OPTIONS


def test_sampler_plans_every_epoch_with_its_options_and_the_epoch_seed():
    kw = dict(KEYWORDS, overflow="drop")
    a = TokenBudgetBatchSampler(LENGTHS, vision_lengths=VISION, num_replicas=1, rank=0, **kw)
    b = TokenBudgetBatchSampler(LENGTHS, vision_lengths=VISION, num_replicas=1, rank=0, **kw)
    assert a.options == b.options == PlanOptions(**kw)
    assert (list(a), list(a)) == (list(b), list(b))
    assert a.state_dict() == b.state_dict()  # the same fingerprint
    same_plan(a.plan(1), plan_packs(LENGTHS, vision_lengths=VISION, **dict(kw, seed=5)))
    assert a.plan(0).sample_index.tolist() != a.plan(1).sample_index.tolist()  # first_fit_shuffle: the seed counts
    assert a.max_length == a.options.usable_length == 256


def test_stream_takes_the_options_it_uses_and_refuses_the_others():
    samples = [{"input_ids": np.arange(int(n))} for n in LENGTHS[:50]]
    a = StreamingPacker(samples, 128, align=4, overflow="split", max_samples_per_pack=3, buffer_size=4,
                        num_replicas=1, rank=0)
    assert a.options == PlanOptions(128, align=4, overflow="split", max_samples_per_pack=3)
    packs = [[len(s["input_ids"]) for s in p] for p in a]
    assert all(len(p) <= 3 and sum(-(-n // 4) * 4 for n in p) <= 128 for p in packs)
    assert sum(map(sum, packs)) == int(LENGTHS[:50].sum())  # split: every token kept
    for changed in (dict(algorithm="ffd"), dict(seed=1), dict(vision_budget=10)):
        with pytest.raises(TypeError, match=rf"StreamingPacker\(\) got unexpected keyword argument\(s\) "
                                            rf"'{list(changed)[0]}'"):
            StreamingPacker(samples, 128, num_replicas=1, rank=0, **changed)


def test_collator_plans_with_the_layouts_multiple_as_align():
    samples = [{"input_ids": list(range(int(n)))} for n in LENGTHS[:30]]
    b = ThdCollator(pack_size=256, overflow="truncate", seed=2, algorithm="first_fit_shuffle", cp_size=2)
    assert b.options == PlanOptions(256, overflow="truncate", seed=2, algorithm="first_fit_shuffle", align=4)
    lengths = [len(s["input_ids"]) for s in samples]
    want = plan_packs(lengths, **b.options.keywords())
    assert [x.sample_index.tolist() for x in b(samples)] == [want.pack(k).tolist() for k in range(len(want))]
    with pytest.raises(TypeError, match=r"got unexpected keyword argument\(s\) 'align'"):
        ThdCollator(pack_size=256, align=4)
    with pytest.raises(TypeError, match=r"planning keyword\(s\) \['overflow'\] without pack_size"):
        ThdCollator(overflow="drop")
    assert ThdCollator().options is None


@pytest.mark.parametrize("make", [
    lambda **kw: plan_packs([3, 4], **kw),
    lambda **kw: plan_balanced([3, 4], num_replicas=1, **kw),
    lambda **kw: TokenBudgetBatchSampler([3, 4], num_replicas=1, rank=0, **kw),
    lambda **kw: StreamingPacker([], num_replicas=1, rank=0, **kw),
    lambda **kw: ThdCollator(**kw),
])
def test_an_options_object_is_not_a_second_way_in(make):
    make(pack_size=8, overflow="drop")  # the keywords
    with pytest.raises(TypeError, match=r"\(\) got unexpected keyword argument\(s\) 'options'$"):
        make(options=PlanOptions(8), pack_size=8)


def test_every_planner_takes_the_options_one_way():
    for planner in (plan_packs, plan_balanced, TokenBudgetBatchSampler, StreamingPacker, ThdCollator):
        parameters = inspect.signature(planner).parameters
        assert "options" not in parameters, planner
        assert not set(PLAN_FIELDS[1:]) & set(parameters), planner  # the keywords come from PlanOptions' fields
    assert set(ALGORITHMS) == {"bfd", "ffd", "first_fit_shuffle", "sequential"}
