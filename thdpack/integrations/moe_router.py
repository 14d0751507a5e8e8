"""The router auxiliary loss of a transformers MoE model (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next, Mixtral, ...)
over a packed batch's real tokens.

What transformers does with the pad slots of a packed batch (5.x; ``load_balancing_loss_func`` of each MoE
family's modeling file, called by ``*ForCausalLM.forward`` when ``output_router_logits=True``, with the
``attention_mask`` the model was called with):

- without an ``attention_mask`` (flash-attention kwargs, ``to_hf_kwargs(ThdBatch)``): the loss averages the
  routing fractions and probabilities over *every* slot, so alignment pad slots and a ``pad_to`` tail count as
  tokens: the loss is that of a batch with extra tokens of the pad id;
- with thdpack's document masks (``to_hf_kwargs(attn_implementation="sdpa" | "eager" | "flex_attention")``,
  and :func:`thdpack.integrations.packed_model`, which adds one): it flattens the ``[1, 1, T, T]`` mask (or a
  ``BlockMask``) as if it were a ``[1, T]`` padding mask and fails with a ``RuntimeError`` (``T`` against
  ``T²``); a ``[1, T]`` mask cannot be given instead, since transformers then stops finding the packed
  samples from ``position_ids`` and attends across them.

:func:`router_aux_loss` computes the loss with the family's own ``load_balancing_loss_func`` and the batch's
:func:`thdpack.batching.views.padding_mask` as its ``[1, T]`` mask, which keeps the pad slots out: it equals the
loss transformers gives for the same samples packed without padding. Get the router logits from the
decoder, which does not compute the loss (``model.model(**kw, output_router_logits=True).router_logits``),
or from ``model(**kw, output_router_logits=True)`` where no mask is passed, and add
``config.router_aux_loss_coef * router_aux_loss(...)`` to the language-model loss.
"""

from __future__ import annotations

import sys

import torch

from thdpack.batching.batch import ThdBatch
from thdpack.batching.views import padding_mask


def _text_config(config):
    text = getattr(config, "text_config", None)
    return text if text is not None else config


def router_aux_loss(model, router_logits, batch: ThdBatch) -> torch.Tensor:
    """The load-balancing loss of ``model``'s family over ``batch``'s real tokens (module docstring).

    Args:
        model: a transformers MoE causal LM (or its decoder) whose modeling module defines
            ``load_balancing_loss_func``.
        router_logits: the per-layer router logits of the batch, ``[T, num_experts]`` each (a tuple or list, as
            transformers returns them with ``output_router_logits=True``).
        batch: the :class:`~thdpack.ThdBatch` the model ran on (its ``padding_mask`` marks the pad slots).

    Returns:
        the loss (a 0-dim tensor), not yet scaled by ``router_aux_loss_coef``.

    Raises:
        TypeError: ``model`` is not a module, ``router_logits`` not a tuple or list of tensors, ``batch`` not a
            :class:`~thdpack.ThdBatch`.
        ValueError: not a MoE model; ``router_logits`` empty, or a layer not ``[T, num_experts]`` of this batch.
    """
    loss_func, experts, top_k = _moe_family(model)
    if not isinstance(batch, ThdBatch):
        raise TypeError(f"router_aux_loss: batch must be the thdpack.ThdBatch the model ran on (build_thd_batch, "
                        f"ThdCollator), got {type(batch).__name__}")
    logits = _layer_logits(router_logits, batch.num_padded_tokens, experts)
    mask = (~padding_mask(batch)).to(torch.int64).unsqueeze(0)
    return loss_func(logits, experts, top_k, mask.to(logits[0].device))


def _moe_family(model) -> tuple:
    """``(load_balancing_loss_func, num_experts, num_experts_per_tok)`` of a transformers MoE model."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"router_aux_loss: model must be a transformers MoE model (a torch.nn.Module), got "
                        f"{type(model).__name__}")
    module = sys.modules.get(type(model).__module__)
    loss_func = getattr(module, "load_balancing_loss_func", None)
    config = _text_config(getattr(model, "config", None))
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if loss_func is None or not experts or not top_k:
        raise ValueError(f"{type(model).__name__} is not a transformers MoE model with a load_balancing_loss_func "
                         "(and num_experts / num_experts_per_tok in its config)")
    return loss_func, experts, top_k


def _layer_logits(router_logits, rows: int, experts: int) -> tuple:
    """``router_logits`` as a tuple of ``[rows, experts]`` tensors, one per layer: ``TypeError`` for anything
    but a tuple or list of tensors, ``ValueError`` for an empty one or a layer of another shape."""
    if not isinstance(router_logits, (tuple, list)):
        raise TypeError(f"router_logits must be a tuple or list of [T, num_experts] tensors, one per MoE layer (the "
                        f"model's output with output_router_logits=True), got {type(router_logits).__name__}")
    if not router_logits:
        raise ValueError("router_logits is empty: the model returned no router logits (call it with "
                         "output_router_logits=True), or it has no MoE layer")
    for i, layer in enumerate(router_logits):
        if not isinstance(layer, torch.Tensor):
            raise TypeError(f"router_logits[{i}] must be a [T, num_experts] tensor, got {type(layer).__name__}")
        if layer.dim() != 2 or layer.shape[1] != experts:
            raise ValueError(f"router_logits[{i}] must be [T, num_experts] with the model's {experts} experts, got "
                             f"shape {tuple(layer.shape)}")
        if layer.shape[0] != rows:
            raise ValueError(f"router_logits[{i}] has {layer.shape[0]} rows; the batch has {rows} slots (router "
                             "logits of this batch, one row per slot)")
    return tuple(router_logits)
