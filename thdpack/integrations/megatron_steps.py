"""A pipeline-parallel step's micro-batches as megatron-core's pipeline schedules read them.

megatron-core's ``forward_backward_func`` (``forward_backward_pipelining_without_interleaving`` /
``..._with_interleaving``) runs ``num_microbatches`` micro-batches, calling the forward step once per
micro-batch and model chunk, which pulls one batch from ``data_iterator`` (with interleaving, a list of
iterators, one per model chunk). What a batch holds depends on the stage (megatron-core's
``get_batch_on_this_tp_rank``): the first stage reads ``tokens`` and ``position_ids``, the last ``labels``
and ``loss_mask``, and every stage of a packed (THD) batch the boundaries: ``cu_seqlens``,
``cu_seqlens_padded`` and ``max_seqlen``, from which attention's ``PackedSeqParams`` is made. The middle
stages get the boundaries without the tokens::

    steps = MegatronSteps(batches, pp_rank=pp_rank, pp_size=pp_size, vpp_size=vpp_size)
    losses = forward_backward_func(forward_step_func=step, model=model, forward_only=False,
                                   **steps.forward_backward_kwargs())

``batches``: this data-parallel rank's micro-batches of the step in run order (``rebalance_steps``'s, or
built from :func:`thdpack.plan_steps`'s ``micro_batches[rank]``), whole packs: megatron-core's
``get_batch_on_this_cp_rank`` cuts a context-parallel rank's share itself (build them with the CP
alignment, ``cp_size=``, and without ``cp_rank``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from thdpack.batching.batch import ThdBatch
from thdpack.common.align import check_int, check_positive_int
from thdpack.integrations.megatron_core import packed_seq_params_dict, to_packed_seq_params

#: The keys of every micro-batch, megatron-core's ``get_batch_on_this_tp_rank`` batch keys and ``packed_seq_params``.
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask", "cu_seqlens", "cu_seqlens_padded",
              "max_seqlen", "packed_seq_params")


def megatron_micro_batch(batch: ThdBatch, *, first_stage: bool, last_stage: bool, ignore_label: int = 0,
                         cp_group=None) -> dict:
    """One micro-batch as a stage of megatron-core's pipeline reads it (:data:`BATCH_KEYS`).

    Returns a dict: on the first stage ``tokens`` and ``position_ids`` int64 ``[1, T]``; on the last ``labels``
    int64 ``[1, T]`` (target labels, ``ignore_label`` where nothing is scored) and ``loss_mask`` float32
    ``[1, T]``; on every stage ``cu_seqlens`` int32 ``[1, n+1]`` (real lengths), ``cu_seqlens_padded`` int32
    ``[1, n+1]`` (the layout; None when no sample is padded and the batch has no alignment), ``max_seqlen``
    int32 ``[1]`` and ``packed_seq_params`` (:func:`thdpack.integrations.megatron_core.to_packed_seq_params`);
    what a stage does not read is None (a middle stage: the boundaries only). ``attention_mask`` is None."""
    if not isinstance(batch, ThdBatch):
        raise TypeError(f"megatron_micro_batch takes a thdpack.ThdBatch, got {type(batch).__name__}")
    if batch.is_shard:
        raise ValueError(f"megatron_micro_batch: got CP rank {batch.shard.cp_rank}'s shard of a pack; megatron-core's "
                         "get_batch_on_this_cp_rank cuts each CP rank's share itself: give the whole pack")
    check_int(ignore_label, "ignore_label", None, hint=" (the label of unscored positions)")
    fields = packed_seq_params_dict(batch, cp_group)
    padded = fields["cu_seqlens_q_padded"]
    out = dict.fromkeys(BATCH_KEYS)
    out.update(cu_seqlens=fields["cu_seqlens_q"].unsqueeze(0),
               cu_seqlens_padded=None if padded is None else padded.unsqueeze(0),
               max_seqlen=torch.tensor([fields["max_seqlen_q"]], dtype=torch.int32),
               packed_seq_params=to_packed_seq_params(batch, cp_group))
    if first_stage:
        out.update(tokens=batch.input_ids.long().unsqueeze(0), position_ids=batch.position_ids.long().unsqueeze(0))
    if last_stage:
        out.update(labels=torch.where(batch.loss_mask, batch.labels, ignore_label).long().unsqueeze(0),
                   loss_mask=batch.loss_mask.float().unsqueeze(0))
    return out


class MegatronSteps:
    """One step's micro-batches for megatron-core's ``forward_backward_func`` on one pipeline rank.

    Args:
        batches: this data-parallel rank's micro-batches in run order (whole packs).
        pp_rank, pp_size: this rank's pipeline stage and the number of stages.
        vpp_size: model chunks per stage (interleaving): :meth:`data_iterator` is then a list of that many
            iterators, chunk ``c`` on stage ``pp_rank`` being virtual stage ``c·pp_size + pp_rank``.
        num_micro_batches: checked against ``len(batches)`` when given (e.g. ``StepsHandle.num_micro_batches``).
        ignore_label, cp_group: as in :func:`megatron_micro_batch`.

    Attributes:
        num_microbatches: ``len(batches)``, the same on every data-parallel rank of a ``plan_steps`` step.
        seq_length: the longest micro-batch's stream length: megatron-core sizes its pipeline messages by it
            unless ``config.variable_seq_lengths`` is set, which a step of varying lengths needs
            (:attr:`variable_seq_lengths` says so); build with ``pad_to=`` the cap for one length.
        variable_seq_lengths: the micro-batches' stream lengths differ.
    """

    def __init__(self, batches: Sequence[ThdBatch], *, pp_rank: int = 0, pp_size: int = 1, vpp_size: int = 1,
                 num_micro_batches: int | None = None, ignore_label: int = 0, cp_group=None):
        check_positive_int(pp_size, "pp_size")
        check_positive_int(vpp_size, "vpp_size")
        check_int(pp_rank, "pp_rank", None)
        if not 0 <= pp_rank < pp_size:
            raise ValueError(f"pp_rank={pp_rank} is not a stage of pp_size={pp_size} (0 .. {pp_size - 1})")
        batches = list(batches)
        if not batches:
            raise ValueError("MegatronSteps got no micro-batches; a step runs at least one")
        for j, b in enumerate(batches):
            if not isinstance(b, ThdBatch):
                raise TypeError(f"MegatronSteps: micro-batch {j} is a {type(b).__name__}, not a thdpack.ThdBatch")
        if num_micro_batches is not None and num_micro_batches != len(batches):
            raise ValueError(f"MegatronSteps: {len(batches)} micro-batches given, but the step has "
                             f"num_micro_batches={num_micro_batches}; every data-parallel rank must run the same number")
        self.batches, self.pp_rank, self.pp_size, self.vpp_size = batches, int(pp_rank), int(pp_size), int(vpp_size)
        self.ignore_label, self.cp_group = ignore_label, cp_group
        self.num_microbatches = len(batches)
        lengths = [int(b.cu_seqlens_padded[-1]) for b in batches]
        self.seq_length = max(lengths)
        self.variable_seq_lengths = len(set(lengths)) > 1

    def stage(self, chunk: int = 0) -> tuple[bool, bool]:
        """``(first, last)``: whether model chunk ``chunk`` of this stage is the pipeline's first / last virtual stage."""
        return (self.pp_rank == 0 and chunk == 0,
                self.pp_rank == self.pp_size - 1 and chunk == self.vpp_size - 1)

    def iterator(self, chunk: int = 0) -> Iterator[dict]:
        """The micro-batches in run order as model chunk ``chunk`` of this stage reads them."""
        first, last = self.stage(chunk)
        for batch in self.batches:
            yield megatron_micro_batch(batch, first_stage=first, last_stage=last, ignore_label=self.ignore_label,
                                       cp_group=self.cp_group)

    def data_iterator(self):
        """What ``forward_backward_func`` takes as ``data_iterator``: one iterator, or (``vpp_size > 1``) a list
        with one per model chunk. Fresh iterators at every call."""
        if self.vpp_size == 1:
            return self.iterator(0)
        return [self.iterator(c) for c in range(self.vpp_size)]

    def forward_backward_kwargs(self) -> dict:
        """``data_iterator``, ``num_microbatches``, ``seq_length`` and ``micro_batch_size`` (1: a micro-batch is
        one pack) for ``forward_backward_func``."""
        return {"data_iterator": self.data_iterator(), "num_microbatches": self.num_microbatches,
                "seq_length": self.seq_length, "micro_batch_size": 1}

    def __repr__(self) -> str:
        return (f"MegatronSteps(num_microbatches={self.num_microbatches}, pp_rank={self.pp_rank}, "
                f"pp_size={self.pp_size}, vpp_size={self.vpp_size}, seq_length={self.seq_length}, "
                f"variable_seq_lengths={self.variable_seq_lengths})")
