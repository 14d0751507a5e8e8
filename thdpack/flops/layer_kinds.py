"""The layers of a ``transformers`` text model, read from its config (an object or its dict) into a
:class:`thdpack.flops.layer_costs.TextStructure`: which token mixer and feed-forward every layer holds.

Sources, in order: ``layer_types`` (or ``layers_block_type``, Nemotron-H's ``hybrid_override_pattern``),
else ``full_attention_interval`` (Qwen3-Next), ``attn_layer_indices`` (Bamba), a Mamba-2 model's all-SSM
stack, the sliding window (``sliding_window`` with ``sliding_window_pattern``, ``use_sliding_window`` /
``max_window_layers``, or on every layer), else full attention everywhere. A layer kind the counts do not
cover raises :class:`UnsupportedLayerError` naming it: nothing is counted as dense attention by default; a config
setting attention sizes the counts do not read (Inkling's ``swa_head_dim``, Gemma 4's ``global_head_dim``, a
heterogeneous ``per_layer_config``, ...) raises ``ValueError`` naming them.
Megatron-style configs (``num_layers``, ``ffn_hidden_size``, ...) are read by
:mod:`thdpack.flops.megatron_layers`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from thdpack.common.model_config import config_get, config_int
from thdpack.flops.layer_costs import Layer, TextStructure, UnsupportedLayerError, check_topk

__all__ = ["NON_GATED_MLP_MODEL_TYPES", "GATED_ATTENTION_MODEL_TYPES", "hf_structure", "model_root"]

# Families whose MLP is two plain GEMMs (up, down); every other family is taken as gated (SwiGLU-like).
NON_GATED_MLP_MODEL_TYPES = frozenset(
    {"gpt2", "gpt_neox", "gptj", "gpt_bigcode", "opt", "bloom", "falcon", "phi", "starcoder2", "mpt", "codegen",
     "bert", "roberta", "nemotron", "nemotron_h"}
)
# Families whose full-attention layers gate the attention output (q_proj emits query and gate).
GATED_ATTENTION_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})
# Families whose "linear_attention" layers are Mamba-2 mixers, and where they read their sizes.
MAMBA2_MODEL_TYPES = frozenset({"mamba2", "nemotron_h", "bamba", "granitemoehybrid"})
# Families whose sliding-window layers have more key-value heads than num_key_value_heads: transformers builds
# MiMo-V2-Flash's with twice as many (the checkpoint's swa_num_key_value_heads 8 against 4).
_SLIDING_KV_HEADS_FACTOR = {"mimo_v2_flash": 2}
# Gemma's default alternation when a hub config.json gives neither layer_types nor sliding_window_pattern.
_WINDOW_PATTERN_DEFAULTS = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6, "cohere2": 4}
_LEGACY_TYPES = {"mamba": "linear_attention", "attention": "full_attention",
                 "deepseek_sparse_attention": "indexed_attention", "hybrid_mlp": "mlp"}
_PATTERN_SYMBOLS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_FFN_ONLY = {"mlp": "dense", "moe": "moe"}
# Fields only models with state-space, convolution or linear-attention layers have: a config holding one whose
# layer types cannot be read (a dict that lost them) is refused rather than counted as attention everywhere.
_NON_ATTENTION_FIELDS = ("mamba_d_state", "ssm_state_size", "state_size", "mamba_expand", "mamba_n_heads",
                         "mamba_num_heads", "mamba_d_ssm", "conv_L_cache", "linear_key_head_dim", "linear_num_heads",
                         "attn_layer_period")
# Attention sizes some families set apart from num_attention_heads, num_key_value_heads and head_dim, which the
# counts do not read: a config setting one is refused (a ValueError naming it) rather than counted as another model.
_INKLING = ("the sliding layers' own attention sizes (Inkling, whose attention also has relative-position "
            "states and short convolutions)")
_UNREAD_ATTENTION_FIELDS = {
    "swa_num_attention_heads": _INKLING, "swa_num_key_value_heads": _INKLING, "swa_head_dim": _INKLING,
    "per_layer_config": "attention sizes layer by layer (Gemma 4, Dots3, Step3.7)",
    "num_attention_heads_per_layer": "a head count layer by layer and the attention gate g_proj (Laguna)",
    "num_sliding_attention_heads": "the sliding layers' own head count and the attention gate g_proj (Step3.7)",
    "attention_other_setting": "the sliding layers' own attention sizes and the attention gate g_proj (Step3.7)",
    "gating": "the attention gate g_proj, one gate a head or a value (Laguna, Step3.7)",
    "global_head_dim": "the full-attention layers' own head_dim (Gemma 4)",
    "num_global_key_value_heads": "the full-attention layers' own key-value heads (Gemma 4)",
    "attention_k_eq_v": "keys reused as values, without v_proj (Gemma 4)",
    "num_kv_shared_layers": "layers reusing an earlier layer's keys and values, without k_proj and v_proj "
                            "(Gemma 3n, Gemma 4)",
    "kv_source_layers": "layers reusing another layer's keys and values, without their projections "
                        "(Mistral Large 4, Kolibri)",
}
# Fields only multi-latent attention has (v_head_dim is not one: MiMo-V2-Flash's plain attention has it too, its
# values' width).
_MLA_ONLY_FIELDS = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")


def model_root(config):
    """The model a config trains: Qwen-Omni's ``thinker_config`` when there is one (its ``text_config``
    and ``vision_config``), else ``config``."""
    return config_get(config, "thinker_config", config)


def _refuse_unsupported(text, model_types: set) -> None:
    """One-line :class:`UnsupportedLayerError` for the model kinds the counts do not cover."""
    refusals = (
        ("deepseek_v4" in model_types, "DeepSeek-V4 hybrid attention (compressed_sparse_attention, "
         "heavily_compressed_attention, hyper-connections) is not counted: its compressed-KV terms are not "
         "exact on packs yet"),
        (bool(config_get(text, "is_encoder_decoder", False)), "encoder-decoder models (an encoder stack and "
         "cross-attention to it) are not counted; decoder cross-attention layers (cross_attention_layers) are"),
        (bool(config_get(text, "use_bidirectional_attention", False)), "bidirectional attention "
         "(use_bidirectional_attention) is not counted: the counts are for causal language models"),
        (config_get(text, "attention_chunk_size", None) is not None, "chunked_attention (attention_chunk_size) "
         "is not counted"),
    )
    for refused, message in refusals:
        if refused:
            raise UnsupportedLayerError(message)


def _sets_field(key: str, value) -> bool:
    """Whether ``value`` of the config's ``key`` (one of :data:`_UNREAD_ATTENTION_FIELDS`) changes the
    attention GEMMs: unset, off, zero, empty, or every layer its own ``kv_source_layers`` source, it does not
    (``gating`` False is still a gate, one a value)."""
    if value is None:
        return False
    if key == "gating":
        return True
    if key == "kv_source_layers" and isinstance(value, (list, tuple)):
        return list(value) != list(range(len(value)))
    if isinstance(value, (Mapping, list, tuple)):
        return len(value) > 0
    return value is not False and value != 0


def _field_value(text, key: str):
    """The config's ``key``; for a config object's ``per_layer_config`` (transformers' view of every layer's
    config, there even when the layers agree), whether its layers differ (``is_heterogeneous``)."""
    value = config_get(text, key, None)
    if key == "per_layer_config" and value is not None and not isinstance(value, Mapping):
        return bool(config_get(text, "is_heterogeneous", False))
    return value


def _refuse_unread_attention_fields(text, where: str) -> None:
    """``ValueError`` naming the attention-size fields of :data:`_UNREAD_ATTENTION_FIELDS` the config sets
    (checked before anything else is read: a per-layer config object refuses its global sizes)."""
    found = [key for key in _UNREAD_ATTENTION_FIELDS if _sets_field(key, _field_value(text, key))]
    if found:
        raise ValueError(f"the model config sets {', '.join(where + key for key in found)}: "
                         f"{_UNREAD_ATTENTION_FIELDS[found[0]]}, which the FLOPs counts do not read; counting "
                         "its attention as plain attention would give another model's FLOPs")


def _check_mla_fields(text, where: str) -> None:
    """``ValueError`` for multi-latent attention fields without ``kv_lora_rank``, the field that makes the
    layers MLA: counting them as plain attention would silently give another model's FLOPs."""
    if config_get(text, "kv_lora_rank", None) is not None:
        return
    present = [key for key in (*_MLA_ONLY_FIELDS, "v_head_dim") if config_get(text, key, None) is not None]
    if any(key in _MLA_ONLY_FIELDS for key in present):
        raise ValueError(f"the model config sets {', '.join(where + key for key in present)} (multi-latent "
                         f"attention) but not {where}kv_lora_rank: give kv_lora_rank for an MLA model, or drop "
                         "the MLA fields for plain attention")


def _layer_type_list(value, name: str, error=TypeError) -> list:
    """``value`` (``layer_types``, ``mlp_layer_types``: one kind a layer) as a list; ``error`` naming ``name``
    for a string (read one layer a character), a mapping or a non-iterable."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise error(f"{name} must be a list of layer kinds, one a layer (e.g. ['full_attention', "
                    f"'linear_attention']), got {type(value).__name__} {value!r}")
    return list(value)


def _window_layer_types(text, num_layers: int, model_types: set) -> list[str] | None:
    """Layer types from the sliding window when the config lists none: ``use_sliding_window`` with
    ``max_window_layers`` (Qwen2 family), ``sliding_window_pattern`` (every n-th layer full; Gemma's
    default), else every layer sliding (Mistral, Mixtral, Phi-3, Starcoder2). None without a window."""
    if config_get(text, "sliding_window", None) is None:
        return None
    if config_get(text, "use_sliding_window", None) is not None:
        if not config_get(text, "use_sliding_window"):
            return None
        first = config_int(text, "max_window_layers", 0, minimum=0)
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    defaults = [_WINDOW_PATTERN_DEFAULTS[t] for t in sorted(model_types) if t in _WINDOW_PATTERN_DEFAULTS]
    pattern = config_int(text, "sliding_window_pattern", defaults[0] if defaults else 0, minimum=0)
    if pattern:
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    return ["sliding_attention"] * num_layers


def _listed_types(text, given, where: str = "") -> list[str] | None:
    """The layer types the config (or ``given``) lists: ``layer_types``, ``layers_block_type``, Nemotron-H's
    ``hybrid_override_pattern``; None when it lists none."""
    if given is not None:
        return _layer_type_list(given, "layer_types")
    for key in ("layer_types", "layers_block_type"):
        if config_get(text, key, None) is not None:
            return _layer_type_list(config_get(text, key), f"the model config's {where}{key}", ValueError)
    if config_get(text, "hybrid_override_pattern", None):
        pattern = str(config_get(text, "hybrid_override_pattern"))
        return [_PATTERN_SYMBOLS.get(c, f"hybrid_override_pattern symbol {c!r}") for c in pattern]
    return None


def _layer_types(text, num_layers: int, given, model_types: set, where: str) -> list[str]:
    """Every layer's type name (``full_attention``, ``sliding_attention``, ``linear_attention``, ...)."""
    types = _listed_types(text, given, where)
    if types is None and config_get(text, "full_attention_interval", None):
        interval = config_int(text, "full_attention_interval", where=where)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if types is None and (config_get(text, "attn_layer_indices", None) is not None or "bamba" in model_types):
        # Bamba: attention on attn_layer_indices (none listed: every layer is Mamba-2)
        full = set(config_get(text, "attn_layer_indices", []))
        types = ["full_attention" if i in full else "linear_attention" for i in range(num_layers)]
    if types is None and "mamba2" in model_types:
        types = ["linear_attention"] * num_layers
    if types is None:
        found = [key for key in _NON_ATTENTION_FIELDS if config_get(text, key, None) is not None]
        if found:
            kinds = ", ".join(sorted(model_types)) or "unknown"
            raise UnsupportedLayerError(f"model_type {kinds} has non-attention layers ({found[0]}) but its config "
                                        "lists no layer_types to tell which; pass the config object or layer_types=")
        types = _window_layer_types(text, num_layers, model_types) or ["full_attention"] * num_layers
    types = [_LEGACY_TYPES.get(t, t) for t in types]
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    return types


def _linear_kind(text, model_types: set) -> str:
    """What a ``linear_attention`` layer is in this family: Gated DeltaNet, Kimi delta attention or Mamba-2."""
    if config_get(text, "linear_key_head_dim", None) is not None:
        return "gdn"
    if "kimi_linear" in model_types:
        return "kda"
    if model_types & MAMBA2_MODEL_TYPES:
        return "mamba2"
    kinds = ", ".join(sorted(model_types)) or "unknown"
    raise UnsupportedLayerError(f"layer type 'linear_attention' of model_type {kinds} is not counted (known: Gated "
                                "DeltaNet, Kimi delta attention, Mamba-2 of " + ", ".join(sorted(MAMBA2_MODEL_TYPES))
                                + ")")


def _mixer(kind: str, i: int, text, model_types: set) -> tuple[str | None, int | None]:
    """``(mixer, window)`` of layer ``i`` whose type name is ``kind``."""
    mla = config_get(text, "kv_lora_rank", None) is not None
    if kind == "full_attention":
        return ("mla" if mla else "attention"), None
    if kind == "indexed_attention":
        return "dsa", None
    if kind == "linear_attention":
        return _linear_kind(text, model_types), None
    if kind == "sliding_attention":
        if config_get(text, "sliding_window", None) is None:
            raise UnsupportedLayerError("layer type 'sliding_attention' needs the config's sliding_window (the keys "
                                        "each query sees); without it the layer cannot be counted")
        if mla:
            raise UnsupportedLayerError("layer type 'sliding_attention' with multi-latent attention is not counted")
        return "sliding_attention", config_int(text, "sliding_window")
    if kind in _FFN_ONLY:
        return None, None
    raise UnsupportedLayerError(f"layer type {kind!r} (layer {i}) is not counted (known: full_attention, "
                                "sliding_attention, indexed_attention, linear_attention, mlp, moe)")


def _num_experts(text, where: str) -> tuple[str, int]:
    """``(key, routed experts)``: the first of ``num_experts``, ``num_local_experts``, ``n_routed_experts`` set
    and non-zero, ``("num_experts", 0)`` for a dense model."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        count = config_int(text, key, 0, minimum=0, where=where)
        if count:
            return key, count
    return "num_experts", 0


def _moe_layers(text, num_layers: int, where: str) -> list[bool]:
    """Whether each layer's feed-forward has experts: ``mlp_layer_types`` (``dense`` / ``sparse``), else
    ``mlp_only_layers``, ``decoder_sparse_step``, ``first_k_dense_replace``, ``moe_layer_freq``."""
    num_experts = _num_experts(text, where)[1]
    mlp_types = config_get(text, "mlp_layer_types", None)
    if num_experts and mlp_types is not None:
        mlp_types = _layer_type_list(mlp_types, f"the model config's {where}mlp_layer_types", ValueError)
        unknown = sorted(set(mlp_types) - {"dense", "sparse", "moe"})
        if unknown:
            raise UnsupportedLayerError(f"mlp layer types {unknown} are not counted (known: dense, sparse)")
        if len(mlp_types) != num_layers:
            raise ValueError(f"mlp_layer_types has {len(mlp_types)} entries for {num_layers} layers")
        return [t != "dense" for t in mlp_types]
    if not num_experts:
        return [False] * num_layers
    mlp_only = set(config_get(text, "mlp_only_layers", []) or [])
    sparse_step = config_int(text, "decoder_sparse_step", 1, where=where)
    first_dense = config_int(text, "first_k_dense_replace", 0, minimum=0, where=where)
    layer_freq = config_int(text, "moe_layer_freq", 1, where=where)
    return [i not in mlp_only and (i + 1) % sparse_step == 0 and i >= first_dense and i % layer_freq == 0
            for i in range(num_layers)]


def _layers(text, types: list[str], model_types: set, where: str) -> list[Layer]:
    """One :class:`Layer` per type name, with its feed-forward and, for cross-attention layers
    (``cross_attention_layers``, Mllama), the cross-attention mixer."""
    ffn_only_layers = any(t in _FFN_ONLY for t in types)  # Nemotron-H: a layer holds a mixer or a feed-forward
    no_ffn = ffn_only_layers or "mamba2" in model_types
    moe = _moe_layers(text, len(types), where)
    cross = set(config_get(text, "cross_attention_layers", []) or [])
    indexer = config_get(text, "indexer_types", None)
    layers = []
    for i, kind in enumerate(types):
        mixer, window = _mixer(kind, i, text, model_types)
        if i in cross:
            mixer = "cross_attention"
        ffn = _FFN_ONLY.get(kind) if no_ffn else ("moe" if moe[i] else "dense")
        has_indexer = indexer is None or indexer[i] != "shared"
        layers.append(Layer(mixer=mixer, ffn=ffn, window=window, indexer=has_indexer))
    return layers


def _attention_params(text, where: str, gate: bool) -> dict:
    """Plain attention: heads, key-value heads, ``head_dim`` (queries and keys) and ``v_head_dim`` (values and
    the attention output, MiMo-V2-Flash; ``head_dim`` when unset)."""
    heads = config_int(text, "num_attention_heads", where=where)
    h = config_int(text, "hidden_size", where=where)
    head_dim = config_int(text, "head_dim", max(h // heads, 1), where=where)
    return {"heads": heads, "kv_heads": config_int(text, "num_key_value_heads", heads, where=where),
            "head_dim": head_dim, "v_head_dim": config_int(text, "v_head_dim", head_dim, where=where), "gate": gate}


def _mla_params(text, where: str) -> dict:
    """Multi-latent attention (DeepSeek-V2/V3, Kimi): ``q_lora_rank`` (None: a plain q projection),
    ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``."""
    return {"heads": config_int(text, "num_attention_heads", where=where),
            "q_lora": config_int(text, "q_lora_rank", 0, minimum=0, where=where),
            **{name: config_int(text, key, where=where) for name, key in (
                ("kv_lora", "kv_lora_rank"), ("qk_nope", "qk_nope_head_dim"), ("rope", "qk_rope_head_dim"),
                ("v", "v_head_dim"))}}


def _mamba2_params(text, h: int, model_types: set, where: str) -> dict:
    """Mamba-2 sizes: ``d_inner`` (x and z width), SSM heads, groups of B / C, state size."""
    get = lambda key, default=None: config_int(text, key, default, where=where)  # noqa: E731
    if "nemotron_h" in model_types:
        heads = get("mamba_num_heads")
        return {"d_inner": heads * get("mamba_head_dim"), "heads": heads, "groups": get("n_groups"),
                "state": get("ssm_state_size")}
    if "mamba2" in model_types:
        return {"d_inner": get("expand") * h, "heads": get("num_heads"), "groups": get("n_groups"),
                "state": get("state_size")}
    return {"d_inner": get("mamba_expand") * h, "heads": get("mamba_n_heads"), "groups": get("mamba_n_groups"),
            "state": get("mamba_d_state")}


def _ffn_params(text, kinds: set, model_types: set, where: str, e: int) -> dict:
    """The dense MLP (``intermediate_size``; Granite-MoE-hybrid: its ``shared_intermediate_size`` MLP) and
    the experts: ``k = num_experts_per_tok`` of ``moe_intermediate_size``, the shared experts
    (``shared_expert_intermediate_size`` and its family spellings, or ``n_shared_experts`` experts), and a
    ``moe_latent_size`` the routed experts run in."""
    params = {}
    dense_key = "shared_intermediate_size" if "granitemoehybrid" in model_types else "intermediate_size"
    if "dense" in kinds:
        params["dense"] = {"ffn": config_int(text, dense_key, where=where), "e": e}
    if "moe" in kinds:
        key = "moe_intermediate_size" if config_get(text, "moe_intermediate_size", None) is not None else (
            "intermediate_size")
        moe_ffn = config_int(text, key, where=where)
        shared = 0
        for key in ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", "shared_intermediate_size"):
            shared = shared or config_int(text, key, 0, minimum=0, where=where)
        for key in ("n_shared_experts", "num_shared_experts"):
            if not shared and config_get(text, key, None):
                shared = config_int(text, key, minimum=0, where=where) * moe_ffn
        topk_key = "num_experts_per_token" if config_get(text, "num_experts_per_token", None) else "num_experts_per_tok"
        topk = config_int(text, topk_key, where=where)
        check_topk(topk, where + topk_key, *_num_experts(text, where), where=where)
        params["moe"] = {"moe_ffn": moe_ffn, "topk": topk,
                         "shared": shared, "e": e,
                         "latent": config_int(text, "moe_latent_size", 0, minimum=0, where=where)}
    return params


def _params(text, layers: list[Layer], model_types: set, where: str, *, gated_mlp, attention_output_gate) -> dict:
    """The sizes of every layer kind present, read from the config."""
    kinds = {layer.mixer for layer in layers} | {layer.ffn for layer in layers}
    h = config_int(text, "hidden_size", where=where)
    if gated_mlp is None:
        gated_mlp = not (model_types & NON_GATED_MLP_MODEL_TYPES)
    if attention_output_gate is None:
        attention_output_gate = (bool(config_get(text, "attn_output_gate", False))
                                 or bool(model_types & GATED_ATTENTION_MODEL_TYPES))
    params = _ffn_params(text, kinds, model_types, where, 3 if gated_mlp else 2)
    if kinds & {"attention", "sliding_attention", "cross_attention"}:
        params["attention"] = _attention_params(text, where, bool(attention_output_gate))
        params["cross_attention"] = dict(params["attention"], kv_input=h)
        factor = max((_SLIDING_KV_HEADS_FACTOR.get(t, 1) for t in model_types), default=1)
        if factor != 1:
            params["sliding_attention"] = dict(params["attention"], kv_heads=factor * params["attention"]["kv_heads"])
    if kinds & {"mla", "dsa"}:
        params["mla"] = _mla_params(text, where)
        params["dsa"] = dict(params["mla"], absorbed=False, trains=False, sparse_loss=False, **{
            name: config_int(text, key, where=where) if "dsa" in kinds else 0 for name, key in (
                ("indexer_heads", "index_n_heads"), ("indexer_dim", "index_head_dim"), ("topk", "index_topk"))})
    if "gdn" in kinds:
        params["gdn"] = {name: config_int(text, key, where=where) for name, key in (
            ("dhk", "linear_key_head_dim"), ("dhv", "linear_value_head_dim"), ("nk", "linear_num_key_heads"),
            ("nv", "linear_num_value_heads"))}
        params["gdn"]["conv"] = config_int(text, "linear_conv_kernel_dim", 4, where=where)
    if "kda" in kinds:
        params["kda"] = {"heads": config_int(text, "linear_num_heads", where=where),
                         "head_dim": config_int(text, "linear_head_dim", where=where),
                         "conv": config_int(text, "linear_conv_kernel_dim", 4, where=where), "gate_full_rank": False}
    if "mamba2" in kinds:
        params["mamba2"] = _mamba2_params(text, h, model_types, where)
    return params


def hf_structure(config, *, gated_mlp=None, attention_output_gate=None, layer_types=None,
                 mtp_layers: int = 0) -> TextStructure:
    """The text stack of a ``transformers`` config (``text_config`` / Qwen-Omni's ``thinker_config`` when
    present). ``mtp_layers``: multi-token-prediction layers to count (copies of the last layer, their
    input projections and extra logits; transformers itself does not run a checkpoint's MTP layers)."""
    root = model_root(config)
    text = config_get(root, "text_config", root)
    where = "" if text is config else ("thinker_config.text_config." if root is not config else "text_config.")
    model_types = {config_get(c, "model_type", None) for c in (text, root, config)} - {None}
    _refuse_unread_attention_fields(text, where)
    for node in (text, root):
        _refuse_unsupported(node, model_types)
    _check_mla_fields(text, where)
    h = config_int(text, "hidden_size", where=where)
    given = None if layer_types is None else _layer_type_list(layer_types, "layer_types")
    listed = _listed_types(text, given, where)
    num_layers = config_int(text, "num_hidden_layers", None if listed is None else len(listed), where=where)
    types = _layer_types(text, num_layers, given, model_types, where)
    layers = _layers(text, types, model_types, where)
    if mtp_layers:
        layers += [layers[-1]] * mtp_layers
    params = _params(text, layers, model_types, where, gated_mlp=gated_mlp,
                       attention_output_gate=attention_output_gate)
    return TextStructure(hidden=h, vocab=config_int(text, "vocab_size", where=where), layers=tuple(layers),
                         params=params, mtp_depths=mtp_layers, mtp_blocks=mtp_layers)
