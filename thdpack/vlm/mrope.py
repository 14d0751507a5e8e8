"""mRoPE position ids on the THD stream, straight from the grids.

The Qwen-VL families' ``get_rope_index`` walks one sample at a time: it groups
the sample's tokens into runs of equal ``mm_token_type_ids`` (0 text, 1 image,
2 video) and keeps a running position ``p`` (starting at 0):

- a text run of length ``L`` gets ``p, p+1, …, p+L-1`` on all three rows; ``p += L``;
- a vision run (one item: an image, a video, or a video frame) with LLM grid
  ``(t, h, w)`` gets, for its ``k``-th token (``k = (ti·h + hi)·w + wi``),
  rows ``(p + trunc(ti·interval), p + hi, p + wi)``; then ``p += max(h, w)``.

Here the same is one pass over the whole pack, with no per-sample loop: a token's
``p`` is the within-sample exclusive cumulative sum of an *advance* vector (1 per
text token, ``max(h, w)`` on the last token of each vision run, 0 on the other
vision tokens), and the in-run offsets come from ``k`` by integer division.

Pad slots (alignment padding after a sample's real tokens) advance like text:
pad ``j`` of a sample gets ``P + j`` on all three rows, where ``P`` is the
position a next text token of that sample would take. They stay after every
real token of their sample, and carry no loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from thdpack.vlm.base import MODE_F32, MODE_F64, RopeItems


@dataclass
class StreamRope:
    """Result of :func:`mrope_for_stream` (``T`` stream length, ``n`` samples).

    Attributes:
        positions: int64 ``[3, T]`` mRoPE rows (temporal, height, width).
        token_type: int8 ``[T]``: 0 text (and pad slots), 1 image, 2 video.
        rope_deltas: int64 ``[n]``: ``max position + 1 − s`` per sample, as the
            second output of ``get_rope_index``.
    """

    positions: np.ndarray
    token_type: np.ndarray
    rope_deltas: np.ndarray


def mrope_for_stream(
    family,
    input_ids: np.ndarray,
    cu_seqlens_padded: np.ndarray,
    seq_lens: np.ndarray,
    images: RopeItems,
    image_counts: np.ndarray,
    videos: RopeItems,
    video_counts: np.ndarray,
    *,
    hint: str = "",
) -> StreamRope:
    """mRoPE rows and token types of a THD stream.

    Args:
        family: a :class:`thdpack.vlm.VlmFamily` (token ids, merge size, video layout).
        input_ids: int ``[T]`` the stream; sample i's real tokens are
            ``cu_seqlens_padded[i] : cu_seqlens_padded[i] + seq_lens[i]``, pad slots after.
        cu_seqlens_padded: int ``[n+1]``.
        seq_lens: int ``[n]`` real lengths.
        images, videos: the pack's items in placeholder order, sample after sample
            (:meth:`VlmFamily.image_items` / :meth:`VlmFamily.video_items`).
        image_counts, video_counts: int ``[n]`` items of each sample.
        hint: appended to placeholder errors (e.g. a truncation note).

    Raises:
        ValueError naming the sample and image / video index when the placeholder
        runs do not match the items (count of runs, or tokens per run).
    """
    ids = np.asarray(input_ids, dtype=np.int64)
    cu = np.asarray(cu_seqlens_padded, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    n = seq_lens.size
    total = ids.size
    padded = cu[1:] - cu[:-1]
    starts_of_sample = cu[:-1]
    sample_of = np.repeat(np.arange(n, dtype=np.int64), padded)
    offset = np.arange(total, dtype=np.int64) - starts_of_sample[sample_of]
    real = offset < seq_lens[sample_of]

    vision_ids = [v for v in (family.image_token_id, family.video_token_id) if v is not None]
    pad_vision = ~real & np.isin(ids, vision_ids)
    if pad_vision.any():
        t = int(np.flatnonzero(pad_vision)[0])
        raise ValueError(
            f"pad slot {t} (after sample {int(sample_of[t])}) holds vision token id {int(ids[t])}: the model "
            "would take it for a placeholder; use a pad_token_id that is not the image or video token id"
        )
    token_type = np.zeros(total, dtype=np.int8)
    token_type[(ids == family.image_token_id) & real] = 1
    if family.video_token_id is not None:
        token_type[(ids == family.video_token_id) & real] = 2

    # runs of equal non-zero type, never crossing a sample boundary
    boundary = np.zeros(total + 1, dtype=bool)
    boundary[starts_of_sample] = True
    boundary[total] = True
    change = np.ones(total + 1, dtype=bool)
    change[1:total] = token_type[1:] != token_type[:-1]
    change |= boundary
    vision = token_type != 0
    run_start = np.flatnonzero(vision & change[:-1])
    run_end = np.flatnonzero(vision & change[1:]) + 1
    run_len = run_end - run_start
    run_kind = token_type[run_start]
    run_sample = sample_of[run_start]
    num_runs = run_start.size

    run_h = np.zeros(num_runs, np.int64)
    run_w = np.zeros(num_runs, np.int64)
    run_interval = np.ones(num_runs, np.float64)
    run_mode = np.zeros(num_runs, np.int8)
    for kind, items, counts, name in ((1, images, image_counts, "image"), (2, videos, video_counts, "video")):
        sel = run_kind == kind
        _check_runs(family, kind, name, counts, items, run_sample[sel], run_len[sel], n, hint)
        run_h[sel], run_w[sel] = items.h, items.w
        run_interval[sel], run_mode[sel] = items.interval, items.mode

    # running position p: exclusive cumsum of the advance, restarted per sample
    advance = (~vision).astype(np.int64)
    advance[run_end - 1] += np.maximum(run_h, run_w)
    excl = np.cumsum(advance) - advance
    base = excl - excl[starts_of_sample][sample_of]
    positions = np.empty((3, total), dtype=np.int64)
    positions[:] = base

    if num_runs:
        tokens = np.flatnonzero(vision)  # runs in stream order, so tokens[j] lies in run run_of[j]
        run_of = np.repeat(np.arange(num_runs, dtype=np.int64), run_len)
        k = tokens - run_start[run_of]
        h, w = run_h[run_of], run_w[run_of]
        ti = k // (h * w)
        positions[0, tokens] += _temporal(ti, run_of, run_interval, run_mode)
        positions[1, tokens] += (k // w) % h
        positions[2, tokens] += k % w

    # get_rope_index's second output: max position over the sample's real tokens + 1 - s
    masked = np.where(real, positions.max(axis=0), np.iinfo(np.int64).min)
    rope_deltas = np.maximum.reduceat(masked, starts_of_sample) + 1 - seq_lens if n else np.zeros(0, np.int64)
    return StreamRope(positions=positions, token_type=token_type, rope_deltas=rope_deltas)


def _temporal(ti: np.ndarray, run_of: np.ndarray, interval: np.ndarray, mode: np.ndarray) -> np.ndarray:
    """``trunc(ti · interval)`` in the arithmetic torch uses in ``get_rope_index``."""
    if not mode.any() and np.all(interval == 1.0):
        return ti
    iv = interval[run_of]
    md = mode[run_of]
    out = ti * iv.astype(np.int64)  # MODE_INT: interval is an integer
    f32 = md == MODE_F32
    if f32.any():
        out[f32] = (ti[f32].astype(np.float32) * iv[f32].astype(np.float32)).astype(np.int64)
    f64 = md == MODE_F64
    if f64.any():
        out[f64] = (ti[f64].astype(np.float64) * iv[f64]).astype(np.int64)
    return out


def _check_runs(family, kind, name, counts, items, run_sample, run_len, n, hint) -> None:
    token_id = family.image_token_id if kind == 1 else family.video_token_id
    grid_field = "image_grid_thw" if kind == 1 else "video_grid_thw"
    frames = kind == 2 and bool(getattr(family, "VIDEO_FRAMES_ARE_ITEMS", False))
    have = np.bincount(run_sample, minlength=n) if run_sample.size else np.zeros(n, np.int64)
    want = np.asarray(counts, dtype=np.int64)
    bad = np.flatnonzero(have != want)
    if bad.size:
        i = int(bad[0])
        unit = f"{name} frames (this family separates video frames with timestamp text)" if frames else f"{name}s"
        raise ValueError(
            f"sample {i}: its input_ids have {int(have[i])} run(s) of {name} placeholder tokens (id {token_id}) "
            f"but its '{grid_field}' describes {int(want[i])} {unit}; every {name}"
            f"{' frame' if frames else ''} needs exactly one contiguous run of placeholders{hint}"
        )
    tokens = items.tokens
    mismatch = np.flatnonzero(run_len != tokens)
    if mismatch.size:
        j = int(mismatch[0])
        i = int(run_sample[j])
        src = int(items.source[j])
        t, h, w = (int(v) for v in items.grid[j])
        m = family.spatial_merge_size
        where = f"{name} {src}" + (f" frame {int(items.frame[j])}" if items.frame[j] >= 0 else "")
        formula = f"{h}·{w}/{m}² = {int(tokens[j])} per frame" if frames else f"{t}·{h}·{w}/{m}² = {int(tokens[j])}"
        raise ValueError(
            f"sample {i}: {where} has {int(run_len[j])} placeholder tokens (id {token_id}) in input_ids "
            f"but its {grid_field} row [{t}, {h}, {w}] gives {formula}{hint}"
        )
