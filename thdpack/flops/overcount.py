"""How much a pack-length FLOPs count over-states the work of packed batches.

Charging every pack as one ``pack_len``-token sequence counts attention as
``n_packs · pack_len²``; the kernels do ``Σ sᵢ²`` over the real lengths. A sliding-window
or top-k layer is charged ``n_packs · G(pack_len)`` for ``Σ G(sᵢ)`` (:func:`length_count`).
The factors here are the one definition of that over-count: the offline build's statistics
(:mod:`thdpack.offline.commands.pack_stats`, :mod:`thdpack.offline.commands.model_record`) and the examples use them.
"""

from __future__ import annotations

import numpy as np

from thdpack.common.align import check_int, integer_array
from thdpack.flops.model import model_flops, needed_length_counts
from thdpack.flops.sequences import check_count, length_count, lengths_squared_sum

__all__ = ["attention_overcount_factor", "model_overcount_factor", "overcount_report"]


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
