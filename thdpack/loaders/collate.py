"""``collate_fn`` for a PyTorch DataLoader: a list of samples in, THD batches out; and the
sample field (``"sample_index"``) through which a batch learns where its samples came from."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from thdpack.batching.batch import ThdBatch
from thdpack.batching.builder import build_batch
from thdpack.common.align import INT64_MAX, check_int
from thdpack.batching.layout import BatchLayout, layout_of
from thdpack.batching.shared_prefix import (DEFAULT_MIN_PREFIX_LEN, check_share_args, flat_layout, group_prefixes,
                                            group_shares)
from thdpack.batching.vision_family import check_vlm
from thdpack.parallel.groups import check_process_group
from thdpack.parallel.ulysses import _shard_for_ulysses, check_ulysses_args, pad_for_ulysses, ulysses_pad_multiple
from thdpack.planning.options import AUDIO_FIELDS, PLAN_FIELDS, PlanOptions, plan_options
from thdpack.planning.plan import PackStats, check_kernel_limits, plan_packs
from thdpack.common.samples import SampleError, get_field, sample_list, to_int_array


class PackedBatches(list):
    """A list of :class:`ThdBatch` (one per pack) with the plan's ``stats``
    (what was truncated, split or dropped to make the packs fit)."""

    def __init__(self, batches, stats: PackStats):
        super().__init__(batches)
        self.stats = stats


SAMPLE_INDEX_FIELD = "sample_index"
"""The sample field that tells :class:`ThdCollator` where a sample came from (an integer >= 0):
:class:`IndexedDataset` adds the dataset index, :class:`thdpack.StreamingPacker` the stream position."""


def with_sample_index(sample, index: int):
    """``sample`` (a mapping) as a dict with :data:`SAMPLE_INDEX_FIELD` set to ``index``, unless it has
    that field already; any other value is returned as it is (the builder's error will name it)."""
    if not isinstance(sample, Mapping) or SAMPLE_INDEX_FIELD in sample:
        return sample
    return {**sample, SAMPLE_INDEX_FIELD: int(index)}


class IndexedDataset(Dataset):
    """A map-style dataset whose samples carry their index, so that batches can name their rows.

    ``IndexedDataset(ds)[i]`` is ``ds[i]`` with ``"sample_index": i`` added (:func:`with_sample_index`),
    and :class:`ThdCollator` puts those indices in ``batch.sample_index``::

        loader = DataLoader(IndexedDataset(ds), batch_sampler=TokenBudgetBatchSampler(lengths, 4096),
                            collate_fn=ThdCollator())
        # every batch.sample_index holds the dataset rows of its pack, in stream order

    ``dataset``: anything with ``__len__`` and ``__getitem__`` returning mappings (a
    ``datasets.Dataset``, a list of dicts); its ``__getitems__`` is used when it has one.
    """

    def __init__(self, dataset):
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")) or isinstance(dataset, (str, bytes)):
            raise TypeError(f"IndexedDataset takes a map-style dataset (with __len__ and __getitem__ returning "
                            f"samples: a datasets.Dataset, a list of dicts), got {type(dataset).__name__}")
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        return with_sample_index(self.dataset[index], index)

    def __getitems__(self, indices: list) -> list:
        """The samples of ``indices`` (what a DataLoader fetches for one batch), read in one call where
        the dataset can."""
        getitems = getattr(self.dataset, "__getitems__", None)
        rows = getitems(indices) if getitems else [self.dataset[i] for i in indices]
        return [with_sample_index(row, i) for row, i in zip(rows, indices)]


class ThdCollator:
    """Turn a list of samples into a :class:`ThdBatch`:
    ``DataLoader(dataset, batch_size=8, collate_fn=ThdCollator())``, or with
    :class:`thdpack.TokenBudgetBatchSampler` as ``batch_sampler`` (each batch is then one pack).

    ``batch.sample_index`` (int64 ``[n]``): each sample's ``"sample_index"`` field (:data:`SAMPLE_INDEX_FIELD`,
    set by :class:`IndexedDataset` / :class:`thdpack.StreamingPacker`; all or none), else ``0..n-1``;
    ``batch.source_index``: the ``"source_index"`` field, else 0. In full: docs/loaders.md, "ThdCollator".

    Args:
        **layout_keywords: the :class:`thdpack.batching.layout.BatchLayout` fields (as in
            :func:`thdpack.build_thd_batch`); with ``cp_size > 1`` and a ``cp_rank``, the CP shard.
        cp_group: the CP ranks' process group (``cp_rank`` from it when None).
        ulysses_sp_size, ulysses_rank, sp_group: Ulysses SP: that rank's ``thdpack.shard(batch, sp_size=, sp_rank=)``,
            or without an SP rank the whole batch padded to the Ulysses multiple.
        **plan_keywords: with ``pack_size``, plan each call into packs (:func:`thdpack.plan_packs` keywords,
            ``align`` the layout's multiple) and return a :class:`PackedBatches` list, one batch per pack.
        vlm: the model's family (``thdpack.vlm.get_family(model_config)``); needed by ``vision_budget``, and
            an omni thinker's by ``audio_budget`` (each pack's audio feature frames, ``vlm.audio_lengths``).
        sample_values: per-sample fields carried into ``batch.sample_values``.
        group_field: with ``pack_size``, the sample field of an integer group id: a group lands in one pack.
        share_prefix, min_prefix_len: the group-id field whose common prefix is laid out once, and the
            shortest prefix worth sharing (not with CP or Ulysses).

    Attributes:
        layout: the :class:`BatchLayout` of each batch (``cp_rank`` resolved; None with one CP rank).
        ulysses_sp_size, ulysses_rank: the Ulysses SP size and rank; ``1, None`` without Ulysses.
        options: the :class:`~thdpack.planning.options.PlanOptions` of each call, or None without planning.
    """

    def __init__(
        self,
        *,
        cp_group=None,
        ulysses_sp_size: int = 1,
        ulysses_rank: int | None = None,
        sp_group=None,
        vlm=None,
        sample_values: Sequence[str] | None = None,
        group_field: str | None = None,
        share_prefix: str | None = None,
        min_prefix_len: int = DEFAULT_MIN_PREFIX_LEN,
        **keywords,
    ):
        plan_keywords = {name: keywords.pop(name) for name in _PLAN_KEYWORDS if name in keywords}
        layout = layout_of("ThdCollator", keywords)  # validated now, rather than in a worker
        self.layout = dataclasses.replace(layout, cp_rank=_cp_rank(layout, cp_group))
        check_vlm(vlm, "ThdCollator")
        self.options = _cap_samples(_collator_options(plan_keywords, self.layout.multiple),
                                    self.layout.max_num_seqs)
        if self.options is not None:
            check_kernel_limits(self.options)
            if self.options.vision_budget is not None and vlm is None:  # its vision counts need the family
                raise ValueError("vision_budget needs vlm=, the VLM family: thdpack.vlm.get_family(model_config)")
            _check_audio_family(self.options.audio_budget, vlm)
        self.build_kwargs = dict(vlm=vlm, sample_values=sample_values)
        self.group_field = _share_fields(share_prefix, min_prefix_len, group_field, self.layout, ulysses_sp_size)
        if share_prefix is not None:
            self.build_kwargs.update(share_prefix=share_prefix, min_prefix_len=int(min_prefix_len))
        self.ulysses_sp_size, self.ulysses_rank = _ulysses_rank(self.layout, ulysses_sp_size, ulysses_rank, sp_group)
        # with Ulysses the whole batch is built, then sliced (a CP rank's shard too)
        self._build_layout = self.layout if ulysses_sp_size == 1 else dataclasses.replace(self.layout, cp_rank=None)

    @property
    def pad_multiple(self) -> int:
        """The multiple every sample is padded to (``layout.multiple``)."""
        return self.layout.multiple

    def __call__(self, samples: Sequence) -> ThdBatch | PackedBatches:
        samples = sample_list(samples, "ThdCollator")
        source = source_index(samples)
        if self.options is None:
            return self._finish(build_batch(samples, self._build_layout, sample_index=source, **self.build_kwargs))
        samples = list(samples)
        lengths = np.zeros(len(samples), dtype=np.int64)
        for i, s in enumerate(samples):
            raw = get_field(s, "input_ids", i, required=True)
            ids = to_int_array(raw, sample=i, field="input_ids")
            lengths[i] = ids.size
            if isinstance(s, dict) and not isinstance(raw, (np.ndarray, torch.Tensor)):
                samples[i] = {**s, "input_ids": ids}  # convert a list once, not again when the pack is built
        if self.layout.max_length is not None:
            lengths = np.minimum(lengths, self.layout.max_length)
        per_sample = {}
        if self.options.vision_budget is not None:
            per_sample["vision_lengths"] = self.build_kwargs["vlm"].vision_lengths(samples)
        if self.options.audio_budget is not None:
            per_sample["audio_lengths"] = self.build_kwargs["vlm"].audio_lengths(samples)
        if self.group_field is not None:
            per_sample["groups"] = [get_field(s, self.group_field, i, required=True) for i, s in enumerate(samples)]
        if "share_prefix" in self.build_kwargs:  # each group's layout, as every pack's build will find it
            flat = build_batch(samples, flat_layout(self.layout), stacklevel=3)
            share = (self.group_field, self.build_kwargs["min_prefix_len"], self.layout.multiple)
            if self.build_kwargs.get("vlm") is None:  # text: a group's trie counts its segments' slots
                per_sample["shared_prefix"] = group_shares(flat, samples, *share)
            else:  # VLM groups keep one level
                per_sample["shared_prefix"] = group_prefixes(flat, samples, *share)
        plan = plan_packs(lengths, **self.options.keywords(), **per_sample)
        batches = [self._build_pack(plan, samples, source, k) for k in range(len(plan))]
        return PackedBatches(batches, plan.stats)

    def _build_pack(self, plan, samples, source: np.ndarray | None, k: int) -> ThdBatch:
        """Pack ``k`` of ``plan`` built from ``samples`` (the call's list); ``source``: int64
        ``[n]`` their source indices, or None (then ``batch.sample_index`` holds positions in the call)."""
        index = plan.pack(k)
        pack = plan.gather(samples, k)  # its errors name input rows already
        sample_index = index if source is None else source[index]
        try:
            return self._finish(build_batch(pack, self._build_layout, sample_index=sample_index, **self.build_kwargs))
        except SampleError as exc:  # name the sample by its position in this call, not in the pack
            if exc.sample is None or not 0 <= exc.sample < len(index):
                raise
            j = exc.sample
            raise exc.renamed(int(index[j]), f" (position {j} of pack {k})") from None

    def _finish(self, batch: ThdBatch) -> ThdBatch:
        """``batch`` as the collator returns it: its Ulysses shard, or padded for Ulysses, or itself."""
        if self.ulysses_sp_size == 1:
            return batch
        sizes = dict(cp_size=self.layout.cp_size, pad_token_id=self.layout.pad_token_id)
        if self.ulysses_rank is None:
            return pad_for_ulysses(batch, self.ulysses_sp_size, **sizes)
        return _shard_for_ulysses(batch, self.ulysses_sp_size, self.ulysses_rank, cp_rank=self.layout.cp_rank or 0,
                                  **sizes)


# align: the layout's pad multiple; audio_budget: with an omni family (vlm=)
_PLAN_KEYWORDS = tuple(name for name in PLAN_FIELDS if name != "align") + AUDIO_FIELDS


def _check_audio_family(audio_budget, vlm) -> None:
    """``ValueError`` for an ``audio_budget`` without an omni family (one with ``audio_lengths``) as ``vlm``."""
    if audio_budget is None or callable(getattr(vlm, "audio_lengths", None)):
        return
    got = "no vlm=" if vlm is None else f"vlm= of model_type {getattr(vlm, 'model_type', type(vlm).__name__)!r}"
    raise ValueError(f"audio_budget needs vlm=, an omni thinker's family (thdpack.vlm.get_family(thinker_config): "
                     f"qwen2_5_omni_thinker, qwen3_omni_moe_thinker) to count each sample's audio frames; got {got}")


def _share_fields(share_prefix, min_prefix_len, group_field, layout: BatchLayout, sp_size) -> str | None:
    """The field a collator plans groups by: ``group_field``, or ``share_prefix`` (``ValueError`` for two
    different fields, for Ulysses or what :func:`check_share_args` refuses)."""
    check_share_args(share_prefix, min_prefix_len, layout)
    if share_prefix is None:
        return group_field
    if group_field not in (None, share_prefix):
        raise ValueError(f"ThdCollator(share_prefix={share_prefix!r}, group_field={group_field!r}): a shared prefix "
                         "needs its group in one pack, so plan by the same field; give group_field=None or the same")
    if sp_size != 1:
        raise ValueError(f"share_prefix={share_prefix!r} with ulysses_sp_size={sp_size}: Ulysses attention (flash / "
                         "sdpa over position_ids) cannot express a shared-prefix tree; use share_prefix=None")
    return share_prefix


def _collator_options(plan_keywords: dict, multiple: int) -> PlanOptions | None:
    """The :class:`PlanOptions` a collator plans each call with, aligned to the layout's pad
    ``multiple``; None without a ``pack_size``."""
    if plan_keywords.get("pack_size") is None:
        unused = sorted(name for name in plan_keywords if name != "pack_size")
        if unused:
            raise TypeError(f"ThdCollator() got the planning keyword(s) {unused} without pack_size; give "
                            "pack_size= to plan each call into packs, or drop them")
        return None
    return plan_options("ThdCollator", {**plan_keywords, "align": multiple})


def _cap_samples(options: PlanOptions | None, max_num_seqs: int | None) -> PlanOptions | None:
    """``options`` planning at most ``max_num_seqs`` samples per pack (static shapes: a pack of more
    could not be built), the smaller of it and ``options.max_samples_per_pack``."""
    if options is None or max_num_seqs is None:
        return options
    cap = options.max_samples_per_pack
    return dataclasses.replace(options, max_samples_per_pack=max_num_seqs if cap is None else min(cap, max_num_seqs))


def source_index(samples: Sequence) -> np.ndarray | None:
    """int64 ``[n]`` the :data:`SAMPLE_INDEX_FIELD` of every sample, or None when no sample has one.
    ``SampleError`` naming the sample when only some have it, when one is not an integer >= 0, or
    when one is a pack of :func:`~thdpack.offline.load_packed` (it has ``seq_lens``)."""
    for i, s in enumerate(samples):
        if isinstance(s, Mapping) and "seq_lens" in s:  # its samples would be collated as one
            raise SampleError.at(i, " is a pack (a row of load_packed: it has 'seq_lens'), not a sample; collate packs "
                                 "with PackedDataset.collator() or thdpack.offline.PackedRowCollator", field="seq_lens")
    values = [get_field(s, SAMPLE_INDEX_FIELD, i) for i, s in enumerate(samples)]
    given = [v is not None for v in values]
    if not any(given):
        return None
    if not all(given):
        first, missing = given.index(True), given.index(False)
        raise SampleError.at(
            missing, f" has no '{SAMPLE_INDEX_FIELD}' field, but sample {first} has one; give every sample of a "
            "call its source index (thdpack.IndexedDataset, StreamingPacker do) or none", field=SAMPLE_INDEX_FIELD,
        )
    index = np.empty(len(values), np.int64)
    for i, value in enumerate(values):
        index[i] = _checked_index(value, i)
    return index


def _checked_index(value, i: int) -> int:
    """Sample ``i``'s source index ``value`` as an int; ``SampleError`` unless it is an integer >= 0
    (a Python, numpy or one-element torch integer)."""
    try:
        number = None if isinstance(value, (bool, np.bool_)) else operator.index(value)
    except TypeError:
        number = None
    if number is None or not 0 <= number <= INT64_MAX:
        raise SampleError.at(i, f": '{SAMPLE_INDEX_FIELD}' must be an integer >= 0 (where the sample came from), "
                             f"got {value!r}", field=SAMPLE_INDEX_FIELD)
    return number


def _cp_rank(layout: BatchLayout, cp_group) -> int | None:
    """The CP rank a collator builds: ``layout.cp_rank``, else this process's rank in
    ``cp_group``; None with one CP rank (the whole batch)."""
    check_process_group(cp_group, "cp_group")
    cp_rank = layout.cp_rank
    if cp_rank is None and cp_group is not None:
        import torch.distributed as dist

        cp_rank = dist.get_rank(group=cp_group)
        if dist.get_world_size(group=cp_group) != layout.cp_size:
            raise ValueError(f"cp_group has {dist.get_world_size(group=cp_group)} ranks but cp_size={layout.cp_size}")
    return cp_rank if layout.cp_size > 1 else None


def _ulysses_rank(layout: BatchLayout, sp_size, rank, sp_group) -> tuple[int, int | None]:
    """``(sp_size, SP rank)`` a collator shards for: ``rank``, else this process's rank in
    ``sp_group``, else None (the whole batch, padded); ``ValueError`` for sizes and ranks out of range,
    a ``pad_to`` the SP ranks cannot split, or a CP layout without the CP rank an SP rank needs."""
    check_int(sp_size, "ulysses_sp_size", 1)
    check_process_group(sp_group, "sp_group")
    if rank is None and sp_group is not None:
        import torch.distributed as dist

        rank = dist.get_rank(group=sp_group)
        if dist.get_world_size(group=sp_group) != sp_size:
            raise ValueError(f"sp_group has {dist.get_world_size(group=sp_group)} ranks but ulysses_sp_size={sp_size}")
    if rank is not None:
        check_ulysses_args(sp_size, rank, names=("ulysses_sp_size", "ulysses_rank"))
    multiple = ulysses_pad_multiple(sp_size, layout.cp_size, layout.multiple)
    if layout.pad_to is not None and layout.pad_to % multiple:  # static shapes: the shards would add a tail
        raise ValueError(f"pad_to={layout.pad_to} is not a multiple of {multiple}, which ulysses_sp_size={sp_size} "
                         f"needs (with cp_size={layout.cp_size} and the pad multiple {layout.multiple})")
    if sp_size > 1 and layout.cp_size > 1 and (rank is None) != (layout.cp_rank is None):
        given, missing = ("ulysses_rank", "cp_rank= or cp_group=") if layout.cp_rank is None else (
            "cp_rank", "ulysses_rank= or sp_group=")
        raise ValueError(f"ThdCollator with ulysses_sp_size={sp_size} and cp_size={layout.cp_size} got a {given} "
                         f"but no {missing}: give both ranks (one shard) or neither (the whole batch)")
    return sp_size, rank if sp_size > 1 else None
