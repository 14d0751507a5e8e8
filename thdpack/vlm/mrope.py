"""mRoPE position ids on the THD stream, straight from the grids.

The Qwen-VL families' ``get_rope_index`` walks one sample at a time: it groups
the sample's tokens into runs of equal ``mm_token_type_ids`` (0 text, 1 image,
2 video) and keeps a running position ``p`` (starting at 0):

- a text run of length ``L`` gets ``p, p+1, …, p+L-1`` on all three rows; ``p += L``;
- a vision run (one item: an image, a video, or a video frame) with LLM grid
  ``(t, h, w)`` gets, for its ``k``-th token (``k = (ti·h + hi)·w + wi``),
  rows ``(p + trunc(ti·interval), p + hi, p + wi)``; then ``p += max(h, w)``
  (convention ``"transformers-4"``: ``p`` becomes one past the item's largest
  position, ``p + max(trunc((t-1)·interval) + 1, h, w)``; see :mod:`thdpack.vlm.convention`).

Here the same is one compiled pass over the whole pack (numba): the runs are found
once on the stream, checked against the grids, and each sample's positions are
written in place; no per-sample Python work and no padded copy.

Pad slots (alignment padding after a sample's real tokens) advance like text:
pad ``j`` of a sample gets ``P + j`` on all three rows, where ``P`` is the
position a next text token of that sample would take. They stay after every
real token of their sample, and carry no loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from thdpack.common.jit import njit
from thdpack.common.samples import SampleError
from thdpack.vlm.items import MODE_F32, MODE_F64, RopeItems
from thdpack.vlm.convention import EXACT, TRANSFORMERS_4


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
    ids = np.ascontiguousarray(input_ids, dtype=np.int64)
    cu = np.ascontiguousarray(cu_seqlens_padded, dtype=np.int64)
    seq_lens = np.ascontiguousarray(seq_lens, dtype=np.int64)
    n = seq_lens.size
    video_id = -1 if family.video_token_id is None else int(family.video_token_id)
    token_type, run_start, run_len, run_sample, bad_pad = _find_runs(ids, cu, seq_lens, int(family.image_token_id), video_id)
    if bad_pad >= 0:
        sample = int(np.searchsorted(cu, bad_pad, side="right") - 1)
        raise ValueError(
            f"pad slot {bad_pad} (after sample {sample}) holds vision token id {int(ids[bad_pad])}: the model "
            "would take it for a placeholder; use a pad_token_id that is not the image or video token id"
        )
    run_kind = token_type[run_start]
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
    past_max = getattr(family, "mrope_convention", EXACT) == TRANSFORMERS_4
    positions, rope_deltas = _positions(
        cu, seq_lens, run_start, run_len, run_h, run_w, run_interval, run_mode, past_max
    )
    return StreamRope(positions=positions, token_type=token_type, rope_deltas=rope_deltas)


@njit
def _find_runs(ids, cu, seq_lens, image_id, video_id):
    """Token types and the runs of equal vision type (never crossing a sample), in
    stream order: ``(token_type int8 [T], run_start, run_len, run_sample, bad_pad)``;
    ``bad_pad`` is the first pad slot holding a vision id, else -1."""
    total = ids.shape[0]
    n = seq_lens.shape[0]
    token_type = np.zeros(total, np.int8)
    run_start = np.empty(total, np.int64)
    run_len = np.empty(total, np.int64)
    run_sample = np.empty(total, np.int64)
    runs = 0
    bad_pad = -1
    for i in range(n):
        a, real_end, end = cu[i], cu[i] + seq_lens[i], cu[i + 1]
        prev = 0
        for t in range(a, real_end):
            kind = 1 if ids[t] == image_id else (2 if ids[t] == video_id else 0)
            token_type[t] = kind
            if kind != 0 and kind != prev:
                run_start[runs] = t
                run_len[runs] = 0
                run_sample[runs] = i
                runs += 1
            if kind != 0:
                run_len[runs - 1] += 1
            prev = kind
        for t in range(real_end, end):
            if bad_pad < 0 and (ids[t] == image_id or ids[t] == video_id):
                bad_pad = t
    return token_type, run_start[:runs].copy(), run_len[:runs].copy(), run_sample[:runs].copy(), bad_pad


@njit
def _temporal_offset(ti, interval, mode):
    """``trunc(ti · interval)`` in the arithmetic torch uses in ``get_rope_index``."""
    if mode == MODE_F32:
        return np.int64(np.float32(ti) * np.float32(interval))
    if mode == MODE_F64:
        return np.int64(np.float64(ti) * interval)
    return ti * np.int64(interval)


@njit
def _positions(cu, seq_lens, run_start, run_len, run_h, run_w, run_interval, run_mode, past_max):
    """One pass per sample: int64 ``[3, T]`` rows and ``[n]`` rope deltas. ``past_max``: after a
    vision run the next position is one past the run's largest (transformers 4.x), else ``p + max(h, w)``."""
    total = cu[cu.shape[0] - 1]
    n = seq_lens.shape[0]
    positions = np.empty((3, total), np.int64)
    deltas = np.zeros(n, np.int64)
    r = 0
    for i in range(n):
        p = 0
        top = -1
        t = cu[i]
        real_end = cu[i] + seq_lens[i]
        while t < real_end:
            if r < run_start.shape[0] and run_start[r] == t:
                h, w, length = run_h[r], run_w[r], run_len[r]
                run_top = p
                for k in range(length):
                    ti = k // (h * w)
                    row = p + _temporal_offset(ti, run_interval[r], run_mode[r])
                    hi = p + (k // w) % h
                    wi = p + k % w
                    positions[0, t + k] = row
                    positions[1, t + k] = hi
                    positions[2, t + k] = wi
                    run_top = max(run_top, max(row, max(hi, wi)))
                top = max(top, run_top)
                t += length
                p = run_top + 1 if past_max else p + max(h, w)
                r += 1
            else:  # text
                positions[0, t] = p
                positions[1, t] = p
                positions[2, t] = p
                top = max(top, p)
                p += 1
                t += 1
        deltas[i] = top + 1 - seq_lens[i]
        for t in range(real_end, cu[i + 1]):  # pad slots advance like text
            positions[0, t] = p
            positions[1, t] = p
            positions[2, t] = p
            p += 1
    return positions, deltas


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
        raise SampleError.at(
            i, f": its input_ids have {int(have[i])} run(s) of {name} placeholder tokens (id {token_id}) "
            f"but its '{grid_field}' describes {int(want[i])} {unit}; every {name}"
            f"{' frame' if frames else ''} needs exactly one contiguous run of placeholders{hint}",
            field='input_ids',
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
        raise SampleError.at(
            i, f": {where} has {int(run_len[j])} placeholder tokens (id {token_id}) in input_ids "
            f"but its {grid_field} row [{t}, {h}, {w}] gives {formula}{hint}",
            field='input_ids',
        )
