"""Losses on a packed :class:`~thdpack.ThdBatch` that mean what they mean unpacked.

Everything here works on the packed stream's own target labels (``batch.labels[t]`` is
the token position t predicts), so no shift is applied and no target crosses a sample
boundary. torch only.

Reductions (``docs/losses.md``):

* ``"token"``: the sum of every target token's loss over a whole optimizer step (all
  micro-batches of all data-parallel ranks) divided by the step's number of target
  tokens (HF Trainer's ``num_items_in_batch``).
* ``"sample"``: the mean over the step's samples of each sample's token-mean.

Pass the step's global count as ``num_items`` (from
:meth:`thdpack.TokenBudgetBatchSampler.step_items`, or :func:`count_items` summed with
:func:`all_reduce_items`): summing the gradients of the micro-batches and ranks then gives
exactly the gradient of one big unpacked batch. (DDP *averages* gradients over ranks:
multiply the loss by the data-parallel world size there, as HF's Trainer does.)

Built on the same reductions: :func:`dpo_loss` for preference pairs packed together
(:func:`pair_groups`), :func:`policy_gradient_loss` with :func:`group_advantages` for RL groups.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from thdpack.batching.batch import ThdBatch
from thdpack.common.align import check_int, check_number, host_array, integer_array
from thdpack.common.values import sample_ids

REDUCTIONS = ("token", "sample")
DEFAULT_CHUNK = 1024  # rows of [T, V] logits upcast and exponentiated at a time


# --------------------------------------------------------------------------- per token / per sample


def token_logps(logits: torch.Tensor, batch, *, chunk_size: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Log-probability of every target token of the packed stream.

    Computed ``chunk_size`` rows at a time, forward and backward, in ``[chunk, V]`` float
    buffers reused by every chunk (one; two for bf16/fp16 logits, the upcast and the
    ``log_softmax``): never a ``[T, V]`` float32 copy of the logits. Autograd keeps the logits
    themselves and a ``[T]`` log-normaliser, not a ``[T, V]`` log_softmax. The gradient of
    the logits is ``[T, V]`` in their dtype, as always. ``benchmarks/losses.py`` measures it.

    Args:
        logits: ``[T, V]`` or ``[1, T, V]`` the model's logits on ``batch`` (any float
            dtype), ``T = batch.num_padded_tokens`` (a CP shard's local tokens).
        batch: the :class:`~thdpack.ThdBatch` (or CP shard) the logits are for.
        chunk_size: rows per chunk.

    Returns:
        ``[T]`` float (the logits' dtype, at least float32): ``log p(labels[t])`` at target
        positions, 0 elsewhere. Differentiable (once). On a shared-prefix batch (``batch.prefix_tree``)
        ``[N]``: one log-prob per entry of its target table, the unshared batch's targets in order
        (``token_logps(unshared)[unshared.loss_mask]``), as a prefix row scores several samples' tokens.
    """
    logits = _stream_logits(logits, batch)
    check_int(chunk_size, "chunk_size", 1)
    chunk_size = int(chunk_size)
    tree = getattr(batch, "prefix_tree", None)
    if tree is not None:
        rows, labels = tree.target_rows.to(logits.device), tree.target_labels.to(logits.device)
        _check_label_range(labels, torch.ones_like(labels, dtype=torch.bool), logits.shape[1])
        return _ChunkedRowLogps.apply(logits, rows, labels, chunk_size)
    mask = batch.loss_mask.to(logits.device)
    labels = torch.where(mask, batch.labels.to(logits.device), 0)
    _check_label_range(labels, mask, logits.shape[1])
    return _ChunkedTargetLogps.apply(logits, labels, mask, chunk_size)


class _ChunkedTargetLogps(torch.autograd.Function):
    """``[T, V]`` logits, int64 ``[T]`` labels, bool ``[T]`` mask -> ``[T]`` masked target
    log-probs, chunk by chunk in both directions."""

    @staticmethod
    def forward(ctx, logits, labels, mask, chunk_size):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        out = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        lse = torch.empty_like(out)  # log-normaliser of every row, for the backward
        buf = _chunk_buffer(logits, chunk_size, dtype)
        upcast = None if logits.dtype == dtype else _chunk_buffer(logits, chunk_size, dtype)
        for a in range(0, logits.shape[0], chunk_size):
            rows, lab = logits[a : a + chunk_size], labels[a : a + chunk_size, None]
            n = rows.shape[0]
            x = rows if upcast is None else upcast[:n].copy_(rows)  # bf16/fp16: upcast into a reused chunk
            logp = torch.log_softmax(x, -1, out=buf[:n]).gather(1, lab).squeeze(1)
            lse[a : a + chunk_size] = rows.gather(1, lab).squeeze(1).to(dtype) - logp
            out[a : a + chunk_size] = logp
        out.masked_fill_(~mask, 0)
        ctx.save_for_backward(logits, labels, mask, lse)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, labels, mask, lse = ctx.saved_tensors
        g = torch.where(mask, grad_out, 0).to(lse.dtype)
        grad = torch.empty_like(logits)
        buf = _chunk_buffer(logits, ctx.chunk_size, lse.dtype)
        for a in range(0, logits.shape[0], ctx.chunk_size):
            b = a + ctx.chunk_size
            rows = logits[a:b]
            chunk = torch.sub(rows, lse[a:b, None], out=buf[: rows.shape[0]])
            chunk.exp_().mul_(-g[a:b, None])  # d logp / d logits = onehot - softmax
            chunk.scatter_add_(1, labels[a:b, None], g[a:b, None])
            grad[a:b] = chunk
        return grad, None, None, None


class _ChunkedRowLogps(torch.autograd.Function):
    """``[T, V]`` logits, int64 ``[N]`` rows and labels (a row may appear several times, with different
    labels) -> ``[N]`` log-probs ``logits[row, label] − logsumexp(logits[row])``, the log-normalisers
    computed chunk by chunk once per row; the backward adds every entry's one-hot and softmax terms to
    its row, chunk by chunk (a row's softmax weighted by the sum of its entries' gradients)."""

    @staticmethod
    def forward(ctx, logits, rows, labels, chunk_size):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        lse = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        upcast = None if logits.dtype == dtype else _chunk_buffer(logits, chunk_size, dtype)
        for a in range(0, logits.shape[0], chunk_size):
            chunk = logits[a : a + chunk_size]
            x = chunk if upcast is None else upcast[: chunk.shape[0]].copy_(chunk)
            lse[a : a + chunk_size] = torch.logsumexp(x, -1)
        ctx.save_for_backward(logits, rows, labels, lse)
        ctx.chunk_size = chunk_size
        return logits[rows, labels].to(dtype) - lse[rows]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, rows, labels, lse = ctx.saved_tensors
        g = grad_out.to(lse.dtype)
        row_grad = torch.zeros_like(lse).index_add_(0, rows, g)  # Σ of the gradients of each row's entries
        grad = torch.empty_like(logits)
        buf = _chunk_buffer(logits, ctx.chunk_size, lse.dtype)
        for a in range(0, logits.shape[0], ctx.chunk_size):
            b = a + ctx.chunk_size
            chunk = torch.sub(logits[a:b], lse[a:b, None], out=buf[: logits[a:b].shape[0]])
            chunk.exp_().mul_(-row_grad[a:b, None])  # d logp / d logits = onehot - softmax
            here = (rows >= a) & (rows < b)
            chunk.index_put_((rows[here] - a, labels[here]), g[here], accumulate=True)
            grad[a:b] = chunk
        return grad, None, None, None


def _chunk_buffer(logits: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """One ``[min(chunk, T), V]`` buffer reused by every chunk: a fresh one per chunk costs its
    page faults each time (large CPU allocations go back to the OS when freed)."""
    return torch.empty(min(chunk_size, logits.shape[0]), logits.shape[1], dtype=dtype, device=logits.device)


def sample_sum(values: torch.Tensor, batch) -> torch.Tensor:
    """``[n]`` sum of the per-token ``values`` ``[T]`` over each sample's slots (on a shared-prefix batch:
    of the per-target ``values`` ``[N]`` over each sample's entries of the target table)."""
    tree = getattr(batch, "prefix_tree", None)
    ids = (sample_ids(batch) if tree is None else tree.target_samples).to(values.device)
    return values.new_zeros(batch.num_samples).index_add(0, ids, values)


def sample_target_counts(batch) -> torch.Tensor:
    """int64 ``[n]`` target tokens of each sample (on a CP shard: this rank's part; sum over
    the CP group for the sample's total; on a shared-prefix batch: its entries of the target table)."""
    tree = getattr(batch, "prefix_tree", None)
    if tree is not None:
        return torch.bincount(tree.target_samples, minlength=batch.num_samples)
    ids = sample_ids(batch).to(batch.loss_mask.device)
    return torch.bincount(ids[batch.loss_mask], minlength=batch.num_samples)


def sequence_logps(logits: torch.Tensor, batch, *, chunk_size: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of target log-probabilities per sample.

    Args:
        logits, batch, chunk_size: as in :func:`token_logps`.

    Returns:
        ``(logps, counts)``: float ``[n]`` (differentiable) and int64 ``[n]`` target tokens
        per sample. On a CP shard both are this rank's part: all-reduce (sum) them over
        the CP group to get the whole samples'.
    """
    return sample_sum(token_logps(logits, batch, chunk_size=chunk_size), batch), sample_target_counts(batch)


# --------------------------------------------------------------------------- reductions


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
    _check_reduction(reduction)
    logps = token_logps(logits, batch, chunk_size=chunk_size)
    return reduce_token_losses(-logps, batch, reduction, num_items, sample_targets=sample_targets)


def reduce_token_losses(losses: torch.Tensor, batch, reduction: str = "token", num_items=None, *,
                        sample_targets: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce per-token losses ``[T]`` (0 off-target) as :func:`packed_loss` does: ``"token"`` sums
    them, ``"sample"`` sums each sample's mean over its targets; then divides by ``num_items``
    (default: this batch's targets, or samples with targets). One definition for every loss here."""
    _check_reduction(reduction)
    if reduction == "token":
        total, own = losses.sum(), batch.num_targets
    else:
        counts = _sample_counts(batch, sample_targets).to(losses.device)
        scored = counts > 0
        means = sample_sum(losses, batch)[scored] / counts[scored].to(losses.dtype)
        total, own = means.sum(), int(scored.sum())
    if num_items is None:
        return total / own if own else total * 0
    return total / _checked_num_items(num_items)


# --------------------------------------------------------------------------- RL groups (GRPO-style)


def group_advantages(rewards, groups, *, eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """GRPO's group-normalised advantages: ``A_i = (r_i − mean_g(r)) / (std_g(r) + eps)``, the
    mean and (unbiased, ``N − 1``) standard deviation over the samples of ``i``'s group ``g``
    (a group of one sample has std 0, so ``A = 0``); ``scale=False`` leaves ``r_i − mean_g``.
    Computed on each group's rewards divided by their largest magnitude, so rewards of any finite
    size give the same advantages as small ones; a NaN or infinite reward is a ``ValueError``
    naming the sample.

    Args:
        rewards: float ``[n]`` one reward per sample (dataset row): numbers (a list, numpy array or
            tensor; strings and bools are a ``ValueError``).
        groups: int ``[n]`` group id per sample (the completions of one prompt).
        eps: added to the spread, a finite number >= 0 (a group whose rewards are all equal has
            advantages 0, also with ``eps=0``).

    Returns:
        float64 ``[n]`` advantages: carry them as a per-sample value (``sample_values=``) and
        broadcast with ``batch.token_values``.
    """
    check_number(eps, "eps", positive=False, what=" (added to each group's standard deviation)")
    r = torch.as_tensor(_numbers(rewards, "rewards"), dtype=torch.float64).reshape(-1)
    g = torch.as_tensor(integer_array(groups, "groups")).reshape(-1)
    if g.shape != r.shape or g.is_floating_point():
        raise ValueError(f"groups must be integers with one id per reward ({r.numel()}), got shape {tuple(g.shape)} "
                         f"and dtype {g.dtype}")
    bad = torch.nonzero(~torch.isfinite(r))
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"rewards must be finite: sample {i} has reward {float(r[i])} (drop or replace such rollouts "
                         "before computing advantages)")
    _, gid = torch.unique(g, return_inverse=True)
    size = torch.bincount(gid).to(torch.float64)
    # the mean and the spread are computed on rewards divided by the group's largest |reward|: the same
    # value, without r² or the sum overflowing (rewards of 1e200 still give ±1/√2 for a pair)
    top = torch.zeros_like(size).scatter_reduce_(0, gid, r.abs(), "amax")
    top = torch.where(top > 0, top, torch.ones_like(top))
    unit = r / top[gid]
    mean = torch.zeros_like(size).index_add_(0, gid, unit) / size
    centred = unit - mean[gid]
    if not scale:
        return centred * top[gid]
    var = torch.zeros_like(size).index_add_(0, gid, centred * centred) / (size - 1).clamp_min(1)
    spread = var.sqrt()[gid] + eps / top[gid]
    return torch.where(spread > 0, centred / spread, 0.0)  # no spread (eps 0): centred is 0, not 0/0


def _numbers(values, name: str):
    """``values`` (a list, numpy array or tensor of real numbers) as a numpy array or tensor; ``ValueError``
    naming ``name`` for strings, bools, None or objects."""
    if isinstance(values, torch.Tensor):
        if values.dtype == torch.bool or values.is_complex():
            raise ValueError(f"{name} must be real numbers, got a {values.dtype} tensor")
        return values
    arr = host_array(values, name, "numbers (a list, numpy array or tensor)", "a flat sequence of numbers")
    if arr.size and arr.dtype.kind not in "iuf":
        first = next((v for v in arr.reshape(-1).tolist() if isinstance(v, bool) or not isinstance(v, (int, float))),
                     arr.reshape(-1)[0])
        raise ValueError(f"{name} must be real numbers, got {first!r} (dtype {arr.dtype})")
    return arr.astype(np.float64)


def policy_gradient_loss(logits: torch.Tensor, batch, advantages: torch.Tensor, reduction: str = "token",
                         num_items=None, *, old_logps: torch.Tensor | None = None, clip: float = 0.2,
                         sample_targets: torch.Tensor | None = None, chunk_size: int = DEFAULT_CHUNK) -> torch.Tensor:
    """The clipped policy-gradient (PPO / GRPO) loss with per-token advantages, in the reductions
    of :func:`packed_loss`: per target token ``−min(ρ·A, clip(ρ, 1−clip, 1+clip)·A)`` with
    ``ρ = exp(logp − old_logp)``; ``old_logps=None`` is the on-policy case (``ρ = 1``, gradient
    ``−A·∇logp``).

    Args:
        logits, batch, reduction, num_items, sample_targets, chunk_size: as in :func:`packed_loss`.
        advantages: float ``[T]`` per token (e.g. ``batch.token_values("advantage")``); on a shared-prefix
            batch ``[N]`` per target (``batch.token_values("advantage")`` gives that too).
        old_logps: float ``[T]`` (``[N]``) :func:`token_logps` of the policy that sampled the data, or None.
        clip: PPO's ε, a finite number >= 0.
    """
    check_number(clip, "clip", positive=False, what=" (PPO's ε, e.g. 0.2)")
    logps = token_logps(logits, batch, chunk_size=chunk_size)
    for name, value in (("advantages", advantages), ("old_logps", old_logps)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a float tensor [T] (batch.token_values(name) of a per-sample value), "
                            f"got {type(value).__name__}")
    if old_logps is not None and old_logps.shape != logps.shape:
        raise ValueError(f"old_logps have shape {tuple(old_logps.shape)}; expected [T] = [{logps.shape[0]}] "
                         "(token_logps of the sampling policy on this batch)")
    if advantages.shape != logps.shape:
        raise ValueError(f"advantages have shape {tuple(advantages.shape)}; expected [T] = [{logps.shape[0]}] "
                         "(batch.token_values(name) of a per-sample advantage)")
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    adv = advantages.to(logps.dtype)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    if getattr(batch, "prefix_tree", None) is None:  # a shared-prefix batch's entries are all targets
        per_token = torch.where(batch.loss_mask.to(per_token.device), per_token, 0)
    return reduce_token_losses(per_token, batch, reduction, num_items, sample_targets=sample_targets)


def _check_reduction(reduction) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def _sample_counts(batch, sample_targets) -> torch.Tensor:
    if sample_targets is None:
        if batch.is_shard and batch.cp_size > 1:
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


def _checked_num_items(num_items):
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


def _check_logps(name: str, value, batch) -> None:
    """``value`` is a float tensor ``[n]``, one per sample of ``batch``; ``TypeError`` / ``ValueError``
    naming ``name`` otherwise."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a float tensor [n] (sequence_logps of this batch), got {type(value).__name__}")
    if value.shape != (batch.num_samples,):
        raise ValueError(f"{name} has shape {tuple(value.shape)}; expected [{batch.num_samples}] (sequence_logps "
                         "of this batch: one sum per sample)")
    if not value.is_floating_point():
        raise ValueError(f"{name} has dtype {value.dtype}; expected a float tensor (sequence_logps of this batch)")


def _checked_beta(beta) -> float:
    """DPO's temperature: a positive finite number (a Python or numpy float or int, not a bool or a string)."""
    check_number(beta, "beta", positive=True, what=" (the DPO temperature, e.g. 0.1)")
    return float(beta)


# --------------------------------------------------------------------------- preference pairs (DPO)


def pair_groups(num_rows: int):
    """int64 ``[num_rows]`` group ids of a preference dataset laid out as :func:`dpo_loss` reads
    it (row ``2k`` the chosen, row ``2k+1`` the rejected sequence of pair ``k``): pass them as
    ``plan_packs(..., groups=...)`` / ``TokenBudgetBatchSampler(groups=...)`` so that both
    sequences of a pair share a pack."""
    check_int(num_rows, "num_rows", 0)
    if num_rows % 2:
        raise ValueError(f"num_rows must be even (a chosen and a rejected row per pair), got {num_rows}")
    return np.arange(num_rows, dtype=np.int64) // 2


def dpo_loss(policy_logps: torch.Tensor, reference_logps: torch.Tensor, batch, beta: float = 0.1,
             num_items=None) -> torch.Tensor:
    """The DPO loss (sigmoid) of the preference pairs in ``batch``.

    Rows are laid out as :func:`pair_groups` says: dataset row ``2k`` is the chosen and row
    ``2k+1`` the rejected sequence (prompt + response, prompt tokens not targets) of pair ``k``;
    ``batch.sample_index`` tells which rows the pack holds (dataset rows, or, from
    ``ThdCollator`` fed by a sampler with pair groups, positions in the pack: whole pairs in
    input order keep chosen at even, rejected at odd positions). Per pair,
    ``-log σ(β · ((π_c − ref_c) − (π_r − ref_r)))`` with ``π``, ``ref`` the summed target
    log-probs of a sequence.

    Args:
        policy_logps, reference_logps: float ``[n]`` per-sample sums of target log-probs, from
            :func:`sequence_logps` of the policy and the reference model (on a CP shard,
            all-reduced over the CP group first: whole sequences' sums).
        batch: the pack (or a CP shard of it); both rows of every pair must be in it
            (plan with ``groups=pair_groups(len(rows))``).
        beta: the DPO temperature.
        num_items: pairs in the whole optimizer step (all micro-batches and ranks), for the
            step's mean; default: this pack's pairs.

    Returns:
        A scalar: the sum of the pack's pair losses / ``num_items``.
    """
    beta = _checked_beta(beta)
    check_batch(batch)
    chosen, rejected = _pair_positions(batch)
    _check_logps("policy_logps", policy_logps, batch)
    _check_logps("reference_logps", reference_logps, batch)
    margin = (policy_logps[chosen] - reference_logps[chosen]) - (policy_logps[rejected] - reference_logps[rejected])
    losses = -torch.nn.functional.logsigmoid(beta * margin)
    return losses.sum() / (len(chosen) if num_items is None else _checked_num_items(num_items))


def _pair_positions(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[p]`` positions in the pack of each pair's chosen and rejected rows, pairs by row."""
    rows = batch.sample_index.to(torch.int64).cpu()
    order = torch.argsort(rows)
    ordered = rows[order]
    partner = ordered ^ 1
    present = torch.isin(partner, ordered)
    if not bool(present.all()) or len(set(rows.tolist())) != rows.numel():
        i = int((~present).nonzero()[0, 0]) if not bool(present.all()) else 0
        row = int(ordered[i])
        raise ValueError(
            f"row {row} ({'chosen' if row % 2 == 0 else 'rejected'} of pair {row // 2}) is in the pack without its "
            f"partner row {row ^ 1} (or twice); plan with groups=thdpack.losses.pair_groups(len(rows)) so that both "
            "sequences of a pair share a pack"
        )
    return order[0::2], order[1::2]


# --------------------------------------------------------------------------- normalisers


def count_items(batches, reduction: str = "token") -> int:
    """The ``num_items`` of ``reduction`` over ``batches`` (one rank's micro-batches of a step,
    whole batches, not CP shards): target tokens, or samples with at least one target."""
    _check_reduction(reduction)
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


# --------------------------------------------------------------------------- checks


def check_batch(batch, name: str = "batch") -> None:
    """``TypeError`` unless ``batch`` is a :class:`~thdpack.ThdBatch` (or a CP shard of one)."""
    if not isinstance(batch, ThdBatch):
        raise TypeError(f"{name} must be a thdpack.ThdBatch (build_thd_batch, ThdCollator), got {type(batch).__name__}")


def _stream_logits(logits: torch.Tensor, batch) -> torch.Tensor:
    """``logits`` as ``[T, V]``; ``TypeError`` / ``ValueError`` unless they are a tensor with data that fits
    ``batch``."""
    check_batch(batch)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a float tensor [T, V] or [1, T, V] (the model's output), got "
                        f"{type(logits).__name__}")
    if logits.is_meta:
        raise ValueError("logits are on the meta device (no data); pass the model's logits computed on a real device")
    T = batch.num_padded_tokens
    if logits.dim() == 3 and logits.shape[0] == 1:
        logits = logits[0]
    if logits.dim() != 2 or logits.shape[0] != T or not logits.is_floating_point():
        raise ValueError(
            f"logits have shape {tuple(logits.shape)} and dtype {logits.dtype}; expected float [T, V] or [1, T, V] "
            f"with T = batch.num_padded_tokens = {T}: pass the model's logits for this batch (shard)"
        )
    return logits


def _check_label_range(labels: torch.Tensor, mask: torch.Tensor, vocab: int) -> None:
    bad = mask & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"target label {int(labels[t])} at stream position {t} is outside the logits' vocabulary [0, {vocab}); "
            "the batch and the model disagree on the vocabulary size"
        )
