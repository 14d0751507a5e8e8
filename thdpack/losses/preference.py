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
             num_items=None, *, source: int | None = None) -> torch.Tensor:
    """The DPO loss (sigmoid) of the preference pairs in ``batch``.

    Rows are laid out as :func:`pair_groups` says: dataset row ``2k`` is the chosen and row
    ``2k+1`` the rejected sequence (prompt + response, prompt tokens not targets) of pair ``k``;
    ``batch.sample_index`` tells which rows the pack holds (dataset rows, or, from
    ``ThdCollator`` fed by a sampler with pair groups, positions in the pack: whole pairs in
    input order keep chosen at even, rejected at odd positions). Per pair,
    ``-log σ(β · ((π_c − ref_c) − (π_r − ref_r)))`` with ``π``, ``ref`` the summed target
    log-probs of a sequence. A pair in the pack more than once (a mixture's repeated pair) counts once per
    copy: the n-th chosen row ``2k`` in stream order is paired with the n-th rejected row ``2k+1``.

    Args:
        policy_logps, reference_logps: float ``[n]`` per-sample sums of target log-probs, from
            :func:`sequence_logps` of the policy and the reference model (on a CP shard,
            all-reduced over the CP group first: whole sequences' sums).
        batch: the pack (or a CP shard of it); both rows of every pair must be in it
            (plan with ``groups=pair_groups(len(rows))``).
        beta: the DPO temperature.
        num_items: pairs in the whole optimizer step (all micro-batches and ranks), for the
            step's mean; default: this pack's pairs.
        source: the preference source of a mixture's pack (``batch.source_index``): only its samples are
            pairs, the other sources' samples are left out (train them with another loss, e.g.
            :func:`packed_loss_by_source`); None: every sample of the pack is a pair's.

    Returns:
        A scalar: the sum of the pack's pair losses / ``num_items``. With ``source`` and no pair of it in
        the pack, 0 (still connected to ``policy_logps``).
    """
    beta = _checked_beta(beta)
    check_batch(batch)
    _check_logps("policy_logps", policy_logps, batch)
    _check_logps("reference_logps", reference_logps, batch)
    chosen, rejected = _pair_positions(batch, source)
    margin = (policy_logps[chosen] - reference_logps[chosen]) - (policy_logps[rejected] - reference_logps[rejected])
    losses = -torch.nn.functional.logsigmoid(beta * margin)
    if num_items is None and not len(chosen):
        return policy_logps.sum() * 0.0
    return losses.sum() / (len(chosen) if num_items is None else checked_num_items(num_items))


def _pair_positions(batch, source: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[p]`` positions in the pack of each pair's chosen and rejected rows (of ``source``'s samples
    only, when given), pairs by row, a repeated pair's copies in stream order."""
    rows = batch.sample_index.to(torch.int64).cpu().numpy()
    positions = np.arange(rows.size)
    if source is not None:
        check_int(source, "source", 0)
        sources = (np.zeros(rows.size, np.int64) if batch.source_index is None
                   else batch.source_index.to(torch.int64).cpu().numpy())
        positions = np.flatnonzero(sources == source)
        rows = rows[positions]
    order = np.argsort(rows, kind="stable")  # by row; a row's copies in stream order
    ordered, positions = rows[order], positions[order]
    starts = np.r_[0, np.flatnonzero(np.diff(ordered)) + 1] if ordered.size else np.zeros(0, np.int64)
    copy = np.arange(ordered.size) - np.repeat(starts, np.diff(np.r_[starts, ordered.size]))
    is_chosen = ordered % 2 == 0
    chosen_key = np.stack([ordered[is_chosen] // 2, copy[is_chosen]], 1)
    rejected_key = np.stack([ordered[~is_chosen] // 2, copy[~is_chosen]], 1)
    if chosen_key.shape != rejected_key.shape or not np.array_equal(chosen_key, rejected_key):
        row = _unpaired_row(ordered, copy, is_chosen)
        raise ValueError(
            f"row {row} ({'chosen' if row % 2 == 0 else 'rejected'} of pair {row // 2}) is in the pack without its "
            f"partner row {row ^ 1}; plan with groups=thdpack.losses.pair_groups(len(rows)) so that both "
            "sequences of a pair share a pack" + ("" if source is None else f" (source {source} of the mixture)"))
    return torch.from_numpy(positions[is_chosen]), torch.from_numpy(positions[~is_chosen])


def _unpaired_row(ordered: np.ndarray, copy: np.ndarray, is_chosen: np.ndarray) -> int:
    """The first row (sorted) whose copy has no partner copy."""
    have = set(zip(ordered.tolist(), copy.tolist()))
    for row, k in zip(ordered.tolist(), copy.tolist()):
        if (row ^ 1, k) not in have:
            return row
    return int(ordered[0])
