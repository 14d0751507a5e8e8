"""Run in the video environment (``tests/video_env.py``): transformers' own Qwen video processors
against thdpack's two video backends, on videos generated here.

stdin: ``{"videos": [[frames, fps, h, w], ...], "options": [{VideoOptions}, ...],
"families": {model_type: [patch, temporal, merge], ...}}`` (fps: a number or ``"num/den"``).
stdout (last line): ``{"cases": [...], "errors": [...], "backend": {model_type: resolved}}``, a
case per family x options x video with what the processor gave (``ref``), what
:func:`~thdpack.offline.vision.video.builtin_patches` and
:func:`~thdpack.offline.vision.video_processor.processor_patches` gave, and the largest absolute
difference of their pixel values from the processor's.

The reference is the processor alone, constructed here by class name: Qwen3VLVideoProcessor
(Qwen3-VL, Qwen3.5) gets every decoded frame with its ``VideoMetadata`` and samples them itself;
Qwen2VLVideoProcessor (Qwen2-VL, Qwen2.5-VL) samples none by default, so it gets the frames of
qwen-vl-utils' ``smart_nframes``, written out below. ``second_per_grid_ts`` is
``temporal / metadata.sampled_fps`` (Qwen2_5_VLProcessor), the timestamps
``Qwen3VLProcessor._calculate_timestamps`` of the returned metadata.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from transformers import Qwen2VLVideoProcessor, Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.video_utils import VideoMetadata

from thdpack.demo.videos import write_video
from thdpack.offline.vision.video import VideoGeometry, VideoOptions, builtin_patches
from thdpack.offline.vision.video_processor import processor_patches, resolve_backend

QWEN3 = ("qwen3_vl", "qwen3_5")


def decode(path: Path) -> tuple[np.ndarray, float]:
    """uint8 ``[n, H, W, 3]`` RGB frames and the frame rate of a video file."""
    with av.open(str(path)) as c:
        s = c.streams.video[0]
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(s)]), float(s.average_rate)


def smart_nframes(total: int, video_fps: float, opts: VideoOptions, temporal: int) -> list[int]:
    """qwen-vl-utils' frame choice: ``total / video_fps · fps`` clamped and floored to the temporal patch."""
    lo = math.ceil(opts.min_frames / temporal) * temporal
    hi = math.floor(min(opts.max_frames, total) / temporal) * temporal
    n = math.floor(min(max(total / video_fps * opts.fps, lo), hi) / temporal) * temporal
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


def reference(path: Path, family: str, opts: VideoOptions, geo: VideoGeometry) -> dict:
    """What the family's transformers video processor gives for the video, on its own."""
    frames, fps = decode(path)
    factor = geo.patch * geo.merge
    min_px, max_px = opts.pixel_bounds(factor)
    cls = Qwen3VLVideoProcessor if family in QWEN3 else Qwen2VLVideoProcessor
    proc = cls(size={"shortest_edge": min_px, "longest_edge": max_px}, patch_size=geo.patch,
               temporal_patch_size=geo.temporal, merge_size=geo.merge, fps=opts.fps, min_frames=opts.min_frames,
               max_frames=opts.max_frames, cap_pixels_per_frame=False)
    meta = VideoMetadata(total_num_frames=len(frames), fps=fps)
    if family in QWEN3:
        out = proc(videos=[frames], video_metadata=[meta], return_metadata=True)
    else:
        meta.frames_indices = smart_nframes(len(frames), fps, opts, geo.temporal)
        out = proc(videos=[frames[meta.frames_indices]], video_metadata=[meta], return_metadata=True)
    meta = out["video_metadata"][0]
    idx = [int(i) for i in meta.frames_indices]
    return {"pixels": out["pixel_values_videos"].numpy(), "grid": out["video_grid_thw"][0].tolist(),
            "spg": geo.temporal / meta.sampled_fps, "timestamps": Qwen3VLProcessor._calculate_timestamps(
                None, list(idx), meta.fps, geo.temporal), "indices": idx}


def ours(video) -> dict:
    return {"pixels": video.pixel_values, "grid": video.grid.tolist(), "spg": video.second_per_grid_t,
            "timestamps": list(video.timestamps), "indices": video.indices.tolist()}


def case(path: Path, family: str, opts: VideoOptions, geo: VideoGeometry) -> dict:
    ref = reference(path, family, opts, geo)
    got = {"builtin": ours(builtin_patches(path, path.name, opts, geo)),
           "processor": ours(processor_patches(path, path.name, opts, geo))}
    out = {"family": family, "video": path.name, "options": opts.max_pixels,
           "ref": {k: v for k, v in ref.items() if k != "pixels"}}
    for name, g in got.items():
        same_shape = g["pixels"].shape == ref["pixels"].shape
        out[name] = {k: v for k, v in g.items() if k != "pixels"}
        out[name]["dtype"] = str(g["pixels"].dtype)
        out[name]["max_abs_diff"] = float(np.abs(g["pixels"] - ref["pixels"]).max()) if same_shape else None
        out[name]["equal"] = bool(same_shape and np.array_equal(g["pixels"], ref["pixels"]))
    return out


def error_of(fn, *args) -> str:
    try:
        fn(*args)
    except ValueError as exc:
        return str(exc)
    return "no error"


def main() -> None:
    tasks = json.loads(sys.stdin.read())
    d = Path(tempfile.mkdtemp())
    paths = []
    for i, (n, fps, h, w) in enumerate(tasks["videos"]):
        paths.append(d / f"v{i}.mp4")
        write_video(paths[-1], n, Fraction(str(fps)), h, w, seed=i)
    write_video(d / "short.mp4", 1, 6, 16, 16)
    cases, errors, backends = [], [], {}
    for family, (patch, temporal, merge) in tasks["families"].items():
        geo = VideoGeometry(family, patch, temporal, merge)
        backends[family] = resolve_backend(VideoOptions(), family).backend
        for spec in tasks["options"]:
            opts = VideoOptions(**spec)
            cases += [case(p, family, opts, geo) for p in paths]
        opts = VideoOptions(**tasks["options"][0])
        errors.append({"family": family, "builtin": error_of(builtin_patches, d / "short.mp4", "short.mp4", opts, geo),
                       "processor": error_of(processor_patches, d / "short.mp4", "short.mp4", opts, geo)})
    print(json.dumps({"cases": cases, "errors": errors, "backend": backends}))


if __name__ == "__main__":
    main()
