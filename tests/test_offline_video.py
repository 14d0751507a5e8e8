"""Offline VLM builds with videos: rows with video paths -> thdpack build -> load_packed.

Everything is local: tiny MPEG-4 videos encoded here with PyAV from generated frames,
the demo tokenizer with Qwen-VL's vision tokens (tests/test_offline_vlm.py's assets),
tiny random-weight configs of the four families.

The reference side runs the frame preparation of :mod:`thdpack.offline.video` (checked
on its own against the written-out rules of qwen-vl-utils below), then expands every
``<video>`` itself (Qwen3: timestamps per temporal patch, as the processor writes them)
and tokenizes with transformers' chat template. A pack read from disk must equal
``build_thd_batch`` of those samples, and a tiny model must give each sample's logits.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
av = pytest.importorskip("av")
Image = pytest.importorskip("PIL.Image")

from test_offline_vlm import IGNORE, IMG, MERGE, PATCH, PROC_KW, TPATCH, VE, VID, VISION_TOKENS, VS  # noqa: E402
from test_offline_vlm import assert_model_equivalent as _unused  # noqa: E402,F401
from test_vlm import tiny_config as tiny_vlm_config  # noqa: E402

from thdpack import build_thd_batch  # noqa: E402
from thdpack.cli import main  # noqa: E402
from thdpack.demo import TOKENIZER_DIR  # noqa: E402
from thdpack.offline import BuildConfig, InputError, build_packed, load_packed  # noqa: E402
from thdpack.offline.video import VideoOptions, frame_timestamps, load_video, sample_indices, video_patches  # noqa: E402

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")
VIDEO_OPTS = {"min_pixels": 16, "max_pixels": 256}
# (frames, fps, h, w) of the test videos: fps 6 with 8 frames samples 4 frames, 3 fps -> 2/3 s per grid
VIDEOS = [(8, 6, 16, 20), (10, Fraction(30000, 1001), 12, 12), (5, 2, 20, 16)]
LOGIT_ATOL = 1e-4

ROWS = [
    {"messages": [{"role": "user", "content": "<video>What happens?"},
                  {"role": "assistant", "content": "Noise moves."}], "videos": ["vid/0.mp4"]},
    {"messages": [{"role": "user", "content": "Image <image> then video <video>."},
                  {"role": "assistant", "content": "Both noisy."}], "images": ["img/0.png"], "videos": ["vid/1.mp4"]},
    {"messages": [{"role": "user", "content": "Just text."}, {"role": "assistant", "content": "Fine."}]},
    {"messages": [{"role": "user", "content": [{"type": "video", "video": "vid/2.mp4"},
                                              {"type": "text", "text": "And this one?"}]},
                  {"role": "assistant", "content": "Shorter."}]},
]


def write_video(path, frames: int, fps, h: int, w: int, seed: int = 0) -> None:
    """A small MPEG-4 file of ``frames`` random RGB frames ``h x w`` at ``fps``."""
    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for _ in range(frames):
            img = (rng.random((h, w, 3)) * 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def family_config(family: str) -> dict:
    cfg = tiny_vlm_config(family)
    cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id = IMG, VID, VS, VE
    cfg.text_config.vocab_size = 3080
    if family == "qwen2_5_vl":
        cfg.vision_config.tokens_per_second = 3
    return cfg


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("video")
    tok = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)
    tok.add_tokens(VISION_TOKENS, special_tokens=True)
    tok.save_pretrained(str(d / "tok"))
    (d / "img").mkdir()
    (d / "vid").mkdir()
    Image.fromarray((np.random.default_rng(1).random((12, 8, 3)) * 255).astype(np.uint8)).save(d / "img" / "0.png")
    for i, spec in enumerate(VIDEOS):
        write_video(d / "vid" / f"{i}.mp4", *spec, seed=i)
    write_rows(d / "data.jsonl", ROWS)
    for family in FAMILIES:
        (d / family).mkdir()
        (d / family / "config.json").write_text(json.dumps(family_config(family).to_dict()))
    return d


def write_rows(path, rows) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def cfg(assets, family="qwen2_vl", **kw) -> BuildConfig:
    base = dict(input=str(assets / "data.jsonl"), tokenizer=str(assets / "tok"), model_config=str(assets / family),
                image_processor=dict(PROC_KW), video=dict(VIDEO_OPTS), pack_size=400, vision_budget=400,
                overflow="error")
    base.update(kw)
    return BuildConfig(**base)


# --------------------------------------------------------------------------- frame preparation


def test_sample_indices_follow_qwen_vl_utils():
    """qwen-vl-utils' smart_nframes written out: n = total / fps_video * fps, clamped to
    [ceil(min_frames), floor(min(max_frames, total))] multiples of 2, floored to a multiple of 2."""
    opts = VideoOptions()
    for total, fps in [(8, 6.0), (300, 29.97), (5, 2.0), (2000, 30.0), (3, 1.0)]:
        n = total / fps * 2.0
        n = min(max(n, 4), math.floor(min(768, total) / 2) * 2)
        n = math.floor(n / 2) * 2
        got = sample_indices(total, fps, opts, 2, "v")
        assert got.tolist() == np.linspace(0, total - 1, n).round().astype(int).tolist()
    with pytest.raises(ValueError, match=r"video 'v\.mp4': 1 frame\(s\), fewer than the temporal patch \(2\)"):
        sample_indices(1, 24.0, opts, 2, "v.mp4")


def test_loaded_video_fps_timestamps_and_patches(assets):
    video = load_video(assets / "vid" / "0.mp4", "vid/0.mp4", VideoOptions(**VIDEO_OPTS), TPATCH, PATCH * MERGE)
    assert video.total_frames == 8 and video.video_fps == 6.0
    assert video.indices.tolist() == [0, 2, 5, 7]  # linspace(0, 7, 4).round()
    assert video.sampled_fps == 3.0 and TPATCH / video.sampled_fps == pytest.approx(2 / 3)
    assert frame_timestamps(video, TPATCH) == pytest.approx([(0 + 2 / 6) / 2, (5 / 6 + 7 / 6) / 2])
    h, w = video.frames.shape[1:3]
    assert h % (PATCH * MERGE) == 0 and w % (PATCH * MERGE) == 0 and 16 <= h * w <= 256
    pv, grid = video_patches(video.frames, [0.5] * 3, [0.5] * 3, PATCH, MERGE, TPATCH)
    assert grid.tolist() == [2, h // PATCH, w // PATCH] and pv.shape == (int(grid.prod()), 3 * TPATCH * PATCH * PATCH)
    # the first patch row: frames 0 and 1 (temporal), channel-major, of the top-left 2x2 pixels
    x = (video.frames[:2, :2, :2].astype(np.float32) / 255 - 0.5) / 0.5  # [t, y, x, c]
    np.testing.assert_allclose(pv[0], x.transpose(3, 0, 1, 2).reshape(-1), rtol=0, atol=1e-6)
