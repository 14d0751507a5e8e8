"""Read-back of a VLM pack: each sample's images and videos out of a packed row.

A packed row (:mod:`thdpack.offline.store.vision_columns`) holds the pack's ``pixel_values``
(float32, ``[P_pack, pixel_dim]`` row-major), ``image_grid_thw`` (3 int32 per image) and
``image_counts`` (images of each sample), and the same for videos. :func:`add_vision`
hands every sample of :func:`thdpack.offline.unpack_row` its own tensors back (one writable
copy of the pack's pixels, or, for the collator, which concatenates them into the batch's
own copy anyway, read-only views of the row: one copy of a pack's pixels, not two);
:func:`all_image_grids` reads every image grid of a packed dataset (the FLOPs report).
"""

from __future__ import annotations

import warnings

import numpy as np

from thdpack.offline.store.schema import row_list


def add_vision(samples: list[dict], row, *, copy: bool = True) -> list[dict]:
    """Give every sample of a packed row (:func:`thdpack.offline.unpack_row`) its
    ``pixel_values`` (float32 tensor ``[P_i, pixel_dim]``) and ``image_grid_thw`` (int64
    tensor ``[k_i, 3]``), and for videos ``pixel_values_videos``, ``video_grid_thw`` and
    ``second_per_grid_ts`` (float32 tensor ``[v_i]``); samples without them get neither.
    ``copy=False``: the pixel tensors are views of the row's arrays, read-only memory for a
    memory-mapped data file: never to be written (the collator only concatenates them)."""
    import torch

    counts = _add_kind(samples, row, "image_counts", "image_grid_thw", "pixel_values", copy)
    if "video_counts" in row:  # datasets built before videos have no video columns
        counts = _add_kind(samples, row, "video_counts", "video_grid_thw", "pixel_values_videos", copy)
        spg = np.asarray(row["second_per_grid_ts"], dtype=np.float32).reshape(-1)
        if spg.size != int(counts.sum()):
            raise ValueError(f"packed row: video_counts sum to {int(counts.sum())} but second_per_grid_ts "
                             f"has {spg.size} values")
        first = np.zeros(counts.size + 1, np.int64)
        np.cumsum(counts, out=first[1:])
        for i, s in enumerate(samples):
            if counts[i]:
                s["second_per_grid_ts"] = torch.from_numpy(spg[first[i]: first[i + 1]].copy())
    if "audio_counts" in row:  # an omni build's audio clips (store/audio_columns.py)
        from thdpack.offline.store.audio_columns import add_audio

        add_audio(samples, row, copy=copy)
    return samples


def _add_kind(samples: list[dict], row, count_col: str, grid_col: str, pixel_col: str, copy: bool) -> np.ndarray:
    """Give the samples their ``grid_col`` / ``pixel_col`` tensors of one kind (images or
    videos) from a packed row (pixels: slices of one writable copy of the pack's, or with
    ``copy=False`` of the row's array); returns int64 ``[n]`` items of each sample."""
    import torch

    counts = row_list(row[count_col], count_col).astype(np.int64)
    if counts.size != len(samples):
        raise ValueError(f"packed row: {count_col} has {counts.size} entries for {len(samples)} samples")
    if not counts.any():
        return counts
    grids = row_list(row[grid_col], grid_col).astype(np.int64).reshape(-1, 3)
    if grids.shape[0] != int(counts.sum()):
        raise ValueError(f"packed row: {count_col} sum to {int(counts.sum())} but {grid_col} has {grids.shape[0]} items")
    patches = grids.prod(axis=1)
    total = int(patches.sum())
    pv = np.asarray(row[pixel_col])
    if pv.dtype != np.float32 or pv.size % total:
        raise ValueError(f"packed row: {pixel_col} ({pv.dtype}, {pv.size} values) do not hold {total} patches")
    pv = _pixel_tensor(pv.reshape(total, pv.size // total), copy)
    img = np.zeros(counts.size + 1, np.int64)
    np.cumsum(counts, out=img[1:])
    cum = np.zeros(patches.size + 1, np.int64)
    np.cumsum(patches, out=cum[1:])
    for i, s in enumerate(samples):
        if counts[i]:
            a, b = int(img[i]), int(img[i + 1])
            s[grid_col] = torch.from_numpy(grids[a:b].copy())
            s[pixel_col] = pv[int(cum[a]): int(cum[b])]
    return counts


def _pixel_tensor(pv: np.ndarray, copy: bool):
    """float32 tensor ``[P, pixel_dim]`` of a pack's pixels: a writable copy, or (``copy=False``)
    a view, which torch would warn about when the row is a read-only memory-mapped array."""
    import torch

    if copy:
        return torch.from_numpy(np.array(pv, copy=True))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(pv)


def all_image_grids(ds) -> np.ndarray:
    """int64 ``[N, 3]`` grids of every image of packed dataset ``ds``, pack after pack."""
    parts = []
    for b in range(len(ds._batches)):
        offsets, values = ds._column(b, "image_grid_thw")
        parts.append(np.asarray(values[offsets[0]: offsets[-1]], dtype=np.int64))
    return (np.concatenate(parts) if parts else np.zeros(0, np.int64)).reshape(-1, 3)
