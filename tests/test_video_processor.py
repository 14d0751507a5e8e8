"""thdpack's two video backends against transformers' own Qwen video processors, constructed locally.

The processors need torchvision, which does not load beside this project's CPU torch, so
the check runs in a second environment (``tests/video_env.py``: made on first use, about
two minutes and 5.6 GB; cached) through ``tests/video_run.py``. For each family (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, Qwen3.5), three option sets and videos generated there (fractional
and integer frame rates, frame counts that are and are not a multiple of the temporal patch,
a video shorter than ``min_frames``):

- ``builtin`` (numpy + PIL) gives exactly the processor's grid, frame indices,
  ``second_per_grid_ts`` (fractional values kept) and Qwen3 timestamps, and pixel values
  within :data:`PIXEL_ATOL`;
- ``processor`` (:mod:`thdpack.offline.vision.video_processor`) gives exactly the processor's output,
  pixel values included, and is what ``backend: auto`` resolves to there;
- a video shorter than the temporal patch is the same named error in both.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from video_env import run, video_env  # noqa: E402

# (frames, fps, h, w): 6 fps x 8 frames -> 4 sampled, 2/3 s per grid; NTSC rate; 5 frames (Qwen3 pads to 6);
# a downscaled 96 x 160; 61 frames at 30 fps; 3 frames at 1 fps (fewer than min_frames)
VIDEOS = [(8, 6, 16, 20), (10, "30000/1001", 12, 12), (5, 2, 20, 16), (37, 25, 96, 160), (61, 30, 120, 90),
          (3, 1, 64, 64)]
OPTIONS = [{"min_pixels": 16, "max_pixels": 256}, {"min_pixels": 1000, "max_pixels": 20000}, {}]
FAMILIES = {"qwen2_vl": [14, 2, 2], "qwen2_5_vl": [14, 2, 2], "qwen3_vl": [16, 2, 2], "qwen3_5": [16, 2, 2]}
# PIL's bicubic (builtin) and torchvision's antialiased bicubic on uint8 round differently; on random-noise
# frames (the worst case for a resampler) the largest difference measured is 0.1898 in normalized units
# (Qwen2 CLIP std 0.2686: 13 of 255 levels), at the 96 x 160 video resized to 84 x 168; 0.0157 elsewhere
# (Qwen3 std 0.5: 2 levels). Grids, frame choice and timing are exact.
PIXEL_ATOL = 0.2


@pytest.fixture(scope="module")
def processor_results():
    env = video_env()
    if isinstance(env, str):
        pytest.skip(f"no video environment: {env}")
    return run(env, {"videos": VIDEOS, "options": OPTIONS, "families": FAMILIES})


def test_builtin_backend_equals_the_family_video_processor(processor_results):
    cases = processor_results["cases"]
    assert len(cases) == len(FAMILIES) * len(OPTIONS) * len(VIDEOS)
    worst = 0.0
    for c in cases:
        ref, got = c["ref"], c["builtin"]
        for key in ("grid", "indices", "spg", "timestamps"):
            assert got[key] == ref[key], (c["family"], c["video"], c["options"], key)
        assert got["dtype"] == "float32" and got["max_abs_diff"] <= PIXEL_ATOL, c
        worst = max(worst, got["max_abs_diff"])
    assert any(c["ref"]["spg"] != int(c["ref"]["spg"]) for c in cases)  # fractional second_per_grid_ts kept
    assert any(c["ref"]["grid"][0] * 2 > len(c["ref"]["indices"]) for c in cases)  # a padded temporal patch
    print(f"builtin vs processor: max abs pixel difference {worst:.4f}")


def test_processor_backend_is_the_family_video_processor(processor_results):
    for c in processor_results["cases"]:
        ref, got = c["ref"], c["processor"]
        assert got["equal"] and got["max_abs_diff"] == 0.0, c
        for key in ("grid", "indices", "spg", "timestamps"):
            assert got[key] == ref[key], (c["family"], c["video"], key)
    assert processor_results["backend"] == dict.fromkeys(FAMILIES, "processor")  # auto, where torchvision loads


def test_too_short_video_is_the_same_error_in_both_backends(processor_results):
    for e in processor_results["errors"]:
        assert e["builtin"] == e["processor"] == (
            "video 'short.mp4': 1 frame(s), fewer than the temporal patch (2) needs; use a longer video or remove it"), e

