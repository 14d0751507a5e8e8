"""thdpack.flops for every layer kind the field trains (issue 36): Megatron-Bridge's published formulas and
worked values (``tests/unit_tests/training/utils/test_flop_utils.py`` in NVIDIA-NeMo/Megatron-Bridge) on
Megatron-style configs; transformers configs read layer by layer (sliding windows, MLA with and without
``q_lora_rank`` and MoE, DeepSeek sparse attention, Kimi delta attention, Mamba-2 hybrids, Qwen-Omni's
thinker); tiny random-weight transformers models counted by ``torch.utils.flop_counter.FlopCounterMode``,
whose GEMMs equal the counted GEMM terms to the last digit; and a one-line refusal for a kind not covered."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from thdpack.flops import (UnsupportedLayerError, count_name, flops_coefficients, length_count, model_flops,
                           model_flops_breakdown)

sys.path.insert(0, str(Path(__file__).resolve().parent))

# A Megatron-style config (Megatron-core TransformerConfig field names), as Megatron-Bridge's tests build one.
MEGATRON = dict(num_layers=4, hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=8, num_query_groups=4,
                kv_channels=128, vocab_size=32000, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1,
                gated_linear_unit=False)
MLA = dict(MEGATRON, num_layers=2, hidden_size=256, ffn_hidden_size=512, num_query_groups=8, kv_channels=32,
           multi_latent_attention=True, q_lora_rank=64, kv_lora_rank=32, qk_head_dim=32, qk_pos_emb_head_dim=16,
           v_head_dim=32)
DSA_TOY = dict(num_layers=1, hidden_size=8, ffn_hidden_size=0, num_attention_heads=2, num_query_groups=2, kv_channels=4,
               vocab_size=128, make_vocab_size_divisible_by=1, gated_linear_unit=False, multi_latent_attention=True,
               experimental_attention_variant="dsa", q_lora_rank=4, kv_lora_rank=3, qk_head_dim=2,
               qk_pos_emb_head_dim=1, v_head_dim=2, dsa_indexer_n_heads=2, dsa_indexer_head_dim=2, dsa_indexer_topk=2,
               dsa_indexer_loss_coeff=0.001, dsa_indexer_use_sparse_loss=True)


def megatron(cfg: dict, batch: int, seq: int):
    """Training FLOPs of ``batch`` sequences of ``seq`` tokens, every count exact (``seq_lens``)."""
    return model_flops(cfg, batch * seq, batch * seq * seq, seq_lens=[seq] * batch)


# =========================================================================== Megatron-Bridge worked values


def test_dsa_toy_worked_values():
    # S=4, top-k 2: each query keeps [1, 2, 2, 2] keys, the indexer scores [1, 2, 3, 4]. Per token: MLA
    # projections 906, sparse QK+AV 147, indexer projections (forward + wgrad) 192, index scores 72,
    # detached teacher 28, logits 6144.
    assert megatron(DSA_TOY, 1, 4) == 4 * (906 + 147 + 192 + 72 + 28 + 6144)
    assert megatron(DSA_TOY, 1, 8) == 60_228
    assert megatron(dict(DSA_TOY, dsa_indexer_topk=4), 1, 4) - megatron(DSA_TOY, 1, 4) == 372
    # index sharing: full layers [1..6], [1, 2, 3], [1, 5]; 192 + 72 + 28 = 292 a full layer and token
    share = {f: megatron(dict(DSA_TOY, num_layers=6, dsa_indexer_topk_freq=f[0], dsa_indexer_skip_topk_offset=f[1]), 1, 4)
             for f in ((1, 0), (4, 3), (4, 1))}
    assert share[(1, 0)] - share[(4, 3)] == 3 * 4 * 292 and share[(4, 3)] - share[(4, 1)] == 4 * 292
    assert megatron(DSA_TOY, 1, 4) - megatron(dict(DSA_TOY, dsa_indexer_loss_coeff=0.0), 1, 4) == 4 * (96 + 42 + 28)
    # MTP depth 1 is one more DSA layer (its own numbering), MTP norms and projection, logits
    assert megatron(dict(DSA_TOY, mtp_num_layers=1), 1, 4) - megatron(DSA_TOY, 1, 4) == 4 * (1345 + 912 + 6144)


def test_sliding_window_worked_values():
    full = megatron(MEGATRON, 1, 4096)
    swa = megatron(dict(MEGATRON, window_size=(511, 0), window_attn_skip_freq=2), 1, 4096)
    w, T, d_q = 512, 4096, 8 * 128  # layers 1 and 3 of 4 use the window
    pairs = w * (w + 1) // 2 + (T - w) * w  # query t sees min(t, w) keys
    assert full - swa == 6 * 2 * d_q * (T * T - 2 * pairs)
    # a window no shorter than the sequence is full attention
    assert megatron(dict(MEGATRON, window_size=(512, 0), window_attn_skip_freq=2), 1, 512) == megatron(MEGATRON, 1, 512)
    # [1, 1, 0, 1] and every 4th layer full: the same 3 window layers
    assert (megatron(dict(MEGATRON, window_size=(511, 0), window_attn_skip_freq=[1, 1, 0, 1]), 1, 4096)
            == megatron(dict(MEGATRON, window_size=(511, 0), window_attn_skip_freq=4), 1, 4096))
    assert megatron(dict(MEGATRON, window_size=(511, 0)), 1, 4096) < swa  # every layer windowed


@pytest.mark.parametrize("q_lora", [64, None])
def test_mla_closed_form(q_lora):
    h, n, s, kv, dqk, rope, dv = 256, 8, 128, 32, 32, 16, 32
    q_term = q_lora * (h + n * (dqk + rope) + 1) if q_lora else h * n * (dqk + rope)
    inner = (q_term + kv * (h + n * (dqk + dv) + 1) + h * rope + n * dv * h
             + s * n * (dqk + rope) / 2 + s * n * dv / 2)
    expected = s * (6 * 2 * inner + 6 * h * 512 * 2 * 2 + 6 * h * 32000)
    assert megatron(dict(MLA, q_lora_rank=q_lora), 1, s) == expected
    # with experts (DeepSeek-V3 shape): the attention is the same, the MLPs become MoE
    moe = dict(MLA, q_lora_rank=q_lora, num_moe_experts=8, moe_layer_freq=1, moe_router_topk=2, moe_ffn_hidden_size=512,
               moe_shared_expert_intermediate_size=0)
    assert megatron(moe, 1, s) - megatron(dict(MLA, q_lora_rank=q_lora), 1, s) == s * 6 * h * 2 * (512 * 2 - 512) * 2


def test_kimi_delta_attention_and_mtp_follow_the_last_layer():
    cfg = dict(MLA, num_layers=4, kimi_linear_num_heads=8, kimi_linear_head_dim=32, kimi_linear_conv_kernel_size=4)
    h, P, d, n = 256, 8 * 32, 32, 8
    kda = 6 * (5 * h * P + h * n + h * d + d * P + 4 * 3 * P + 4 * n * d * d)
    s = 128
    mla_layer = (megatron(dict(MLA, num_layers=4), 1, s) - megatron(dict(MLA, num_layers=3), 1, s))
    mlp = 6 * h * 512 * 2 * s
    assert megatron(dict(cfg, kimi_kda_layers=(1, 3)), 1, s) == pytest.approx(
        megatron(cfg, 1, s) - 2 * mla_layer + 2 * (kda * s + mlp), rel=1e-15)
    assert megatron(dict(cfg, kimi_kda_layers=(1, 2, 3, 4)), 1, 256) == 2 * megatron(
        dict(cfg, kimi_kda_layers=(1, 2, 3, 4)), 1, 128)  # linear in the sequence length
    assert (megatron(dict(cfg, kimi_kda_layers=(1, 4), mtp_num_layers=1), 1, s)
            != megatron(dict(cfg, kimi_kda_layers=(1, 2), mtp_num_layers=1), 1, s))
    with pytest.raises(ValueError, match="kimi_kda_layers contains layer numbers outside"):
        megatron(dict(cfg, kimi_kda_layers=(0, 1)), 1, s)


@pytest.mark.parametrize("freq,last_is_gdn", [(4, False), ([1, 1, 1, 0], False), (3, True), ([1, 1, 0, 1], True)])
def test_gdn_mtp_reuses_the_last_decoder_layer(freq, last_is_gdn):
    h, s, ffn, vocab, n, g, kv = 128, 32, 256, 1024, 4, 2, 32
    cfg = dict(num_layers=4, hidden_size=h, ffn_hidden_size=ffn, num_attention_heads=n, num_query_groups=g,
               kv_channels=kv, vocab_size=vocab, gated_linear_unit=False, experimental_attention_variant="gdn",
               linear_attention_freq=freq, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=4,
               linear_num_value_heads=8, linear_conv_kernel_dim=4)
    qk, v = 16 * 4, 16 * 8
    gdn = 6 * (h * (2 * qk + 2 * v + 2 * 8) + 4 * (2 * qk + v) + 8 * 16 * 16 * 4 + h * v)
    attention = 6 * (h * (n * kv + 2 * g * kv) + n * kv * h + n * kv * s)
    per_depth = 6 * h * ffn * 2 + (gdn if last_is_gdn else attention) + 6 * (3 * h + 2 * h * h) + 6 * h * vocab
    assert megatron(dict(cfg, mtp_num_layers=2), 1, s) - megatron(cfg, 1, s) == s * 2 * per_depth
    # gdn2's input projection is q, k, v, z, f, b, w
    assert megatron(dict(cfg, experimental_attention_variant="gdn2"), 1, s) > megatron(cfg, 1, s)


def test_moe_latent_and_hybrid_patterns():
    h, s, moe_ffn, latent = 2048, 1024, 4096, 512
    hybrid = dict(MEGATRON, hybrid_layer_pattern="E", num_layers=1, hidden_size=h, moe_ffn_hidden_size=moe_ffn,
                  moe_shared_expert_intermediate_size=0, moe_router_topk=1, moe_latent_size=latent)
    logit = 2 * s * h * 32000
    assert megatron(hybrid, 1, s) == (4 * s * latent * moe_ffn + 4 * s * h * latent + logit) * 3
    assert megatron(dict(hybrid, moe_latent_size=None), 1, s) == (4 * s * h * moe_ffn + logit) * 3
    # one symbol a layer: Mamba-2 in_proj / scan estimate / out_proj (d_inner = 2h), attention, MLP, MoE
    cfg = dict(MEGATRON, hybrid_layer_pattern="M-*E", hidden_size=1024, moe_ffn_hidden_size=2048,
               moe_shared_expert_intermediate_size=1024, moe_router_topk=1, mamba_state_dim=64, mamba_head_dim=32,
               mamba_num_groups=4, mamba_num_heads=64)
    H, S, d_in = 1024, 512, 2048
    mamba = 2 * H * (2 * d_in + 2 * 4 * 64 + 64) + 7 * d_in * 64 + 2 * d_in * H
    attention = 4 * H * 1024 * (H + H * 4 / 8) / H + 2 * 1024 * S
    mlp, moe = 4 * 4 * H * H, 4 * H * 2048 + 4 * H * 1024
    assert megatron(cfg, 1, S) == S * 3 * (mamba + attention + mlp + moe + 2 * H * 32000)
    # MTP depths after '/': their layers and one more logits GEMM each
    mtp = dict(MEGATRON, hybrid_layer_pattern="M*/MM/MM", num_layers=2, mamba_num_heads=16)
    terms = model_flops_breakdown(mtp, 256, 256 * 256)
    assert terms["logits"] == 6 * 1024 * 32000 * 3 * 256
    assert flops_coefficients(mtp).terms["mamba"][1] == 5 * flops_coefficients(
        dict(mtp, hybrid_layer_pattern="M")).terms["mamba"][1]


def test_transformers_and_megatron_configs_of_one_mla_model_agree():
    hf = {"model_type": "deepseek_v3", "hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 8,
          "num_key_value_heads": 8, "intermediate_size": 512, "moe_intermediate_size": 128, "n_routed_experts": 8,
          "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "vocab_size": 1024,
          "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32}
    mcore = dict(num_layers=3, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8, vocab_size=1024,
                 make_vocab_size_divisible_by=1, gated_linear_unit=True, multi_latent_attention=True, q_lora_rank=64,
                 kv_lora_rank=32, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=32, num_moe_experts=8,
                 moe_layer_freq=[0, 1, 1], moe_router_topk=2, moe_ffn_hidden_size=128,
                 moe_shared_expert_intermediate_size=128)
    lens = [100, 7, 300]
    counts = (sum(lens), sum(s * s for s in lens))
    assert model_flops_breakdown(hf, *counts) == model_flops_breakdown(mcore, *counts)
    # DeepSeek sparse attention, transformers' form (deepseek_v32: every indexed layer scores its own top-k)
    dsa = dict(hf, model_type="deepseek_v32", layer_types=["indexed_attention"] * 3, index_n_heads=4,
               index_head_dim=16, index_topk=64)
    terms = model_flops_breakdown(dsa, *counts, seq_lens=lens)
    pairs64 = sum(min(t, 64) for s in lens for t in range(1, s + 1))
    assert terms["sparse_attention_64"] == 3 * 6 * 8 * (32 + 16 + 32) * pairs64
    assert terms["indexer_scores"] == 3 * 2 * 4 * 17 * sum(s * (s + 1) // 2 for s in lens)
    assert terms["indexer_projections"] == 3 * 2 * (64 * 4 * 16 + 256 * 16 + 256 * 4) * sum(lens)


# =========================================================================== transformers configs


def test_sliding_window_layers_from_transformers_configs():
    base = {"hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "intermediate_size": 128, "vocab_size": 100, "sliding_window": 32}

    def windowed(cfg):
        coefficients = flops_coefficients(cfg).terms
        full = coefficients.get("core_attention", (None, 0))[1] // (6 * 64)
        return full, coefficients.get("sliding_attention_32", (None, 0))[1] // (6 * 64)

    assert windowed(dict(base, model_type="mistral")) == (0, 6)  # every layer
    assert windowed(dict(base, model_type="gemma2")) == (3, 3)  # Gemma 2 alternates
    assert windowed(dict(base, model_type="gemma3_text")) == (1, 5)  # Gemma 3: 5 local, 1 global
    assert windowed(dict(base, model_type="gemma3_text", sliding_window_pattern=3)) == (2, 4)
    qwen2 = dict(base, model_type="qwen2", max_window_layers=2)
    assert windowed(dict(qwen2, use_sliding_window=False)) == (6, 0)
    assert windowed(dict(qwen2, use_sliding_window=True)) == (2, 4)  # layers >= max_window_layers
    gpt_oss = dict(base, model_type="gpt_oss", layer_types=["sliding_attention", "full_attention"] * 3)
    assert windowed(gpt_oss) == (3, 3)
    # Megatron's window_size (511, 0) and transformers' sliding_window 512 are the same window
    name = count_name("window_square_sum", 512)
    mcore = dict(MEGATRON, window_size=(511, 0))
    assert flops_coefficients(mcore).length_counts == (name,)


def test_qwen_omni_thinker_is_counted_as_its_text_model_and_vision_tower():
    text = {"model_type": "qwen2_5_omni_text", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100}
    vision = {"model_type": "qwen2_5_omni_vision_encoder", "depth": 4, "hidden_size": 32, "intermediate_size": 48,
              "num_heads": 2, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "window_size": 112, "out_hidden_size": 64, "fullatt_block_indexes": [3], "hidden_act": "silu"}
    omni = {"model_type": "qwen2_5_omni", "thinker_config": {"model_type": "qwen2_5_omni_thinker",
                                                             "text_config": text, "vision_config": vision}}
    vl = {"model_type": "qwen2_5_vl", "text_config": dict(text, model_type="qwen2_5_vl_text"), "vision_config": vision}
    grid = [[1, 16, 24], [2, 8, 8]]
    assert model_flops(omni, 500, 90_000, vision_grid_thw=grid) == model_flops(vl, 500, 90_000, vision_grid_thw=grid)
    assert model_flops(omni, 500, 90_000) == model_flops(text, 500, 90_000)


@pytest.mark.parametrize("cfg,kind", [
    ({"layer_types": ["conv", "full_attention"]}, "'conv'"),
    ({"layer_types": ["hybrid", "hybrid"], "model_type": "falcon_h1"}, "'hybrid'"),
    ({"layer_types": ["chunked_attention"] * 2}, "'chunked_attention'"),
    ({"model_type": "jamba", "layer_types": ["linear_attention", "full_attention"]}, "'linear_attention' of model_type jamba"),
    ({"model_type": "jamba", "mamba_d_state": 16, "mamba_expand": 2}, "model_type jamba has non-attention layers"),
    ({"model_type": "deepseek_v4"}, "DeepSeek-V4"),
    ({"model_type": "llama4_text", "attention_chunk_size": 8192}, "chunked_attention"),
    ({"model_type": "whisper", "is_encoder_decoder": True}, "encoder-decoder"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True, "sliding_window": 8}, "bidirectional"),
    ({"layer_types": ["sliding_attention"] * 2}, "sliding_window"),
    ({"mlp_layer_types": ["hash_moe", "moe"], "num_experts": 4, "num_experts_per_tok": 2}, "hash_moe"),
    (dict(MEGATRON, multi_latent_attention=True, experimental_attention_variant="dsv4_hybrid"), "dsv4_hybrid"),
    (dict(MEGATRON, hybrid_layer_pattern="M*D"), "'D'"),
    (dict(MEGATRON, experimental_attention_variant="mamba"), "'mamba'"),
])
def test_a_kind_not_covered_is_refused_in_one_line_naming_it(cfg, kind):
    text = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128, "vocab_size": 100}
    config = cfg if "num_layers" in cfg else {**text, **cfg}
    with pytest.raises(UnsupportedLayerError) as caught:
        model_flops(config, 100, 5000)
    assert isinstance(caught.value, NotImplementedError)  # never counted as dense attention
    message = str(caught.value)
    assert kind in message and "\n" not in message


# =========================================================================== tiny models, FlopCounterMode

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, max_position_embeddings=512, pad_token_id=0, bos_token_id=None, eos_token_id=None)
MLA_COMMON = dict({k: v for k, v in COMMON.items() if k != "head_dim"}, num_key_value_heads=4, num_hidden_layers=2,
                  kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1,
                  n_group=1, topk_group=1)
# The terms that are GEMMs of nn.Linear layers, which FlopCounterMode sees as aten.mm; core attention, scans,
# convolutions and norms it cannot see or sees otherwise (eager attention computes the masked square too).
GEMM_TERMS = ("attention_projections", "mlp", "moe", "mamba", "logits")


def _tiny_configs():
    transformers = pytest.importorskip("transformers")
    from hybrid_models import _configs

    out = {
        "qwen3": transformers.Qwen3Config(**COMMON, num_hidden_layers=2),
        "gemma3": transformers.Gemma3TextConfig(**COMMON, num_hidden_layers=3, sliding_window=8,
                                                layer_types=["sliding_attention", "sliding_attention",
                                                             "full_attention"]),
        "mistral": transformers.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=8),
        "deepseek_v3": transformers.DeepseekV3Config(**MLA_COMMON, q_lora_rank=16),
        "deepseek_v3_no_q_lora": transformers.DeepseekV3Config(**MLA_COMMON, q_lora_rank=None),
    }
    out["kimi_linear"] = transformers.KimiLinearConfig(  # MLA, and Kimi delta attention with low-rank gates
        **{k: v for k, v in MLA_COMMON.items() if k not in ("n_routed_experts", "num_experts_per_tok", "n_group",
                                                            "topk_group", "n_shared_experts")},
        q_lora_rank=None, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
        linear_attn_config={"kda_layers": [1], "full_attn_layers": [2], "head_dim": 8, "num_heads": 4,
                            "short_conv_kernel_size": 4})
    for family in ("nemotron_h", "bamba", "granitemoehybrid"):  # Mamba-2 hybrids
        config_class, _, kwargs = _configs()[family]
        out[family] = getattr(transformers, config_class)(**kwargs)
    return out


def _routers(config) -> int:
    """Per-token training FLOPs of the MoE routers (``h → experts`` GEMMs), which thdpack does not count."""
    from thdpack.flops.layer_kinds import hf_structure

    layers = hf_structure(config).layers
    experts = (getattr(config, "n_routed_experts", None) or getattr(config, "num_local_experts", None)
               or getattr(config, "num_experts", 0))
    return 6 * config.hidden_size * experts * sum(layer.ffn == "moe" for layer in layers)


def _kda_gemms(config, terms: dict, tokens: int) -> int:
    """The GEMMs of Kimi delta attention layers: their term less the short convolutions and the delta rule
    (``6·(K·3·P + 4·n·d²)`` a token and layer), which are not ``nn.Linear`` GEMMs."""
    if "kimi_linear" not in config.model_type:
        return 0
    n, d, conv = config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim
    layers = config.layer_types.count("linear_attention")
    return terms["linear_attention"] - 6 * (conv * 3 * n * d + 4 * n * d * d) * layers * tokens


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "mistral", "deepseek_v3", "deepseek_v3_no_q_lora", "kimi_linear",
                                  "nemotron_h", "bamba", "granitemoehybrid"])
def test_tiny_models_gemms_equal_the_counted_gemm_terms(name):
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    config = _tiny_configs()[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="eager")
    tokens = 40
    ids = torch.randint(3, config.vocab_size, (1, tokens))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()  # forward and backward: the 6 of training
    seen = counter.get_flop_counts()["Global"]
    terms = model_flops_breakdown(config, tokens, tokens * tokens, seq_lens=[tokens])
    assert model_flops_breakdown(config.to_dict(), tokens, tokens * tokens, seq_lens=[tokens]) == terms  # its dict
    counted = sum(v for k, v in terms.items() if k in GEMM_TERMS) + _kda_gemms(config, terms, tokens)
    assert seen[torch.ops.aten.mm] == counted + _routers(config) * tokens
    assert set(terms) - set(GEMM_TERMS) <= {"core_attention", "sliding_attention_8", "latent_norms", "mamba_scan",
                                            "linear_attention"}


def test_gemma3_window_is_the_keys_its_attention_sees():
    """The window count against the model's own mask: eager attention weights of a tiny Gemma-3 are
    non-zero exactly on the pairs counted (``sliding_window`` 8: a query and the 7 keys before it)."""
    from transformers import AutoModelForCausalLM

    config = _tiny_configs()["gemma3"]
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    for s in (5, 8, 9, 20):
        with torch.no_grad():
            out = model(input_ids=torch.randint(3, 96, (1, s)), output_attentions=True)
        seen = [int((a[0, 0] > 0).sum()) for a in out.attentions]
        window = length_count([s], count_name("causal_pairs", 8))
        assert seen == [window, window, s * (s + 1) // 2]
