"""``seq_idx``: the sample of every stream slot, for Mamba-2 / Gated-DeltaNet style layers.

State-space and linear-attention layers scan the stream token by token; ``seq_idx`` tells
their kernels (``mamba_ssm``'s ``mamba_chunk_scan_combined``, ``causal_conv1d_fn``, through
transformers' ``seq_idx`` keyword) where a scan restarts. Two conventions, one value:

- transformers: ``DataCollatorWithFlattening(return_seq_idx=True)`` gives int32 ``[1, T]``,
  ``seq_idx[0, t]`` the index of the sample of token t in the pack (``0..n-1``);
- megatron-core (>= 0.19): ``PackedSeqParams.__post_init__`` builds the same int32
  ``[1, total_tokens]`` from ``cu_seqlens_q_padded`` (else ``cu_seqlens_q``) and
  ``total_tokens`` (``thdpack.integrations.megatron_core.packed_seq_params_dict`` sets both).

Pad slots, alignment padding and a ``pad_to`` tail alike, hold the id of the sample whose padded
span they are in (``cu_seqlens_padded`` decides, as in megatron-core, and as ``position_ids``
continue that sample's count). They come after all of the sample's real tokens, so a causal scan
or convolution over them changes no real token's output, and the next sample starts afresh.
A ``pad_to`` tail is the last sample's (it is part of its padded span); giving it an id of its own
would need one more ``cu_seqlens_padded`` entry than there are samples.
"""

from __future__ import annotations

import torch

from thdpack.attention.documents import document_ids_from_offsets


def seq_idx_from_cu_seqlens(cu_seqlens_padded) -> torch.Tensor:
    """int32 ``[1, T]``: ``seq_idx[0, t] = i`` for every slot ``t`` of sample i's padded span, the
    document ids of :mod:`thdpack.attention.documents` with the batch axis transformers and
    megatron-core give them.

    Args:
        cu_seqlens_padded: int ``[n+1]`` cumulative padded lengths (a list, numpy array or torch
            tensor on any device), starting at 0 and non-decreasing; ``T = cu_seqlens_padded[-1]``.
            Zero-length entries (the repeated last values of static shapes) hold no slot, so they
            change nothing.

    Returns:
        int32 ``[1, T]`` on the input's device (CPU for lists and numpy arrays).
    """
    return document_ids_from_offsets(cu_seqlens_padded).unsqueeze(0)
