"""The packed THD batch and its conversions to consumer formats."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


@dataclass
class ThdBatch:
    """One pack of samples in THD layout (no batch axis, no padding rows).

    ``T`` is the stream length (sum of padded lengths), ``n`` the number of samples.

    Attributes:
        input_ids: int64 ``[T]``. Sample i occupies
            ``cu_seqlens_padded[i] : cu_seqlens_padded[i] + seq_lens[i]``; the
            ``pad_multiple`` alignment slots after it hold ``pad_token_id``.
        labels: int64 ``[T]`` *target* labels, already shifted within each sample:
            ``labels[t]`` is the token position t must predict. The last token of
            every sample, prompt tokens and pad slots are ``ignore_index``.
        loss_mask: bool ``[T]``, ``labels != ignore_index``.
        position_ids: int64 ``[T]``, restarting at 0 for every sample. Pad slots
            continue their sample's count (``s_i, s_i+1, ...``), so they stay in
            their sample's attention segment, after all its real tokens.
        cu_seqlens: int32 ``[n+1]`` cumulative real lengths.
        cu_seqlens_padded: int32 ``[n+1]`` cumulative padded lengths (the layout).
        max_seqlen: largest padded length (Python int).
        seq_lens: int32 ``[n]`` real lengths.
        sample_index: int64 ``[n]`` which input rows are in the pack, in order.
        pad_multiple: every padded length is a multiple of this.
        ignore_index: the label value that carries no loss.
        tokens_truncated: tokens cut off the input samples to build this batch.
        extras: room for per-batch data added by later stages.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    seq_lens: torch.Tensor
    sample_index: torch.Tensor
    pad_multiple: int = 1
    ignore_index: int = -100
    tokens_truncated: int = 0
    extras: dict = field(default_factory=dict)

    # ---- sizes -----------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return int(self.seq_lens.numel())

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens in the pack."""
        return int(self.cu_seqlens[-1])

    @property
    def num_padded_tokens(self) -> int:
        """Stream length ``T``, alignment padding included."""
        return int(self.input_ids.numel())

    @property
    def seq_lens_padded(self) -> torch.Tensor:
        """int32 ``[n]`` padded lengths."""
        return self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]

    @property
    def seqlen_squared_sum(self) -> int:
        """``Σ sᵢ²`` over real lengths (Python int: no int32 overflow)."""
        s = self.seq_lens.to(torch.int64)
        return int((s * s).sum())

    def __len__(self) -> int:
        return self.num_padded_tokens

    # ---- movement --------------------------------------------------------
    def _map_tensors(self, fn) -> "ThdBatch":
        changes = {
            f.name: fn(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        changes["extras"] = {k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in self.extras.items()}
        return dataclasses.replace(self, **changes)

    def to(self, device, non_blocking: bool = False) -> "ThdBatch":
        """A copy with every tensor on ``device``."""
        return self._map_tensors(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "ThdBatch":
        """A copy with every tensor in pinned host memory (DataLoader ``pin_memory=True`` calls this)."""
        return self._map_tensors(lambda t: t.pin_memory())

    # ---- consumers -------------------------------------------------------
    def hf_labels(self) -> torch.Tensor:
        """int64 ``[T]`` labels for a transformers causal LM, whose loss shifts by one:
        ``hf_labels[t + 1] == labels[t]``, so the model scores exactly the targets."""
        out = torch.full_like(self.labels, self.ignore_index)
        out[1:] = self.labels[:-1]
        return out

    def to_hf_kwargs(self, *, include_labels: bool = True) -> dict:
        """Keyword arguments for ``model(**kw)`` of a transformers causal LM.

        Tensors get a batch axis of 1. ``position_ids`` let sdpa / eager attention
        find the sample boundaries; ``cu_seq_lens_q/k`` and ``max_length_q/k`` (the
        padded layout) drive flash-attention varlen kernels.
        """
        kw = {
            "input_ids": self.input_ids.unsqueeze(0),
            "position_ids": self.position_ids.unsqueeze(0),
            "cu_seq_lens_q": self.cu_seqlens_padded,
            "cu_seq_lens_k": self.cu_seqlens_padded,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
        }
        if include_labels:
            kw["labels"] = self.hf_labels().unsqueeze(0)
        return kw

    def packed_seq_params_dict(self) -> dict:
        """Megatron-core ``PackedSeqParams`` fields as a dict."""
        return {
            "qkv_format": "thd",
            "cu_seqlens_q": self.cu_seqlens,
            "cu_seqlens_kv": self.cu_seqlens,
            "cu_seqlens_q_padded": self.cu_seqlens_padded,
            "cu_seqlens_kv_padded": self.cu_seqlens_padded,
            "max_seqlen_q": self.max_seqlen,
            "max_seqlen_kv": self.max_seqlen,
        }

    def to_packed_seq_params(self):
        """Megatron-core's ``PackedSeqParams`` when ``megatron.core`` is importable,
        else a dict with the same field names (see :meth:`packed_seq_params_dict`)."""
        fields = self.packed_seq_params_dict()
        try:
            from megatron.core.packed_seq_params import PackedSeqParams
        except ImportError:
            return fields
        return PackedSeqParams(**fields)
