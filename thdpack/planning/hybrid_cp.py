"""Hybrid (per-sample) context-parallel plans: each sample's CP size, its block of ranks, and every rank's
micro-batches, balanced by cost.

Static CP splits every sample over all ``cp`` ranks, so a step that mixes one 64k document with hundreds of
1k chats pays CP communication on the chats and padding to ``2·cp`` on each of them. Hybrid CP (megatron-core
≥ 0.19) gives every sample its own CP size ``k``, a power of two, on an aligned block of the ``R``
data-parallel × CP ranks (:mod:`thdpack.parallel.hybrid_blocks`); short samples run whole on one rank::

    R = 8, max_tokens_per_rank = 16k; lengths 64k, 24k, 12k, 9k, 6k, 4k x 10 ...

    position   0     1     2     3     4     5     6     7
    k = 8     [         64k (8k per rank, chunks j, 15 - j)          ]     micro-batch 1 on every rank
    k = 2     [ 24k (12k each) ] [ 12k 9k ]                              then each block's own
    k = 1                                    [6k 4k][4k 4k][4k 4k][4k 4k]  micro-batches, no barrier

Every rank runs its micro-batches largest block first, so the ranks of a block reach the block's micro-batches
together (they ran the same larger blocks before) and nothing waits: one round, whose time is the busiest rank.
:func:`plan_hybrid_cp` picks each sample's ``k`` (the least that fits ``max_tokens_per_rank``, widened when
one sample would be more than a rank's share of the step, or to give an idle rank work) and deals the samples
to blocks by cost, largest first onto the least loaded block, with :class:`thdpack.CostModel`'s costs: a rank
of a ``k``-block pays ``(linear · P + quadratic · s²) / k`` for a sample of ``s`` tokens padded to ``P``.

The plan is integers only; ``thdpack.shard(samples, plan=, rank=)`` builds a rank's
micro-batches from it, and :meth:`HybridCPPlan.sample_id_groups` is the schedule in megatron-core's format
(``hybrid_context_parallel_forward_backward``: per group, per rank, the sample ids).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from thdpack.common.align import INT64_MAX, check_bool, check_int, host_array, resolve_pad_multiple, round_up
from thdpack.common.samples import SampleError
from thdpack.flops.rank_work import hybrid_cp_rank_counts
from thdpack.parallel.groups import check_ranks
from thdpack.parallel.hybrid_blocks import block_sizes, check_block
from thdpack.planning.balance import CostModel
from thdpack.planning.plan import check_groups, number_groups, validate_lengths


@dataclass(frozen=True)
class HybridCPPlan:
    """Where every sample of a global batch runs under hybrid CP, and in which micro-batch.

    Attributes:
        lengths: int64 ``[n]`` real lengths.
        padded_lengths: int64 ``[n]`` each padded to its least valid multiple for its ``k`` (``2k``, with
            tensor / sequence parallelism and ``pad_multiple`` combined: :func:`thdpack.cp_pad_multiple`).
        cp_sizes: int64 ``[n]`` each sample's CP size ``k`` (1: no CP, the sample whole on one rank).
        block_starts: int64 ``[n]`` the first data-parallel × CP position of its block (a multiple of ``k``).
        world_size: ``R``, the data-parallel × CP ranks.
        micro_batch_offsets, micro_batch_samples: CSR, int64 ``[m + 1]`` and ``[n]``: micro-batch ``j`` is
            samples ``micro_batch_samples[offsets[j]:offsets[j + 1]]``, all on one block, in the order every
            rank of the block runs them; micro-batches in run order (largest block first).
        max_tokens_per_rank: the token budget of a rank's micro-batch (megatron-core's
            ``max_seqlen_per_dp_cp_rank``): ``Σ P / k`` of a micro-batch stays within it.
        cost: the :class:`thdpack.CostModel` the samples were dealt by.
    """

    lengths: np.ndarray
    padded_lengths: np.ndarray
    cp_sizes: np.ndarray
    block_starts: np.ndarray
    world_size: int
    micro_batch_offsets: np.ndarray
    micro_batch_samples: np.ndarray
    max_tokens_per_rank: int | None = None
    cost: CostModel = CostModel()

    @property
    def num_samples(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_micro_batches(self) -> int:
        return int(self.micro_batch_offsets.shape[0] - 1)

    def micro_batch(self, j: int) -> np.ndarray:
        """int64 sample ids of micro-batch ``j``, in order."""
        return self.micro_batch_samples[self.micro_batch_offsets[j]:self.micro_batch_offsets[j + 1]]

    def micro_batch_block(self, j: int) -> tuple[int, int]:
        """``(k, block_start)`` of micro-batch ``j``."""
        first = int(self.micro_batch(j)[0])
        return int(self.cp_sizes[first]), int(self.block_starts[first])

    def rank_micro_batches(self, rank: int) -> list[int]:
        """The micro-batches data-parallel × CP position ``rank`` runs, in order (its block's, largest first)."""
        check_int(rank, "rank", 0, below=self.world_size)
        first = self.micro_batch_samples[self.micro_batch_offsets[:-1]]
        k, start = self.cp_sizes[first], self.block_starts[first]
        return np.flatnonzero((start <= rank) & (rank < start + k)).tolist()

    def rank_samples(self, rank: int) -> list[int]:
        """The samples position ``rank`` runs (a share of each), in order."""
        return [int(i) for j in self.rank_micro_batches(rank) for i in self.micro_batch(j)]

    def sample_id_groups(self) -> list[list[list[int]]]:
        """The schedule in megatron-core's format: ``[group][rank] -> sample ids`` in run order, one group
        (no barrier is needed: module docstring). What ``HybridCPDataLoaderWrapper`` hands
        ``hybrid_context_parallel_forward_backward``, which runs each listed sample as a micro-batch with
        ``local_cp_size`` = the ranks that list it."""
        return [[self.rank_samples(r) for r in range(self.world_size)]]

    def rank_counts(self) -> dict:
        """Every rank's real tokens, slots and ``Σ sᵢ²`` share
        (:func:`thdpack.flops.rank_work.hybrid_cp_rank_counts`)."""
        return hybrid_cp_rank_counts(self.lengths, self.padded_lengths, self.cp_sizes, self.block_starts,
                                     self.world_size)

    @property
    def rank_costs(self) -> np.ndarray:
        """float64 ``[R]``: ``linear · slots + quadratic · Σ sᵢ² share`` of every rank (exact shares)."""
        counts = self.rank_counts()
        return (self.cost.linear * counts["num_padded_tokens"].astype(np.float64)
                + self.cost.quadratic * counts["seqlen_squared_sum"].astype(np.float64))

    @property
    def straggler(self) -> float:
        """``max / mean`` of :attr:`rank_costs` (1.0: every rank busy for the same time)."""
        costs = self.rank_costs
        return float(costs.max() / costs.mean()) if costs.size and costs.mean() > 0 else 1.0

    @property
    def cp_tokens(self) -> int:
        """``Σ sᵢ·(kᵢ − 1)``: the tokens whose K/V go to other ranks (a sample on ``k`` ranks sends to
        ``k − 1``); 0 when every sample runs whole. Static CP over ``cp`` ranks pays ``(cp − 1)·Σ sᵢ``."""
        return int((self.lengths * (self.cp_sizes - 1)).sum())

    @property
    def padding_tokens(self) -> int:
        """Pad slots the plan adds, ``Σ (Pᵢ − sᵢ)``."""
        return int((self.padded_lengths - self.lengths).sum())

    @classmethod
    def from_blocks(cls, lengths, cp_sizes, block_starts, world_size: int, *, max_tokens_per_rank: int | None = None,
                    tp_size: int = 1, sequence_parallel: bool = False, pad_multiple: int | None = None,
                    pack: bool = True, cost=None, order=None) -> "HybridCPPlan":
        """A plan of given CP sizes and blocks (one's own schedule): checked (one line naming the sample for a
        ``k`` that is not a power of two, a block not aligned, a sample over ``max_tokens_per_rank``), padded
        for its ``k``, its blocks' samples in micro-batches (:func:`plan_hybrid_cp`'s ``pack``) in the order
        ``order`` (a permutation of the samples; default: as given) within each block."""
        lengths = validate_lengths(lengths)
        k = _per_sample(cp_sizes, lengths.shape[0], "cp_sizes")
        start = _per_sample(block_starts, lengths.shape[0], "block_starts")
        padding = _check_sizes(world_size, tp_size, sequence_parallel, pack)
        for i in range(lengths.shape[0]):
            check_block(int(k[i]), int(start[i]), world_size, f"sample {i}")
        padded = lengths.copy()
        for size in np.unique(k).tolist():
            mine = k == size
            padded[mine] = _padded_for(lengths[mine], size, (*padding, pad_multiple))
        if max_tokens_per_rank is not None:
            check_int(max_tokens_per_rank, "max_tokens_per_rank", 1)
            over = np.flatnonzero(padded // k > max_tokens_per_rank)
            if over.size:
                i = int(over[0])
                raise SampleError.at(i, f" has {lengths[i]} tokens, padded to {padded[i]}: {padded[i] // k[i]} per "
                                        f"rank at cp_size={k[i]}, more than max_tokens_per_rank={max_tokens_per_rank}")
        rank_in = np.arange(k.shape[0]) if order is None else np.argsort(_permutation(order, k.shape[0]))
        order = np.lexsort((rank_in, start, -k))
        offsets, samples = _micro_batches(order, k, start, padded, max_tokens_per_rank, pack)
        return cls(lengths, padded, k, start, int(world_size), offsets, samples, max_tokens_per_rank,
                   CostModel() if cost is None else CostModel.of(cost))


def _check_sizes(world_size, tp_size, sequence_parallel, pack) -> tuple[int, bool]:
    """The planners' size and switch arguments checked (a number of ranks below
    :data:`thdpack.parallel.groups.MAX_RANKS`, booleans by the one rule); ``(tp_size, sequence_parallel)``."""
    check_ranks(world_size, "world_size", "the data-parallel × context-parallel ranks")
    check_ranks(tp_size, "tp_size", "the tensor-parallel ranks")
    check_bool(pack, "pack")
    return int(tp_size), check_bool(sequence_parallel, "sequence_parallel")


def _padded_for(lengths: np.ndarray, k: int, padding: tuple) -> np.ndarray:
    """int64 ``lengths`` padded for CP size ``k`` (``padding``: ``(tp_size, sequence_parallel, pad_multiple)``);
    ``ValueError`` naming them when a padded length would pass int64 (a ``pad_multiple`` that large)."""
    multiple = resolve_pad_multiple(k, *padding)
    if multiple > INT64_MAX - (int(lengths.max()) if lengths.size else 0):
        raise ValueError(f"pad_multiple={padding[2]} (tp_size={padding[0]}): samples on {k} ranks would pad to "
                         f"multiples of {multiple}, past int64 lengths")
    return round_up(lengths, multiple)


def _permutation(order, n: int) -> np.ndarray:
    arr = np.asarray(order)
    if arr.shape != (n,) or (arr.size and arr.dtype.kind not in "iu") or not np.array_equal(np.sort(arr), np.arange(n)):
        raise ValueError(f"order must be a permutation of the {n} samples, got {arr.tolist()[:8]}...")
    return arr.astype(np.int64)


def _per_sample(values, n: int, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.shape != (n,) or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{name} must hold one integer per sample ({n}), got shape {arr.shape} and dtype {arr.dtype}")
    return arr.astype(np.int64)


def _micro_batches(order: np.ndarray, k: np.ndarray, start: np.ndarray, padded: np.ndarray, budget: int | None,
                   pack: bool) -> tuple[np.ndarray, np.ndarray]:
    """CSR micro-batches over ``order`` (samples in run order, each block's consecutive): with ``pack``, a
    block's samples first-fit, in ``order``, into micro-batches of ``Σ P / k <= budget`` (without a budget,
    one micro-batch per block); without, one sample per micro-batch (megatron-core's way)."""
    batches: list[list[int]] = []
    block_of = np.stack([k[order], start[order]], 1)
    cuts = np.flatnonzero((np.diff(block_of, axis=0) != 0).any(1)) + 1
    for block in np.split(order, cuts):
        if not pack:
            batches += [[int(s)] for s in block]
        elif budget is None:
            batches.append(block.tolist())
        else:
            batches += _first_fit((padded[block] // k[block]).tolist(), block.tolist(), budget)
    sizes = np.array([len(b) for b in batches], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    samples = np.array([s for b in batches for s in b], dtype=np.int64)
    return offsets, samples


def _first_fit(needs: list[int], ids: list[int], budget: int) -> list[list[int]]:
    """``ids`` into bins of ``budget`` by first fit, in order (each need fits the budget: checked before)."""
    room: list[int] = []
    bins: list[list[int]] = []
    for need, s in zip(needs, ids):
        b = next((b for b, r in enumerate(room) if r >= need), None)
        if b is None:
            room.append(budget - need)
            bins.append([s])
        else:
            room[b] -= need
            bins[b].append(s)
    return bins


@dataclass
class _Units:
    """Samples planned as units (a group is one unit: one ``k``, one block, adjacent), and their costs."""

    members: list[np.ndarray]
    sizes: tuple[int, ...]
    feasible: np.ndarray  # bool [u, len(sizes)]: every member fits max_tokens_per_rank at that k
    work: np.ndarray  # float64 [u, len(sizes)]: the unit's whole cost at that k (padding included)


def plan_hybrid_cp(lengths, world_size: int, max_tokens_per_rank: int, *, cost=None, groups=None, tp_size: int = 1,
                   sequence_parallel: bool = False, pad_multiple: int | None = None, pack: bool = True) -> HybridCPPlan:
    """Plan a global batch under hybrid (per-sample) context parallelism.

    Args:
        lengths: int ``[n]`` real lengths of every sample of the global batch (known on every rank, as
            :func:`thdpack.rebalance` gathers them).
        world_size: ``R``, the data-parallel × context-parallel ranks (every sample's ``k`` is a power of
            two dividing ``R``), below 2**20 (:data:`thdpack.parallel.groups.MAX_RANKS`: the plan keeps arrays
            per rank); at least ``R / K`` samples (groups count once), ``K`` the largest such ``k``, so that
            every rank runs one.
        max_tokens_per_rank: the tokens one rank holds in a micro-batch (megatron-core's
            ``max_seqlen_per_dp_cp_rank``): a sample gets at least the ``k`` that brings its padded length
            to ``P / k <= max_tokens_per_rank``; a sample longer than all ``R`` ranks hold is a
            ``SampleError`` naming it.
        cost: a :class:`thdpack.CostModel` or ``(linear, quadratic)``; default ``CostModel.from_config`` is
            up to the caller: None is ``(1, 1 / max_tokens_per_rank)``, attention and linear layers equal at
            one budget's length.
        groups: ``[n]`` group id per sample (GRPO prompts, DPO pairs): a group's samples get one ``k`` (the
            largest they need) and one block, and run one after the other on it.
        tp_size, sequence_parallel, pad_multiple: the padding a sample needs besides ``2k``
            (:func:`thdpack.cp_pad_multiple`; ``pad_multiple`` for FP8's 16); ``tp_size`` below 2**20 too,
            ``sequence_parallel`` and ``pack`` booleans (:func:`thdpack.common.align.check_bool`).
        pack: put a block's samples into micro-batches of up to ``max_tokens_per_rank`` tokens per rank
            (True, thdpack's batches: TransformerEngine's THD attention splits each sample of a micro-batch
            over the block); False: one sample per micro-batch, megatron-core's own hybrid-CP schedule.

    Returns:
        A :class:`HybridCPPlan`: every rank has at least one micro-batch (megatron-core's schedule needs one;
        ``ValueError`` naming the first idle rank where too few samples leave one without).
    """
    lengths = validate_lengths(lengths)
    padding = (*_check_sizes(world_size, tp_size, sequence_parallel, pack), pad_multiple)
    check_int(max_tokens_per_rank, "max_tokens_per_rank", 1)
    if lengths.size == 0:
        raise ValueError("plan_hybrid_cp needs at least one sample (every rank runs a micro-batch)")
    cost = CostModel(1.0, 1.0 / max_tokens_per_rank) if cost is None else CostModel.of(cost)
    units = _units(lengths, groups, int(world_size), int(max_tokens_per_rank), cost, padding)
    choice = _initial_sizes(units, int(world_size))
    blocks, loads = _deal(units, choice, int(world_size))
    choice, blocks = _widen(units, choice, blocks, loads, int(world_size))
    k = np.empty(lengths.shape[0], dtype=np.int64)
    start = np.empty(lengths.shape[0], dtype=np.int64)
    for u, members in enumerate(units.members):
        k[members], start[members] = units.sizes[choice[u]], blocks[u]
    _check_every_rank_runs(k, start, int(world_size), len(units.members))
    return HybridCPPlan.from_blocks(lengths, k, start, int(world_size), max_tokens_per_rank=int(max_tokens_per_rank),
                                    tp_size=tp_size, sequence_parallel=sequence_parallel, pad_multiple=pad_multiple,
                                    pack=pack, cost=cost, order=_deal_order(units, choice))


def _check_every_rank_runs(k: np.ndarray, start: np.ndarray, world_size: int, units: int) -> None:
    """``ValueError`` when a rank has no micro-batch: fewer samples (groups count once) than the ranks need,
    each on at most the largest power of two dividing ``world_size``."""
    busy = np.zeros(world_size, dtype=bool)
    for size, first in set(zip(k.tolist(), start.tolist())):
        busy[first:first + size] = True
    if not busy.all():
        most = block_sizes(world_size)[-1]
        raise ValueError(f"plan_hybrid_cp: {units} sample(s) (a group counts once) leave rank "
                         f"{int(np.argmin(busy))} of the world_size={world_size} ranks without a micro-batch; "
                         f"megatron-core's schedule runs one on every rank and a sample runs on at most {most} of "
                         f"them (the largest power of two dividing {world_size}): give at least "
                         f"{-(-world_size // most)} samples")


def _units(lengths: np.ndarray, groups, world_size: int, budget: int, cost: CostModel, padding: tuple) -> _Units:
    """The units, which sizes each fits, and its cost at each; ``SampleError`` for a sample no size fits."""
    sizes = block_sizes(world_size)
    padded = np.stack([_padded_for(lengths, k, padding) for k in sizes], 1)  # [n, sizes]
    fits = padded // np.array(sizes) <= budget
    none = np.flatnonzero(~fits.any(1))
    if none.size:
        i = int(none[0])
        raise SampleError.at(i, f" has {lengths[i]} tokens: more than the {world_size} data-parallel × CP ranks hold "
                                f"at max_tokens_per_rank={budget} ({padded[i, -1] // sizes[-1]} per rank at cp_size="
                                f"{sizes[-1]}); raise max_tokens_per_rank or cut the sample")
    work = cost.linear * padded + cost.quadratic * (lengths.astype(np.float64) ** 2)[:, None]
    gid = np.arange(lengths.shape[0]) if groups is None else number_groups(check_groups(groups, lengths.shape[0]))
    order = np.argsort(gid, kind="stable")
    cuts = np.flatnonzero(np.diff(gid[order])) + 1
    members = np.split(order, cuts)
    return _Units(members, sizes, np.array([fits[m].all(0) for m in members]),
                  np.array([work[m].sum(0) for m in members]))


def _initial_sizes(units: _Units, world_size: int) -> np.ndarray:
    """Each unit's size index: the least that fits, widened while its per-rank cost is over a rank's share of
    the step (alone, it would be the straggler)."""
    k = np.asarray(units.sizes, dtype=np.float64)
    least = units.feasible.argmax(1)
    share = units.work[np.arange(least.shape[0]), least].sum() / world_size
    choice = least.copy()
    for u in range(choice.shape[0]):
        while choice[u] + 1 < len(units.sizes) and units.work[u, choice[u]] / k[choice[u]] > share:
            choice[u] += 1
    return choice


def _deal(units: _Units, choice: np.ndarray, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Largest per-rank cost first, each unit onto the aligned block of its size whose busiest rank is least
    busy; ``(block start per unit, float64 [R] loads)``."""
    sizes = np.asarray(units.sizes)[choice]
    per_rank = units.work[np.arange(choice.shape[0]), choice] / sizes
    loads = np.zeros(world_size, dtype=np.float64)
    starts = np.empty(choice.shape[0], dtype=np.int64)
    for u in np.lexsort((np.arange(choice.shape[0]), -sizes, -per_rank)).tolist():
        k = int(sizes[u])
        b = int(loads.reshape(-1, k).max(1).argmin())
        loads[b * k:(b + 1) * k] += per_rank[u]
        starts[u] = b * k
    return starts, loads


def _deal_order(units: _Units, choice: np.ndarray) -> np.ndarray:
    """The samples in the order :func:`_deal` placed their units (largest per-rank cost first), a group's
    members together."""
    sizes = np.asarray(units.sizes)[choice]
    per_rank = units.work[np.arange(choice.shape[0]), choice] / sizes
    order = np.lexsort((np.arange(choice.shape[0]), -sizes, -per_rank))
    return np.concatenate([units.members[u] for u in order])


def _widen(units: _Units, choice: np.ndarray, blocks: np.ndarray, loads: np.ndarray, world_size: int):
    """Give idle ranks work, then trim the straggler: widen (to its next size that fits) the unit of the
    largest per-rank cost, among all units while a rank is idle (megatron-core's schedule runs at least one
    micro-batch on every rank), else among the busiest rank's, and deal again; kept while ranks are idle or
    while it lowers the busiest rank's load. Every step grows one unit, so it ends."""
    sizes = np.asarray(units.sizes)
    for _ in range((choice.shape[0] + world_size) * len(units.sizes)):
        idle = bool((loads == 0).any())
        busiest = int(loads.argmax())
        on = [u for u in range(choice.shape[0]) if units.feasible[u, choice[u] + 1:].any()
              and (idle or blocks[u] <= busiest < blocks[u] + sizes[choice[u]])]
        if not on:
            break
        u = max(on, key=lambda v: (units.work[v, choice[v]] / sizes[choice[v]], -v))
        trial = choice.copy()
        trial[u] += int(units.feasible[u, choice[u] + 1:].argmax()) + 1
        new_blocks, new_loads = _deal(units, trial, world_size)
        if not idle and new_loads.max() >= loads.max() * (1 - 1e-12):
            break
        choice, blocks, loads = trial, new_blocks, new_loads
    return choice, blocks


def schedule_cost(sample_id_groups, lengths, cost=None) -> dict:
    """The step a hybrid-CP schedule in megatron-core's format takes, by a cost model (to compare plans).

    ``sample_id_groups[g][r]``: the samples rank ``r`` runs in group ``g`` (megatron-core's
    ``BalancedCPScheduler.get_groups_and_subsamples`` second output, or :meth:`HybridCPPlan.sample_id_groups`);
    a sample's ``k`` in a group is the number of ranks that list it there, and each of them pays
    ``cost(s) / k``, ``cost(s) = linear · s + quadratic · s²`` on the real length (default ``(0, 1)``:
    megatron-core's own ``get_total_workload``, ``s² / k``). Groups end at a barrier, so the step is
    ``Σ_g max_r load[g, r]``.

    Returns ``{"step", "mean", "straggler", "groups", "rank_loads", "cp_tokens"}``: the step, the mean rank's
    busy time (``Σ load / R``), their ratio (1.0: no rank waits), the number of groups, float64 ``[R]`` loads,
    and ``Σ s·(k − 1)`` over the scheduled samples: what CP costs in communication (a sample on ``k`` ranks
    sends its K/V to ``k − 1`` others; 0 when no sample is split). Spreading every sample over all ranks
    balances ``s² / k`` perfectly; ``cp_tokens`` is the price.
    """
    cost = CostModel(0.0, 1.0) if cost is None else CostModel.of(cost)
    lengths = _schedule_lengths(lengths)
    _check_schedule(sample_id_groups, lengths.shape[0])
    step, total, ranks, cp_tokens = 0.0, 0.0, None, 0
    for group in sample_id_groups:
        counts: dict[int, int] = {}
        for ids in group:
            for i in ids:
                counts[int(i)] = counts.get(int(i), 0) + 1
        cp_tokens += sum(int(lengths[i]) * (k - 1) for i, k in counts.items())
        load = np.array([sum((cost.linear * lengths[i] + cost.quadratic * lengths[i] ** 2) / counts[int(i)]
                             for i in ids) for ids in group], dtype=np.float64)
        ranks = load if ranks is None else ranks + load
        step += float(load.max()) if load.size else 0.0
        total += float(load.sum())
    world = len(sample_id_groups[0]) if len(sample_id_groups) else 1
    mean = total / world
    return {"step": step, "mean": mean, "straggler": step / mean if mean > 0 else 1.0,
            "groups": len(sample_id_groups), "rank_loads": ranks if ranks is not None else np.zeros(world),
            "cp_tokens": cp_tokens}


def _schedule_lengths(lengths) -> np.ndarray:
    """float64 ``[n]`` of ``lengths`` (non-negative finite numbers), else ``ValueError`` / ``TypeError``."""
    arr = host_array(lengths, "lengths", "a list or array of sample lengths", "1-D")
    if arr.ndim != 1 or arr.dtype.kind not in "iuf" and arr.size:
        raise ValueError(f"lengths must be 1-D numbers, one per sample, got shape {arr.shape} and dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    if not np.isfinite(arr).all() or (arr < 0).any():
        raise ValueError("lengths must be non-negative finite numbers")
    return arr


def _check_schedule(sample_id_groups, n: int) -> None:
    """``TypeError`` / ``ValueError`` naming the first entry of ``sample_id_groups`` that is not a group of
    equally many per-rank lists of sample ids in ``[0, n)``."""
    what = "a list of groups, each a list of per-rank lists of sample ids (megatron-core's format)"
    if not _is_list(sample_id_groups):
        raise TypeError(f"sample_id_groups must be {what}, got {type(sample_id_groups).__name__}")
    for g, group in enumerate(sample_id_groups):
        if not _is_list(group) or not all(_is_list(ids) for ids in group):
            raise TypeError(f"sample_id_groups[{g}] must be a list of per-rank lists of sample ids, got {group!r:.80}")
        if len(group) != len(sample_id_groups[0]):
            raise ValueError(f"sample_id_groups[{g}] lists {len(group)} ranks, sample_id_groups[0] "
                             f"{len(sample_id_groups[0])}: every group lists every rank")
        for r, ids in enumerate(group):
            for i in ids:
                check_int(i, f"sample_id_groups[{g}][{r}]: a sample id", 0, below=n, hint=f" (one of the {n} lengths)")


def _is_list(value) -> bool:
    return isinstance(value, (list, tuple, np.ndarray))
