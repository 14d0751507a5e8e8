"""The packed THD batch and its CP shard (:func:`_shard_for_cp`, what ``thdpack.shard(batch, cp_size=, cp_rank=)``
runs, over the index arithmetic of :mod:`thdpack.parallel.cp`). Consumers' views live with them:
:mod:`thdpack.integrations.hf_kwargs` (transformers), :mod:`thdpack.integrations.megatron_core` (``PackedSeqParams``),
:mod:`thdpack.batching.views` (masks, document ids, pad slots, ``seq_idx``, static shapes), :mod:`thdpack.flops`
(``seqlen_squared_sum(batch)``)."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

import torch

from thdpack.batching.prefix_tree import PrefixTree, refuse_tree
from thdpack.parallel.shard import WHOLE, Shard
from thdpack.parallel.cp import check_cp_args, local_seq_lens, thd_partition_indices, vision_shard_extras
from thdpack.common.align import check_bool, check_int
from thdpack.common.samples import IGNORE_INDEX

_warned_no_targets = False  # warn_if_no_targets warns once per process


@dataclass
class ThdBatch:
    """One pack of samples in THD layout (no batch axis, no padding rows); ``T`` is the stream length
    (sum of padded lengths), ``n`` the number of samples. The fields in full: docs/loaders.md, "ThdBatch: fields".

    Attributes:
        input_ids: int64 ``[T]``: sample i's ``seq_lens[i]`` tokens from ``cu_seqlens_padded[i]``, then pad slots.
        labels: int64 ``[T]`` target labels, shifted within each sample; ``ignore_index`` where unscored.
        loss_mask: bool ``[T]``, ``labels != ignore_index``.
        position_ids: int64 ``[T]``, restarting at 0 for every sample (pad slots continue its count).
        cu_seqlens: int32 ``[n+1]`` cumulative real lengths.
        cu_seqlens_padded: int32 ``[n+1]`` cumulative padded lengths (the layout).
        max_seqlen: largest padded length (Python int).
        seq_lens: int32 ``[n]`` real lengths.
        sample_index: int64 ``[n]`` where each sample of the pack came from, in pack order.
        source_index: int64 ``[n]`` the source (of a mixture) each sample came from (0: one source).
        pad_multiple: every padded length is a multiple of this.
        ignore_index: the label value that carries no loss.
        tokens_truncated: tokens cut off the input samples to build this batch.
        token_extras: more per-token tensors, token axis last (``[..., T]``), e.g. mRoPE rows.
        extras: other per-batch data added by later stages.
        max_num_seqs: None, or the fixed number of sequences the kernels see (static shapes).
        shard: which part of the pack it holds (:class:`thdpack.parallel.shard.Shard`; default: whole).
        prefix_tree: None, or a shared-prefix batch's :class:`thdpack.batching.prefix_tree.PrefixTree`.
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
    ignore_index: int = IGNORE_INDEX
    tokens_truncated: int = 0
    token_extras: dict = field(default_factory=dict)
    extras: dict = field(default_factory=dict)
    max_num_seqs: int | None = None
    prefix_tree: PrefixTree | None = None
    source_index: torch.Tensor | None = None
    shard: Shard = WHOLE

    def __post_init__(self):
        check_int(self.ignore_index, "ignore_index", None, hint=" (the label of unscored positions)")
        if self.source_index is None:  # one source: every sample's is 0
            self.source_index = torch.zeros(self.sample_index.shape, dtype=torch.int64, device=self.sample_index.device)

    # ---- sizes -----------------------------------------------------------
    @property
    def num_samples(self) -> int:
        if self.prefix_tree is not None:  # segments are not samples: prefixes hold several samples' tokens
            return int(self.sample_index.numel())
        return int(self.seq_lens.numel())

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens in the pack."""
        return int(self.cu_seqlens[-1])

    @property
    def num_targets(self) -> int:
        """Target tokens (``loss_mask.sum()``; on a CP shard, this rank's). 0 means the batch
        trains nothing, and a mean loss over it is NaN (0/0): skip it, or weight the loss
        by this count (the sum over targets divided by their total across batches / ranks). On a
        shared-prefix batch, the target table's entries: the unshared batch's count."""
        if self.prefix_tree is not None:
            return self.prefix_tree.num_targets
        return int(self.loss_mask.sum())

    @property
    def num_padded_tokens(self) -> int:
        """Length of the (local, for a shard) stream, alignment padding included."""
        return int(self.input_ids.numel())

    @property
    def is_shard(self) -> bool:
        """True when the batch holds one rank's tokens only (``shard.partition_indices`` set)."""
        return self.shard.partition_indices is not None

    @property
    def seq_lens_padded(self) -> torch.Tensor:
        """int32 ``[n]`` padded lengths."""
        return self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]

    def __len__(self) -> int:
        return self.num_padded_tokens

    # ---- per-sample values (thdpack.common.values) -------------------------------
    @property
    def sample_values(self) -> dict:
        """``{name: [n] or [n, k]}`` per-sample values read at build time (``sample_values=``)."""
        from thdpack.common.values import batch_sample_values

        return batch_sample_values(self)

    def token_values(self, name: str) -> torch.Tensor:
        """``[T]`` (or ``[T, k]``) per-sample value ``name`` on every slot of its sample. On a shared-prefix
        batch ``[N]`` (or ``[N, k]``): its sample's value for every entry of the target table, where
        :func:`thdpack.losses.token_logps` puts each target (a prefix row serves several samples)."""
        from thdpack.common.values import batch_sample_values, token_values

        values = batch_sample_values(self)
        if self.prefix_tree is not None and name in values:
            return values[name][self.prefix_tree.target_samples.to(values[name].device)]

        return token_values(self, name)

    # ---- movement --------------------------------------------------------
    def _map_tensors(self, fn) -> "ThdBatch":
        changes = {
            f.name: fn(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        for name in ("token_extras", "extras"):
            changes[name] = {k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in getattr(self, name).items()}
        if self.prefix_tree is not None:
            changes["prefix_tree"] = self.prefix_tree.map(fn)
        changes["shard"] = self.shard.map(fn)
        return dataclasses.replace(self, **changes)

    def to(self, device, non_blocking: bool = False) -> "ThdBatch":
        """A copy with every tensor on ``device``."""
        non_blocking = check_bool(non_blocking, "non_blocking")
        return self._map_tensors(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "ThdBatch":
        """A copy with every tensor in pinned host memory (DataLoader ``pin_memory=True`` calls this)."""
        return self._map_tensors(lambda t: t.pin_memory())


def _shard_for_cp(batch: ThdBatch, cp_size: int, cp_rank: int) -> ThdBatch:
    """Rank ``cp_rank``'s shard of ``batch``: every per-token tensor indexed by
    :func:`thdpack.thd_partition_indices` (:mod:`thdpack.parallel.cp`).

    The shard keeps the *global* ``cu_seqlens``, ``cu_seqlens_padded`` and
    ``max_seqlen`` (TransformerEngine divides by cp itself); its ``shard`` (layout ``"cp"``) holds
    ``local_cu_seqlens_padded`` (``cu_seqlens_padded // cp_size``: the local
    layout), ``local_seq_lens`` (real tokens per sample on this rank) and
    ``partition_indices`` (where each local token sits in the global stream).

    VLM batches: ``mrope_position_ids`` and ``mm_token_type_ids`` (token extras) are
    sharded with the same indices; vision inputs stay whole (vision embeddings are
    scattered into the global stream before the CP split) and the shard's extras add
    ``vision_token_positions``, ``image_embed_index`` and ``video_embed_index``
    (:func:`thdpack.parallel.cp.vision_shard_extras`).
    """
    if not isinstance(batch, ThdBatch):
        raise TypeError(f"shard(batch, cp_size=, cp_rank=) takes a thdpack.ThdBatch (build_thd_batch, ThdCollator), "
                        f"got {type(batch).__name__}; for raw offsets use thdpack.thd_partition_indices")
    check_cp_args(cp_size, cp_rank)
    refuse_tree("static CP sharding (thdpack.shard(batch, cp_size=, cp_rank=): TE / Megatron ring attention over "
                "cu_seqlens)", batch)
    have = batch.shard
    if have.cp_size != 1:
        raise ValueError(f"batch is already a CP shard (cp_size={have.cp_size}, rank {have.cp_rank})")
    if have.block_start is not None:
        raise ValueError(f"batch is a hybrid-CP batch (one rank's, at position {have.block_start}): its plan "
                         "decided its CP size; build the block's shards with thdpack.shard(samples, plan=, rank=)")
    if have.sp_size != 1:
        raise ValueError(f"batch is a Ulysses shard (sp_size={have.sp_size}, rank {have.sp_rank}); for Ulysses x "
                         "ring shard the whole batch once: thdpack.shard(batch, sp_size=, sp_rank=, cp_size=, "
                         "cp_rank=)")
    index = thd_partition_indices(batch.cu_seqlens_padded, cp_size, cp_rank).to(batch.input_ids.device)
    shard = dataclasses.replace(
        batch,
        input_ids=batch.input_ids[index],
        labels=batch.labels[index],
        loss_mask=batch.loss_mask[index],
        position_ids=batch.position_ids[index],
        token_extras={k: v[..., index] for k, v in batch.token_extras.items()},
        shard=Shard("cp", cp_size, cp_rank, partition_indices=index,
                    local_cu_seqlens_padded=(batch.cu_seqlens_padded // cp_size).to(torch.int32),
                    local_seq_lens=local_seq_lens(batch.seq_lens, batch.cu_seqlens_padded, cp_size, cp_rank)),
    )
    if "mm_token_type_ids" in batch.token_extras:  # VLM: global positions of this rank's vision tokens
        shard.extras = {**batch.extras, **vision_shard_extras(batch.token_extras["mm_token_type_ids"], index)}
    return shard


def warn_if_no_targets(batch: ThdBatch, stacklevel: int = 3) -> None:
    """Warn (once per process) when the whole batch ``batch`` has no target token. Not for a CP
    shard: one rank's part of a pack may hold no targets while the others do. ``stacklevel``
    as in :func:`warnings.warn`, counted from this function (3: the builder's caller)."""
    global _warned_no_targets
    if _warned_no_targets or batch.is_shard:
        return
    mask = batch.loss_mask  # any() through numpy: a third of a torch reduction's overhead (a per-batch hot path)
    if batch.prefix_tree is not None:
        mask = batch.prefix_tree.target_rows  # the targets of a shared-prefix batch are its table's entries
        if mask.numel():
            return
    elif mask.numpy().any() if mask.device.type == "cpu" else mask.any():
        return
    _warned_no_targets = True
    index = batch.sample_index.tolist()
    shown = ", ".join(map(str, index[:8])) + (", ..." if len(index) > 8 else "")
    warnings.warn(
        f"thdpack: a batch of {batch.num_samples} sample(s) (sample_index [{shown}]) has no target token "
        f"(every label is ignore_index={batch.ignore_index}), so a mean loss over it is NaN: skip such batches "
        "(if batch.num_targets == 0) or weight the loss by batch.num_targets; offline builds drop such samples "
        "by default (without_targets: drop). Warned once per process.",
        stacklevel=stacklevel,
    )
