"""What a shared-prefix batch carries besides its stream: the tree of its segments and every sample's
targets, so that losses read one value per sample as for the unshared batch.

A group whose samples share a token prefix is laid out once as ``[prefix][member 1][member 2]...``
(:mod:`thdpack.batching.shared_prefix`). The stream's *segments* (``cu_seqlens_padded``) are the
shared prefixes, the members' own tokens after them, and the samples laid out alone. The logits of
the prefix's last row predict every member's first own token: one row, several targets. So the
targets are carried as a table, one entry per (sample, target token) of the unshared batch, in its
order (sample by sample, token by token): the row whose logits score it, and its label::

    member A = p0 p1 p2 a3 a4        member B = p0 p1 p2 b3           (prefix p = 3)
    stream         p0  p1  p2 | a3  a4 | b3
    row labels     p1  p2   - | a4   - |  -       (row 2 has two targets: a3 for A, b3 for B)
    target table   A: rows 0 1 2 3 -> p1 p2 a3 a4    B: rows 0 1 2 -> p1 p2 b3

A prefix row that is a target (loss on the prompt) appears once per member in the table, as each
member scores it unshared, so sums, means and gradients are those of the unshared batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class PrefixTree:
    """The segments and targets of a shared-prefix :class:`thdpack.ThdBatch` (``batch.prefix_tree``).

    ``S`` is the number of segments (``batch.seq_lens``), ``n`` of samples (``batch.num_samples``),
    ``U`` their tokens unshared (``Σ sample_lens``), ``N`` their targets (``batch.num_targets``).
    Samples are numbered in the order they were given (``batch.sample_index``), whatever their place
    in the stream. All int64.

    Attributes:
        parents: ``[S]`` the parent segment of every segment: its group's prefix for a member, ``-1``
            for a shared prefix and for a sample laid out alone.
        segment_sample: ``[S]`` the sample whose own tokens a segment holds, ``-1`` for a shared prefix.
        sample_segment: ``[n]`` every sample's own segment (empty for a member equal to the prefix).
        prefix_lens: ``[n]`` tokens of each sample in its group's prefix (0: laid out alone).
        sample_lens: ``[n]`` every sample's real length, as unshared.
        first_rows: ``[n]`` the row whose logits predict the sample's first own token (its prefix's
            last row); ``-1`` for a sample laid out alone or equal to its prefix.
        first_labels: ``[n]`` that token's label, ``ignore_index`` where it is not a target (or no row).
        unshared_rows: ``[U]`` for token t of sample j (samples in order, tokens in order): the stream
            row whose logits equal that token's logits in the sample alone.
        target_rows, target_labels, target_samples: ``[N]`` the target table (the module docstring):
            the row scoring each target, its label and its sample, in the unshared batch's order.
    """

    parents: torch.Tensor
    segment_sample: torch.Tensor
    sample_segment: torch.Tensor
    prefix_lens: torch.Tensor
    sample_lens: torch.Tensor
    first_rows: torch.Tensor
    first_labels: torch.Tensor
    unshared_rows: torch.Tensor
    target_rows: torch.Tensor
    target_labels: torch.Tensor
    target_samples: torch.Tensor

    @property
    def num_targets(self) -> int:
        return int(self.target_rows.numel())

    @property
    def num_shared_groups(self) -> int:
        """Shared prefixes in the stream."""
        return int((self.segment_sample < 0).sum())

    def map(self, fn) -> "PrefixTree":
        """A copy with ``fn`` applied to every tensor (``ThdBatch.to`` / ``pin_memory``)."""
        return dataclasses.replace(self, **{f.name: fn(getattr(self, f.name)) for f in dataclasses.fields(self)})


SHARED_LAYOUT_HINT = "or build the batch with share_prefix=None (the unshared layout)"


def refuse_tree(what: str, batch) -> None:
    """``ValueError`` when ``batch`` is a shared-prefix batch, which ``what`` cannot express."""
    if getattr(batch, "prefix_tree", None) is not None:
        raise ValueError(f"{what} cannot express a shared-prefix batch (prefixes laid out once, members attending to "
                         f"them): use attn_implementation='flex_attention', 'sdpa', 'eager' or 'thdpack_varlen' "
                         f"(thdpack.integrations.register_varlen_attention(): a varlen kernel given each segment's "
                         f"ancestors), {SHARED_LAYOUT_HINT}")
