"""thdpack.flops: Σ sᵢ² against brute force, model FLOPs against hand-written formulas
for published configs and against Megatron-LM's closed form, CP / DP accounting,
throughput, and the transformers Trainer callback on a tiny packed run."""

from __future__ import annotations

import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import thdpack
from thdpack import build_thd_batch
from thdpack.flops import (
    GPU_PEAK_TFLOPS,
    FlopsAccumulator,
    FlopsMeter,
    attention_overcount_factor,
    cp_seqlen_squared_share,
    flops_coefficients,
    model_flops,
    model_flops_breakdown,
    model_overcount_factor,
    overcount_report,
    peak_tflops_for,
    seqlen_squared_sum,
    throughput,
    vision_seqlen_stats,
)
from thdpack.integrations import to_hf_kwargs

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --------------------------------------------------------------------------- published configs (dicts)

QWEN3_8B = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "vocab_size": 151936,
    "hidden_act": "silu",
}

QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "hidden_act": "silu",
}

QWEN3_NEXT_80B_A3B = {  # Qwen3-Next hybrid: 3 Gated DeltaNet layers, then 1 gated full-attention layer
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "intermediate_size": 5120,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "vocab_size": 151936,
}

QWEN2_5_VL_7B = {
    "model_type": "qwen2_5_vl",
    "text_config": {
        "model_type": "qwen2_5_vl_text",
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
    },
    "vision_config": {  # as in the published config.json
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
    },
}


def brute_square_sum(lengths) -> int:
    return sum(int(s) * int(s) for s in lengths)


def cumulative(lengths) -> list[int]:
    return [0] + np.cumsum(np.asarray(lengths, dtype=np.int64)).tolist()


def make_samples(lengths, seed=0, vocab=100):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(3, vocab, n)} for n in lengths]


# =========================================================================== Σ sᵢ²

lengths_st = st.lists(st.integers(0, 5000), min_size=0, max_size=40)


@SETTINGS
@given(lengths=lengths_st, use_numpy=st.booleans(), dtype=st.sampled_from([torch.int32, torch.int64]))
def test_square_sum_matches_brute_force(lengths, use_numpy, dtype):
    cu = cumulative(lengths)
    arg = np.asarray(cu, dtype=np.int32 if dtype == torch.int32 else np.int64) if use_numpy else torch.tensor(cu, dtype=dtype)
    if sum(lengths) == 0:  # no tokens: the micro-batch's token count is unknown here, so no 0
        with pytest.raises(ValueError, match="cu_seqlens holds no tokens"):
            seqlen_squared_sum(arg)
        if not lengths:  # [0]: visible without reading the values, also lazily
            with pytest.raises(ValueError, match="cu_seqlens holds no tokens"):
                seqlen_squared_sum(arg, as_tensor=True)
        return
    got = seqlen_squared_sum(arg)
    assert type(got) is int
    assert got == brute_square_sum(lengths)
    lazy = seqlen_squared_sum(arg, as_tensor=True)
    assert int(lazy) == brute_square_sum(lengths)
    if not use_numpy:
        assert isinstance(lazy, torch.Tensor) and lazy.dtype == torch.int64 and lazy.ndim == 0


@SETTINGS
@given(
    rows=st.lists(lengths_st, min_size=1, max_size=4),
    pad=st.integers(0, 5),
    pass_argmin=st.booleans(),
    garbage=st.booleans(),
)
def test_square_sum_argmin_minus_one_padded_rows(rows, pad, pass_argmin, garbage):
    """NeMo / Megatron-Bridge: [B, N] rows padded with -1, argmin = first -1 of each row."""
    width = max(len(r) for r in rows) + 1 + pad
    table = np.full((len(rows), width), -1, dtype=np.int64)
    argmin = []
    for i, r in enumerate(rows):
        cu = cumulative(r)
        table[i, : len(cu)] = cu
        argmin.append(len(cu))
    if garbage and pass_argmin:
        # with an explicit argmin, whatever sits past it is never read
        for i in range(len(rows)):
            table[i, argmin[i] :] = np.arange(width - argmin[i]) * 7 + 10**6
    expected = sum(brute_square_sum(r) for r in rows)
    t = torch.from_numpy(table).to(torch.int32)
    am = torch.tensor(argmin).reshape(-1, 1) if pass_argmin else None
    if expected == 0:  # no row holds a token: unknown token count, no 0 (test_empty_cu_seqlens_*)
        with pytest.raises(ValueError, match="cu_seqlens holds no tokens"):
            seqlen_squared_sum(t, cu_seqlens_argmin=am)
        return
    assert seqlen_squared_sum(t, cu_seqlens_argmin=am) == expected
    assert int(seqlen_squared_sum(t, cu_seqlens_argmin=am, as_tensor=True)) == expected
    assert seqlen_squared_sum(table, cu_seqlens_argmin=np.asarray(argmin) if pass_argmin else None) == expected
    if len(rows) == 1 and pass_argmin:  # the 1-D form with a Python int argmin
        assert seqlen_squared_sum(t[0], cu_seqlens_argmin=argmin[0]) == expected


@SETTINGS
@given(real=st.lists(st.integers(0, 3000), min_size=1, max_size=30), multiple=st.sampled_from([2, 8, 16]))
def test_square_sum_prefers_unpadded(real, multiple):
    padded = [-(-s // multiple) * multiple for s in real]
    cu_pad = torch.tensor(cumulative(padded) + [-1, -1], dtype=torch.int32)
    cu_real = torch.tensor(cumulative(real) + [-1, -1, -1], dtype=torch.int32)
    got = seqlen_squared_sum(
        cu_pad,
        cu_seqlens_argmin=len(padded) + 1,
        cu_seqlens_unpadded=cu_real,
        cu_seqlens_unpadded_argmin=torch.tensor([[len(real) + 1]]),
    )
    if sum(real) == 0:  # no real tokens and none in the layout either: an empty micro-batch
        assert got == 0
        with pytest.raises(ValueError, match="cu_seqlens holds no tokens"):
            seqlen_squared_sum(cu_pad)
        return
    assert got == brute_square_sum(real)
    assert seqlen_squared_sum(cu_pad) == brute_square_sum(padded)


def test_zero_length_segments_are_ignored():
    lengths = [5, 0, 0, 7, 0, 3, 0]
    cu = torch.tensor(cumulative(lengths), dtype=torch.int32)
    assert seqlen_squared_sum(cu) == 25 + 49 + 9
    acc = FlopsAccumulator().add_cu_seqlens(cu)
    assert acc.counts()["samples"] == 3 and acc.tokens == 15 and acc.seqlen_squared_sum == 83
    # no tokens at all: Σ sᵢ² of the micro-batch is unknown here (test_empty_cu_seqlens_*)
    with pytest.raises(ValueError, match="cu_seqlens holds no tokens"):
        seqlen_squared_sum(torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens holds no tokens"):
        seqlen_squared_sum([0, 0, 0])


def test_square_sum_int64_no_overflow():
    # int32 cu_seqlens near the top of the range: each s² overflows int32 but fits int64
    cu = torch.tensor([0, 2**30, 2**31 - 1], dtype=torch.int32)
    assert seqlen_squared_sum(cu) == (2**30) ** 2 + (2**31 - 1 - 2**30) ** 2
    assert int(seqlen_squared_sum(cu, as_tensor=True)) == (2**30) ** 2 + (2**31 - 1 - 2**30) ** 2
    # int64 lengths whose squares sum beyond int64: exact Python integers
    big = [5 * 10**9, 3 * 10**9, 4 * 10**9 + 7]
    exact = brute_square_sum(big)
    assert exact > 2**63
    assert seqlen_squared_sum(torch.tensor(cumulative(big), dtype=torch.int64)) == exact
    assert seqlen_squared_sum(np.asarray(cumulative(big), dtype=np.int64)) == exact
    acc = FlopsAccumulator().add_cu_seqlens(torch.tensor(cumulative(big), dtype=torch.int64))
    assert acc.seqlen_squared_sum == exact and acc.tokens == sum(big)


def test_square_sum_stays_on_device_without_host_sync():
    # a meta tensor has no data: any host sync (.item(), int(), bool()) raises, so reaching the
    # end proves the as_tensor path never syncs, and the result stays on the input's device
    cu = torch.empty(9, dtype=torch.int32, device="meta")
    out = seqlen_squared_sum(cu, as_tensor=True)
    assert out.device.type == "meta" and out.dtype == torch.int64 and out.ndim == 0
    out = seqlen_squared_sum(
        torch.empty(2, 9, dtype=torch.int32, device="meta"),
        cu_seqlens_argmin=torch.empty(2, 1, dtype=torch.int64, device="meta"),
        as_tensor=True,
    )
    assert out.device.type == "meta"
    with pytest.raises(Exception):
        seqlen_squared_sum(cu)  # the exact (synced) path needs the values
    share = cp_seqlen_squared_share(torch.empty(4, dtype=torch.int32, device="meta"),
                                    torch.empty(5, dtype=torch.int32, device="meta"), 2, 1)
    assert share.device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_counts_without_host_sync():
    lengths = [300, 17, 0, 4096, 55]
    cu = torch.tensor(cumulative(lengths), dtype=torch.int32, device="cuda")
    batch = build_thd_batch(make_samples([n for n in lengths if n]), pad_multiple=8).to("cuda")
    acc = FlopsAccumulator()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = seqlen_squared_sum(cu, as_tensor=True)
        acc.add(batch)
        acc.add_cu_seqlens(cu)
        lazy = acc.model_flops(QWEN3_8B)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.device.type == "cuda" and int(out) == brute_square_sum(lengths)
    assert isinstance(lazy, torch.Tensor) and lazy.device.type == "cuda"
    assert acc.counts()["seqlen_squared_sum"] == 2 * brute_square_sum(lengths)
    assert float(lazy) == float(model_flops(QWEN3_8B, 2 * sum(lengths), 2 * brute_square_sum(lengths)))


def test_square_sum_rejects_decreasing():
    with pytest.raises(ValueError, match="non-decreasing"):
        seqlen_squared_sum(torch.tensor([0, 5, 3], dtype=torch.int32))
    with pytest.raises(ValueError):
        seqlen_squared_sum()


def test_thd_batch_square_sum():
    lengths = [17, 1, 64, 33, 5]
    batch = build_thd_batch(make_samples(lengths), pad_multiple=8)
    assert seqlen_squared_sum(batch) == seqlen_squared_sum(batch.cu_seqlens) == brute_square_sum(lengths)
    assert seqlen_squared_sum(batch.cu_seqlens_padded, cu_seqlens_unpadded=batch.cu_seqlens) == brute_square_sum(lengths)
    with pytest.raises(TypeError, match=r"^seqlen_squared_sum\(batch\) takes no other argument .* pass batch.cu_seqlens"):
        seqlen_squared_sum(batch, as_tensor=True)


# =========================================================================== pack vs one sequence


def test_32_packed_128_counts_32x_less_attention_than_one_4096():
    packed = build_thd_batch(make_samples([128] * 32))
    single = build_thd_batch(make_samples([4096]))
    assert packed.num_tokens == single.num_tokens == 4096
    sq_packed = seqlen_squared_sum(packed.cu_seqlens)
    sq_single = seqlen_squared_sum(single.cu_seqlens)
    assert sq_packed == 32 * 128 * 128 and sq_single == 4096 * 4096
    assert sq_single == 32 * sq_packed
    attn_packed = model_flops_breakdown(QWEN3_8B, 4096, sq_packed)["core_attention"]
    attn_single = model_flops_breakdown(QWEN3_8B, 4096, sq_single)["core_attention"]
    assert attn_single == 32 * attn_packed
    # everything else is per token and identical
    assert model_flops(QWEN3_8B, 4096, sq_single) - model_flops(QWEN3_8B, 4096, sq_packed) == attn_single - attn_packed
    assert attention_overcount_factor(1, 4096, sq_packed) == 32.0
    acc_packed, acc_single = FlopsAccumulator().add(packed), FlopsAccumulator().add(single)
    assert acc_single.seqlen_squared_sum == 32 * acc_packed.seqlen_squared_sum


# =========================================================================== BSHD fallback


@pytest.mark.parametrize("mbs,seq_len", [(1, 4096), (4, 2048), (8, 8192), (3, 131072)])
def test_bshd_fallback_bit_identical_to_legacy(mbs, seq_len):
    acc = FlopsAccumulator()
    acc.add(torch.zeros(mbs, seq_len, dtype=torch.long))
    assert acc.seqlen_squared_sum == mbs * seq_len**2 and type(acc.seqlen_squared_sum) is int
    assert acc.tokens == mbs * seq_len
    other = FlopsAccumulator().add({"input_ids": torch.zeros(mbs, seq_len, dtype=torch.long),
                                    "attention_mask": torch.ones(mbs, seq_len, dtype=torch.long)})
    assert other.counts() == acc.counts() == FlopsAccumulator().add_bshd(mbs, seq_len).counts()
    # the legacy count: B sequences of S tokens charged B·S² attention
    legacy = model_flops(QWEN3_8B, mbs * seq_len, mbs * seq_len * seq_len)
    assert acc.model_flops(QWEN3_8B) == legacy
    assert legacy == megatron_dense_flops(QWEN3_8B, mbs, seq_len)


# =========================================================================== model FLOPs, hand-written


def megatron_dense_flops(cfg, batch, seq_len) -> int:
    """Megatron-LM ``num_floating_point_operations`` for dense GQA + SwiGLU, causal attention,
    in its closed form:

        6·B·s·L·h²·( (d_q/h)·(2·(1 + g/n) + s/h) + e·ffn/h + V/(L·h) ),  e = 3 (SwiGLU)

    i.e. 12·B·s·L·h²·((d_q/h)·(1 + g/n + s/(2h)) + (3/2)·ffn/h + V/(2·L·h)) with
    n heads, g query groups (kv heads), d_q = n·kv_channels. Exact with fractions.
    """
    B, s = batch, seq_len
    L, h, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    n, g = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d_q = n * cfg["head_dim"]
    ffn = cfg["intermediate_size"]
    bracket = (
        Fraction(d_q, h) * (2 * (1 + Fraction(g, n)) + Fraction(s, h))
        + 3 * Fraction(ffn, h)
        + Fraction(V, L * h)
    )
    total = 6 * B * s * L * h * h * bracket
    assert total.denominator == 1
    return int(total)


def test_qwen3_8b_hand_formula():
    h, L, V = 4096, 36, 151936
    d_q, d_kv, ffn = 32 * 128, 8 * 128, 12288
    tokens, sq = 123_457, 987_654_321
    mlp = 6 * h * 3 * ffn * L  # gate, up, down: 3 GEMMs h x ffn
    attn_proj = 6 * L * (h * d_q + 2 * h * d_kv + d_q * h)  # q, k, v, o
    core = 6 * L * d_q  # QKᵀ and AV: 2·2·d_q·s²/2 forward, x3
    logits = 6 * h * V
    terms = model_flops_breakdown(QWEN3_8B, tokens, sq)
    assert terms == {
        "mlp": mlp * tokens,
        "attention_projections": attn_proj * tokens,
        "core_attention": core * sq,
        "logits": logits * tokens,
    }
    assert model_flops(QWEN3_8B, tokens, sq) == (mlp + attn_proj + logits) * tokens + core * sq
    assert type(model_flops(QWEN3_8B, tokens, sq)) is int


@pytest.mark.parametrize("mbs,seq_len", [(1, 2048), (1, 4096), (2, 8192), (16, 1024)])
def test_dense_equals_megatron_closed_form(mbs, seq_len):
    assert model_flops(QWEN3_8B, mbs * seq_len, mbs * seq_len**2) == megatron_dense_flops(QWEN3_8B, mbs, seq_len)
    # a transformers config object works as the dict does
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(**{k: v for k, v in QWEN3_8B.items() if k != "model_type"})
    assert model_flops(cfg, mbs * seq_len, mbs * seq_len**2) == megatron_dense_flops(QWEN3_8B, mbs, seq_len)


def test_overcount_grows_with_pack_length_while_the_real_count_is_flat():
    """The same samples planned at pack length 2048 and 4096: the real counts are identical,
    the pack-length count grows with the pack length."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.5, 0.9, 20000), 16, 2048).astype(np.int64)
    p2, p4 = thdpack.plan_packs(lengths, 2048), thdpack.plan_packs(lengths, 4096)
    r2 = overcount_report(p2, config=QWEN3_8B)
    r4 = overcount_report(p4, config=QWEN3_8B)
    assert r2["real_tokens"] == r4["real_tokens"] == int(lengths.sum())
    assert r2["seqlen_squared_sum"] == r4["seqlen_squared_sum"] == brute_square_sum(lengths)
    assert r4["attention"] / r2["attention"] == pytest.approx(4 * len(p4) / len(p2), rel=1e-12)
    assert 1 < r2["model"] < r4["model"] < r4["attention"]
    # charging every sample a whole pack_len sequence (batch size in samples x seq_length)
    real = model_flops(QWEN3_8B, int(lengths.sum()), brute_square_sum(lengths))
    per_sample = model_flops(QWEN3_8B, len(lengths) * 4096, len(lengths) * 4096**2)
    assert r4["n_samples"] == len(lengths)
    assert r4["model_samples_at_pack_len"] == pytest.approx(per_sample / real, rel=1e-12)


def test_qwen3_moe_hand_formula():
    h, L, V = 2048, 48, 151936
    d_q, d_kv = 32 * 128, 4 * 128
    tokens, sq = 50_000, 7_000_000
    moe = 6 * h * 3 * 768 * 8 * L  # 8 routed experts of 768, SwiGLU
    attn_proj = 6 * L * (h * d_q + 2 * h * d_kv + d_q * h)
    core = 6 * L * d_q
    logits = 6 * h * V
    terms = model_flops_breakdown(QWEN3_30B_A3B, tokens, sq)
    assert terms == {"moe": moe * tokens, "attention_projections": attn_proj * tokens,
                     "core_attention": core * sq, "logits": logits * tokens}
    # dense layers (mlp_only_layers) use intermediate_size; decoder_sparse_step skips layers
    cfg = dict(QWEN3_30B_A3B, mlp_only_layers=[0, 1, 2])
    terms = model_flops_breakdown(cfg, tokens, sq)
    assert terms["mlp"] == 6 * h * 3 * 6144 * 3 * tokens
    assert terms["moe"] == 6 * h * 3 * 768 * 8 * 45 * tokens
    cfg = dict(QWEN3_30B_A3B, decoder_sparse_step=2)  # layers 1, 3, 5, ... have experts
    terms = model_flops_breakdown(cfg, tokens, sq)
    assert terms["moe"] == 6 * h * 3 * 768 * 8 * 24 * tokens and terms["mlp"] == 6 * h * 3 * 6144 * 24 * tokens
    # shared experts (Qwen2-MoE style) add e·h·shared per MoE layer
    cfg = dict(QWEN3_30B_A3B, shared_expert_intermediate_size=5632)
    assert model_flops_breakdown(cfg, tokens, sq)["moe"] == 6 * h * 3 * (768 * 8 + 5632) * L * tokens


def test_qwen3_next_hybrid_hand_formula():
    h, L, V = 2048, 48, 151936
    n_full, n_lin = 12, 36  # full_attention_interval 4: layers 3, 7, ..., 47
    d_q, d_kv = 16 * 256, 2 * 256
    gate = d_q  # q_proj emits query and output gate
    dk, dv, nv, dhv = 16 * 128, 32 * 128, 32, 128
    tokens, sq = 65_536, 400_000_000
    attn_proj = 6 * n_full * (h * (d_q + gate) + 2 * h * d_kv + d_q * h)
    core = 6 * n_full * d_q
    # Megatron-LM's gdn_layer_flops (forward, per token) times 3 for training
    gdn_fwd = 2 * (h * (2 * dk + 2 * dv + 2 * nv) + 4 * (2 * dk + dv) + nv * dhv**2 * 4 + h * dv)
    linear = 3 * gdn_fwd * n_lin
    moe = 6 * h * 3 * (512 * 10 + 512) * L
    logits = 6 * h * V
    expected = {
        "moe": moe * tokens,
        "attention_projections": attn_proj * tokens,
        "core_attention": core * sq,
        "linear_attention": linear * tokens,
        "logits": logits * tokens,
    }
    assert model_flops_breakdown(QWEN3_NEXT_80B_A3B, tokens, sq) == expected
    # linear-attention layers add nothing per Σ sᵢ²: only the 12 full-attention layers do
    assert flops_coefficients(QWEN3_NEXT_80B_A3B).per("seqlen_squared_sum") == 6 * d_q * 12
    # Qwen3.5 style: explicit layer_types inside a VL config's text_config, same numbers
    layer_types = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(L)]
    text = {k: v for k, v in QWEN3_NEXT_80B_A3B.items() if k not in ("full_attention_interval", "model_type")}
    qwen35 = {"model_type": "qwen3_5_moe", "text_config": dict(text, model_type="qwen3_5_moe_text", layer_types=layer_types)}
    assert model_flops(qwen35, tokens, sq) == sum(expected.values())
    # without the output gate the projections shrink by 6·h·d_q per full layer
    no_gate = model_flops_breakdown(QWEN3_NEXT_80B_A3B, tokens, sq, attention_output_gate=False)
    assert expected["attention_projections"] - no_gate["attention_projections"] == 6 * n_full * h * d_q * tokens


def test_sliding_window_layers_are_refused():
    cfg = dict(QWEN3_8B, layer_types=["sliding_attention"] * 36)
    with pytest.raises(NotImplementedError, match="sliding"):
        model_flops(cfg, 10, 100)
    # explicit override counts them as full attention if the caller says so
    assert model_flops(cfg, 10, 100, layer_types=["full_attention"] * 36) == model_flops(QWEN3_8B, 10, 100)


def window_square_sum_brute(grid, merge, window):
    """Σ over Qwen2.5-VL windows of patches², by enumerating merge units."""
    total = 0
    for t, h, w in grid:
        counts = {}
        for i in range(h // merge):
            for j in range(w // merge):
                key = (i // window, j // window)
                counts[key] = counts.get(key, 0) + merge * merge
        total += t * sum(c * c for c in counts.values())
    return total


def test_qwen2_5_vl_7b_vision_hand_formula():
    grid = [[1, 34, 52], [2, 16, 24], [1, 8, 8]]  # an image, a 4-frame video, a small image
    v = QWEN2_5_VL_7B["vision_config"]
    w, I, depth, C, T, P, m, out = 1280, 3420, 32, 3, 2, 14, 2, 3584
    patches = 34 * 52 + 2 * 16 * 24 + 8 * 8
    full_sq = (34 * 52) ** 2 + 2 * (16 * 24) ** 2 + (8 * 8) ** 2  # each frame attends on its own
    win_sq = window_square_sum_brute(grid, m, 112 // m // 14)
    stats = vision_seqlen_stats(torch.tensor(grid), QWEN2_5_VL_7B)
    assert (stats.patches, stats.seqlen_squared_sum, stats.window_seqlen_squared_sum) == (patches, full_sq, win_sq)
    assert vision_seqlen_stats(grid, v) == stats  # the vision sub-config works too

    pytest.importorskip("transformers")
    vision_utils = pytest.importorskip("transformers.vision_utils")
    _, cu_win = vision_utils.get_vision_window_index(torch.tensor(grid), m, 112, 14)
    win = (cu_win[1:] - cu_win[:-1]).to(torch.int64)
    assert int((win * win).sum()) == win_sq  # transformers' own window layout

    merged = patches // (m * m)
    H = w * m * m
    expected = {
        "vision_patch_embed": 3 * 2 * (C * T * P * P) * w * patches,  # Conv3d as a GEMM per patch
        "vision_blocks": 3 * 2 * depth * (w * 3 * w + w * w + 3 * w * I) * patches,  # qkv, proj, gated MLP
        "vision_attention": 3 * 4 * w * 4 * full_sq,  # 4 full blocks, bidirectional QKᵀ + AV
        "vision_window_attention": 3 * 4 * w * 28 * win_sq,  # 28 window blocks
        "vision_merger": 3 * 2 * (H * H + H * out) * merged,  # two GEMMs per merged token
    }
    tokens, sq = 6000, 9_000_000
    text = model_flops_breakdown(QWEN2_5_VL_7B, tokens, sq)
    assert not any(k.startswith("vision") for k in text)
    h, L, d_q, d_kv = 3584, 28, 28 * 128, 4 * 128
    assert text["attention_projections"] == 6 * L * (h * d_q + 2 * h * d_kv + d_q * h) * tokens
    assert text["mlp"] == 6 * h * 3 * 18944 * L * tokens
    full = model_flops_breakdown(QWEN2_5_VL_7B, tokens, sq, vision_grid_thw=grid)
    assert {k: full[k] for k in expected} == expected
    assert model_flops(QWEN2_5_VL_7B, tokens, sq, vision_patches=patches, vision_seqlen_squared_sum=full_sq,
                       vision_window_seqlen_squared_sum=win_sq) == sum(text.values()) + sum(expected.values())
    frozen = model_flops_breakdown(QWEN2_5_VL_7B, tokens, sq, vision_grid_thw=grid, vision_backward=False)
    assert all(frozen[k] * 3 == expected[k] for k in expected)
    with pytest.raises(ValueError, match="vision_window_seqlen_squared_sum"):
        model_flops(QWEN2_5_VL_7B, tokens, sq, vision_patches=patches, vision_seqlen_squared_sum=full_sq)


def test_qwen3_vl_vision_deepstack_and_no_windows():
    cfg = {
        "model_type": "qwen3_vl",
        "text_config": dict(QWEN3_8B, model_type="qwen3_vl_text"),
        "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                          "in_channels": 3, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
                          "out_hidden_size": 4096, "hidden_act": "gelu_pytorch_tanh",
                          "deepstack_visual_indexes": [8, 16, 24]},
    }
    grid = [[1, 32, 48]]
    n = 32 * 48
    w, I, out = 1152, 4304, 4096
    terms = model_flops_breakdown(cfg, 100, 10_000, vision_grid_thw=grid)
    assert terms["vision_blocks"] == 6 * 27 * (4 * w * w + 2 * w * I) * n  # plain 2-GEMM MLP
    assert terms["vision_attention"] == 12 * w * 27 * n * n
    assert terms["vision_merger"] == 4 * 6 * (4 * w * 4 * w + 4 * w * out) * (n // 4)  # merger + 3 deepstack
    assert terms["vision_patch_embed"] == 6 * 3 * 2 * 16 * 16 * w * n
    assert "vision_window_attention" not in terms


# =========================================================================== CP and DP


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_shards_count_each_sample_once(cp):
    lengths = [37, 4, 129, 64, 1, 250]
    batch = build_thd_batch(make_samples(lengths, seed=cp), cp_size=cp)
    whole = FlopsAccumulator().add(batch)
    shards = [thdpack.shard(batch, cp_size=cp, cp_rank=r) for r in range(cp)]
    per_rank = [FlopsAccumulator().add(s) for s in shards]
    total = FlopsAccumulator()
    for acc in per_rank:
        total.merge(acc)
    assert total.counts() == whole.counts()
    assert whole.seqlen_squared_sum == brute_square_sum(lengths) and whole.tokens == sum(lengths)
    assert sum(a.seqlen_squared_sum for a in per_rank) != cp * whole.seqlen_squared_sum  # not once per rank
    flops = [a.model_flops(QWEN3_8B) for a in per_rank]
    assert sum(flops) == whole.model_flops(QWEN3_8B)
    # each rank's Σ share is the causal work of the real tokens it holds: position q costs 2q+1
    seq = batch.seq_lens.tolist()
    starts = batch.cu_seqlens_padded[:-1].tolist()
    for shard, acc in zip(shards, per_rank):
        brute = 0
        for p in shard.shard.partition_indices.tolist():
            i = max(k for k in range(len(starts)) if starts[k] <= p)
            q = p - starts[i]
            if q < seq[i]:
                brute += 2 * q + 1
        assert acc.seqlen_squared_sum == brute
        assert acc.tokens == int(shard.shard.local_seq_lens.sum())


def test_vision_counted_once_per_sample_across_cp_ranks():
    batch = build_thd_batch(make_samples([40, 90, 12]), cp_size=2)
    grid = torch.tensor([[1, 34, 52], [2, 16, 24]])
    batch.extras["image_grid_thw"] = grid[:1]
    batch.extras["video_grid_thw"] = grid[1:]
    batch.extras["pixel_values"] = None
    whole = FlopsAccumulator(QWEN2_5_VL_7B).add(batch)
    stats = vision_seqlen_stats(grid, QWEN2_5_VL_7B)
    assert (whole.vision_patches, whole.vision_seqlen_squared_sum, whole.vision_window_seqlen_squared_sum) == (
        stats.patches, stats.seqlen_squared_sum, stats.window_seqlen_squared_sum)
    ranks = [FlopsAccumulator(QWEN2_5_VL_7B).add(thdpack.shard(batch, cp_size=2, cp_rank=r)) for r in range(2)]
    assert [r.vision_patches for r in ranks] == [stats.patches, 0]
    assert ranks[0].merge(ranks[1]).counts() == whole.counts()
    assert whole.model_flops(QWEN2_5_VL_7B) == model_flops(QWEN2_5_VL_7B, 142, 40**2 + 90**2 + 12**2, vision_grid_thw=grid)


def _dp_worker(rank, world, init_file, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        acc = FlopsAccumulator()
        acc.add(build_thd_batch(make_samples([10 + rank, 20 * (rank + 1)], seed=rank)))
        acc.all_reduce()
        meter = FlopsMeter(QWEN3_8B, peak_tflops=100.0)
        assert meter.all_reduce and meter.world_size == world
        meter.update(build_thd_batch(make_samples([10 + rank, 20 * (rank + 1)], seed=rank)))
        record = meter.step(2.0)
        results[rank] = (acc.counts(), record["model_flops"], record["tflops_per_gpu"])
    finally:
        dist.destroy_process_group()


def test_all_reduce_over_data_parallel_ranks(tmp_path):
    import torch.multiprocessing as mp

    world = 2
    manager = mp.Manager()
    results = manager.dict()
    mp.start_processes(_dp_worker, args=(world, str(tmp_path / "init"), results), nprocs=world, join=True,
                       start_method="fork")
    lens = [[10 + r, 20 * (r + 1)] for r in range(world)]
    expected_sq = sum(brute_square_sum(x) for x in lens)
    expected_tokens = sum(sum(x) for x in lens)
    flops = model_flops(QWEN3_8B, expected_tokens, expected_sq)
    for r in range(world):
        counts, rec_flops, tflops = results[r]
        assert counts["seqlen_squared_sum"] == expected_sq and counts["tokens"] == expected_tokens
        assert rec_flops == flops
        assert tflops == pytest.approx(flops / 2.0 / world / 1e12, rel=1e-12)


# =========================================================================== accumulator inputs


def test_accumulator_reads_model_input_dicts():
    real = [100, 37, 0, 255]
    padded = [104, 40, 0, 256]
    nemo = {
        "cu_seqlens": torch.tensor([cumulative(padded) + [-1, -1]], dtype=torch.int32),
        "cu_seqlens_argmin": torch.tensor([[5]]),
        "cu_seqlens_unpadded": torch.tensor([cumulative(real) + [-1]], dtype=torch.int32),
        "cu_seqlens_unpadded_argmin": torch.tensor([[5]]),
    }
    acc = FlopsAccumulator().add(nemo)
    assert acc.counts()["seqlen_squared_sum"] == brute_square_sum(real)
    assert acc.tokens == sum(real) and acc.padded_tokens == sum(padded) and acc.samples == 3

    batch = build_thd_batch(make_samples(real[:2] + real[3:]))
    hf = to_hf_kwargs(batch)
    assert FlopsAccumulator().add(hf).counts() == FlopsAccumulator().add(batch).counts()
    # transformers' DataCollatorWithFlattening without flash kwargs: positions restart per sample
    flat = {"input_ids": batch.input_ids.unsqueeze(0), "position_ids": batch.position_ids.unsqueeze(0)}
    assert FlopsAccumulator().add(flat).seqlen_squared_sum == seqlen_squared_sum(batch)
    # 4-row mRoPE (text row first)
    mrope = torch.cat([batch.position_ids.view(1, 1, -1), torch.zeros(3, 1, batch.num_padded_tokens, dtype=torch.long)])
    with_mrope = {"input_ids": flat["input_ids"], "position_ids": mrope}
    assert FlopsAccumulator().add(with_mrope).seqlen_squared_sum == seqlen_squared_sum(batch)
    # vision grids in the inputs
    vl = dict(hf, image_grid_thw=torch.tensor([[1, 34, 52]]), video_grid_thw=torch.tensor([[2, 16, 24]]))
    acc = FlopsAccumulator(QWEN2_5_VL_7B).add(vl)
    stats = vision_seqlen_stats([[1, 34, 52], [2, 16, 24]], QWEN2_5_VL_7B)
    assert (acc.vision_patches, acc.vision_seqlen_squared_sum, acc.vision_window_seqlen_squared_sum) == (
        stats.patches, stats.seqlen_squared_sum, stats.window_seqlen_squared_sum)
    assert acc.model_flops(QWEN2_5_VL_7B) == model_flops(
        QWEN2_5_VL_7B, batch.num_tokens, seqlen_squared_sum(batch), vision_grid_thw=[[1, 34, 52], [2, 16, 24]])
    # without the vision config the window sums are unknown: refuse rather than undercount
    with pytest.raises(ValueError, match="window"):
        FlopsAccumulator().add(vl).model_flops(QWEN2_5_VL_7B)
    with pytest.raises(TypeError):
        FlopsAccumulator().add(3.5)


def test_count_padding_charges_linear_terms_for_pad_slots():
    batch = build_thd_batch(make_samples([13, 30, 7]), pad_multiple=16)
    acc = FlopsAccumulator().add(batch)
    assert acc.padded_tokens == 16 + 32 + 16 and acc.tokens == 50
    per_token = flops_coefficients(QWEN3_8B).per("tokens")
    assert acc.model_flops(QWEN3_8B, count_padding=True) - acc.model_flops(QWEN3_8B) == per_token * (64 - 50)


# =========================================================================== throughput and meter


def test_throughput_and_peak_table():
    out = throughput(989e12 * 4 * 0.5, seconds=1.0, world_size=4, peak_tflops="H100")
    assert out["tflops_per_gpu"] == pytest.approx(494.5) and out["mfu"] == pytest.approx(0.5)
    assert throughput(3e15, 2.0, 8, peak_tflops=312.0)["tflops_per_gpu"] == pytest.approx(187.5)
    assert peak_tflops_for("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops_for("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops_for("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops_for("NVIDIA H200") == 989.0
    assert peak_tflops_for("NVIDIA GH200 480GB") == GPU_PEAK_TFLOPS["GH200"]
    assert peak_tflops_for("NVIDIA B200") == 2250.0
    assert peak_tflops_for("NVIDIA GB200") == 2500.0
    assert peak_tflops_for("Some Other Accelerator") is None
    if not torch.cuda.is_available():  # no GPU to detect: no MFU, TFLOP/s still reported
        assert throughput(1e12, 1.0, 1) == {"tflops_per_gpu": 1.0, "mfu": None, "peak_tflops": None}
    with pytest.raises(ValueError, match=r"^peak_tflops must be a positive number or a known GPU name \(A100, .*\), "
                                         r"got unknown GPU 'NoSuchGPU'$"):
        throughput(1.0, 1.0, 1, peak_tflops="NoSuchGPU")
    with pytest.raises(ValueError):
        throughput(1.0, 0.0, 1)


def test_flops_meter_plain_loop():
    meter = FlopsMeter(QWEN3_8B, peak_tflops=989.0)
    assert meter.world_size == 1 and not meter.all_reduce
    steps = [[[300, 20], [512]], [[4096]]]  # step 1: two micro-batches
    for i, micro_batches in enumerate(steps):
        for lens in micro_batches:
            meter.update(build_thd_batch(make_samples(lens, seed=i)))
        record = meter.step(0.25)
        flat = [n for lens in micro_batches for n in lens]
        flops = model_flops(QWEN3_8B, sum(flat), brute_square_sum(flat))
        assert record["model_flops"] == flops and record["tokens"] == sum(flat)
        assert record["tflops_per_gpu"] == pytest.approx(flops / 0.25 / 1e12, rel=1e-12)
        assert record["mfu"] == pytest.approx(record["tflops_per_gpu"] / 989.0, rel=1e-12)
    summary = meter.summary()
    assert summary["steps"] == 2 and summary["seconds"] == 0.5
    assert summary["model_flops"] == sum(r["model_flops"] for r in meter.history)
    assert meter.accumulator.counts()["tokens"] == 0  # reset after each step


def test_overcount_report_for_a_plan():
    lengths = np.array([128] * 32 + [1000, 3000, 96])
    plan = thdpack.plan_packs(lengths, 4096)
    report = overcount_report(plan, config=QWEN3_8B)
    sq = brute_square_sum(lengths)
    assert report["seqlen_squared_sum"] == sq and report["n_packs"] == len(plan)
    assert report["attention"] == pytest.approx(len(plan) * 4096**2 / sq)
    claimed = model_flops(QWEN3_8B, len(plan) * 4096, len(plan) * 4096**2)
    assert report["model"] == pytest.approx(claimed / model_flops(QWEN3_8B, int(lengths.sum()), sq))
    assert report["model"] == pytest.approx(model_overcount_factor(QWEN3_8B, len(plan), 4096, int(lengths.sum()), sq))
    by_lengths = overcount_report(pack_lengths=[plan.pack_lengths(k) for k in range(len(plan))], pack_len=4096)
    assert by_lengths["attention"] == report["attention"]


def test_core_imports_no_transformers():
    code = "import sys, thdpack, thdpack.flops, thdpack.integrations; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))


# =========================================================================== transformers Trainer callback


def _tiny_qwen3(vocab):
    from thdpack.demo.models import tiny_qwen3

    model = tiny_qwen3(vocab, max_position_embeddings=1024, seed=0)
    model.config.use_cache = False
    return model


def _train(tmp_path, with_callback: bool):
    transformers = pytest.importorskip("transformers")
    from thdpack.integrations.hf_trainer import FlopsCallback, hf_collator

    vocab = 128
    rng = np.random.default_rng(7)
    packs = [{"samples": make_samples(rng.integers(5, 120, size=k), seed=k, vocab=vocab)} for k in (2, 5, 3, 4, 6, 1)]
    seen = []
    collate_pack = hf_collator(thdpack.ThdCollator())

    def collate(items):
        assert len(items) == 1
        batch = build_thd_batch(items[0]["samples"])
        seen.append((batch.num_tokens, seqlen_squared_sum(batch)))
        return collate_pack(items[0]["samples"])

    model = _tiny_qwen3(vocab)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("cb" if with_callback else "plain")), per_device_train_batch_size=1, max_steps=3,
        logging_steps=1, learning_rate=1e-3, report_to="none", save_strategy="no", use_cpu=True,
        dataloader_num_workers=0, seed=0, disable_tqdm=True, remove_unused_columns=False,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=packs, data_collator=collate)
    callback = FlopsCallback(peak_tflops=1.0).attach(trainer) if with_callback else None
    trainer.train()
    return trainer, callback, seen, model


def test_hf_trainer_callback_logs_model_flops_of_the_batches(tmp_path):
    trainer, callback, seen, model = _train(tmp_path, with_callback=True)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logs] == [1, 2, 3]
    assert len(callback.history) == 3
    for entry, record, (tokens, sq) in zip(logs, callback.history, seen[:3]):
        expected = model_flops(model.config, tokens, sq)
        assert entry["model_flops"] == expected == record["model_flops"]
        assert record["tokens"] == tokens and record["seqlen_squared_sum"] == sq
        assert entry["tflops_per_gpu"] == pytest.approx(expected / record["seconds"] / 1e12, rel=1e-12)
        assert entry["mfu"] == pytest.approx(entry["tflops_per_gpu"] / 1.0, rel=1e-12)
    assert len({sq for _, sq in seen[:3]}) == 3  # the three steps differ, so a mix-up would show

    # the callback does not change training: same losses and weights as a run without it
    plain, _, seen_plain, plain_model = _train(tmp_path, with_callback=False)
    assert seen_plain[:3] == seen[:3]
    assert [e["loss"] for e in plain.state.log_history if "loss" in e] == [e["loss"] for e in logs]
    for (name, p), (_, q) in zip(model.named_parameters(), plain_model.named_parameters()):
        assert torch.equal(p, q), name
    assert plain.state.total_flos == trainer.state.total_flos
