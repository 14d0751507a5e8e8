"""A batch sampler whose batches are packs: one planned pack per step and rank."""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

from thdpack.common.align import check_bool, check_int, check_positive_int, integer_array
from thdpack.planning.balance import BalancedPlan, CostModel, plan_balanced
from thdpack.planning.options import plan_options
from thdpack.planning.plan import PackPlan, plan_packs, validate_lengths


def distributed_default(num_replicas, rank) -> tuple[int, int]:
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    check_positive_int(num_replicas, "num_replicas")
    check_int(rank, "rank", 0, below=num_replicas)
    return int(num_replicas), int(rank)


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Yields, per step, the dataset indices of one pack of at most ``pack_size`` tokens.

    Each epoch the packs are planned with :func:`thdpack.plan_packs` (seeded by
    ``seed + epoch``) and, with ``shuffle=True``, visited in a seeded random order.
    Packs are dealt to data-parallel ranks round-robin; every rank gets the same
    number of steps (``drop_last=True`` drops the remainder, otherwise the first
    packs of the epoch are repeated to fill the last step).

    Pair it with a :class:`thdpack.ThdCollator`; with ``overflow="truncate"`` give
    the collator ``max_length=pack_size`` (it cuts rows where the plan did,
    ``sampler.max_length`` tokens, once alignment is accounted for): ``DataLoader(ds, batch_sampler=sampler, collate_fn=ThdCollator(...))``.
    A DataLoader hands the collator the rows, not their indices: draw from
    ``thdpack.IndexedDataset(ds)`` for batches whose ``sample_index`` are the dataset
    rows (otherwise their positions in the pack, ``0..n-1``).

    Resuming (``state_dict(consumed=k)``, ``load_state_dict()``): docs/resume.md, "TokenBudgetBatchSampler:
    where to save the position".

    Args (in full: docs/loaders.md, "TokenBudgetBatchSampler: arguments"):
        lengths: ``[n]`` token count of every dataset row.
        pack_size, **plan_keywords: the planning keywords, as in :func:`thdpack.plan_packs`
            (``overflow="split"`` is not available); epoch e is planned with ``seed + e``.
        shuffle, num_replicas, rank, drop_last: seeded pack order; the data-parallel world; drop partial steps.
        balance, micro_batches, cost: ``"compute"``: equal rank costs per step, ``micro_batches`` packs each.
        vision_lengths, groups, shared_prefix: ``[n]`` vision patches, group ids and shared prefixes per row.

    Attributes:
        options: the :class:`~thdpack.planning.options.PlanOptions` every epoch is planned with (its ``seed`` plus the epoch).
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        pack_size: int | None = None,
        *,
        shuffle: bool = True,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
        balance: str | None = None,
        micro_batches: int = 1,
        cost: CostModel | tuple[float, float] = CostModel(),
        vision_lengths: Sequence[int] | np.ndarray | None = None,
        groups: Sequence[int] | np.ndarray | None = None,
        shared_prefix: Sequence[int] | np.ndarray | None = None,
        **plan_keywords,
    ):
        if balance not in (None, "compute"):
            raise ValueError(f"balance must be None or 'compute', got {balance!r}")
        self.options = plan_options("TokenBudgetBatchSampler", {"pack_size": pack_size, **plan_keywords})
        if self.options.overflow == "split":
            raise ValueError(
                "TokenBudgetBatchSampler yields whole dataset rows, so overflow='split' is not possible here; "
                "use 'truncate' (with ThdCollator(max_length=pack_size)), 'drop', or split rows offline"
            )
        self.lengths = validate_lengths(lengths)
        with_vision = self.options.vision_budget is not None  # vision_lengths alone are not planned with
        self.vision_lengths = None
        if with_vision and vision_lengths is not None:  # integers: never rounded to them
            self.vision_lengths = integer_array(vision_lengths, "vision_lengths").astype(np.int64)
        self.groups = None if groups is None else np.asarray(groups)  # e.g. a preference pair's rows share a pack
        self.shared_prefix = None if shared_prefix is None else np.asarray(shared_prefix)
        self.shuffle = check_bool(shuffle, "shuffle")
        self.seed = int(self.options.seed)
        self.num_replicas, self.rank = distributed_default(num_replicas, rank)
        self.drop_last = check_bool(drop_last, "drop_last")
        self.balance = balance
        check_positive_int(micro_batches, "micro_batches")
        self.micro_batches = micro_batches
        self.cost = CostModel.of(cost)
        self.epoch = 0
        self._step = 0  # position: the next pack is step `_step` of `epoch` (== len: the epoch is used up)
        self._pass = 0  # id of the newest pass; older passes no longer move the position
        self._pass_start = (0, 0)
        self._cached: tuple[int, PackPlan, np.ndarray, BalancedPlan | None] | None = None
        self._plan_for_epoch(0)  # validate now: errors surface at construction, not in the loop

    @property
    def pack_size(self) -> int:
        """The token budget of a pack (``options.pack_size``)."""
        return self.options.pack_size

    @property
    def max_length(self) -> int:
        """Longest row the plan keeps whole: ``pack_size`` rounded down to ``align``
        (what a collator must truncate to with ``overflow="truncate"``)."""
        return self.options.usable_length

    # ---- planning -------------------------------------------------------
    def _plan_for_epoch(self, epoch: int) -> tuple[PackPlan, np.ndarray]:
        """The epoch's plan and this rank's pack ids in the order it runs them."""
        if self._cached is None or self._cached[0] != epoch:
            options = replace(self.options, seed=self.seed + epoch)
            per_row = dict(vision_lengths=self.vision_lengths, groups=self.groups, shared_prefix=self.shared_prefix)
            balanced = None
            if self.balance == "compute":
                balanced = plan_balanced(
                    self.lengths, num_replicas=self.num_replicas, micro_batches=self.micro_batches, cost=self.cost,
                    shuffle_steps=self.shuffle, **options.keywords(), **per_row,
                )
                plan = balanced.plan
                schedules = balanced.steps.transpose(1, 0, 2).reshape(self.num_replicas, -1)
            else:
                plan = plan_packs(self.lengths, **options.keywords(), **per_row)
                order = np.arange(len(plan))
                if self.shuffle:
                    order = np.random.default_rng([self.seed, epoch]).permutation(len(plan))
                if len(plan) < self.num_replicas and self.drop_last:
                    message = f"epoch {epoch}: only {len(plan)} packs for {self.num_replicas} replicas with drop_last=True"
                    if epoch == 0 and self._cached is None:
                        raise ValueError(message)
                    warnings.warn(message + "; the epoch has no steps")
                steps = len(plan) // self.num_replicas if self.drop_last else -(-len(plan) // self.num_replicas)
                # round-robin; without drop_last the first packs are repeated to fill the last step
                ranks = np.arange(self.num_replicas)[:, None]
                schedules = order[(np.arange(steps)[None, :] * self.num_replicas + ranks) % max(len(plan), 1)]
            self._cached = (epoch, plan, schedules, balanced)
        return self._cached[1], self._cached[2][self.rank]

    def plan(self, epoch: int | None = None) -> PackPlan:
        """The pack plan of ``epoch`` (default: the current one)."""
        return self._plan_for_epoch(self.epoch if epoch is None else epoch)[0]

    def balanced_plan(self, epoch: int | None = None) -> BalancedPlan | None:
        """With ``balance="compute"``, the :class:`thdpack.planning.BalancedPlan` of ``epoch`` (default: the current
        one), whose ``straggler`` over the epoch's ranks stands beside ``straggler_bound``; None without."""
        self._plan_for_epoch(self.epoch if epoch is None else epoch)
        return self._cached[3]

    def __len__(self) -> int:
        return len(self._plan_for_epoch(self.epoch)[1])

    # ---- loss normalisers -------------------------------------------------
    @property
    def num_optimizer_steps(self) -> int:
        """Optimizer steps in the current epoch: ``ceil(len(self) / micro_batches)``."""
        return self.num_optimizer_steps_of(self.epoch)

    def step_items(self, step: int, targets: Sequence[int] | np.ndarray | None = None, *,
                   epoch: int | None = None) -> "StepItems":
        """What optimizer step ``step`` of ``epoch`` (default: the current one) will train, on
        every rank, known before it runs: the normaliser ``num_items`` of
        :func:`thdpack.losses.packed_loss`.

        An optimizer step is ``micro_batches`` consecutive packs of each rank (with
        ``balance="compute"`` exactly the planned step; without it, the gradient-accumulation
        group of sampler steps ``[step·M, (step+1)·M)``; the last one may be shorter).

        Args:
            step: optimizer step index, in ``[0, num_optimizer_steps)``.
            targets: ``[n]`` target tokens of every dataset row as the collator builds it
                (``labels != -100`` after the shift, e.g. completion tokens only); default:
                every token of the row's planned piece but its last (plain language modelling).
                With ``overflow="truncate"``, give the counts of the truncated rows.
            epoch: the epoch (default: the sampler's current one).

        Returns:
            A :class:`StepItems` with global and per-rank totals (rows with no target count
            as no sample).
        """
        epoch = self.epoch if epoch is None else epoch
        check_int(epoch, "epoch", 0)
        check_int(step, "step", 0)
        num_steps = self.num_optimizer_steps_of(int(epoch))
        plan, schedules = self._plan_for_epoch(int(epoch))[0], self._cached[2]
        if step >= num_steps:
            raise ValueError(
                f"step={step} is outside epoch {epoch} of {num_steps} optimizer steps ({schedules.shape[1]} packs "
                f"per rank, micro_batches={self.micro_batches}); pass a step in [0, {num_steps})"
            )
        per_piece = self._piece_targets(plan, targets)
        packs = schedules[:, step * self.micro_batches : (step + 1) * self.micro_batches]  # [R, <=M] pack ids
        rank_targets = np.zeros(self.num_replicas, np.int64)
        rank_samples = np.zeros(self.num_replicas, np.int64)
        for r in range(self.num_replicas):
            for k in packs[r].tolist():
                counts = per_piece[plan.pack_offsets[k] : plan.pack_offsets[k + 1]]
                rank_targets[r] += int(counts.sum())
                rank_samples[r] += int((counts > 0).sum())
        return StepItems(int(rank_targets.sum()), int(rank_samples.sum()), rank_targets, rank_samples)

    def num_optimizer_steps_of(self, epoch: int) -> int:
        """Optimizer steps in ``epoch``: ``ceil(packs per rank / micro_batches)``."""
        return -(-len(self._plan_for_epoch(epoch)[1]) // self.micro_batches)

    def _piece_targets(self, plan: PackPlan, targets) -> np.ndarray:
        """int64 ``[m]`` target tokens of every planned piece."""
        if targets is None:
            return plan.length - 1
        arr = np.asarray(targets)
        if arr.shape != self.lengths.shape or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(
                f"targets must be integers with one entry per dataset row ({self.lengths.size}), got shape "
                f"{arr.shape} and dtype {arr.dtype}; pass each row's number of target tokens"
            )
        bad = np.flatnonzero((arr < 0) | (arr >= np.maximum(self.lengths, 1)))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"targets[{i}] = {int(arr[i])} but row {i} has {int(self.lengths[i])} tokens; a row has at most "
                "length - 1 targets (its last token predicts nothing)"
            )
        return arr.astype(np.int64)[plan.sample_index]

    def __iter__(self) -> Iterator[list[int]]:
        """One pass: the rest of the current epoch (nothing if it is used up), after
        which the sampler moves to the next epoch. The pass moves the sampler's
        position as it draws packs."""
        self._pass += 1
        self._pass_start = (self.epoch, self._step)
        return self._run_pass(self._pass, self.epoch, self._step)

    def _run_pass(self, pass_id: int, epoch: int, start: int) -> Iterator[list[int]]:
        plan, schedule = self._plan_for_epoch(epoch)
        for step in range(start, len(schedule)):
            if pass_id == self._pass:  # a newer pass, set_epoch or load_state_dict detached this one
                self._step = step + 1
            yield plan.pack(int(schedule[step])).tolist()
        if pass_id == self._pass:
            self.epoch, self._step = epoch + 1, 0

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first step (as ``DistributedSampler.set_epoch``).
        Not needed between epochs (a pass moves on by itself) and not after
        :meth:`load_state_dict` (it would discard the resumed position)."""
        check_int(epoch, "epoch", 0)
        self._move_to(int(epoch), 0)

    def _move_to(self, epoch: int, step: int) -> None:
        """Set the position (the next pack is step ``step`` of ``epoch``) and detach
        any live pass from it."""
        self.epoch, self._step = epoch, step
        self._pass += 1
        self._pass_start = (epoch, step)

    # ---- resume ---------------------------------------------------------
    def _planned_with(self) -> dict:
        """The planning settings a state is fingerprinted with (the seed is saved apart): the
        options but pack_size and seed, and the per-row vision patches and groups planned with."""
        o = self.options
        settings = dict(algorithm=o.algorithm, align=o.align, overflow=o.overflow,
                        max_samples_per_pack=o.max_samples_per_pack)
        if self.vision_lengths is not None:
            settings.update(vision_lengths=self.vision_lengths, vision_budget=o.vision_budget)
        if self.groups is not None:
            settings.update(groups=self.groups)
        return settings

    def _fingerprint(self) -> str:
        h = hashlib.sha1(self.lengths.tobytes())
        kwargs = {k: (v.tobytes() if isinstance(v, np.ndarray) else v) for k, v in self._planned_with().items()}
        settings = (self.pack_size, sorted(kwargs.items()), self.shuffle, self.num_replicas, self.drop_last,
                    self.balance, self.micro_batches, self.cost)
        h.update(repr(settings).encode())
        return h.hexdigest()

    def state_dict(self, consumed: int | None = None) -> dict:
        """``{"epoch", "step", "seed", "fingerprint"}``: where the next pack comes from.

        Without arguments: the position after the last pack this sampler handed out,
        exact only when nothing was prefetched (``num_workers=0``) or when
        ``StatefulDataLoader`` takes the state (it does so as each batch is drawn).

        Args:
            consumed: batches the training loop took from the current pass (the
                current ``for batch in loader``); exact with any number of workers,
                persistent or not, as a loader's prefetching runs ahead of training.
        """
        epoch, step = self._consumed_position(consumed)
        return {"epoch": epoch, "step": step, "seed": self.seed, "fingerprint": self._fingerprint()}

    def _consumed_position(self, consumed: int | None) -> tuple[int, int]:
        """``(epoch, step)`` after ``consumed`` batches of the current pass (None: after the last one drawn)."""
        if consumed is None:
            return self.epoch, self._step
        epoch, start = self._pass_start
        steps = len(self._plan_for_epoch(epoch)[1])
        check_int(consumed, "consumed", 0)
        drawn = self._step - start if self.epoch == epoch else steps - start
        if consumed > drawn:
            raise ValueError(
                f"consumed={consumed}, but the current pass over epoch {epoch} (from step {start}) has only "
                f"{drawn} drawn; pass the number of batches the loop took from the current `for batch in loader`"
            )
        return epoch, start + int(consumed)

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: the passes that follow yield exactly the packs an
        uninterrupted run would yield next (from a state at the end of an epoch, one
        empty pass, as the uninterrupted run's loop ends there too).

        Raises:
            ValueError: ``state`` is not such a dict, lacks a key, holds a negative or
                non-integer epoch/step, a step past its epoch, or comes from a
                sampler over other lengths or with other settings.
        """
        epoch, step = _checked_state(state, self._fingerprint())
        kept = self.seed, self._cached
        self.seed, self._cached = int(state["seed"]), None
        try:
            self._check_step(epoch, step)
        except ValueError:
            self.seed, self._cached = kept
            raise
        self._move_to(epoch, step)

    def _check_step(self, epoch: int, step: int) -> None:
        steps = len(self._plan_for_epoch(epoch)[1])
        if step > steps:
            raise ValueError(f"step {step} is outside epoch {epoch} of {steps} steps; pass a step in [0, {steps}]")


@dataclass(frozen=True, eq=False)
class StepItems:
    """What one optimizer step trains, from :meth:`TokenBudgetBatchSampler.step_items`.

    Attributes:
        targets: target tokens of the step over all micro-batches of all ranks (the
            ``num_items`` of ``packed_loss(reduction="token")``; HF's ``num_items_in_batch``).
        samples: samples with at least one target, over all micro-batches and ranks (the
            ``num_items`` of ``packed_loss(reduction="sample")``).
        rank_targets, rank_samples: int64 ``[num_replicas]`` the same per data-parallel rank.
    """

    targets: int
    samples: int
    rank_targets: np.ndarray
    rank_samples: np.ndarray

    def num_items(self, reduction: str) -> int:
        """The global normaliser of ``reduction`` (``"token"`` or ``"sample"``)."""
        if reduction not in ("token", "sample"):
            raise ValueError(f"reduction must be 'token' or 'sample', got {reduction!r}")
        return self.targets if reduction == "token" else self.samples


_STATE_KEYS = ("epoch", "step", "seed", "fingerprint")


def _checked_state(state, fingerprint: str) -> tuple[int, int]:
    """``(epoch, step)`` of a sampler state, after checking its keys, types and fingerprint."""
    check_state_dict(state, _STATE_KEYS, "TokenBudgetBatchSampler", _check_position)
    if state["fingerprint"] != fingerprint:
        raise ValueError(
            "state_dict was saved by a sampler over other lengths or with other settings; resume with the same "
            "lengths, pack_size, algorithm, align, overflow, shuffle, num_replicas, drop_last and balance"
        )
    return int(state["epoch"]), int(state["step"])


def _check_position(state: dict) -> None:
    for key in ("epoch", "step", "seed"):
        check_int(state[key], f"state_dict[{key!r}]", 0)


def check_state_dict(state, keys: tuple[str, ...], owner: str, check_values: Callable[[dict], None]) -> None:
    """One ``ValueError`` naming the key if ``state`` is not a dict with ``keys`` whose
    values pass ``check_values``; ``owner`` is the class whose ``state_dict()`` made it."""
    unchanged = f"; pass the dict that {owner}.state_dict() returned, unchanged"
    if not isinstance(state, dict):
        raise ValueError(f"state_dict must be a dict, got {type(state).__name__}{unchanged}")
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"state_dict is missing key(s) {', '.join(map(repr, missing))}{unchanged}")
    try:
        check_values(state)
    except ValueError as exc:
        raise ValueError(f"{exc}{unchanged}") from None
