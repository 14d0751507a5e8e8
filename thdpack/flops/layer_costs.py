"""What each kind of layer costs: a model's text stack as layers (:class:`TextStructure`, read from a config
by :mod:`thdpack.flops.layer_kinds` or :mod:`thdpack.flops.megatron_layers`) and the training FLOPs of each
layer as terms ``{name: (count, coefficient)}`` (:func:`structure_terms`).

A term's FLOPs are ``coefficient × count``; counts are tokens, ``Σ sᵢ²`` and the length counts of
:mod:`thdpack.flops.sequences` (``window_square_sum[w]``, ``causal_pairs[k]``, ``causal_pairs``), all
exact on packs. Conventions of Megatron-LM: a GEMM ``[m,k]@[k,n]`` is ``2·m·k·n`` FLOPs, training three
times the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from thdpack.flops.sequences import count_name

__all__ = ["MIXER_KINDS", "Layer", "TextStructure", "UnsupportedLayerError", "check_topk", "structure_terms"]

# The token mixers a layer may hold; a layer holds at most one mixer and one feed-forward ("dense", "moe").
MIXER_KINDS = ("attention", "sliding_attention", "mla", "dsa", "gdn", "gdn2", "kda", "mamba2", "cross_attention")

SEQ = "seqlen_squared_sum"
TOKENS = "tokens"


class UnsupportedLayerError(NotImplementedError):
    """A layer kind the FLOPs counts do not cover: counting it as dense attention would be wrong."""


def check_topk(topk: int, topk_key: str, experts_key: str, experts: int, *, where: str = "") -> None:
    """``ValueError`` naming both config keys when a token is routed to more experts (``topk``) than the
    model has (``experts``; 0: not given, nothing to check)."""
    if experts and topk > experts:
        raise ValueError(f"the model config's {topk_key} ({topk}) is more than its {where}{experts_key} "
                         f"({experts}): a token is routed to {experts} experts at most")


@dataclass(frozen=True)
class Layer:
    """One layer of the text stack: its token ``mixer`` (one of :data:`MIXER_KINDS`, or None) and its
    feed-forward ``ffn`` (``"dense"``, ``"moe"`` or None). ``window``: the keys a ``sliding_attention``
    query sees (itself and the ``window − 1`` before it); ``indexer``: whether a ``dsa`` layer computes
    its own top-k (False: it reuses an earlier layer's)."""

    mixer: str | None = None
    ffn: str | None = None
    window: int | None = None
    indexer: bool = True


@dataclass(frozen=True)
class TextStructure:
    """The text stack of a model: ``layers`` (the decoder's, then any multi-token-prediction layers),
    ``params`` of each kind present (``{"attention": {"heads": ..., ...}, "dense": {...}, ...}``), and the
    MTP extras: ``mtp_depths`` extra logits GEMMs, ``mtp_blocks`` MTP input projections (``2h → h``) and
    their three norms (Megatron-LM counts those, ``6·(2h² + 3h)`` per token)."""

    hidden: int
    vocab: int
    layers: tuple[Layer, ...]
    params: dict = field(default_factory=dict)
    mtp_depths: int = 0
    mtp_blocks: int = 0


def _attention_widths(p: dict) -> tuple[int, int, int, int]:
    """``(d_q, d_k, d_v, d_o)``: the widths of the query and key projections (``head_dim`` a head), of the
    value projection and of the attention output (``v_head_dim`` a head: MiMo-V2-Flash's 128 against a
    ``head_dim`` of 192; ``head_dim`` when unset)."""
    v_head_dim = p.get("v_head_dim") or p["head_dim"]
    return (p["heads"] * p["head_dim"], p["kv_heads"] * p["head_dim"], p["kv_heads"] * v_head_dim,
            p["heads"] * v_head_dim)


def _attention(p: dict, h: int, layer: Layer) -> dict:
    """q, k, v (and the output gate, as wide as the attention output) from ``h``, the output back to ``h``;
    per causal pair, ``Q·Kᵀ`` over ``head_dim`` and ``P·V`` over ``v_head_dim`` (``3·(d_q + d_o)`` per unit
    of ``Σ sᵢ²`` or of the window count: half the square, two FLOPs a MAC, three passes)."""
    d_q, d_k, d_v, d_o = _attention_widths(p)
    gate = d_o if p["gate"] else 0
    terms = {"attention_projections": (TOKENS, 6 * (h * (d_q + d_k + d_v + gate) + d_o * h))}
    if layer.mixer == "sliding_attention":
        terms[f"sliding_attention_{layer.window}"] = (count_name("window_square_sum", layer.window), 3 * (d_q + d_o))
    else:
        terms["core_attention"] = (SEQ, 3 * (d_q + d_o))
    return terms


def _mla_projections(p: dict, h: int) -> dict:
    """MLA's GEMMs (q, optionally through ``q_lora``; the kv latent and its rope key; the kv up-projection;
    the output) and Megatron-Bridge's latent-norm terms (one FLOP per latent element, x6)."""
    n, dqk = p["heads"], p["qk_nope"] + p["rope"]
    q = p["q_lora"] * (h + n * dqk) if p["q_lora"] else h * n * dqk
    kv = p["kv_lora"] * (h + n * (p["qk_nope"] + p["v"])) + h * p["rope"]
    return {"attention_projections": (TOKENS, 6 * (q + kv + n * p["v"] * h)),
            "latent_norms": (TOKENS, 6 * (p["q_lora"] + p["kv_lora"]))}


def _mla(p: dict, h: int, layer: Layer) -> dict:
    terms = _mla_projections(p, h)
    terms["core_attention"] = (SEQ, 3 * p["heads"] * (p["qk_nope"] + p["rope"] + p["v"]))
    return terms


def _dsa(p: dict, h: int, layer: Layer) -> dict:
    """DeepSeek sparse attention: MLA whose queries each attend to ``topk`` keys at most, chosen by a
    lightning indexer that scores every causal pair (``indexer_heads·(indexer_dim + 1)`` MACs a pair)."""
    terms = _mla_projections(p, h)
    n, k = p["heads"], p["topk"]
    core = 2 * p["kv_lora"] + p["rope"] if p["absorbed"] else p["qk_nope"] + p["rope"] + p["v"]
    sparse, dense = count_name("causal_pairs", k), count_name("causal_pairs")
    terms[f"sparse_attention_{k}"] = (sparse, 6 * n * core)
    if not layer.indexer:
        return terms
    ni, di = p["indexer_heads"], p["indexer_dim"]
    q_in = p["q_lora"] or h
    terms["indexer_projections"] = (TOKENS, (4 if p["trains"] else 2) * (q_in * ni * di + h * di + h * ni))
    terms["indexer_scores"] = (dense, 2 * ni * (di + 1))  # forward only: top-k needs every causal score
    if p["trains"]:  # the indexer's KL loss: score gradients and a detached teacher over its pairs
        pairs = sparse if p["sparse_loss"] else dense
        terms["indexer_score_grads"] = (pairs, 4 * ni * (di + 1))
        terms["indexer_teacher"] = (pairs, 2 * n * (p["kv_lora"] + p["rope"]))
    return terms


def _gdn(p: dict, h: int, layer: Layer) -> dict:
    """Gated DeltaNet: in_proj (q, k, v, z, b, a; GDN2: q, k, v, z, f, b, w), a causal conv of width K over
    q, k, v, the gated delta rule (``4·d_hk·d_hv`` per value head and token), out_proj."""
    dk, dv, nv = p["dhk"] * p["nk"], p["dhv"] * p["nv"], p["nv"]
    in_proj = 4 * dk + 3 * dv if layer.mixer == "gdn2" else 2 * dk + 2 * dv + 2 * nv
    macs = h * in_proj + p["conv"] * (2 * dk + dv) + 4 * nv * p["dhk"] * p["dhv"] + dv * h
    return {"linear_attention": (TOKENS, 6 * macs)}


def _kda(p: dict, h: int, layer: Layer) -> dict:
    """Kimi delta attention: q, k, v and output projections, the output gate (full rank ``h → P``, or
    transformers' low-rank ``h → d → P``), the per-head beta, the low-rank forget gate, causal convs over
    q, k, v, and the delta rule over a ``d × d`` state per head."""
    n, d = p["heads"], p["head_dim"]
    width = n * d
    gate = h * width if p["gate_full_rank"] else h * d + d * width
    macs = 4 * h * width + gate + h * n + (h * d + d * width) + p["conv"] * 3 * width + 4 * n * d * d
    return {"linear_attention": (TOKENS, 6 * macs)}


def _mamba2(p: dict, h: int, layer: Layer) -> dict:
    """Mamba-2: in_proj (x, z, B, C, dt), out_proj, and Megatron-LM's estimate of the SSD scan,
    ``7·d_inner·d_state`` FLOPs a token forward."""
    d_in, state = p["d_inner"], p["state"]
    proj = h * (2 * d_in + 2 * p["groups"] * state + p["heads"]) + d_in * h
    return {"mamba": (TOKENS, 6 * proj), "mamba_scan": (TOKENS, 21 * d_in * state)}


def _cross_attention(p: dict, h: int, layer: Layer) -> dict:
    """Attention from the text tokens to a memory (an encoder's or an image's tokens): q and o on the
    tokens, k and v on the memory tokens, and both products over every (token, memory token) pair of a
    sample, ``Σ qᵢ·kᵢ`` (not causal: twice the causal figure)."""
    d_q, d_k, d_v, d_o = _attention_widths(p)
    return {"cross_attention_projections": (TOKENS, 6 * h * (d_q + d_o)),
            "cross_attention_kv": ("cross_tokens", 6 * p["kv_input"] * (d_k + d_v)),
            "cross_attention": ("cross_seqlen_product_sum", 6 * (d_q + d_o))}


def _ffn(kind: str, p: dict, h: int) -> dict:
    if kind == "dense":
        return {"mlp": (TOKENS, 6 * h * p["e"] * p["ffn"])}
    routed = p["moe_ffn"] * p["topk"] * p["e"]
    if p["latent"]:  # routed experts run in a latent of that width, between a down and an up projection
        routed_macs = p["latent"] * routed + 2 * h * p["latent"]
    else:
        routed_macs = h * routed
    return {"moe": (TOKENS, 6 * (routed_macs + h * p["e"] * p["shared"]))}


_MIXERS = {"attention": _attention, "sliding_attention": _attention, "mla": _mla, "dsa": _dsa, "gdn": _gdn,
           "gdn2": _gdn, "kda": _kda, "mamba2": _mamba2, "cross_attention": _cross_attention}
# Where a kind's sizes are when the structure gives none of its own (MiMo-V2-Flash's sliding layers have their own).
_PARAMS_OF = {"sliding_attention": "attention", "gdn2": "gdn"}


def _add(terms: dict, more: dict) -> None:
    for name, (count, coefficient) in more.items():
        if name in terms:
            assert terms[name][0] == count, name
            coefficient += terms[name][1]
        terms[name] = (count, coefficient)


def structure_terms(structure: TextStructure) -> dict:
    """The training-FLOPs terms ``{name: (count, coefficient)}`` of a text stack, summed over its layers,
    then ``mtp_projections`` / ``mtp_norms`` and ``logits`` (``6·h·V`` per token and prediction depth)."""
    h, terms = structure.hidden, {}
    for layer in structure.layers:
        if layer.mixer is not None:
            kind = layer.mixer if layer.mixer in structure.params else _PARAMS_OF.get(layer.mixer, layer.mixer)
            _add(terms, _MIXERS[layer.mixer](structure.params[kind], h, layer))
        if layer.ffn is not None:
            _add(terms, _ffn(layer.ffn, structure.params[layer.ffn], h))
    if structure.mtp_blocks:
        _add(terms, {"mtp_projections": (TOKENS, 6 * 2 * h * h * structure.mtp_blocks),
                     "mtp_norms": (TOKENS, 6 * 3 * h * structure.mtp_blocks)})
    _add(terms, {"logits": (TOKENS, 6 * h * structure.vocab * (1 + structure.mtp_depths))})
    return terms
