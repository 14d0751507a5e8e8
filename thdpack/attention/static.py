"""Static shapes for CUDA graphs and ``torch.compile(dynamic=False)``: ``cu_seqlens`` of a fixed length.

A pack's stream length is made fixed by ``pad_to`` (:class:`thdpack.batching.layout.BatchLayout`);
its number of samples by ``max_num_seqs``: the offsets handed to a kernel are padded to
``max_num_seqs + 1`` entries by repeating their last value, which appends zero-length sequences
(Megatron-Bridge's ``pad_cu_seqlens``: ``GPTSFTPackedDataset.collate_fn`` in
``megatron/bridge/data/packing/gpt_sft.py`` extends ``cu_seqlens_padded`` with the stream length and
``cu_seqlens`` with its last value; megatron-core's ``pad_cu_seqlens_for_cuda_graph``, Megatron-LM
PR #5046, and torchtitan's varlen CUDA graphs, PR #4158, do the same)::

    cu_seqlens         [0, 5, 7, 11]                  (3 samples)
    max_num_seqs=6  -> [0, 5, 7, 11, 11, 11, 11]      (3 zero-length sequences after them)

Details: docs/attention.md, "Static shapes: zero-length sequences and a static max_seqlen".
"""

from __future__ import annotations

import torch

from thdpack.common.align import check_int

_OFFSET_KEYS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")


def check_max_num_seqs(max_num_seqs) -> None:
    """``ValueError`` unless ``max_num_seqs`` is None or an integer >= 1."""
    if max_num_seqs is not None:
        check_int(max_num_seqs, "max_num_seqs", 1, hint=" (the most samples a pack holds, for static cu_seqlens)")


def check_num_seqs(num_samples: int, max_num_seqs: int | None) -> None:
    """``ValueError`` naming the batch's number of samples when it exceeds ``max_num_seqs``."""
    if max_num_seqs is not None and num_samples > max_num_seqs:
        raise ValueError(
            f"a batch of {num_samples} samples does not fit max_num_seqs={max_num_seqs}: plan at most "
            f"{max_num_seqs} samples per pack (max_samples_per_pack={max_num_seqs}, which ThdCollator(pack_size=..., "
            f"max_num_seqs={max_num_seqs}) sets) or raise max_num_seqs"
        )


def pad_cu_seqlens(cu_seqlens: torch.Tensor, max_num_seqs: int) -> torch.Tensor:
    """``cu_seqlens`` followed by its last value until it has ``max_num_seqs + 1`` entries.

    Args:
        cu_seqlens: int32 ``[n+1]`` cumulative lengths (real or padded; any device), ``n <= max_num_seqs``.
        max_num_seqs: the fixed number of sequences (an integer >= 1).

    Returns:
        int32 ``[max_num_seqs + 1]`` on ``cu_seqlens``' device; the ``max_num_seqs - n`` sequences
        appended have length 0. ``ValueError`` naming ``n`` when it exceeds ``max_num_seqs``.
    """
    check_int(max_num_seqs, "max_num_seqs", 1)
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 1:
        got = tuple(cu_seqlens.shape) if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
        raise ValueError(f"cu_seqlens must be a 1-D tensor with at least one entry, got {got}")
    n = cu_seqlens.shape[0] - 1
    check_num_seqs(n, max_num_seqs)
    cu = cu_seqlens.to(torch.int32)
    return torch.cat([cu, cu[-1:].expand(max_num_seqs - n)])


def static_seq_params(fields: dict, max_num_seqs: int) -> dict:
    """Megatron-core ``PackedSeqParams`` fields (``thdpack.integrations.megatron_core.packed_seq_params_dict``)
    with static shapes.

    Every offset field becomes int32 ``[max_num_seqs + 1]`` (:func:`pad_cu_seqlens`); the padded
    fields are set even where they equal the real ones (a field that is None for one batch and a
    tensor for the next is a new graph); ``max_seqlen_q`` / ``max_seqlen_kv`` become ``total_tokens``.
    megatron-core's ``seq_idx`` is unchanged: the zero-length sequences hold no slot."""
    out = dict(fields)
    if out["cu_seqlens_q_padded"] is None:
        out["cu_seqlens_q_padded"] = out["cu_seqlens_kv_padded"] = fields["cu_seqlens_q"]
    padded = {}  # q and kv are the same tensor: pad it once and keep them one object
    for key in _OFFSET_KEYS:
        source = out[key]
        if id(source) not in padded:
            padded[id(source)] = pad_cu_seqlens(source, max_num_seqs)
        out[key] = padded[id(source)]
    out["max_seqlen_q"] = out["max_seqlen_kv"] = int(out["total_tokens"])
    return out
