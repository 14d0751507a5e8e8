"""What a model costs per count: the training-FLOPs coefficients of a model config.

A config (``transformers`` object or dict, read with
:func:`thdpack.common.model_config.config_get`) becomes a linear form in the counts of a
batch (:class:`FlopsCoefficients`): FLOPs per token, per unit of ``Σ sᵢ²``, per vision
patch and per unit of the vision attention sums, per audio-encoder count (Qwen-Omni,
:mod:`thdpack.flops.audio_stats`), per unit of the window and top-k counts
(:mod:`thdpack.flops.sequences`) and of the cross-attention counts. The text stack is read
layer by layer (:mod:`thdpack.flops.layer_kinds`, :mod:`thdpack.flops.megatron_layers`) and
costed by kind (:mod:`thdpack.flops.layer_costs`); :mod:`thdpack.flops.model` applies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from thdpack.common.align import check_int
from thdpack.common.model_config import check_config, config_get, config_int, config_number
from thdpack.flops.layer_costs import UnsupportedLayerError, structure_terms
from thdpack.flops.layer_kinds import GATED_ATTENTION_MODEL_TYPES, NON_GATED_MLP_MODEL_TYPES, hf_structure, model_root
from thdpack.flops.megatron_layers import is_megatron_config, megatron_structure
from thdpack.flops.audio_stats import audio_family
from thdpack.flops.vision_stats import as_pair, window_patches

__all__ = ["GATED_ATTENTION_MODEL_TYPES", "NON_GATED_MLP_MODEL_TYPES", "FlopsCoefficients", "UnsupportedLayerError",
           "flops_coefficients"]


@dataclass(frozen=True)
class FlopsCoefficients:
    """Training FLOPs as a linear form in the counts of a batch.

    ``terms`` maps a term name to ``(count, coefficient)``, where ``count`` is one of
    ``"tokens"``, ``"seqlen_squared_sum"``, a length count of :mod:`thdpack.flops.sequences`
    (``"window_square_sum[w]"``, ``"causal_pairs[k]"``, ``"causal_pairs"``), ``"cross_tokens"``,
    ``"cross_seqlen_product_sum"``, ``"vision_patches"``, ``"vision_seqlen_squared_sum"``,
    ``"vision_window_seqlen_squared_sum"``, the audio encoder's counts
    ``"audio_padded_frames"``, ``"audio_padded_frames_2"`` (``_4``, ``_8``), ``"audio_tokens"``,
    ``"audio_seqlen_squared_sum"``, ``"audio_output_tokens"`` (:class:`thdpack.flops.audio_stats.AudioStats`);
    the term's FLOPs are ``coefficient × count``. All coefficients are integers.
    """

    terms: dict

    def per(self, count: str) -> int:
        """Sum of the coefficients multiplying ``count``."""
        return sum(c for k, c in self.terms.values() if k == count)

    @property
    def counts(self) -> tuple[str, ...]:
        """The counts the terms multiply, each once, in term order."""
        return tuple(dict.fromkeys(k for k, _ in self.terms.values()))

    @property
    def length_counts(self) -> tuple[str, ...]:
        """The counts beyond tokens and ``Σ sᵢ²`` that come from the real sample lengths (windows, top-k):
        what :class:`thdpack.flops.FlopsAccumulator` adds up for this model."""
        return tuple(k for k in self.counts if k.startswith(("window_square_sum", "causal_pairs")))


def _text_terms(config, gated_mlp, attention_output_gate, layer_types, mtp_layers) -> dict:
    """The language model's terms of :func:`flops_coefficients`: the text stack read layer by layer
    (:mod:`thdpack.flops.layer_kinds` for transformers configs, :mod:`thdpack.flops.megatron_layers` for
    Megatron-style ones), each layer's kinds costed by :mod:`thdpack.flops.layer_costs`."""
    if mtp_layers is not None:
        check_int(mtp_layers, "mtp_layers", 0, hint=" (multi-token-prediction depths to count)")
    options = dict(gated_mlp=gated_mlp, attention_output_gate=attention_output_gate, layer_types=layer_types)
    if is_megatron_config(config):
        structure = megatron_structure(config, mtp_layers=mtp_layers, **options)
    else:
        structure = hf_structure(config, mtp_layers=mtp_layers or 0, **options)
    return structure_terms(structure)


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


def _audio_terms(audio, audio_backward) -> dict:
    """The audio encoder's terms (``audio_*``) of :func:`flops_coefficients`: Qwen2.5-Omni's two Conv1d or
    Qwen3-Omni's Conv2d stack (on the padded chunks), the encoder layers, their chunked attention and the
    output projection; ``f = 6`` (2 with ``audio_backward=False``) per multiply-accumulate."""
    at = "audio_config."
    d = config_int(audio, "d_model", where=at)
    mel = config_int(audio, "num_mel_bins", where=at)
    layers = config_int(audio, "encoder_layers", where=at)
    ffn = config_int(audio, "encoder_ffn_dim", where=at)
    out = config_int(audio, "output_dim", where=at)
    f = 6 if audio_backward else 2
    terms = {}
    if audio_family(audio) == "qwen3_omni":
        c = config_int(audio, "downsample_hidden_size", where=at)
        terms["audio_conv1"] = ("audio_padded_frames_2", f * 9 * c * -(-mel // 2))  # Conv2d(1, c, 3, s2) per output
        terms["audio_conv2"] = ("audio_padded_frames_4", f * 9 * c * c * -(-mel // 4))
        terms["audio_conv3"] = ("audio_padded_frames_8", f * 9 * c * c * -(-mel // 8))
        terms["audio_conv_out"] = ("audio_padded_frames_8", f * c * -(-mel // 8) * d)  # Linear(c·⌈mel/8⌉, d)
        projection = d * (d + out)  # proj1 (d → d), proj2 (d → out)
    else:
        terms["audio_conv1"] = ("audio_padded_frames", f * 3 * mel * d)  # Conv1d(mel, d, 3, s1)
        terms["audio_conv2"] = ("audio_padded_frames_2", f * 3 * d * d)  # Conv1d(d, d, 3, s2)
        projection = d * out  # proj after the average pool
    terms["audio_blocks"] = ("audio_tokens", f * d * (4 * d + 2 * ffn) * layers)  # q, k, v, out; fc1, fc2
    terms["audio_attention"] = ("audio_seqlen_squared_sum", 2 * f * d * layers)  # bidirectional, per chunk
    terms["audio_projection"] = ("audio_output_tokens", f * projection)
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
    audio_backward: bool = True,
    include_audio: bool = True,
    mtp_layers: int | None = None,
) -> FlopsCoefficients:
    """The per-count coefficients of :func:`model_flops` for ``config``.

    Text model (``config.text_config`` when present), ``h`` hidden size, ``V`` vocab,
    ``d_q = heads·head_dim``, ``d_kv = kv_heads·head_dim``, ``d_v = kv_heads·v_head_dim``,
    ``d_o = heads·v_head_dim`` (``v_head_dim = head_dim`` unless set apart, MiMo-V2-Flash), ``e = 3`` for
    a gated MLP (SwiGLU: gate, up, down) else 2. Per token, training:

    ========================  ==========================================================
    ``mlp``                   ``6·h·e·ffn · N_dense``
    ``moe``                   ``6·h·e·(moe_ffn·k + shared_ffn) · N_moe`` (k experts per token)
    ``attention_projections`` ``6·(h·(d_q + d_kv + d_v + gate) + d_o·h) · L_attn``
                              (``gate = d_o`` for an attention output gate, Qwen3-Next / 3.5)
    ``linear_attention``      ``6·(h·(2·d_k + 2·d_v + 2·n_v) + K·(2·d_k + d_v) + 4·n_v·d_hk·d_hv
                              + d_v·h) · L_linear`` (Gated DeltaNet; no ``Σ sᵢ²`` term)
    ``logits``                ``6·h·V``
    ========================  ==========================================================

    and per unit of ``Σ sᵢ²``: ``core_attention = 3·(d_q + d_o) · L_attn`` (causal: ``Q·Kᵀ`` over
    ``head_dim``, ``P·V`` over ``v_head_dim``; ``6·d_q`` when they are equal).
    ``N_moe`` counts layers with experts (``mlp_layer_types``, ``mlp_only_layers``,
    ``decoder_sparse_step``, ``first_k_dense_replace``, ``moe_layer_freq`` respected), ``N_dense``
    the others; the layers' kinds come from ``layer_types`` (or ``full_attention_interval``, ...).

    Other layer kinds, and ``mtp_layers``: docs/flops.md, "flops_coefficients: other layer kinds, multi-token
    prediction".

    Vision, audio terms (``vision_*``, ``audio_*``): docs/flops.md, "The vision tower", "The audio encoder".
    """
    check_config(config)
    terms = _text_terms(config, gated_mlp, attention_output_gate, layer_types, mtp_layers)
    root = model_root(config)
    vision = config_get(root, "vision_config", None)
    if include_vision and vision is not None:
        terms.update(_vision_terms(vision, root, vision_gated_mlp, vision_backward))
    audio = config_get(root, "audio_config", None)
    if include_audio and audio_family(audio) is not None:
        terms.update(_audio_terms(audio, audio_backward))
    return FlopsCoefficients(terms)

