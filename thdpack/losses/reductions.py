"""The reductions every loss here shares (``"token"`` and ``"sample"``, normalised for a whole optimizer step),
the step's normaliser (:func:`count_items` and :func:`all_reduce_items`), and the same split by the source of
each sample in a dataset mixture (:func:`source_totals`, :func:`packed_loss_by_source`)."""

from __future__ import annotations

import math

import numpy as np
import torch

from thdpack.batching.batch import ThdBatch
from thdpack.common.align import check_int, integer_array
from thdpack.losses.target_logps import DEFAULT_CHUNK, check_batch, sample_sum, sample_target_counts, token_logps

REDUCTIONS = ("token", "sample")


def packed_loss(
    logits: torch.Tensor,
    batch,
    reduction: str = "token",
    num_items=None,
    *,
    sample_targets: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """Negative log-likelihood of a packed batch, normalised for a whole optimizer step.

    Args:
        logits, batch, chunk_size: as in :func:`token_logps`.
        reduction: ``"token"`` (sum of target NLLs / ``num_items`` target tokens) or
            ``"sample"`` (sum over samples of each sample's token-mean NLL / ``num_items``
            samples).
        num_items: the step's global normaliser (target tokens, or samples with targets,
            over all micro-batches and data-parallel ranks: :meth:`StepItems.num_items
            <thdpack.loaders.sampler.StepItems.num_items>`, or :func:`count_items` +
            :func:`all_reduce_items`); an int or a scalar tensor > 0. Default: this batch's
            own count (a plain mean over the batch).
        sample_targets: ``"sample"`` on a CP shard only: int ``[n]`` each sample's target
            tokens over all CP ranks (:func:`sample_target_counts` of the whole batch, or
            the shard's all-reduced over the CP group); each at least the sample's targets
            in ``batch`` (a smaller count, negative or 0 where the batch has targets, is a
            ``ValueError`` naming the sample).

    Returns:
        A scalar (the logits' dtype, at least float32). A batch with nothing to score gives
        0, still connected to ``logits`` (so every rank runs the same backward).
    """
    check_reduction(reduction)
    logps = token_logps(logits, batch, chunk_size=chunk_size)
    return reduce_token_losses(-logps, batch, reduction, num_items, sample_targets=sample_targets)


def reduce_token_losses(losses: torch.Tensor, batch, reduction: str = "token", num_items=None, *,
                        sample_targets: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce per-token losses ``[T]`` (0 off-target) as :func:`packed_loss` does: ``"token"`` sums
    them, ``"sample"`` sums each sample's mean over its targets; then divides by ``num_items``
    (default: this batch's targets, or samples with targets). One definition for every loss here."""
    check_reduction(reduction)
    if reduction == "token":
        total, own = losses.sum(), batch.num_targets
    else:
        counts = _sample_counts(batch, sample_targets).to(losses.device)
        scored = counts > 0
        means = sample_sum(losses, batch)[scored] / counts[scored].to(losses.dtype)
        total, own = means.sum(), int(scored.sum())
    if num_items is None:
        return total / own if own else total * 0
    return total / checked_num_items(num_items)


def source_totals(losses: torch.Tensor, batch, num_sources: int, reduction: str = "token", *,
                  sample_targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token losses ``[T]`` (0 off-target) of ``batch`` split by the source of their sample
    (``batch.source_index``, a dataset mixture's source): what :func:`reduce_token_losses` sums and counts,
    per source.

    Args:
        losses: ``[T]`` per-token losses (``-token_logps(logits, batch)``; on a shared-prefix batch ``[N]``).
        batch: the :class:`~thdpack.ThdBatch` (a CP shard: its local part; sum both results over the CP group).
        num_sources: ``S``, the mixture's number of sources (an integer >= 1, above every ``source_index``).
        reduction: ``"token"`` or ``"sample"``, as in :func:`packed_loss`.
        sample_targets: ``"sample"`` on a CP shard: as in :func:`packed_loss`.

    Returns:
        ``(totals, items)``: float ``[S]`` (differentiable) the sum of each source's target losses
        (``"token"``) or of its samples' token-means (``"sample"``), and int64 ``[S]`` its target tokens, or
        its samples with targets. Sum both over micro-batches and ranks (:func:`all_reduce_items` per entry,
        or one ``all_reduce`` of the tensors), then ``totals / items`` is each source's loss; ``totals.sum()``
        is :func:`reduce_token_losses`' numerator.
    """
    check_reduction(reduction)
    check_int(num_sources, "num_sources", 1)
    source = _source_ids(batch, int(num_sources)).to(losses.device)
    sums = sample_sum(losses, batch)
    if reduction == "token":
        counts = sample_target_counts(batch).to(losses.device)
        return (losses.new_zeros(num_sources).index_add(0, source, sums),
                torch.zeros(num_sources, dtype=torch.int64, device=losses.device).index_add(0, source, counts))
    counts = _sample_counts(batch, sample_targets).to(losses.device)
    scored = counts > 0
    means = sums[scored] / counts[scored].to(losses.dtype)
    return (losses.new_zeros(num_sources).index_add(0, source[scored], means),
            torch.bincount(source[scored], minlength=num_sources).to(torch.int64))


def packed_loss_by_source(logits: torch.Tensor, batch, num_sources: int, reduction: str = "token", num_items=None, *,
                          sample_targets: torch.Tensor | None = None, chunk_size: int = DEFAULT_CHUNK) -> torch.Tensor:
    """:func:`packed_loss` of each source's samples (``batch.source_index``): float ``[S]``.

    ``num_items``: the step's normaliser of every source, ``[S]`` (its target tokens, or samples with
    targets, over the step: :func:`source_totals`' ``items`` summed), or one number for all (the step's
    total: then the entries sum to :func:`packed_loss`); default: this batch's own items per source. A
    source without items (in the batch, or with ``num_items`` 0) gives 0, still connected to ``logits``.
    Other arguments as in :func:`packed_loss` and :func:`source_totals`."""
    totals, items = source_totals(-token_logps(logits, batch, chunk_size=chunk_size), batch, num_sources, reduction,
                                  sample_targets=sample_targets)
    if num_items is None:
        denominator = items
    elif isinstance(num_items, (list, tuple, np.ndarray)) or (isinstance(num_items, torch.Tensor) and num_items.dim()):
        denominator = torch.as_tensor(np.asarray(num_items) if isinstance(num_items, (list, tuple)) else num_items,
                                      device=totals.device)
        if denominator.shape != (num_sources,) or denominator.is_complex() or denominator.dtype == torch.bool or bool(
                (denominator < 0).any()) or not bool(torch.isfinite(denominator.to(torch.float64)).all()):
            raise ValueError(f"num_items must be one number > 0 or {num_sources} finite numbers >= 0 (one per source), "
                             f"got {num_items!r}")
    else:
        denominator = torch.full((num_sources,), float(checked_num_items(num_items)), device=totals.device)
    denominator = denominator.to(totals.dtype)
    return torch.where(denominator > 0, totals / denominator.clamp(min=1e-30), totals * 0)


def _source_ids(batch, num_sources: int) -> torch.Tensor:
    """int64 ``[n]`` every sample's source; ``ValueError`` naming the sample whose source is ``num_sources`` or more."""
    check_batch(batch)
    source = batch.source_index.to(torch.int64)
    over = torch.nonzero(source >= num_sources)
    if over.numel():
        i = int(over[0, 0])
        raise ValueError(f"sample {i} of the batch (sample_index {int(batch.sample_index[i])}) has source_index "
                         f"{int(source[i])}, but num_sources={num_sources}; pass the mixture's number of sources")
    return source


def check_reduction(reduction) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def _sample_counts(batch, sample_targets) -> torch.Tensor:
    if sample_targets is None:
        if batch.is_shard and batch.shard.cp_size > 1:
            raise ValueError(
                "packed_loss(reduction='sample') on a CP shard needs sample_targets=: each sample's target count "
                "over all CP ranks (sample_target_counts(batch) of the whole batch, or the shard's all-reduced)"
            )
        return sample_target_counts(batch)
    counts = torch.as_tensor(integer_array(sample_targets, "sample_targets", " (one per sample of the pack)"))
    if counts.shape != (batch.num_samples,):
        raise ValueError(
            f"sample_targets must be integers of shape [{batch.num_samples}] (one per sample of the pack), "
            f"got shape {tuple(counts.shape)}"
        )
    here = sample_target_counts(batch).to(counts.device)
    short = torch.nonzero(counts < here)
    if short.numel():
        i = int(short[0, 0])
        raise ValueError(
            f"sample_targets[{i}] is {int(counts[i])}, but sample {i} has {int(here[i])} target tokens in this batch; "
            "pass each sample's target count over all CP ranks (sample_target_counts of the whole batch, or the "
            "shard's all-reduced over the CP group)"
        )
    return counts


def checked_num_items(num_items):
    value = num_items.detach() if isinstance(num_items, torch.Tensor) else num_items
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)) or (
        isinstance(value, torch.Tensor) and value.numel() != 1
    ):
        raise ValueError(f"num_items must be a number or a scalar tensor > 0, got {num_items!r}")
    if not float(value) > 0:
        raise ValueError(
            f"num_items must be > 0 (the step's global count of target tokens or samples), got {float(value)}; "
            "a step with nothing to score has no loss: skip it"
        )
    if not math.isfinite(float(value)):
        raise ValueError(f"num_items must be finite (the step's global count of target tokens or samples), "
                         f"got {float(value)}")
    return num_items


def count_items(batches, reduction: str = "token") -> int:
    """The ``num_items`` of ``reduction`` over ``batches`` (one rank's micro-batches of a step,
    whole batches, not CP shards): target tokens, or samples with at least one target."""
    check_reduction(reduction)
    if isinstance(batches, ThdBatch):
        raise TypeError("count_items takes a list of batches (one rank's micro-batches of a step), got one ThdBatch: "
                        "pass [batch]")
    batches = list(batches)
    for k, b in enumerate(batches):
        check_batch(b, f"batches[{k}]")
    if reduction == "token":
        return sum(b.num_targets for b in batches)
    return sum(int((sample_target_counts(b) > 0).sum()) for b in batches)


def all_reduce_items(count, group=None) -> int:
    """``count`` summed over the ranks of ``group`` (``torch.distributed``, default the world);
    ``count`` itself when torch.distributed is not initialised. Call it on every rank."""
    import torch.distributed as dist

    if not isinstance(count, torch.Tensor):
        check_int(count, "count", 0)
    if not (dist.is_available() and dist.is_initialized()):
        return int(count)
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    if device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.tensor(int(count), dtype=torch.int64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return int(total)
