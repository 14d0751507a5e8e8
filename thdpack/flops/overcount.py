"""How much a pack-length FLOPs count over-states the work of packed batches.

Charging every pack as one ``pack_len``-token sequence counts attention as
``n_packs · pack_len²``; the kernels do ``Σ sᵢ²`` over the real lengths. A sliding-window
or top-k layer is charged ``n_packs · G(pack_len)`` for ``Σ G(sᵢ)`` (:func:`length_count`).
The factors here are the one definition of that over-count: the offline build's statistics
(:mod:`thdpack.offline.commands.pack_stats`, :mod:`thdpack.offline.commands.model_record`) and the examples use them.

A shared-prefix batch (a one-level prefix or a rollout trie, issue 46) has the other over-count: counting its
samples as the unshared batch charges every shared segment once per sample below it. :func:`trie_overcount`
compares the two (tokens, attention, and with a config the whole model).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from thdpack.common.align import check_int, integer_array
from thdpack.flops.model import model_flops, needed_length_counts
from thdpack.flops.sequences import (check_count, length_count, lengths_squared_sum, tree_length_count,
                                      tree_seqlen_squared_sum)

__all__ = ["TrieOvercount", "attention_overcount_factor", "model_overcount_factor", "overcount_report",
           "trie_overcount"]


def _check_overcount_args(n_packs, pack_len, real_tokens, seqlen_squared_sum) -> None:
    """The counts of an over-count: ``n_packs`` an integer >= 0, ``pack_len`` >= 1, the real counts
    integers >= 0 and not zero (no real tokens: nothing to compare with); ``ValueError`` naming the argument."""
    check_int(n_packs, "n_packs", 0)
    check_int(pack_len, "pack_len", 1)
    if real_tokens is not None:
        check_count(real_tokens, "num_tokens")
    check_count(seqlen_squared_sum, "seqlen_squared_sum", square_sum=True)
    if not seqlen_squared_sum or (real_tokens is not None and not real_tokens):
        raise ValueError("no real tokens (num_tokens and seqlen_squared_sum are 0): the over-count of a pack-length "
                         "count is undefined; count a plan or packs that hold tokens")


def attention_overcount_factor(n_packs: int, pack_len: int, seqlen_squared_sum) -> float:
    """``n_packs · pack_len² / Σ sᵢ²``: how much a pack-length count over-states attention.
    ``n_packs`` is an integer >= 0, ``pack_len`` >= 1, ``Σ sᵢ²`` an integer > 0 (``ValueError``
    naming the argument otherwise; ``Σ sᵢ² = 0``, no real tokens, has no over-count)."""
    _check_overcount_args(n_packs, pack_len, None, seqlen_squared_sum)
    return int(n_packs) * int(pack_len) ** 2 / float(seqlen_squared_sum)


def model_overcount_factor(config, n_packs: int, pack_len: int, num_tokens, seqlen_squared_sum, *, counts=None,
                           seq_lens=None, **options) -> float:
    """Whole-model over-count of a pack-length count: ``model_flops`` of ``n_packs``
    sequences of ``pack_len`` (the legacy BSHD count) over ``model_flops`` of the real
    ``num_tokens`` and ``Σ sᵢ²``. Counts checked as in :func:`attention_overcount_factor`
    (``num_tokens`` > 0 too). A model with sliding windows or top-k attention also needs its
    real length counts: ``counts`` (by name) or ``seq_lens`` (the real lengths) to compute them."""
    _check_overcount_args(n_packs, pack_len, num_tokens, seqlen_squared_sum)
    uniform = {name: int(n_packs) * length_count([int(pack_len)], name)
               for name in needed_length_counts(config, **options)}
    claimed = model_flops(config, n_packs * pack_len, n_packs * pack_len * pack_len, counts=uniform or None, **options)
    real = model_flops(config, num_tokens, seqlen_squared_sum, counts=counts, seq_lens=seq_lens, **options)
    return claimed / real


def overcount_report(plan=None, *, pack_lengths=None, pack_len: int | None = None, config=None, **options) -> dict:
    """Over-count factors of a pack-length count for a planned dataset.

    Args:
        plan: a :class:`thdpack.planning.PackPlan` (its packs, real piece lengths and ``pack_size``).
        pack_lengths: instead of ``plan``, one array of real lengths per pack.
        pack_len: the pack length the legacy count would charge (default: the plan's
            ``pack_size``).
        config: a model config: adds the whole-model factor.

    ``pack_len`` is an integer >= 1 and the packs must hold tokens (``ValueError`` otherwise:
    an empty plan has no over-count).

    Returns:
        ``{"n_packs", "n_samples", "pack_len", "real_tokens", "seqlen_squared_sum",
        "attention"}``; with ``config`` also ``"model"`` (:func:`model_overcount_factor`)
        and ``"model_samples_at_pack_len"``: the factor of the other common mistake,
        charging every *sample* (piece) a whole ``pack_len`` sequence (a batch size
        counted in samples times ``seq_length``); and for a model with sliding windows or
        top-k attention ``"length_counts"``: ``{name: {"real", "pack_len_count",
        "overcount"}}`` for each of its length counts (``window_square_sum[w]``, ...): what
        a pack-length count charges those layers against what they do.
    """
    if plan is not None:
        lengths = np.asarray(plan.length, dtype=np.int64)
        n_packs = len(plan)
        pack_len = plan.pack_size if pack_len is None else pack_len
    elif pack_lengths is not None:
        if isinstance(pack_lengths, (str, bytes)) or not hasattr(pack_lengths, "__len__"):
            raise TypeError(f"pack_lengths must be a list of per-pack length arrays, got {type(pack_lengths).__name__}")
        n_packs = len(pack_lengths)
        parts = [integer_array(p, f"pack_lengths[{k}]").reshape(-1).astype(np.int64) for k, p in enumerate(pack_lengths)]
        lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if pack_len is None:
            raise ValueError("pass pack_len with pack_lengths")
    else:
        raise ValueError("pass plan or pack_lengths")
    check_int(pack_len, "pack_len", 1)
    sq = lengths_squared_sum(lengths)
    tokens = int(lengths.sum())
    out = {
        "n_packs": n_packs,
        "n_samples": int(lengths.size),
        "pack_len": int(pack_len),
        "real_tokens": tokens,
        "seqlen_squared_sum": sq,
        "attention": attention_overcount_factor(n_packs, pack_len, sq),
    }
    if config is not None:
        names = needed_length_counts(config, **options)
        real = {name: length_count(lengths, name) for name in names}
        if names:
            out["length_counts"] = {name: _length_overcount(real[name], n_packs * length_count([int(pack_len)], name))
                                    for name in names}
        counts = real or None
        out["model"] = model_overcount_factor(config, n_packs, pack_len, tokens, sq, counts=counts, **options)
        out["model_samples_at_pack_len"] = model_overcount_factor(config, int(lengths.size), pack_len, tokens, sq,
                                                                  counts=counts, **options)
    return out


def _length_overcount(real: int, claimed: int) -> dict:
    return {"real": real, "pack_len_count": claimed, "overcount": claimed / real if real else None}


# --------------------------------------------------------------------------- shared prefixes and tries


@dataclass(frozen=True)
class TrieOvercount:
    """What counting a shared-prefix batch (one level or a trie) as its unshared batch over-states
    (:func:`trie_overcount`). Counts are exact Python ints.

    Attributes:
        samples: samples in the batch; ``segments``: segments laid out (``batch.seq_lens``), of which
            ``shared_segments`` hold a shared prefix; ``depth``: segments on the longest root-to-leaf path.
        tokens: real tokens laid out (``Σ seq_lens``: what the MLP and projections see).
        unshared_tokens: the samples' tokens, every prefix repeated (``Σ sample_lens``).
        attention: the tree's ``Σ sᵢ²`` (:func:`~thdpack.flops.sequences.tree_seqlen_squared_sum`: every
            segment against all its ancestors and itself, causally).
        unshared_attention: the unshared batch's ``Σ Lⱼ²`` over the sample lengths.
        length_counts: with a config whose model has sliding windows or top-k attention:
            ``{name: (tree count, unshared count)}``.
        model_flops, unshared_model_flops: with a config, :func:`~thdpack.flops.model.model_flops` of each.
    """

    samples: int
    segments: int
    shared_segments: int
    depth: int
    tokens: int
    unshared_tokens: int
    attention: int
    unshared_attention: int
    length_counts: dict | None = None
    model_flops: int | None = None
    unshared_model_flops: int | None = None

    @property
    def token_overcount(self) -> float:
        """``unshared_tokens / tokens`` (>= 1): the over-count of a per-token (MLP, projections) count."""
        return self.unshared_tokens / self.tokens

    @property
    def attention_overcount(self) -> float:
        """``unshared_attention / attention`` (>= 1): the over-count of the unshared ``Σ Lⱼ²``."""
        return self.unshared_attention / self.attention

    @property
    def model_overcount(self) -> float | None:
        """``unshared_model_flops / model_flops`` with a config, else None."""
        return None if self.model_flops is None else self.unshared_model_flops / self.model_flops

    def lines(self) -> list[str]:
        """The report as text lines (the benchmarks print them)."""
        out = [f"{self.samples} samples in {self.segments} segments ({self.shared_segments} shared prefixes, "
               f"depth {self.depth})",
               f"tokens: {self.tokens:,} laid out, {self.unshared_tokens:,} unshared (over-count "
               f"{self.token_overcount:.3f}x)",
               f"attention: Σ {self.attention:,} on the tree, Σ Lⱼ² {self.unshared_attention:,} unshared (over-count "
               f"{self.attention_overcount:.3f}x)"]
        for name, (tree, flat) in (self.length_counts or {}).items():
            factor = f"{flat / tree:.3f}x" if tree else "undefined"
            out.append(f"{name}: {tree:,} on the tree, {flat:,} unshared (over-count {factor})")
        if self.model_flops is not None:
            out.append(f"model FLOPs: {self.model_flops:.4g} on the tree, {self.unshared_model_flops:.4g} unshared "
                       f"(over-count {self.model_overcount:.3f}x)")
        return out


def trie_overcount(batch, config=None, **options) -> TrieOvercount:
    """The over-count of counting a shared-prefix batch's samples unshared (issue 46): real tokens laid out vs
    ``Σ sample_lens``, the tree's attention work (each segment against its ancestors,
    :func:`~thdpack.flops.sequences.tree_seqlen_squared_sum`; each sample's share of it added up gives the same
    total) vs the unshared ``Σ Lⱼ²``; with ``config`` (and :func:`~thdpack.flops.model.model_flops`'s
    ``options``) the whole model's FLOPs of each, window / top-k layers counted on the tree
    (:func:`~thdpack.flops.sequences.tree_length_count`).

    Args:
        batch: a :class:`thdpack.ThdBatch` built with ``share_prefix`` (``batch.prefix_tree`` set; any device).

    Raises:
        ValueError: ``batch`` has no prefix tree (built without ``share_prefix``, or no group shared a prefix:
            its unshared count is already exact), is one CP rank's shard, or holds no real tokens.
    """
    tree = getattr(batch, "prefix_tree", None)
    if tree is None:
        raise ValueError("trie_overcount needs a shared-prefix batch (build_thd_batch(..., share_prefix=...) whose "
                         "groups share a prefix: batch.prefix_tree is None); a batch without one has no over-count: "
                         "its seqlen_squared_sum(batch) is already the work")
    if getattr(batch, "is_shard", False):
        raise ValueError("trie_overcount takes the whole batch, not one CP rank's shard")
    lens = batch.seq_lens.detach().cpu().to(torch.int64)
    parents = tree.parents.detach().cpu()
    sample_lens = tree.sample_lens.detach().cpu()
    tokens, unshared_tokens = int(lens.sum()), int(sample_lens.sum())
    attention = tree_seqlen_squared_sum(lens, parents)
    unshared_attention = lengths_squared_sum(sample_lens)
    if not tokens or not attention:
        raise ValueError("the batch holds no real tokens: the over-count is undefined")
    depth = [0] * len(parents)
    for d, p in enumerate(parents.tolist()):  # a parent precedes its children
        depth[d] = 1 if p < 0 else depth[p] + 1
    extra = {}
    if config is not None:
        names = needed_length_counts(config, **options)
        counts = {name: (tree_length_count(lens, parents, name), length_count(sample_lens, name)) for name in names}
        extra = dict(
            length_counts=counts or None,
            model_flops=model_flops(config, tokens, attention, counts={k: v[0] for k, v in counts.items()} or None,
                                    **options),
            unshared_model_flops=model_flops(config, unshared_tokens, unshared_attention,
                                             counts={k: v[1] for k, v in counts.items()} or None, **options))
    return TrieOvercount(samples=int(sample_lens.numel()), segments=int(lens.numel()),
                         shared_segments=int(tree.num_shared_groups), depth=max(depth, default=0), tokens=tokens,
                         unshared_tokens=unshared_tokens, attention=attention, unshared_attention=unshared_attention,
                         **extra)
