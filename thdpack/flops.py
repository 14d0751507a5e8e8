"""Honest FLOPs for packed (THD) training: ``Σ sᵢ²`` from ``cu_seqlens``, model FLOPs
from a model config, TFLOP/s/GPU and MFU.

Counting a pack as one sequence of length ``pack_len`` charges causal attention
``pack_len²``; the kernels do ``Σ sᵢ²`` over the real sub-sequence lengths. Every
count here is exact integer arithmetic on what the batches actually hold.

Conventions (the same as Megatron-LM's ``num_floating_point_operations``):

- a GEMM ``[m, k] @ [k, n]`` is ``2·m·k·n`` FLOPs; training is 3x the forward
  (forward, backward data-gradient, backward weight-gradient), hence the ``6``s;
- norms, activations, softmax, rotary embeddings, routers, biases and the
  embedding lookup are not counted (each is well under 1% of a layer);
- causal core attention of a sequence of length ``s`` costs
  ``2·(2·s²·d_q)/2`` forward (``QKᵀ`` and ``A·V``, half of the square), so
  ``6·d_q·s²`` for training, and the packed version sums it over sub-sequences:
  ``6·d_q·Σ sᵢ²``. Bidirectional (vision) attention is twice that.

The core does not import ``transformers``: a config is a ``transformers``
config object or a plain dict; attributes are read with ``getattr`` / ``dict.get``,
and a VL config's ``text_config`` / ``vision_config`` are used when present.
See ``docs/flops.md`` for the formulas and worked numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "GPU_PEAK_TFLOPS",
    "FlopsAccumulator",
    "FlopsCoefficients",
    "FlopsMeter",
    "VisionStats",
    "attention_overcount_factor",
    "cp_seqlen_squared_share",
    "flops_coefficients",
    "model_flops",
    "model_flops_breakdown",
    "model_overcount_factor",
    "overcount_report",
    "peak_tflops_for",
    "seqlen_squared_sum",
    "throughput",
    "vision_seqlen_stats",
]

_INT64_SAFE = 3_037_000_499  # floor(sqrt(2**63 - 1)): a sum of squares below this total fits int64


# =========================================================================== Σ sᵢ²


def _as_int64_tensor(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(torch.int64)
    return torch.as_tensor(np.asarray(x), dtype=torch.int64)


def segment_lengths(cu_seqlens, cu_seqlens_argmin=None) -> torch.Tensor:
    """Lengths of the valid segments of ``cu_seqlens`` (int64, same device, no host sync).

    Args:
        cu_seqlens: int ``[n+1]`` cumulative lengths, or ``[B, N]`` one row per
            micro-batch (NeMo / Megatron-Bridge packed batches), torch or numpy.
            A row is cut at its first negative entry (rows padded with ``-1``).
        cu_seqlens_argmin: optional index of the first padding entry of each row
            (an int, or a ``[B]`` / ``[B, 1]`` tensor): only ``cu_seqlens[:argmin]``
            is read. This is the NeMo convention, where ``argmin`` of a ``-1``
            padded row points at its first ``-1``.

    Returns:
        int64 ``[B, N-1]`` (``[1, n]`` for a 1-D input): segment lengths, 0 for
        entries past the cut. Zero-length segments stay 0 and so add nothing.
    """
    cu = _as_int64_tensor(cu_seqlens)
    if cu.ndim == 1:
        cu = cu.unsqueeze(0)
    if cu.ndim != 2:
        raise ValueError(f"cu_seqlens must be 1-D or 2-D, got shape {tuple(cu.shape)}")
    if cu.shape[1] == 0:
        return cu.new_zeros((cu.shape[0], 0))
    valid = torch.cumsum((cu < 0).to(torch.int64), dim=1) == 0  # before the first negative entry
    if cu_seqlens_argmin is not None:
        limit = torch.as_tensor(cu_seqlens_argmin, device=cu.device).to(torch.int64).reshape(-1, 1)
        if limit.shape[0] not in (1, cu.shape[0]):
            raise ValueError(f"cu_seqlens_argmin has {limit.shape[0]} rows, cu_seqlens {cu.shape[0]}")
        valid = valid & (torch.arange(cu.shape[1], device=cu.device).unsqueeze(0) < limit)
    lengths = cu[:, 1:] - cu[:, :-1]
    return torch.where(valid[:, 1:], lengths, torch.zeros_like(lengths))  # valid is a prefix per row


def _exact_square_sum(lengths: torch.Tensor) -> int:
    """``Σ x²`` of a CPU/any int64 tensor as an exact Python int (validates, host sync)."""
    if lengths.numel() == 0:
        return 0
    if bool((lengths < 0).any()):
        raise ValueError("cu_seqlens must be non-decreasing within its valid entries")
    total = int(lengths.sum())
    if total <= _INT64_SAFE:  # Σ x² <= (Σ x)² < 2**63
        return int((lengths * lengths).sum())
    return sum(v * v for v in lengths.flatten().tolist())  # Python ints: exact for any length


def seqlen_squared_sum(
    cu_seqlens=None,
    *,
    cu_seqlens_argmin=None,
    cu_seqlens_unpadded=None,
    cu_seqlens_unpadded_argmin=None,
    as_tensor: bool = False,
):
    """``Σ sᵢ²`` over the real sub-sequence lengths ``sᵢ = cu[i+1] − cu[i]``.

    Args:
        cu_seqlens: int ``[n+1]`` (or ``[B, N]``, rows summed) cumulative lengths,
            torch (any device) or numpy / list.
        cu_seqlens_argmin: cut each row at this index (NeMo's ``-1`` padding);
            without it a row is cut at its first negative entry anyway.
        cu_seqlens_unpadded: the real-length ``cu_seqlens`` when ``cu_seqlens``
            holds padded lengths (Megatron-Bridge with CP / FP8 padding). Preferred
            whenever given: attention runs over the real lengths.
        cu_seqlens_unpadded_argmin: its cut index.
        as_tensor: return a 0-dim int64 tensor on the input's device, computed
            without any host sync (nothing is validated then; exact while
            ``Σ sᵢ² < 2⁶³``, always true for int32 ``cu_seqlens``). For numpy input a
            ``numpy.int64``.

    Returns:
        A Python int (exact: int64 arithmetic, switching to Python integers when the
        total could overflow), or the tensor described under ``as_tensor``.
        Zero-length segments contribute nothing.

    A :class:`thdpack.ThdBatch` gives it as ``batch.seqlen_squared_sum``.
    """
    if cu_seqlens_unpadded is not None:
        cu, argmin = cu_seqlens_unpadded, cu_seqlens_unpadded_argmin
    else:
        cu, argmin = cu_seqlens, cu_seqlens_argmin
    if cu is None:
        raise ValueError("pass cu_seqlens or cu_seqlens_unpadded")
    is_numpy = not isinstance(cu, torch.Tensor)
    lengths = segment_lengths(cu, argmin)
    if as_tensor:
        out = (lengths * lengths).sum()
        return np.int64(out.item()) if is_numpy else out
    return _exact_square_sum(lengths.cpu())


def cp_seqlen_squared_share(seq_lens, cu_seqlens_padded, cp_size: int, cp_rank: int):
    """CP rank ``cp_rank``'s exact share of ``Σ sᵢ²`` under the dual-chunk split.

    Sample i's padded span ``Pᵢ`` is cut into ``2·cp`` chunks of ``hᵢ = Pᵢ / (2·cp)``;
    rank r holds chunks ``r`` and ``2·cp−1−r``. Chunk c holds real positions
    ``[aᵢ, bᵢ)`` with ``a = min(s, c·h)``, ``b = min(s, (c+1)·h)``, and its causal
    attention work is ``(b² − a²)/2`` (queries at q attend to keys 0..q). The share is
    ``Σᵢ Σ_{c ∈ {r, 2cp−1−r}} (bᵢ,c² − aᵢ,c²)``: the attention this rank computes,
    and the shares of all ranks add up to ``Σ sᵢ²`` exactly (the chunks tile each sample).

    Returns an int64 0-dim tensor on the device of ``seq_lens`` (no host sync).
    """
    s = _as_int64_tensor(seq_lens)
    cu = _as_int64_tensor(cu_seqlens_padded).to(s.device)
    h = (cu[1:] - cu[:-1]) // (2 * cp_size)
    share = torch.zeros((), dtype=torch.int64, device=s.device)
    for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
        lo = torch.minimum(s, c * h)
        hi = torch.minimum(s, (c + 1) * h)
        share = share + (hi * hi - lo * lo).sum()
    return share


def _segments_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Segment lengths of one packed row whose positions restart at 0 for every sample."""
    pos = position_ids.reshape(-1)
    total = pos.numel()
    starts = torch.nonzero(pos == 0).flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    ends = torch.cat([starts[1:], starts.new_tensor([total])])
    return (ends - starts).to(torch.int64)


# =========================================================================== vision


@dataclass(frozen=True)
class VisionStats:
    """Attention work of a Qwen-VL style vision tower over some images / videos.

    Attributes:
        patches: ViT patches ``Σ t·h·w`` over the ``grid_thw`` rows.
        seqlen_squared_sum: ``Σ t·(h·w)²``: every frame (temporal patch) is its own
            attention segment of ``h·w`` patches (Qwen2-VL / 2.5-VL / 3-VL / 3.5).
        window_seqlen_squared_sum: ``Σ`` over Qwen2.5-VL attention windows of
            (patches in the window)², 0 for towers without window attention.
    """

    patches: int = 0
    seqlen_squared_sum: int = 0
    window_seqlen_squared_sum: int = 0

    def __add__(self, other: "VisionStats") -> "VisionStats":
        return VisionStats(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


def _pair(v) -> tuple[int, int]:
    if isinstance(v, (list, tuple)):
        return (int(v[0]), int(v[-1]))
    return (int(v), int(v))


def _vision_config_of(config):
    """``config.vision_config``, ``config`` itself when it is a vision config (has ``depth``), else None."""
    vision = _get(config, "vision_config")
    if vision is None and _get(config, "depth") is not None:
        vision = config
    return vision


def _window_patches(vision_config) -> int | None:
    """Side of a Qwen2.5-VL attention window in merge units (``window_size // merge // patch``),
    or None for a tower without window attention."""
    window = _get(vision_config, "window_size")
    if window is None or _get(vision_config, "fullatt_block_indexes") is None:
        return None
    return int(window) // int(_get(vision_config, "spatial_merge_size", 1)) // _pair(_get(vision_config, "patch_size"))[0]


def vision_seqlen_stats(grid_thw, vision_config=None) -> VisionStats:
    """:class:`VisionStats` of ``grid_thw`` (int ``[k, 3]``: temporal, height, width in
    patches, per image or video; torch, numpy or nested lists).

    Window sums follow Qwen2.5-VL's ``get_window_index``: each frame's
    ``(h/m) × (w/m)`` grid of merge units (``m = spatial_merge_size``) is tiled by
    ``W × W`` windows, ``W = window_size // m // patch_size``, the last row / column of
    windows partial. A window of ``r × c`` merge units holds ``r·c·m²`` patches, so a
    frame contributes ``m⁴ · (Σ_rows rᵢ²) · (Σ_cols cⱼ²)`` with ``Σ rᵢ² = ⌊H/W⌋·W² + (H mod W)²``.
    ``vision_config`` (a config, its ``vision_config`` or a dict) is needed only for windows.
    """
    vision_config = _vision_config_of(vision_config)
    if isinstance(grid_thw, torch.Tensor):
        grid_thw = grid_thw.detach().cpu().numpy()
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    if grid.size and (grid < 0).any():
        raise ValueError("grid_thw must be non-negative")
    patches = full = window = 0
    side = _window_patches(vision_config) if vision_config is not None else None
    merge = int(_get(vision_config, "spatial_merge_size", 1)) if vision_config is not None else 1
    for t, h, w in grid.tolist():
        patches += t * h * w
        full += t * (h * w) ** 2
        if side:
            gh, gw = h // merge, w // merge
            rows = (gh // side) * side**2 + (gh % side) ** 2
            cols = (gw // side) * side**2 + (gw % side) ** 2
            window += t * merge**4 * rows * cols
    return VisionStats(patches, full, window)


# =========================================================================== model FLOPs


def _get(cfg, key, default=None):
    """``cfg[key]`` or ``cfg.key``; ``default`` when missing or None."""
    if cfg is None:
        return default
    value = cfg.get(key, None) if isinstance(cfg, Mapping) else getattr(cfg, key, None)
    return default if value is None else value


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
    text = _get(config, "text_config", config)
    model_types = {_get(text, "model_type"), _get(config, "model_type")} - {None}

    h = int(_get(text, "hidden_size"))
    num_layers = int(_get(text, "num_hidden_layers"))
    vocab = int(_get(text, "vocab_size"))
    heads = int(_get(text, "num_attention_heads"))
    kv_heads = int(_get(text, "num_key_value_heads", heads))
    head_dim = int(_get(text, "head_dim", h // heads))
    if _get(text, "kv_lora_rank") is not None or _get(text, "q_lora_rank") is not None:
        raise NotImplementedError("multi-latent attention (DeepSeek MLA) is not covered")

    # ---- layer kinds
    if layer_types is None:
        layer_types = _get(text, "layer_types")
    if layer_types is None:
        interval = _get(text, "full_attention_interval")
        if interval:
            layer_types = ["linear_attention" if (i + 1) % int(interval) else "full_attention" for i in range(num_layers)]
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
    n_attn = layer_types.count("full_attention")
    n_linear = layer_types.count("linear_attention")

    # ---- MLP / MoE layers
    num_experts = int(_get(text, "num_experts", 0) or _get(text, "num_local_experts", 0) or _get(text, "n_routed_experts", 0))
    if num_experts:
        mlp_only = set(_get(text, "mlp_only_layers", []) or [])
        sparse_step = int(_get(text, "decoder_sparse_step", 1))
        first_dense = int(_get(text, "first_k_dense_replace", 0))
        layer_freq = int(_get(text, "moe_layer_freq", 1))
        is_moe = [
            i not in mlp_only and (i + 1) % sparse_step == 0 and i >= first_dense and i % layer_freq == 0
            for i in range(num_layers)
        ]
    else:
        is_moe = [False] * num_layers
    n_moe = sum(is_moe)
    n_dense = num_layers - n_moe

    if gated_mlp is None:
        gated_mlp = not (model_types & NON_GATED_MLP_MODEL_TYPES)
    e = 3 if gated_mlp else 2
    if attention_output_gate is None:
        attention_output_gate = bool(_get(text, "attn_output_gate", False)) or bool(model_types & GATED_ATTENTION_MODEL_TYPES)

    d_q = heads * head_dim
    d_kv = kv_heads * head_dim
    gate = d_q if attention_output_gate else 0

    terms: dict = {}
    if n_dense:
        ffn = int(_get(text, "intermediate_size"))
        terms["mlp"] = ("tokens", 6 * h * e * ffn * n_dense)
    if n_moe:
        moe_ffn = int(_get(text, "moe_intermediate_size", _get(text, "intermediate_size")))
        top_k = int(_get(text, "num_experts_per_tok"))
        shared = int(_get(text, "shared_expert_intermediate_size", 0))
        if not shared and _get(text, "n_shared_experts"):
            shared = int(_get(text, "n_shared_experts")) * moe_ffn
        terms["moe"] = ("tokens", 6 * h * e * (moe_ffn * top_k + shared) * n_moe)
    if n_attn:
        terms["attention_projections"] = ("tokens", 6 * (h * (d_q + 2 * d_kv + gate) + d_q * h) * n_attn)
        terms["core_attention"] = ("seqlen_squared_sum", 6 * d_q * n_attn)
    if n_linear:
        dhk = int(_get(text, "linear_key_head_dim"))
        dhv = int(_get(text, "linear_value_head_dim"))
        nk = int(_get(text, "linear_num_key_heads"))
        nv = int(_get(text, "linear_num_value_heads"))
        conv = int(_get(text, "linear_conv_kernel_dim", 4))
        dk, dv = dhk * nk, dhv * nv
        per_layer = (
            h * (2 * dk + 2 * dv + 2 * nv)  # in_proj: q, k, v, z (output gate), b, a
            + conv * (2 * dk + dv)  # depthwise causal conv1d over q, k, v
            + 4 * nv * dhk * dhv  # gated delta rule: KKᵀ, VKᵀ, S(α(I − βKKᵀ)), SQ per head
            + dv * h  # out_proj
        )
        terms["linear_attention"] = ("tokens", 6 * per_layer * n_linear)
    terms["logits"] = ("tokens", 6 * h * vocab)
    return terms


def _vision_terms(vision, config, vision_gated_mlp, vision_backward) -> dict:
    if _get(vision, "embed_dim") is not None:  # Qwen2-VL: embed_dim is the ViT width, hidden_size the merger output
        width = int(_get(vision, "embed_dim"))
        out = int(_get(vision, "hidden_size"))
        inter = int(width * float(_get(vision, "mlp_ratio", 4)))
    else:  # Qwen2.5-VL, Qwen3-VL, Qwen3.5
        width = int(_get(vision, "hidden_size"))
        out = int(_get(vision, "out_hidden_size"))
        inter = int(_get(vision, "intermediate_size"))
    depth = int(_get(vision, "depth"))
    ph, pw = _pair(_get(vision, "patch_size"))
    temporal = int(_get(vision, "temporal_patch_size", 1))
    channels = int(_get(vision, "in_channels", _get(vision, "in_chans", 3)))
    merge = int(_get(vision, "spatial_merge_size", 1))
    n_mergers = 1 + len(_get(vision, "deepstack_visual_indexes", []) or [])
    if vision_gated_mlp is None:
        types = {_get(vision, "model_type"), _get(config, "model_type")} - {None}
        if types:
            vision_gated_mlp = any(t.startswith("qwen2_5") for t in types)
        else:
            vision_gated_mlp = _get(vision, "hidden_act") in ("silu", "swish")
    e = 3 if vision_gated_mlp else 2
    full_blocks = depth
    if _window_patches(vision) is not None:
        full_blocks = len(set(_get(vision, "fullatt_block_indexes")))
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
    terms = _text_terms(config, gated_mlp, attention_output_gate, layer_types)
    vision = _get(config, "vision_config")
    if include_vision and vision is not None:
        terms.update(_vision_terms(vision, config, vision_gated_mlp, vision_backward))
    return FlopsCoefficients(terms)


def _as_count(x):
    if isinstance(x, torch.Tensor):
        return x.to(torch.float64)
    if isinstance(x, np.generic):
        return int(x)
    return x


def model_flops_breakdown(
    config,
    num_tokens,
    seqlen_squared_sum,
    *,
    vision_patches=None,
    vision_seqlen_squared_sum=None,
    vision_window_seqlen_squared_sum=None,
    vision_grid_thw=None,
    **options,
) -> dict:
    """Training FLOPs per term (see :func:`flops_coefficients`), as a dict ``{term: FLOPs}``.

    Arguments as :func:`model_flops`.
    """
    if vision_grid_thw is not None:
        if vision_patches is not None:
            raise ValueError("pass vision_grid_thw or the vision counts, not both")
        stats = vision_seqlen_stats(vision_grid_thw, config)
        vision_patches = stats.patches
        vision_seqlen_squared_sum = stats.seqlen_squared_sum
        vision_window_seqlen_squared_sum = stats.window_seqlen_squared_sum
    has_vision = vision_patches is not None and not (isinstance(vision_patches, int) and vision_patches == 0)
    coefficients = flops_coefficients(config, include_vision=has_vision, **options)
    if has_vision and _get(config, "vision_config") is None:
        raise ValueError("vision counts given but the config has no vision_config")
    counts = {
        "tokens": num_tokens,
        "seqlen_squared_sum": seqlen_squared_sum,
        "vision_patches": vision_patches,
        "vision_seqlen_squared_sum": vision_seqlen_squared_sum,
        "vision_window_seqlen_squared_sum": vision_window_seqlen_squared_sum,
    }
    out = {}
    for name, (count, coefficient) in coefficients.terms.items():
        value = counts[count]
        if value is None:
            raise ValueError(
                f"{name} needs {count}: pass it (thdpack.flops.vision_seqlen_stats computes the vision sums) "
                "or vision_grid_thw"
            )
        out[name] = coefficient * _as_count(value)
    return out


def model_flops(
    config,
    num_tokens,
    seqlen_squared_sum,
    *,
    vision_patches=None,
    vision_seqlen_squared_sum=None,
    vision_window_seqlen_squared_sum=None,
    vision_grid_thw=None,
    **options,
):
    """Training FLOPs (forward + backward) of a model on packed batches.

    ``FLOPs = Σ_terms coefficient × count`` with the per-term formulas of
    :func:`flops_coefficients`; in short, per token
    ``6·h·(ffn·e·N_dense + moe_ffn·k·e·N_moe + shared·e·N_moe)``
    ``+ 6·L_attn·(h·(d_q + 2·d_kv + gate) + d_q·h) + GDN layers + 6·h·V``, plus
    ``6·L_attn·d_q·Σ sᵢ²``, plus the vision tower. With ``Σ sᵢ² = B·s²`` and
    ``num_tokens = B·s`` it is Megatron-LM's ``num_floating_point_operations`` for
    ``B`` sequences of length ``s``.

    Args:
        config: a ``transformers`` config or a dict (VL configs: ``text_config`` and
            ``vision_config`` are used).
        num_tokens: tokens through the language model (real tokens; padded ones to
            count the work done on pad slots too).
        seqlen_squared_sum: ``Σ sᵢ²`` (:func:`seqlen_squared_sum`).
        vision_patches, vision_seqlen_squared_sum, vision_window_seqlen_squared_sum:
            the vision tower's counts (:class:`VisionStats`), or ``vision_grid_thw``
            (image and video grids concatenated) to compute them.
        options: ``gated_mlp``, ``attention_output_gate``, ``layer_types``,
            ``vision_gated_mlp``, ``vision_backward`` (see :func:`flops_coefficients`).

    Returns:
        A Python int when the counts are ints; a float64 tensor (on the counts'
        device, no host sync) when any count is a tensor.
    """
    terms = model_flops_breakdown(
        config,
        num_tokens,
        seqlen_squared_sum,
        vision_patches=vision_patches,
        vision_seqlen_squared_sum=vision_seqlen_squared_sum,
        vision_window_seqlen_squared_sum=vision_window_seqlen_squared_sum,
        vision_grid_thw=vision_grid_thw,
        **options,
    )
    return sum(terms.values())


# =========================================================================== accumulation


_COUNTS = (
    "samples",
    "tokens",
    "padded_tokens",
    "seqlen_squared_sum",
    "vision_patches",
    "vision_seqlen_squared_sum",
    "vision_window_seqlen_squared_sum",
)


def _total(x):
    """A CPU tensor becomes a Python int; device tensors stay lazy (no host sync)."""
    if isinstance(x, torch.Tensor) and x.device.type == "cpu":
        return int(x)
    return x


class FlopsAccumulator:
    """Counts added micro-batch by micro-batch: samples, real tokens, padded tokens,
    ``Σ sᵢ²``, vision patches and the vision attention sums (:class:`VisionStats`).

    ``add`` takes whatever a step consumes:

    - a :class:`thdpack.ThdBatch`; a CP shard adds its rank's share: its local real
      tokens, its local stream, and :func:`cp_seqlen_squared_share` of ``Σ sᵢ²``
      (samples and vision are counted on CP rank 0). The shares of all CP ranks add
      up exactly to the whole batch: every sample is counted once, not once per rank;
    - a mapping of model inputs: ``cu_seqlens_unpadded`` / ``cu_seqlens`` (with their
      ``*_argmin``, NeMo / Megatron-Bridge), else ``cu_seq_lens_q`` (transformers
      flash-attention kwargs), else ``position_ids`` of one packed row restarting at 0
      (a 4-row mRoPE tensor: its text row), else the BSHD fallback from
      ``input_ids`` ``[B, S]``; plus ``image_grid_thw`` / ``video_grid_thw``;
    - a tensor of token ids ``[B, S]`` (BSHD) or ``[T]``.

    The BSHD fallback adds ``B·S`` tokens and ``B·S²`` to ``Σ sᵢ²``: exactly the legacy
    pack-length count, so dense pretraining figures do not change.

    Counts are Python ints; counts read from tensors on an accelerator are kept as
    device tensors until read (no host sync per micro-batch).

    Args:
        vision_config: the model config (or its ``vision_config``); needed to sum
            Qwen2.5-VL attention windows from ``grid_thw``.
    """

    def __init__(self, vision_config=None):
        self.vision_config = _vision_config_of(vision_config)
        self.reset()

    def reset(self) -> None:
        for name in _COUNTS:
            setattr(self, name, 0)

    def _add(self, **counts) -> None:
        for name, value in counts.items():
            setattr(self, name, getattr(self, name) + _total(value))

    # ---- adders ----------------------------------------------------------
    def add(self, batch) -> "FlopsAccumulator":
        """Add one micro-batch (see the class docstring for what ``batch`` may be)."""
        if hasattr(batch, "cu_seqlens") and hasattr(batch, "seq_lens"):
            self._add_thd_batch(batch)
        elif isinstance(batch, Mapping):
            self._add_inputs(batch)
        elif isinstance(batch, torch.Tensor):
            if batch.ndim == 1:
                self.add_bshd(1, batch.shape[0])
            else:
                self.add_bshd(batch.shape[0], batch.shape[-1])
        else:
            raise TypeError(f"cannot count a batch of type {type(batch).__name__}")
        return self

    def _add_thd_batch(self, batch) -> None:
        seq_lens = batch.seq_lens.to(torch.int64)
        if getattr(batch, "cp_size", 1) > 1:
            first = batch.cp_rank == 0
            self._add(
                samples=(seq_lens > 0).sum() if first else 0,
                tokens=batch.local_seq_lens.to(torch.int64).sum(),
                padded_tokens=batch.input_ids.numel(),
                seqlen_squared_sum=cp_seqlen_squared_share(seq_lens, batch.cu_seqlens_padded, batch.cp_size, batch.cp_rank),
            )
            if first:
                self._add_vision_from(batch.extras)
            return
        self._add(
            samples=(seq_lens > 0).sum(),
            tokens=seq_lens.sum(),
            padded_tokens=batch.input_ids.numel(),
            seqlen_squared_sum=(seq_lens * seq_lens).sum(),
        )
        self._add_vision_from(batch.extras)

    def add_cu_seqlens(self, cu_seqlens=None, *, cu_seqlens_argmin=None, cu_seqlens_unpadded=None,
                       cu_seqlens_unpadded_argmin=None, num_padded_tokens=None) -> "FlopsAccumulator":
        """Add a packed micro-batch given by its cumulative lengths (arguments as
        :func:`seqlen_squared_sum`). Padded tokens: ``num_padded_tokens`` or the total
        of ``cu_seqlens`` (the padded layout when ``cu_seqlens_unpadded`` is given)."""
        if cu_seqlens_unpadded is not None:
            real = segment_lengths(cu_seqlens_unpadded, cu_seqlens_unpadded_argmin)
        else:
            real = segment_lengths(cu_seqlens, cu_seqlens_argmin)
        if num_padded_tokens is None:
            layout = segment_lengths(cu_seqlens, cu_seqlens_argmin) if cu_seqlens is not None else real
            num_padded_tokens = layout.sum()
        device_lazy = real.device.type != "cpu"
        self._add(
            samples=(real > 0).sum(),
            tokens=real.sum(),
            padded_tokens=num_padded_tokens,
            seqlen_squared_sum=(real * real).sum() if device_lazy else _exact_square_sum(real),
        )
        return self

    def add_bshd(self, micro_batch_size: int, seq_len: int) -> "FlopsAccumulator":
        """The legacy count of ``micro_batch_size`` sequences of ``seq_len`` tokens:
        ``B·S`` tokens and ``B·S²`` for ``Σ sᵢ²``."""
        b, s = int(micro_batch_size), int(seq_len)
        self._add(samples=b, tokens=b * s, padded_tokens=b * s, seqlen_squared_sum=b * s * s)
        return self

    def add_vision(self, grid_thw) -> "FlopsAccumulator":
        """Add images / videos by their ``grid_thw`` rows (:func:`vision_seqlen_stats`)."""
        stats = vision_seqlen_stats(grid_thw, self.vision_config)
        self._add(
            vision_patches=stats.patches,
            vision_seqlen_squared_sum=stats.seqlen_squared_sum,
            vision_window_seqlen_squared_sum=stats.window_seqlen_squared_sum,
        )
        return self

    def _add_vision_from(self, mapping) -> None:
        for key in ("image_grid_thw", "video_grid_thw"):
            grid = mapping.get(key) if mapping is not None else None
            if grid is not None and len(grid):
                self.add_vision(grid)

    def _add_inputs(self, inputs: Mapping) -> None:
        ids = inputs.get("input_ids")
        padded = ids.numel() if isinstance(ids, torch.Tensor) else None
        if inputs.get("cu_seqlens_unpadded") is not None or inputs.get("cu_seqlens") is not None:
            self.add_cu_seqlens(
                inputs.get("cu_seqlens"),
                cu_seqlens_argmin=inputs.get("cu_seqlens_argmin"),
                cu_seqlens_unpadded=inputs.get("cu_seqlens_unpadded"),
                cu_seqlens_unpadded_argmin=inputs.get("cu_seqlens_unpadded_argmin"),
                num_padded_tokens=padded,
            )
        elif inputs.get("cu_seq_lens_q") is not None:
            self.add_cu_seqlens(inputs["cu_seq_lens_q"], num_padded_tokens=padded)
        elif isinstance(ids, torch.Tensor):
            pos = inputs.get("position_ids")
            rows = ids.shape[0] if ids.ndim == 2 else 1
            if isinstance(pos, torch.Tensor) and rows == 1:
                if pos.ndim == 3 and pos.shape[0] == 4:  # mRoPE with the text positions first
                    pos = pos[0]
                if pos.ndim == 3:  # 3-row mRoPE: sample starts cannot be read off it
                    pos = None
            else:
                pos = None
            if pos is not None:
                lengths = _segments_from_position_ids(pos)
                self._add(samples=int(lengths.numel()), tokens=int(lengths.sum()), padded_tokens=padded,
                          seqlen_squared_sum=_exact_square_sum(lengths.cpu()))
            else:
                self.add(ids)
        else:
            raise ValueError("inputs hold none of cu_seqlens, cu_seq_lens_q, input_ids: nothing to count")
        self._add_vision_from(inputs)

    # ---- combining -------------------------------------------------------
    def counts(self) -> dict:
        """The counts as Python ints (host sync for device counts)."""
        return {name: int(getattr(self, name)) for name in _COUNTS}

    def merge(self, other: "FlopsAccumulator") -> "FlopsAccumulator":
        """Add ``other``'s counts into this accumulator."""
        self._add(**{name: getattr(other, name) for name in _COUNTS})
        return self

    def all_reduce(self, group=None) -> "FlopsAccumulator":
        """Sum the counts over ``group`` (``torch.distributed``; a no-op when it is not
        initialized). Reduce over the ranks that see *different* data: data parallel
        × context parallel (CP shards hold shares, see the class docstring), not
        tensor / pipeline parallel ranks, which see the same micro-batches."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self
        device = torch.device("cpu")
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        values = torch.stack([torch.as_tensor(getattr(self, n), dtype=torch.int64).to(device) for n in _COUNTS])
        dist.all_reduce(values, group=group)
        for name, value in zip(_COUNTS, values.tolist()):
            setattr(self, name, value)
        return self

    # ---- FLOPs -----------------------------------------------------------
    def model_flops(self, config, *, count_padding: bool = False, **options):
        """:func:`model_flops` of the counts so far; ``count_padding`` charges the linear
        terms for the padded tokens (the work done on pad slots) instead of the real ones."""
        window = self.vision_window_seqlen_squared_sum
        if self.vision_config is None and _get(config, "vision_config") is not None:
            window = None if _window_patches(_get(config, "vision_config")) is not None else window
        patches = self.vision_patches
        return model_flops(
            config,
            self.padded_tokens if count_padding else self.tokens,
            self.seqlen_squared_sum,
            vision_patches=patches if not (isinstance(patches, int) and patches == 0) else None,
            vision_seqlen_squared_sum=self.vision_seqlen_squared_sum,
            vision_window_seqlen_squared_sum=window,
            **options,
        )

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={getattr(self, n)}" for n in _COUNTS)
        return f"FlopsAccumulator({inner})"


# =========================================================================== throughput

# Dense (no sparsity) BF16 tensor-core peaks per GPU, TFLOP/s, from the vendors' data sheets.
# Edit or pass ``peak_tflops=`` for other GPUs, clocks or precisions.
GPU_PEAK_TFLOPS = {
    "A100": 312.0,
    "A800": 312.0,
    "H100": 989.0,  # SXM
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H800": 989.0,
    "H200": 989.0,
    "GH200": 989.0,
    "H20": 148.0,
    "B200": 2250.0,
    "GB200": 2500.0,
    "L40S": 362.0,
    "MI300X": 1307.0,
}


def peak_tflops_for(device_name: str | None = None) -> float | None:
    """Peak BF16 TFLOP/s for a GPU name (the longest :data:`GPU_PEAK_TFLOPS` key it
    contains, case-insensitive); the current CUDA device when ``device_name`` is None.
    None when unknown."""
    if device_name is None:
        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    name = device_name.lower()
    matches = [k for k in GPU_PEAK_TFLOPS if k.lower() in name]
    return GPU_PEAK_TFLOPS[max(matches, key=len)] if matches else None


def throughput(flops, seconds: float, world_size: int = 1, peak_tflops: float | str | None = None) -> dict:
    """TFLOP/s per GPU and MFU.

    Args:
        flops: FLOPs done by ``world_size`` GPUs in ``seconds`` (e.g. :func:`model_flops`
            of the global batch of a step).
        seconds: wall-clock time of that work.
        world_size: GPUs that shared the work.
        peak_tflops: the GPU's peak TFLOP/s, or a GPU name looked up in
            :data:`GPU_PEAK_TFLOPS`; None detects the current CUDA device.

    Returns:
        ``{"tflops_per_gpu": flops / seconds / world_size / 1e12, "mfu": tflops_per_gpu
        / peak (None when the peak is unknown), "peak_tflops": peak}``.
    """
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if isinstance(peak_tflops, str):
        name = peak_tflops
        peak_tflops = GPU_PEAK_TFLOPS.get(name, peak_tflops_for(name))
        if peak_tflops is None:
            raise KeyError(f"unknown GPU {name!r}; known: {sorted(GPU_PEAK_TFLOPS)}")
    elif peak_tflops is None:
        peak_tflops = peak_tflops_for()
    tflops = float(flops) / seconds / world_size / 1e12
    return {"tflops_per_gpu": tflops, "mfu": tflops / peak_tflops if peak_tflops else None, "peak_tflops": peak_tflops}


class FlopsMeter:
    """TFLOP/s/GPU and MFU per step of a plain training loop::

        meter = FlopsMeter(model.config)
        for step, micro_batches in enumerate(loader):
            t0 = time.perf_counter()
            for batch in micro_batches:
                meter.update(batch)          # ThdBatch, CP shard, model-input dict, ...
                ...forward / backward...
            optimizer.step(); torch.cuda.synchronize()
            print(meter.step(time.perf_counter() - t0))   # {"tflops_per_gpu": ..., "mfu": ...}

    Args:
        config: model config (object or dict).
        all_reduce: sum the counts over ``group`` at every :meth:`step` (default: when
            ``torch.distributed`` is initialized). ``group`` must be the ranks that see
            different data (data parallel × context parallel).
        group: the process group (None: the default group).
        world_size: GPUs sharing the counted work; default: the world size when
            all-reducing, else 1 (pass tensor × pipeline parallel size then).
        peak_tflops: GPU peak (number or name), None to detect.
        count_padding: charge the linear terms for padded tokens too.
        flops_options: passed to :func:`model_flops` (``gated_mlp``, ``vision_backward``, ...).

    ``history`` holds one record per step; :meth:`summary` averages over all steps.
    """

    def __init__(self, config, *, all_reduce: bool | None = None, group=None, world_size: int | None = None,
                 peak_tflops: float | str | None = None, count_padding: bool = False, **flops_options):
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        self.config = config
        self.all_reduce = distributed if all_reduce is None else all_reduce
        self.group = group
        if world_size is None:
            world_size = dist.get_world_size() if (self.all_reduce and distributed) else 1
        self.world_size = world_size
        self.peak_tflops = peak_tflops
        self.count_padding = count_padding
        self.flops_options = flops_options
        self.accumulator = FlopsAccumulator(config)
        self.history: list[dict] = []
        flops_coefficients(config, **flops_options)  # fail now on an unsupported config

    def update(self, batch) -> None:
        """Count one micro-batch."""
        self.accumulator.add(batch)

    def step(self, seconds: float) -> dict:
        """Close a step that took ``seconds``: reduce, compute, reset. Returns the record
        (``model_flops``, ``seconds``, ``tflops_per_gpu``, ``mfu``, ``peak_tflops`` and the counts)."""
        acc = self.accumulator
        if self.all_reduce:
            acc.all_reduce(self.group)
        flops = acc.model_flops(self.config, count_padding=self.count_padding, **self.flops_options)
        if isinstance(flops, torch.Tensor):
            flops = float(flops)
        record = {"step": len(self.history) + 1, "seconds": float(seconds), "model_flops": flops}
        record.update(throughput(flops, seconds, self.world_size, self.peak_tflops))
        record.update(acc.counts())
        self.history.append(record)
        acc.reset()
        return record

    def summary(self) -> dict:
        """Totals over all steps: ``model_flops``, ``seconds``, ``tflops_per_gpu``, ``mfu``."""
        flops = sum(r["model_flops"] for r in self.history)
        seconds = sum(r["seconds"] for r in self.history)
        out = {"steps": len(self.history), "model_flops": flops, "seconds": seconds}
        if seconds > 0:
            out.update(throughput(flops, seconds, self.world_size, self.peak_tflops))
        return out


# =========================================================================== over-count


def attention_overcount_factor(n_packs: int, pack_len: int, seqlen_squared_sum) -> float:
    """``n_packs · pack_len² / Σ sᵢ²``: how much a pack-length count over-states attention
    (NaN when ``Σ sᵢ² = 0``)."""
    sq = float(seqlen_squared_sum)
    return n_packs * pack_len * pack_len / sq if sq else float("nan")


def model_overcount_factor(config, n_packs: int, pack_len: int, num_tokens, seqlen_squared_sum, **options) -> float:
    """Whole-model over-count of a pack-length count: ``model_flops`` of ``n_packs``
    sequences of ``pack_len`` (the legacy BSHD count) over ``model_flops`` of the real
    ``num_tokens`` and ``Σ sᵢ²``."""
    claimed = model_flops(config, n_packs * pack_len, n_packs * pack_len * pack_len, **options)
    real = model_flops(config, num_tokens, seqlen_squared_sum, **options)
    return claimed / real


def overcount_report(plan=None, *, pack_lengths=None, pack_len: int | None = None, config=None, **options) -> dict:
    """Over-count factors of a pack-length count for a planned dataset.

    Args:
        plan: a :class:`thdpack.PackPlan` (its packs, real piece lengths and ``pack_size``).
        pack_lengths: instead of ``plan``, one array of real lengths per pack.
        pack_len: the pack length the legacy count would charge (default: the plan's
            ``pack_size``).
        config: a model config: adds the whole-model factor.

    Returns:
        ``{"n_packs", "n_samples", "pack_len", "real_tokens", "seqlen_squared_sum",
        "attention"}``; with ``config`` also ``"model"`` (:func:`model_overcount_factor`)
        and ``"model_samples_at_pack_len"``: the factor of the other common mistake,
        charging every *sample* (piece) a whole ``pack_len`` sequence (a batch size
        counted in samples times ``seq_length``).
    """
    if plan is not None:
        lengths = np.asarray(plan.length, dtype=np.int64)
        n_packs = len(plan)
        pack_len = plan.pack_size if pack_len is None else pack_len
    elif pack_lengths is not None:
        n_packs = len(pack_lengths)
        parts = [np.asarray(p, dtype=np.int64).reshape(-1) for p in pack_lengths]
        lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if pack_len is None:
            raise ValueError("pass pack_len with pack_lengths")
    else:
        raise ValueError("pass plan or pack_lengths")
    sq = _exact_square_sum(torch.from_numpy(lengths))
    tokens = int(lengths.sum())
    out = {
        "n_packs": n_packs,
        "n_samples": int(lengths.size),
        "pack_len": int(pack_len),
        "real_tokens": tokens,
        "seqlen_squared_sum": sq,
        "attention": attention_overcount_factor(n_packs, pack_len, sq),
    }
    if config is not None:
        out["model"] = model_overcount_factor(config, n_packs, pack_len, tokens, sq, **options)
        out["model_samples_at_pack_len"] = model_overcount_factor(config, int(lengths.size), pack_len, tokens, sq, **options)
    return out
