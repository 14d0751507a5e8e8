"""Pipeline-parallel schedules simulated exactly: Megatron-core's 1F1B and interleaved 1F1B, op by op.

A data-parallel rank's step under pipeline parallelism (``P`` stages, ``V`` model chunks per stage) runs
its ``m`` micro-batches through every stage forward, then backward. Each stage runs its ops in the order
megatron-core's schedule gives it (``forward_backward_pipelining_without_interleaving`` for ``V = 1``,
``..._with_interleaving`` and its ``get_schedule_table`` for ``V > 1``): ``W`` warm-up forwards, then one
forward and one backward in turn, then the cool-down backwards. An op starts when its stage is free and
its input is there (the previous virtual stage's forward of the same micro-batch, or the next virtual
stage's backward), and sends cost nothing: a dataflow model of the schedule, so that the step time of a
given order of micro-batches is exact under the model (no sampling, no approximation)::

    P = 2, m = 3, costs 3, 3, 3 (forward 0.5 per stage, backward 1.0)
    stage 0: F0 F1 .  B0 F2 B1 .  B2          warm-up P - 1 - s forwards, then 1F1B, then cool-down
    stage 1: .  F0 B0 F1 B1 F2 B2

Cost of a micro-batch ``c`` (any unit: :class:`thdpack.CostModel`'s, forward and backward of the whole
model): its forward on one chunk of one stage takes ``c / ((1 + r)·P·V)`` and its backward ``r`` times that
(``r``: ``backward_ratio``, 2 by default). The layers are assumed split evenly over the ``P·V`` chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from thdpack.common.align import check_number, check_positive_int
from thdpack.common.jit import njit

FORWARD, BACKWARD = 0, 1


@dataclass(frozen=True)
class PipelineShape:
    """How a data-parallel rank's model is split: ``pp_size`` stages of ``vpp_size`` model chunks each.

    ``vpp_group``: megatron-core's ``microbatch_group_size_per_vp_stage`` (micro-batches run on one chunk
    before the next chunk; None: its default, ``pp_size``). Interleaving (``vpp_size > 1``) needs
    ``pp_size >= 2`` and ``vpp_group >= pp_size`` (megatron-core refuses a smaller group), and the number of
    micro-batches of a step a multiple of ``vpp_group`` (:meth:`micro_batch_multiple`)."""

    pp_size: int = 1
    vpp_size: int = 1
    vpp_group: int | None = None

    def __post_init__(self):
        check_positive_int(self.pp_size, "pp_size")
        check_positive_int(self.vpp_size, "vpp_size")
        if self.vpp_group is not None:
            check_positive_int(self.vpp_group, "vpp_group")
        if self.vpp_size > 1:
            if self.pp_size < 2:
                raise ValueError(f"vpp_size={self.vpp_size} interleaves model chunks over pipeline stages: it needs "
                                 f"pp_size >= 2, got pp_size={self.pp_size}")
            if self.group < self.pp_size:
                raise ValueError(f"vpp_group={self.vpp_group} (megatron-core's microbatch_group_size_per_vp_stage) "
                                 f"must be at least pp_size={self.pp_size}; megatron-core refuses a smaller group")

    @property
    def group(self) -> int:
        """Micro-batches run on one model chunk before the next (``vpp_group``, or ``pp_size``)."""
        return self.pp_size if self.vpp_group is None else int(self.vpp_group)

    def micro_batch_multiple(self) -> int:
        """What a step's micro-batch count must be a multiple of: ``vpp_group`` with interleaving, else 1."""
        return self.group if self.vpp_size > 1 else 1


def stage_ops(shape: PipelineShape, num_micro_batches: int) -> list[np.ndarray]:
    """Every stage's ops in megatron-core's order: per stage, int64 ``[2·m·V, 3]`` rows ``(kind, micro-batch,
    chunk)``, ``kind`` :data:`FORWARD` (0) or :data:`BACKWARD` (1)."""
    check_positive_int(num_micro_batches, "num_micro_batches")
    m, p, v = int(num_micro_batches), shape.pp_size, shape.vpp_size
    table = _schedule_table(m, v, shape.group)  # [m·V, 2] (micro-batch, chunk) of virtual micro-batch k
    total = m * v
    out = []
    for s in range(p):
        if p == 1:
            warmup = 0
        elif v == 1:
            warmup = min(p - s - 1, total)
        else:
            warmup = min((p - s - 1) * 2 + (v - 1) * shape.group, total)
        ops = []
        forward = lambda k: (FORWARD, int(table[k, 0]), int(table[k, 1]))
        backward = lambda k: (BACKWARD, int(table[k, 0]), v - 1 - int(table[k, 1]))
        ops.extend(forward(k) for k in range(warmup))
        for i in range(total - warmup):
            ops.append(forward(warmup + i))
            ops.append(backward(i))
        ops.extend(backward(k) for k in range(total - warmup, total))
        out.append(np.array(ops, np.int64).reshape(-1, 3))
    return out


def _schedule_table(m: int, v: int, group: int) -> np.ndarray:
    """int64 ``[m·V, 2]``: the ``(micro-batch, chunk)`` of each virtual micro-batch: groups of ``group``
    micro-batches run on chunk 0, then chunk 1, ...; the last group takes what is left."""
    if v == 1:
        return np.stack([np.arange(m), np.zeros(m, np.int64)], axis=1).astype(np.int64)
    rows = []
    for lo in range(0, m, group):
        hi = m if lo + group >= m else lo + group
        rows.extend((j, c) for c in range(v) for j in range(lo, hi))
    return np.array(rows, np.int64)


@dataclass(frozen=True)
class PipelineTimeline:
    """One rank's step, simulated (times in the unit of the costs).

    Attributes:
        ops: per stage, int64 ``[2·m·V, 3]`` ``(kind, micro-batch, chunk)`` in run order (:func:`stage_ops`).
        start, end: per stage, float64 ``[2·m·V]`` when each op starts and ends.
        step_time: when the last op of any stage ends (the step starts at 0).
        busy: float64 ``[P]`` each stage's compute time.
    """

    ops: list
    start: list
    end: list
    step_time: float
    busy: np.ndarray

    @property
    def bubble_fraction(self) -> float:
        """The share of the stages' time spent waiting: ``1 − mean(busy) / step_time``."""
        return float(1.0 - self.busy.mean() / self.step_time) if self.step_time > 0 else 0.0


def simulate_pipeline(costs, shape: PipelineShape = PipelineShape(), *, backward_ratio: float = 2.0) -> PipelineTimeline:
    """Simulate one rank's step: float ``[m]`` ``costs`` of its micro-batches, in run order (module docstring)."""
    durations, ops = _prepare(costs, shape, backward_ratio)
    start, end = _run(ops, durations, durations.shape[1], shape.pp_size, shape.vpp_size)
    busy = (end - start).sum(axis=1)
    return PipelineTimeline(ops=list(ops), start=list(start), end=list(end), step_time=float(end.max()), busy=busy)


def step_time(costs, shape: PipelineShape = PipelineShape(), *, backward_ratio: float = 2.0) -> float:
    """:attr:`PipelineTimeline.step_time` of :func:`simulate_pipeline` (the same simulation)."""
    durations, ops = _prepare(costs, shape, backward_ratio)
    _, end = _run(ops, durations, durations.shape[1], shape.pp_size, shape.vpp_size)
    return float(end.max())


def step_time_bound(rank_cost: float, cheapest: float, shape: PipelineShape, *, backward_ratio: float = 2.0) -> float:
    """A step time no order of micro-batches beats on a rank whose micro-batches cost ``rank_cost`` in all, each
    at least ``cheapest``: the last stage computes ``rank_cost / P``, cannot start before the first micro-batch's
    forward crossed the ``P − 1`` stages before it, and the last backward crosses them after it:
    ``rank_cost / P + (P − 1)·cheapest / (P·V)``."""
    del backward_ratio  # forward + backward of one chunk is c / (P·V) whatever the ratio
    p, v = shape.pp_size, shape.vpp_size
    return float(rank_cost) / p + (p - 1) * float(cheapest) / (p * v)


def _prepare(costs, shape: PipelineShape, backward_ratio: float):
    check_number(backward_ratio, "backward_ratio", positive=True)
    c = np.asarray(costs, np.float64)
    if c.ndim != 1 or c.size == 0 or not np.isfinite(c).all() or (c < 0).any():
        raise ValueError(f"costs must be a non-empty 1-d array of finite costs >= 0, one per micro-batch; got {c!r}")
    forward = c / ((1.0 + float(backward_ratio)) * shape.pp_size * shape.vpp_size)
    return np.stack([forward, forward * float(backward_ratio)]), _stacked_ops(shape, c.size)


@lru_cache(maxsize=64)
def _stacked_ops(shape: PipelineShape, m: int) -> np.ndarray:
    """int64 ``[P, 2·m·V, 3]`` :func:`stage_ops`, stacked (read-only, cached: the order search simulates one
    shape and count many times)."""
    ops = np.stack(stage_ops(shape, m))
    ops.flags.writeable = False
    return ops


@njit
def _run(ops, durations, m, p, v):
    """start, end float64 ``[P, 2·m·V]`` of int64 ``ops`` ``[P, 2·m·V, 3]`` (:func:`stage_ops`) with float64
    ``durations`` ``[2, m]`` (forward, backward of one chunk on one stage)."""
    n = ops.shape[1]
    start = np.zeros((p, n))
    end = np.zeros((p, n))
    done_f = np.full((m, v, p), -1.0)
    done_b = np.full((m, v, p), -1.0)
    nxt = np.zeros(p, np.int64)
    free = np.zeros(p)
    remaining = p * n
    while remaining > 0:
        progressed = False
        for s in range(p):
            while nxt[s] < n:
                k = nxt[s]
                kind, j, c = ops[s, k, 0], ops[s, k, 1], ops[s, k, 2]
                if kind == 0:
                    if s > 0:
                        ready = done_f[j, c, s - 1]
                    elif c > 0:
                        ready = done_f[j, c - 1, p - 1]
                    else:
                        ready = 0.0
                else:
                    if s < p - 1:
                        ready = done_b[j, c, s + 1]
                    elif c < v - 1:
                        ready = done_b[j, c + 1, 0]
                    else:
                        ready = done_f[j, c, s]
                if ready < 0.0:
                    break
                t0 = max(free[s], ready)
                t1 = t0 + durations[kind, j]
                start[s, k] = t0
                end[s, k] = t1
                free[s] = t1
                if kind == 0:
                    done_f[j, c, s] = t1
                else:
                    done_b[j, c, s] = t1
                nxt[s] = k + 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked; this is a bug in thdpack")
    return start, end
