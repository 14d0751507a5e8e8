"""The planning options: how lengths become packs, stated once.

:class:`PlanOptions` is what every planner shares. :func:`thdpack.plan_packs`,
:func:`thdpack.plan_balanced`, :class:`thdpack.TokenBudgetBatchSampler`,
:class:`thdpack.StreamingPacker` and :class:`thdpack.ThdCollator` take its fields as keywords
(:func:`plan_options` builds it) and hold the one they built (``.options``). Per-sample data
(``lengths``, ``vision_lengths``, ``audio_lengths``, ``groups``) is not an option: it is passed beside them.

``audio_budget`` is planned by :func:`thdpack.plan_packs` and :class:`thdpack.ThdCollator` alone for now: every other owner
(:data:`AUDIO_PLANNERS` lists those that take it) refuses it with a one-line ``ValueError``. It is
not among :data:`PLAN_FIELDS` (the keywords every planner takes), and :meth:`PlanOptions.keywords`
holds it only when set, so options without audio are what they were.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from thdpack.common.align import check_int
from thdpack.planning.packing import check_overflow, usable_length

ALGORITHMS = ("bfd", "ffd", "first_fit_shuffle", "sequential")
AUDIO_PLANNERS = ("plan_packs", "ThdCollator")  # the owners that plan with an audio_budget


@dataclass(frozen=True)
class PlanOptions:
    """How samples are planned into packs; every field is validated on construction.

    Attributes:
        pack_size: token budget of a pack (an integer >= 1), counted after each piece is
            rounded up to ``align``.
        algorithm: one of :data:`ALGORITHMS`: ``"bfd"`` best-fit decreasing over the whole
            input, ``"ffd"`` first-fit decreasing, ``"first_fit_shuffle"`` first fit in an
            order randomised by ``seed``, ``"sequential"`` next fit in input order.
        align: every length is rounded up to a multiple of this (an integer >= 1, at most
            ``pack_size``) before fitting, so per-sample CP/TP padding
            (:func:`thdpack.cp_pad_multiple`) still fits.
        overflow: what becomes of a sample whose aligned length exceeds ``pack_size``:
            ``"error"``, ``"truncate"``, ``"split"`` or ``"drop"``
            (:data:`thdpack.planning.packing.OVERFLOW_POLICIES`).
        max_samples_per_pack: None, or the most pieces a pack holds (an integer >= 1).
        seed: randomness of ``"first_fit_shuffle"`` (an integer >= 0; a sampler plans
            epoch e with ``seed + e``). Plans are deterministic.
        vision_budget: None, or the most vision patches a pack holds (an integer >= 1,
            ``pack_size · vision_budget < 2**56``), planned with per-sample ``vision_lengths``.
        audio_budget: None, or the most audio frames (the omni audio encoder's input) a pack holds
            (an integer >= 1), planned with per-sample ``audio_lengths``; a third budget beside
            tokens and vision patches. Only :func:`thdpack.plan_packs` takes it so far
            (:data:`AUDIO_PLANNERS`; the others refuse it).
        usable_length: (derived) the longest real length a pack takes whole: ``pack_size``
            rounded down to ``align`` (:func:`thdpack.planning.packing.usable_length`).
    """

    pack_size: int
    algorithm: str = "bfd"
    align: int = 1
    overflow: str = "error"
    max_samples_per_pack: int | None = None
    seed: int = 0
    vision_budget: int | None = None
    audio_budget: int | None = None
    usable_length: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        check_overflow(self.overflow)
        check_int(self.pack_size, "pack_size", 1)
        check_int(self.align, "align", 1)
        if self.max_samples_per_pack is not None:
            check_int(self.max_samples_per_pack, "max_samples_per_pack", 1)
        check_int(self.seed, "seed", 0)
        object.__setattr__(self, "usable_length", usable_length(self.pack_size, self.align))
        if self.vision_budget is not None:
            check_int(self.vision_budget, "vision_budget", 1)
            if int(self.pack_size) * int(self.vision_budget) >= 2**56:
                raise ValueError(
                    f"pack_size · vision_budget must be < 2**56, got {self.pack_size} · {self.vision_budget}"
                )
        if self.audio_budget is not None:
            check_int(self.audio_budget, "audio_budget", 1)

    def keywords(self) -> dict:
        """The fields as the keywords of :func:`thdpack.plan_packs` (what built these options)."""
        keywords = {name: getattr(self, name) for name in PLAN_FIELDS}
        if self.audio_budget is not None:  # only when set: the keywords without audio are those of before
            keywords["audio_budget"] = self.audio_budget
        return keywords

    def check_unused(self, owner: str, names: tuple[str, ...], why: str) -> None:
        """``ValueError`` naming the fields of ``names`` that differ from their defaults:
        ``owner`` does not use them (``why`` says so)."""
        changed = [f"{name}={getattr(self, name)!r}" for name in names
                   if getattr(self, name) != _DEFAULTS[name]]
        if changed:
            defaults = ", ".join(f"{name}={_DEFAULTS[name]!r}" for name in names)
            raise ValueError(
                f"{owner} does not use the options {', '.join(changed)} ({why}); leave them at their defaults ({defaults})"
            )


AUDIO_FIELDS = ("audio_budget",)  # taken by AUDIO_PLANNERS only
PLAN_FIELDS = tuple(f.name for f in dataclasses.fields(PlanOptions) if f.init and f.name not in AUDIO_FIELDS)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PlanOptions) if f.init}


def plan_options(owner: str, keywords: dict, *, fields: tuple[str, ...] = PLAN_FIELDS) -> PlanOptions:
    """The :class:`PlanOptions` of ``keywords``: the fields among ``fields`` that a caller of ``owner``
    passed (and ``audio_budget`` for the owners of :data:`AUDIO_PLANNERS`). ``TypeError`` naming ``owner``
    for any other keyword; ``ValueError`` for an ``audio_budget`` given to any other owner."""
    if owner in AUDIO_PLANNERS:
        fields = fields + AUDIO_FIELDS
    elif keywords.get("audio_budget") is not None:
        raise ValueError(f"{owner} does not take audio_budget yet (only {', '.join(AUDIO_PLANNERS)} plans with an "
                         f"audio budget); drop audio_budget={keywords['audio_budget']!r}")
    unknown = sorted(set(keywords) - set(fields) - set(AUDIO_FIELDS))  # audio_budget=None: as not given
    if unknown:
        raise TypeError(f"{owner}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}")
    return PlanOptions(**keywords)
