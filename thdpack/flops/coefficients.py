"""What a model costs per count: the training-FLOPs coefficients of a model config.

A config (``transformers`` object or dict, read with
:func:`thdpack.common.model_config.config_get`) becomes a linear form in the counts of a
batch (:class:`FlopsCoefficients`): FLOPs per token, per unit of ``Σ sᵢ²``, per vision
patch and per unit of the vision attention sums. :mod:`thdpack.flops.model` applies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from thdpack.flops.vision_stats import as_pair, window_patches
from thdpack.common.model_config import check_config, config_get, config_int, config_number

__all__ = ["GATED_ATTENTION_MODEL_TYPES", "NON_GATED_MLP_MODEL_TYPES", "FlopsCoefficients", "flops_coefficients"]

# Families whose MLP is two plain GEMMs (up, down); every other family is taken as gated (SwiGLU-like).
NON_GATED_MLP_MODEL_TYPES = frozenset(
    {"gpt2", "gpt_neox", "gptj", "gpt_bigcode", "opt", "bloom", "falcon", "phi", "starcoder2", "mpt", "codegen",
     "bert", "roberta"}
)
# Families whose full-attention layers gate the attention output (q_proj emits query and gate).
GATED_ATTENTION_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})


@dataclass(frozen=True)
class FlopsCoefficients:
    """Training FLOPs as a linear form in the counts of a batch.

    ``terms`` maps a term name to ``(count, coefficient)``, where ``count`` is one of
    ``"tokens"``, ``"seqlen_squared_sum"``, ``"vision_patches"``,
    ``"vision_seqlen_squared_sum"``, ``"vision_window_seqlen_squared_sum"``; the
    term's FLOPs are ``coefficient × count``. All coefficients are integers.
    """

    terms: dict

    def per(self, count: str) -> int:
        """Sum of the coefficients multiplying ``count``."""
        return sum(c for k, c in self.terms.values() if k == count)


def _text_terms(config, gated_mlp, attention_output_gate, layer_types) -> dict:
    """The language model's terms (``mlp``, ``moe``, ``attention_projections``,
    ``core_attention``, ``linear_attention``, ``logits``) of :func:`flops_coefficients`."""
    text = config_get(config, "text_config", config)
    where = "" if text is config else "text_config."
    model_types = {config_get(text, "model_type", None), config_get(config, "model_type", None)} - {None}

    h = config_int(text, "hidden_size", where=where)
    num_layers = config_int(text, "num_hidden_layers", where=where)
    vocab = config_int(text, "vocab_size", where=where)
    heads = config_int(text, "num_attention_heads", where=where)
    kv_heads = config_int(text, "num_key_value_heads", heads, where=where)
    head_dim = config_int(text, "head_dim", max(h // heads, 1), where=where)
    if config_get(text, "kv_lora_rank", None) is not None or config_get(text, "q_lora_rank", None) is not None:
        raise NotImplementedError("multi-latent attention (DeepSeek MLA) is not covered")
    n_attn, n_linear = _attention_layer_counts(text, num_layers, layer_types, where)
    n_moe = _moe_layer_count(text, num_layers, where)
    n_dense = num_layers - n_moe

    if gated_mlp is None:
        gated_mlp = not (model_types & NON_GATED_MLP_MODEL_TYPES)
    e = 3 if gated_mlp else 2
    if attention_output_gate is None:
        attention_output_gate = (bool(config_get(text, "attn_output_gate", False))
                                 or bool(model_types & GATED_ATTENTION_MODEL_TYPES))

    d_q = heads * head_dim
    d_kv = kv_heads * head_dim
    gate = d_q if attention_output_gate else 0

    terms: dict = {}
    if n_dense:
        ffn = config_int(text, "intermediate_size", where=where)
        terms["mlp"] = ("tokens", 6 * h * e * ffn * n_dense)
    if n_moe:
        terms["moe"] = ("tokens", 6 * h * e * _moe_ffn_per_token(text, where) * n_moe)
    if n_attn:
        terms["attention_projections"] = ("tokens", 6 * (h * (d_q + 2 * d_kv + gate) + d_q * h) * n_attn)
        terms["core_attention"] = ("seqlen_squared_sum", 6 * d_q * n_attn)
    if n_linear:
        terms["linear_attention"] = ("tokens", 6 * _linear_attention_macs(text, h, where) * n_linear)
    terms["logits"] = ("tokens", 6 * h * vocab)
    return terms


def _attention_layer_counts(text, num_layers: int, layer_types, where: str) -> tuple[int, int]:
    """``(L_attn, L_linear)``: full-attention and linear-attention (Gated DeltaNet) layers, from
    ``layer_types`` (the argument, else the config's), else ``full_attention_interval``."""
    if layer_types is None:
        layer_types = config_get(text, "layer_types", None)
    if layer_types is None:
        interval = config_get(text, "full_attention_interval", None)
        if interval:
            interval = config_int(text, "full_attention_interval", where=where)
            layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
        else:
            layer_types = ["full_attention"] * num_layers
    layer_types = list(layer_types)
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = sorted(set(layer_types) - {"full_attention", "linear_attention"})
    if unknown:
        raise NotImplementedError(
            f"layer types {unknown} are not covered (sliding-window attention is not Σ sᵢ²); "
            "pass layer_types=... to model_flops to count them as another kind"
        )
    return layer_types.count("full_attention"), layer_types.count("linear_attention")


def _moe_layer_count(text, num_layers: int, where: str) -> int:
    """``N_moe``: layers with experts (``mlp_only_layers``, ``decoder_sparse_step``,
    ``first_k_dense_replace``, ``moe_layer_freq`` respected); 0 for a dense model."""
    num_experts = 0
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):  # the first one set and non-zero
        num_experts = num_experts or config_int(text, key, 0, minimum=0, where=where)
    if not num_experts:
        return 0
    mlp_only = set(config_get(text, "mlp_only_layers", []) or [])
    sparse_step = config_int(text, "decoder_sparse_step", 1, where=where)
    first_dense = config_int(text, "first_k_dense_replace", 0, minimum=0, where=where)
    layer_freq = config_int(text, "moe_layer_freq", 1, where=where)
    return sum(
        i not in mlp_only and (i + 1) % sparse_step == 0 and i >= first_dense and i % layer_freq == 0
        for i in range(num_layers)
    )


def _moe_ffn_per_token(text, where: str) -> int:
    """``moe_ffn·k + shared_ffn``: the expert MLP width a token goes through in a MoE layer."""
    key = "moe_intermediate_size" if config_get(text, "moe_intermediate_size", None) is not None else "intermediate_size"
    moe_ffn = config_int(text, key, where=where)
    top_k = config_int(text, "num_experts_per_tok", where=where)
    shared = config_int(text, "shared_expert_intermediate_size", 0, minimum=0, where=where)
    if not shared and config_get(text, "n_shared_experts", None):
        shared = config_int(text, "n_shared_experts", minimum=0, where=where) * moe_ffn
    return moe_ffn * top_k + shared


def _linear_attention_macs(text, h: int, where: str) -> int:
    """Multiply-adds per token of one Gated DeltaNet layer (hidden size ``h``)."""
    dhk, dhv, nk, nv = (config_int(text, key, where=where) for key in (
        "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads"))
    conv = config_int(text, "linear_conv_kernel_dim", 4, where=where)
    dk, dv = dhk * nk, dhv * nv
    return (
        h * (2 * dk + 2 * dv + 2 * nv)  # in_proj: q, k, v, z (output gate), b, a
        + conv * (2 * dk + dv)  # depthwise causal conv1d over q, k, v
        + 4 * nv * dhk * dhv  # gated delta rule: KKᵀ, VKᵀ, S(α(I − βKKᵀ)), SQ per head
        + dv * h  # out_proj
    )


def _vision_terms(vision, config, vision_gated_mlp, vision_backward) -> dict:
    """The vision tower's terms (``vision_*``) of :func:`flops_coefficients`."""
    # Qwen2-VL: embed_dim is the ViT width, hidden_size the merger output
    at = "vision_config."
    if config_get(vision, "embed_dim", None) is not None:
        width = config_int(vision, "embed_dim", where=at)
        out = config_int(vision, "hidden_size", where=at)
        inter = int(width * config_number(vision, "mlp_ratio", 4, where=at))
    else:  # Qwen2.5-VL, Qwen3-VL, Qwen3.5
        width = config_int(vision, "hidden_size", where=at)
        out = config_int(vision, "out_hidden_size", where=at)
        inter = config_int(vision, "intermediate_size", where=at)
    depth = config_int(vision, "depth", where=at)
    ph, pw = as_pair(config_get(vision, "patch_size", None), "vision_config.patch_size")
    temporal = config_int(vision, "temporal_patch_size", 1, where=at)
    channels = config_int(vision, "in_channels", config_get(vision, "in_chans", 3), where=at)
    merge = config_int(vision, "spatial_merge_size", 1, where=at)
    n_mergers = 1 + len(config_get(vision, "deepstack_visual_indexes", []) or [])
    if vision_gated_mlp is None:
        types = {config_get(vision, "model_type", None), config_get(config, "model_type", None)} - {None}
        if types:
            vision_gated_mlp = any(t.startswith("qwen2_5") for t in types)
        else:
            vision_gated_mlp = config_get(vision, "hidden_act", None) in ("silu", "swish")
    e = 3 if vision_gated_mlp else 2
    full_blocks = depth
    if window_patches(vision) is not None:
        full_blocks = len(set(config_get(vision, "fullatt_block_indexes", None)))
    window_blocks = depth - full_blocks
    f = 6 if vision_backward else 2  # 2 FLOPs per MAC, x3 with a backward pass through the tower

    terms = {
        "vision_patch_embed": ("vision_patches", f * channels * temporal * ph * pw * width),
        "vision_blocks": ("vision_patches", f * width * (4 * width + e * inter) * depth),
        "vision_attention": ("vision_seqlen_squared_sum", 2 * f * width * full_blocks),
        "vision_merger": ("vision_patches", f * width * (width * merge * merge + out) * n_mergers),
    }
    if window_blocks:
        terms["vision_window_attention"] = ("vision_window_seqlen_squared_sum", 2 * f * width * window_blocks)
    return terms


def flops_coefficients(
    config,
    *,
    gated_mlp: bool | None = None,
    attention_output_gate: bool | None = None,
    layer_types: Sequence[str] | None = None,
    vision_gated_mlp: bool | None = None,
    vision_backward: bool = True,
    include_vision: bool = True,
) -> FlopsCoefficients:
    """The per-count coefficients of :func:`model_flops` for ``config``.

    Text model (``config.text_config`` when present), ``h`` hidden size, ``V`` vocab,
    ``d_q = heads·head_dim``, ``d_kv = kv_heads·head_dim``, ``e = 3`` for a gated MLP
    (SwiGLU: gate, up, down) else 2. Per token, training:

    ========================  ==========================================================
    ``mlp``                   ``6·h·e·ffn · N_dense``
    ``moe``                   ``6·h·e·(moe_ffn·k + shared_ffn) · N_moe`` (k experts per token)
    ``attention_projections`` ``6·(h·(d_q + 2·d_kv + gate) + d_q·h) · L_attn``
                              (``gate = d_q`` for an attention output gate, Qwen3-Next / 3.5)
    ``linear_attention``      ``6·(h·(2·d_k + 2·d_v + 2·n_v) + K·(2·d_k + d_v) + 4·n_v·d_hk·d_hv
                              + d_v·h) · L_linear`` (Gated DeltaNet; no ``Σ sᵢ²`` term)
    ``logits``                ``6·h·V``
    ========================  ==========================================================

    and per unit of ``Σ sᵢ²``: ``core_attention = 6·d_q · L_attn`` (causal).
    ``N_moe`` counts layers with experts (``mlp_only_layers``, ``decoder_sparse_step``,
    ``first_k_dense_replace``, ``moe_layer_freq`` respected), ``N_dense`` the others;
    ``L_attn`` / ``L_linear`` come from ``layer_types`` (or ``full_attention_interval``).

    Vision tower (``config.vision_config``: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5),
    width ``w``, MLP ``I``, ``f = 6`` (3 with ``vision_backward=False``, a frozen
    tower: forward only, ``f = 2``), per patch:

    ============================  ======================================================
    ``vision_patch_embed``        ``f·C·T·P²·w`` (Conv3d over ``C×T×P×P`` pixels)
    ``vision_blocks``             ``f·w·(4·w + e_v·I) · depth`` (qkv, proj, MLP)
    ``vision_merger``             ``f·w·(w·m² + out) · (1 + deepstack)``
    ============================  ======================================================

    and ``vision_attention = 2·f·w · full_blocks`` per unit of ``Σ (patches per frame)²``,
    ``vision_window_attention = 2·f·w · window_blocks`` per unit of the window sum
    (bidirectional: twice the causal figure). ``e_v = 3`` for Qwen2.5-VL's gated MLP.
    """
    check_config(config)
    terms = _text_terms(config, gated_mlp, attention_output_gate, layer_types)
    vision = config_get(config, "vision_config", None)
    if include_vision and vision is not None:
        terms.update(_vision_terms(vision, config, vision_gated_mlp, vision_backward))
    return FlopsCoefficients(terms)

