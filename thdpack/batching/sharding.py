"""One verb for a rank's part of a pack, :func:`shard`; its keywords pick the layout that the result's
``shard`` field names (:class:`thdpack.parallel.shard.Shard`). The work is done where each layout lives:
:func:`thdpack.batching.batch._shard_for_cp` (static CP), :func:`thdpack.parallel.ulysses._shard_for_ulysses`
(Ulysses) and :func:`thdpack.batching.hybrid_shards._hybrid_cp_shards` (hybrid CP)."""

from __future__ import annotations

from collections.abc import Mapping

from thdpack.batching.batch import ThdBatch, _shard_for_cp
from thdpack.batching.hybrid_shards import _hybrid_cp_shards
from thdpack.parallel.ulysses import _shard_for_ulysses

ULYSSES_OPTIONS = ("pad_token_id", "num_heads", "num_kv_heads")
"""The keywords a Ulysses shard takes besides its sizes and ranks."""

CALLS = ("shard(batch, cp_size=, cp_rank=) (static CP), shard(batch, sp_size=, sp_rank=[, cp_size=, cp_rank=]) "
         "(Ulysses) or shard(samples, plan=, rank=, **layout) (hybrid CP)")


def shard(data, *, cp_size=None, cp_rank=None, sp_size=None, sp_rank=None, plan=None, rank=None, **options):
    """One rank's part of a pack; the keywords pick the layout (the result's ``shard.layout``).

    - ``shard(batch, cp_size=, cp_rank=)``, ``"cp"``: CP rank ``cp_rank``'s dual-chunk shard of a whole
      :class:`thdpack.ThdBatch` built with that ``cp_size`` (chunks ``r`` and ``2·cp − 1 − r`` of every sample,
      :func:`thdpack.thd_partition_indices`); ``cu_seqlens``, ``cu_seqlens_padded`` and ``max_seqlen`` stay
      global, ``batch.shard`` holds the local layout and ``partition_indices``.
    - ``shard(batch, sp_size=, sp_rank=)``, ``"ulysses"``: Ulysses SP rank ``sp_rank``'s contiguous slice of the
      stream padded to the Ulysses multiple; with ``cp_size=``, ``cp_rank=`` (default 1, 0) of that CP rank's
      dual-chunk shard (CP outer, SP inner). Options: ``pad_token_id`` (the tail slots, default 0),
      ``num_heads``, ``num_kv_heads`` (checked against ``sp_size``).
    - ``shard(samples, plan=, rank=, **layout)``, ``"hybrid-cp"``: the list of micro-batches that data-parallel
      × CP position ``rank`` runs under a :class:`thdpack.planning.HybridCPPlan` (:func:`thdpack.plan_hybrid_cp`),
      built from ``samples`` (a sequence, or a mapping sample id -> sample) with the keywords of
      :func:`thdpack.build_thd_batch` (the plan's ``pad_multiple``, ``tp_size``, ...; ``vlm``, ``sample_values``):
      each its block's ``"cp"`` shard, or the whole micro-batch on a block of one rank.

    In full: docs/attention.md (CP, Ulysses), docs/megatron.md (hybrid CP). A mix that means nothing (``plan=``
    with ``cp_size=``, samples without ``plan=``, a batch with it, no layout) is a ``TypeError`` naming the calls.
    """
    if plan is not None or rank is not None:
        cp = {k: v for k, v in dict(cp_size=cp_size, cp_rank=cp_rank).items() if v is not None}  # refused there
        return _hybrid(data, plan, rank, dict(sp_size=sp_size, sp_rank=sp_rank), {**options, **cp})
    if sp_size is not None:
        _check_batch(data, "shard(batch, sp_size=, sp_rank=)")
        _check_options(options, ULYSSES_OPTIONS, "shard(batch, sp_size=, sp_rank=)")
        return _shard_for_ulysses(data, sp_size, sp_rank, cp_size=1 if cp_size is None else cp_size,
                                  cp_rank=0 if cp_rank is None else cp_rank, **options)
    if sp_rank is not None:
        raise TypeError(f"shard() got sp_rank= without sp_size=: a Ulysses shard takes both; the calls: {CALLS}")
    if cp_size is not None:
        _check_batch(data, "shard(batch, cp_size=, cp_rank=)")
        _check_options(options, (), "shard(batch, cp_size=, cp_rank=)")
        return _shard_for_cp(data, cp_size, cp_rank)
    if cp_rank is not None:
        raise TypeError(f"shard() got cp_rank= without cp_size=: a CP shard takes both; the calls: {CALLS}")
    raise TypeError(f"shard() needs the layout's keywords: {CALLS}")


def _hybrid(samples, plan, rank, ulysses: dict, options: dict) -> list[ThdBatch]:
    """``shard(samples, plan=, rank=, **options)``; ``TypeError`` for a batch, a missing keyword or ``ulysses``
    sizes (``cp_size`` / ``cp_rank`` in ``options`` are refused by :func:`_hybrid_cp_shards`, after ``layout=``)."""
    given = [name for name, value in ulysses.items() if value is not None]
    if given:
        raise TypeError(f"shard(samples, plan=, rank=) takes no {given[0]}=: hybrid CP has no Ulysses; the calls: "
                        f"{CALLS}")
    if plan is None or rank is None:
        raise TypeError(f"shard() got {'rank' if plan is None else 'plan'}= without "
                        f"{'plan' if plan is None else 'rank'}=: hybrid CP takes both (rank: the data-parallel × CP "
                        f"position; a CP rank is cp_rank=, a Ulysses rank sp_rank=); the calls: {CALLS}")
    if isinstance(samples, ThdBatch):
        raise TypeError("shard(samples, plan=, rank=) builds the plan's micro-batches from the samples, got a "
                        "thdpack.ThdBatch: pass the samples (the plan's sample ids index them); a built batch is "
                        "sharded with cp_size=, cp_rank= or sp_size=, sp_rank=")
    return _hybrid_cp_shards(samples, plan, rank, **options)


def _check_batch(data, call: str) -> None:
    """``TypeError`` naming ``call`` when ``data`` is samples (a list, tuple or mapping), not a built batch."""
    if isinstance(data, (list, tuple, Mapping)):
        raise TypeError(f"{call} takes a thdpack.ThdBatch (build_thd_batch, ThdCollator), got {type(data).__name__}; "
                        "samples: build the batch first, or give them with plan= and rank= (hybrid CP)")


def _check_options(options: dict, allowed: tuple, call: str) -> None:
    """``TypeError`` naming ``call`` and the keywords of ``options`` outside ``allowed``."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        takes = f"takes only {', '.join(f'{k}=' for k in allowed)} besides" if allowed else "takes nothing but"
        raise TypeError(f"{call} got unexpected keyword argument(s) {', '.join(map(repr, unknown))}: it {takes} "
                        "its sizes and ranks")
