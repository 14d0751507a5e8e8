"""thdpack.flops under bad input (issue 43): partial multi-latent attention fields, ``mtp_layers``, MoE
top-k, windows and layer frequencies of Megatron-style configs, ``layer_types`` strings, the accumulator's
config and ``merge`` arguments, cross-attention memories (their unpadded lengths; refused without
cross-attention layers), docs/flops.md's ``count_padding`` example, and attention whose value head dim is
apart from its query / key head dim (MiMo-V2-Flash in transformers and Megatron-Bridge's provider, counted
exactly), and attention sizes the counts do not read (Inkling's swa_*, Gemma 4's global_*, Laguna's and
Step3.7's per-layer heads, KV sharing, a heterogeneous per_layer_config: refused). Each bad input is one clear ``ValueError`` / ``TypeError`` naming the argument or config key; every
other valid input counts as before."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thdpack import build_thd_batch
from thdpack.flops import (FlopsAccumulator, FlopsMeter, count_name, flops_coefficients, length_count, model_flops,
                           model_flops_breakdown)

DOC = Path(__file__).resolve().parents[1] / "docs" / "flops.md"

TEXT = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 100}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 8,
               "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
               "v_head_dim": 32, "intermediate_size": 512, "moe_intermediate_size": 64, "n_routed_experts": 8,
               "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "vocab_size": 1000}
MEGATRON = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2, "kv_channels": 16,
            "ffn_hidden_size": 128, "vocab_size": 100, "make_vocab_size_divisible_by": 1}
MEGATRON_MLA = dict(MEGATRON, multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16,
                    qk_pos_emb_head_dim=8, v_head_dim=16)
MEGATRON_MOE = dict(MEGATRON, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
MLLAMA_TEXT = {"model_type": "mllama_text_model", "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "vocab_size": 96,
               "cross_attention_layers": [1]}

NOT_INTS = st.one_of(st.booleans(), st.floats(allow_nan=True), st.text(max_size=3),
                     st.integers(0, 9).map(str), st.integers(1, 9).map(float), st.none().map(lambda _: [1]))


def i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32)


def flops(config, **options) -> int:
    return model_flops(config, 100, 2000, seq_lens=[40, 60], **options)


# =========================================================================== multi-latent attention


@pytest.mark.parametrize("fields", [{"q_lora_rank": 64}, {"qk_rope_head_dim": 16},
                                    {"qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32},
                                    {"q_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16}])
def test_mla_fields_without_kv_lora_rank_are_refused(fields):
    config = {k: v for k, v in DEEPSEEK_V3.items() if k not in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                                                                  "qk_rope_head_dim", "v_head_dim")}
    with pytest.raises(ValueError, match="but not kv_lora_rank") as raised:
        flops(dict(config, **fields))
    assert all(key in str(raised.value) for key in fields)
    nested = {"model_type": "kimi_vl", "text_config": dict(TEXT, **fields)}
    with pytest.raises(ValueError, match=r"text_config\.\w+ .*but not text_config\.kv_lora_rank"):
        flops(nested)


def test_v_head_dim_alone_is_plain_attention():
    # MiMo-V2-Flash's plain attention has a v_head_dim: not an MLA field on its own
    assert flops(dict(TEXT, v_head_dim=16)) == flops(TEXT)


@pytest.mark.parametrize("fields", [{"q_lora_rank": 32}, {"kv_lora_rank": 16},
                                    {"qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 16}])
def test_megatron_mla_fields_without_the_switch_are_refused(fields):
    with pytest.raises(ValueError, match="but not multi_latent_attention") as raised:
        flops(dict(MEGATRON, **fields))
    assert all(key in str(raised.value) for key in fields)
    assert flops(dict(MEGATRON, v_head_dim=16)) == flops(MEGATRON)


def test_valid_mla_configs_count_as_before():
    # pinned from the count before issue 43 (DeepSeek-V3 and V2-Lite styles, Megatron's MLA form)
    assert flops(DEEPSEEK_V3) == 821472000
    assert flops(dict(DEEPSEEK_V3, q_lora_rank=None)) == 924576000
    assert flops(MEGATRON_MLA) == 77836800


# =========================================================================== mtp_layers


@settings(max_examples=30, deadline=None)
@given(depths=st.integers(0, 5))
def test_mtp_layers_count_linearly_in_the_depths(depths):
    for config in (TEXT, DEEPSEEK_V3, dict(MEGATRON, mtp_num_layers=1)):
        base, one = flops(config, mtp_layers=0), flops(config, mtp_layers=1)
        assert flops(config, mtp_layers=depths) == base + depths * (one - base)
        assert flops(config, mtp_layers=np.int64(depths)) == flops(config, mtp_layers=depths)


@settings(max_examples=40, deadline=None)
@given(bad=st.one_of(st.integers(max_value=-1), NOT_INTS))
def test_mtp_layers_must_be_an_integer_at_least_zero(bad):
    for config in (TEXT, MEGATRON):
        with pytest.raises(ValueError, match=r"^mtp_layers must be an integer >= 0"):
            flops(config, mtp_layers=bad)


# =========================================================================== MoE top-k


def test_topk_above_the_experts_is_refused():
    hf = dict(DEEPSEEK_V3, num_experts_per_tok=9)
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\) is more than its n_routed_experts \(8\)"):
        flops(hf)
    qwen = dict(TEXT, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=5, moe_intermediate_size=32)
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(5\) is more than its num_experts \(4\)"):
        flops(qwen)
    with pytest.raises(ValueError, match=r"moe_router_topk \(5\) is more than its num_moe_experts \(4\)"):
        flops(dict(MEGATRON_MOE, moe_router_topk=5))
    # every expert is allowed, and counts k experts
    every = dict(MEGATRON_MOE, moe_router_topk=4)
    assert flops(every) - flops(MEGATRON_MOE) == 4 * 6 * 100 * 64 * 32 * 2 * 2
    assert flops(dict(DEEPSEEK_V3, num_experts_per_tok=8)) > flops(DEEPSEEK_V3)


# =========================================================================== windows


@settings(max_examples=40, deadline=None)
@given(bad=st.one_of(NOT_INTS, st.integers(max_value=0)))
def test_megatron_window_must_be_an_integer(bad):
    with pytest.raises(ValueError, match="window_size"):
        flops(dict(MEGATRON, window_size=bad))
    with pytest.raises(ValueError, match="window_size"):
        flops(dict(MEGATRON, window_size=(bad, 0)) if bad not in (0, -1) else dict(MEGATRON, window_size=(3, bad, 0)))


@settings(max_examples=30, deadline=None)
@given(bad=NOT_INTS)
def test_hf_window_must_be_an_integer(bad):
    with pytest.raises(ValueError, match="sliding_window"):
        flops(dict(TEXT, model_type="mistral", sliding_window=bad))


@settings(max_examples=30, deadline=None)
@given(window=st.integers(1, 80))
def test_valid_windows_count_as_before(window):
    # an int is the window itself; (left, right) is left + 1 keys; left -1 or no window_size: full attention
    as_int = flops(dict(MEGATRON, window_size=window))
    assert as_int == flops(dict(MEGATRON, window_size=(window - 1, 0))) == flops(
        dict(MEGATRON, window_size=[np.int64(window - 1), 0]))
    # window_square_sum[w] per sample: s² up to s = w, then w·(w + 1) + 2·w·(s − w) (docs/flops.md)
    square_sum = sum(s * s if s <= window else window * (window + 1) + 2 * window * (s - window) for s in (40, 60))
    per_layer = 6 * 64 * (square_sum - 2000)  # 6·d_q per unit, d_q = 64, instead of Σ sᵢ² = 2000
    assert as_int == flops(MEGATRON) + 4 * per_layer
    assert flops(dict(MEGATRON, window_size=(-1, 0))) == flops(MEGATRON)
    hf = dict(TEXT, model_type="mistral")
    assert flops(dict(hf, sliding_window=window)) == flops(hf) + 2 * per_layer
    assert flops(dict(hf, sliding_window=None)) == flops(hf)


# =========================================================================== Megatron layer frequencies


GDN = {"experimental_attention_variant": "gdn", "linear_key_head_dim": 8, "linear_value_head_dim": 8,
       "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4}


@pytest.mark.parametrize("key,extra", [("window_attn_skip_freq", {"window_size": (7, 0)}),
                                       ("moe_layer_freq", {"num_moe_experts": 4, "moe_router_topk": 2}),
                                       ("linear_attention_freq", GDN)])
@settings(max_examples=20, deadline=None)
@given(bad=st.one_of(st.integers(max_value=0), st.booleans(), st.floats(), st.text(max_size=2)))
def test_megatron_layer_frequency_must_be_at_least_one(key, extra, bad):
    with pytest.raises(ValueError, match=rf"^the model config's {key} must be an integer >= 1"):
        flops(dict(MEGATRON, **extra, **{key: bad}))


@pytest.mark.parametrize("key,extra", [("window_attn_skip_freq", {"window_size": (7, 0)}),
                                       ("moe_layer_freq", {"num_moe_experts": 4, "moe_router_topk": 2})])
@pytest.mark.parametrize("freq", [1, 2, 3, 4, 5])
def test_a_layer_frequency_counts_as_its_list(key, extra, freq):
    # an int f: the window on all but every f-th layer (1-indexed), experts on layers 0, f, 2f, ...
    listed = ([int((n % freq) != 0) for n in range(1, 5)] if key == "window_attn_skip_freq"
              else [int(i % freq == 0) for i in range(4)])
    assert flops(dict(MEGATRON, **extra, **{key: freq})) == flops(dict(MEGATRON, **extra, **{key: listed}))


# =========================================================================== layer_types


def test_layer_types_as_a_string_is_refused():
    for bad in ("full_attention", "ff", b"ff", {"full_attention": 2}, 5):
        with pytest.raises(TypeError, match=r"^layer_types must be a list of layer kinds"):
            flops(TEXT, layer_types=bad)
    for key in ("layer_types", "layers_block_type"):
        with pytest.raises(ValueError, match=rf"^the model config's {key} must be a list of layer kinds"):
            flops(dict(TEXT, **{key: "full_attention"}))
    with pytest.raises(ValueError, match=r"^the model config's text_config\.layer_types must be a list"):
        flops({"model_type": "qwen3_vl", "text_config": dict(TEXT, layer_types="ff")})
    moe = dict(TEXT, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    with pytest.raises(ValueError, match=r"^the model config's mlp_layer_types must be a list"):
        flops(dict(moe, mlp_layer_types="ds"))
    # lists and tuples (and generators) of kinds count as before
    full = ["full_attention"] * 2
    assert flops(TEXT, layer_types=full) == flops(TEXT, layer_types=tuple(full)) == flops(
        TEXT, layer_types=(k for k in full)) == flops(TEXT)
    assert flops(dict(moe, mlp_layer_types=("dense", "sparse"))) == flops(dict(moe, mlp_only_layers=[0]))


# =========================================================================== the accumulator's arguments


@pytest.mark.parametrize("bad", ["qwen3", b"qwen3", 5, 1.5, [TEXT], (TEXT,)])
def test_accumulator_takes_a_config_or_none(bad):
    with pytest.raises(TypeError, match=r"^FlopsAccumulator's vision_config .*must be a transformers config or its "
                                        rf"dict .*, got {type(bad).__name__}$"):
        FlopsAccumulator(bad)
    with pytest.raises(TypeError, match=rf"^config must be a transformers config .*got {type(bad).__name__}$"):
        FlopsMeter(bad)
    assert FlopsAccumulator(None).count_names == FlopsAccumulator().count_names


@pytest.mark.parametrize("bad", [None, "acc", {"tokens": 5}, 3])
def test_merge_takes_an_accumulator(bad):
    acc = FlopsAccumulator(TEXT).add_bshd(2, 8)
    before = acc.counts()
    with pytest.raises(TypeError, match=rf"^merge's other must be a FlopsAccumulator, got {type(bad).__name__}$"):
        acc.merge(bad)
    assert acc.counts() == before
    assert acc.merge(FlopsAccumulator(TEXT).add_bshd(1, 8)).counts()["tokens"] == 24


# =========================================================================== cross-attention memories


@pytest.mark.parametrize("config", [None, TEXT])
@pytest.mark.parametrize("key", ["cross_cu_seqlens", "cross_cu_seqlens_unpadded"])
def test_memories_without_cross_attention_layers_are_refused(config, key):
    acc = FlopsAccumulator(config).add({"cu_seqlens": i32([0, 4]), "input_ids": torch.zeros(1, 4)})
    before = acc.counts()
    batch = {"cu_seqlens": i32([0, 5, 12]), key: i32([0, 3, 7]), "input_ids": torch.zeros(1, 12)}
    why = "has no model config" if config is None else "counts no cross-attention"
    with pytest.raises(ValueError, match=rf"^{key} given, but this FlopsAccumulator {why}"):
        acc.add(batch)
    with pytest.raises(ValueError, match=rf"^{key} given"):
        acc.add_cu_seqlens(i32([0, 5, 12]), **{key: i32([0, 3, 7])})
    assert acc.counts() == before  # nothing half-added


def test_unpadded_memories_are_preferred():
    # Megatron-Bridge's convention: cross_cu_seqlens_unpadded holds the memories' real lengths
    cu, padded, unpadded = i32([0, 5, 12, 20]), i32([0, 8, 8, 16]), i32([0, 6, 6, 11])
    ids = torch.zeros(1, 20)
    both = FlopsAccumulator(MLLAMA_TEXT).add({"cu_seqlens": cu, "cross_cu_seqlens": padded,
                                               "cross_cu_seqlens_unpadded": unpadded, "input_ids": ids}).counts()
    assert both["cross_tokens"] == 11 and both["cross_seqlen_product_sum"] == 5 * 6 + 7 * 0 + 8 * 5
    alone = FlopsAccumulator(MLLAMA_TEXT).add({"cu_seqlens": cu, "cross_cu_seqlens_unpadded": unpadded,
                                                "input_ids": ids}).counts()
    assert alone == both
    direct = FlopsAccumulator(MLLAMA_TEXT).add_cu_seqlens(cu, cross_cu_seqlens=padded,
                                                          cross_cu_seqlens_unpadded=unpadded).counts()
    assert direct["cross_seqlen_product_sum"] == both["cross_seqlen_product_sum"]
    # the padded memories alone count as before
    only_padded = FlopsAccumulator(MLLAMA_TEXT).add({"cu_seqlens": cu, "cross_cu_seqlens": padded,
                                                      "input_ids": ids}).counts()
    assert only_padded["cross_tokens"] == 16 and only_padded["cross_seqlen_product_sum"] == 5 * 8 + 8 * 8
    with pytest.raises(ValueError, match="memory lengths for"):
        FlopsAccumulator(MLLAMA_TEXT).add({"cu_seqlens": cu, "cross_cu_seqlens_unpadded": i32([0, 6]),
                                           "input_ids": ids})


# =========================================================================== docs/flops.md's count_padding


def _count_padding_snippets() -> list[str]:
    """The python blocks and inline code spans of docs/flops.md that pass ``count_padding=``."""
    text = DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    spans = re.findall(r"`([^`]+)`", prose)
    return [piece for piece in blocks + spans if "count_padding=" in piece]


def test_docs_count_padding_examples_run():
    snippets = _count_padding_snippets()
    assert len(snippets) >= 2  # the accumulator's example block and the "Padding" bullet
    batch = build_thd_batch([{"input_ids": list(range(1, n + 1))} for n in (5, 9, 14)], pad_multiple=8)
    model = SimpleNamespace(config=TEXT)
    acc = FlopsAccumulator(TEXT).add(batch)
    for snippet in snippets:
        scope = {"FlopsAccumulator": FlopsAccumulator, "model": model, "config": TEXT, "micro_batches": [batch],
                 "dp_cp_group": None, "acc": acc}
        exec(snippet, scope)  # noqa: S102 - the documented example, as written
    assert acc.model_flops(TEXT, count_padding=True) > acc.model_flops(TEXT)
    with pytest.raises(TypeError):  # the module-level function takes the token count itself
        model_flops(TEXT, 28, 302, count_padding=True)


# =========================================================================== a value head dim apart (MiMo-V2-Flash)
# Queries and keys have head_dim, values and the attention output v_head_dim: q, k, v = h → n·d, k·d, k·dv;
# o = n·dv → h; scores Q·Kᵀ over d, P·V over dv. MiMo-V2-Flash's sliding layers have twice the KV heads
# (transformers builds them so; the checkpoint's swa_num_key_value_heads is 8 against 4).

SEQ_LENS = [40, 60]
MIMO = {"model_type": "mimo_v2_flash", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 24, "v_head_dim": 8, "sliding_window": 8, "intermediate_size": 128,
        "vocab_size": 100, "layer_types": ["full_attention", "sliding_attention", "full_attention"]}
MEGATRON_MIMO = dict(MEGATRON, num_layers=3, kv_channels=24, v_head_dim=8, window_size=8,
                     hybrid_attention_pattern=[0, 1, 1], full_attn_num_query_groups=2, swa_num_query_groups=4,
                     num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=[0, 1, 1],
                     gated_linear_unit=True, mtp_num_layers=1)


def _attention_by_hand(h, n, k, d, dv, full, sliding, window, seq_lens=SEQ_LENS) -> dict:
    """Training FLOPs (3x the forward, 2 a MAC) of the attention of ``full`` and ``sliding`` layers
    (``k`` KV heads each: a pair ``(full, sliding)``) over one pack of ``seq_lens``."""
    tokens, squares = sum(seq_lens), sum(s * s for s in seq_lens)
    # the window's unit of Σ sᵢ²: s² while the window cuts nothing, else 2·Σ_t min(t, w) = w·(2s − w + 1)
    windowed = sum(s * s if s <= window else window * (2 * s - window + 1) for s in seq_lens)
    proj = lambda kv: 6 * tokens * (h * n * d + h * kv * d + h * kv * dv + n * dv * h)  # noqa: E731
    per_pair = 6 * n * (d + dv) // 2  # Q·Kᵀ and P·V on half the square (causal), x3
    return {"attention_projections": full * proj(k[0]) + sliding * proj(k[1]),
            "core_attention": full * per_pair * squares, f"sliding_attention_{window}": sliding * per_pair * windowed}


def test_v_head_dim_equal_to_head_dim_counts_as_before():
    # pinned from the count before this fix: transformers and Megatron-style, with and without windows
    windowed = dict(TEXT, layer_types=["full_attention", "sliding_attention"], sliding_window=8)
    for config, pinned in ((TEXT, 49612800), (windowed, 49416192), (MEGATRON, 75724800),
                           (dict(MEGATRON, window_size=8), 74938368)):
        head_dim = config.get("head_dim") or config["kv_channels"]
        assert flops(config) == flops(dict(config, v_head_dim=head_dim)) == pinned


def test_mimo_attention_counts_the_value_head_dim():
    terms = model_flops_breakdown(MIMO, sum(SEQ_LENS), sum(s * s for s in SEQ_LENS), seq_lens=SEQ_LENS)
    expected = _attention_by_hand(64, 4, (2, 4), 24, 8, full=2, sliding=1, window=8)
    assert {name: terms[name] for name in expected} == expected
    assert terms["mlp"] == 6 * 100 * 64 * 3 * 128 * 3 and terms["logits"] == 6 * 100 * 64 * 100
    assert set(terms) == {*expected, "mlp", "logits"}
    same = dict(MIMO, v_head_dim=24)
    assert flops(MIMO) < flops(same)  # the V projection, P·V and the output projection narrower


def test_plain_v_head_dim_outside_mimo():
    # the value width alone (no MiMo family: every layer's KV heads num_key_value_heads)
    config = dict(TEXT, head_dim=24, v_head_dim=8)
    terms = model_flops_breakdown(config, sum(SEQ_LENS), sum(s * s for s in SEQ_LENS), seq_lens=SEQ_LENS)
    expected = _attention_by_hand(64, 4, (2, 2), 24, 8, full=2, sliding=0, window=8)
    assert terms["attention_projections"] == expected["attention_projections"]
    assert terms["core_attention"] == expected["core_attention"]


def test_megatron_mimo_provider_counts_its_layers():
    # Megatron-Bridge's MiMoV2FlashModelProvider: hybrid_attention_pattern (1: sliding), KV groups by kind,
    # v_head_dim, and MTP layers that slide with a dense MLP
    terms = model_flops_breakdown(MEGATRON_MIMO, sum(SEQ_LENS), sum(s * s for s in SEQ_LENS), seq_lens=SEQ_LENS)
    expected = _attention_by_hand(64, 4, (2, 4), 24, 8, full=1, sliding=2 + 1, window=8)
    assert {name: terms[name] for name in expected} == expected
    tokens = sum(SEQ_LENS)
    assert terms["mlp"] == 6 * tokens * 64 * 3 * 128 * (1 + 1)  # decoder layer 1 and the MTP layer
    assert terms["moe"] == 6 * tokens * 64 * 3 * 32 * 2 * 2
    plain = dict(MEGATRON, kv_channels=24, v_head_dim=8)  # no pattern: num_query_groups everywhere, no window
    terms = model_flops_breakdown(plain, tokens, sum(s * s for s in SEQ_LENS), seq_lens=SEQ_LENS)
    expected = _attention_by_hand(64, 4, (2, 2), 24, 8, full=4, sliding=0, window=8)
    assert terms["attention_projections"] == expected["attention_projections"]
    assert terms["core_attention"] == expected["core_attention"]


def test_megatron_mla_keeps_kv_channels_for_plain_attention():
    # with multi_latent_attention on, v_head_dim is MLA's: a hybrid stack's '*' layer keeps kv_channels (16)
    hybrid = dict(MEGATRON_MLA, num_layers=2, v_head_dim=8)
    both, mla = (model_flops_breakdown(dict(hybrid, hybrid_layer_pattern=pattern), 100, 2000, seq_lens=[40, 60])
                 for pattern in ("*+", "+"))
    plain = 6 * 100 * (64 * (4 * 16 + 2 * 2 * 16) + 4 * 16 * 64)
    assert both["attention_projections"] - mla["attention_projections"] == plain
    assert both["core_attention"] - mla["core_attention"] == 6 * 4 * 16 * 2000


@settings(max_examples=30, deadline=None)
@given(bad=st.one_of(st.text(max_size=3), st.integers(0, 1), st.lists(st.integers(0, 1), max_size=2),
                     st.lists(st.sampled_from([2, -1, 1.0, 0.0, True, "1"]), min_size=3, max_size=3)))
def test_hybrid_attention_pattern_is_one_zero_or_one_a_layer(bad):
    with pytest.raises(ValueError, match="hybrid_attention_pattern"):
        flops(dict(MEGATRON_MIMO, hybrid_attention_pattern=bad))


def test_tiny_mimo_model_gemms_equal_the_counted_terms():
    """FlopCounterMode on a tiny random-weight MiMo-V2-Flash (eager attention: the whole square)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "MiMoV2FlashConfig"):
        pytest.skip("this transformers has no MiMo-V2-Flash")
    from torch.utils.flop_counter import FlopCounterMode

    n, d, dv, experts, s = 4, 12, 8, 4, 40
    config = transformers.MiMoV2FlashConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=n, num_key_value_heads=2,
        head_dim=d, v_head_dim=dv, num_hidden_layers=3, moe_intermediate_size=16, n_routed_experts=experts,
        num_experts_per_tok=2, sliding_window=8, max_position_embeddings=512, pad_token_id=0, bos_token_id=None,
        eos_token_id=None, layer_types=["full_attention", "sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          experts_implementation="eager")
    ids = torch.randint(3, config.vocab_size, (1, s))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()  # forward and backward: the 6 of training
    seen = counter.get_flop_counts()["Global"]
    terms = model_flops_breakdown(config, s, s * s, seq_lens=[s])
    assert model_flops_breakdown(config.to_dict(), s, s * s, seq_lens=[s]) == terms
    routers = 6 * s * 32 * experts * 2  # two MoE layers' routers, which thdpack does not count
    gemms = sum(terms[k] for k in ("attention_projections", "mlp", "moe", "logits"))
    assert seen[torch.ops.aten.mm] == gemms + routers
    # eager attention: Q·Kᵀ over d and P·V over dv on the whole square of each of the 3 layers; the two
    # full layers' count is their causal half
    per_layer = 6 * n * s * s * (d + dv)
    assert seen[torch.ops.aten.bmm] == 3 * per_layer
    assert 2 * terms["core_attention"] == 2 * per_layer
    window = length_count([s], count_name("window_square_sum", 8))
    assert terms["sliding_attention_8"] == 3 * n * (d + dv) * window


# =========================================================================== attention sizes the counts do not read
# Fields some families set apart from num_attention_heads / num_key_value_heads / head_dim (Inkling's sliding
# layers, Gemma 4's global layers and KV sharing, Laguna's and Step3.7's per-layer heads and g_proj gate, a
# heterogeneous per_layer_config): counted as plain attention they gave another model's FLOPs; now refused.

UNREAD = {"swa_num_attention_heads": 8, "swa_num_key_value_heads": 4, "swa_head_dim": 8,
          "per_layer_config": {"1": {"head_dim": 32}}, "num_attention_heads_per_layer": [4, 8],
          "num_sliding_attention_heads": 8, "attention_other_setting": {"num_attention_heads": 8},
          "gating": False, "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
          "num_kv_shared_layers": 1, "kv_source_layers": [0, 0]}
INERT = {"swa_head_dim": None, "per_layer_config": {}, "attention_k_eq_v": False, "num_kv_shared_layers": 0,
         "kv_source_layers": [0, 1], "global_head_dim": None, "gating": None}


@pytest.mark.parametrize("key", sorted(UNREAD))
def test_unread_attention_fields_are_refused(key):
    for config, where in ((dict(TEXT, **{key: UNREAD[key]}), ""),
                          ({"model_type": "qwen3_vl", "text_config": dict(TEXT, **{key: UNREAD[key]})},
                           "text_config.")):
        with pytest.raises(ValueError, match=rf"^the model config sets {re.escape(where + key)}: .*do not read"):
            flops(config)
        with pytest.raises(ValueError, match=re.escape(where + key)):  # whatever layer_types says
            flops(config, layer_types=["full_attention", "sliding_attention"])
        with pytest.raises(ValueError, match=re.escape(where + key)):
            FlopsAccumulator(config).add_bshd(1, 8).model_flops(config)


def test_inert_attention_fields_count_as_before():
    assert flops(dict(TEXT, **INERT)) == flops(TEXT) == 49612800


@settings(max_examples=40, deadline=None)
@given(key=st.sampled_from(["swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim",
                            "num_sliding_attention_heads", "global_head_dim", "num_global_key_value_heads"]),
       size=st.integers(1, 64))
def test_any_size_of_an_unread_field_is_refused(key, size):
    # equal to the plain size or not: the family's attention differs from plain attention
    with pytest.raises(ValueError, match=rf"sets {key}:"):
        flops(dict(TEXT, **{key: size}))


def test_inkling_hub_config_without_layer_types_is_refused():
    # a hub config.json lists local_layer_ids and sliding_window_size, not layer_types: it was counted as full
    # attention everywhere, each sliding layer with the full layers' sizes and none of Inkling's extra GEMMs
    inkling = dict(TEXT, model_type="inkling_text", swa_num_attention_heads=8, swa_num_key_value_heads=4,
                   swa_head_dim=8, sliding_window_size=8, local_layer_ids=[0])
    with pytest.raises(ValueError, match=r"swa_num_attention_heads, swa_num_key_value_heads, swa_head_dim: "
                                         r"the sliding layers' own attention sizes \(Inkling"):
        flops(inkling)


@pytest.mark.parametrize("name", ["InklingTextConfig", "Inkling2TextConfig", "Inkling2LoopTextConfig",
                                  "InklingConfig", "Gemma4TextConfig", "DiffusionGemmaTextConfig",
                                  "EmbeddingGemma2TextConfig", "LagunaConfig", "Step3p7TextConfig",
                                  "Dots3NoteTextConfig", "Gemma3nTextConfig"])
def test_transformers_families_with_unread_attention_sizes_are_refused(name):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, name):
        pytest.skip(f"this transformers has no {name}")
    config = getattr(transformers, name)()
    for given in (config, config.to_dict()):  # the object (per-layer attributes) and its dict
        with pytest.raises(ValueError, match=r"^the model config sets .*which the FLOPs counts do not read"):
            flops(given)


def test_kv_sharing_of_kolibri_is_refused_and_homogeneous_objects_are_counted():
    transformers = pytest.importorskip("transformers")
    if hasattr(transformers, "Kolibri1_1Config"):
        kolibri = transformers.Kolibri1_1Config()
        with pytest.raises(ValueError, match=r"sets kv_source_layers: layers reusing another layer's keys"):
            flops(dict(kolibri.to_dict(), intermediate_size=64))
    # a plain config object's per_layer_config (a view of every layer, all alike) is not a per-layer config
    qwen3 = transformers.Qwen3Config(**{k: v for k, v in TEXT.items() if k != "model_type"})
    assert flops(qwen3) == flops(TEXT)
