"""The family's own transformers video processor, constructed locally, and the choice of backend.

:func:`prepare_video` turns one video file into :class:`~thdpack.offline.vision.video.VideoPatches`
with the backend that ``video: {backend: ...}`` resolved to (:func:`resolve_backend`):

- ``processor``: the class ``AutoVideoProcessor`` maps the config's ``model_type`` to
  (transformers' ``VIDEO_PROCESSOR_MAPPING_NAMES``: Qwen2VLVideoProcessor for Qwen2-VL and
  Qwen2.5-VL, Qwen3VLVideoProcessor for Qwen3-VL and Qwen3.5), built with
  ``size = {shortest_edge: min_pixels, longest_edge: max_pixels}``, the patch, temporal patch
  and merge sizes, ``fps``, ``min_frames``, ``max_frames`` and ``cap_pixels_per_frame=False``
  (the processors' current default, stated to silence their warning). Frames: a processor
  that samples (``do_sample_frames``, Qwen3) picks the indices with its own ``sample_frames``;
  Qwen2VLVideoProcessor samples none, so the indices are qwen-vl-utils' (as for ``builtin``).
  Only the sampled frames are converted to RGB and handed over (``do_sample_frames=False``,
  with the metadata their indices). ``second_per_grid_ts`` is ``temporal / sampled_fps`` of
  that metadata (Qwen2.5-VL's processor), the timestamps Qwen3-VL's processor's
  ``_calculate_timestamps``;
- ``builtin``: :func:`~thdpack.offline.vision.video.builtin_patches`.

``auto`` takes ``processor`` where the class imports (torchvision loads) and ``builtin``
elsewhere; ``processor`` where it does not is a configuration error saying why.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import numpy as np

from thdpack.offline.vision.video import (
    VideoGeometry, VideoOptions, VideoPatches, builtin_patches, decode_video, frame_cap, resize_error, sample_indices,
    too_short, video_rule,
)


@functools.lru_cache(maxsize=None)
def processor_class(model_type: str):
    """``(class, None)``: the family's transformers video processor class, or ``(None, why)``
    when it cannot be loaded here (no mapping for the family, or torchvision does not import)."""
    try:
        from transformers.models.auto.video_processing_auto import (
            VIDEO_PROCESSOR_MAPPING_NAMES, video_processor_class_from_name,
        )

        name = (VIDEO_PROCESSOR_MAPPING_NAMES.get(model_type) or {}).get("torchvision")
        if name is None:
            return None, f"transformers has no video processor for model_type {model_type!r}"
        import torchvision  # noqa: F401 - the processors' resize; PyPI's wheels fail beside torch's CPU build

        cls = video_processor_class_from_name(name)
    except Exception as exc:  # noqa: BLE001 - ImportError, or torchvision's RuntimeError (operator ... does not exist)
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if cls is None:
        return None, f"transformers' {name} does not load"
    return cls, None


def resolve_backend(opts: VideoOptions, model_type: str) -> VideoOptions:
    """``opts`` checked for the family, with ``backend`` ``auto`` resolved to ``processor`` or
    ``builtin``; ValueError for ``processor`` where the family's processor does not load."""
    opts.check(video_rule(model_type), model_type)
    cls, why = processor_class(model_type)
    if opts.backend == "processor" and cls is None:
        raise ValueError(f"video: backend 'processor' needs transformers' video processor for {model_type}, which "
                         f"does not load here ({why}); install torchvision for your torch, or use backend: builtin")
    if opts.backend == "auto":
        return replace(opts, backend="builtin" if cls is None else "processor")
    return opts


@functools.lru_cache(maxsize=8)
def build_processor(opts: VideoOptions, geo: VideoGeometry):
    """The family's video processor, constructed from the build's settings (no hub, no file)."""
    cls, why = processor_class(geo.model_type)
    if cls is None:
        raise ValueError(f"video: transformers' video processor for {geo.model_type} does not load here ({why})")
    min_px, max_px = opts.pixel_bounds(geo.patch * geo.merge)
    return cls(size={"shortest_edge": min_px, "longest_edge": max_px}, patch_size=geo.patch,
               temporal_patch_size=geo.temporal, merge_size=geo.merge, fps=opts.fps, min_frames=opts.min_frames,
               max_frames=opts.max_frames, cap_pixels_per_frame=False)


def processor_patches(path: Path, name: str, opts: VideoOptions, geo: VideoGeometry) -> VideoPatches:
    """One video file as :class:`VideoPatches`, by the family's transformers video processor."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    proc = build_processor(opts, geo)
    frames, video_fps = decode_video(path, name)
    total, h0, w0 = len(frames), frames[0].height, frames[0].width
    meta = VideoMetadata(total_num_frames=total, fps=video_fps, width=w0, height=h0, video_backend="pyav")
    if proc.do_sample_frames:
        idx = np.asarray(proc.sample_frames(meta), np.int64)
        if len(idx) < geo.temporal:
            raise too_short(total, geo.temporal, name)
    else:
        idx = sample_indices(total, video_fps, opts, geo.temporal, name, video_rule(geo.model_type))
    meta.frames_indices = idx.tolist()
    rgb = np.stack([frames[i].to_ndarray(format="rgb24") for i in meta.frames_indices])  # uint8 [n, H, W, 3]
    with resize_error(name, w0, h0):
        out = proc(videos=[rgb], video_metadata=[meta], do_sample_frames=False, return_metadata=True,
                   **_size(opts, geo, len(idx)))
    meta = out["video_metadata"][0]
    stamps = Qwen3VLProcessor._calculate_timestamps(None, list(meta.frames_indices), meta.fps, geo.temporal)
    return VideoPatches(out["pixel_values_videos"].numpy(), out["video_grid_thw"][0].numpy().astype(np.int64),
                        geo.temporal / meta.sampled_fps, stamps, idx)


def _size(opts: VideoOptions, geo: VideoGeometry, n: int) -> dict:
    """The processor call's ``size`` argument: qwen-vl-utils' per-frame cap of ``total_pixels``
    (Qwen2-VL / Qwen2.5-VL, when set; :func:`~thdpack.offline.vision.video.frame_size`), else none (its own)."""
    if opts.total_pixels is None:
        return {}
    min_px, max_px = opts.pixel_bounds(geo.patch * geo.merge)
    return {"size": {"shortest_edge": min_px, "longest_edge": frame_cap(opts, n, geo.temporal, min_px, max_px)}}


def prepare_video(path: Path, name: str, opts: VideoOptions, geo: VideoGeometry) -> VideoPatches:
    """One video file as :class:`VideoPatches`, by the backend ``opts`` resolved to
    (:func:`resolve_backend`; an unresolved ``auto`` is resolved here)."""
    if opts.backend == "auto":
        opts = resolve_backend(opts, geo.model_type)
    if opts.backend == "processor":
        return processor_patches(path, name, opts, geo)
    return builtin_patches(path, name, opts, geo)
