"""thdpack.flops length counts (issue 36): the window and top-k counts of every sample in closed form
against a brute count of each sample's allowed (query, key) pairs; their CP shares, shared-prefix trees and
exact sums; FlopsAccumulator carrying them for a windowed model; and the over-count report of a windowed
model at 32k packs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import thdpack
from thdpack import build_thd_batch, plan_packs
from thdpack.flops import (
    FlopsAccumulator,
    count_name,
    cp_length_count_share,
    length_count,
    model_flops,
    model_flops_breakdown,
    needed_length_counts,
    overcount_report,
    tree_length_count,
)
from thdpack.flops.sequences import length_count_values, parse_count_name
from thdpack.integrations import to_hf_kwargs

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

MISTRAL_7B = {  # Mistral-7B-v0.1: every layer attends inside a 4096-token window
    "model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336, "vocab_size": 32000,
    "sliding_window": 4096,
}
TINY_GEMMA3 = {  # layers 0, 1 local (window 8), layer 2 global
    "model_type": "gemma3_text", "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "vocab_size": 96, "sliding_window": 8,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
}


def allowed_pairs(s: int, window: int | None) -> int:
    """(query, key) pairs a causal query sees in a sample of ``s`` tokens, at most ``window`` keys back
    (itself included): enumerated."""
    return sum(1 for q in range(s) for k in range(s) if k <= q and (window is None or q - k < window))


def topk_pairs(s: int, k: int, seed: int) -> int:
    """Keys a top-k selection over random causal scores keeps, summed over the queries of one sample."""
    scores = torch.randn(s, s, generator=torch.Generator().manual_seed(seed))
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    kept = scores.topk(min(k, s), dim=-1).values
    return int(torch.isfinite(kept).sum())


@SETTINGS
@given(lengths=st.lists(st.integers(0, 90), max_size=8), window=st.integers(1, 100))
def test_window_counts_are_the_allowed_pairs(lengths, window):
    pairs = [allowed_pairs(s, window) for s in lengths]
    assert length_count(lengths, count_name("causal_pairs", window)) == sum(pairs)
    assert length_count(lengths, "causal_pairs") == sum(allowed_pairs(s, None) for s in lengths)
    # the window count in the unit of Σ sᵢ²: a sample the window cuts is charged twice its pairs, one it
    # does not cut s² (full attention, as Megatron-Bridge counts both)
    expected = sum(s * s if s <= window else 2 * p for s, p in zip(lengths, pairs))
    assert length_count(lengths, count_name("window_square_sum", window)) == expected
    assert length_count(np.asarray(lengths, np.int32), "seqlen_squared_sum") == sum(s * s for s in lengths)


@SETTINGS
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4), k=st.integers(1, 50), seed=st.integers(0, 99))
def test_topk_count_is_what_a_topk_selection_keeps(lengths, k, seed):
    assert length_count(lengths, count_name("causal_pairs", k)) == sum(topk_pairs(s, k, seed + i)
                                                                       for i, s in enumerate(lengths))


@SETTINGS
@given(lengths=st.lists(st.integers(0, 200), min_size=1, max_size=6), window=st.integers(1, 64),
       cp=st.sampled_from([2, 3, 4]))
def test_cp_shares_are_each_ranks_pairs_and_add_up(lengths, window, cp):
    multiple = 2 * cp
    padded = [-(-s // multiple) * multiple for s in lengths]
    cu_padded = np.concatenate([[0], np.cumsum(padded)])
    for name in (count_name("causal_pairs", window), count_name("window_square_sum", window), "causal_pairs"):
        shares = [int(cp_length_count_share(lengths, cu_padded, cp, r, name)) for r in range(cp)]
        assert sum(shares) == length_count(lengths, name)
    name = count_name("causal_pairs", window)  # a rank's share is the pairs of the queries it holds
    for rank in range(cp):
        brute = 0
        for s, p in zip(lengths, padded):
            h = p // multiple
            for c in (rank, multiple - 1 - rank):
                brute += sum(min(q + 1, window) for q in range(c * h, min(s, (c + 1) * h)))
        assert int(cp_length_count_share(lengths, cu_padded, cp, rank, name)) == brute


@SETTINGS
@given(prefix=st.integers(1, 40), members=st.lists(st.integers(1, 30), min_size=1, max_size=4),
       window=st.integers(1, 50))
def test_shared_prefix_tree_counts_the_pairs_of_the_tree(prefix, members, window):
    # the prefix once, each member's queries at positions prefix .. prefix + c - 1 seeing the prefix
    lens, parents = [prefix, *members], [-1] + [0] * len(members)
    name = count_name("causal_pairs", window)
    brute = sum(min(q + 1, window) for q in range(prefix))
    brute += sum(min(q + 1, window) for c in members for q in range(prefix, prefix + c))
    assert tree_length_count(lens, parents, name) == brute


def test_exact_past_int64_and_count_names():
    big = [3_000_000_000] * 4  # 2·max·Σ passes 2⁶³: Python integers
    w = 4096
    one = w * (w + 1) + 2 * w * (big[0] - w)
    assert length_count(big, count_name("window_square_sum", w)) == 4 * one
    assert length_count(big, "causal_pairs") == 4 * (big[0] * (big[0] + 1) // 2)
    assert parse_count_name("window_square_sum[4096]") == ("window_square_sum", 4096)
    assert parse_count_name("causal_pairs") == ("causal_pairs", None)
    for bad in ("window_square_sum", "window_square_sum[0]", "causal_pairs[x]", "tokens[3]", "seqlen_squared_sum[2]"):
        with pytest.raises(ValueError, match="length count"):
            parse_count_name(bad)
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        length_count([3, -1], "causal_pairs")
    t = torch.tensor([0, 5, 9, 20])
    assert length_count_values(t, "causal_pairs[6]").tolist() == [0, 15, 6 * 7 // 2 + 6 * 3, 21 + 6 * 14]


# =========================================================================== FlopsAccumulator


def _samples(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(3, 90, n)} for n in lengths]


LENGTHS = [3, 8, 9, 17, 30, 1]


def test_accumulator_carries_the_window_counts_of_a_windowed_model():
    name = count_name("window_square_sum", 8)
    assert needed_length_counts(TINY_GEMMA3) == (name,)
    batch = build_thd_batch(_samples(LENGTHS))
    acc = FlopsAccumulator(TINY_GEMMA3).add(batch)
    counts = acc.counts()
    assert counts[name] == length_count(LENGTHS, name) == sum(s * s if s <= 8 else 2 * allowed_pairs(s, 8)
                                                              for s in LENGTHS)
    expected = model_flops(TINY_GEMMA3, sum(LENGTHS), sum(s * s for s in LENGTHS), seq_lens=LENGTHS)
    assert acc.model_flops(TINY_GEMMA3) == expected
    terms = model_flops_breakdown(TINY_GEMMA3, sum(LENGTHS), sum(s * s for s in LENGTHS), seq_lens=LENGTHS)
    assert terms["sliding_attention_8"] == 2 * 6 * 32 * counts[name]  # 2 window layers, 6·d_q each
    assert terms["core_attention"] == 6 * 32 * sum(s * s for s in LENGTHS)  # the global layer
    # the same micro-batch as model inputs, as a CP shard pair, as BSHD: the same window counts
    for inputs in (to_hf_kwargs(batch), {"cu_seqlens": batch.cu_seqlens, "input_ids": batch.input_ids}):
        assert FlopsAccumulator(TINY_GEMMA3).add(inputs).counts()[name] == counts[name]
    shards = FlopsAccumulator(TINY_GEMMA3)
    cp_batch = build_thd_batch(_samples(LENGTHS), cp_size=2)
    for rank in range(2):
        shards.add(thdpack.shard(cp_batch, cp_size=2, cp_rank=rank))
    assert shards.counts()[name] == counts[name]
    for cp in (1, 2):  # Ulysses ranks (under CP ranks): 1/sp each of the pack's (or CP shard's) count
        ulysses, cp_built = FlopsAccumulator(TINY_GEMMA3), build_thd_batch(_samples(LENGTHS), cp_size=cp)
        for cp_rank in range(cp):
            for rank in range(2):
                ulysses.add(thdpack.shard(cp_built, sp_size=2, sp_rank=rank, cp_size=cp, cp_rank=cp_rank))
        assert ulysses.counts()[name] == counts[name]
    bshd = FlopsAccumulator(TINY_GEMMA3).add_bshd(3, 20).counts()[name]
    assert bshd == 3 * (8 * 9 + 2 * 8 * 12)
    # a whole model config is needed to know the window; without it model_flops names the count
    with pytest.raises(ValueError, match=r"window_square_sum\[8\]"):
        FlopsAccumulator().add(batch).model_flops(TINY_GEMMA3)
    with pytest.raises(ValueError, match="same model config"):
        FlopsAccumulator(TINY_GEMMA3).merge(FlopsAccumulator())


def test_accumulator_counts_cross_attention_memories():
    text = {"model_type": "mllama_text_model", "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "vocab_size": 96,
            "cross_attention_layers": [1]}
    cu, memory = torch.tensor([0, 5, 12, 20], dtype=torch.int32), torch.tensor([0, 4, 4, 10], dtype=torch.int32)
    acc = FlopsAccumulator(text).add({"cu_seqlens": cu, "cross_cu_seqlens": memory, "input_ids": torch.zeros(1, 20)})
    counts = acc.counts()
    assert counts["cross_tokens"] == 10 and counts["cross_seqlen_product_sum"] == 5 * 4 + 7 * 0 + 8 * 6
    terms = model_flops_breakdown(text, 20, 25 + 49 + 64, counts={k: counts[k] for k in ("cross_tokens",
                                                                                         "cross_seqlen_product_sum")})
    d_q, d_kv = 32, 16
    assert terms["cross_attention"] == 12 * d_q * 68  # QKᵀ and AV over every (token, memory token) pair
    assert terms["cross_attention_kv"] == 6 * 2 * 32 * d_kv * 10
    assert terms["cross_attention_projections"] == 6 * 2 * 32 * d_q * 20
    assert terms["core_attention"] == 6 * d_q * 2 * (25 + 49 + 64)  # the two self-attention layers
    with pytest.raises(ValueError, match="needs cross_tokens"):
        model_flops(text, 20, 138)


# =========================================================================== the over-count at 32k packs


def test_overcount_report_of_a_windowed_model_at_32k_packs():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(7.0, 1.1, 3000), 16, 32768).astype(np.int64)
    plan = plan_packs(lengths, 32768)
    n = len(plan)
    report = overcount_report(plan, config=MISTRAL_7B)
    name = count_name("window_square_sum", 4096)
    real = length_count(lengths, name)
    claimed = n * (4096 * 4097 + 2 * 4096 * (32768 - 4096))
    assert report["length_counts"][name] == {"real": real, "pack_len_count": claimed, "overcount": claimed / real}
    tokens = int(lengths.sum())
    legacy = model_flops(MISTRAL_7B, n * 32768, n * 32768**2, counts={name: claimed})
    honest = model_flops(MISTRAL_7B, tokens, int((lengths**2).sum()), counts={name: real})
    assert report["model"] == pytest.approx(legacy / honest, rel=1e-12)
    # a window caps what a pack-length count can over-charge: far less than Σ sᵢ² alone suggests
    assert 1 < report["length_counts"][name]["overcount"] < report["attention"]


def test_window_counts_stay_on_the_device_without_host_sync():
    # a meta tensor has no data: any host sync raises, so reaching the end proves none happened
    meta = torch.empty(5, dtype=torch.int32, device="meta")
    share = cp_length_count_share(torch.empty(4, dtype=torch.int32, device="meta"), meta, 2, 1,
                                  count_name("window_square_sum", 8))
    assert share.device.type == "meta" and share.dtype == torch.int64
    acc = FlopsAccumulator(TINY_GEMMA3).add_cu_seqlens(meta, num_padded_tokens=30)
    assert acc._get(count_name("window_square_sum", 8)).device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_window_counts_without_host_sync():
    lengths = [300, 17, 0, 4096, 55]
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32, device="cuda")
    batch = build_thd_batch(_samples([n for n in lengths if n]), pad_multiple=8).to("cuda")
    acc = FlopsAccumulator(TINY_GEMMA3)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        acc.add(batch)
        acc.add_cu_seqlens(cu)
        lazy = acc.model_flops(TINY_GEMMA3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    name = count_name("window_square_sum", 8)
    assert isinstance(lazy, torch.Tensor) and lazy.device.type == "cuda"
    assert acc.counts()[name] == 2 * length_count(lengths, name)
    expected = model_flops(TINY_GEMMA3, 2 * sum(lengths), 2 * sum(s * s for s in lengths),
                           counts={name: 2 * length_count(lengths, name)})
    assert float(lazy) == float(expected)
