"""``plan_packs(audio_lengths=..., audio_budget=...)``: a third planning budget, audio frames (issue 48 point 3).

Every sample lands once (or is dropped, as documented), no pack goes over any budget, each algorithm is
exactly its plain-Python definition on d budgets (written here), bfd / ffd stay within ⌈3/2·OPT⌉ packs of
the brute-force optimum on tiny inputs, errors name the sample, and other planners refuse ``audio_budget`` (``ThdCollator`` takes it with an
omni family).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thdpack import StreamingPacker, ThdCollator, TokenBudgetBatchSampler, plan_balanced, plan_packs
from thdpack.common.samples import SampleError
from thdpack.planning.options import ALGORITHMS, PLAN_FIELDS, PlanOptions

PACK, VISION, AUDIO = 64, 40, 30


def _order(items, caps, algorithm, seed):
    """The placement order of :func:`thdpack.planning.plan._place_nd`, in plain Python."""
    if algorithm in ("bfd", "ffd"):
        return sorted(range(len(items)), key=lambda i: -max(x / c for x, c in zip(items[i], caps)))
    if algorithm == "first_fit_shuffle":
        return np.random.default_rng(seed).permutation(len(items)).tolist()
    return list(range(len(items)))


def reference(items, caps, algorithm, seed=0, max_items=0):
    """Plain-Python packing of ``items`` (tuples, one per budget): the list of bins, each a list of
    item indices, bins in the order they were opened."""
    bins, rooms = [], []
    full = lambda b: max_items and len(bins[b]) >= max_items  # noqa: E731
    holds = lambda b, it: not full(b) and all(r >= x for r, x in zip(rooms[b], it))  # noqa: E731
    for i in _order(items, caps, algorithm, seed):
        it = items[i]
        if algorithm == "sequential":
            fit = [len(bins) - 1] if bins and holds(len(bins) - 1, it) else []
        else:
            fit = [b for b in range(len(bins)) if holds(b, it) and rooms[b][0] > 0]
            if algorithm == "bfd":  # least token room, then least second room, ..., then the lowest bin
                fit.sort(key=lambda b: tuple(rooms[b]))  # stable: ties keep the lowest bin first
        if fit:
            b = fit[0]
        else:
            bins.append([])
            rooms.append(list(caps))
            b = len(bins) - 1
        bins[b].append(i)
        rooms[b] = [r - x for r, x in zip(rooms[b], it)]
    return bins


def brute_optimum(items, caps) -> int:
    n, best = len(items), [len(items)]

    def place(i, bins):
        if len(bins) >= best[0]:
            return
        if i == n:
            best[0] = len(bins)
            return
        for b in bins:
            if all(r + x <= c for r, x, c in zip(b, items[i], caps)):
                b[:] = [r + x for r, x in zip(b, items[i])]
                place(i + 1, bins)
                b[:] = [r - x for r, x in zip(b, items[i])]
        bins.append(list(items[i]))
        place(i + 1, bins)
        bins.pop()

    place(0, [])
    return best[0]


@st.composite
def inputs(draw, max_n=40):
    n = draw(st.integers(0, max_n))
    lengths = draw(st.lists(st.integers(1, PACK + 8), min_size=n, max_size=n))
    vision = draw(st.lists(st.integers(0, VISION + 5), min_size=n, max_size=n))
    audio = draw(st.lists(st.integers(0, AUDIO + 5), min_size=n, max_size=n))
    return np.array(lengths, np.int64), np.array(vision, np.int64), np.array(audio, np.int64)


def _check_budgets(plan, lengths, vision, audio, with_vision, align, max_items=None):
    for k in range(len(plan)):
        idx = plan.pack(k)
        assert -(-lengths[idx] // align).sum() * align <= PACK
        assert audio[idx].sum() <= AUDIO and plan.pack_audio(k).sum() == audio[idx].sum()
        if with_vision:
            assert vision[idx].sum() <= VISION
        if max_items:
            assert idx.size <= max_items


@settings(deadline=None, max_examples=80)
@given(data=inputs(), algorithm=st.sampled_from(ALGORITHMS), with_vision=st.booleans(), align=st.sampled_from([1, 4]),
       max_items=st.sampled_from([None, 3]), seed=st.integers(0, 3))
def test_every_sample_once_within_every_budget_as_the_plain_definition(data, algorithm, with_vision, align, max_items,
                                                                       seed):
    lengths, vision, audio = data
    vision_kw = dict(vision_lengths=vision, vision_budget=VISION) if with_vision else {}
    plan = plan_packs(lengths, PACK, algorithm=algorithm, align=align, overflow="drop", max_samples_per_pack=max_items,
                      seed=seed, audio_lengths=audio, audio_budget=AUDIO, **vision_kw)
    usable = PACK // align * align
    over = (lengths > usable) | (audio > AUDIO) | ((vision > VISION) if with_vision else False)
    assert sorted(plan.dropped.tolist()) == np.flatnonzero(over).tolist()  # dropped: over some budget alone
    assert sorted(plan.sample_index.tolist()) == np.flatnonzero(~over).tolist()  # the rest, once each
    assert plan.audio_budget == AUDIO and plan.audio_length.tolist() == audio[plan.sample_index].tolist()
    _check_budgets(plan, lengths, vision, audio, with_vision, align, max_items)
    kept = np.flatnonzero(~over)
    sizes = -(-lengths[kept] // align) * align
    columns = [sizes] + ([vision[kept]] if with_vision else []) + [audio[kept]]
    caps = (PACK,) + ((VISION,) if with_vision else ()) + (AUDIO,)
    items = [tuple(int(c[i]) for c in columns) for i in range(kept.size)]
    expected = reference(items, caps, algorithm, seed, max_items or 0)
    got = [kept[np.searchsorted(kept, plan.pack(k))] for k in range(len(plan))]
    assert sorted(sorted(np.searchsorted(kept, g).tolist()) for g in got) == sorted(sorted(b) for b in expected)


@settings(deadline=None, max_examples=80)
@given(data=inputs(30), algorithm=st.sampled_from(ALGORITHMS), with_vision=st.booleans(),
       group_ids=st.lists(st.integers(0, 12), min_size=30, max_size=30))
def test_groups_share_a_pack_within_every_budget(data, algorithm, with_vision, group_ids):
    lengths, vision, audio = data
    lengths, vision, audio = lengths // 4 + 1, vision // 4, audio // 4  # groups that mostly fit
    groups = np.array(group_ids[: lengths.size], np.int64)
    vision_kw = dict(vision_lengths=vision, vision_budget=VISION) if with_vision else {}
    sums = lambda values: {g: values[groups == g].sum() for g in set(groups.tolist())}  # noqa: E731
    fits = all(v <= PACK for v in sums(lengths).values()) and all(v <= AUDIO for v in sums(audio).values()) and (
        not with_vision or all(v <= VISION for v in sums(vision).values()))
    call = lambda: plan_packs(lengths, PACK, algorithm=algorithm, groups=groups, audio_lengths=audio,  # noqa: E731
                              audio_budget=AUDIO, **vision_kw)
    if not fits:
        with pytest.raises(ValueError, match=r"^group -?\d+ \(samples .*\) has \d+ (tokens|vision|audio)"):
            call()
        return
    plan = call()
    assert sorted(plan.sample_index.tolist()) == list(range(lengths.size))
    _check_budgets(plan, lengths, vision, audio, with_vision, 1)
    pack_of = np.empty(lengths.size, np.int64)
    for k in range(len(plan)):
        pack_of[plan.pack(k)] = k
    for g in set(groups.tolist()):
        assert np.unique(pack_of[groups == g]).size == 1


@settings(deadline=None, max_examples=80, derandomize=True)
@given(data=inputs(6), algorithm=st.sampled_from(["bfd", "ffd"]))
def test_decreasing_algorithms_within_three_halves_of_the_optimum_on_tiny_inputs(data, algorithm):
    """The documented margin: no tighter guarantee holds for any-fit decreasing on several budgets."""
    lengths, vision, audio = (np.minimum(x, cap) for x, cap in zip(data, (PACK, VISION, AUDIO)))
    plan = plan_packs(lengths, PACK, algorithm=algorithm, vision_lengths=vision, vision_budget=VISION,
                      audio_lengths=audio, audio_budget=AUDIO)
    best = brute_optimum(list(zip(lengths.tolist(), vision.tolist(), audio.tolist())), (PACK, VISION, AUDIO))
    assert best <= len(plan) <= math.ceil(1.5 * best)


def test_without_audio_the_plans_and_keywords_are_those_of_before():
    rng = np.random.default_rng(0)
    lengths, vision = rng.integers(1, 300, 500), rng.integers(0, 60, 500)
    for algorithm in ALGORITHMS:
        a = plan_packs(lengths, 512, algorithm=algorithm, vision_lengths=vision, vision_budget=200)
        b = plan_packs(lengths, 512, algorithm=algorithm, vision_lengths=vision, vision_budget=200, audio_budget=None)
        assert a.audio_length is None and a.audio_budget is None and not a.pack_audio(0).any()
        np.testing.assert_array_equal(a.sample_index, b.sample_index)
        np.testing.assert_array_equal(a.pack_offsets, b.pack_offsets)
    assert "audio_budget" not in PLAN_FIELDS and "audio_budget" not in PlanOptions(64).keywords()
    assert PlanOptions(64, audio_budget=5).keywords()["audio_budget"] == 5


def test_a_pure_audio_budget_binds():
    lengths, audio = np.ones(10, np.int64), np.full(10, 10)
    plan = plan_packs(lengths, 100, audio_lengths=audio, audio_budget=25)
    assert len(plan) == 5 and plan.vision_length is None
    assert [plan.pack_audio(k).sum() for k in range(5)] == [20] * 5


@pytest.mark.parametrize("keywords, error, message", [
    (dict(audio_lengths=[1, -2, 0], audio_budget=8), SampleError, r"^sample 1 has negative audio length -2$"),
    (dict(audio_lengths=[1, 2], audio_budget=8), ValueError, r"^audio_lengths must be 1-D with one entry per sample \(3\)"),
    (dict(audio_lengths=[[1, 2, 3]], audio_budget=8), ValueError, r"^audio_lengths must be 1-D"),
    (dict(audio_lengths=[1.5, 2, 3], audio_budget=8), ValueError, r"^audio_lengths must be integers"),
    (dict(audio_lengths=[1, 2, 3]), ValueError, r"^audio_lengths and audio_budget go together"),
    (dict(audio_budget=8), ValueError, r"^audio_lengths and audio_budget go together"),
    (dict(audio_lengths=[1, 9, 3], audio_budget=8), SampleError,
     r"^sample 1 has 9 audio frames, more than audio_budget=8; 1 sample\(s\) are over"),
    (dict(audio_lengths=[1, 2, 3], audio_budget=0), ValueError, r"^audio_budget must be an integer >= 1, got 0$"),
    (dict(audio_lengths=[0, 0, 2], audio_budget=8, overflow="split"), SampleError,
     r"^sample 2 has 20 tokens, more than pack_size=16, and 2 audio frames: a sample with audio cannot be split"),
    (dict(audio_lengths=[0, 0, 2], audio_budget=8, overflow="truncate"), SampleError,
     r"^sample 2 has 20 tokens.*cannot be truncate"),
])
def test_errors_are_one_line_and_name_the_sample(keywords, error, message):
    with pytest.raises(error, match=message) as info:
        plan_packs([3, 4, 20 if "overflow" in keywords else 5], 16, **keywords)
    assert "\n" not in str(info.value)


def test_cut_samples_without_audio_are_still_cut_and_over_budget_samples_dropped():
    plan = plan_packs([3, 4, 20, 5], 16, audio_lengths=[1, 0, 0, 2], audio_budget=8, overflow="split")
    assert plan.stats.samples_split == 1 and sorted(set(plan.sample_index.tolist())) == [0, 1, 2, 3]
    plan = plan_packs([3, 4, 20, 5], 16, audio_lengths=[1, 9, 2, 2], audio_budget=8, overflow="drop")
    assert plan.dropped.tolist() == [1, 2] and sorted(plan.sample_index.tolist()) == [0, 3]


@pytest.mark.parametrize("make", [
    lambda: plan_balanced([1, 2, 3], 8, num_replicas=1, audio_budget=4),
    lambda: TokenBudgetBatchSampler([1, 2, 3], 8, audio_budget=4),
    lambda: StreamingPacker([{"input_ids": [1, 2]}], 8, audio_budget=4),
], ids=["plan_balanced", "TokenBudgetBatchSampler", "StreamingPacker"])
def test_other_planners_refuse_audio_budget(make):
    with pytest.raises(ValueError, match=r"^\w+ does not take audio_budget yet .*drop audio_budget=4$"):
        make()


def test_the_collator_needs_an_omni_family_for_audio_budget():
    with pytest.raises(ValueError, match=r"^audio_budget needs vlm=, an omni thinker's family .*got no vlm=$"):
        ThdCollator(pack_size=8, audio_budget=4)
    from thdpack.vlm import get_family

    qwen2_vl = {"model_type": "qwen2_vl", "vision_config": {"spatial_merge_size": 2}, "image_token_id": 5,
                "video_token_id": 6, "vision_start_token_id": 7}
    with pytest.raises(ValueError, match=r"got vlm= of model_type 'qwen2_vl'$"):
        ThdCollator(pack_size=8, audio_budget=4, vlm=get_family(qwen2_vl))
    with pytest.raises(TypeError, match=r"without pack_size"):
        ThdCollator(audio_budget=4)


@pytest.mark.parametrize("algorithm", ["bfd", "sequential"])
def test_the_collator_plans_the_audio_budget(algorithm):
    """``ThdCollator(vlm=omni family, pack_size=, audio_budget=)``: no pack over the budget, every sample once, each
    batch what build_thd_batch makes of its samples."""
    pytest.importorskip("transformers")
    import torch

    from test_omni_pack import make_sample, tiny_thinker
    from thdpack import build_thd_batch
    from thdpack.integrations import to_hf_kwargs
    from thdpack.vlm import get_family

    family = get_family(tiny_thinker().config)
    rng = np.random.default_rng(0)
    frames = [20, 35, 0, 50, 12, 0, 44, 28]
    samples = [make_sample(rng, [("text", 3)] + ([("audio", f)] if f else []) + [("text", 2)]) for f in frames]
    samples = [dict(s, sample_index=i) for i, s in enumerate(samples)]
    assert family.audio_lengths(samples).tolist() == frames
    collate = ThdCollator(vlm=family, pack_size=256, audio_budget=60, algorithm=algorithm)
    batches = collate(samples)
    seen = []
    for batch in batches:
        rows = batch.sample_index.tolist()
        seen += rows
        assert sum(frames[r] for r in rows) <= 60
        want = build_thd_batch([samples[r] for r in rows], vlm=family)
        got, ref = to_hf_kwargs(batch), to_hf_kwargs(want)
        assert got.keys() == ref.keys()
        for k in got:
            assert torch.equal(got[k], ref[k]) if isinstance(got[k], torch.Tensor) else got[k] == ref[k], k
    assert sorted(seen) == list(range(len(samples))) and len(batches) >= 4  # 239 frames, budget 60
    unbounded = ThdCollator(vlm=family, pack_size=256, algorithm=algorithm)(samples)
    assert len(unbounded) < len(batches)
