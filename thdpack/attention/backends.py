"""Which attention inputs a transformers ``attn_implementation`` needs from a packed batch.

What transformers 5.x does with a packed batch (``masking_utils.create_causal_mask``, read for
5.24): when the model gets no ``attention_mask`` and no cache (``use_cache=False``), it finds the
sample boundaries where ``position_ids`` stop counting up by one
(``find_packed_sequence_indices``) and masks sdpa, eager and flex attention per sample. The
Qwen-VL families do the same from the text row of ``[4, 1, T]`` position ids. With a cache (the
default ``use_cache=True`` of most configs) it does not: the pack is masked as one sequence.
A 4D ``attention_mask`` (tensor or ``BlockMask``) is used as it is.

So per backend (:meth:`thdpack.ThdBatch.to_hf_kwargs`):

- ``"flash"``: flash-attn varlen kwargs (``cu_seq_lens_q/k``, ``max_length_q/k``), for ``None``,
  any name with ``flash`` in it (transformers' own test: ``flash_attention_2/3/4``,
  ``kernels-community/flash-attn3``) and other hub kernels (``org/name``);
- ``"flex"``: ``flex_attention``: the document ``BlockMask`` as ``attention_mask``, built from the
  offsets (transformers would otherwise build one per forward with ``create_block_mask``, ``T²``
  evaluations);
- ``"dense"``: ``sdpa`` / ``eager``: ``position_ids`` only (transformers derives the mask; call the
  model with ``use_cache=False``). :meth:`thdpack.ThdBatch.attention_mask_4d` is the explicit mask
  where that is not possible.
"""

from __future__ import annotations

DENSE_IMPLEMENTATIONS = ("sdpa", "eager")
FLEX_IMPLEMENTATIONS = ("flex_attention",)


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
        if "flash" in attn_implementation or "/" in attn_implementation.strip("/"):
            return "flash"
    raise ValueError(
        f"attn_implementation must be None, 'flash_attention_2', 'flash_attention_3', a kernels hub name (org/name), "
        f"'flex_attention', 'sdpa' or 'eager', got {attn_implementation!r}"
    )
