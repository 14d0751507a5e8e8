"""Run-time rebalancing across data-parallel ranks: samples whose lengths appear only at run time
(RL rollouts, generated on whichever rank sampled the prompt) dealt to the ranks that run them.

::

    rank 0: rollouts a b c (long)     all_gather: lengths,      rank 0: packs [a f] [d h]
    rank 1: rollouts d e   (short) ─▶ group ids, sizes     ─▶   rank 1: packs [b e] [c g]
    rank 2: rollouts f g h (short)    plan_balanced, all_to_all rank 2: packs [...]
                                                  ▲
    handle.restore(values) ───────────────────────┘ one value per sample back to its rank and order

Every rank runs the same :func:`thdpack.plan_balanced` on the same gathered lengths (so no second
round), then one all-to-all moves each sample's fields to the rank that runs it, and
:meth:`RebalanceHandle.restore` sends per-sample results (log-probs, rewards) back.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from thdpack.batching.batch import ThdBatch
from thdpack.batching.builder import build_thd_batch
from thdpack.batching.layout import LAYOUT_FIELDS, BatchLayout, layout_of, refuse_layout_object
from thdpack.batching.vision_family import check_vlm
from thdpack.batching.shared_prefix import (DEFAULT_MIN_PREFIX_LEN, PREFIX_FIELD, check_share_args, flat_layout,
                                            group_prefixes, group_shares, read_groups)
from thdpack.planning.prefix_budget import SharedLayout
from thdpack.common.align import check_positive_int
from thdpack.common.samples import SampleError, get_field, sample_list, to_int_array
from thdpack.loaders.exchange import Comm, decode_sample, encode_sample, exchange_blobs, exchange_objects, exchange_rows
from thdpack.loaders.routing import RankRecord, Route, StepsRequest, plan_route
from thdpack.planning.balance import CostModel
from thdpack.planning.options import PlanOptions
from thdpack.planning.plan import number_groups
from thdpack.planning.pipeline_parallel.simulate import PipelineShape
from thdpack.planning.rank_fill import straggler_bound
from thdpack.planning.pipeline_parallel.steps import DEFAULT_ORDER_BUDGET, check_order_budget

# build_thd_batch keywords besides the layout's that rebalance passes on to every micro-batch. With
# "share_prefix" each rank finds its groups' prefixes (_local_prefixes), and plan_route counts each once.
BUILD_KEYWORDS = ("vlm", "sample_values", "share_prefix", "min_prefix_len")


def _rebalance_hybrid(local_samples, pack_size: int, hybrid_cp, micro_batches: int, group, cost, groups, layout):
    """``rebalance(..., hybrid_cp=...)``: :func:`thdpack.loaders.hybrid_rebalance.rebalance_hybrid_cp`."""
    from thdpack.loaders.hybrid_rebalance import HybridCP, rebalance_hybrid_cp

    if micro_batches != 1:
        raise ValueError(f"rebalance(hybrid_cp=...) plans its own micro-batches per rank: micro_batches must be 1, "
                         f"got {micro_batches}")
    plan = hybrid_cp if isinstance(hybrid_cp, HybridCP) else HybridCP(int(pack_size))
    return rebalance_hybrid_cp(local_samples, plan, group=group, cost=cost, groups=groups, **layout)


def rebalance(local_samples: Sequence, pack_size: int, *, group=None, micro_batches: int = 1, cost=None, groups=None,
              hybrid_cp=None, **layout) -> tuple[list[ThdBatch], "RebalanceHandle"]:
    """Deal this step's samples, wherever they were made, to the data-parallel ranks by cost, and pack them.

    A collective: call it on every rank of ``group`` with that rank's samples (one all-gather of the lengths,
    the same :func:`thdpack.plan_balanced` on every rank, one all-to-all). In full, with an example:
    docs/rl.md, "rebalance: arguments and returns".

    Args:
        local_samples: this rank's samples (mappings with integer ``input_ids`` and ``labels`` / ``loss_mask``,
            as :func:`thdpack.build_thd_batch` reads them); may be empty.
        pack_size: token budget of a micro-batch, counted after alignment (an integer >= 1).
        group: the data-parallel process group (None: the default group; no ``torch.distributed``: world size 1).
        micro_batches: ``M``: every rank gets ``S·M`` micro-batches (``S`` the plan's steps); a group spans at
            most ``M`` packs.
        cost: a :class:`thdpack.CostModel` or ``(linear, quadratic)`` (None: tokens, ``CostModel()``).
        groups: ``[n]`` integer group id per local sample (per rank): a group stays on one rank and step.
        hybrid_cp: plan under hybrid (per-sample) context parallelism instead
            (:func:`thdpack.loaders.hybrid_rebalance.rebalance_hybrid_cp`, which returns ``(batches, plan, offsets)``).
        **layout: :func:`thdpack.build_thd_batch` keywords for every micro-batch (the layout fields, ``vlm``,
            ``sample_values``, ``share_prefix``, ``min_prefix_len``; ``layout=`` is a ``TypeError``).

    Returns:
        ``(batches, handle)``: this rank's :class:`thdpack.ThdBatch` micro-batches (``sample_index``: global
        ids, rank ``r``'s local sample ``i`` is ``handle.offsets[r] + i``) and the :class:`RebalanceHandle`
        that sends results back; a slot no pack is left for holds a filler (``handle.filler[k]``).

    Raises ``ValueError`` (on every rank, naming the rank and its local sample or group) for a
    sample longer than ``pack_size``, ``groups`` of the wrong length, a sample that is not a
    mapping with integer ``input_ids``, a group over ``M`` packs; ``TypeError`` for unknown keywords.
    """
    check_positive_int(pack_size, "pack_size")
    check_positive_int(micro_batches, "micro_batches")
    refuse_layout_object("rebalance", layout)
    if hybrid_cp is not None and hybrid_cp is not False:
        return _rebalance_hybrid(local_samples, pack_size, hybrid_cp, micro_batches, group, cost, groups, layout)
    return _rebalance(local_samples, int(pack_size), group, cost, groups, layout, micro_batches=int(micro_batches))


def rebalance_steps(local_samples: Sequence, max_tokens_per_micro_batch: int, *, group=None, pp_size: int = 1,
                    vpp_size: int = 1, vpp_group: int | None = None, cost=None, groups=None, min_micro_batches: int = 1,
                    order_budget: int = DEFAULT_ORDER_BUDGET, **layout) -> tuple[list[ThdBatch], "StepsHandle"]:
    """:func:`rebalance` for one pipeline-parallel step: the micro-batch count and order of
    :func:`thdpack.plan_steps`, planned on the lengths gathered from every rank of ``group``.

    A collective, like :func:`rebalance` (one all-gather, one all-to-all). Every rank computes the same
    :func:`thdpack.plan_steps` of the gathered lengths (rank ``r``'s local sample ``i`` is global sample
    ``handle.offsets[r] + i``), so the plan equals the offline plan of the same global batch, and gets the same
    ``num_micro_batches``.

    Args:
        local_samples, group, cost, groups, **layout: as in :func:`rebalance` (``**layout``'s ``multiple`` / CP
            alignment is the plan's ``align``).
        max_tokens_per_micro_batch, pp_size, vpp_size, vpp_group, min_micro_batches, order_budget: as in
            :func:`thdpack.plan_steps`.

    Returns:
        ``(batches, handle)``: this rank's ``handle.num_micro_batches`` micro-batches in run order (a filler where
        the samples cannot fill every slot, as in :func:`rebalance`) and a :class:`StepsHandle` (``restore``,
        ``steps``, ``seqlen_sums`` for the FLOPs meter).
    """
    check_positive_int(max_tokens_per_micro_batch, "max_tokens_per_micro_batch")
    refuse_layout_object("rebalance_steps", layout)
    check_positive_int(min_micro_batches, "min_micro_batches")
    request = StepsRequest(PipelineShape(pp_size, vpp_size, vpp_group), int(min_micro_batches),
                           check_order_budget(order_budget))
    return _rebalance(local_samples, int(max_tokens_per_micro_batch), group, cost, groups, layout, pipeline=request)


def _rebalance(local_samples, pack_size: int, group, cost, groups, layout: dict, *, micro_batches: int | None = None,
               pipeline: StepsRequest | None = None):
    """:func:`rebalance` (``micro_batches``) or :func:`rebalance_steps` (``pipeline``) after their checks."""
    cost = CostModel() if cost is None else CostModel.of(cost)
    batch_layout, build_kwargs = _split_layout(layout)
    share = _share_of(build_kwargs, batch_layout)
    options = _plan_options(pack_size, batch_layout)
    comm = Comm.of(group)
    samples, blobs, record, local_error = _read_local(local_samples, groups, batch_layout, comm.world_size > 1, share)
    try:
        route = plan_route(comm.all_gather_object(record), options, micro_batches=micro_batches, cost=cost,
                           pipeline=pipeline)
    except ValueError as exc:
        raise exc from local_error
    held = _fetch_samples(comm, route, samples, blobs)
    batches = _build_batches(route, comm.rank, held, batch_layout, build_kwargs, share)
    handle = RebalanceHandle if pipeline is None else StepsHandle
    return batches, handle(comm, route, options, cost)


def _split_layout(layout: dict) -> tuple[BatchLayout, dict]:
    """``**layout`` as ``(BatchLayout, build_thd_batch keywords)``; ``TypeError`` naming unknown keywords."""
    build = {k: layout.pop(k) for k in BUILD_KEYWORDS if k in layout}
    unknown = sorted(set(layout) - set(LAYOUT_FIELDS))
    if unknown:
        raise TypeError(f"rebalance() got unexpected keyword argument(s) {', '.join(map(repr, unknown))} (it takes "
                        f"the BatchLayout fields and {', '.join(BUILD_KEYWORDS)})")
    return layout_of("rebalance", layout), build


def _share_of(build_kwargs: dict, layout: BatchLayout) -> tuple | None:
    """``(field, min_prefix_len, vlm)`` of a shared-prefix rebalance (checked as
    ``build_thd_batch`` checks them), or None."""
    field = build_kwargs.get("share_prefix")
    min_prefix_len = build_kwargs.setdefault("min_prefix_len", DEFAULT_MIN_PREFIX_LEN)
    vlm = build_kwargs.get("vlm")
    check_share_args(field, min_prefix_len, layout)
    check_vlm(vlm, "rebalance")
    return None if field is None else (field, int(min_prefix_len), vlm)


def _plan_options(pack_size: int, layout: BatchLayout) -> PlanOptions:
    """Packs of ``pack_size`` tokens after the layout's alignment, at most ``max_num_seqs`` samples each."""
    if layout.pad_to is not None and layout.pad_to < pack_size:
        raise ValueError(f"rebalance: pad_to={layout.pad_to} is shorter than pack_size={pack_size}; a full pack "
                         "could not be padded to it (give pad_to >= pack_size)")
    if pack_size < layout.multiple:
        raise ValueError(f"rebalance: pack_size={pack_size} is smaller than the layout's pad multiple "
                         f"{layout.multiple}; nothing fits")
    return PlanOptions(pack_size, align=layout.multiple, max_samples_per_pack=layout.max_num_seqs)


def _read_local(local_samples, groups, layout: BatchLayout, encode: bool, share: tuple | None = None):
    """``(samples, encoded samples, RankRecord, error)`` of this rank (encoded only with ``encode``: one
    process sends nothing; every sample is encoded before the gather, since a receiver must know its
    size, though those that stay here are neither sent nor decoded). With ``share`` the groups are
    the samples' ``share[0]`` field and the record carries their prefixes. A problem is not raised here but
    carried in the record (every rank raises it after the gather) and returned as ``error``."""
    try:
        samples = sample_list(local_samples, "rebalance")
        lengths = np.zeros(len(samples), np.int64)
        blobs = []
        for i, sample in enumerate(samples):
            lengths[i] = to_int_array(get_field(sample, "input_ids", i, required=True), sample=i,
                                      field="input_ids").size
            if lengths[i] == 0:
                raise SampleError.at(i, ": 'input_ids' is empty; every sample needs at least one token",
                                     field="input_ids")
            if not isinstance(sample, Mapping):  # get_field also reads objects with keys(); they are not encoded
                raise SampleError.at(i, f" is a {type(sample).__name__}; rebalance sends mappings (dicts)")
            blobs.append(encode_sample(sample) if encode else b"")
        gid = None if groups is None else _local_groups(groups, len(samples))
        prefix = None
        if share is not None:
            gid, prefix = _local_prefixes(samples, gid, share, layout)
    except (TypeError, ValueError) as exc:
        error = str(exc).replace("\n", " ")
        return [], [], RankRecord(np.zeros(0, np.int64), None, np.zeros(0, np.int64), error), exc
    if layout.cut_length is not None:
        lengths = np.minimum(lengths, layout.cut_length)
    sizes = np.array([len(b) for b in blobs], np.int64)
    return samples, blobs, RankRecord(lengths, gid, sizes, prefix=prefix), None


def _local_prefixes(samples: list, gid: np.ndarray | None, share: tuple, layout: BatchLayout):
    """``(groups, prefixes)``, int64 ``[n]`` each: the samples' ``share[0]`` field (which ``groups=``, when
    given, must partition alike) and the prefix each shares with its group, as ``build_thd_batch``
    would lay it out (:func:`thdpack.batching.shared_prefix.group_prefixes`; a group's members are
    all here, so each rank finds its own). VLM samples (``share[2]``, the family): a prefix ends before
    an image it would split or that differs between members, as ``build_thd_batch`` cuts it."""
    field, min_prefix_len, vlm = share
    own = read_groups(samples, field)
    if gid is not None:
        differs = np.flatnonzero(number_groups(gid) != number_groups(own))
        if differs.size:
            i = int(differs[0])
            raise ValueError(f"groups= and the share_prefix field {field!r} group the samples differently (local "
                             f"sample {i}: groups {int(gid[i])}, {field} {int(own[i])}); give one of them, or both alike")
    if not samples:
        empty = np.zeros(0, np.int64)
        return own, empty if vlm is not None else SharedLayout(empty, empty, empty)
    flat = build_thd_batch(samples, **flat_layout(layout).keywords(), vlm=vlm)
    if vlm is None:  # text: each group as the build lays it out, a trie's segments once (a SharedLayout)
        return own, group_shares(flat, samples, field, min_prefix_len, layout.multiple)
    return own, group_prefixes(flat, samples, field, min_prefix_len, layout.multiple, vlm.prefix_limit(flat))


def _local_groups(groups, n: int) -> np.ndarray:
    gid = np.asarray(groups.detach().cpu() if isinstance(groups, torch.Tensor) else groups)
    if gid.shape != (n,) or (gid.size and gid.dtype.kind not in "iu"):
        raise ValueError(f"groups must hold one integer group id per local sample ({n}), got shape {gid.shape} "
                         f"and dtype {gid.dtype}")
    return gid.astype(np.int64)


def _fetch_samples(comm: Comm, route: Route, samples: list, blobs: list) -> dict:
    """``{global id: sample}`` of every sample this rank's micro-batches hold: its own as they are, the
    others' decoded from one all-to-all (each rank sends each other rank what that one needs)."""
    me, base = comm.rank, int(route.offsets[comm.rank])
    send = [[] if d == me else [blobs[i] for i in (route.sends(me, d) - base).tolist()]
            for d in range(comm.world_size)]
    incoming = [route.sends(s, me) for s in range(comm.world_size)]
    sizes = route.sizes
    receive = [np.zeros(0, np.int64) if s == me else sizes[ids] for s, ids in enumerate(incoming)]
    held = {int(g): samples[int(g) - base] for g in incoming[me].tolist()}
    for s, items in enumerate(exchange_blobs(comm, send, receive)):
        held.update((int(g), decode_sample(item)) for g, item in zip(incoming[s].tolist(), items))
    return held


def _build_batches(route: Route, rank: int, held: dict, layout: BatchLayout, build_kwargs: dict,
                   share: tuple | None = None) -> list[ThdBatch]:
    """This rank's micro-batches, built from ``held`` (``{global id: sample}``) in the route's order."""
    ids, bounds, filler = route.batch_ids[rank], route.batch_bounds[rank], route.filler[rank]
    batches = []
    for k, is_filler in enumerate(filler.tolist()):
        part = ids[bounds[k] : bounds[k + 1]]
        samples = [held[g] for g in part.tolist()]
        if share is not None:
            samples = _as_planned(samples, part, route, share[0])
        try:
            if not is_filler:
                batches.append(build_thd_batch(samples, sample_index=part, **layout.keywords(), **build_kwargs))
                continue
            with warnings.catch_warnings():  # a filler has no targets by design
                warnings.simplefilter("ignore")
                masked = [_without_targets(s, layout.ignore_index) for s in samples]
                batches.append(build_thd_batch(masked, sample_index=part, **layout.keywords(), **build_kwargs))
        except SampleError as exc:
            if exc.sample is None or not 0 <= exc.sample < part.size:
                raise
            g = int(part[exc.sample])
            owner = int(route.owner(np.array([g]))[0])
            raise exc.renamed(g - int(route.offsets[owner]), f" (local sample of rank {owner}, in micro-batch {k} "
                              f"of rank {rank})") from None
    return batches


def _as_planned(samples: list, part: np.ndarray, route: Route, field: str) -> list[dict]:
    """``samples`` (global ids ``part``) with ``field`` their global group number (two ranks' group 3 are
    two groups) and, where the plan counted a one-level prefix, :data:`PREFIX_FIELD` that prefix, so that the
    build lays out what was planned (a group's part in one of its packs could have a longer common prefix of
    another size). A text group whole in this pack was planned as its build lays it out (a trie where that is
    fewer slots: :func:`thdpack.batching.shared_prefix.group_shares`): nothing is declared, the build finds it."""
    gid = route.groups[part]
    if not isinstance(route.prefix, SharedLayout):  # VLM: one level, declared
        return [{**s, field: g, PREFIX_FIELD: p} for s, g, p in zip(samples, gid.tolist(), route.prefix[part].tolist())]
    here = np.unique(gid, return_counts=True)
    whole = dict(zip(here[0].tolist(), (here[1] == np.bincount(route.groups)[here[0]]).tolist()))
    prefix = route.prefix.prefix[part].tolist()
    return [{**s, field: g} if whole[g] else {**s, field: g, PREFIX_FIELD: p}
            for s, g, p in zip(samples, gid.tolist(), prefix)]


def _without_targets(sample: Mapping, ignore_index: int) -> dict:
    """``sample`` with every label ``ignore_index`` (a filler's copy scores nothing)."""
    n = to_int_array(get_field(sample, "input_ids", 0, required=True), sample=0, field="input_ids").size
    return {**sample, "labels": np.full(n, ignore_index, np.int64)}


class RebalanceHandle:
    """What :func:`rebalance` did on this rank, and the way back for per-sample results.

    Attributes:
        rank, world_size: this rank in the rebalance's group, and the group's size.
        offsets: int64 ``[R+1]``: rank ``r``'s local sample ``i`` is global sample ``offsets[r] + i``.
        sample_ids: int64 ``[m]`` global ids of the samples of this rank's ``batches``, in order
            (each batch's ``sample_index``, concatenated; fillers included).
        batch_sizes: int64 ``[b]`` samples per micro-batch.
        filler: bool ``[b]``: micro-batch ``k`` only fills a repeated slot (no targets; its values
            are dropped by :meth:`restore`).
        plan: the :class:`thdpack.planning.BalancedPlan` every rank computed (global sample ids).
        options: the :class:`thdpack.planning.PlanOptions` it was planned with (``align``: the layout's multiple).
        rank_costs: float64 ``[R]`` every rank's cost of its micro-batches under the call's cost model.
        straggler: ``max / mean`` of ``rank_costs`` (1.0 is perfect balance).
        straggler_bound: the least ``straggler`` any plan of these samples (and groups) on these ranks,
            with as many micro-batches of ``pack_size`` and as much work in all, could reach: ``max(1,
            floor / mean)``, ``floor`` the largest of the mean (fillers counted), the costliest sample or group
            with a sample in each of its rank's other micro-batches, and the pigeonhole of many samples on few
            ranks (``plan.rank_floor``, :mod:`thdpack.planning.rank_fill`). Never above ``straggler``; a
            ``straggler`` close to it is as balanced as the samples allow.
    """

    def __init__(self, comm: Comm, route: Route, options: PlanOptions, cost: CostModel):
        self._comm, self._route = comm, route
        self.rank, self.world_size = comm.rank, comm.world_size
        self.offsets = route.offsets
        self.plan = route.plan
        self.sample_ids = route.batch_ids[comm.rank]
        self.batch_sizes = np.diff(route.batch_bounds[comm.rank])
        self.filler = route.filler[comm.rank]
        self.options = options
        self.rank_costs = route.rank_costs(route.lengths, cost)
        mean = self.rank_costs.mean() if self.rank_costs.size else 0.0
        self.straggler = float(self.rank_costs.max() / mean) if mean > 0 else 1.0
        self.straggler_bound = straggler_bound(route.plan.rank_floor, self.rank_costs)
        real = np.repeat(~self.filler, self.batch_sizes)
        self._real = np.flatnonzero(real)
        real_ids = self.sample_ids[real]
        self._send_order = np.argsort(real_ids, kind="stable")  # to each origin rank, its samples by id
        self._send_counts = np.bincount(route.owner(real_ids), minlength=self.world_size)
        mine = np.arange(route.offsets[self.rank], route.offsets[self.rank + 1])
        runner = route.runner[mine]
        self._receive_order = np.argsort(runner, kind="stable")  # from each runner, my samples by id
        self._receive_counts = np.bincount(runner, minlength=self.world_size)

    @property
    def num_local_samples(self) -> int:
        """Samples this rank gave to :func:`rebalance` (what :meth:`restore` returns one value for)."""
        return int(self._receive_order.size)

    def restore(self, values):
        """One value per sample of this rank's ``batches`` in, one per sample of its ``local_samples`` out.

        A collective: call it on every rank of the group. ``values``: a tensor ``[m, ...]`` (any
        dtype and device; the same dtype and trailing shape on every rank; detached), a numpy array,
        or a list of picklable objects, in the order of the batches' samples, concatenated: ``m`` is
        ``sample_ids.size`` (fillers' values included, then dropped) or the number of non-filler
        samples. Returns the same kind, ``[num_local_samples, ...]``, in ``local_samples``' order.
        """
        if isinstance(values, np.ndarray):
            return self.restore(torch.from_numpy(values)).numpy()
        if isinstance(values, torch.Tensor):
            rows = self._real_rows(values, values.shape[0] if values.dim() else None)
            order = torch.as_tensor(self._send_order, device=rows.device)
            received = exchange_rows(self._comm, rows[order], self._send_counts, self._receive_counts)
            out = torch.empty_like(received)
            out[torch.as_tensor(self._receive_order, device=out.device)] = received
            return out
        if isinstance(values, (list, tuple)):
            rows = self._real_rows(list(values), len(values))
            received = exchange_objects(self._comm, [rows[i] for i in self._send_order.tolist()], self._send_counts,
                                        self._receive_counts)
            out = [None] * len(received)
            for j, i in enumerate(self._receive_order.tolist()):
                out[i] = received[j]
            return out
        raise TypeError("restore takes a tensor, numpy array or list of per-sample values, got "
                        f"{type(values).__name__}")

    def _real_rows(self, values, m):
        """``values`` without the fillers' rows; ``ValueError`` unless ``m`` is one of the two accepted counts."""
        total, real = int(self.sample_ids.size), int(self._real.size)
        if m not in (total, real):
            expected = f"{total}" if total == real else f"{total} (or {real} without the {int(self.filler.sum())} " \
                                                        "filler micro-batches)"
            raise ValueError(f"restore got {'a 0-d tensor' if m is None else m} values on rank {self.rank}; expected "
                             f"one per sample of its batches, {expected}")
        if m == real or total == real:
            return values
        if isinstance(values, list):
            return [values[i] for i in self._real.tolist()]
        return values[torch.as_tensor(self._real, device=values.device)]

    def __repr__(self) -> str:
        return (f"RebalanceHandle(rank={self.rank}, world_size={self.world_size}, micro_batches={self.filler.size}, "
                f"samples={self.sample_ids.size}, fillers={int(self.filler.sum())}, straggler={self.straggler:.4f}, "
                f"straggler_bound={self.straggler_bound:.4f})")


class StepsHandle(RebalanceHandle):
    """:class:`RebalanceHandle` of :func:`rebalance_steps`, with the step's plan and FLOPs statistics.

    Attributes (besides :class:`RebalanceHandle`'s):
        steps: the :class:`thdpack.planning.pipeline_parallel.steps.StepPlan` every rank computed (global sample ids;
            ``steps.micro_batches[rank]`` are the sample ids of that rank's batches).
        num_micro_batches: ``m``, the same on every rank: megatron-core's ``num_microbatches`` for the step.
        seqlen_sums: ``(Σ sᵢ, Σ sᵢ²)`` (Python ints) of the real lengths this rank runs (fillers included):
            what :mod:`thdpack.flops` turns into this rank's model FLOPs.
        global_seqlen_sums: the same over every rank of the group (the step's global batch).
    """

    def __init__(self, comm: Comm, route: Route, options: PlanOptions, cost: CostModel):
        super().__init__(comm, route, options, cost)
        self.steps = route.steps
        self.num_micro_batches = route.steps.num_micro_batches
        tokens, squares = route.steps.seqlen_sums
        self.seqlen_sums = (int(tokens[comm.rank]), int(squares[comm.rank]))
        self.global_seqlen_sums = (int(tokens.sum()), int(squares.sum()))

    def __repr__(self) -> str:
        return (f"StepsHandle(rank={self.rank}, world_size={self.world_size}, num_micro_batches="
                f"{self.num_micro_batches}, samples={self.sample_ids.size}, fillers={int(self.filler.sum())}, "
                f"step_time={self.steps.step_time:.4g}, step_time_bound={self.steps.step_time_bound:.4g})")
