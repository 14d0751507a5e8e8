"""Videos of offline VLM builds: decoded with PyAV, then patches, grids and timestamps by the family's own
transformers video processor where it loads, or by a step-for-step copy of it here.

The decoder is PyAV (``av`` on PyPI, in the ``video`` extra): its wheels bundle FFmpeg,
so it installs beside any torch. ``torchcodec`` needs system FFmpeg libraries and a
torch it was built for. Two backends turn the decoded frames into patches
(:func:`prepare_video`; ``video: {backend: auto | processor | builtin}`` in the YAML):

- ``processor``: the family's transformers video processor (``AutoVideoProcessor``'s class
  for the ``model_type``), constructed here from the build's own settings (patch, temporal
  patch, merge size, ``min_pixels`` / ``max_pixels``, fps, min / max frames), never from a
  hub; it needs torchvision, whose PyPI wheels do not load beside the CPU build of torch;
- ``builtin``: the frames prepared here with numpy and PIL, step for step as that video
  processor does it (transformers 5.24, read in ``transformers/models/``; :func:`video_rule`
  picks the rule by ``model_type``); same grids, frame indices, ``second_per_grid_ts`` and
  timestamps, pixel values within the resampler's rounding (PIL's bicubic for
  torchvision's: ``tests/test_video_processor.py`` measures it);
- ``auto`` (the default): ``processor`` when it loads, else ``builtin``.

Details: docs/build.md, "Videos: the frame and size rules of each family".
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

# the video processors' defaults (fps, min_frames, max_frames; both families) and their size
# bounds in units of (patch · merge)²: 128 and 768 "tokens" of 28² (Qwen2/2.5-VL: per frame)
# or 32² (Qwen3-VL / Qwen3.5: the whole video)
DEFAULT_FPS = 2.0
DEFAULT_MIN_FRAMES = 4
DEFAULT_MAX_FRAMES = 768
MIN_TOKENS = 128
MAX_TOKENS = 768
QWEN3_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")  # auto: Qwen3VLVideoProcessor
BACKENDS = ("auto", "processor", "builtin")


@dataclass(frozen=True)
class VideoRule:
    """The family's transformers video processor: ``whole_video`` (Qwen3VLVideoProcessor:
    frames not floored to the temporal patch, pixel bounds over ``t · h · w``) or not
    (Qwen2VLVideoProcessor), and its normalisation."""

    whole_video: bool
    mean: tuple
    std: tuple


def video_rule(model_type: str) -> VideoRule:
    """The :class:`VideoRule` of a family (``model_type`` of its config): the class
    attributes ``image_mean`` / ``image_std`` of its video processor, from transformers'
    ``image_utils`` (Qwen3VLVideoProcessor: IMAGENET_STANDARD; Qwen2VLVideoProcessor: OPENAI_CLIP)."""
    from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    if model_type in QWEN3_MODEL_TYPES:
        return VideoRule(True, tuple(IMAGENET_STANDARD_MEAN), tuple(IMAGENET_STANDARD_STD))
    return VideoRule(False, tuple(OPENAI_CLIP_MEAN), tuple(OPENAI_CLIP_STD))


@dataclass(frozen=True)
class VideoOptions:
    """How a video becomes frames (see the module docstring); pixel bounds of None take
    the video processor's defaults for the family's ``patch_size · merge_size``;
    ``total_pixels`` (Qwen2-VL / Qwen2.5-VL only) turns on qwen-vl-utils' per-frame cap;
    ``backend``: who cuts the patches (see the module docstring)."""

    fps: float = DEFAULT_FPS
    min_frames: int = DEFAULT_MIN_FRAMES
    max_frames: int = DEFAULT_MAX_FRAMES
    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None
    backend: str = "auto"

    @classmethod
    def from_config(cls, spec) -> "VideoOptions":
        """The options of the YAML ``video`` mapping, or of that mapping written as YAML
        (``--video '{fps: 1}'``); None: the defaults."""
        if isinstance(spec, str):
            import yaml

            spec = yaml.safe_load(spec)
        if spec is not None and not isinstance(spec, dict):
            raise ValueError(f"video: a mapping of frame options (fps, min_frames, ...) expected, got {spec!r}")
        spec = dict(spec or {})
        unknown = sorted(set(spec) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"video: unknown option(s) {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        opts = cls(**spec)
        if not opts.fps > 0 or opts.min_frames < 1 or opts.max_frames < opts.min_frames:
            raise ValueError(f"video: need fps > 0 and 1 <= min_frames <= max_frames, got {spec}")
        if opts.backend not in BACKENDS:
            raise ValueError(f"video: backend must be one of {list(BACKENDS)}, got {opts.backend!r}")
        return opts

    def pixel_bounds(self, factor: int) -> tuple[int, int]:
        """``(min_pixels, max_pixels)`` for spatial factor ``patch · merge``."""
        f2 = factor * factor
        return self.min_pixels or MIN_TOKENS * f2, self.max_pixels or MAX_TOKENS * f2

    def check(self, rule: VideoRule, model_type: str) -> None:
        """Raise ValueError for an option the family's video processor has no use for."""
        if rule.whole_video and self.total_pixels is not None:
            raise ValueError(f"video: total_pixels is for Qwen2-VL / Qwen2.5-VL; {model_type}'s max_pixels already "
                             "bounds the whole video (t·h·w): remove total_pixels")


@dataclass
class Video:
    """One decoded and sampled video: ``frames`` uint8 ``[n, H, W, 3]`` (RGB), the
    ``indices`` (int64 ``[n]``) they had in the file, and the file's frame rate."""

    frames: np.ndarray
    indices: np.ndarray
    video_fps: float
    total_frames: int

    @property
    def sampled_fps(self) -> float:
        return len(self.indices) / self.total_frames * self.video_fps


@dataclass(frozen=True)
class VideoGeometry:
    """How the family's vision tower cuts a video: ``model_type`` (picks the video processor),
    spatial ``patch``, ``temporal`` patch and ``merge`` size."""

    model_type: str
    patch: int
    temporal: int
    merge: int


@dataclass
class VideoPatches:
    """One video as the model takes it: ``pixel_values`` float32 ``[t·h·w, 3·temporal·patch²]``,
    ``grid`` int64 ``[3]`` (t, h, w), ``second_per_grid_t`` (temporal / sampled fps, seconds),
    ``timestamps`` (seconds of each of the ``t`` temporal patches) and the sampled frame ``indices``
    (int64 ``[n]``)."""

    pixel_values: np.ndarray
    grid: np.ndarray
    second_per_grid_t: float
    timestamps: list
    indices: np.ndarray


def decode_video(path: Path, name: str) -> tuple[list, float]:
    """All frames of the video file at ``path`` (``av.VideoFrame``, still in the file's pixel
    format: an RGB copy is made only of the frames sampled) and its frame rate.
    Raises ValueError naming the video (``name``) when it cannot be read or has no frame."""
    import av

    if not Path(path).is_file():
        raise ValueError(f"video {name!r} not found (looked at {path})")
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:  # what an mp4 written without any frame reads as
                raise ValueError(f"video {name!r} has no frames (no video stream)")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            frames = list(container.decode(stream))
    except (av.error.FFmpegError, OSError, EOFError) as exc:
        raise ValueError(f"video {name!r} cannot be decoded ({exc}); check the file") from None
    if not frames:
        raise ValueError(f"video {name!r} has no frames")
    return frames, float(rate) if rate else 24.0


def too_short(total: int, temporal: int, name: str) -> ValueError:
    """The error of a video whose sampled frames cannot fill one temporal patch."""
    return ValueError(f"video {name!r}: {total} frame(s), fewer than the temporal patch ({temporal}) needs; "
                      "use a longer video or remove it")


def sample_indices(total: int, video_fps: float, opts: VideoOptions, temporal: int, name: str,
                   rule: VideoRule | None = None) -> np.ndarray:
    """int64 ``[n]`` frame indices: Qwen3VLVideoProcessor's ``sample_frames`` (``rule.whole_video``)
    or qwen-vl-utils' ``smart_nframes``."""
    if rule is not None and rule.whole_video:
        n = min(max(int(total / video_fps * opts.fps), opts.min_frames), opts.max_frames, total)
    else:
        lo = math.ceil(opts.min_frames / temporal) * temporal
        hi = math.floor(min(opts.max_frames, total) / temporal) * temporal
        n = total / video_fps * opts.fps
        n = math.floor(min(max(n, lo), hi) / temporal) * temporal
    if not temporal <= n <= total:
        raise too_short(total, temporal, name)
    return np.linspace(0, total - 1, n).round().astype(np.int64)


def frame_size(height: int, width: int, n: int, opts: VideoOptions, factor: int, temporal: int,
               rule: VideoRule | None = None) -> tuple[int, int]:
    """``(h, w)`` every one of the ``n`` frames is resized to: transformers' own ``smart_resize``
    of the family's video processor (see the module docstring)."""
    min_px, max_px = opts.pixel_bounds(factor)
    if rule is not None and rule.whole_video:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as video_resize

        return video_resize(n, height, width, temporal_factor=temporal, factor=factor, min_pixels=min_px,
                            max_pixels=max_px)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    if opts.total_pixels is not None:
        max_px = frame_cap(opts, n, temporal, min_px, max_px)
    return smart_resize(height, width, factor=factor, min_pixels=min_px, max_pixels=max_px)


def frame_cap(opts: VideoOptions, n: int, temporal: int, min_px: int, max_px: int) -> float:
    """qwen-vl-utils' per-frame pixel cap of ``opts.total_pixels`` over ``n`` frames (Qwen2-VL / Qwen2.5-VL)."""
    return max(min(max_px, opts.total_pixels / n * temporal), int(min_px * 1.05))


def load_video(path: Path, name: str, opts: VideoOptions, temporal: int, factor: int,
               rule: VideoRule | None = None) -> Video:
    """The sampled frames of one video file, resized (bicubic) to :func:`frame_size`;
    ``rule``: the family's :func:`video_rule` (None: Qwen2-VL's)."""
    from PIL import Image

    frames, video_fps = decode_video(path, name)
    idx = sample_indices(len(frames), video_fps, opts, temporal, name, rule)
    h0, w0 = frames[0].height, frames[0].width
    with resize_error(name, w0, h0):
        h, w = frame_size(h0, w0, len(idx), opts, factor, temporal, rule)
    out = np.stack([np.asarray(frames[i].to_image().resize((w, h), Image.BICUBIC)) for i in idx.tolist()])
    return Video(out, idx, video_fps, len(frames))


@contextmanager
def resize_error(name: str, width: int, height: int):
    """Re-raise smart_resize's ValueError (an aspect ratio over 200, ...) naming the video."""
    try:
        yield
    except ValueError as exc:
        raise ValueError(f"video {name!r} ({width} x {height}) cannot be resized: {exc}") from None


def video_patches(frames: np.ndarray, mean, std, patch: int, merge: int, temporal: int) -> tuple[np.ndarray, np.ndarray]:
    """``(pixel_values_videos, grid)``: float32 ``[t·h·w, 3·temporal·patch²]`` and int64
    ``[3]`` of uint8 frames ``[n, H, W, 3]``, in the Qwen video processors' patch order
    (the last frame repeated up to a multiple of ``temporal``)."""
    x = frames.astype(np.float32) / 255.0
    x = (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    x = x.transpose(0, 3, 1, 2)  # [n, C, H, W]
    if pad := -x.shape[0] % temporal:
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
    n, c, hh, ww = x.shape
    gt, gh, gw = n // temporal, hh // patch, ww // patch
    x = x.reshape(gt, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(gt * gh * gw, c * temporal * patch * patch)), np.array([gt, gh, gw], np.int64)


def frame_timestamps(video: Video, temporal: int) -> list[float]:
    """Seconds of every temporal patch (Qwen3-VL's ``_calculate_timestamps``): the mean
    of its first and last frame's ``index / video_fps`` (indices padded like the frames)."""
    idx = video.indices.tolist()
    if pad := -len(idx) % temporal:
        idx += [idx[-1]] * pad
    t = [i / video.video_fps for i in idx]
    return [(t[i] + t[i + temporal - 1]) / 2 for i in range(0, len(t), temporal)]


def builtin_patches(path: Path, name: str, opts: VideoOptions, geo: VideoGeometry) -> VideoPatches:
    """One video file as :class:`VideoPatches`, prepared here (the ``builtin`` backend)."""
    rule = video_rule(geo.model_type)
    video = load_video(path, name, opts, geo.temporal, geo.patch * geo.merge, rule)
    pv, grid = video_patches(video.frames, rule.mean, rule.std, geo.patch, geo.merge, geo.temporal)
    return VideoPatches(pv, grid, geo.temporal / video.sampled_fps, frame_timestamps(video, geo.temporal), video.indices)


def cut_to_budget(video: VideoPatches, budget: int, temporal: int, name: str) -> tuple[VideoPatches, int]:
    """``(video, temporal patches cut)``: ``video`` with its first temporal patches that fit in
    ``budget`` vision patches (all of them when they do). The patch rows are in temporal order,
    so the first ``k`` temporal patches are the first ``k · h · w`` rows and ``k · temporal``
    frames; the sampling rate, and so ``second_per_grid_t``, stays the whole video's."""
    have, per_grid = int(video.grid[0]), int(video.grid[1] * video.grid[2])
    keep = min(have, max(budget, 0) // per_grid)
    if keep < 1:
        raise ValueError(f"video {name!r}: one temporal patch of it ({per_grid} vision patches) does not fit in "
                         f"vision_budget ({budget} left for it); use a larger vision_budget or smaller max_pixels")
    if keep == have:
        return video, 0
    grid = np.array([keep, video.grid[1], video.grid[2]], np.int64)
    return replace(video, pixel_values=video.pixel_values[: keep * per_grid], grid=grid,
                   timestamps=video.timestamps[:keep], indices=video.indices[: keep * temporal]), have - keep
