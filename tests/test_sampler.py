"""Property tests for ``TokenBudgetBatchSampler``: coverage, rank balance, epochs, resume, DataLoader use."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from thdpack import ThdBatch, ThdCollator, TokenBudgetBatchSampler, plan_packs

SETTINGS = settings(max_examples=60, deadline=None)


def aligned(x, align):
    return -(-np.asarray(x, dtype=np.int64) // align) * align


@st.composite
def sampler_case(draw):
    align = draw(st.sampled_from([1, 1, 2, 4]))
    pack_size = draw(st.integers(max(8, align), 64))
    overflow = draw(st.sampled_from(["error", "truncate", "drop"]))
    limit = pack_size // align * align
    max_len = limit if overflow == "error" else 2 * pack_size
    small = st.integers(1, max(1, max_len // 4))
    lengths = draw(st.lists(st.one_of(small, st.integers(1, max_len)), min_size=1, max_size=80))
    kw = dict(
        pack_size=pack_size,
        align=align,
        overflow=overflow,
        algorithm=draw(st.sampled_from(["bfd", "ffd", "first_fit_shuffle", "sequential"])),
        max_samples_per_pack=draw(st.one_of(st.none(), st.integers(1, 5))),
        shuffle=draw(st.booleans()),
        seed=draw(st.integers(0, 2**20)),
        num_replicas=draw(st.integers(1, 4)),
        drop_last=draw(st.booleans()),
    )
    return lengths, kw


def make(lengths, kw, **over):
    kw = dict(kw, **over)
    pack_size = kw.pop("pack_size")
    return TokenBudgetBatchSampler(lengths, pack_size, **kw)


def plan_of(lengths, kw, epoch=0):
    return plan_packs(
        lengths,
        kw["pack_size"],
        algorithm=kw["algorithm"],
        align=kw["align"],
        overflow=kw["overflow"],
        max_samples_per_pack=kw["max_samples_per_pack"],
        seed=kw["seed"] + epoch,
    )


def usable(lengths, kw) -> bool:
    plan = plan_of(lengths, kw)
    if kw["drop_last"] and len(plan) < kw["num_replicas"]:
        with pytest.raises(ValueError, match="replicas"):
            make(lengths, kw, rank=0)
        return False
    return len(plan) > 0


def take(sampler, n):
    """The next ``n`` batches of a training loop that iterates the sampler epoch after epoch."""
    out = []
    while len(out) < n:
        for batch in sampler:
            out.append(batch)
            if len(out) == n:
                break
    return out


def check_epoch(lengths, kw, per_rank, epoch=0):
    lengths = np.asarray(lengths, dtype=np.int64)
    R = kw["num_replicas"]
    plan = plan_of(lengths, kw, epoch)
    P = len(plan)
    steps = P // R if kw["drop_last"] else -(-P // R)
    assert [len(b) for b in per_rank] == [steps] * R, "ranks disagree on the number of steps"
    limit = kw["pack_size"] // kw["align"] * kw["align"]
    planned = lengths if kw["overflow"] != "truncate" else np.minimum(lengths, limit)
    packs = {tuple(plan.pack(k).tolist()) for k in range(P)}
    for rank_batches in per_rank:
        for b in rank_batches:
            assert b, "empty batch"
            assert b == sorted(b)
            assert int(aligned(planned[b], kw["align"]).sum()) <= kw["pack_size"], "batch over pack_size"
            if kw["max_samples_per_pack"]:
                assert len(b) <= kw["max_samples_per_pack"]
            assert tuple(b) in packs, "batch is not a planned pack"
    # global order: step-major, rank-minor
    g = [per_rank[r][s] for s in range(steps) for r in range(R)]
    dropped = set(plan.dropped.tolist())
    expected = sorted(set(range(len(lengths))) - dropped)
    if kw["drop_last"]:
        flat = [i for b in g for i in b]
        assert len(flat) == len(set(flat)), "an index repeats with drop_last=True"
        assert len(g) == steps * R and P - len(g) < R
        assert set(flat) <= set(expected)
    else:
        flat = [i for b in g[:P] for i in b]
        assert sorted(flat) == expected, "first pass over the packs does not cover every index exactly once"
        assert sorted(tuple(b) for b in g[:P]) == sorted(packs)
        assert g[P:] == g[: len(g) - P], "padding must repeat whole packs from the start of the epoch"
        assert len(g) - P < R
    assert not dropped & {i for b in g for i in b}


@SETTINGS
@given(sampler_case())
def test_epoch_coverage_and_rank_balance(case):
    lengths, kw = case
    assume(usable(lengths, kw))
    samplers = [make(lengths, kw, rank=r) for r in range(kw["num_replicas"])]
    lens = [len(s) for s in samplers]
    per_rank = [list(s) for s in samplers]
    assert lens == [len(b) for b in per_rank]
    check_epoch(lengths, kw, per_rank, epoch=0)
    # the next iteration is epoch 1, and matches set_epoch(1) on a fresh sampler
    second = [list(s) for s in samplers]
    check_epoch(lengths, kw, second, epoch=1)
    fresh = [make(lengths, kw, rank=r) for r in range(kw["num_replicas"])]
    for s in fresh:
        s.set_epoch(1)
    assert [list(s) for s in fresh] == second
    # deterministic
    again = [list(make(lengths, kw, rank=r)) for r in range(kw["num_replicas"])]
    assert again == per_rank


@SETTINGS
@given(sampler_case(), st.data())
def test_resume_gives_exactly_the_remaining_batches(case, data):
    lengths, kw = case
    assume(usable(lengths, kw))
    rank = data.draw(st.integers(0, kw["num_replicas"] - 1))
    steps = len(make(lengths, kw, rank=rank))
    assume(steps > 0)
    total = 2 * steps + data.draw(st.integers(0, steps))  # runs into a third epoch
    full = take(make(lengths, kw, rank=rank), total)
    cut = data.draw(st.integers(0, total))
    a = make(lengths, kw, rank=rank)
    head = take(a, cut)
    assert head == full[:cut]
    state = a.state_dict()
    assert set(state) >= {"epoch", "step", "seed", "fingerprint"}
    # another seed (one whose first epoch has packs for every replica): the seed comes from the state
    other = next((s for s in range(kw["seed"] + 12345, kw["seed"] + 12355) if usable(lengths, dict(kw, seed=s))), None)
    assume(other is not None)
    b = make(lengths, kw, rank=rank, seed=other)
    b.load_state_dict(state)
    assert b.state_dict() == state
    assert head + take(b, total - cut) == full


@SETTINGS
@given(sampler_case(), st.data())
def test_resume_from_trainer_step(case, data):
    """With prefetching the sampler runs ahead; state_dict(consumed=k) resumes after k consumed batches."""
    lengths, kw = case
    assume(usable(lengths, kw))
    a = make(lengths, kw)
    steps = len(a)
    assume(steps > 0)
    full = list(make(lengths, kw))
    consumed = data.draw(st.integers(0, steps))
    it = iter(a)
    prefetched = [next(it) for _ in range(min(steps, consumed + 2))]
    assert prefetched == full[: len(prefetched)]
    state = a.state_dict(consumed=consumed)
    assert state["step"] == consumed and state["epoch"] == 0
    with pytest.raises(TypeError, match="unexpected keyword argument 'step'"):  # thdpack 0.1.0's form, removed
        a.state_dict(step=consumed)
    b = make(lengths, kw)
    b.load_state_dict(state)
    assert list(b) == full[consumed:]
    # and the epoch after it is epoch 1
    c = make(lengths, kw)
    c.set_epoch(1)
    assert list(b) == list(c)


@SETTINGS
@given(sampler_case(), st.data())
def test_consumed_is_exact_however_far_the_pass_ran_ahead(case, data):
    """A loader's prefetching draws ``ahead`` more batches than the loop consumed, possibly past the
    end of the epoch (the pass is then over and the sampler already in the next epoch);
    state_dict(consumed=k) still resumes right after the k-th batch of the loop's pass."""
    lengths, kw = case
    assume(usable(lengths, kw))
    rank = data.draw(st.integers(0, kw["num_replicas"] - 1))
    steps = len(make(lengths, kw, rank=rank))
    assume(steps > 0)
    full = take(make(lengths, kw, rank=rank), 3 * steps)
    a = make(lengths, kw, rank=rank)
    whole = data.draw(st.integers(0, 1))
    for _ in range(whole):
        list(a)
    if data.draw(st.booleans()):  # resumed mid-epoch first: the pass starts at a later step
        start = data.draw(st.integers(0, steps))
        a.load_state_dict(dict(a.state_dict(), step=start))
    else:
        start = 0
    before = whole * steps + start
    consumed = data.draw(st.integers(0, steps - start))
    ahead = data.draw(st.integers(0, 6))
    drawn = list(itertools.islice(iter(a), consumed + ahead))
    assert drawn[:consumed] == full[before : before + consumed]
    state = a.state_dict(consumed=consumed)
    b = make(lengths, kw, rank=rank)
    b.load_state_dict(state)
    assert full[: before + consumed] + take(b, 3 * steps - before - consumed) == full


def _lognormal(n, seed, hi):
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(60), 0.8, size=n)), 1, hi).astype(np.int64)


def test_reshuffles_per_epoch_deterministically():
    lengths = _lognormal(400, 0, 256)
    s = TokenBudgetBatchSampler(lengths, 256, shuffle=True, seed=3, num_replicas=1, rank=0)
    e0, e1, e2 = list(s), list(s), list(s)
    assert s.epoch == 3
    assert e0 != e1 and e1 != e2, "packs not reshuffled between epochs"
    for e in (e0, e1, e2):
        assert sorted(i for b in e for i in b) == list(range(400))
    t = TokenBudgetBatchSampler(lengths, 256, shuffle=True, seed=3, num_replicas=1, rank=0)
    assert [list(t), list(t), list(t)] == [e0, e1, e2]
    t.set_epoch(1)
    assert list(t) == e1
    other = TokenBudgetBatchSampler(lengths, 256, shuffle=True, seed=4, num_replicas=1, rank=0)
    assert list(other) != e0
    # no shuffle with a deterministic algorithm: every epoch the same
    u = TokenBudgetBatchSampler(lengths, 256, shuffle=False, num_replicas=1, rank=0)
    assert list(u) == list(u)
    # first_fit_shuffle re-plans per epoch (seed + epoch)
    v = TokenBudgetBatchSampler(lengths, 256, algorithm="first_fit_shuffle", shuffle=False, num_replicas=1, rank=0)
    assert v.plan(0).sample_index.tolist() != v.plan(1).sample_index.tolist()


def test_len_and_set_epoch():
    lengths = _lognormal(300, 1, 128)
    for R in (1, 2, 3, 5):
        for drop_last in (False, True):
            P = len(plan_packs(lengths, 128))
            samplers = [TokenBudgetBatchSampler(lengths, 128, num_replicas=R, rank=r, drop_last=drop_last) for r in range(R)]
            expected = P // R if drop_last else -(-P // R)
            assert [len(s) for s in samplers] == [expected] * R
    s = TokenBudgetBatchSampler(lengths, 128, num_replicas=1, rank=0)
    it = iter(s)
    first = [next(it) for _ in range(3)]
    s.set_epoch(5)
    assert s.epoch == 5 and s.state_dict()["epoch"] == 5 and s.state_dict()["step"] == 0
    fresh = TokenBudgetBatchSampler(lengths, 128, num_replicas=1, rank=0)
    fresh.set_epoch(5)
    assert list(s) == list(fresh)
    assert first == list(TokenBudgetBatchSampler(lengths, 128, num_replicas=1, rank=0))[:3]


def test_resume_across_epoch_boundary():
    lengths = _lognormal(200, 2, 128)
    ref = TokenBudgetBatchSampler(lengths, 128, seed=9, num_replicas=2, rank=1)
    steps = len(ref)
    e0, e1 = list(ref), list(ref)
    # state taken after a fully iterated epoch points at the next epoch's first step
    a = TokenBudgetBatchSampler(lengths, 128, seed=9, num_replicas=2, rank=1)
    assert list(a) == e0
    state = a.state_dict()
    assert state["epoch"] == 1 and state["step"] == 0
    b = TokenBudgetBatchSampler(lengths, 128, seed=9, num_replicas=2, rank=1)
    b.load_state_dict(state)
    assert list(b) == e1
    # state taken mid-epoch 1
    a = TokenBudgetBatchSampler(lengths, 128, seed=9, num_replicas=2, rank=1)
    got = take(a, steps + 2)
    assert got == e0 + e1[:2]
    st_ = a.state_dict()
    assert (st_["epoch"], st_["step"]) == (1, 2)
    b = TokenBudgetBatchSampler(lengths, 128, seed=9, num_replicas=2, rank=1)
    b.load_state_dict(st_)
    assert list(b) == e1[2:]
    assert b.epoch == 2


def test_fingerprint_mismatch_raises():
    lengths = _lognormal(100, 3, 128)
    state = TokenBudgetBatchSampler(lengths, 128, num_replicas=1, rank=0).state_dict()
    others = [
        TokenBudgetBatchSampler(lengths[:-1], 128, num_replicas=1, rank=0),
        TokenBudgetBatchSampler(lengths, 256, num_replicas=1, rank=0),
        TokenBudgetBatchSampler(lengths, 128, num_replicas=2, rank=0),
        TokenBudgetBatchSampler(lengths, 128, algorithm="ffd", num_replicas=1, rank=0),
        TokenBudgetBatchSampler(lengths, 128, align=8, num_replicas=1, rank=0),
        TokenBudgetBatchSampler(lengths, 128, shuffle=False, num_replicas=1, rank=0),
    ]
    for other in others:
        with pytest.raises(ValueError, match="state_dict was saved by a sampler over other lengths or with other settings"):
            other.load_state_dict(state)
    same = TokenBudgetBatchSampler(lengths.tolist(), 128, num_replicas=1, rank=0)
    same.load_state_dict(state)  # same lengths as a list: accepted


def test_load_state_dict_step_out_of_range():
    lengths = _lognormal(100, 4, 128)
    s = TokenBudgetBatchSampler(lengths, 128, num_replicas=1, rank=0)
    state = s.state_dict()
    with pytest.raises(ValueError, match=r"step \d+ is outside epoch 0"):
        TokenBudgetBatchSampler(lengths, 128, num_replicas=1, rank=0).load_state_dict(dict(state, step=len(s) + 1))
    with pytest.raises(ValueError, match=r"state_dict\['step'\] must be an integer >= 0, got -1"):
        TokenBudgetBatchSampler(lengths, 128, num_replicas=1, rank=0).load_state_dict(dict(state, step=-1))
    with pytest.raises(TypeError, match="unexpected keyword argument 'step'"):  # thdpack 0.1.0's form, removed
        s.state_dict(step=len(s) + 1)


def _state_without(state, key):
    return {k: v for k, v in state.items() if k != key}


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda st: {}, r"missing key\(s\) 'epoch', 'step', 'seed', 'fingerprint'"),
        (lambda st: None,
         r"state_dict must be a dict, got NoneType; "
         r"pass the dict that TokenBudgetBatchSampler.state_dict\(\) returned"),
        (lambda st: [st], r"got list"),
        (lambda st: _state_without(st, "step"), r"missing key\(s\) 'step'"),
        (lambda st: _state_without(st, "seed"), r"missing key\(s\) 'seed'"),
        (lambda st: _state_without(st, "fingerprint"), r"missing key\(s\) 'fingerprint'"),
        (lambda st: dict(st, epoch=-1), r"state_dict\['epoch'\] must be an integer >= 0, got -1"),
        (lambda st: dict(st, step=1.5), r"state_dict\['step'\] must be an integer >= 0, got 1.5"),
        (lambda st: dict(st, step=True), r"state_dict\['step'\] must be an integer >= 0, got True"),
        (lambda st: dict(st, epoch="1"), r"state_dict\['epoch'\] must be an integer >= 0, got '1'"),
        (lambda st: dict(st, seed=0.5), r"state_dict\['seed'\] must be an integer >= 0, got 0.5; pass the dict"),
        (lambda st: dict(st, fingerprint=None), r"saved by a sampler over other lengths or with other settings"),
    ],
)
def test_load_state_dict_rejects_malformed_states(bad, message):
    """Issue 11 §7: each malformed state is one ValueError naming the key and what is wrong
    (before: KeyError / AttributeError / TypeError, or silently accepted), and leaves the sampler as it was."""
    lengths = _lognormal(100, 4, 128)
    s = TokenBudgetBatchSampler(lengths, 128, num_replicas=1, rank=0, seed=3)
    before = list(TokenBudgetBatchSampler(lengths, 128, num_replicas=1, rank=0, seed=3))
    with pytest.raises(ValueError, match=message):
        s.load_state_dict(bad(s.state_dict()))
    assert list(s) == before


def test_state_dict_argument_errors():
    s = TokenBudgetBatchSampler(_lognormal(50, 4, 128), 128, num_replicas=1, rank=0)
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(ValueError, match=r"consumed must be an integer >= 0"):
            s.state_dict(consumed=bad)
    with pytest.raises(TypeError, match="unexpected keyword argument 'step'"):
        s.state_dict(consumed=0, step=0)
    with pytest.raises(ValueError, match=r"epoch must be an integer >= 0, got -2"):
        s.set_epoch(-2)


def _dataset(n, seed, hi):
    rng = np.random.default_rng(seed)
    lens = _lognormal(n, seed, hi)
    ds = []
    for L in lens.tolist():
        ids = rng.integers(1, 1000, size=L)
        labels = np.where(rng.random(L) < 0.3, -100, ids)
        ds.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return ds, lens


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_with_collator(num_workers):
    ds, lens = _dataset(150, 5, 96)
    collate = ThdCollator(cp_size=2)
    sampler = TokenBudgetBatchSampler(lens, 96, align=collate.pad_multiple, seed=1, num_replicas=1, rank=0)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=collate, num_workers=num_workers)
    assert len(loader) == len(sampler)
    expected = list(TokenBudgetBatchSampler(lens, 96, align=collate.pad_multiple, seed=1, num_replicas=1, rank=0))
    batches = list(loader)
    assert len(batches) == len(expected)
    seen = []
    for batch, idx in zip(batches, expected):
        assert isinstance(batch, ThdBatch)
        assert batch.num_padded_tokens <= 96
        assert batch.pad_multiple == 4
        cup = batch.cu_seqlens_padded.tolist()
        for j, i in enumerate(idx):
            L = len(ds[i]["input_ids"])
            assert batch.input_ids[cup[j] : cup[j] + L].tolist() == ds[i]["input_ids"]
            assert batch.labels[cup[j] : cup[j] + L - 1].tolist() == ds[i]["labels"][1:]
        seen.extend(idx)
    assert sorted(seen) == list(range(len(ds)))


def test_dataloader_resume():
    ds, lens = _dataset(120, 6, 64)
    mk = lambda: TokenBudgetBatchSampler(lens, 64, seed=2, num_replicas=1, rank=0)  # noqa: E731
    full = [b.input_ids.tolist() for b in DataLoader(ds, batch_sampler=mk(), collate_fn=ThdCollator())]
    sampler = mk()
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=ThdCollator())
    it = iter(loader)
    head = [next(it).input_ids.tolist() for _ in range(4)]
    state = sampler.state_dict(consumed=4)
    resumed = mk()
    resumed.load_state_dict(state)
    tail = [b.input_ids.tolist() for b in DataLoader(ds, batch_sampler=resumed, collate_fn=ThdCollator())]
    assert head + tail == full


def test_truncate_pairing_with_collator_stays_within_pack_size():
    """The documented pairing: overflow='truncate' with ThdCollator(max_length=pack_size).
    Every collated pack must still fit pack_size, also when pack_size is not a multiple of the alignment."""
    ds = [{"input_ids": list(range(1, 13))}, {"input_ids": [1, 2]}, {"input_ids": list(range(1, 10))}]
    lens = [len(d["input_ids"]) for d in ds]
    for pack_size in (16, 10):
        collate = ThdCollator(cp_size=2, max_length=pack_size)  # aligns to 4
        sampler = TokenBudgetBatchSampler(
            lens, pack_size, align=collate.pad_multiple, overflow="truncate", num_replicas=1, rank=0, shuffle=False
        )
        for batch in DataLoader(ds, batch_sampler=sampler, collate_fn=collate):
            assert batch.num_padded_tokens <= pack_size, (
                f"pack_size={pack_size}: collated pack has {batch.num_padded_tokens} tokens "
                f"(seq_lens {batch.seq_lens.tolist()})"
            )


def test_sampler_with_drop_overflow_skips_long_rows():
    lengths = [5, 100, 7, 3, 200]
    s = TokenBudgetBatchSampler(lengths, 16, overflow="drop", num_replicas=1, rank=0)
    seen = sorted(i for b in s for i in b)
    assert seen == [0, 2, 3]
    assert s.plan(0).dropped.tolist() == [1, 4]


def test_more_replicas_than_packs_without_drop_last():
    s = [TokenBudgetBatchSampler([3, 4], 64, num_replicas=4, rank=r) for r in range(4)]
    batches = [list(x) for x in s]
    assert [len(b) for b in batches] == [1, 1, 1, 1]
    assert all(b[0] == [0, 1] for b in batches)


def test_distributed_defaults_single_process():
    s = TokenBudgetBatchSampler([3, 4, 5], 8)
    assert s.num_replicas == 1 and s.rank == 0


def test_later_epochs_do_not_fail_once_construction_succeeded():
    """Construction validates the plan so that errors do not surface inside the training loop.
    With first_fit_shuffle each epoch is re-planned (seed + epoch) and can have fewer packs;
    with drop_last=True and as many replicas as epoch 0 has packs, a later epoch must not raise."""
    kw = dict(algorithm="first_fit_shuffle", num_replicas=3, drop_last=True, seed=3)
    try:
        samplers = [TokenBudgetBatchSampler([6, 6, 4, 4], 10, rank=r, **kw) for r in range(3)]
    except ValueError:
        return  # refusing up front is acceptable
    for epoch in range(4):
        per_rank = [list(s) for s in samplers]
        assert len({len(b) for b in per_rank}) == 1, f"epoch {epoch}: ranks disagree on steps"


def test_set_epoch_detaches_a_live_pass():
    """A pass that is still being drawn from after set_epoch/load_state_dict does not move the position."""
    s = TokenBudgetBatchSampler(_lognormal(200, 7, 128), 128, num_replicas=1, rank=0)
    it = iter(s)
    next(it)
    s.set_epoch(3)
    rest = list(it)
    assert rest, "the old pass still yields its packs"
    assert (s.state_dict()["epoch"], s.state_dict()["step"]) == (3, 0)
    assert s.state_dict(consumed=0)["epoch"] == 3
