"""Property tests for pack planning (``plan_packs``) and the bin-packing kernels."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thdpack.planning import binpack as _binpack
from thdpack.planning.packing import (
    OVERFLOW_POLICIES, PACK_TOTALS_KEYS, Cuts, PackStats, PackTotals, cut_overflow, pack_totals, usable_length,
)
from thdpack.planning.options import ALGORITHMS
from thdpack.planning.plan import PackPlan, plan_packs

SETTINGS = settings(max_examples=80, deadline=None)


def aligned(x, align):
    return -(-np.asarray(x, dtype=np.int64) // align) * align


# --------------------------------------------------------------------------
# tiny pure-Python references of the kernels
# --------------------------------------------------------------------------
def ref_first_fit(sizes, capacity, max_items):
    """Each item into the lowest-numbered bin with room (and item slots) for it."""
    rooms, counts, bin_of = [], [], []
    for s in sizes:
        for b in range(len(rooms)):
            if rooms[b] >= s and (max_items <= 0 or counts[b] < max_items):
                break
        else:
            b = len(rooms)
            rooms.append(capacity)
            counts.append(0)
        rooms[b] -= s
        counts[b] += 1
        bin_of.append(b)
    return bin_of, len(rooms)


def ref_next_fit_2d(sizes, vsizes, capacity, vcapacity, max_items):
    """Only the most recently opened bin is open; an item goes there only when both
    its tokens and its vision patches fit (and the bin has an item slot left)."""
    rooms, vrooms, counts, bin_of = [], [], [], []
    for s, v in zip(sizes, vsizes):
        if not rooms or rooms[-1] < s or vrooms[-1] < v or (max_items > 0 and counts[-1] >= max_items):
            rooms.append(capacity)
            vrooms.append(vcapacity)
            counts.append(0)
        rooms[-1] -= s
        vrooms[-1] -= v
        counts[-1] += 1
        bin_of.append(len(rooms) - 1)
    return bin_of, len(rooms)


def ref_next_fit(sizes, capacity, max_items):
    """Next fit on tokens alone: the 2-D reference with no vision patches."""
    return ref_next_fit_2d(sizes, [0] * len(sizes), capacity, 0, max_items)


def _feasible_bins(rooms, vrooms, counts, s, v, max_items):
    """Open bins that hold an item of ``s`` tokens and ``v`` vision patches."""
    return [
        b for b in range(len(rooms))
        if rooms[b] >= s and vrooms[b] >= v and (max_items <= 0 or counts[b] < max_items)
    ]


def ref_best_fit_2d(sizes, vsizes, capacity, vcapacity, max_items):
    """Each item into the open bin that holds it in both budgets with the least token
    room (ties: least vision room, then lowest number); a new bin when none holds it."""
    rooms, vrooms, counts, bin_of = [], [], [], []
    for s, v in zip(sizes, vsizes):
        feasible = _feasible_bins(rooms, vrooms, counts, s, v, max_items)
        if feasible:
            b = min(feasible, key=lambda k: (rooms[k], vrooms[k], k))
        else:
            b = len(rooms)
            rooms.append(capacity)
            vrooms.append(vcapacity)
            counts.append(0)
        rooms[b] -= s
        vrooms[b] -= v
        counts[b] += 1
        bin_of.append(b)
    return bin_of, len(rooms)


def ref_best_fit(sizes, capacity, max_items):
    """Best fit on tokens alone: the 2-D reference with no vision patches."""
    return ref_best_fit_2d(sizes, [0] * len(sizes), capacity, 0, max_items)


def best_fit_trace(sizes, vsizes, capacity, vcapacity, bin_of):
    """``(token room, vision room)`` of the bin each item went to, before it went
    there, or None when it opened a new bin. Bins with equal rooms are
    interchangeable for best fit, so without an item cap two correct best-fit runs
    have equal traces whatever their tie-breaking among such bins."""
    rooms, vrooms, trace = [], [], []
    for s, v, b in zip(sizes, vsizes, bin_of):
        if b == len(rooms):
            rooms.append(capacity)
            vrooms.append(vcapacity)
            trace.append(None)
        else:
            trace.append((rooms[b], vrooms[b]))
        rooms[b] -= s
        vrooms[b] -= v
    return trace


def assert_best_fit_choices(sizes, capacity, max_items, bin_of, nbins, vsizes=None, vcapacity=0):
    """Replay an assignment: every item went to a feasible open bin of minimum token room
    (then minimum vision room), or to a new bin (numbered in opening order) only when no
    open bin could take it. Without ``vsizes`` the items have no vision patches."""
    vsizes = [0] * len(sizes) if vsizes is None else vsizes
    rooms, vrooms, counts = [], [], []
    for j, (s, v) in enumerate(zip(sizes, vsizes)):
        s, v, b = int(s), int(v), int(bin_of[j])
        feasible = _feasible_bins(rooms, vrooms, counts, s, v, max_items)
        if b == len(rooms):
            assert not feasible, f"item {j} (size {s}, vision {v}) opened bin {b} although bins {feasible} could hold it"
            rooms.append(capacity)
            vrooms.append(vcapacity)
            counts.append(0)
        else:
            assert 0 <= b < len(rooms), f"item {j} went to bin {b}, not open and not the next new bin"
            assert b in feasible, f"item {j} (size {s}, vision {v}) went to bin {b} with rooms {rooms[b]}, {vrooms[b]}"
            best = min((rooms[k], vrooms[k]) for k in feasible)
            got = (rooms[b], vrooms[b])
            assert got == best, f"item {j} (size {s}, vision {v}) went to rooms {got}, best feasible was {best}"
        rooms[b] -= s
        vrooms[b] -= v
        counts[b] += 1
    assert nbins == len(rooms)
    assert all(r >= 0 for r in rooms) and all(r >= 0 for r in vrooms)
    if max_items > 0:
        assert all(c <= max_items for c in counts)


# --------------------------------------------------------------------------
# kernels against the references
# --------------------------------------------------------------------------
@st.composite
def kernel_inputs(draw):
    capacity = draw(st.integers(1, 64))
    small = st.integers(1, max(1, capacity // 3))
    sizes = draw(st.lists(st.one_of(small, st.integers(1, capacity)), max_size=80))
    max_items = draw(st.sampled_from([0, 0, 1, 2, 3, 5]))
    return np.array(sizes, dtype=np.int64), capacity, max_items


@pytest.mark.parametrize("kernel, reference", [("first_fit", ref_first_fit), ("next_fit", ref_next_fit)])
@SETTINGS
@given(args=kernel_inputs())
def test_fit_kernel_matches_reference(kernel, reference, args):
    sizes, capacity, max_items = args
    bin_of, nbins = getattr(_binpack, kernel)(sizes, capacity, max_items)
    ref_bins, ref_n = reference(sizes.tolist(), capacity, max_items)
    assert int(nbins) == ref_n
    assert bin_of.tolist() == ref_bins


@SETTINGS
@given(kernel_inputs())
def test_best_fit_kernel_picks_min_feasible_room(args):
    sizes, capacity, max_items = args
    bin_of, nbins = _binpack.best_fit(sizes, capacity, max_items)
    assert bin_of.shape == sizes.shape
    assert_best_fit_choices(sizes.tolist(), capacity, max_items, bin_of.tolist(), int(nbins))
    _, ref_n = ref_best_fit(sizes.tolist(), capacity, max_items)
    if max_items == 0:
        # without an item cap the state is the multiset of rooms: tie-breaking cannot matter
        assert int(nbins) == ref_n


# ---- two budgets (tokens, vision patches) ------------------------------------
@st.composite
def kernel_inputs_2d(draw):
    """Small rooms so that items often fill a bin exactly, or miss by one unit."""
    capacity = draw(st.integers(1, 24))
    vcapacity = draw(st.integers(1, 24))
    n = draw(st.integers(0, 60))
    sizes = draw(st.lists(st.one_of(st.integers(1, max(1, capacity // 3)), st.integers(1, capacity)), min_size=n, max_size=n))
    vsizes = draw(st.lists(
        st.one_of(st.just(0), st.integers(0, max(1, vcapacity // 3)), st.integers(0, vcapacity)), min_size=n, max_size=n
    ))
    max_items = draw(st.sampled_from([0, 0, 1, 2, 3]))
    return np.array(sizes, dtype=np.int64), np.array(vsizes, dtype=np.int64), capacity, vcapacity, max_items


@SETTINGS
@given(kernel_inputs_2d())
def test_next_fit_2d_kernel_matches_reference(args):
    sizes, vsizes, capacity, vcapacity, max_items = args
    bin_of, nbins = _binpack.next_fit_2d(sizes, vsizes, capacity, vcapacity, max_items)
    ref_bins, ref_n = ref_next_fit_2d(sizes.tolist(), vsizes.tolist(), capacity, vcapacity, max_items)
    assert bin_of.tolist() == ref_bins
    assert int(nbins) == ref_n


@SETTINGS
@given(kernel_inputs_2d())
def test_best_fit_2d_kernel_matches_reference(args):
    sizes, vsizes, capacity, vcapacity, max_items = args
    bin_of, nbins = _binpack.best_fit_2d(sizes, vsizes, capacity, vcapacity, max_items)
    assert bin_of.shape == sizes.shape
    assert_best_fit_choices(sizes.tolist(), capacity, max_items, bin_of.tolist(), int(nbins), vsizes.tolist(), vcapacity)
    if max_items == 0:  # bins with equal rooms are then interchangeable: the traces must agree exactly
        ref_bins, ref_n = ref_best_fit_2d(sizes.tolist(), vsizes.tolist(), capacity, vcapacity, 0)
        trace = best_fit_trace(sizes.tolist(), vsizes.tolist(), capacity, vcapacity, bin_of.tolist())
        assert trace == best_fit_trace(sizes.tolist(), vsizes.tolist(), capacity, vcapacity, ref_bins)
        assert int(nbins) == ref_n


# (sizes, vision sizes, capacity, vision capacity, max_items, expected bins): an item exactly
# filling the room, one unit over, on each budget; then choices only the right kernel makes
BOUNDARY_2D = {
    "next_fit_2d": [
        ([4, 6], [0, 0], 10, 10, 0, [0, 0]),  # tokens exactly fill
        ([4, 7], [0, 0], 10, 10, 0, [0, 1]),  # tokens one over
        ([1, 1], [5, 5], 10, 10, 0, [0, 0]),  # vision exactly fills
        ([1, 1], [5, 6], 10, 10, 0, [0, 1]),  # vision one over (issue 14)
        ([4, 6], [5, 5], 10, 10, 0, [0, 0]),  # both exactly fill
        ([4, 6], [10, 1], 10, 10, 0, [0, 1]),  # tokens fit exactly, vision one over
        ([10, 1], [0, 0], 10, 10, 0, [0, 1]),  # one item fills the whole bin
        ([1, 1], [10, 0], 10, 10, 0, [0, 0]),  # one item fills the whole vision budget; no patches fit
        ([1, 1, 1], [3, 3, 0], 10, 6, 0, [0, 0, 0]),  # the second item fills the (smaller) vision budget
        ([1, 1, 1], [3, 3, 1], 10, 6, 0, [0, 0, 1]),  # ... and the third is one patch over
        ([6, 5, 4], [0, 0, 0], 10, 10, 0, [0, 1, 1]),  # never goes back to an earlier bin
        ([1, 1, 1], [0, 0, 0], 10, 10, 2, [0, 0, 1]),  # item cap
    ],
    "best_fit_2d": [
        ([4, 6], [0, 0], 10, 10, 0, [0, 0]),
        ([4, 7], [0, 0], 10, 10, 0, [0, 1]),
        ([1, 1], [5, 5], 10, 10, 0, [0, 0]),
        ([1, 1], [5, 6], 10, 10, 0, [0, 1]),
        ([4, 6], [5, 5], 10, 10, 0, [0, 0]),
        ([4, 6], [10, 1], 10, 10, 0, [0, 1]),
        ([10, 1], [0, 0], 10, 10, 0, [0, 1]),
        ([1, 1], [10, 0], 10, 10, 0, [0, 0]),
        ([1, 1, 1], [3, 3, 0], 10, 6, 0, [0, 0, 0]),
        ([1, 1, 1], [3, 3, 1], 10, 6, 0, [0, 0, 1]),
        ([5, 7, 3], [0, 0, 0], 10, 10, 0, [0, 1, 1]),  # least token room that holds it (exact fill)
        ([5, 7, 4], [0, 0, 0], 10, 10, 0, [0, 1, 0]),  # least room is one token short
        ([5, 7, 3], [0, 8, 2], 10, 10, 0, [0, 1, 1]),  # least room holds the patches exactly
        ([5, 7, 3], [0, 8, 3], 10, 10, 0, [0, 1, 0]),  # least room is one patch short
        ([6, 6, 3], [2, 4, 1], 10, 10, 0, [0, 1, 1]),  # equal token rooms: least vision room
        ([6, 6, 3], [2, 4, 7], 10, 10, 0, [0, 1, 0]),  # ... unless it is one patch short
        ([6, 6, 3], [4, 2, 1], 10, 10, 0, [0, 1, 0]),  # ... also when that is the older bin
        ([2, 2, 2], [0, 0, 0], 10, 10, 2, [0, 0, 1]),  # item cap
    ],
}


@pytest.mark.parametrize(
    "kernel, case", [(k, c) for k, cases in BOUNDARY_2D.items() for c in cases], ids=lambda x: str(x)
)
def test_2d_kernels_on_boundary_cases(kernel, case):
    sizes, vsizes, capacity, vcapacity, max_items, expected = case
    reference = {"next_fit_2d": ref_next_fit_2d, "best_fit_2d": ref_best_fit_2d}[kernel]
    assert reference(sizes, vsizes, capacity, vcapacity, max_items) == (expected, max(expected) + 1)
    bin_of, nbins = getattr(_binpack, kernel)(
        np.array(sizes, np.int64), np.array(vsizes, np.int64), capacity, vcapacity, max_items
    )
    assert bin_of.tolist() == expected
    assert int(nbins) == max(expected) + 1


@SETTINGS
@given(st.lists(st.integers(0, 20), max_size=60), st.booleans())
def test_bucket_order_is_a_stable_sort(keys, descending):
    keys = np.array(keys, dtype=np.int64)
    order = _binpack.bucket_order(keys, 21, descending)
    expected = np.argsort(-keys if descending else keys, kind="stable")
    assert order.tolist() == expected.tolist()


# --------------------------------------------------------------------------
# plan_packs properties
# --------------------------------------------------------------------------
@st.composite
def plan_inputs(draw):
    align = draw(st.sampled_from([1, 1, 2, 3, 4, 8]))
    pack_size = draw(st.integers(align, 160))
    overflow = draw(st.sampled_from(OVERFLOW_POLICIES))
    limit = pack_size // align * align
    max_len = limit if overflow == "error" else 2 * pack_size + 5
    small = st.integers(1, max(1, max_len // 4))
    lengths = draw(st.lists(st.one_of(small, st.integers(1, max_len)), max_size=60))
    algorithm = draw(st.sampled_from(ALGORITHMS))
    max_spp = draw(st.one_of(st.none(), st.integers(1, 6)))
    seed = draw(st.integers(0, 2**32 - 1))
    as_numpy = draw(st.booleans())
    return dict(
        lengths=np.array(lengths, dtype=np.int64) if as_numpy else lengths,
        pack_size=pack_size,
        align=align,
        overflow=overflow,
        algorithm=algorithm,
        max_samples_per_pack=max_spp,
        seed=seed,
    )


def run_plan(kw) -> PackPlan:
    kw = dict(kw)
    return plan_packs(kw.pop("lengths"), kw.pop("pack_size"), **kw)


def pieces_in_creation_order(plan: PackPlan):
    """(sample, start, length, pack) of every piece, sorted by (sample, start)."""
    pack_of = np.repeat(np.arange(len(plan)), np.diff(plan.pack_offsets))
    rows = sorted(
        zip(plan.sample_index.tolist(), plan.start.tolist(), plan.length.tolist(), pack_of.tolist())
    )
    return rows


def check_plan(plan: PackPlan, lengths, pack_size, align, overflow, max_spp):
    lengths = np.asarray(lengths, dtype=np.int64)
    n = lengths.size
    limit = pack_size // align * align
    over = lengths > limit

    # ---- layout ---------------------------------------------------------
    for arr in (plan.sample_index, plan.start, plan.length, plan.pack_offsets, plan.dropped):
        assert arr.dtype == np.int64
    m = plan.sample_index.size
    assert plan.start.size == m and plan.length.size == m
    assert plan.pack_offsets[0] == 0 and plan.pack_offsets[-1] == m
    counts = np.diff(plan.pack_offsets)
    assert (counts >= 1).all(), "empty pack"
    num_packs = len(plan)
    assert num_packs == len(plan.pack_offsets) - 1 == len(plan.packs)
    assert (plan.length >= 1).all()
    assert (plan.start >= 0).all()
    assert (plan.start + plan.length <= lengths[plan.sample_index]).all()

    # ---- capacity ---------------------------------------------------------
    sizes = aligned(plan.length, align)
    fills_aligned = np.array([sizes[a:b].sum() for a, b in zip(plan.pack_offsets[:-1], plan.pack_offsets[1:])], dtype=np.int64)
    fills_real = np.array([plan.length[a:b].sum() for a, b in zip(plan.pack_offsets[:-1], plan.pack_offsets[1:])], dtype=np.int64)
    assert (fills_aligned <= pack_size).all(), f"pack over budget: {fills_aligned.max()} > {pack_size}"
    if max_spp is not None:
        assert (counts <= max_spp).all()

    # ---- accessors agree --------------------------------------------------
    for k in range(num_packs):
        idx, st_, ln = plan.pieces(k)
        assert plan.pack(k).tolist() == idx.tolist() == plan.packs[k].tolist()
        assert plan.pack_lengths(k).tolist() == ln.tolist()
        # pieces in a pack are ordered by (input index, start)
        keys = list(zip(idx.tolist(), st_.tolist()))
        assert keys == sorted(keys) and len(set(keys)) == len(keys)

    # ---- coverage -----------------------------------------------------------
    by_sample: dict[int, list[tuple[int, int]]] = {}
    for i, a, ln in zip(plan.sample_index.tolist(), plan.start.tolist(), plan.length.tolist()):
        by_sample.setdefault(i, []).append((a, ln))
    dropped = set(plan.dropped.tolist())
    for i in range(n):
        L = int(lengths[i])
        if overflow == "drop" and over[i]:
            assert i in dropped
            assert i not in by_sample, f"dropped sample {i} placed"
            continue
        assert i not in dropped
        pieces = sorted(by_sample.get(i, []))
        assert pieces, f"sample {i} not placed"
        if overflow == "split":
            pos = 0
            for a, ln in pieces:
                assert a == pos, f"sample {i}: pieces {pieces} leave a gap or overlap"
                pos += ln
            assert pos == L, f"sample {i}: pieces {pieces} cover {pos} of {L} tokens"
            if not over[i]:
                assert pieces == [(0, L)]
            else:
                assert len(pieces) >= 2
        elif overflow == "truncate":
            assert pieces == [(0, min(L, limit))]
        else:
            assert pieces == [(0, L)]
    assert set(by_sample) <= set(range(n))
    if overflow == "drop":
        assert plan.dropped.tolist() == np.flatnonzero(over).tolist()
    else:
        assert plan.dropped.size == 0

    # ---- stats --------------------------------------------------------------
    s = plan.stats
    assert s.num_packs == num_packs
    assert s.num_samples == n
    assert s.num_pieces == m
    assert s.pack_size == pack_size
    assert s.real_tokens == int(plan.length.sum())
    assert s.aligned_tokens == int(sizes.sum())
    assert s.lower_bound == -(-int(sizes.sum()) // pack_size)
    assert s.lower_bound <= s.num_packs
    if num_packs:
        assert s.efficiency == pytest.approx(s.real_tokens / (num_packs * pack_size))
        assert 0 < s.efficiency <= 1
        assert s.packing_factor == pytest.approx(m / num_packs)
        assert s.max_samples_per_pack == int(counts.max())
        assert s.min_pack_fill == pytest.approx(fills_real.min() / pack_size)
        assert s.max_pack_fill == pytest.approx(fills_real.max() / pack_size)
        assert 0 < s.min_pack_fill <= s.max_pack_fill <= 1
    else:
        assert m == 0
        assert s.efficiency == 0 and s.packing_factor == 0
    n_over = int(over.sum())
    over_tokens = int(lengths[over].sum())
    assert s.samples_truncated == (n_over if overflow == "truncate" else 0)
    assert s.tokens_truncated == (over_tokens - n_over * limit if overflow == "truncate" else 0)
    assert s.samples_dropped == (n_over if overflow == "drop" else 0)
    assert s.tokens_dropped == (over_tokens if overflow == "drop" else 0)
    assert s.samples_split == (n_over if overflow == "split" else 0)
    # every input token is placed, truncated or dropped
    assert s.real_tokens + s.tokens_truncated + s.tokens_dropped == int(lengths.sum())
    assert plan.is_whole_samples == (s.samples_truncated == 0 and s.samples_split == 0)
    assert s.as_dict()["num_packs"] == num_packs
    assert "packs" in str(s)


@SETTINGS
@given(plan_inputs())
def test_plan_invariants(kw):
    plan = run_plan(kw)
    assert plan.pack_size == kw["pack_size"] and plan.align == kw["align"]
    assert plan.algorithm == kw["algorithm"] and plan.overflow == kw["overflow"]
    check_plan(plan, kw["lengths"], kw["pack_size"], kw["align"], kw["overflow"], kw["max_samples_per_pack"])


@SETTINGS
@given(plan_inputs())
def test_plan_is_deterministic(kw):
    a, b = run_plan(kw), run_plan(kw)
    for name in ("sample_index", "start", "length", "pack_offsets", "dropped"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.stats == b.stats


@SETTINGS
@given(plan_inputs())
def test_plan_matches_reference_kernels(kw):
    """ffd / sequential give exactly what the references give on the documented
    placement order; bfd makes best-fit choices in decreasing-size order."""
    plan = run_plan(kw)
    rows = pieces_in_creation_order(plan)
    if not rows:
        return
    align, pack_size = kw["align"], kw["pack_size"]
    max_items = kw["max_samples_per_pack"] or 0
    sizes = aligned([r[2] for r in rows], align)
    actual_bins = np.array([r[3] for r in rows])
    algorithm = kw["algorithm"]
    if algorithm in ("ffd", "bfd"):
        order = np.argsort(-sizes, kind="stable")  # decreasing size, ties in input order
    elif algorithm == "sequential":
        order = np.arange(len(rows))
    else:
        order = None
    if algorithm == "ffd":
        ref, _ = ref_first_fit(sizes[order].tolist(), pack_size, max_items)
        expected = np.empty(len(rows), dtype=np.int64)
        expected[order] = ref
        assert actual_bins.tolist() == expected.tolist()
    elif algorithm == "sequential":
        ref, _ = ref_next_fit(sizes.tolist(), pack_size, max_items)
        assert actual_bins.tolist() == ref
    elif algorithm == "bfd":
        assert_best_fit_choices(sizes[order].tolist(), pack_size, max_items, actual_bins[order].tolist(), len(plan))
        if max_items == 0:
            _, ref_n = ref_best_fit(sizes[order].tolist(), pack_size, 0)
            assert len(plan) == ref_n


def test_sequential_plan_keeps_vision_budget_one_patch_over():
    """Issue 14: next fit must close a pack one vision patch short of the next sample."""
    plan = plan_packs([1, 1], 10, algorithm="sequential", vision_lengths=[5, 6], vision_budget=10)
    assert [p.tolist() for p in plan.packs] == [[0], [1]]
    assert plan.stats.max_pack_vision == 6
    exact = plan_packs([1, 1], 10, algorithm="sequential", vision_lengths=[5, 5], vision_budget=10)
    assert [p.tolist() for p in exact.packs] == [[0, 1]]


@SETTINGS
@given(kernel_inputs_2d(), st.sampled_from(["bfd", "sequential"]))
def test_vision_plan_matches_reference_kernels(args, algorithm):
    """With a vision budget, ``sequential`` is exactly next fit in input order and ``bfd``
    makes best-fit choices by decreasing larger share of either budget."""
    sizes, vsizes, pack_size, vision_budget, max_items = args
    plan = plan_packs(sizes, pack_size, algorithm=algorithm, vision_lengths=vsizes, vision_budget=vision_budget,
                      max_samples_per_pack=max_items or None)
    rows = pieces_in_creation_order(plan)
    actual_bins = [r[3] for r in rows]
    if algorithm == "sequential":
        assert actual_bins == ref_next_fit_2d(sizes.tolist(), vsizes.tolist(), pack_size, vision_budget, max_items)[0]
        return
    order = np.argsort(-np.maximum(sizes * vision_budget, vsizes * pack_size), kind="stable")
    assert_best_fit_choices(sizes[order].tolist(), pack_size, max_items, np.array(actual_bins)[order].tolist(),
                            len(plan), vsizes[order].tolist(), vision_budget)


@SETTINGS
@given(plan_inputs())
def test_any_fit_packs_are_pairwise_over_half_full(kw):
    """First fit / best fit (in any order) never leave two packs that could be merged;
    next fit never leaves two *consecutive* packs that could be merged."""
    if kw["max_samples_per_pack"] is not None:
        return
    plan = run_plan(kw)
    if len(plan) < 2:
        return
    sizes = aligned(plan.length, kw["align"])
    fills = np.add.reduceat(sizes, plan.pack_offsets[:-1])
    pack_size = kw["pack_size"]
    if kw["algorithm"] == "sequential":
        assert (fills[:-1] + fills[1:] > pack_size).all()
    else:
        two_smallest = np.sort(fills)[:2]
        assert two_smallest.sum() > pack_size


@SETTINGS
@given(plan_inputs())
def test_sequential_keeps_input_order(kw):
    kw = dict(kw, algorithm="sequential")
    plan = run_plan(kw)
    keys = list(zip(plan.sample_index.tolist(), plan.start.tolist()))
    assert keys == sorted(keys), "sequential plan reordered samples across packs"
    # next fit: a pack is closed only when the next piece does not fit (or the cap is hit)
    sizes = aligned(plan.length, kw["align"])
    cap = kw["max_samples_per_pack"]
    for k in range(len(plan) - 1):
        a, b = plan.pack_offsets[k], plan.pack_offsets[k + 1]
        fits = sizes[a:b].sum() + sizes[b] <= kw["pack_size"]
        cap_hit = cap is not None and b - a >= cap
        assert not fits or cap_hit, f"pack {k} closed although piece {b} fit"


@SETTINGS
@given(plan_inputs())
def test_max_samples_per_pack_one(kw):
    kw = dict(kw, max_samples_per_pack=1)
    plan = run_plan(kw)
    assert (np.diff(plan.pack_offsets) == 1).all()
    assert len(plan) == plan.stats.num_pieces


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=20, max_size=60), st.integers(0, 2**31), st.integers(0, 2**31))
def test_first_fit_shuffle_seed(lengths, seed_a, seed_b):
    a = plan_packs(lengths, 64, algorithm="first_fit_shuffle", seed=seed_a)
    a2 = plan_packs(lengths, 64, algorithm="first_fit_shuffle", seed=seed_a)
    assert np.array_equal(a.sample_index, a2.sample_index) and np.array_equal(a.pack_offsets, a2.pack_offsets)
    assert a.seed == seed_a
    check_plan(a, lengths, 64, 1, "error", None)
    b = plan_packs(lengths, 64, algorithm="first_fit_shuffle", seed=seed_b)
    check_plan(b, lengths, 64, 1, "error", None)


def test_first_fit_shuffle_seed_changes_plan():
    lengths = np.random.default_rng(0).integers(1, 200, size=300)
    plans = {plan_packs(lengths, 512, algorithm="first_fit_shuffle", seed=s).sample_index.tobytes() for s in range(5)}
    assert len(plans) > 1, "the seed has no effect on first_fit_shuffle"


def test_empty_lengths_give_empty_plan():
    for algorithm in ALGORITHMS:
        plan = plan_packs([], 16, algorithm=algorithm)
        assert len(plan) == 0 and plan.stats.num_samples == 0 and plan.stats.lower_bound == 0
        assert plan.stats.num_packs == 0 and plan.stats.efficiency == 0.0
        assert [p.tolist() for p in plan.packs] == [], "an empty plan must have no packs"


def test_all_dropped():
    plan = plan_packs([20, 30], 16, overflow="drop")
    assert len(plan) == 0
    assert plan.dropped.tolist() == [0, 1]
    assert plan.stats.samples_dropped == 2 and plan.stats.tokens_dropped == 50
    assert [p.tolist() for p in plan.packs] == [], "a plan with every sample dropped must have no packs"


def test_split_example():
    plan = plan_packs([5, 10], 4, overflow="split", algorithm="sequential")
    check_plan(plan, [5, 10], 4, 1, "split", None)
    pieces = pieces_in_creation_order(plan)
    assert [(i, a, n) for i, a, n, _ in pieces] == [(0, 0, 4), (0, 4, 1), (1, 0, 4), (1, 4, 4), (1, 8, 2)]
    assert plan.stats.samples_split == 2


def test_truncate_with_align_example():
    # pack_size 10, align 4: the longest real length whose aligned length fits is 8
    plan = plan_packs([9, 3, 10], 10, align=4, overflow="truncate")
    check_plan(plan, [9, 3, 10], 10, 4, "truncate", None)
    got = {i: n for i, n in zip(plan.sample_index.tolist(), plan.length.tolist())}
    assert got == {0: 8, 1: 3, 2: 8}
    assert plan.stats.tokens_truncated == 1 + 2


def _lognormal_lengths(n, seed, pack_size):
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(mean=np.log(500), sigma=1.0, size=n)), 1, pack_size).astype(np.int64)


@pytest.mark.parametrize("align", [1, 8])
def test_bfd_quality_on_lognormal(align):
    pack_size = 4096
    lengths = _lognormal_lengths(20_000, 1234, pack_size)
    lengths = np.minimum(lengths, pack_size // align * align)
    bfd = plan_packs(lengths, pack_size, algorithm="bfd", align=align)
    ffd = plan_packs(lengths, pack_size, algorithm="ffd", align=align)
    seq = plan_packs(lengths, pack_size, algorithm="sequential", align=align)
    for p in (bfd, ffd, seq):
        check_plan(p, lengths, pack_size, align, "error", None)
    lb = bfd.stats.lower_bound
    assert bfd.stats.num_packs <= ffd.stats.num_packs + max(1, ffd.stats.num_packs // 200)
    assert bfd.stats.num_packs <= lb + 3, (bfd.stats.num_packs, lb)
    assert bfd.stats.num_packs < seq.stats.num_packs


def test_plans_large_input_near_the_lower_bound():
    """200k long-tailed lengths: BFD within 3 packs of the lower bound, every sample once.
    (Its speed is measured by benchmarks/plan.py against the peers, not asserted here.)"""
    lengths = _lognormal_lengths(200_000, 7, 8192)
    plan = plan_packs(lengths, 8192, algorithm="bfd")
    assert plan.stats.num_packs <= plan.stats.lower_bound + 3
    assert np.array_equal(np.sort(plan.sample_index), np.arange(lengths.size))


# --------------------------------------------------------------------------
# the packing core (thdpack/planning/packing.py): usable length, overflow, PackStats
# --------------------------------------------------------------------------
def test_usable_length_is_pack_size_rounded_down_to_align():
    assert [usable_length(p, a) for p, a in ((10, 1), (10, 4), (8, 8), (4096, 6))] == [10, 8, 8, 4092]
    with pytest.raises(ValueError, match=r"pack_size \(7\) is smaller than align \(8\); nothing can fit"):
        usable_length(7, 8)


@pytest.mark.parametrize(
    "overflow, sample_index, start, length, dropped, cuts",
    [
        ("truncate", [0, 1, 2, 3], [0, 0, 0, 0], [3, 8, 5, 8], [], Cuts(samples_truncated=2, tokens_truncated=3 + 12)),
        ("split", [0, 1, 1, 2, 3, 3, 3], [0, 0, 8, 0, 0, 8, 16], [3, 8, 3, 5, 8, 8, 4], [], Cuts(samples_split=2)),
        ("drop", [0, 2], [0, 0], [3, 5], [1, 3], Cuts(samples_dropped=2, tokens_dropped=11 + 20)),
    ],
)
def test_cut_overflow_exact(overflow, sample_index, start, length, dropped, cuts):
    """pack_size 10 at align 4: 8 tokens fit (usable_length); samples 1 (11) and 3 (20) are over."""
    pieces = cut_overflow(np.array([3, 11, 5, 20], np.int64), overflow, 10, 4)
    assert pieces.sample_index.tolist() == sample_index
    assert pieces.start.tolist() == start
    assert pieces.length.tolist() == length
    assert pieces.dropped.tolist() == dropped
    assert pieces.cuts == cuts


def test_cut_overflow_error_names_the_first_sample_and_the_count():
    lengths = np.array([3, 11, 5, 20], np.int64)
    with pytest.raises(ValueError, match=r"^sample 1 has 11 tokens \(12 after aligning to 4\), more than pack_size=10; "
                                         r"2 sample\(s\) are too long\. Use overflow="):
        cut_overflow(lengths, "error", 10, 4)
    with pytest.raises(ValueError, match=r"^sample 41 has 11 tokens, more than pack_size=10; 2 sample"):
        cut_overflow(lengths, "error", 10, 1, names=np.array([40, 41, 42, 43]))
    whole = cut_overflow(np.array([3, 8], np.int64), "error", 10, 4)  # nothing over: every sample one whole piece
    assert whole.length.tolist() == [3, 8] and whole.cuts == Cuts()


def test_pack_stats_from_packs_exact():
    # packs [3, 5] and [8] of pack_size 10 at align 4: aligned 4 + 8 + 8 = 20 -> lower bound 2
    stats = PackStats.from_packs(np.array([3, 5, 8]), np.array([0, 2, 3]), 10, align=4, num_samples=4,
                                 cuts=Cuts(samples_dropped=1, tokens_dropped=30))
    assert stats == PackStats(
        num_packs=2, num_samples=4, num_pieces=3, lower_bound=2, pack_size=10, real_tokens=16, aligned_tokens=20,
        efficiency=0.8, packing_factor=1.5, max_samples_per_pack=2, min_pack_fill=0.8, max_pack_fill=0.8,
        samples_truncated=0, tokens_truncated=0, samples_dropped=1, tokens_dropped=30, samples_split=0,
    )
    empty = PackStats.from_packs(np.zeros(0, np.int64), np.zeros(1, np.int64), 10)
    assert (empty.num_packs, empty.efficiency, empty.min_pack_fill, empty.lower_bound) == (0, 0.0, 0.0, 0)
    vision = PackStats.from_packs(np.array([3, 5, 8]), np.array([0, 2, 3]), 10, vision_length=np.array([4, 0, 7]),
                                  vision_budget=8)
    assert (vision.vision_budget, vision.vision_patches, vision.max_pack_vision, vision.lower_bound) == (8, 11, 7, 2)


def test_pack_totals_pack_by_pack_equal_the_arrays_and_round_trip():
    totals = PackTotals()
    for pack in ([3, 5], [8], [1, 1, 1]):
        totals.add_pack(len(pack), sum(pack), sum(-(-n // 4) * 4 for n in pack))
    totals.add_cuts(Cuts(samples_split=1))
    lengths, offsets = np.array([3, 5, 8, 1, 1, 1]), np.array([0, 2, 3, 6])
    assert totals == pack_totals(lengths, offsets, 4, num_samples=0, cuts=Cuts(samples_split=1))
    assert PackTotals.from_dict(totals.as_dict()) == totals
    assert tuple(totals.as_dict()) == PACK_TOTALS_KEYS


def test_a_pack_out_of_range_is_named():
    """``plan.pieces(k)`` past the last pack was a bare numpy IndexError, and a negative k before the
    first silently gave an empty pack (issue 21 point 6); negative k counts from the end."""
    plan = plan_packs([5, 6, 7, 8, 9], 10)
    n = len(plan.packs)
    for k in (n, n + 1, -n - 1, 2.0, True):
        for method in (plan.pieces, plan.pack_lengths, plan.pack_vision):
            with pytest.raises(IndexError, match=rf"^pack must be an integer in \[-{n}, {n}\), got {k!r} \(the plan has "
                                                 rf"{n} packs; a negative pack counts from the end\)$"):
                method(k)
    for k in range(-n, n):
        assert plan.pack_lengths(k).tolist() == plan.pack_lengths(k % n).tolist()
        assert plan.pieces(k)[0].tolist() == list(plan.packs[k % n])
