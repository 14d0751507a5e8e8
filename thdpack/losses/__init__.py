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
(:func:`pair_groups`), :func:`policy_gradient_loss` with :func:`group_advantages` for RL groups;
:func:`source_totals` and :func:`packed_loss_by_source` split them by the source of each sample
(``batch.source_index``) in a dataset mixture.
"""

from thdpack.losses.policy_gradient import group_advantages, policy_gradient_loss
from thdpack.losses.preference import dpo_loss, pair_groups
from thdpack.losses.reductions import all_reduce_items, count_items, packed_loss, packed_loss_by_source, source_totals
from thdpack.losses.target_logps import DEFAULT_CHUNK, check_batch, sample_target_counts, sequence_logps, token_logps

__all__ = [
    "DEFAULT_CHUNK",
    "all_reduce_items",
    "check_batch",
    "count_items",
    "dpo_loss",
    "group_advantages",
    "packed_loss",
    "packed_loss_by_source",
    "pair_groups",
    "policy_gradient_loss",
    "sample_target_counts",
    "sequence_logps",
    "source_totals",
    "token_logps",
]
