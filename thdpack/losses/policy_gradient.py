"""RL groups (GRPO-style): group-normalised advantages and the clipped policy-gradient loss on a pack."""

from __future__ import annotations

import numpy as np
import torch

from thdpack.common.align import check_bool, check_number, host_array, integer_array
from thdpack.losses.reductions import reduce_token_losses
from thdpack.losses.target_logps import DEFAULT_CHUNK, token_logps


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
    scale = check_bool(scale, "scale")
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
