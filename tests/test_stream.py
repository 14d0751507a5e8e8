"""Tests for ``thdpack.StreamingPacker``: bounded-buffer best fit over a stream, exact resume."""

from __future__ import annotations

import itertools
import pickle
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import thdpack
from thdpack import StreamingPacker, ThdCollator, plan_packs
from thdpack.planning import PackStats

SETTINGS = settings(max_examples=60, deadline=None)


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------
def make_samples(lengths):
    """Samples whose tokens are globally unique (a running counter), so every
    packed piece tells which sample it came from and where it starts."""
    out, offset = [], 0
    for i, n in enumerate(lengths):
        out.append({"input_ids": np.arange(offset, offset + n, dtype=np.int64), "id": i, "offset": offset})
        offset += n
    return out


def piece(sample):
    """``(sample id, start, length)`` of a (possibly sliced) sample."""
    ids = np.asarray(sample["input_ids"])
    return (sample["id"], int(ids[0]) - sample["offset"], int(ids.size))


def as_pieces(packs):
    return [[piece(s) for s in pack] for pack in packs]


def aligned(n, align):
    return -(-n // align) * align


def reference_stream(lengths, pack_size, buffer_size, align=1, overflow="error", max_samples_per_pack=None):
    """The documented rule, in plain Python, on ``(id, start, length)`` pieces.

    Each piece goes to the open pack with the least room that holds it (ties:
    the oldest) or to a new pack; a pack is emitted as soon as no aligned
    piece fits any more (room < align) or it reaches ``max_samples_per_pack``;
    otherwise, when more than ``buffer_size`` packs are open, the fullest is
    emitted (ties: the oldest). At the end the open packs are emitted in the
    order they were opened.
    """
    limit = pack_size // align * align
    open_, out = [], []  # open packs: [room, [pieces]]
    for i, n in enumerate(lengths):
        if n <= limit:
            pieces = [(i, 0, n)]
        elif overflow == "truncate":
            pieces = [(i, 0, limit)]
        elif overflow == "split":
            pieces = [(i, a, min(limit, n - a)) for a in range(0, n, limit)]
        elif overflow == "drop":
            pieces = []
        else:
            raise AssertionError("reference only handles overflow policies that keep going")
        for p in pieces:
            size = aligned(p[2], align)
            fits = [k for k in range(len(open_)) if open_[k][0] >= size]
            if fits:
                k = min(fits, key=lambda j: (open_[j][0], j))
            else:
                open_.append([pack_size, []])
                k = len(open_) - 1
            open_[k][0] -= size
            open_[k][1].append(p)
            if open_[k][0] < align or (max_samples_per_pack is not None and len(open_[k][1]) >= max_samples_per_pack):
                out.append(open_.pop(k)[1])
            elif len(open_) > buffer_size:
                j = min(range(len(open_)), key=lambda j: (open_[j][0], j))
                out.append(open_.pop(j)[1])
    out.extend(p[1] for p in open_)
    return out


@st.composite
def stream_cases(draw, overflows=("truncate", "split", "drop")):
    pack_size = draw(st.integers(1, 64))
    align = draw(st.sampled_from([1, 1, 2, 4, 8]))
    if pack_size < align:
        pack_size = align
    lengths = draw(st.lists(st.integers(1, 2 * pack_size + 3), min_size=0, max_size=60))
    return dict(
        lengths=lengths,
        pack_size=pack_size,
        align=align,
        buffer_size=draw(st.sampled_from([1, 2, 3, 5, 16])),
        overflow=draw(st.sampled_from(overflows)),
        max_samples_per_pack=draw(st.one_of(st.none(), st.integers(1, 5))),
    )


def packer_for(case, samples=None, **extra):
    kw = {k: v for k, v in case.items() if k != "lengths"}
    kw.update(extra)
    return StreamingPacker(make_samples(case["lengths"]) if samples is None else samples, kw.pop("pack_size"), **kw)


# --------------------------------------------------------------------------
# contract: every sample once, every pack within budget, stats counted
# --------------------------------------------------------------------------
@SETTINGS
@given(stream_cases())
def test_every_sample_once_and_packs_within_budget(case):
    lengths, pack_size, align = case["lengths"], case["pack_size"], case["align"]
    limit = pack_size // align * align
    packer = packer_for(case)
    packs = as_pieces(list(packer))

    for pack in packs:
        assert pack, "an empty pack was emitted"
        assert sum(aligned(n, align) for _, _, n in pack) <= pack_size
        if case["max_samples_per_pack"] is not None:
            assert len(pack) <= case["max_samples_per_pack"]

    got = Counter(p for pack in packs for p in pack)
    assert all(c == 1 for c in got.values()), "a piece was emitted twice"
    expected = Counter()
    for i, n in enumerate(lengths):
        if n <= limit:
            expected[(i, 0, n)] += 1
        elif case["overflow"] == "truncate":
            expected[(i, 0, limit)] += 1
        elif case["overflow"] == "split":
            for a in range(0, n, limit):
                expected[(i, a, min(limit, n - a))] += 1
    assert got == expected

    over = [n for n in lengths if n > limit]
    stats = packer.stats
    assert stats.num_packs == len(packs)
    assert stats.real_tokens == sum(n for pack in packs for _, _, n in pack)
    pol = case["overflow"]
    assert stats.samples_truncated == (len(over) if pol == "truncate" else 0)
    assert stats.tokens_truncated == (sum(n - limit for n in over) if pol == "truncate" else 0)
    assert stats.samples_dropped == (len(over) if pol == "drop" else 0)
    assert stats.tokens_dropped == (sum(over) if pol == "drop" else 0)
    assert stats.samples_split == (len(over) if pol == "split" else 0)
    # the same PackStats a plan of these packs has (thdpack.planning.packing: one derivation)
    piece_lengths = np.array([n for pack in packs for _, _, n in pack], np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(pack) for pack in packs])]).astype(np.int64)
    assert stats == PackStats.from_packs(piece_lengths, offsets, pack_size, align=align, num_samples=len(lengths),
                                         cuts=stats.cuts)


@SETTINGS
@given(stream_cases())
def test_matches_reference_rule(case):
    """Pack boundaries and order are exactly the documented best-fit-over-a-buffer rule."""
    packs = as_pieces(packer_for(case))
    assert packs == reference_stream(**case)


@SETTINGS
@given(stream_cases())
def test_at_most_buffer_size_packs_open(case):
    packer = packer_for(case)
    it = iter(packer)
    for _ in it:
        assert len(packer.state_dict()["open"]) <= case["buffer_size"]


def test_best_fit_example_and_ties():
    # 6 and 6 open two packs with room 4 each; 2 goes to the oldest of the tied packs;
    # 3 then goes to the pack with least room that holds it (room 4, not room 2)
    packs = as_pieces(StreamingPacker(make_samples([6, 6, 2, 3]), 10, buffer_size=4))
    assert packs == [[(0, 0, 6), (2, 0, 2)], [(1, 0, 6), (3, 0, 3)]]
    # buffer_size=2: a third open pack makes one too many, so the fullest is emitted ...
    packs = as_pieces(StreamingPacker(make_samples([6, 7, 5, 1]), 10, buffer_size=2))
    assert packs == [[(1, 0, 7)], [(0, 0, 6), (3, 0, 1)], [(2, 0, 5)]]
    # ... ties: the oldest; then 4 fills the other room-4 pack exactly, which is emitted at once
    packs = as_pieces(StreamingPacker(make_samples([6, 6, 5, 4]), 10, buffer_size=2))
    assert packs == [[(0, 0, 6)], [(1, 0, 6), (3, 0, 4)], [(2, 0, 5)]]


def test_reiterating_starts_over():
    case = dict(lengths=[5, 9, 3, 7, 7, 2, 10, 1], pack_size=12, align=1, buffer_size=2, overflow="error",
                max_samples_per_pack=None)
    packer = packer_for(case)
    first = as_pieces(packer)
    assert as_pieces(packer) == first
    assert packer.stats.num_packs == len(first)


def test_align_counts_aligned_lengths():
    # aligned to 4: 5 -> 8, 3 -> 4, so 5 and 3 cannot share a pack of 11 (8 + 4 > 11)
    packs = as_pieces(StreamingPacker(make_samples([5, 3]), 11, buffer_size=4, align=4))
    assert packs == [[(0, 0, 5)], [(1, 0, 3)]]
    # without alignment they share one
    assert as_pieces(StreamingPacker(make_samples([5, 3]), 11, buffer_size=4)) == [[(0, 0, 5), (1, 0, 3)]]


# --------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------
def test_overflow_error_names_the_sample():
    packer = StreamingPacker(make_samples([3, 4, 2, 11, 1]), 10, buffer_size=2)
    with pytest.raises(ValueError, match=r"sample 3 has 11 tokens.*pack_size=10"):
        list(packer)


def test_overflow_error_after_alignment_names_the_sample():
    # 9 tokens fit 10 unaligned, but not once rounded up to 4 (limit 8)
    packer = StreamingPacker(make_samples([2, 9]), 10, align=4)
    with pytest.raises(ValueError, match=r"sample 1 has 9 tokens.*align"):
        list(packer)


def test_empty_sample_error_names_the_sample():
    samples = make_samples([3, 1, 2])
    samples[2]["input_ids"] = np.zeros(0, np.int64)
    with pytest.raises(ValueError, match=r"sample 2 is empty"):
        list(StreamingPacker(samples, 8))


@pytest.mark.parametrize(
    "kwargs",
    [dict(buffer_size=0), dict(buffer_size=-1), dict(buffer_size=2.5), dict(align=0), dict(overflow="wrap"),
     dict(pack_size=0), dict(pack_size=3, align=4), dict(buffer_size=True)],
)
def test_bad_arguments(kwargs):
    kw = dict(pack_size=8)
    kw.update(kwargs)
    with pytest.raises(ValueError):
        StreamingPacker([], kw.pop("pack_size"), **kw)


# --------------------------------------------------------------------------
# buffer_size=1 versus next fit
# --------------------------------------------------------------------------
def test_buffer_one_is_not_next_fit():
    """With one open pack, a sample that does not fit opens a second and the
    *fuller* of the two is emitted, so the emptier stays open. Next fit always
    closes the old pack. Here: 3 is open, 8 arrives and is fuller, so [8] goes
    out and 2 and 5 still join the 3."""
    lengths = [3, 8, 2, 5]
    packs = as_pieces(StreamingPacker(make_samples(lengths), 10, buffer_size=1))
    assert packs == [[(1, 0, 8)], [(0, 0, 3), (2, 0, 2), (3, 0, 5)]]
    nf = plan_packs(lengths, 10, algorithm="sequential")
    assert [nf.pack(k).tolist() for k in range(len(nf))] == [[0], [1, 2], [3]]


@SETTINGS
@given(
    st.integers(1, 40).flatmap(
        lambda c: st.tuples(st.just(c), st.lists(st.integers(1, c), max_size=60), st.sampled_from([1, 2, 4]))
    )
)
def test_buffer_one_never_uses_more_packs_than_next_fit(args):
    """Keeping the emptier pack open is never worse than next fit (an exchange
    argument: either fewer packs were emitted so far, or as many and the open
    pack is no fuller than next fit's)."""
    pack_size, lengths, align = args
    pack_size = max(pack_size, align)
    lengths = [min(n, pack_size // align * align) for n in lengths]
    got = len(list(StreamingPacker(make_samples(lengths), pack_size, buffer_size=1, align=align)))
    nf = len(plan_packs(lengths, pack_size, algorithm="sequential", align=align))
    assert got <= nf


@SETTINGS
@given(
    st.integers(1, 40).flatmap(
        lambda c: st.tuples(st.just(c), st.lists(st.integers(1, c), max_size=60), st.sampled_from([1, 2, 4]))
    )
)
def test_buffer_one_is_next_fit_on_non_increasing_lengths(args):
    """When lengths never increase, the open pack is never emptier than the new
    sample, so buffer_size=1 makes exactly next fit's packs, in order."""
    pack_size, lengths, align = args
    pack_size = max(pack_size, align)
    lengths = sorted((min(n, pack_size // align * align) for n in lengths), reverse=True)
    packs = [[sid for sid, _, _ in p] for p in as_pieces(StreamingPacker(make_samples(lengths), pack_size,
                                                                         buffer_size=1, align=align))]
    nf = plan_packs(lengths, pack_size, algorithm="sequential", align=align)
    assert packs == [nf.pack(k).tolist() for k in range(len(nf))]


# --------------------------------------------------------------------------
# efficiency against buffer size
# --------------------------------------------------------------------------
def test_efficiency_grows_with_buffer_and_approaches_bfd():
    rng = np.random.default_rng(1234)
    lengths = np.clip(rng.lognormal(6.0, 1.0, 20_000), 1, 4096).astype(np.int64)
    samples = [{"n": int(n)} for n in lengths]
    total = int(lengths.sum())
    effs = []
    for b in (1, 4, 16, 64, 256):
        packer = StreamingPacker(samples, 4096, buffer_size=b, length_fn=lambda s, i: s["n"])
        n_packs = sum(1 for _ in packer)
        assert packer.stats.real_tokens == total
        effs.append(total / (n_packs * 4096))
    assert all(x <= y for x, y in zip(effs, effs[1:])), effs
    assert effs[-1] > effs[0] + 0.05, effs  # a buffer matters on lognormal data
    bfd = plan_packs(lengths, 4096).stats.efficiency
    assert effs[-1] <= bfd + 1e-12
    assert effs[-1] >= bfd - 0.005, (effs, bfd)


# --------------------------------------------------------------------------
# resume
# --------------------------------------------------------------------------
def run_with_cut(case, cut, *, skip_consumed=True, via_pickle=True):
    """First ``cut`` packs, then a fresh packer resumed from the state at the cut."""
    samples = make_samples(case["lengths"])
    first = packer_for(case, samples)
    it = iter(first)
    head = [pk for pk in itertools.islice(it, cut)]
    state = first.state_dict()
    if via_pickle:
        state = pickle.loads(pickle.dumps(state))
    if skip_consumed:
        second = packer_for(case, make_samples(case["lengths"]))
    else:  # the caller resumes the stream itself, here as a one-shot generator
        rest = (s for s in make_samples(case["lengths"])[state["consumed"]:])
        second = packer_for(case, rest, skip_consumed=False)
    second.load_state_dict(state)
    tail = list(second)
    return as_pieces(head) + as_pieces(tail), second.stats


@SETTINGS
@given(stream_cases(), st.floats(0, 1), st.booleans())
def test_resume_equals_uninterrupted(case, frac, skip_consumed):
    full_packer = packer_for(case)
    full = as_pieces(full_packer)
    cut = int(round(frac * len(full)))
    got, stats = run_with_cut(case, cut, skip_consumed=skip_consumed)
    assert got == full
    assert stats == full_packer.stats


@pytest.mark.parametrize("skip_consumed", [True, False])
def test_resume_at_every_cut_including_the_final_flush(skip_consumed):
    case = dict(lengths=[5, 9, 3, 7, 7, 2, 10, 1, 4, 4, 6, 8, 3, 25, 2, 6, 7, 8], pack_size=12, align=1, buffer_size=3,
                overflow="split", max_samples_per_pack=None)
    full_packer = packer_for(case)
    full = as_pieces(full_packer)
    # cuts during the end-of-stream flush: the whole stream consumed, packs still to yield
    packer = packer_for(case)
    flush_cuts = []
    for k, _ in enumerate(packer, start=1):
        st_ = packer.state_dict()
        if st_["consumed"] == len(case["lengths"]) and k < len(full):
            assert st_["open"] == [] and st_["ready"]
            flush_cuts.append(k)
    assert len(flush_cuts) >= 2, "the example should end with several packs flushed"
    for cut in range(len(full) + 1):
        got, stats = run_with_cut(case, cut, skip_consumed=skip_consumed)
        assert got == full, cut
        assert stats == full_packer.stats


def test_state_dict_is_plain_and_picklable():
    samples = [{"input_ids": [1] * n, "labels": [2] * n} for n in (3, 5, 2, 6, 4)]
    packer = StreamingPacker(samples, 8, buffer_size=2)
    it = iter(packer)
    next(it)
    state = packer.state_dict()
    restored = pickle.loads(pickle.dumps(state))
    assert restored == state
    assert restored["consumed"] >= 1
    # the state is a snapshot: going on does not change it
    rest = list(it)
    assert pickle.loads(pickle.dumps(state)) == restored
    resumed = StreamingPacker(samples, 8, buffer_size=2)
    resumed.load_state_dict(restored)
    assert list(resumed) == rest


# --------------------------------------------------------------------------
# DataLoader
# --------------------------------------------------------------------------
@pytest.mark.parametrize("cp_size", [1, 2])
def test_dataloader_with_thd_collator(cp_size):
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 50, size=80).tolist()
    samples = make_samples(lengths)
    collator = ThdCollator(cp_size=cp_size)
    pack_size = 64
    packer = StreamingPacker(samples, pack_size, buffer_size=4, align=collator.pad_multiple)
    loader = torch.utils.data.DataLoader(packer, batch_size=None, collate_fn=collator)
    batches = list(loader)
    assert batches and all(isinstance(b, thdpack.ThdBatch) for b in batches)
    seen = []
    for b in batches:
        assert b.num_padded_tokens <= pack_size
        assert b.num_padded_tokens % collator.pad_multiple == 0
        cu = b.cu_seqlens_padded.tolist()
        for k, n in enumerate(b.seq_lens.tolist()):
            toks = b.input_ids[cu[k] : cu[k] + n].numpy()
            sid = int(np.searchsorted([s["offset"] for s in samples], toks[0], side="right") - 1)
            np.testing.assert_array_equal(toks, samples[sid]["input_ids"])
            seen.append(sid)
    assert sorted(seen) == list(range(len(lengths)))
    # exact resume through the DataLoader (num_workers=0: nothing is prefetched)
    it = iter(loader)
    head = [next(it) for _ in range(3)]
    state = packer.state_dict()
    packer2 = StreamingPacker(make_samples(lengths), pack_size, buffer_size=4, align=collator.pad_multiple)
    packer2.load_state_dict(state)
    tail = list(torch.utils.data.DataLoader(packer2, batch_size=None, collate_fn=collator))
    assert len(head) + len(tail) == len(batches)
    for a, b in zip(head + tail, batches):
        assert torch.equal(a.input_ids, b.input_ids)
        assert torch.equal(a.cu_seqlens_padded, b.cu_seqlens_padded)


# --------------------------------------------------------------------------
# load_state_dict errors (issue 11 §7) and stream shares
# --------------------------------------------------------------------------
def _saved_state():
    packer = StreamingPacker(make_samples([3, 5, 2, 6, 4, 7]), 8, buffer_size=2)
    it = iter(packer)
    next(it)
    return packer.state_dict()


def _without(state, key):
    return {k: v for k, v in state.items() if k != key}


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda st: {}, r"missing key\(s\) 'consumed', 'open', 'ready', 'stats', 'share', 'fingerprint'"),
        (lambda st: None,
         r"state_dict must be a dict, got NoneType; pass the dict that StreamingPacker.state_dict\(\) returned"),
        (lambda st: _without(st, "consumed"), r"missing key\(s\) 'consumed'"),
        (lambda st: _without(st, "fingerprint"), r"missing key\(s\) 'fingerprint'"),
        (lambda st: dict(st, consumed=-1), r"state_dict\['consumed'\] must be an integer >= 0, got -1"),
        (lambda st: dict(st, consumed=2.5), r"state_dict\['consumed'\] must be an integer >= 0, got 2.5"),
        (lambda st: dict(st, open=None), r"state_dict\['open'\] must be a list, got NoneType"),
        (lambda st: dict(st, open=[(1, 2)]), r"state_dict\['open'\] must hold \(room, samples, real_tokens\)"),
        (lambda st: dict(st, stats=[]), r"state_dict\['stats'\] must be a dict, got list"),
        (lambda st: dict(st, stats={"packs": 1}), r"state_dict\['stats'\] must have the keys num_packs, "),
        (lambda st: dict(st, stats=dict(st["stats"], num_packs=-1)),
         r"state_dict\['stats'\]\['num_packs'\] must be an integer >= 0, got -1"),
        (lambda st: dict(st, share=3), r"state_dict\['share'\] must be \[share, shares\], got 3"),
        (lambda st: dict(st, share=[1, 2]),
         r"state_dict\['share'\] is share 1 of 2, but this packer reads share 0 of 1"),
        (lambda st: dict(st, fingerprint="pack_size=9"),
         r"saved by a StreamingPacker with pack_size=9, but this one has pack_size=8, buffer_size=2"),
    ],
)
def test_load_state_dict_rejects_malformed_states(bad, message):
    """Each malformed state is one ValueError naming the key and what is wrong (before: KeyError,
    TypeError, or accepted, to fail later or resume wrongly)."""
    packer = StreamingPacker(make_samples([3, 5, 2, 6, 4, 7]), 8, buffer_size=2)
    with pytest.raises(ValueError, match=message):
        packer.load_state_dict(bad(_saved_state()))


def test_bad_rank_arguments():
    with pytest.raises(ValueError, match=r"^rank must be an integer in \[0, 2\), got 2$"):
        StreamingPacker([], 8, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match=r"num_replicas must be .*, got 0"):
        StreamingPacker([], 8, num_replicas=0, rank=0)


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_dp_ranks_share_the_stream_and_resume(num_replicas):
    """Rank r packs samples r, r + R, ...; together the ranks pack every sample once; each resumes exactly."""
    lengths = np.random.default_rng(3).integers(1, 30, size=50).tolist()
    seen = []
    for rank in range(num_replicas):
        mk = lambda: StreamingPacker(make_samples(lengths), 32, buffer_size=3, num_replicas=num_replicas,  # noqa: E731
                                     rank=rank)
        full = as_pieces(mk())
        ids = [sid for pack in full for sid, _, _ in pack]
        assert sorted(ids) == list(range(rank, len(lengths), num_replicas))
        seen += ids
        first = mk()
        it = iter(first)
        head = as_pieces(itertools.islice(it, 2))
        second = mk()
        second.load_state_dict(pickle.loads(pickle.dumps(first.state_dict())))
        assert head + as_pieces(second) == full
        other = StreamingPacker(make_samples(lengths), 32, buffer_size=3, num_replicas=num_replicas,
                                rank=(rank + 1) % num_replicas)
        with pytest.raises(ValueError, match="state_dict\\['share'\\]"):
            other.load_state_dict(first.state_dict())
    assert sorted(seen) == list(range(len(lengths)))


def test_overflow_error_names_the_stream_index_under_stream_shares():
    packer = StreamingPacker(make_samples([3, 4, 2, 11, 1]), 10, num_replicas=2, rank=1)
    with pytest.raises(ValueError, match=r"sample 3 has 11 tokens"):
        list(packer)
    list(StreamingPacker(make_samples([3, 4, 2, 11, 1]), 10, num_replicas=2, rank=0))  # sample 3 is rank 1's


@pytest.mark.parametrize("overflow", ["truncate", "split"])
def test_a_cut_sample_with_a_bad_field_is_named_by_its_stream_position(overflow):
    samples = [{"input_ids": [1, 2, 3]}, {"input_ids": list(range(1, 11)), "loss_mask": [1] * 9}]
    with pytest.raises(ValueError, match=r"^sample 1: 'loss_mask' has 9 values but 'input_ids' has 10"):
        list(StreamingPacker(samples, 4, overflow=overflow, num_replicas=1, rank=0))


def test_a_state_saved_by_thdpack_0_1_0_is_refused_naming_the_missing_key():
    """thdpack 0.1.0's StreamingPacker state said "shard" (not "share") and kept a plain stats dict:
    loading it is one ValueError naming the missing key (never a KeyError), and the packer is unchanged."""
    samples = make_samples([5, 9, 3, 12, 7, 2, 8, 6, 11, 4, 1, 10, 3, 7])
    first = StreamingPacker(samples, 16, buffer_size=3, overflow="split", num_replicas=1, rank=0)
    whole = as_pieces(StreamingPacker(samples, 16, buffer_size=3, overflow="split", num_replicas=1, rank=0))
    as_pieces(itertools.islice(iter(first), 3))
    state = first.state_dict()
    old = {k: v for k, v in state.items() if k != "share"}
    old["shard"] = state["share"]
    old["stats"] = {"packs": 3, "real_tokens": state["stats"]["real_tokens"],
                    **{k: 0 for k in ("samples_truncated", "tokens_truncated", "samples_dropped", "tokens_dropped",
                                      "samples_split")}}
    packer = StreamingPacker(samples, 16, buffer_size=3, overflow="split", num_replicas=1, rank=0)
    with pytest.raises(ValueError, match=r"state_dict is missing key\(s\) 'share'; pass the dict that "
                                         r"StreamingPacker\.state_dict\(\) returned"):
        packer.load_state_dict(old)
    assert as_pieces(packer) == whole  # not resumed: the packer starts from the beginning
