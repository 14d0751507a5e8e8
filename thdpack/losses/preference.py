"""Preference pairs (DPO) packed together: the pair groups to plan with and the DPO loss."""

from __future__ import annotations

import numpy as np
import torch

from thdpack.common.align import check_int, check_number
from thdpack.losses.reductions import checked_num_items
from thdpack.losses.target_logps import check_batch


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
    return losses.sum() / (len(chosen) if num_items is None else checked_num_items(num_items))


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
