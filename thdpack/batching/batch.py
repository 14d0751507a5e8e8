"""The packed THD batch and its CP shard (:func:`shard_for_cp`, over the index arithmetic of
:mod:`thdpack.parallel.cp`). Consumers' views live with them: :mod:`thdpack.integrations.hf_kwargs`
(transformers), :mod:`thdpack.integrations.megatron_core` (``PackedSeqParams``)."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

import torch

from thdpack.attention.seq_idx import seq_idx_from_cu_seqlens
from thdpack.attention.static import pad_cu_seqlens
from thdpack.attention.block_mask import DEFAULT_BLOCK_SIZE, build_block_mask, check_block_size
from thdpack.attention.dense_mask import build_dense_mask, check_mask_dtype
from thdpack.attention.documents import documents_of
from thdpack.flops.sequences import tree_seqlen_squared_sum
from thdpack.attention.tree_mask import build_dense_tree_mask, build_tree_block_mask
from thdpack.batching.prefix_tree import PrefixTree, refuse_tree
from thdpack.parallel.shard import WHOLE, Shard
from thdpack.parallel.cp import check_cp_args, local_seq_lens, thd_partition_indices, vision_shard_extras
from thdpack.common.align import check_bool, check_int
from thdpack.common.samples import IGNORE_INDEX

_warned_no_targets = False  # warn_if_no_targets warns once per process


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
        sample_index: int64 ``[n]`` where each sample of the pack came from, in pack order:
            the ``sample_index`` given to :func:`thdpack.build_thd_batch` (default: the
            samples' positions in its list, ``0..n-1``). Offline packs
            (``PackedRowCollator``) hold the rows of the build's input; :class:`thdpack.ThdCollator`
            the samples' ``"sample_index"`` field, which :class:`thdpack.IndexedDataset` sets to
            the dataset row (behind a ``TokenBudgetBatchSampler``) and
            :class:`thdpack.StreamingPacker` to the stream position; samples without it
            are numbered by their position in the collator's call.
        source_index: int64 ``[n]`` the source (of a dataset mixture) each sample came from, in pack
            order: the ``source_index`` given to :func:`thdpack.build_thd_batch`, by default the samples'
            ``"source_index"`` field (:class:`thdpack.loaders.mixture_dataset.MixtureDataset` sets it),
            else 0 for every sample (given as None, it is filled so). Losses and metrics split by it:
            :func:`thdpack.losses.source_totals`.
        pad_multiple: every padded length is a multiple of this.
        ignore_index: the label value that carries no loss.
        tokens_truncated: tokens cut off the input samples to build this batch.
        token_extras: more per-token tensors, token axis last (``[..., T]``), e.g.
            mRoPE rows; CP sharding indexes them like ``input_ids``.
        extras: other per-batch data added by later stages.
        max_num_seqs: None, or the fixed number of sequences the kernels see (static shapes,
            ``BatchLayout.max_num_seqs``): :mod:`thdpack.integrations`' ``to_hf_kwargs`` and
            ``packed_seq_params_dict`` pad their offsets to ``max_num_seqs + 1`` entries (``static_cu_seqlens``);
            every field above stays real.
        shard: which part of the pack the batch holds (:class:`thdpack.parallel.shard.Shard`): the whole
            stream (:data:`~thdpack.parallel.shard.WHOLE`), or one CP / Ulysses / hybrid-CP rank's shard, with
            its sizes, ranks, local offsets and ``partition_indices``.
        prefix_tree: None, or for a shared-prefix batch (``build_thd_batch(share_prefix=...)``) its
            :class:`thdpack.batching.prefix_tree.PrefixTree`. Then the stream's segments (``cu_seqlens``,
            ``cu_seqlens_padded``, ``seq_lens``, ``max_seqlen``, ``document_ids``) are the shared prefixes,
            the members' own tokens after them and the samples alone; ``position_ids`` continue each
            prefix's count in its members; ``labels`` / ``loss_mask`` are each row's target where it has
            one label (a prefix's last row predicts every member's first token: ``ignore_index`` there,
            the targets in the tree's table); ``num_samples``, ``sample_index``, ``sample_values`` and the
            losses of :mod:`thdpack.losses` are per sample, in the order given; ``num_targets``, and what
            :func:`thdpack.losses.token_logps` and :meth:`token_values` return, per entry of the target
            table (``[N]``, the unshared batch's targets in order). Masks: :meth:`block_mask`,
            :meth:`attention_mask_4d` and ``to_hf_kwargs(attn_implementation="flex_attention" | "sdpa" |
            "eager")``; the varlen / Megatron / Mamba dialects (flash kwargs, ``packed_seq_params_dict``,
            ``seq_idx``) and CP shards cannot express the tree and raise ``ValueError``.
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

    @property
    def seqlen_squared_sum(self) -> int:
        """``Σ sᵢ²`` over real lengths (Python int: no int32 overflow). On a shared-prefix batch the tree's
        attention work in the same convention, ``Σ_prefix p² + Σ_member c·(2p + c)``
        (:func:`thdpack.flops.sequences.tree_seqlen_squared_sum`)."""
        if self.prefix_tree is not None:
            return tree_seqlen_squared_sum(self.seq_lens, self.prefix_tree.parents)
        s = self.seq_lens.to(torch.int64)
        return int((s * s).sum())

    def __len__(self) -> int:
        return self.num_padded_tokens

    @property
    def padding_mask(self) -> torch.Tensor:
        """bool ``[T]`` (a shard: its local slots), True on the slots that hold no token of a sample: the
        alignment pad slots after each sample's real tokens and a ``pad_to`` tail. On a CP (or Ulysses) shard
        the stream's mask taken by ``partition_indices``, the indices of its tokens. What megatron-core's
        ``GPTModel.forward(padding_mask=...)`` takes (``[1, T]``, True = pad) to keep pad slots out of its MoE
        routers' aux and z losses, token counts and expert-bias updates (``to_gpt_forward_kwargs``). A
        shared-prefix batch is a ``ValueError``."""
        refuse_tree("padding_mask (each sample's pad slots after its tokens)", self)
        cu = self.cu_seqlens_padded.to(torch.int64)
        whole = torch.arange(self.num_padded_tokens, device=cu.device)
        slots = self.shard.partition_indices if self.is_shard else whole
        slots = slots.to(cu.device)
        doc = documents_of(cu, slots)
        return slots - cu[doc] >= self.seq_lens.to(device=cu.device, dtype=torch.int64)[doc]

    # ---- seq_idx and static shapes (thdpack.attention.seq_idx, thdpack.attention.static) ----
    @property
    def seq_idx(self) -> torch.Tensor:
        """int32 ``[1, T]``: the sample of every stream slot, as transformers'
        ``DataCollatorWithFlattening(return_seq_idx=True)`` and megatron-core's ``PackedSeqParams``
        (from ``total_tokens``) give it to Mamba-2 / Gated-DeltaNet layers. Pad slots and a ``pad_to``
        tail hold their sample's id (the span of ``cu_seqlens_padded`` they are in). On a CP shard:
        the whole stream's (``T`` global), since such a layer scans the whole stream. A scan cannot
        restart from a shared prefix: ``ValueError`` on a shared-prefix batch."""
        refuse_tree("seq_idx (a per-sequence scan)", self)
        return seq_idx_from_cu_seqlens(self.cu_seqlens_padded)

    @property
    def static_cu_seqlens(self) -> torch.Tensor:
        """int32 ``[max_num_seqs + 1]``: ``cu_seqlens`` with its last value repeated (zero-length
        sequences, :func:`thdpack.attention.static.pad_cu_seqlens`); ``cu_seqlens`` without ``max_num_seqs``."""
        return self.cu_seqlens if self.max_num_seqs is None else pad_cu_seqlens(self.cu_seqlens, self.max_num_seqs)

    @property
    def static_cu_seqlens_padded(self) -> torch.Tensor:
        """int32 ``[max_num_seqs + 1]``: ``cu_seqlens_padded`` likewise (its repeated last value is ``T``)."""
        cu = self.cu_seqlens_padded
        return cu if self.max_num_seqs is None else pad_cu_seqlens(cu, self.max_num_seqs)

    @property
    def static_max_seqlen(self) -> int:
        """``max_seqlen`` for the kernels: with ``max_num_seqs`` the stream length ``T`` (global), an
        upper bound every batch of a ``pad_to`` epoch shares; else ``max_seqlen``."""
        return self.max_seqlen if self.max_num_seqs is None else int(self.cu_seqlens_padded[-1])

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

    # ---- document ids and attention masks (thdpack.attention) -------------
    @property
    def document_ids(self) -> torch.Tensor:
        """int32 ``[T]``: the sample (``0..n-1``) of every slot, by ``cu_seqlens_padded``: pad
        slots and a ``pad_to`` tail hold the id of the sample before them, as ``position_ids``
        continue its count (:mod:`thdpack.attention.documents`). On a CP or Ulysses shard: the
        sample of each local token (the whole stream's ids at ``partition_indices``). On a shared-prefix
        batch: the segment of every slot (:attr:`document_parents` tells which prefix a member sees)."""
        cu = self.cu_seqlens_padded.to(torch.int64)
        whole = torch.arange(self.num_padded_tokens, device=cu.device)
        slots = self.shard.partition_indices if self.is_shard else whole
        return documents_of(cu, slots.to(cu.device)).to(torch.int32)

    @property
    def document_parents(self) -> torch.Tensor:
        """int32 ``[S]`` the parent of every document (segment) of :attr:`document_ids`: on a shared-prefix
        batch a member's prefix (it attends to the prefix's real tokens, then to itself causally), ``-1``
        for a prefix or a sample alone; all ``-1`` for an unshared batch."""
        if self.prefix_tree is not None:
            return self.prefix_tree.parents.to(torch.int32)
        return torch.full((int(self.seq_lens.numel()),), -1, dtype=torch.int32, device=self.seq_lens.device)

    def block_mask(self, block_size=DEFAULT_BLOCK_SIZE, *, device=None):
        """The document-causal FlexAttention ``BlockMask`` of the stream, ``shape (1, 1, T, T)``, built
        from ``cu_seqlens_padded`` (:func:`thdpack.attention.block_mask.document_block_mask`: no
        ``[T, T]`` tensor; equal to ``create_block_mask`` over a document mask_mod, block for block).

        Args:
            block_size: tile size, an integer or a ``(q_block, kv_block)`` pair.
            device: where to build it (default: the batch's); build it where attention runs.

        On a shared-prefix batch, the tree's mask (:func:`thdpack.attention.tree_mask.tree_block_mask`).
        """
        q_block, kv_block = check_block_size(block_size)
        cu = whole_stream_offsets(self, "block_mask()", device)
        if self.prefix_tree is not None:
            lens, parents = self._tree_segments(cu.device)
            return build_tree_block_mask(cu, lens, parents, self.num_padded_tokens, q_block, kv_block)
        return build_block_mask(cu, self.num_padded_tokens, q_block, kv_block)

    def attention_mask_4d(self, dtype: torch.dtype = torch.bool, *, device=None) -> torch.Tensor:
        """The dense block-diagonal causal mask ``[1, 1, T, T]`` for SDPA (``torch.bool``, True =
        attend) or eager attention (a floating ``dtype``: additive, 0 or ``finfo(dtype).min``).
        ``T²`` elements (1 GiB as bool for 32k tokens): for small packs; prefer :meth:`block_mask`
        or flash-attn varlen for long ones (:mod:`thdpack.attention.dense_mask`). On a shared-prefix
        batch, the tree's mask (:func:`thdpack.attention.tree_mask.dense_tree_mask`)."""
        check_mask_dtype(dtype)
        cu = whole_stream_offsets(self, "attention_mask_4d()", device)
        if self.prefix_tree is not None:
            return build_dense_tree_mask(cu, *self._tree_segments(cu.device), self.num_padded_tokens, dtype)
        return build_dense_mask(cu, self.num_padded_tokens, dtype)

    def _tree_segments(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``[S]`` real lengths and parents of the segments, on ``device``."""
        return self.seq_lens.to(device, torch.int64), self.prefix_tree.parents.to(device, torch.int64)



def whole_stream_offsets(batch: ThdBatch, what: str, device=None) -> torch.Tensor:
    """int64 ``cu_seqlens_padded`` of ``batch`` on ``device`` (default: the batch's); ``ValueError`` naming
    ``what`` on a shard (a whole-stream mask cannot be built from one rank's tokens)."""
    if batch.is_shard:
        sh = batch.shard
        kind = f"Ulysses shard (sp_size={sh.sp_size}" if sh.sp_size > 1 else f"CP shard (cp_size={sh.cp_size}"
        rank = sh.sp_rank if sh.sp_size > 1 else sh.cp_rank
        raise ValueError(f"{what} is for a whole batch, and this is a {kind}, rank {rank}): masks span "
                         "the whole stream; build them on the batch before sharding, or attend across ranks "
                         "with a CP attention (ring / all-gather) over the flash kwargs")
    cu = batch.cu_seqlens_padded.to(torch.int64)
    return cu if device is None else cu.to(device)


def shard_for_cp(batch: ThdBatch, cp_size: int, cp_rank: int) -> ThdBatch:
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
        raise TypeError(f"shard_for_cp takes a thdpack.ThdBatch (build_thd_batch, ThdCollator), got "
                        f"{type(batch).__name__}; for raw offsets use thdpack.thd_partition_indices")
    check_cp_args(cp_size, cp_rank)
    refuse_tree("shard_for_cp (TE / Megatron ring attention over cu_seqlens)", batch)
    have = batch.shard
    if have.cp_size != 1:
        raise ValueError(f"batch is already a CP shard (cp_size={have.cp_size}, rank {have.cp_rank})")
    if have.block_start is not None:
        raise ValueError(f"batch is a hybrid-CP batch (one rank's, at position {have.block_start}): its plan "
                         "decided its CP size; build the block's shards with thdpack.hybrid_cp_shards")
    if have.sp_size != 1:
        raise ValueError(f"batch is a Ulysses shard (sp_size={have.sp_size}, rank {have.sp_rank}); for Ulysses x "
                         "ring shard the whole batch once: thdpack.shard_for_ulysses(batch, sp_size, rank, cp_size=, "
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
