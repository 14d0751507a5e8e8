"""Which attention inputs a transformers ``attn_implementation`` needs from a packed batch.

What transformers 5.x does with a packed batch (``masking_utils.create_causal_mask``, read for
5.25): when the model gets no ``attention_mask`` and no cache, it finds the sample boundaries where
``position_ids`` stop counting up by one and masks sdpa, eager and flex attention per sample. With a
cache (the default ``use_cache=True`` of most configs) it does not: the pack is masked as one
sequence. A 4D ``attention_mask`` (tensor or ``BlockMask``) is used as it is, cache or not; that is
what the batch hands sdpa / eager / flex, so the model's ``use_cache`` default no longer matters.

Every kind also gets the boundaries that linear-attention, SSM and convolution layers read
(``cu_seq_lens_q/k``, ``max_length_q/k``, ``seq_idx``; docs/hybrid.md); attention functions take
them in ``**kwargs`` and ignore what they do not read. The kinds differ in the attention mask:

- ``"flash"``: no mask (varlen kernels read ``cu_seq_lens_q/k``): ``None``, ``"thdpack_varlen"`` (PyTorch's own
  ``varlen_attn``, :func:`thdpack.integrations.register_varlen_attention`), any name with ``flash``
  in it (transformers' own test: ``flash_attention_2/3/4``, ``kernels-community/flash-attn3``),
  other hub kernels (``org/name``), and custom names registered in transformers'
  ``AttentionInterface`` without a mask function;
- ``"flex"``: ``flex_attention`` (or a custom name whose mask function is transformers'
  ``flex_attention_mask``): the document ``BlockMask``, built from the offsets;
- ``"dense"``: ``sdpa`` / ``eager`` (or a custom name whose mask function is ``sdpa_mask`` /
  ``eager_mask``): the document-causal ``[1, 1, T, T]`` mask, bool for sdpa, float32 additive for
  eager (which adds it to its scores). ``T²`` elements, as transformers' own packed sdpa mask.

The core imports no transformers: a custom name is looked up only where the caller has imported
transformers already (it must have, to register the name).
"""

from __future__ import annotations

import sys

import torch

DENSE_IMPLEMENTATIONS = ("sdpa", "eager")
VARLEN_ATTENTION = "thdpack_varlen"  # PyTorch's varlen_attn (thdpack.integrations.register_varlen_attention): "flash"
FLEX_IMPLEMENTATIONS = ("flex_attention",)
_MASK_FUNCTION_KINDS = {"sdpa_mask": "dense", "eager_mask": "dense", "flex_attention_mask": "flex",
                        "flash_attention_mask": "flash"}


def attention_kind(attn_implementation) -> str:
    """``"flash"``, ``"flex"`` or ``"dense"`` for a transformers ``attn_implementation`` name (the
    rules: the module docstring); ``ValueError`` naming the value for anything else."""
    if attn_implementation is None:
        return "flash"
    if isinstance(attn_implementation, str):
        if attn_implementation in FLEX_IMPLEMENTATIONS:
            return "flex"
        if attn_implementation in DENSE_IMPLEMENTATIONS:
            return "dense"
        if attn_implementation == VARLEN_ATTENTION or "flash" in attn_implementation \
                or "/" in attn_implementation.strip("/"):
            return "flash"
        registered = _registered_kind(attn_implementation)
        if registered is not None:
            return registered
    raise ValueError(
        f"attn_implementation must be None, 'flash_attention_2', 'flash_attention_3', {VARLEN_ATTENTION!r}, "
        f"a kernels hub name (org/name), "
        f"'flex_attention', 'sdpa', 'eager' or a name registered in transformers' AttentionInterface, "
        f"got {attn_implementation!r}"
    )


def dense_mask_dtype(attn_implementation) -> torch.dtype:
    """The dtype of the ``"dense"`` kind's mask: float32 (additive) where transformers' eager mask would
    be used, else bool."""
    if attn_implementation == "eager":
        return torch.float32
    return torch.float32 if _mask_function_name(attn_implementation) == "eager_mask" else torch.bool


def _mask_function_name(name) -> str | None:
    """The name of the mask function an already imported transformers registers for ``name`` in its
    ``AttentionMaskInterface``; None when there is none (or transformers is not imported)."""
    masks = sys.modules.get("transformers.masking_utils")
    mapping = getattr(getattr(masks, "AttentionMaskInterface", None), "_global_mapping", {})
    fn = mapping.get(name)
    return None if fn is None else getattr(fn, "__name__", "")


def _registered_kind(name: str) -> str | None:
    """The kind of a name registered in an already imported transformers' ``AttentionInterface``, by the
    mask function registered beside it (none: ``"flash"``, transformers builds no mask for it); None when
    transformers is not imported or the name is not registered."""
    modeling = sys.modules.get("transformers.modeling_utils")
    interface = getattr(modeling, "AttentionInterface", None)
    if interface is None or name not in interface._global_mapping:
        return None
    mask_function = _mask_function_name(name)
    if mask_function is None:
        return "flash"
    return _MASK_FUNCTION_KINDS.get(mask_function, "dense")
