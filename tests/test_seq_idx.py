"""``thdpack.batching.seq_idx(batch)`` (issue 23 point 2): the sample of every stream slot for Mamba-2 / Gated-DeltaNet
layers, checked against the consumers' own code:

- transformers' ``DataCollatorWithFlattening(return_seq_idx=True)`` on the same samples (dtype,
  shape ``[1, T]``, values; with its flash kwargs, positions and labels beside it);
- transformers' ``find_packed_sequence_indices``, the segments its sdpa / eager masks cut from our
  ``position_ids``: pad slots and a ``pad_to`` tail must fall in the segment ``seq_idx`` gives them;
- megatron-core 0.19.2's ``PackedSeqParams.__post_init__`` on ``packed_seq_params_dict()`` (its
  ``seq_idx`` from ``total_tokens``), static shapes (``max_num_seqs``) included.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import megatron_env  # tests/megatron_env.py

import thdpack
from thdpack import build_thd_batch
from thdpack.attention.seq_idx import seq_idx_from_cu_seqlens
from thdpack.integrations import packed_seq_params_dict, to_hf_kwargs
from thdpack.batching import seq_idx

transformers = pytest.importorskip("transformers")
from transformers import DataCollatorWithFlattening  # noqa: E402
from transformers.masking_utils import find_packed_sequence_indices  # noqa: E402

PROPERTY = settings(max_examples=30, deadline=None)

lengths_st = st.lists(st.integers(1, 12), min_size=1, max_size=7)


def samples_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(1, 100, n).tolist()} for n in lengths]


def sample_of_each_slot(cu_padded: list[int]) -> list[int]:
    """Written out by hand: slot t of the stream belongs to the sample whose padded span holds it."""
    return [i for i in range(len(cu_padded) - 1) for _ in range(cu_padded[i + 1] - cu_padded[i])]


@pytest.mark.filterwarnings("ignore:thdpack. a batch of")  # a 1-token sample with labels has no target
@PROPERTY
@given(lengths=lengths_st, with_labels=st.booleans())
def test_equals_transformers_flattening_collator(lengths, with_labels):
    """No padding: seq_idx and everything else the collator returns equal what thdpack gives."""
    samples = samples_of(lengths)
    if with_labels:
        for s in samples:
            s["labels"] = [t if t % 3 else -100 for t in s["input_ids"]]
    hf = DataCollatorWithFlattening(return_seq_idx=True, return_flash_attn_kwargs=True)(
        [{k: list(v) for k, v in s.items()} for s in samples])
    batch = build_thd_batch(samples)
    kw = to_hf_kwargs(batch)
    assert seq_idx(batch).dtype == hf["seq_idx"].dtype == torch.int32
    assert seq_idx(batch).shape == hf["seq_idx"].shape == (1, sum(lengths))
    assert torch.equal(seq_idx(batch), hf["seq_idx"])
    for key in ("input_ids", "position_ids", "labels", "cu_seq_lens_q", "cu_seq_lens_k"):
        assert torch.equal(kw[key].to(hf[key].dtype), hf[key]), key
    assert kw["max_length_q"] == hf["max_length_q"]


@PROPERTY
@given(lengths=lengths_st, pad_multiple=st.sampled_from([None, 4, 8]), cp_size=st.sampled_from([1, 2]),
       extra=st.sampled_from([None, 0, 8, 24]))
def test_pad_slots_and_pad_to_tail_hold_their_samples_id(lengths, pad_multiple, cp_size, extra):
    """Real slots: the collator's ids. Pad slots (alignment and the pad_to tail): their sample's, the
    span of cu_seqlens_padded they lie in, which is also the segment transformers' masks cut from
    position_ids (find_packed_sequence_indices)."""
    samples = samples_of(lengths, seed=len(lengths))
    aligned = build_thd_batch(samples, pad_multiple=pad_multiple, cp_size=cp_size)
    pad_to = None if extra is None else aligned.num_padded_tokens + extra * aligned.pad_multiple
    batch = build_thd_batch(samples, pad_multiple=pad_multiple, cp_size=cp_size, pad_to=pad_to)
    ids = seq_idx(batch)
    T = batch.num_padded_tokens
    assert ids.shape == (1, T) and ids.dtype == torch.int32
    assert ids[0].tolist() == sample_of_each_slot(batch.cu_seqlens_padded.tolist())

    real = torch.zeros(T, dtype=torch.bool)
    for a, s in zip(batch.cu_seqlens_padded[:-1].tolist(), batch.seq_lens.tolist()):
        real[a : a + s] = True
    hf = DataCollatorWithFlattening(return_seq_idx=True)(samples)
    assert torch.equal(ids[:, real], hf["seq_idx"])
    if pad_to is not None and extra:  # the tail is the last sample's
        assert bool((ids[0, aligned.num_padded_tokens:] == batch.num_samples - 1).all())

    segments = find_packed_sequence_indices(batch.position_ids.unsqueeze(0))
    segments = torch.zeros_like(ids) if segments is None else segments  # None: one segment
    assert torch.equal(segments.to(torch.int32), ids)


def test_a_cp_shard_gives_the_whole_streams_seq_idx():
    batch = build_thd_batch(samples_of([5, 2, 7, 1]), cp_size=2)
    for rank in range(2):
        shard = thdpack.shard(batch, cp_size=2, cp_rank=rank)
        assert torch.equal(seq_idx(shard), seq_idx(batch))
        assert seq_idx(shard).shape[1] == packed_seq_params_dict(shard)["total_tokens"]


MEGATRON_CASES = [
    ([5, 2, 7, 1], {}),
    ([5, 2, 7, 1], {"cp_size": 2}),
    ([5, 2, 7, 1], {"pad_to": 24}),
    ([5, 2, 7, 1], {"pad_to": 24, "max_num_seqs": 6}),
    ([4, 8, 12], {"cp_size": 2, "pad_to": 32, "max_num_seqs": 5}),
    ([3, 3], {"max_num_seqs": 4}),  # unpadded: megatron-core reads cu_seqlens_q, padded with repeats
]


@pytest.mark.parametrize("lengths,kw", MEGATRON_CASES)
@pytest.mark.parametrize("core", [megatron_env.peer_param(megatron_env.core_params_or_reason(), megatron_env.CORE_ID)])
def test_megatron_core_seq_idx_equals_seq_idx(core, lengths, kw):
    """megatron-core 0.19.2's own PackedSeqParams (its file loaded on its own: it imports only torch),
    given packed_seq_params_dict() (static or not), builds exactly seq_idx(batch)."""
    params_class = core.PackedSeqParams
    batch = build_thd_batch(samples_of(lengths), **kw)
    params = params_class(**packed_seq_params_dict(batch))
    assert params.seq_idx.dtype == torch.int32
    assert torch.equal(params.seq_idx, seq_idx(batch)), (lengths, kw)


@pytest.mark.parametrize("cu,message", [
    ([[0, 2]], r"^cu_seqlens_padded must be 1-D with at least 2 entries .*got shape \(1, 2\)"),
    ([0], r"^cu_seqlens_padded must be 1-D with at least 2 entries .*got shape \(1,\)"),
    ([1, 3], r"^cu_seqlens_padded must start at 0 and never decrease, got \[1, 3\]"),
    ([0, 3, 2], r"^cu_seqlens_padded must start at 0 and never decrease, got \[0, 3, 2\]"),
    ([0.0, 2.0], r"^cu_seqlens_padded must hold integers"),
])
def test_bad_offsets_are_named(cu, message):
    with pytest.raises(ValueError, match=message):
        seq_idx_from_cu_seqlens(cu)


def test_zero_length_entries_hold_no_slot():
    """Static offsets (the last value repeated) give the same seq_idx; a list, numpy or tensor alike."""
    want = [[0, 0, 0, 1, 1, 2, 2, 2, 2]]
    for cu in ([0, 3, 5, 9], np.array([0, 3, 5, 9, 9, 9]), torch.tensor([0, 3, 5, 9, 9], dtype=torch.int32)):
        got = seq_idx_from_cu_seqlens(cu)
        assert got.tolist() == want and got.dtype == torch.int32
