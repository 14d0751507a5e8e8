"""The media stage of an offline VLM build: one row's image and video references ->
pixel values and grids.

A reference is a path (relative ones against ``image_dir``, default the directory of the
row's input file), ``{"path": ...}``, or for images ``{"bytes": ...}`` as ``datasets``'
``Image`` feature stores them. Images are opened with PIL and go through the family's
image processor (:func:`load_image_processor`); videos are decoded and cut into patches
by :mod:`thdpack.offline.vision.video` / :mod:`thdpack.offline.vision.video_processor`. The row
tokenizer (:mod:`thdpack.offline.vision.vlm_rows`) calls :func:`row_images` and
:func:`row_videos` row by row; errors are ``ValueError`` naming the file.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from thdpack.offline.errors import ConfigError

_PROCESSOR_CLASS = "Qwen2VLImageProcessor"  # what every supported family's processor config names


def load_image_processor(opts, model_config: dict, family):
    """The image processor of the vision options ``opts`` (:class:`~thdpack.offline.stage_options.VisionOptions`):
    a local directory (``AutoImageProcessor``, offline), or the family's processor class built from
    ``image_processor`` keyword arguments, with ``patch_size`` / ``temporal_patch_size`` / ``merge_size``
    from the model config."""
    import transformers

    spec = opts.image_processor
    if isinstance(spec, str):
        path = opts.image_processor_path
        if not path.is_dir():
            raise ConfigError(f"image_processor {spec!r}: no such directory ({path})")
        try:
            return transformers.AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"image_processor {spec!r}: cannot load {path} ({exc})") from None
    kwargs = dict(spec or {})
    vc = model_config.get("vision_config") or {}
    defaults = {"patch_size": vc.get("patch_size"), "temporal_patch_size": vc.get("temporal_patch_size"),
                "merge_size": vc.get("spatial_merge_size", family.spatial_merge_size)}
    for k, v in defaults.items():
        if v is not None:
            kwargs.setdefault(k, v)
    from transformers.utils import is_torchvision_available

    name = _PROCESSOR_CLASS if is_torchvision_available() else _PROCESSOR_CLASS + "Pil"
    cls = getattr(transformers, name, None) or getattr(transformers, _PROCESSOR_CLASS)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"image_processor {kwargs}: cannot build {cls.__name__} ({exc})") from None


# ---------------------------------------------------------------------------- references


def resolve_ref(ref, kind: str, base: Path) -> tuple[Path, str]:
    """``(path, name as given)`` of an image / video reference: a path, or ``{"path": ...}``;
    a relative one against ``base``."""
    if isinstance(ref, dict):
        if ref.get("bytes") is not None and kind == "video":
            raise ValueError("a video must be a file path ({'bytes': ...} videos are not supported)")
        ref = ref.get("path")
    if not isinstance(ref, str) or not ref:
        raise ValueError(f"an {kind} must be a path, or {{'bytes': ...}} / {{'path': ...}}, got {ref!r}"
                         if kind == "image" else f"a video must be a path or {{'path': ...}}, got {ref!r}")
    p = Path(ref).expanduser()
    return (p if p.is_absolute() else base / p), ref


def open_image(ref, base: Path, convert_rgb: bool):
    """The PIL image of a reference (``{"bytes": ...}`` or a path, relative to ``base``),
    converted to RGB when ``convert_rgb``."""
    from PIL import Image

    if isinstance(ref, dict) and ref.get("bytes") is not None:
        src, name = io.BytesIO(ref["bytes"]), "image bytes"
    else:
        src, name = resolve_ref(ref, "image", base)
        if not src.is_file():
            raise ValueError(f"image {name!r} not found (looked at {src})")
    try:
        with Image.open(src) as im:
            return im.convert("RGB") if convert_rgb else im.copy()
    except OSError as exc:
        raise ValueError(f"image {name!r} cannot be read ({exc})") from None


# ---------------------------------------------------------------------------- images and videos of a row


def row_images(refs: list, base: Path, processor, pixel_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """``(pixel_values, image_grid_thw)`` of a row's images: float32 ``[P, pixel_dim]``
    (P = Σ t·h·w) and int64 ``[k, 3]``, as the image processor gives them."""
    images = [open_image(r, base, getattr(processor, "do_convert_rgb", True)) for r in refs]
    out = processor(images=images, return_tensors="np")
    pv = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
    grid = np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(-1, 3)
    if pv.ndim != 2 or pv.shape[1] != pixel_dim or pv.shape[0] != int(grid.prod(1).sum()):
        raise ValueError(f"image processor gave pixel_values {pv.shape} for grids {grid.tolist()}")
    return pv, grid


@dataclass
class RowVideos:
    """The processed videos of one row."""

    pixels: np.ndarray  # float32 [P, pixel_dim] every video's patches, in order
    grids: np.ndarray  # int64 [k, 3]
    second_per_grid_ts: np.ndarray  # float32 [k] temporal / sampled fps
    timestamps: list  # per video, seconds of each temporal patch
    patches_cut: int = 0  # temporal patches cut off to fit vision_budget (overflow: truncate)


def row_videos(refs: list, base: Path, vlm, used: int) -> RowVideos:
    """A row's videos decoded, sampled and cut into patches (``vlm``: the build's
    :class:`thdpack.offline.vision.vlm_setup.VlmBuild`). ``used``: vision patches of the row's images.
    Under ``overflow: truncate`` a video that would take the row over ``vision_budget``
    keeps its first temporal patches that fit (at least one, or the row fails)."""
    from thdpack.offline.vision.video import VideoGeometry, cut_to_budget
    from thdpack.offline.vision.video_processor import prepare_video

    proc, fam = vlm.processor, vlm.family
    temporal = int(getattr(proc, "temporal_patch_size", 1) or 1)
    geo = VideoGeometry(fam.model_type, int(proc.patch_size), temporal, fam.spatial_merge_size)
    pv, grids, spg, stamps, cut = [], [], [], [], 0
    for ref in refs:
        path, name = resolve_ref(ref, "video", base)
        video = prepare_video(path, name, vlm.video_options, geo)
        if vlm.overflow == "truncate" and vlm.vision_budget is not None:
            video, k = cut_to_budget(video, vlm.vision_budget - used, temporal, name)
            cut += k
        used += int(video.grid.prod())
        pv.append(video.pixel_values)
        grids.append(video.grid)
        spg.append(video.second_per_grid_t)
        stamps.append(video.timestamps)
    return RowVideos(np.concatenate(pv), np.stack(grids), np.asarray(spg, np.float32), stamps, cut)
