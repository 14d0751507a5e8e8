"""A batch sampler whose batches are packs: one planned pack per step and rank."""

from __future__ import annotations

import hashlib
import warnings
from typing import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

from thdpack.align import check_positive_int
from thdpack.balance import CostModel, plan_balanced
from thdpack.plan import PackPlan, plan_packs, validate_lengths


def _distributed_default(num_replicas, rank) -> tuple[int, int]:
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    check_positive_int(num_replicas, "num_replicas")
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be in [0, {num_replicas}), got {rank!r}")
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

    Resuming: ``state_dict()`` records the epoch and the number of steps this
    sampler has yielded in it; ``load_state_dict()`` continues with exactly the
    packs an uninterrupted run would yield next. A DataLoader with workers
    prefetches batches ahead of training; pass the trainer's own step count as
    ``state_dict(step=...)`` to resume exactly from what was consumed.

    Args:
        lengths: ``[n]`` token count of every dataset row.
        pack_size, algorithm, align, overflow, max_samples_per_pack: see
            :func:`thdpack.plan_packs` (``overflow="split"`` is not available here:
            a batch sampler yields whole rows).
        shuffle: visit packs in a seeded random order each epoch.
        seed: base seed; epoch e uses ``seed + e``.
        num_replicas, rank: data-parallel world; default from ``torch.distributed``.
        drop_last: drop the packs that do not fill a step on every rank.
        balance: ``None`` (deal packs round-robin) or ``"compute"``: plan with
            :func:`thdpack.balance.plan_balanced` so that in every step the
            ranks' costs (``cost``: ``a·Σs + b·Σs²``) are as equal as possible.
            Each step then gives every rank ``micro_batches`` consecutive packs.
        micro_batches: packs per rank per optimizer step (used with ``balance``).
        cost: a :class:`thdpack.balance.CostModel` or ``(a, b)``.
        vision_lengths, vision_budget: VLM second budget: ``[n]`` vision patches
            per row (:func:`thdpack.vlm.vision_lengths`) and the most per pack.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        pack_size: int,
        *,
        algorithm: str = "bfd",
        align: int = 1,
        overflow: str = "error",
        max_samples_per_pack: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
        balance: str | None = None,
        micro_batches: int = 1,
        cost: CostModel | tuple[float, float] = CostModel(),
        vision_lengths: Sequence[int] | np.ndarray | None = None,
        vision_budget: int | None = None,
    ):
        if balance not in (None, "compute"):
            raise ValueError(f"balance must be None or 'compute', got {balance!r}")
        if overflow == "split":
            raise ValueError(
                "TokenBudgetBatchSampler yields whole dataset rows, so overflow='split' is not possible here; "
                "use 'truncate' (with ThdCollator(max_length=pack_size)), 'drop', or split rows offline"
            )
        self.lengths = validate_lengths(lengths)
        self.pack_size = pack_size
        self.plan_kwargs = dict(
            algorithm=algorithm, align=align, overflow=overflow, max_samples_per_pack=max_samples_per_pack
        )
        if vision_budget is not None:
            self.plan_kwargs.update(vision_lengths=np.asarray(vision_lengths, dtype=np.int64), vision_budget=vision_budget)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.num_replicas, self.rank = _distributed_default(num_replicas, rank)
        self.drop_last = drop_last
        self.balance = balance
        self.micro_batches = micro_batches
        self.cost = cost if isinstance(cost, CostModel) else CostModel(*cost)
        self.epoch = 0
        self._start_step = 0
        self._yielded = 0
        self._cached: tuple[int, PackPlan, np.ndarray] | None = None
        self._plan_for_epoch(0)  # validate now: errors surface at construction, not in the loop

    @property
    def max_length(self) -> int:
        """Longest row the plan keeps whole: ``pack_size`` rounded down to ``align``
        (what a collator must truncate to with ``overflow="truncate"``)."""
        align = self.plan_kwargs["align"]
        return self.pack_size // align * align

    # ---- planning -------------------------------------------------------
    def _plan_for_epoch(self, epoch: int) -> tuple[PackPlan, np.ndarray]:
        """The epoch's plan and this rank's pack ids in the order it runs them."""
        if self._cached is None or self._cached[0] != epoch:
            if self.balance == "compute":
                balanced = plan_balanced(
                    self.lengths, self.pack_size, num_replicas=self.num_replicas, micro_batches=self.micro_batches,
                    cost=self.cost, seed=self.seed + epoch, shuffle_steps=self.shuffle, **self.plan_kwargs,
                )
                plan, schedule = balanced.plan, balanced.rank_packs(self.rank).reshape(-1)
            else:
                plan = plan_packs(self.lengths, self.pack_size, seed=self.seed + epoch, **self.plan_kwargs)
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
                schedule = order[(np.arange(steps) * self.num_replicas + self.rank) % len(plan)]
            self._cached = (epoch, plan, schedule)
        return self._cached[1], self._cached[2]

    def plan(self, epoch: int | None = None) -> PackPlan:
        """The pack plan of ``epoch`` (default: the current one)."""
        return self._plan_for_epoch(self.epoch if epoch is None else epoch)[0]

    def __len__(self) -> int:
        return len(self._plan_for_epoch(self.epoch)[1])

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.epoch
        plan, schedule = self._plan_for_epoch(epoch)
        start, self._start_step = self._start_step, 0
        for step in range(start, len(schedule)):
            self._yielded = step + 1
            yield plan.pack(int(schedule[step])).tolist()
        if self.epoch == epoch:  # unless set_epoch was called meanwhile, move on
            self.epoch = epoch + 1
            self._yielded = 0

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first step (as ``DistributedSampler.set_epoch``)."""
        self.epoch = int(epoch)
        self._start_step = 0
        self._yielded = 0

    # ---- resume ---------------------------------------------------------
    def _fingerprint(self) -> str:
        h = hashlib.sha1(self.lengths.tobytes())
        kwargs = {k: (v.tobytes() if isinstance(v, np.ndarray) else v) for k, v in self.plan_kwargs.items()}
        settings = (self.pack_size, sorted(kwargs.items()), self.shuffle, self.num_replicas, self.drop_last,
                    self.balance, self.micro_batches, self.cost)
        h.update(repr(settings).encode())
        return h.hexdigest()

    def state_dict(self, step: int | None = None) -> dict:
        """``{"epoch", "step", "seed", "fingerprint"}``; ``step`` defaults to the
        number of batches this sampler has yielded in the current epoch."""
        return {
            "epoch": self.epoch,
            "step": self._yielded if step is None else int(step),
            "seed": self.seed,
            "fingerprint": self._fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: the next iteration yields the packs that follow it."""
        if state.get("fingerprint", self._fingerprint()) != self._fingerprint():
            raise ValueError("state_dict was saved by a sampler over other lengths or with other settings")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self._cached = None
        steps = len(self)
        step = int(state["step"])
        if not 0 <= step <= steps:
            raise ValueError(f"step {step} is outside epoch {self.epoch} of {steps} steps")
        self._start_step = step
        self._yielded = step
