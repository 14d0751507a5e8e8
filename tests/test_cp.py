"""Context-parallel (CP) sharding: TransformerEngine's dual-chunk split, CP padding,
per-rank shards, and that sharded causal attention equals unsharded attention.

References here never use thdpack's own CP code: TE's kernel is re-written as a
per-token Python loop, the least padding multiple is found by brute force, and
attention is computed sample by sample with plain torch.
"""

from __future__ import annotations

import dataclasses
import math
from operator import attrgetter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import thdpack
from thdpack import (
    ThdCollator,
    build_thd_batch,
    cp_pad_multiple,
    local_seq_lens,
    thd_partition_indices,
)
from thdpack.integrations import to_hf_kwargs, to_packed_seq_params

IGNORE = -100


# --------------------------------------------------------------------------- references (no thdpack)


def te_partition_reference(cu_padded, cp: int, r: int) -> list[int]:
    """TransformerEngine's ``thd_partition_indices`` kernel, one local token at a time."""
    cu = [int(x) for x in cu_padded]
    total = cu[-1]
    if cp == 1:
        return list(range(total))
    local_cu = [c // cp for c in cu]
    out = []
    for j in range(total // cp):
        seq = next(i for i in range(len(cu) - 1) if local_cu[i] <= j < local_cu[i + 1])
        index = j - local_cu[seq]
        h = (cu[seq + 1] - cu[seq]) // (2 * cp)
        offset = r if index < h else 2 * cp - 2 - r
        out.append(cu[seq] + index + h * offset)
    return out


def least_padded_length(s: int, cp: int, tp: int, sp: bool) -> int:
    """Least P >= s meeting every CP / SP divisibility constraint (brute force)."""
    constraints = parallel_constraints(cp, tp, sp)
    p = s
    while not all(p % c == 0 for c in constraints):
        p += 1
    return p


def parallel_constraints(cp: int, tp: int, sp: bool) -> list[int]:
    constraints = [2 * cp if cp > 1 else 1]
    if sp and tp > 1:
        constraints.append(tp * cp)
    return constraints


def te_local_seq_lens(seq_lens, cu_padded, cp: int, r: int) -> list[int]:
    """TE's rule: ``clamp(s − r·h, 0, h) + clamp(s − (2cp−1−r)·h, 0, h)`` (cp > 1);
    with cp == 1 the single rank holds every token."""
    if cp == 1:
        return [int(s) for s in seq_lens]
    out = []
    for i, s in enumerate(seq_lens):
        s = int(s)
        h = (int(cu_padded[i + 1]) - int(cu_padded[i])) // (2 * cp)
        out.append(min(max(s - r * h, 0), h) + min(max(s - (2 * cp - 1 - r) * h, 0), h))
    return out


def psp_field(params, name):
    return params[name] if isinstance(params, dict) else getattr(params, name)


def make_samples(lengths, seed: int, as_numpy: bool = True, with_labels: bool = True):
    rng = np.random.default_rng(seed)
    samples = []
    for n in lengths:
        ids = rng.integers(1, 1000, size=n)
        sample = {"input_ids": ids if as_numpy else ids.tolist()}
        if with_labels:
            labels = ids.copy()
            labels[rng.random(n) < 0.3] = IGNORE
            sample["labels"] = labels if as_numpy else labels.tolist()
        samples.append(sample)
    return samples


# --------------------------------------------------------------------------- partition indices


def test_te_reference_vector():
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    assert thd_partition_indices(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert thd_partition_indices(cu, 2, 1).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    # the Python reference of the kernel agrees with TE's vector too
    assert te_partition_reference(cu, 2, 0) == [0, 1, 6, 7, 8, 9, 14, 15]
    assert te_partition_reference(cu, 2, 1) == [2, 3, 4, 5, 10, 11, 12, 13]


def test_partition_indices_dtype_and_identity():
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    idx = thd_partition_indices(cu, 1, 0)
    assert idx.dtype == torch.int64
    assert idx.tolist() == list(range(10))
    idx = thd_partition_indices(torch.tensor([0, 8, 24]), 2, 1)
    assert idx.dtype == torch.int64 and idx.numel() == 12
    # lists and numpy arrays are accepted like tensors
    want = [2, 3, 4, 5, 10, 11, 12, 13]
    assert thd_partition_indices([0, 8, 16], 2, 1).tolist() == want
    assert thd_partition_indices(np.array([0, 8, 16], dtype=np.int32), 2, 1).tolist() == want


@settings(max_examples=100, deadline=None)
@given(
    cp=st.sampled_from([1, 2, 4, 8]),
    multiples=st.lists(st.integers(0, 12), min_size=1, max_size=12),
    data=st.data(),
)
def test_partition_indices_match_te_kernel(cp, multiples, data):
    # padded lengths: any multiple of 2cp, zero-length samples included
    lengths = [m * 2 * cp for m in multiples]
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)
    r = data.draw(st.integers(0, cp - 1))
    assert thd_partition_indices(cu, cp, r).tolist() == te_partition_reference(cu, cp, r)


# --------------------------------------------------------------------------- padding multiple


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
def test_cp_pad_multiple_is_least(cp, tp, sp):
    m = cp_pad_multiple(cp, tp, sp)
    constraints = parallel_constraints(cp, tp, sp)
    assert all(m % c == 0 for c in constraints)
    assert not any(all(k % c == 0 for c in constraints) for k in range(1, m))


@pytest.mark.parametrize("cp", [1, 2, 4, 8, 16])
def test_cp_pad_multiple_fp8(cp):
    base = cp_pad_multiple(cp)
    assert cp_pad_multiple(cp, fp8=True) == math.lcm(base, 16)
    assert cp_pad_multiple(cp, fp8="fp8") == math.lcm(base, 16)
    assert cp_pad_multiple(cp, fp8="mxfp8") == math.lcm(base, 32)
    with pytest.raises(ValueError):
        cp_pad_multiple(cp, fp8="int4")


# --------------------------------------------------------------------------- built batches and shards


def check_cp_batch(batch, samples, lengths, cp, tp, sp, pad_to=None, extras=True):
    """Every CP invariant of ``batch`` (built with cp/tp/sp) and of its shards."""
    n = len(lengths)
    seq_lens = batch.seq_lens.tolist()
    assert seq_lens == list(lengths)
    cu = batch.cu_seqlens
    cu_p = batch.cu_seqlens_padded
    assert cu.dtype == torch.int32 and cu_p.dtype == torch.int32
    assert cu.tolist() == [0, *np.cumsum(lengths).tolist()]  # real cu_seqlens untouched
    padded = batch.seq_lens_padded.tolist()
    least = [least_padded_length(s, cp, tp, sp) for s in lengths]
    if pad_to is None:
        assert padded == least
    else:
        assert padded[:-1] == least[:-1]
        assert padded[-1] == least[-1] + (pad_to - sum(least))
        assert int(cu_p[-1]) == pad_to
    for p in padded:
        assert all(p % c == 0 for c in parallel_constraints(cp, tp, sp))
    T = int(cu_p[-1])
    assert batch.num_padded_tokens == T
    assert batch.max_seqlen == max(padded)

    # a per-token extra with the token axis last (mRoPE-like), to check it is indexed too
    if extras:
        mrope = torch.arange(3 * T, dtype=torch.int64).reshape(3, T)
        batch = dataclasses.replace(batch, token_extras={"mrope": mrope})

    all_idx = []
    local_sum = torch.zeros(n, dtype=torch.int64)
    for r in range(cp):
        shard = thdpack.shard(batch, cp_size=cp, cp_rank=r)
        idx = shard.shard.partition_indices
        assert idx.dtype == torch.int64
        assert idx.tolist() == thd_partition_indices(cu_p, cp, r).tolist() == te_partition_reference(cu_p, cp, r)
        # every rank: same number of tokens, P_i / cp of every sample
        assert idx.numel() == T // cp
        assert shard.num_padded_tokens == T // cp
        # shard tensors are the batch tensors at the indices
        for name in ("input_ids", "labels", "loss_mask", "position_ids"):
            assert torch.equal(getattr(shard, name), getattr(batch, name)[idx]), name
        if extras:
            assert torch.equal(shard.token_extras["mrope"], batch.token_extras["mrope"][:, idx])
        # local layout and local lengths
        assert shard.shard.local_cu_seqlens_padded.dtype == torch.int32
        assert shard.shard.local_cu_seqlens_padded.tolist() == [c // cp for c in cu_p.tolist()]
        lsl = shard.shard.local_seq_lens
        assert lsl.dtype == torch.int32
        assert lsl.tolist() == te_local_seq_lens(seq_lens, cu_p, cp, r)
        assert local_seq_lens(batch.seq_lens, cu_p, cp, r).tolist() == lsl.tolist()
        # ... and the real tokens of each sample that this rank's indices actually hold
        starts = cu_p.to(torch.int64)
        sample_of = torch.searchsorted(starts, idx, right=True) - 1
        real = (idx - starts[sample_of]) < batch.seq_lens.to(torch.int64)[sample_of]
        assert torch.bincount(sample_of[real], minlength=n).tolist() == lsl.tolist()
        # each rank holds P_i / cp tokens of sample i, in sample order
        assert torch.bincount(sample_of, minlength=n).tolist() == [p // cp for p in padded]
        assert bool((sample_of[1:] >= sample_of[:-1]).all())
        local_sum += lsl.to(torch.int64)
        # global metadata preserved
        assert torch.equal(shard.cu_seqlens, cu)
        assert torch.equal(shard.cu_seqlens_padded, cu_p)
        assert shard.max_seqlen == batch.max_seqlen
        assert torch.equal(shard.seq_lens, batch.seq_lens)
        assert (shard.shard.cp_size, shard.shard.cp_rank) == (cp, r)
        assert shard.is_shard
        # Megatron fields stay global on a shard
        params = to_packed_seq_params(shard)
        assert psp_field(params, "qkv_format") == "thd"
        for name, want in (("cu_seqlens_q", cu), ("cu_seqlens_kv", cu)):
            assert torch.equal(psp_field(params, name), want), name
        for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):  # None without alignment or a padded sample
            if batch.pad_multiple == 1 and torch.equal(cu_p, cu):
                assert psp_field(params, name) is None, name
            else:
                assert torch.equal(psp_field(params, name), cu_p), name
        assert psp_field(params, "max_seqlen_q") == psp_field(params, "max_seqlen_kv") == batch.max_seqlen
        # transformers kwargs use the local layout and the targets as shift_labels
        kw = to_hf_kwargs(shard)
        assert torch.equal(kw["input_ids"], shard.input_ids.unsqueeze(0))
        assert torch.equal(kw["position_ids"], shard.position_ids.unsqueeze(0))
        assert torch.equal(kw["cu_seq_lens_q"], shard.shard.local_cu_seqlens_padded)
        assert torch.equal(kw["cu_seq_lens_k"], shard.shard.local_cu_seqlens_padded)
        assert kw["max_length_q"] == kw["max_length_k"] == batch.max_seqlen // cp
        assert torch.equal(kw["shift_labels"], shard.labels.unsqueeze(0))
        all_idx.append(idx)
    # the ranks' indices together: a permutation of the stream
    assert torch.equal(torch.sort(torch.cat(all_idx)).values, torch.arange(T))
    assert local_sum.tolist() == seq_lens


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 100), min_size=1, max_size=12),
    tp=st.sampled_from([1, 2, 4]),
    sp=st.booleans(),
    extra_multiples=st.one_of(st.none(), st.integers(0, 3)),
    seed=st.integers(0, 2**16),
)
def test_build_and_shard_invariants(lengths, cp, tp, sp, extra_multiples, seed):
    samples = make_samples(lengths, seed)
    m = cp_pad_multiple(cp, tp, sp)
    pad_to = None
    if extra_multiples is not None:
        pad_to = sum(least_padded_length(s, cp, tp, sp) for s in lengths) + extra_multiples * m
    batch = build_thd_batch(samples, cp_size=cp, tp_size=tp, sequence_parallel=sp, pad_to=pad_to)
    assert batch.pad_multiple == m
    check_cp_batch(batch, samples, lengths, cp, tp, sp, pad_to=pad_to)
    # the unsharded contract still holds: tokens at the start of each padded span
    cu_p = batch.cu_seqlens_padded.tolist()
    for i, sample in enumerate(samples):
        a, s, p = cu_p[i], lengths[i], cu_p[i + 1] - cu_p[i]
        assert batch.input_ids[a : a + s].tolist() == np.asarray(sample["input_ids"]).tolist()
        assert batch.position_ids[a : a + s].tolist() == list(range(s))
        assert batch.labels[a + s - 1 : a + p].eq(IGNORE).all()


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_pad_to(cp):
    lengths = [5, 1, 17, 9]
    samples = make_samples(lengths, 0)
    aligned = sum(least_padded_length(s, cp, 1, False) for s in lengths)
    for pad_to in (aligned, aligned + 2 * cp, 256):
        batch = build_thd_batch(samples, cp_size=cp, pad_to=pad_to)
        assert batch.num_padded_tokens == pad_to
        check_cp_batch(batch, samples, lengths, cp, 1, False, pad_to=pad_to)
    with pytest.raises(ValueError, match="shorter"):
        build_thd_batch(samples, cp_size=cp, pad_to=aligned - 2 * cp)
    with pytest.raises(ValueError, match="multiple"):
        build_thd_batch(samples, cp_size=cp, pad_to=aligned + 1)
    with pytest.raises(ValueError, match="multiple"):
        build_thd_batch(samples, cp_size=cp, pad_to=aligned + cp)  # a multiple of cp, not of 2cp


def test_pad_to_without_alignment():
    """pad_to must pad the stream when the pad multiple is 1 (cp_size=1) as well."""
    batch = build_thd_batch([{"input_ids": [5, 6, 7]}], pad_to=8)
    assert batch.cu_seqlens_padded.tolist() == [0, 8]
    assert batch.input_ids.tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
    assert batch.labels.tolist() == [6, 7] + [IGNORE] * 6
    assert batch.position_ids.numel() == batch.loss_mask.numel() == 8


def test_local_seq_lens_cp1_is_seq_lens():
    """With one rank, the rank holds every real token, odd padded lengths included."""
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    seq_lens = torch.tensor([3, 1, 5], dtype=torch.int32)
    assert local_seq_lens(seq_lens, cu, 1, 0).tolist() == [3, 1, 5]
    shard = thdpack.shard(build_thd_batch(make_samples([3, 1, 5], 0)), cp_size=1, cp_rank=0)
    assert shard.shard.local_seq_lens.tolist() == [3, 1, 5]


def test_pad_multiple_combines_with_cp():
    lengths = [5, 30, 2]
    batch = build_thd_batch(make_samples(lengths, 1), cp_size=4, pad_multiple=16)
    assert batch.pad_multiple == 16
    assert batch.seq_lens_padded.tolist() == [16, 32, 16]
    batch = build_thd_batch(make_samples(lengths, 1), cp_size=8, pad_multiple=6)
    assert batch.pad_multiple == 48
    assert batch.seq_lens_padded.tolist() == [48, 48, 48]


def test_uncp_batch_with_aligned_lengths_shards():
    # a batch built without CP whose lengths happen to be multiples of 2cp is a valid TE layout
    lengths = [4, 8, 12]
    batch = build_thd_batch(make_samples(lengths, 2))
    check_cp_batch(batch, None, lengths, 1, 1, False, extras=False)
    for r in range(2):
        shard = thdpack.shard(batch, cp_size=2, cp_rank=r)
        assert shard.shard.partition_indices.tolist() == te_partition_reference(batch.cu_seqlens_padded, 2, r)


# --------------------------------------------------------------------------- collator


@pytest.mark.parametrize("cp", [2, 4])
def test_collator_returns_shard(cp):
    lengths = [7, 33, 1, 12]
    samples = make_samples(lengths, 3, as_numpy=False)
    batch = build_thd_batch(samples, cp_size=cp)
    for r in range(cp):
        got = ThdCollator(cp_size=cp, cp_rank=r)(samples)
        want = thdpack.shard(batch, cp_size=cp, cp_rank=r)
        assert (got.shard.cp_size, got.shard.cp_rank) == (cp, r)
        for name in ("input_ids", "labels", "position_ids", "shard.partition_indices", "shard.local_seq_lens",
                     "shard.local_cu_seqlens_padded", "cu_seqlens", "cu_seqlens_padded"):
            assert torch.equal(attrgetter(name)(got), attrgetter(name)(want)), name
    whole = ThdCollator(cp_size=cp)(samples)  # no rank: the whole CP-padded batch
    assert not whole.is_shard and torch.equal(whole.input_ids, batch.input_ids)
    packs = ThdCollator(cp_size=cp, cp_rank=cp - 1, pack_size=48)(samples)
    assert len(packs) >= 2
    for shard in packs:
        assert shard.shard.cp_rank == cp - 1
        assert shard.num_padded_tokens * cp == int(shard.cu_seqlens_padded[-1])
        assert all(p % (2 * cp) == 0 for p in shard.seq_lens_padded.tolist())


# --------------------------------------------------------------------------- attention equivalence


def varlen_causal_attention(q, k, v, cu_padded) -> torch.Tensor:
    """Unsharded reference: causal softmax attention within each padded span. q,k,v: [T, H, D]."""
    out = torch.zeros_like(q)
    cu = [int(c) for c in cu_padded]
    for a, b in zip(cu[:-1], cu[1:]):
        if a == b:
            continue
        scores = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) / math.sqrt(q.shape[-1])
        mask = torch.ones(b - a, b - a, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[a:b])
    return out


def cp_causal_attention(shards, qs, ks, vs) -> list[torch.Tensor]:
    """Each rank: its local queries against the keys of the same sample gathered from
    every rank, placed by their global positions; causal by the shards' position ids."""
    T = int(shards[0].cu_seqlens_padded[-1])
    H, D = qs[0].shape[1:]
    k_all = torch.empty(T, H, D, dtype=ks[0].dtype)
    v_all = torch.empty(T, H, D, dtype=vs[0].dtype)
    pos_all = torch.empty(T, dtype=torch.int64)
    for shard, k, v in zip(shards, ks, vs):  # the all-gather
        k_all[shard.shard.partition_indices] = k
        v_all[shard.shard.partition_indices] = v
        pos_all[shard.shard.partition_indices] = shard.position_ids
    cu_p = shards[0].cu_seqlens_padded.to(torch.int64)
    key_sample = torch.searchsorted(cu_p, torch.arange(T), right=True) - 1
    outs = []
    for shard, q in zip(shards, qs):
        local_cu = shard.shard.local_cu_seqlens_padded.to(torch.int64)
        n_local = q.shape[0]
        q_sample = torch.searchsorted(local_cu, torch.arange(n_local), right=True) - 1
        allowed = (q_sample[:, None] == key_sample[None, :]) & (pos_all[None, :] <= shard.position_ids[:, None])
        scores = torch.einsum("qhd,khd->hqk", q, k_all) / math.sqrt(D)
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v_all))
    return outs


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("seed", range(4))
def test_cp_attention_equals_unsharded(cp, seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 60, size=int(rng.integers(1, 7))).tolist()
    samples = make_samples(lengths, seed)
    batch = build_thd_batch(samples, cp_size=cp, tp_size=2, sequence_parallel=bool(seed % 2),
                            pad_to=None if seed < 2 else int(sum(least_padded_length(s, cp, 2, bool(seed % 2)) for s in lengths)) + 4 * cp)
    T = batch.num_padded_tokens
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, 2, 8, dtype=torch.float64, generator=gen) for _ in range(3))
    want = varlen_causal_attention(q, k, v, batch.cu_seqlens_padded)

    shards = [thdpack.shard(batch, cp_size=cp, cp_rank=r) for r in range(cp)]
    for shard in shards:
        idx = shard.shard.partition_indices
        # labels, positions and indices agree with the global stream
        assert torch.equal(shard.position_ids, batch.position_ids[idx])
        assert torch.equal(shard.labels, batch.labels[idx])
        assert torch.equal(shard.input_ids, batch.input_ids[idx])
    outs = cp_causal_attention(shards, [q[s.shard.partition_indices] for s in shards],
                               [k[s.shard.partition_indices] for s in shards], [v[s.shard.partition_indices] for s in shards])
    got = torch.full_like(q, float("nan"))
    for shard, o in zip(shards, outs):
        got[shard.shard.partition_indices] = o
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    # a wrong split is caught: ranks exchanging their index sets breaks the result
    wrong = torch.full_like(q, float("nan"))
    for shard, o in zip(reversed(shards), outs):
        wrong[shard.shard.partition_indices] = o
    assert not torch.allclose(wrong, want)


def test_cp_loss_sums_to_global_loss():
    """transformers' causal-LM loss on each rank's hf kwargs (shift_labels) sums to the
    unsharded loss computed with HF's own shift."""
    pytest.importorskip("transformers")
    from transformers.loss.loss_utils import ForCausalLMLoss

    cp, vocab = 4, 1000
    lengths = [13, 1, 40, 7, 22]
    batch = build_thd_batch(make_samples(lengths, 5), cp_size=cp)
    T = batch.num_padded_tokens
    logits = torch.randn(T, vocab, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    n_items = int(batch.loss_mask.sum())
    kw = to_hf_kwargs(batch)
    want = ForCausalLMLoss(logits.unsqueeze(0), kw["labels"], vocab, num_items_in_batch=n_items)
    total = 0.0
    for r in range(cp):
        shard = thdpack.shard(batch, cp_size=cp, cp_rank=r)
        skw = to_hf_kwargs(shard)
        total = total + ForCausalLMLoss(logits[shard.shard.partition_indices].unsqueeze(0), skw["labels"], vocab,
                                        num_items_in_batch=n_items, shift_labels=skw["shift_labels"])
    torch.testing.assert_close(total, want, rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------- work balance


def causal_pairs_per_rank(batch, cp) -> list[int]:
    """Σ over samples of the causal (query, key) pairs each rank computes, padded layout:
    a query at position p of its sample sees p + 1 keys."""
    return [int((thdpack.shard(batch, cp_size=cp, cp_rank=r).position_ids + 1).sum()) for r in range(cp)]


def contiguous_pairs_per_rank(batch, cp) -> list[int]:
    """The same for a naive split: each sample's padded span cut into cp contiguous pieces."""
    work = [0] * cp
    for p in batch.seq_lens_padded.tolist():
        piece = p // cp
        for r in range(cp):
            work[r] += sum(range(r * piece + 1, (r + 1) * piece + 1))
    return work


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_dual_chunk_balances_attention_work(cp):
    rng = np.random.default_rng(cp)
    lengths = np.clip(rng.lognormal(4, 1, 16), 1, 1000).astype(int).tolist()
    batch = build_thd_batch(make_samples(lengths, cp, with_labels=False), cp_size=cp)
    dual = causal_pairs_per_rank(batch, cp)
    naive = contiguous_pairs_per_rank(batch, cp)
    dual_ratio = max(dual) / (sum(dual) / cp)
    naive_ratio = max(naive) / (sum(naive) / cp)
    print(f"\ncp={cp}: causal pairs per rank max/mean: dual-chunk {dual_ratio:.4f}, contiguous {naive_ratio:.4f}")
    assert sum(dual) == sum(naive)  # same total work, different split
    assert max(dual) == min(dual)  # exactly balanced
    assert dual_ratio == 1.0
    assert naive_ratio > 1.0


# --------------------------------------------------------------------------- errors


def test_errors_cp_size():
    cu = torch.tensor([0, 8], dtype=torch.int32)
    batch = build_thd_batch(make_samples([5], 0), cp_size=2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="cp_size"):
            thd_partition_indices(cu, bad, 0)
        with pytest.raises(ValueError, match="cp_size"):
            thdpack.shard(batch, cp_size=bad, cp_rank=0)
        with pytest.raises(ValueError, match="cp_size"):
            cp_pad_multiple(bad)
        with pytest.raises(ValueError, match="cp_size"):
            build_thd_batch(make_samples([5], 0), cp_size=bad)
        with pytest.raises(ValueError, match="cp_size"):
            ThdCollator(cp_size=bad)
    with pytest.raises(ValueError, match="tp_size"):
        cp_pad_multiple(2, 0, True)


def test_errors_cp_rank():
    cu = torch.tensor([0, 8], dtype=torch.int32)
    batch = build_thd_batch(make_samples([5], 0), cp_size=2)
    for bad in (-1, 2, 7, 0.0, None):
        with pytest.raises(ValueError, match="cp_rank"):
            thd_partition_indices(cu, 2, bad)
        with pytest.raises(ValueError, match="cp_rank"):
            thdpack.shard(batch, cp_size=2, cp_rank=bad)
        with pytest.raises(ValueError, match="cp_rank"):
            thdpack.shard(batch, cp_size=2, cp_rank=bad)
        with pytest.raises(ValueError, match="cp_rank"):
            local_seq_lens(batch.seq_lens, cu, 2, bad)
    for bad in (-1, 2, 5):
        with pytest.raises(ValueError, match="cp_rank"):
            ThdCollator(cp_size=2, cp_rank=bad)


def test_error_batch_without_cp_padding_names_sample():
    batch = build_thd_batch(make_samples([4, 8, 3, 6], 0))  # no CP padding: sample 2 has length 3
    with pytest.raises(ValueError, match=r"sample 2\b"):
        thdpack.shard(batch, cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match=r"sample 3\b"):
        thdpack.shard(build_thd_batch(make_samples([4, 8, 12, 6], 0)), cp_size=2, cp_rank=1)  # 6 % 4 != 0
    # padded for cp=2 is not enough for cp=4
    batch = build_thd_batch(make_samples([4, 8, 3], 0), cp_size=2)
    with pytest.raises(ValueError, match=r"sample 0\b"):
        thdpack.shard(batch, cp_size=4, cp_rank=0)


def test_error_cu_seqlens_not_divisible():
    for cp, cu in ((2, [0, 6, 12]), (2, [0, 8, 10]), (4, [0, 8, 12]), (8, [0, 16, 32, 40])):
        cu = torch.tensor(cu, dtype=torch.int32)
        with pytest.raises(ValueError, match="sample"):
            thd_partition_indices(cu, cp, 0)
        with pytest.raises(ValueError, match="sample"):
            local_seq_lens(torch.ones(len(cu) - 1, dtype=torch.int32), cu, cp, 0)
    for cu in ([], [1, 4], [0, 8, 4]):
        with pytest.raises(ValueError):
            thd_partition_indices(torch.tensor(cu, dtype=torch.int32), 2, 0)


def test_error_sharding_a_shard():
    batch = build_thd_batch(make_samples([5, 9], 0), cp_size=4)
    shard = thdpack.shard(batch, cp_size=2, cp_rank=1)
    with pytest.raises(ValueError, match="already a CP shard"):
        thdpack.shard(shard, cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match="already a CP shard"):
        thdpack.shard(shard, cp_size=2, cp_rank=1)
    with pytest.raises(ValueError, match="already a CP shard"):
        thdpack.shard(shard, cp_size=1, cp_rank=0)


def test_public_api():
    for name in ("cp_pad_multiple", "thd_partition_indices", "shard", "local_seq_lens"):
        assert name in thdpack.__all__ and callable(getattr(thdpack, name))
