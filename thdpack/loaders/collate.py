"""``collate_fn`` for a PyTorch DataLoader: a list of samples in, THD batches out."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from thdpack.batching.batch import ThdBatch
from thdpack.batching.builder import build_batch
from thdpack.common.extensions import vision as vision_extension
from thdpack.batching.layout import BatchLayout, layout_from
from thdpack.planning.plan import PackStats, plan_packs
from thdpack.common.samples import SampleError, get_field, to_int_array


class PackedBatches(list):
    """A list of :class:`ThdBatch` (one per pack) with the plan's ``stats``
    (what was truncated, split or dropped to make the packs fit)."""

    def __init__(self, batches, stats: PackStats):
        super().__init__(batches)
        self.stats = stats


class ThdCollator:
    """Turn a list of samples into a :class:`ThdBatch`.

    Use as ``DataLoader(dataset, batch_size=8, collate_fn=ThdCollator())`` or with
    :class:`thdpack.TokenBudgetBatchSampler` as ``batch_sampler`` (then each batch
    is already one pack).

    Args:
        layout, **layout_keywords: a :class:`thdpack.batching.layout.BatchLayout`, or its fields
            as keywords (``pad_token_id``, ``ignore_index``, ``cp_size``, ``tp_size``,
            ``sequence_parallel``, ``pad_multiple``, ``max_length``, ``pad_to``,
            ``cp_rank``), as in :func:`thdpack.build_thd_batch`; with ``cp_size > 1``
            and a ``cp_rank``, each call returns this rank's CP shard
            (:func:`thdpack.shard_for_cp`) instead of the whole batch.
        cp_group: a ``torch.distributed`` process group of the CP ranks; when given
            and ``cp_rank`` is None, the rank is this process's rank in it.
            Without either, the whole (CP-padded) batch is returned.
        pack_size: if given, the samples of a call are planned into packs of at
            most ``pack_size`` tokens (after alignment) and the call returns a
            :class:`PackedBatches` list, one batch per pack.
        algorithm, overflow, max_samples_per_pack: planning options used with
            ``pack_size`` (see :func:`thdpack.plan_packs`).
        model_config: for VLM samples, the model's transformers config (or dict):
            see :func:`thdpack.build_thd_batch`.
        vision_budget: with ``pack_size``, also keep each pack under this many
            vision patches (``plan_packs(vision_budget=...)``).
        sample_values: per-sample fields carried into ``batch.sample_values`` (see
            :func:`thdpack.build_thd_batch`).
        group_field: with ``pack_size``, the sample field holding an integer group id: a
            group's samples land in one pack (``plan_packs(groups=...)``, e.g. DPO pairs).

    Attributes:
        layout: the :class:`BatchLayout` each batch is built with (``cp_rank`` resolved
            from ``cp_group``; None with one CP rank: the whole batch is returned).
    """

    def __init__(
        self,
        *,
        layout: BatchLayout | None = None,
        cp_group=None,
        pack_size: int | None = None,
        algorithm: str = "bfd",
        overflow: str = "error",
        max_samples_per_pack: int | None = None,
        model_config=None,
        vision_budget: int | None = None,
        sample_values: Sequence[str] | None = None,
        group_field: str | None = None,
        **layout_keywords,
    ):
        layout = layout_from("ThdCollator", layout, layout_keywords)  # validated now, rather than in a worker
        self.layout = dataclasses.replace(layout, cp_rank=_cp_rank(layout, cp_group))
        self.build_kwargs = dict(model_config=model_config, sample_values=sample_values)
        self.vision_budget = vision_budget
        self.group_field = group_field
        self.pack_size = pack_size
        self.plan_kwargs = dict(algorithm=algorithm, overflow=overflow, max_samples_per_pack=max_samples_per_pack)
        if pack_size is not None:  # validate planning options now rather than in a worker
            plan_packs([1], pack_size, align=self.pad_multiple, **self.plan_kwargs)

    @property
    def pad_multiple(self) -> int:
        """The multiple every sample is padded to (``layout.multiple``)."""
        return self.layout.multiple

    def __call__(self, samples: Sequence) -> ThdBatch | PackedBatches:
        if self.pack_size is None:
            return build_batch(samples, self.layout, **self.build_kwargs)
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
        vision = {}
        if self.vision_budget is not None:
            vision = dict(vision_lengths=vision_extension().lengths(samples), vision_budget=self.vision_budget)
        if self.group_field is not None:
            vision["groups"] = [get_field(s, self.group_field, i, required=True) for i, s in enumerate(samples)]
        plan = plan_packs(lengths, self.pack_size, align=self.pad_multiple, **self.plan_kwargs, **vision)
        batches = [self._build_pack(plan, samples, k) for k in range(len(plan))]
        return PackedBatches(batches, plan.stats)

    def _build_pack(self, plan, samples, k: int) -> ThdBatch:
        index = plan.pack(k)
        pack = plan.gather(samples, k)  # its errors name input rows already
        try:
            return build_batch(pack, self.layout, sample_index=index, **self.build_kwargs)
        except SampleError as exc:  # name the sample by its position in this call, not in the pack
            if exc.sample is None or not 0 <= exc.sample < len(index):
                raise
            j = exc.sample
            raise exc.renamed(int(index[j]), f" (position {j} of pack {k})") from None


def _cp_rank(layout: BatchLayout, cp_group) -> int | None:
    """The CP rank a collator builds: ``layout.cp_rank``, else this process's rank in
    ``cp_group``; None with one CP rank (the whole batch)."""
    cp_rank = layout.cp_rank
    if cp_rank is None and cp_group is not None:
        import torch.distributed as dist

        cp_rank = dist.get_rank(group=cp_group)
        if dist.get_world_size(group=cp_group) != layout.cp_size:
            raise ValueError(f"cp_group has {dist.get_world_size(group=cp_group)} ranks but cp_size={layout.cp_size}")
    return cp_rank if layout.cp_size > 1 else None
