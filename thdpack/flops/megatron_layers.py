"""The layers of a Megatron-style model config (``num_layers``, ``ffn_hidden_size``, ``num_query_groups``,
``kv_channels``, ...: a Megatron-core ``TransformerConfig`` or Megatron-Bridge model provider, or their dict)
read into a :class:`thdpack.flops.layer_costs.TextStructure`, as Megatron-Bridge's ``flop_utils`` reads it.

Two layouts. A ``hybrid_layer_pattern`` (or ``is_hybrid_model``) gives one symbol a layer: ``*`` attention,
``M`` Mamba-2, ``G`` Gated DeltaNet, ``+`` multi-latent attention, ``-`` MLP, ``E`` MoE, ``|`` a pipeline
boundary, and ``/`` separates the multi-token-prediction depths (``"M*M*/MM/MM"``: two depths of ``MM``).
Otherwise every layer is attention and a feed-forward: multi-latent (``multi_latent_attention``) or DeepSeek
sparse attention (``experimental_attention_variant: dsa``), a sliding window (``window_size``,
``window_attn_skip_freq``; MiMo-V2-Flash's ``hybrid_attention_pattern``), Gated DeltaNet layers (``gdn`` /
``gdn2`` every ``linear_attention_freq``), Kimi delta attention (``kimi_kda_layers``), experts
(``num_moe_experts``, ``moe_layer_freq``), and ``mtp_num_layers`` prediction layers shaped as the last decoder
layer (MiMo-V2-Flash's: sliding, with a dense MLP).
"""

from __future__ import annotations

from thdpack.common.align import check_int, is_int
from thdpack.common.model_config import config_get, config_int
from thdpack.flops.layer_costs import Layer, TextStructure, UnsupportedLayerError, check_topk

__all__ = ["is_megatron_config", "megatron_structure"]

_HYBRID_SYMBOLS = {"M": ("mamba2", None), "*": ("attention", None), "G": ("gdn", None), "+": ("mla", None),
                   "-": (None, "dense"), "E": (None, "moe")}
_GDN_VARIANTS = {"gdn": "gdn", "gated_delta_net": "gdn", "gdn2": "gdn2"}
# The fields of Megatron-core's MLATransformerConfig, which multi_latent_attention switches on.
_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim")


def is_megatron_config(config) -> bool:
    """Whether ``config`` names its sizes the Megatron way: ``num_layers`` (no ``num_hidden_layers``) and one of
    ``ffn_hidden_size``, ``kv_channels``, ``num_query_groups``, ``hybrid_layer_pattern``."""
    return (config_get(config, "num_layers", None) is not None
            and config_get(config, "num_hidden_layers", None) is None
            and config_get(config, "text_config", None) is None
            and not config_get(config, "is_encoder_decoder", False)
            and any(config_get(config, key, None) is not None
                    for key in ("ffn_hidden_size", "kv_channels", "num_query_groups", "hybrid_layer_pattern")))


def _padded_vocab(config) -> int:
    """``vocab_size`` rounded up to ``make_vocab_size_divisible_by × tensor_model_parallel_size``
    (Megatron's default 128 × 1): the logits GEMM runs over the padded vocabulary."""
    vocab = config_int(config, "vocab_size")
    divisor = config_int(config, "make_vocab_size_divisible_by", 128) * config_int(
        config, "tensor_model_parallel_size", 1)
    return -(-vocab // divisor) * divisor


def _window(config) -> int | None:
    """Keys a sliding-window query sees: ``window_size`` ``(left, right)`` of a causal model is the query
    and ``left`` keys before it (``right`` keys lie in the future, masked); an int is the window itself;
    ``left = -1`` is an unbounded window (full attention)."""
    size = config_get(config, "window_size", None)
    if size is None:
        return None
    if isinstance(size, (list, tuple)):
        if len(size) != 2:
            raise ValueError(f"the model config's window_size must be (left, right) or an integer, got {size!r}")
        for value in size:
            check_int(value, "the model config's window_size entries", -1, hint=f" in {size!r} (-1: unbounded)")
        return None if size[0] < 0 else int(size[0]) + 1
    check_int(size, "the model config's window_size", 1, hint=" (or a (left, right) pair)")
    return int(size)


def _layer_freq(config, key: str, default):
    """A Megatron per-layer frequency (``window_attn_skip_freq``, ``linear_attention_freq``,
    ``moe_layer_freq``): an integer >= 1 or a list of 1 / 0, one per layer (``default`` when unset).
    Megatron-core itself divides by the integer, so 0 is refused here."""
    value = config_get(config, key, default)
    if value is None or isinstance(value, (list, tuple)):
        return value
    check_int(value, f"the model config's {key}", 1, hint=" (or a list of 1 / 0, one per layer)")
    return int(value)


def _is_window_layer(config, layer_number: int) -> bool:
    """Whether the 1-indexed layer uses the window (``window_attn_skip_freq``: None every layer, an int
    ``f`` all but every f-th, a list 1 / 0 per layer, layers past its end full)."""
    skip = _layer_freq(config, "window_attn_skip_freq", None)
    if skip is None:
        return True
    if isinstance(skip, int):
        return layer_number % skip != 0
    return layer_number <= len(skip) and bool(skip[layer_number - 1])


def _per_layer_pattern(config, key: str, num_layers: int) -> list[bool]:
    """A Megatron per-layer switch: an int ``f`` (1 on all but every f-th layer, ``linear_attention_freq``)
    or a list of 1 / 0 of ``num_layers`` entries."""
    value = _layer_freq(config, key, None)
    if value is None:
        raise ValueError(f"the model config has no {key}; pass a complete config of the model")
    if isinstance(value, int):
        return [bool((i + 1) % value) for i in range(num_layers)]
    if len(value) != num_layers:
        raise ValueError(f"{key} has {len(value)} entries for {num_layers} layers")
    return [bool(v) for v in value]


def _moe_pattern(config, num_layers: int) -> list[bool]:
    """Layers with experts: ``num_moe_experts`` set, then ``moe_layer_freq`` (an int ``f``: layers
    ``0, f, 2f, ...``; or a 1 / 0 list)."""
    if not config_get(config, "num_moe_experts", None):
        return [False] * num_layers
    freq = _layer_freq(config, "moe_layer_freq", 1)
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(num_layers)]
    if len(freq) != num_layers:
        raise ValueError(f"moe_layer_freq has {len(freq)} entries for {num_layers} layers")
    return [bool(v) for v in freq]


def _indexer_layers(config, count: int) -> list[bool]:
    """Which of ``count`` layers compute their DSA top-k (``dsa_indexer_topk_freq``,
    ``dsa_indexer_skip_topk_offset``: the others reuse it), 1-indexed as Megatron-core numbers them."""
    freq = config_int(config, "dsa_indexer_topk_freq", 1)
    offset = max(config_int(config, "dsa_indexer_skip_topk_offset", 0, minimum=0), 1)
    return [max(n - offset, 0) % freq == 0 for n in range(1, count + 1)]


def _local_attention_layers(config, num_layers: int, mtp: int) -> list[bool] | None:
    """Megatron-Bridge's MiMo-V2-Flash provider: ``hybrid_attention_pattern``, 1 for a sliding-window layer and
    0 for a full one, one entry a decoder layer (its MTP layers all slide); None without it."""
    pattern = config_get(config, "hybrid_attention_pattern", None)
    if pattern is None:
        return None
    if isinstance(pattern, (str, bytes)) or not isinstance(pattern, (list, tuple)):
        raise ValueError(f"the model config's hybrid_attention_pattern must be a list of 1 (sliding window) / 0 "
                         f"(full attention), one a layer, got {type(pattern).__name__} {pattern!r}")
    if len(pattern) != num_layers or not all(is_int(value, 0, 2) for value in pattern):
        raise ValueError(f"hybrid_attention_pattern must hold {num_layers} entries of 1 (sliding window) / 0 "
                         f"(full attention), got {list(pattern)!r}")
    return [bool(value) for value in pattern] + [True] * mtp


def _check_mla_switch(config) -> None:
    """``ValueError`` for multi-latent attention fields without ``multi_latent_attention``, the switch that
    makes Megatron-core build MLA layers: counting them as plain attention would give another model's FLOPs."""
    if config_get(config, "multi_latent_attention", False):
        return
    present = [key for key in (*_MLA_FIELDS, "v_head_dim") if config_get(config, key, None) is not None]
    if any(key in _MLA_FIELDS for key in present):
        raise ValueError(f"the model config sets {', '.join(present)} (multi-latent attention) but not "
                         "multi_latent_attention: set multi_latent_attention=True for an MLA model, or drop the MLA "
                         "fields for plain attention")


def _transformer_mixers(config, num_layers: int, mtp: int) -> list[Layer]:
    """The token mixer of every decoder and MTP layer of the transformer layout."""
    total = num_layers + mtp
    variant = config_get(config, "experimental_attention_variant", None)
    _check_mla_switch(config)
    if config_get(config, "multi_latent_attention", False):
        if variant == "dsv4_hybrid":
            raise UnsupportedLayerError("DeepSeek-V4 hybrid attention (experimental_attention_variant "
                                        "'dsv4_hybrid', csa_compress_ratios) is not counted: its compressed-KV terms "
                                        "are not exact on packs yet")
        if variant == "dsa":
            indexer = _indexer_layers(config, num_layers) + _indexer_layers(config, mtp)
            layers = [Layer("dsa", indexer=indexer[i]) for i in range(total)]
        else:
            layers = [Layer("mla") for _ in range(total)]
    else:
        window = _window(config)
        local = _local_attention_layers(config, num_layers, mtp)
        layers = [Layer("sliding_attention", window=window)
                  if window and (_is_window_layer(config, i + 1) if local is None else local[i])
                  else Layer("attention") for i in range(total)]
    if variant is not None and variant not in _GDN_VARIANTS and variant not in ("dsa",):
        raise UnsupportedLayerError(f"experimental_attention_variant {variant!r} is not counted "
                                    "(known: gdn, gdn2, gated_delta_net, dsa)")
    linear = [False] * num_layers
    if variant in _GDN_VARIANTS:
        linear = [_GDN_VARIANTS[variant] if on else False for on in
                  _per_layer_pattern(config, "linear_attention_freq", num_layers)]
    kda = sorted(set(config_get(config, "kimi_kda_layers", ()) or ()))
    if kda:
        bad = [n for n in kda if not 0 < n <= num_layers]
        if bad:
            raise ValueError(f"kimi_kda_layers contains layer numbers outside [1, {num_layers}]: {bad}")
        linear = ["kda" if i + 1 in kda else kind for i, kind in enumerate(linear)]
    linear += [linear[-1] if num_layers else False] * mtp  # MTP layers are built as the last decoder layer
    return [Layer(kind) if kind else layer for kind, layer in zip(linear, layers)]


def _transformer_layers(config, mtp: int) -> list[Layer]:
    num_layers = config_int(config, "num_layers")
    moe = _moe_pattern(config, num_layers)
    # MTP layers are built as the last decoder layer; MiMo-V2-Flash's (hybrid_attention_pattern) with a dense MLP
    mimo = config_get(config, "hybrid_attention_pattern", None) is not None
    moe += [moe[-1] if num_layers and not mimo else False] * mtp
    mixers = _transformer_mixers(config, num_layers, mtp)
    return [Layer(m.mixer, "moe" if e else "dense", m.window, m.indexer) for m, e in zip(mixers, moe)]


def _hybrid_pattern(config) -> tuple[str, str, int]:
    """``(main, mtp, depths)`` of ``hybrid_layer_pattern`` (``|`` dropped), or of the deprecated
    ``hybrid_attention_ratio`` / ``hybrid_mlp_ratio`` counts (order then does not matter)."""
    pattern = config_get(config, "hybrid_layer_pattern", None)
    if not pattern:
        num_layers = config_int(config, "num_layers")
        attn = round(num_layers * float(config_get(config, "hybrid_attention_ratio", 0) or 0))
        mlp = round(num_layers * float(config_get(config, "hybrid_mlp_ratio", 0) or 0))
        return "*" * attn + "-" * mlp + "M" * (num_layers - attn - mlp), "", 0
    main, *mtp = str(pattern).split("/")
    mtp = [part for part in mtp if part] if not all(part == "" for part in mtp) else []
    if any(part != mtp[0] for part in mtp):
        raise ValueError(f"hybrid_layer_pattern {pattern!r}: all MTP patterns after '/' must be identical")
    for symbol in main.replace("|", "") + "".join(mtp):
        if symbol == "D":
            raise UnsupportedLayerError("hybrid_layer_pattern symbol 'D' (DeepSeek sparse attention in a hybrid "
                                        "stack) is not counted")
        if symbol not in _HYBRID_SYMBOLS:
            raise UnsupportedLayerError(f"hybrid_layer_pattern symbol {symbol!r} is not a layer kind the counts "
                                        f"cover (known: {''.join(_HYBRID_SYMBOLS)})")
    return main.replace("|", ""), (mtp[0] if mtp else ""), len(mtp)


def _hybrid_layers(config) -> tuple[list[Layer], int]:
    """The hybrid layout's layers (main pattern, then the MTP pattern once per depth) and its MTP depths.
    A main-pattern ``*`` layer uses the window when ``window_size`` is set and ``window_attn_skip_freq``
    selects its physical layer number; MTP attention layers are full."""
    main, mtp, depths = _hybrid_pattern(config)
    window = _window(config) if config_get(config, "hybrid_layer_pattern", None) else None
    layers = []
    for number, symbol in enumerate(main, start=1):
        mixer, ffn = _HYBRID_SYMBOLS[symbol]
        if mixer == "attention" and window and _is_window_layer(config, number):
            layers.append(Layer("sliding_attention", window=window))
        else:
            layers.append(Layer(mixer, ffn))
    layers += [Layer(*_HYBRID_SYMBOLS[symbol]) for symbol in mtp * depths]
    explicit = config_get(config, "mtp_num_layers", None)
    return layers, depths if explicit is None else config_int(config, "mtp_num_layers", minimum=0)


def _plain_attention_params(config, kinds: set, h: int, heads: int, gate: bool) -> dict:
    """``{"attention": ...}`` (and ``"sliding_attention"`` when its KV groups differ): ``kv_channels`` a query
    and key head; ``v_head_dim`` a value head only without MLA (MLA's field otherwise), as Megatron-Bridge's
    MiMo-V2-Flash provider builds its attention, with ``full_attn_num_query_groups`` / ``swa_num_query_groups``
    KV groups on the full / sliding layers of its ``hybrid_attention_pattern``."""
    kv_heads = int(config_get(config, "num_query_groups", None) or heads)
    head_dim = config_int(config, "kv_channels", max(h // heads, 1))
    mla = config_get(config, "multi_latent_attention", False) or kinds & {"mla", "dsa"}
    attention = {"heads": heads, "kv_heads": kv_heads, "gate": gate, "head_dim": head_dim,
                 "v_head_dim": head_dim if mla else config_int(config, "v_head_dim", head_dim)}
    if config_get(config, "hybrid_attention_pattern", None) is None:
        return {"attention": attention}
    return {kind: dict(attention, kv_heads=config_int(config, key, kv_heads)) for kind, key in (
        ("attention", "full_attn_num_query_groups"), ("sliding_attention", "swa_num_query_groups"))}


def _attention_and_mla_params(config, kinds: set, h: int, gate: bool) -> dict:
    params = {}
    heads = config_int(config, "num_attention_heads")
    if kinds & {"attention", "sliding_attention"}:
        params.update(_plain_attention_params(config, kinds, h, heads, gate))
    if kinds & {"mla", "dsa"}:
        params["mla"] = {"heads": heads, "q_lora": config_int(config, "q_lora_rank", 0, minimum=0),
                         **{name: config_int(config, key, minimum=minimum) for name, key, minimum in (
                             ("kv_lora", "kv_lora_rank", 1), ("qk_nope", "qk_head_dim", 1),
                             ("rope", "qk_pos_emb_head_dim", 0), ("v", "v_head_dim", 1))}}
    if "dsa" in kinds:
        params["dsa"] = dict(params["mla"], absorbed=True, **{name: config_int(config, key) for name, key in (
            ("indexer_heads", "dsa_indexer_n_heads"), ("indexer_dim", "dsa_indexer_head_dim"),
            ("topk", "dsa_indexer_topk"))})
        params["dsa"]["trains"] = float(config_get(config, "dsa_indexer_loss_coeff", 0.0) or 0.0) > 0
        params["dsa"]["sparse_loss"] = bool(config_get(config, "dsa_indexer_use_sparse_loss", False))
    return params


def _linear_params(config, kinds: set, h: int) -> dict:
    params = {}
    if kinds & {"gdn", "gdn2"}:
        params["gdn"] = {name: config_int(config, key) for name, key in (
            ("dhk", "linear_key_head_dim"), ("dhv", "linear_value_head_dim"), ("nk", "linear_num_key_heads"),
            ("nv", "linear_num_value_heads"), ("conv", "linear_conv_kernel_dim"))}
    if "kda" in kinds:
        params["kda"] = {"heads": config_int(config, "kimi_linear_num_heads"),
                         "head_dim": config_int(config, "kimi_linear_head_dim"),
                         "conv": config_int(config, "kimi_linear_conv_kernel_size"), "gate_full_rank": True}
    if "mamba2" in kinds:  # Megatron-core's Mamba mixer: d_inner = 2h
        d_inner = 2 * h
        heads = config_get(config, "mamba_num_heads", None) or d_inner // config_int(config, "mamba_head_dim", 64)
        params["mamba2"] = {"d_inner": d_inner, "heads": int(heads),
                            "groups": config_int(config, "mamba_num_groups", 8),
                            "state": config_int(config, "mamba_state_dim", 128)}
    return params


def _ffn_params(config, kinds: set, e: int) -> dict:
    params = {}
    if "dense" in kinds:
        params["dense"] = {"ffn": config_int(config, "ffn_hidden_size", minimum=0), "e": e}
    if "moe" in kinds:
        moe_ffn = config_get(config, "moe_ffn_hidden_size", None) or config_int(config, "ffn_hidden_size")
        topk = config_int(config, "moe_router_topk")
        check_topk(topk, "moe_router_topk", "num_moe_experts", config_int(config, "num_moe_experts", 0, minimum=0))
        params["moe"] = {"moe_ffn": int(moe_ffn), "topk": topk, "e": e,
                         "shared": config_int(config, "moe_shared_expert_intermediate_size", 0, minimum=0),
                         "latent": config_int(config, "moe_latent_size", 0, minimum=0)}
    return params


def megatron_structure(config, *, gated_mlp=None, attention_output_gate=None, layer_types=None,
                       mtp_layers: int | None = None) -> TextStructure:
    """The text stack of a Megatron-style config (see the module docstring). ``gated_mlp`` defaults to
    ``gated_linear_unit``, ``attention_output_gate`` to the config's, ``mtp_layers`` to
    ``mtp_num_layers`` (transformer layout) or the pattern's depths (hybrid layout)."""
    if layer_types is not None:
        raise ValueError("layer_types= is for transformers configs; a Megatron-style config's layers come from "
                         "hybrid_layer_pattern, window_attn_skip_freq, linear_attention_freq, kimi_kda_layers")
    h = config_int(config, "hidden_size")
    hybrid = bool(config_get(config, "hybrid_layer_pattern", None) or config_get(config, "is_hybrid_model", False))
    if hybrid:
        layers, depths = _hybrid_layers(config)
        if mtp_layers is not None:
            depths = mtp_layers
        blocks = 0
    else:
        depths = mtp_layers if mtp_layers is not None else config_int(config, "mtp_num_layers", 0, minimum=0)
        layers, blocks = _transformer_layers(config, depths), depths
    kinds = {layer.mixer for layer in layers} | {layer.ffn for layer in layers}
    if gated_mlp is None:
        gated_mlp = bool(config_get(config, "gated_linear_unit", False))
    if attention_output_gate is None:
        attention_output_gate = bool(config_get(config, "attention_output_gate", False))
    params = {**_ffn_params(config, kinds, 3 if gated_mlp else 2), **_linear_params(config, kinds, h),
              **_attention_and_mla_params(config, kinds, h, bool(attention_output_gate))}
    return TextStructure(hidden=h, vocab=_padded_vocab(config), layers=tuple(layers), params=params,
                         mtp_depths=depths, mtp_blocks=blocks)
