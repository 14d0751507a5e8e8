"""Statistics of a plan or a packed dataset: lengths, packing, padding, attention FLOPs.

Everything is computed from integers: the per-sample lengths in each pack
(``seq_lens`` and pack offsets), the pack size and an alignment multiple.
"""

from __future__ import annotations

import numpy as np

from thdpack.common.align import round_up
from thdpack.planning.packing import PackStats, pack_sums, pack_totals
from thdpack.flops import attention_overcount_factor, lengths_squared_sum


# the build's counters that its statistics carry (metadata.json "stats"), shown by ``thdpack stats``
BUILD_COUNTS = ("truncated", "dropped", "split", "skipped_rows", "samples_without_targets", "without_targets",
                "target_tokens")


def log2_histogram(lengths: np.ndarray) -> list[list[int]]:
    """``[[lo, hi, count], ...]`` over buckets ``[2^k, 2^(k+1))`` from the shortest to the longest length."""
    x = np.asarray(lengths, dtype=np.int64)
    x = x[x > 0]
    if x.size == 0:
        return []
    k = np.floor(np.log2(x)).astype(np.int64)
    lo, hi = int(k.min()), int(k.max())
    counts = np.bincount(k - lo, minlength=hi - lo + 1)
    return [[1 << (lo + i), (1 << (lo + i + 1)) - 1, int(c)] for i, c in enumerate(counts)]


def summarize(
    seq_lens: np.ndarray,
    pack_offsets: np.ndarray,
    pack_size: int,
    align: int,
    *,
    eval_multiple: int | None = None,
    input_lengths: np.ndarray | None = None,
    counts: dict | None = None,
    model_config=None,
    vision_grid_thw=None,
) -> dict:
    """A JSON-able summary.

    Args:
        seq_lens: ``[m]`` real length of every sample (piece) in packs, pack after pack.
        pack_offsets: ``[num_packs + 1]`` samples of pack k are ``pack_offsets[k]:pack_offsets[k+1]``.
        pack_size, align: the plan's budget and the multiple it reserved room for.
        eval_multiple: alignment multiple to evaluate padding at (default ``align``).
        input_lengths: lengths of the input samples before truncation/splitting
            (for the histogram); defaults to ``seq_lens``.
        counts: extra counters to carry (truncated, dropped, skipped, ...).
        model_config: a model config (dict or transformers config): adds ``model_flops``,
            the whole-model over-count (:func:`thdpack.offline.commands.model_record.model_flops_summary`).
        vision_grid_thw: ``[N, 3]`` grids of every image in the packs (VLM builds), so
            that the model figure counts the vision tower.
    """
    s = np.asarray(seq_lens, dtype=np.int64)
    off = np.asarray(pack_offsets, dtype=np.int64)
    totals = pack_totals(s, off, align)
    plan = PackStats.from_totals(totals, int(pack_size))
    num_packs, real = plan.num_packs, plan.real_tokens
    lengths = s if input_lengths is None else np.asarray(input_lengths, dtype=np.int64)
    per_pack = pack_sums(s, off)
    sum_sq = lengths_squared_sum(s)
    out = {
        "samples": plan.num_pieces,
        "packs": num_packs,
        "pack_size": int(pack_size),
        "align": int(align),
        "lower_bound": plan.lower_bound,
        "real_tokens": real,
        "max_seqlen": int(s.max()) if s.size else 0,  # longest sample in a pack
        "min_pack_tokens": totals.min_pack_tokens,
        "efficiency": plan.efficiency,
        "packing_factor": plan.packing_factor,
        "max_samples_per_pack": plan.max_samples_per_pack,
        "pack_fill": _pack_fill_summary(plan, per_pack / pack_size),
        "lengths": _lengths_summary(lengths, "input samples" if input_lengths is not None else "packed samples"),
        "padding": _padding_summary(s, off, eval_multiple or align, pack_size, plan),
        "attention_flops": _attention_flops_summary(num_packs, pack_size, sum_sq, per_pack),
    }
    if model_config is not None:
        from thdpack.offline.commands.model_record import model_flops_summary

        out["model_flops"] = model_flops_summary(model_config, num_packs, pack_size, real, sum_sq, int(s.size),
                                                 vision_grid_thw, seq_lens=s)
    out.update(counts or {})
    return out


def _pack_fill_summary(plan: PackStats, fill: np.ndarray) -> dict:
    """``summarize``'s ``pack_fill``: min, mean, max and a 10-bucket histogram of each pack's
    real tokens / pack_size (``fill``: float64 ``[num_packs]``)."""
    num_packs = plan.num_packs
    return {
        "min": plan.min_pack_fill,
        "mean": float(fill.mean()) if num_packs else 0.0,
        "max": plan.max_pack_fill,
        "histogram": np.histogram(fill, bins=10, range=(0.0, 1.0))[0].tolist() if num_packs else [],
    }


def _lengths_summary(lengths: np.ndarray, of: str) -> dict:
    """``summarize``'s ``lengths``: count, min, percentiles, max, mean and the log2 histogram of
    ``lengths`` (int64 ``[k]``); ``of`` names what they are the lengths of."""
    pct = (lambda q: int(np.percentile(lengths, q, method="lower"))) if lengths.size else (lambda q: 0)
    return {
        "of": of,
        "count": int(lengths.size),
        "min": int(lengths.min()) if lengths.size else 0,
        "p50": pct(50),
        "p90": pct(90),
        "p99": pct(99),
        "max": int(lengths.max()) if lengths.size else 0,
        "mean": float(lengths.mean()) if lengths.size else 0.0,
        "histogram": log2_histogram(lengths),
    }


def _padding_summary(s: np.ndarray, off: np.ndarray, multiple: int, pack_size: int, plan: PackStats) -> dict:
    """``summarize``'s ``padding``: the pad tokens when every sample (real lengths ``s``, int64
    ``[m]``, packs at ``off``) is padded to ``multiple``, and when every pack is padded to pack_size."""
    padded = round_up(s, multiple)
    padded_per_pack = pack_sums(padded, off)
    stream = int(padded.sum())
    real = plan.real_tokens
    return {
        "multiple": int(multiple),
        "pad_tokens": stream - real,
        "stream_tokens": stream,
        "fraction": (stream - real) / stream if stream else 0.0,
        "packs_over_pack_size": int((padded_per_pack > pack_size).sum()),
        "static_fraction": 1 - plan.efficiency if plan.num_packs else 0.0,
    }


def _attention_flops_summary(num_packs: int, pack_size: int, sum_sq: int, per_pack: np.ndarray) -> dict:
    """``summarize``'s ``attention_flops``: ``Σ sᵢ²`` against counting each pack as one
    ``pack_size`` sequence, and against each pack's filled length (``per_pack``: int64 ``[num_packs]``)."""
    return {
        "sum_seqlen_squared": sum_sq,
        "pack_len_count": num_packs * pack_size**2,
        # None (JSON null, not the invalid NaN) when nothing was packed
        "overcount": attention_overcount_factor(num_packs, pack_size, sum_sq) if sum_sq else None,
        "overcount_at_fill": float((per_pack.astype(np.float64) ** 2).sum() / sum_sq) if sum_sq else None,
    }


def nemo_fields(summary: dict) -> dict:
    """NeMo / Megatron-Bridge packed-sequence metadata fields (``packing_efficiency`` in percent)."""
    s = summary
    return {
        "dataset_max_seqlen": s["max_seqlen"],
        "max_samples_per_bin": s["max_samples_per_pack"],
        "packing_factor": round(s["packing_factor"], 2),
        "packing_efficiency": round(100 * s["efficiency"], 2),
        "pack_size": s["pack_size"],
        "min_packed_seqlen": s["min_pack_tokens"],
    }


# ---------------------------------------------------------------------------- text


def _bar(count: int, top: int, width: int = 40) -> str:
    n = 0 if top == 0 else max(1 if count else 0, round(width * count / top))
    return "█" * n


def format_summary(s: dict, *, title: str | None = None) -> str:
    """Human-readable report of a :func:`summarize` result."""
    lines = []
    if title:
        lines.append(title)
    L = s["lengths"]
    lines.append(
        f"lengths ({L['of']}): n={L['count']}  min {L['min']}  p50 {L['p50']}  p90 {L['p90']}  "
        f"p99 {L['p99']}  max {L['max']}  mean {L['mean']:.1f}"
    )
    top = max((c for _, _, c in L["histogram"]), default=0)
    for lo, hi, c in L["histogram"]:
        lines.append(f"  {lo:>7} – {hi:<7} {c:>8}  {_bar(c, top)}")
    lines.append(f"packs            {s['packs']} of {s['pack_size']} tokens (lower bound {s['lower_bound']} at align {s['align']})")
    lines.append(f"samples          {s['samples']} in packs; {s['packing_factor']:.2f} per pack (max {s['max_samples_per_pack']})")
    lines.append(f"real tokens      {s['real_tokens']:,}" + (f"; {s['target_tokens']:,} are loss targets" if "target_tokens" in s else ""))
    lines.append(f"efficiency       {s['efficiency']:.4f}  (real tokens / (packs · pack_size))")
    f = s["pack_fill"]
    lines.append(f"pack fill        min {f['min']:.3f}  mean {f['mean']:.3f}  max {f['max']:.3f}")
    if f["histogram"]:
        top = max(f["histogram"])
        for i, c in enumerate(f["histogram"]):
            if c:
                lines.append(f"  {i / 10:.1f} – {(i + 1) / 10:.1f}     {c:>8}  {_bar(c, top)}")
    p = s["padding"]
    lines.append(
        f"pad fraction     {p['fraction']:.4f} at multiple {p['multiple']}: {p['pad_tokens']:,} pad tokens in a "
        f"{p['stream_tokens']:,}-token stream" + (
            f"; {p['packs_over_pack_size']} packs would exceed pack_size at this multiple"
            if p["packs_over_pack_size"] else "")
    )
    lines.append(f"                 {p['static_fraction']:.4f} when every pack is padded to pack_size (static shapes)")
    for key, label in (("truncated", "truncated"), ("dropped", "dropped"), ("split", "split")):
        if key in s and (key == "truncated" or s[key]["samples"]):
            v = s[key]
            lines.append(f"{label:<16} {v['samples']} samples" + (f", {v['tokens']:,} tokens" if "tokens" in v else ""))
    if s.get("skipped_rows"):
        lines.append(f"skipped rows     {s['skipped_rows']}")
    if "samples_without_targets" in s:
        lines.append(_without_targets_line(s["samples_without_targets"], s.get("without_targets")))
    if s.get("mixture"):
        lines.extend(_mixture_lines(s["mixture"]))
    a = s["attention_flops"]
    if a["overcount"] is None:
        lines.append("attention FLOPs  no tokens packed: no over-count to report")
    else:
        lines.append(
            f"attention FLOPs  counting each pack as one {s['pack_size']}-token sequence over-counts by "
            f"{a['overcount']:.2f}x  (n_packs·pack_size²/Σsᵢ²; {a['overcount_at_fill']:.2f}x at each pack's filled length)"
        )
    mf = s.get("model_flops")
    if mf:
        name = mf.get("model_type") or "model"
        if "error" in mf:
            lines.append(f"model FLOPs      ({name}) not computed: {mf['error']}")
        else:
            lines.append(
                f"model FLOPs      ({name}{', vision tower included' if mf.get('vision_included') else ''}) the same count "
                f"over-counts whole-model training FLOPs by {mf['overcount']:.2f}x  "
                f"({mf['overcount_samples_at_pack_len']:.2f}x if every sample is charged a {s['pack_size']}-token sequence)"
            )
    return "\n".join(lines)


def _mixture_lines(m: dict) -> list[str]:
    """The per-source table of a mixture build (``metadata.json``'s ``mixture`` entry): rows read, dropped before
    the blend (failed, too long), kept, the blend's units (rows, pairs or groups), samples packed and what the plan
    dropped, tokens, and the shares of the blend's ``weight_by`` unit as requested, drawn and packed."""
    lines = [f"mixture          {len(m['sources'])} sources, {m['samples']:,} units blended (shares of {m['weight_by']}, "
             f"{m['packing']} packing)",
             f"  {'source':<16} {'read':>8} {'failed':>6} {'long':>6} {'kept':>8} {'blend':>8} {'rep':>3} "
             f"{'packed':>8} {'dropped':>7} {'tokens':>12} {'requested':>9} {'realized':>8} {'packed':>7}"]
    for r in m["sources"]:
        dropped = r["dropped_overflow"] + r["dropped_without_targets"]
        lines.append(f"  {r['name'][:16]:<16} {r['rows_read']:>8,} {r['rows_failed']:>6,} {r['rows_too_long']:>6,} "
                     f"{r['rows_kept']:>8,} {r['blend_units']:>8,} {r['max_repeats']:>3} {r['packed_samples']:>8,} "
                     f"{dropped:>7,} {r['tokens']:>12,} {r['requested_share']:>9.4f} {r['realized_share']:>8.4f} "
                     f"{r['packed_share']:>7.4f}")
    return lines


def _without_targets_line(n: int, w: dict | None) -> str:
    """What became of the samples left with no target token after truncation (``without_targets``
    policy; ``w`` is None for datasets built before the policy existed)."""
    line = f"without targets  {n} samples (no target token left after truncation)"
    if w is None:
        return line + (": they train nothing" if n else "")
    if w["policy"] == "drop":
        line += f": dropped, {w['dropped_tokens']:,} tokens (without_targets: drop)"
    else:
        line += ": kept (without_targets: keep)"
    if w["packs"] or w["pieces"]:
        line += f"; {w['pieces']} pieces in packs train nothing, {w['packs']} packs have no target at all"
    return line


def plot_summary(s: dict, path: str) -> None:
    """Length histogram and pack-fill histogram to an image (needs matplotlib: the ``plot`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from thdpack.offline.errors import OfflineError

        raise OfflineError("--plot needs matplotlib: pip install 'thdpack[plot]'") from None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    hist = s["lengths"]["histogram"]
    labels = [f"{lo}" for lo, _, _ in hist]
    ax1.bar(range(len(hist)), [c for _, _, c in hist], color="#4477aa")
    ax1.set_xticks(range(len(hist)), labels, rotation=45)
    ax1.set_xlabel("length (tokens, log2 buckets: lower edge)")
    ax1.set_ylabel("samples")
    ax1.set_title(f"{s['lengths']['of']} (n={s['lengths']['count']})")
    fills = s["pack_fill"]["histogram"]
    ax2.bar([i / 10 + 0.05 for i in range(10)], fills, width=0.09, color="#228833")
    ax2.set_xlim(0, 1)
    ax2.set_xlabel("pack fill (real tokens / pack_size)")
    ax2.set_ylabel("packs")
    ax2.set_title(f"{s['packs']} packs, efficiency {s['efficiency']:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
