"""Dataset mixtures: which rows of which source go in, how many times, in what order; and packs that keep
the blend in every step.

A mixture blends several sources (datasets, files), each with a weight. Everything here is a function of
the sources' row counts (and, for token weights, their row lengths), the weights and a seed, and of nothing
else: not of processes, workers, input slices or engines. So an offline build, a DataLoader and every rank
get the same blend.

Details: docs/mixtures.md, "The blend's rules (thdpack.planning.mixture)".
"""

from __future__ import annotations

import difflib
import hashlib
import math
import numbers
from dataclasses import dataclass, field, fields
from typing import Mapping, Sequence

import numpy as np

from thdpack.common.align import check_int, round_up
from thdpack.common.jit import njit
from thdpack.planning import binpack
from thdpack.planning.options import plan_options
from thdpack.planning.packing import PackStats, cut_overflow
from thdpack.planning.plan import PackPlan, validate_lengths

WEIGHT_KEYS = ("weight", "epochs", "max_samples")
"""The keys of a source that say how much of it goes in: give at most one (none: ``weight: 1``)."""
WEIGHT_BY = ("samples", "tokens")
STOPPING = ("first_exhausted", "all_exhausted")
MAX_BLEND_SAMPLES = 2**31
"""A blend holds fewer samples than this: its plan keeps a source, a row and a length (int64) per sample, 48 GiB
at the bound. Larger sizes, epochs or weight ratios are refused before anything is drawn, saying what they take."""


@dataclass(frozen=True)
class MixtureSource:
    """One source of a mixture; every field is checked on construction, errors naming the source.

    Attributes:
        name: what reports and errors call the source (unique within a mixture).
        num_rows: its rows (after filtering; an integer >= 1: an empty source is an error).
        weight: its share of the blend (a finite number >= 0, normalised over the weighted sources).
        epochs: a fixed repetition (a finite number >= 0; ``2.5``: every row twice, half of them three times).
        max_samples: at most this many rows (an integer >= 0).
        lengths: None, or int64 ``[num_rows]`` token count of every row (each >= 1): needed for
            ``weight_by="tokens"``, and for the blend's ``lengths`` and token counts.

    Give at most one of ``weight``, ``epochs``, ``max_samples``; none means ``weight=1``.
    """

    name: str
    num_rows: int
    weight: float | None = None
    epochs: float | None = None
    max_samples: int | None = None
    lengths: np.ndarray | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a mixture source's name must be a non-empty string, got {self.name!r}")
        where = f"mixture source {self.name!r}"
        check_int(self.num_rows, f"{where}: num_rows", 0)
        if self.num_rows == 0:
            raise ValueError(f"{where} is empty (0 rows, after filtering): drop it from the mixture or fix its rows")
        given = [key for key in WEIGHT_KEYS if getattr(self, key) is not None]
        if len(given) > 1:
            raise ValueError(f"{where} gives {' and '.join(given)}; give one of {', '.join(WEIGHT_KEYS)}")
        if not given:
            object.__setattr__(self, "weight", 1.0)
        for key in ("weight", "epochs"):
            value = getattr(self, key)
            ok = value is None or (not isinstance(value, bool) and isinstance(value, numbers.Real)
                                   and math.isfinite(value) and value >= 0)
            if not ok:
                raise ValueError(f"{where}: {key} must be a finite number >= 0, got {value!r}")
        if self.max_samples is not None:
            check_int(self.max_samples, f"{where}: max_samples", 0)
        if self.lengths is not None:
            object.__setattr__(self, "lengths", _checked_lengths(self.lengths, self.num_rows, where))

    @property
    def how(self) -> str:
        """Which of :data:`WEIGHT_KEYS` the source was given by."""
        return next(key for key in WEIGHT_KEYS if getattr(self, key) is not None)


_SOURCE_KEYS = tuple(f.name for f in fields(MixtureSource))


def _checked_lengths(lengths, num_rows: int, where: str) -> np.ndarray:
    try:
        arr = validate_lengths(lengths)
    except ValueError as exc:
        raise ValueError(f"{where}: lengths: {exc}") from None
    if arr.size != num_rows:
        raise ValueError(f"{where}: lengths has {arr.size} entries for {num_rows} rows; give one per row")
    return arr


def mixture_sources(entries: Sequence, *, extra_keys: Sequence[str] = ()) -> tuple[MixtureSource, ...]:
    """``entries`` (each a :class:`MixtureSource` or a mapping of its fields) as checked sources.

    A mapping's keys are the fields of :class:`MixtureSource` and ``extra_keys`` (what a caller reads
    itself, e.g. a loader's ``dataset``; ignored here). ``ValueError``, one line naming the source, for
    an unknown key (with the closest known one), two sources of one name, or what
    :class:`MixtureSource` refuses; ``TypeError`` for an entry that is neither."""
    if isinstance(entries, (Mapping, str, bytes)) or not hasattr(entries, "__iter__"):
        raise TypeError(f"a mixture takes a list of sources, got {type(entries).__name__}")
    known = _SOURCE_KEYS + tuple(extra_keys)
    sources = []
    for i, entry in enumerate(entries):
        if isinstance(entry, MixtureSource):
            sources.append(entry)
            continue
        if not isinstance(entry, Mapping):
            raise TypeError(f"mixture source {i} must be a mapping of {', '.join(_SOURCE_KEYS)} or a "
                            f"MixtureSource, got {type(entry).__name__}")
        name = entry.get("name", f"source{i}")
        for key in entry:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"mixture source {name!r}: unknown key {key!r}{hint}; a source takes "
                                 f"{', '.join(known)}")
        sources.append(MixtureSource(**{k: v for k, v in entry.items() if k in _SOURCE_KEYS and k != "name"},
                                     name=name))
    if not sources:
        raise ValueError("a mixture needs at least one source")
    seen: dict[str, int] = {}
    for i, source in enumerate(sources):
        if source.name in seen:
            raise ValueError(f"mixture sources {seen[source.name]} and {i} are both {source.name!r}: give a source "
                             "once (epochs: 2 repeats it), and distinct sources distinct names")
        seen[source.name] = i
    return tuple(sources)


@dataclass(frozen=True, eq=False)
class MixturePlan:
    """Which row of which source is each sample of the blend, in blend order.

    Attributes:
        names: the sources' names, ``[S]``.
        source: int64 ``[N]`` the source of every sample of the blend.
        row: int64 ``[N]`` its row within that source.
        num_rows: int64 ``[S]`` rows of every source.
        counts: int64 ``[S]`` samples every source gives the blend.
        tokens: int64 ``[S]`` tokens every source gives, or None without every source's lengths.
        requested_share, realized_share: float64 ``[S]`` each source's share of the blend (of its
            samples, or its tokens with ``weight_by="tokens"``) as asked and as drawn.
        weight_by: ``"samples"`` or ``"tokens"``.
        seed: the seed it was drawn with.
        lengths: int64 ``[N]`` the token count of every sample of the blend, or None (as ``tokens``).
    """

    names: tuple[str, ...]
    source: np.ndarray
    row: np.ndarray
    num_rows: np.ndarray
    counts: np.ndarray
    tokens: np.ndarray | None
    requested_share: np.ndarray
    realized_share: np.ndarray
    weight_by: str
    seed: int
    lengths: np.ndarray | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return int(self.source.size)

    def repeats(self, source: int) -> np.ndarray:
        """int64 ``[num_rows[source]]``: how many times each row of ``source`` (its index) is in the blend."""
        check_int(source, "source", 0, below=len(self.names))
        return np.bincount(self.row[self.source == source], minlength=int(self.num_rows[source]))

    def report(self) -> list[dict]:
        """One dict per source: ``source`` (name), ``rows``, ``samples``, ``tokens`` (None without lengths),
        ``max_repeats`` (most times a row is in), ``requested_share`` and ``realized_share``."""
        return [
            {"source": name, "rows": int(self.num_rows[i]), "samples": int(self.counts[i]),
             "tokens": None if self.tokens is None else int(self.tokens[i]),
             "max_repeats": int(self.repeats(i).max()), "requested_share": float(self.requested_share[i]),
             "realized_share": float(self.realized_share[i])}
            for i, name in enumerate(self.names)
        ]

    def __str__(self) -> str:
        head = (f"{'source':<20} {'rows':>10} {'samples':>10} {'tokens':>13} {'repeats':>7} {'requested':>9} "
                f"{'realized':>9}")
        lines = [f"mixture of {len(self.names)} sources, {len(self)} samples, shares of {self.weight_by}", head]
        for r in self.report():
            tokens = "-" if r["tokens"] is None else f"{r['tokens']:,}"
            lines.append(f"{r['source'][:20]:<20} {r['rows']:>10,} {r['samples']:>10,} {tokens:>13} "
                         f"{r['max_repeats']:>7} {r['requested_share']:>9.4f} {r['realized_share']:>9.4f}")
        return "\n".join(lines)


def plan_mixture(sources: Sequence, *, weight_by: str = "samples", size: int | None = None,
                 stopping: str = "first_exhausted", seed: int = 0) -> MixturePlan:
    """The blend of ``sources``: which rows of which source, how many times, in what order.

    ``plan_mixture([{"name": "chat", "num_rows": 1000, "weight": 0.7}, {"name": "math", "num_rows": 200,
    "weight": 0.3}], stopping="all_exhausted")`` blends all 1000 chat rows (the source that runs out last)
    with 429 math samples (every one of its 200 rows twice, 29 of them three times), interleaved: 70% / 30%
    of the samples in every window. With the default ``"first_exhausted"`` it is every math row once and
    467 chat rows, drawn without replacement.

    Args:
        sources: :class:`MixtureSource` s or mappings of their fields (:func:`mixture_sources`).
        weight_by: what a ``weight`` is a share of: ``"samples"`` or ``"tokens"`` (then every source
            needs its ``lengths``).
        size: the weighted sources' part of the blend, in samples (or tokens): an integer >= 1; default
            from ``stopping``.
        stopping: without ``size``: ``"first_exhausted"`` or ``"all_exhausted"`` (see the module).
        seed: an integer >= 0; the same seed gives the same blend everywhere.

    Returns:
        A :class:`MixturePlan`. ``ValueError`` (one line naming the source) for what :func:`check_mixture`
        refuses, and for a blend that draws no sample (every share rounds to 0 samples, or with token
        weights a ``size`` too small for one row: the message says the size that draws one).
    """
    sources, target, requested = _checked_targets(sources, weight_by, size, stopping)
    check_int(seed, "seed", 0)
    tokens = weight_by == "tokens"
    drawn = [_draw(_source_rng(seed, s.name), s, t, tokens and s.how == "weight") for s, t in zip(sources, target)]
    if not any(d.size for d in drawn):
        _refuse_empty(sources, requested, tokens, size)
    return _blend(sources, drawn, requested, weight_by, int(seed))


def check_mixture(sources: Sequence, *, weight_by: str = "samples", size: int | None = None,
                  stopping: str = "first_exhausted", rows_at_least: bool = False) -> tuple[MixtureSource, ...]:
    """The checked sources of :func:`plan_mixture`'s arguments, without drawing the blend (cheap whatever the
    sizes: a config is checked by it before any row is read). ``ValueError`` (one line naming the source) for
    a weight that is negative or NaN, weights that are 0 for every source, an empty source, two sources of
    one name, an unknown key, ``weight_by="tokens"`` without a source's lengths, and a blend of
    :data:`MAX_BLEND_SAMPLES` samples or more (a ``size``, ``epochs`` or weight ratio too large: the message
    says what it would take). ``rows_at_least``: the sources' ``num_rows`` are lower bounds (a config checked
    before its rows are counted gives 1 each), and the message says so."""
    return _checked_targets(sources, weight_by, size, stopping, rows_at_least)[0]


def _checked_targets(sources, weight_by: str, size, stopping,
                     rows_at_least: bool = False) -> tuple[tuple[MixtureSource, ...], list, np.ndarray]:
    """:func:`check_mixture`'s sources and :func:`_targets`' per-source targets and requests."""
    sources = mixture_sources(sources)
    if weight_by not in WEIGHT_BY:
        raise ValueError(f"weight_by must be one of {WEIGHT_BY}, got {weight_by!r}")
    if stopping not in STOPPING:
        raise ValueError(f"stopping must be one of {STOPPING}, got {stopping!r}")
    if size is not None:
        check_int(size, "size", 1, hint=f" (the weighted sources' {weight_by} in the blend)")
    tokens = weight_by == "tokens"
    if tokens:
        missing = [s.name for s in sources if s.lengths is None]
        if missing:
            raise ValueError(f"mixture source {missing[0]!r} has no lengths, which weight_by='tokens' needs: give "
                             "every source its rows' token counts (lengths=)")
    if not any(_asks_for_some(s) for s in sources):
        names = ", ".join(repr(s.name) for s in sources)
        raise ValueError(f"every mixture source's weight is 0 ({names}): give at least one a weight (epochs, "
                         "max_samples) > 0")
    return (sources, *_targets(sources, tokens, size, stopping, rows_at_least))


def _asks_for_some(source: MixtureSource) -> bool:
    return bool(getattr(source, source.how) > 0)


def _units(source: MixtureSource, tokens: bool) -> float:
    """The source's size in the blend's unit: rows, or tokens."""
    return float(source.lengths.sum()) if tokens else float(source.num_rows)


def _targets(sources, tokens: bool, size, stopping, rows_at_least: bool) -> tuple[list[float], np.ndarray]:
    """Per source: what to draw (a sample count, or for a weighted source with token weights a token
    target) and float64 ``[S]`` what was asked, in the blend's unit. ``ValueError`` (:func:`_check_blend_size`)
    before anything is rounded or drawn when the blend would not fit :data:`MAX_BLEND_SAMPLES`."""
    weighted = [i for i, s in enumerate(sources) if s.how == "weight" and s.weight > 0]
    target: list[float] = [0.0] * len(sources)
    for i, s in enumerate(sources):
        if s.how == "epochs":  # rounded half up below, once its size is checked
            target[i] = s.epochs * s.num_rows + 0.5
        elif s.how == "max_samples":
            target[i] = min(s.max_samples, s.num_rows)
    quota, total = _weighted_quota([sources[i] for i in weighted], tokens, size, stopping)
    for i, q in zip(weighted, quota.tolist()):
        target[i] = q
    _check_blend_size(sources, target, tokens, size, stopping, rows_at_least)
    requested = np.zeros(len(sources))
    for i, s in enumerate(sources):
        if s.how == "epochs":
            target[i] = math.floor(target[i])
        if s.how != "weight":  # in tokens: the expected tokens of that many rows
            requested[i] = target[i] * (_units(s, tokens) / s.num_rows)
    if weighted:
        requested[weighted] = quota
        if not tokens:
            # the stopping source's quota is its rows (to float noise): its remainder is the smallest (first
            # exhausted: rounded down) or the largest (all exhausted: rounded up), so it gets exactly its rows
            counts = _largest_remainder(quota, int(math.floor(total + 0.5)))
            for i, c in zip(weighted, counts):
                target[i] = int(c)
    return target, requested


def _weighted_quota(weighted: list, tokens: bool, size, stopping) -> tuple[np.ndarray, float]:
    """float64 ``[W]`` the weighted sources' quotas (samples, or tokens) and their total: ``size``, or what
    ``stopping`` makes it; ``inf`` where extreme weight ratios ask for more than a float holds (refused by
    :func:`_check_blend_size`)."""
    if not weighted:
        return np.zeros(0), 0.0
    weights = np.array([s.weight for s in weighted], np.float64)
    with np.errstate(over="ignore"):
        summed = weights.sum()
    if not math.isfinite(summed):  # weights near the float maximum: scaled by a power of two first (exact)
        weights = weights * np.ldexp(1.0, -int(np.frexp(weights.max())[1]))
        summed = weights.sum()
    share = weights / summed
    units = np.array([_units(s, tokens) for s in weighted])
    if size is not None:
        total = float(size)
    else:  # a source whose share is tiny (or 0 by underflow) would be used once at an infinite total
        with np.errstate(over="ignore", divide="ignore"):
            ratio = units / share
        total = float(ratio.min() if stopping == "first_exhausted" else ratio.max())
    with np.errstate(invalid="ignore"):  # inf times a share of 0: that source takes none
        quota = np.nan_to_num(share * total, nan=0.0, posinf=np.inf)
    return quota, total


def _check_blend_size(sources, target: list[float], tokens: bool, size, stopping, rows_at_least: bool) -> None:
    """``ValueError`` naming the source that asks for the most samples when the blend would hold
    :data:`MAX_BLEND_SAMPLES` or more (``target``: :func:`_targets`' per-source targets, before rounding;
    a weighted source's in tokens with token weights), saying what it would take (``rows_at_least``: at least)
    and which option to lower."""
    samples = [t / _units(s, True) * s.num_rows if tokens and s.how == "weight" else t
               for s, t in zip(sources, target)]
    total = math.fsum(samples) if all(map(math.isfinite, samples)) else math.inf
    if total < MAX_BLEND_SAMPLES:
        return
    k = max(range(len(sources)), key=lambda i: (samples[i], sources[i].weight or 0))  # inf ties: the heaviest
    s = sources[k]
    if s.how == "epochs":
        rows = "each of its rows" if rows_at_least else f"its {s.num_rows:,} rows"
        cause, fix = f"epochs {s.epochs:g} of {rows}", "lower its epochs"
    elif size is not None:
        cause, fix = f"size {size:,}{' tokens' if tokens else ''} at weight {s.weight:g}", "lower size"
    else:
        cause = (f"weight {s.weight:g}, drawn in proportion to the source that stopping={stopping!r} uses once, "
                 "whose share is far smaller")
        fix = "give the sources weights closer together, a size, or stopping first_exhausted"
    per = 8 * (2 + all(x.lengths is not None for x in sources))  # source, row (and length), int64 each
    together = "" if samples[k] >= MAX_BLEND_SAMPLES else f", {_amount(total)} with the other sources"
    least = "at least " if rows_at_least else ""
    raise ValueError(f"mixture source {s.name!r} would put {least}{_amount(samples[k])} samples in the blend ({cause}"
                     f"{together}); a blend holds fewer than 2**31 ({MAX_BLEND_SAMPLES:,}) samples, and this one's "
                     f"plan would take {least}{_bytes(total * per)} ({per} bytes a sample): {fix}")


def _amount(x: float) -> str:
    return "more than 1.8e308" if not math.isfinite(x) else f"{x:,.0f}" if x < 1e15 else f"{x:.3g}"


def _bytes(x: float) -> str:
    """``x`` bytes as text: ``1.5 TiB``."""
    if not math.isfinite(x):
        return "more bytes than a float counts"
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    k = 0
    while x >= 1024 and k < len(units) - 1:
        x, k = x / 1024, k + 1
    return f"{x:,.1f} {units[k]}" if x < 1e6 else f"{x:.3g} {units[k]}"


def _refuse_empty(sources, requested: np.ndarray, tokens: bool, size) -> None:
    """``ValueError`` for a blend that drew no sample, saying what would draw one (``requested``: float64
    ``[S]`` each source's target, in the blend's unit)."""
    weighted = [i for i, s in enumerate(sources) if s.how == "weight" and requested[i] > 0]
    if tokens and size is not None and weighted:  # a source's share of size is less than half of any of its rows
        need = {i: math.ceil(int(sources[i].lengths.max()) * size / requested[i]) for i in weighted}
        k = min(need, key=need.get)
        raise ValueError(f"the blend draws no sample: size {size:,} tokens gives no weighted source enough tokens "
                         f"for one of its rows (each takes the rows whose tokens come closest to its share); give "
                         f"size >= {need[k]:,} (so that the share of source {sources[k].name!r} holds its longest row)")
    s = next(s for s in sources if _asks_for_some(s))
    raise ValueError(f"the blend draws no sample: every source's share rounds to 0 samples (source {s.name!r}: "
                     f"{s.how} {getattr(s, s.how):g} of its {s.num_rows:,} rows); raise it")


def _largest_remainder(quota: np.ndarray, total: int) -> np.ndarray:
    """int64 counts summing to ``total`` (within the quotas' rounding), each ``floor`` or ``ceil`` of its quota:
    the floors, then one more for the largest remainders (ties: the first source)."""
    base = np.floor(quota).astype(np.int64)
    extra = int(min(max(total - int(base.sum()), 0), quota.size))
    order = np.lexsort((np.arange(quota.size), -(quota - base)))
    base[order[:extra]] += 1
    return base


_ORDER_STREAM = 0x6D6978  # the blend order's generator: [seed, this]; each source's rows: [seed, its name's hash]


def _source_rng(seed: int, name: str) -> np.random.Generator:
    """The source's own generator: of the seed and its name (not its position among the sources)."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return np.random.default_rng([int(seed), *np.frombuffer(digest[:16], np.uint32).tolist()])


def _draw(rng: np.random.Generator, source: MixtureSource, target: float, by_tokens: bool) -> np.ndarray:
    """int64 rows of ``source`` in its order in the blend: full passes, then part of one more, each pass a
    permutation of the rows. ``target``: a sample count, or (``by_tokens``) a token count."""
    n = source.num_rows
    if by_tokens:
        total = float(source.lengths.sum())
        passes = int(math.floor(target / total + 1e-9))
        rest = max(target - passes * total, 0.0)
    else:
        passes, rest = divmod(int(target), n)
    perms = rng.permuted(np.tile(np.arange(n, dtype=np.int64), (passes + 1, 1)), axis=1)
    last = perms[passes]
    if by_tokens:  # the prefix of the last pass whose tokens are closest to what is left
        reach = np.concatenate([[0], np.cumsum(source.lengths[last])])
        j = int(np.searchsorted(reach, rest))
        take = j if j < reach.size and (j == 0 or reach[j] - rest < rest - reach[j - 1]) else j - 1
    else:
        take = int(rest)
    return np.concatenate([perms[:passes].reshape(-1), last[:take]])


def _blend(sources, drawn: list[np.ndarray], requested: np.ndarray, weight_by: str, seed: int) -> MixturePlan:
    """The :class:`MixturePlan` of the drawn rows, interleaved by :func:`interleave_keys`."""
    counts = np.array([d.size for d in drawn], np.int64)
    source = np.repeat(np.arange(len(sources), dtype=np.int64), counts)
    row = np.concatenate(drawn) if drawn else np.zeros(0, np.int64)
    has_lengths = all(s.lengths is not None for s in sources)
    lengths = np.concatenate([s.lengths[d] for s, d in zip(sources, drawn)]) if has_lengths else None
    tokens = np.array([int(s.lengths[d].sum()) for s, d in zip(sources, drawn)], np.int64) if has_lengths else None
    units = source_units(source, lengths, weight_by)
    jitter = np.random.default_rng([seed, _ORDER_STREAM]).random(source.size)
    order = np.lexsort((source, interleave_keys(source, units, len(sources), jitter)))
    realized = (tokens if weight_by == "tokens" else counts).astype(np.float64)
    return MixturePlan(
        names=tuple(s.name for s in sources), source=source[order], row=row[order],
        num_rows=np.array([s.num_rows for s in sources], np.int64), counts=counts, tokens=tokens,
        requested_share=requested / requested.sum(), realized_share=realized / max(realized.sum(), 1.0),
        weight_by=weight_by, seed=seed, lengths=None if lengths is None else lengths[order],
    )


def source_units(source: np.ndarray, lengths: np.ndarray | None, weight_by: str) -> np.ndarray:
    """float64 ``[n]`` what every sample counts for in the blend: 1, or its tokens (``weight_by="tokens"``)."""
    if weight_by == "tokens":
        if lengths is None:
            raise ValueError("weight_by='tokens' needs every sample's length")
        return np.asarray(lengths, np.float64)
    return np.ones(source.size, np.float64)


def interleave_keys(source: np.ndarray, units: np.ndarray, num_sources: int,
                    jitter: np.ndarray | None = None) -> np.ndarray:
    """float64 ``[n]`` where every sample sits in a smooth interleave of the sources: a point of its ``units``
    within its source's, as a fraction of the source's total: ``(k + jitter) / cᵢ`` for the k-th of ``cᵢ``
    samples counted alike. ``source``: int64 ``[n]``, each source's samples in their own order; ``jitter``:
    float64 ``[n]`` in ``[0, 1)``, default ½ (the middle)."""
    totals = np.bincount(source, weights=units, minlength=num_sources)
    order = np.argsort(source, kind="stable")
    before = np.cumsum(units[order]) - units[order]  # units of the earlier samples, all sources
    start = np.cumsum(totals) - totals  # where each source's run begins in `before`
    keys = np.empty(source.size)
    point = 0.5 if jitter is None else jitter[order]
    keys[order] = (before - start[source[order]] + units[order] * point) / totals[source[order]]
    return keys


# ---------------------------------------------------------------------------------------------------------
# stratified packing: every step of n packs close to the blend


def plan_stratified(lengths, sources, pack_size: int | None = None, *, step_packs: int = 1,
                    weight_by: str = "samples", **plan_keywords) -> PackPlan:
    """Packs that keep the blend: every step of ``step_packs`` consecutive packs is filled from the blend's
    next samples, so each step holds close to the blend's shares.

    The samples are taken in the blend's smooth interleave (:func:`interleave_keys`, of ``sources`` and
    ``weight_by``: what :func:`plan_mixture` orders its blend by), until the step's candidates hold
    ``step_packs · pack_size`` aligned tokens and half a pack more; best fit decreasing places them
    into the step's ``step_packs`` packs; what does not fit comes first among the next step's candidates.
    So every step but the last has exactly ``step_packs`` packs (pack k is in step ``k // step_packs``), and
    no sample waits for long. Whole-dataset BFD (:func:`thdpack.plan_packs`) packs tighter, as it pairs
    samples from anywhere; ``benchmarks/mixture.py`` measures the cost (the fill, and the blend's drift
    per step).

    Args:
        lengths: ``[n]`` token counts (each >= 1), e.g. ``MixturePlan.lengths``.
        sources: ``[n]`` integer source of every sample (>= 0), e.g. ``MixturePlan.source``.
        pack_size, **plan_keywords: the planning keywords ``pack_size``, ``align``, ``overflow``,
            ``max_samples_per_pack`` as in :func:`thdpack.plan_packs`; ``algorithm``, ``seed`` and ``vision_budget`` keep their defaults.
        step_packs: packs per step (an integer >= 1): the packs of one optimizer step (data-parallel ranks ×
            micro-batches), each step close to the blend.
        weight_by: what the blend's shares count: ``"samples"`` or ``"tokens"``.

    Returns:
        A :class:`thdpack.planning.PackPlan` (``algorithm="stratified"``) over the samples' positions, packs in step
        order; pieces within a pack by position.
    """
    options = plan_options("plan_stratified", {"pack_size": pack_size, **plan_keywords})
    options.check_unused("plan_stratified", ("algorithm", "seed", "vision_budget"),
                         "it fills every step by best fit from the blend's next samples, without a vision budget")
    check_int(step_packs, "step_packs", 1)
    if weight_by not in WEIGHT_BY:
        raise ValueError(f"weight_by must be one of {WEIGHT_BY}, got {weight_by!r}")
    lengths = validate_lengths(lengths)
    src = _checked_sources(sources, lengths.size)
    pieces = cut_overflow(lengths, options.overflow, options.pack_size, options.align)
    piece_src = src[pieces.sample_index]
    units = source_units(piece_src, pieces.length, weight_by)
    num_sources = int(src.max()) + 1 if src.size else 1
    order = np.lexsort((piece_src, interleave_keys(piece_src, units, num_sources)))
    sizes = np.ascontiguousarray(round_up(pieces.length, options.align)[order])
    lookahead = int(options.pack_size) // 2
    bins, num_packs = _fill_steps(sizes, int(options.pack_size), int(step_packs),
                                  int(options.max_samples_per_pack or 0), lookahead)
    pack_of = np.empty_like(bins)
    pack_of[order] = bins
    by_pack = binpack.bucket_order(pack_of, num_packs, False)
    pack_offsets = np.zeros(num_packs + 1, np.int64)
    np.cumsum(np.bincount(pack_of, minlength=num_packs), out=pack_offsets[1:])
    length = pieces.length[by_pack]
    stats = PackStats.from_packs(length, pack_offsets, int(options.pack_size), align=int(options.align),
                                 num_samples=int(lengths.size), cuts=pieces.cuts)
    return PackPlan(sample_index=pieces.sample_index[by_pack], start=pieces.start[by_pack], length=length,
                    pack_offsets=pack_offsets, dropped=pieces.dropped, pack_size=int(options.pack_size),
                    align=int(options.align), algorithm="stratified", overflow=options.overflow,
                    seed=int(options.seed), stats=stats)


def _checked_sources(sources, n: int) -> np.ndarray:
    src = np.asarray(sources)
    if src.shape != (n,) or (src.size and src.dtype.kind not in "iu"):
        raise ValueError(f"sources must be integers with one source per sample ({n}), got shape {src.shape} and "
                         f"dtype {src.dtype}")
    src = src.astype(np.int64)
    if src.size and src.min() < 0:
        i = int(np.flatnonzero(src < 0)[0])
        raise ValueError(f"sources[{i}] is {int(src[i])}; a source is an integer >= 0")
    return src


@njit
def _fill_steps(sizes, capacity, step_packs, max_items, lookahead):
    """Bin of every item (int64 ``[m]``, sizes in priority order) and the number of bins: step after step,
    the carried items and the next ones until ``step_packs · capacity + lookahead`` tokens are candidates,
    placed by best fit decreasing into the step's ``step_packs`` bins (``max_items`` per bin, 0: any);
    what does not fit is carried to the next step."""
    m = sizes.size
    bin_of = np.full(m, -1, np.int64)
    carry = np.empty(m, np.int64)
    cand = np.empty(m, np.int64)
    room = np.empty(step_packs, np.int64)
    count = np.empty(step_packs, np.int64)
    target = step_packs * capacity + lookahead
    n_carry, nxt, num_bins = 0, 0, 0
    while nxt < m or n_carry > 0:
        n_cand, tokens = 0, 0
        for c in range(n_carry):
            cand[n_cand] = carry[c]
            tokens += sizes[carry[c]]
            n_cand += 1
        while nxt < m and tokens < target:
            cand[n_cand] = nxt
            tokens += sizes[nxt]
            n_cand += 1
            nxt += 1
        n_carry, used = _place_step(sizes, cand[:n_cand], room, count, capacity, max_items, bin_of, num_bins, carry)
        num_bins += used
    return bin_of, num_bins


@njit
def _place_step(sizes, cand, room, count, capacity, max_items, bin_of, first_bin, carry):
    """Best fit decreasing of ``cand`` into ``room.size`` empty bins numbered from ``first_bin``; the items
    that fit nowhere go to ``carry`` (in decreasing size). Returns (carried, bins used: a prefix)."""
    room[:] = capacity
    count[:] = 0
    order = np.argsort(-sizes[cand], kind="mergesort")
    n_carry, used = 0, 0
    for o in order:
        j = cand[o]
        s = sizes[j]
        best = -1
        for b in range(room.size):
            if room[b] >= s and (max_items == 0 or count[b] < max_items) and (best < 0 or room[b] < room[best]):
                best = b
        if best < 0:
            carry[n_carry] = j
            n_carry += 1
        else:
            bin_of[j] = first_bin + best
            room[best] -= s
            count[best] += 1
            used = max(used, best + 1)
    return n_carry, used


def step_shares(plan: PackPlan, sources, step_packs: int, *, weight_by: str = "samples",
                num_sources: int | None = None) -> np.ndarray:
    """float64 ``[steps, S]`` every step's share of each source (steps of ``step_packs`` consecutive packs of
    ``plan``, the last one shorter; samples, or their planned tokens with ``weight_by="tokens"``).
    ``sources``: ``[n]`` the source of every sample ``plan`` was planned over."""
    check_int(step_packs, "step_packs", 1)
    src = np.asarray(sources, np.int64)[plan.sample_index]
    S = int(num_sources if num_sources is not None else (src.max() + 1 if src.size else 1))
    steps = -(-len(plan) // step_packs)
    pack_of = np.repeat(np.arange(len(plan)), np.diff(plan.pack_offsets))
    units = plan.length.astype(np.float64) if weight_by == "tokens" else np.ones(src.size)
    table = np.zeros((steps, S))
    np.add.at(table, (pack_of // step_packs, src), units)
    return table / np.maximum(table.sum(axis=1, keepdims=True), 1e-300)
