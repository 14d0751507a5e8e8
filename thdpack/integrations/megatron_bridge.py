"""A :class:`~thdpack.ThdBatch` as the batch Megatron-Bridge's training steps read, so that
:class:`~thdpack.ThdCollator` can be a Bridge collate function (micro batch size 1: one pack).

Checked against megatron-bridge 0.6.2 (tests/test_megatron_bridge_steps.py runs its code):

- ``gpt_step`` (training/gpt_step.py): ``get_batch`` reads ``tokens``, ``labels``, ``loss_mask``,
  ``position_ids`` (``[1, T]``) and ``attention_mask`` (None for THD); ``cu_seqlens_q`` present
  selects its current packed path, whose keys (``_CURRENT_PACKED_SEQ_*_KEYS``) go through
  ``get_packed_seq_params`` (training/utils/packed_seq_utils.py) into megatron-core's
  ``PackedSeqParams``. With context parallelism the step shards the whole pack itself
  (``get_thd_cp_partition_indices``), so give it the whole pack, not a thdpack CP shard.
- ``vlm_step`` (training/vlm_step.py, the Qwen2.5-VL / Qwen3.5 path): the same keys, plus
  ``visual_inputs``, an object whose tensor attributes the step moves to the GPU and whose
  ``normalized_for_model()`` gives the model's vision keyword arguments. Bridge's Qwen-VL models
  compute mRoPE themselves from ``tokens``, the grids and the packed boundaries.
- ``qwen3_vl_step`` refuses batches that carry ``cu_seqlens_q`` (it packs by itself): for Qwen3-VL
  in Bridge, use that step with unpacked batches.

Bridge does no loss shift: ``labels[t]`` is scored at position ``t``, which are thdpack's target
labels (shifted within each sample). Unscored positions carry ``ignore_label`` (0) and
``loss_mask`` 0, as Bridge's own collate functions give.
"""

from __future__ import annotations

import dataclasses

import torch

from thdpack.batching.batch import ThdBatch
from thdpack.common.align import check_int
from thdpack.integrations.megatron_core import packed_seq_params_dict, to_packed_seq_params
from thdpack.batching.views import padding_mask

# the vision inputs of a VLM batch (ThdBatch.extras / token_extras) that Bridge's models take
VISION_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")


@dataclasses.dataclass
class VisualInputs:
    """What ``vlm_step`` reads as ``batch["visual_inputs"]`` when Bridge's own
    ``GenericVisualInputs`` (training/utils/visual_inputs.py) cannot be imported: tensor fields
    (None when absent) and ``normalized_for_model()``, the non-None ones."""

    pixel_values: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None
    mm_token_type_ids: torch.Tensor | None = None

    def normalized_for_model(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def _visual_inputs(fields: dict):
    try:
        from megatron.bridge.training.utils.visual_inputs import GenericVisualInputs
    except ImportError:
        return VisualInputs(**fields)
    return GenericVisualInputs(**fields)


def to_bridge_batch(batch: ThdBatch, *, ignore_label: int = 0) -> dict:
    """The keys Bridge's ``gpt_step`` / ``vlm_step`` read for a packed THD batch.

    Returns a dict: ``tokens`` int64 ``[1, T]``, ``labels`` int64 ``[1, T]`` (target labels;
    ``ignore_label`` where nothing is scored), ``loss_mask`` float32 ``[1, T]``, ``position_ids``
    int64 ``[1, T]``, ``attention_mask`` None, ``cu_seqlens_q`` / ``cu_seqlens_kv`` int32
    ``[1, n+1]`` (real lengths), ``cu_seqlens_q_padded`` / ``cu_seqlens_kv_padded`` int32
    ``[1, n+1]`` (the layout; None when no sample is padded, as in
    :func:`~thdpack.integrations.megatron_core.packed_seq_params_dict`: TransformerEngine picks a slower kernel
    when they are set), ``max_seqlen_q`` / ``max_seqlen_kv`` int32 ``[1, 1]``; for a VLM
    batch also ``visual_inputs`` (pixel values, grids, ``mm_token_type_ids`` ``[1, T]``). A batch built
    with ``max_num_seqs=M`` gives ``[1, M+1]`` offsets (the last value repeated) and the stream length as
    ``max_seqlen``, as Bridge's own ``pad_cu_seqlens`` does: one shape for every batch.
    """
    _check_args("to_bridge_batch", batch, ignore_label)
    if batch.is_shard:
        raise ValueError(
            f"to_bridge_batch: got CP rank {batch.shard.cp_rank}'s shard of a pack; Megatron-Bridge's training steps "
            "shard packed batches themselves: collate the whole pack (ThdCollator without cp_rank) for them"
        )
    fields = packed_seq_params_dict(batch)  # the static offsets under max_num_seqs (thdpack.attention.static)
    max_seqlen = torch.tensor([[fields["max_seqlen_q"]]], dtype=torch.int32)
    layout = fields["cu_seqlens_q_padded"]  # None when no sample is padded
    out = {
        "tokens": batch.input_ids.long().unsqueeze(0),
        "labels": torch.where(batch.loss_mask, batch.labels, ignore_label).long().unsqueeze(0),
        "loss_mask": batch.loss_mask.float().unsqueeze(0),
        "position_ids": batch.position_ids.long().unsqueeze(0),
        "attention_mask": None,
        "cu_seqlens_q": fields["cu_seqlens_q"].unsqueeze(0),
        "cu_seqlens_kv": fields["cu_seqlens_kv"].unsqueeze(0),
        "cu_seqlens_q_padded": None if layout is None else layout.unsqueeze(0),
        "cu_seqlens_kv_padded": None if layout is None else layout.unsqueeze(0),
        "max_seqlen_q": max_seqlen,
        "max_seqlen_kv": max_seqlen.clone(),
    }
    vision = {k: batch.extras[k] for k in VISION_KEYS if batch.extras.get(k) is not None}
    if vision:
        token_type = batch.token_extras.get("mm_token_type_ids")
        if token_type is not None:
            vision["mm_token_type_ids"] = token_type.unsqueeze(0)
        out["visual_inputs"] = _visual_inputs(vision)
    return out


def to_gpt_forward_kwargs(batch: ThdBatch, *, cp_group=None, ignore_label: int = 0) -> dict:
    """Keyword arguments of megatron-core's ``GPTModel.forward`` for a batch, a static CP shard or a hybrid-CP
    micro-batch (``thdpack.shard(samples, plan=, rank=)``): what a forward step of one's own hands the model.

    Returns a dict: ``input_ids``, ``position_ids``, ``labels`` (target labels, ``ignore_label`` where nothing
    is scored) int64 ``[1, T]``; ``loss_mask`` float32 ``[1, T]``; ``attention_mask`` None;
    ``packed_seq_params`` (:func:`thdpack.integrations.megatron_core.to_packed_seq_params`, with ``local_cp_size``
    and the block's ``cp_group`` on a hybrid-CP batch: ``cp_group=`` as there); and ``padding_mask`` bool ``[1, T]``
    (:func:`thdpack.batching.views.padding_mask`, True on pad slots), which megatron-core's MoE layers use to keep
    pad slots out of the routers' aux and z losses, token counts and expert-bias updates. ``T`` is the local
    length on a shard."""
    _check_args("to_gpt_forward_kwargs", batch, ignore_label)
    return {
        "input_ids": batch.input_ids.long().unsqueeze(0),
        "position_ids": batch.position_ids.long().unsqueeze(0),
        "attention_mask": None,
        "labels": torch.where(batch.loss_mask, batch.labels, ignore_label).long().unsqueeze(0),
        "loss_mask": batch.loss_mask.float().unsqueeze(0),
        "packed_seq_params": to_packed_seq_params(batch, cp_group=cp_group),
        "padding_mask": padding_mask(batch).unsqueeze(0),
    }


def _check_args(caller: str, batch, ignore_label) -> None:
    """``TypeError`` unless ``batch`` is a :class:`~thdpack.ThdBatch`; ``ValueError`` unless ``ignore_label``
    is an integer (a token id: ``1.5`` is not read as 1)."""
    if not isinstance(batch, ThdBatch):
        raise TypeError(f"{caller} takes a thdpack.ThdBatch (build_thd_batch, ThdCollator, a CP or hybrid-CP "
                        f"shard), got {type(batch).__name__}")
    check_int(ignore_label, "ignore_label", None, hint=" (the label of unscored positions)")


class BridgeCollator:
    """``collate_fn`` for a Bridge data loader: ``collator`` (a :class:`~thdpack.ThdCollator`,
    or any callable giving a :class:`~thdpack.ThdBatch`) then :func:`to_bridge_batch`."""

    def __init__(self, collator, *, ignore_label: int = 0):
        self.collator = collator
        self.ignore_label = ignore_label

    def __call__(self, samples) -> dict:
        return to_bridge_batch(self.collator(samples), ignore_label=self.ignore_label)
