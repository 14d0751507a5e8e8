"""Offline VLM builds with videos: rows with video paths -> thdpack build -> load_packed.

Everything is local: tiny MPEG-4 videos encoded here with PyAV from generated frames,
the demo tokenizer with Qwen-VL's vision tokens (tests/test_offline_vlm.py's assets),
tiny random-weight configs of the four families.

The reference side runs the frame preparation of :mod:`thdpack.offline.vision.video` (checked
on its own against the written-out rules of qwen-vl-utils and of transformers' video
processors below), then expands every
``<video>`` itself (Qwen3: timestamps per temporal patch, as the processor writes them)
and tokenizes with transformers' chat template. A pack read from disk must equal
``build_thd_batch`` of those samples, and a tiny model must give each sample's logits.
"""

from __future__ import annotations

import dataclasses
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

from test_offline_vlm import (  # noqa: E402
    IGNORE, IMG, MERGE, PATCH, PROC_KW, TPATCH, VE, VID, VISION_TOKENS, VS, assert_model_equivalent, assert_same_hf_kwargs,
)
from test_vlm import tiny_config as tiny_vlm_config  # noqa: E402

from thdpack import build_thd_batch  # noqa: E402
from thdpack.cli import main  # noqa: E402
from thdpack.demo import TOKENIZER_DIR  # noqa: E402
from thdpack.demo.videos import write_video  # noqa: E402
from thdpack.offline import BuildConfig, InputError, build_packed, load_packed  # noqa: E402
from thdpack.vlm import get_family  # noqa: E402
from thdpack.offline.vision.video import (  # noqa: E402
    VideoOptions, frame_timestamps, load_video, sample_indices, video_patches, video_rule,
)
from thdpack.integrations import to_hf_kwargs

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
    # what transformers' own Qwen3-VL processor and VideoMetadata compute from the same indices
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    meta = VideoMetadata(total_num_frames=8, fps=6.0, frames_indices=video.indices.tolist())
    assert video.sampled_fps == meta.sampled_fps
    assert frame_timestamps(video, TPATCH) == Qwen3VLProcessor._calculate_timestamps(None, video.indices, 6.0, TPATCH)
    odd = dataclasses.replace(video, indices=np.array([0, 2, 5]))  # padded with the last index, as the processor does
    assert frame_timestamps(odd, TPATCH) == Qwen3VLProcessor._calculate_timestamps(None, [0, 2, 5], 6.0, TPATCH)
    h, w = video.frames.shape[1:3]
    assert h % (PATCH * MERGE) == 0 and w % (PATCH * MERGE) == 0 and 16 <= h * w <= 256
    pv, grid = video_patches(video.frames, [0.5] * 3, [0.5] * 3, PATCH, MERGE, TPATCH)
    assert grid.tolist() == [2, h // PATCH, w // PATCH] and pv.shape == (int(grid.prod()), 3 * TPATCH * PATCH * PATCH)
    # the first patch row: frames 0 and 1 (temporal), channel-major, of the top-left 2x2 pixels
    x = (video.frames[:2, :2, :2].astype(np.float32) / 255 - 0.5) / 0.5  # [t, y, x, c]
    np.testing.assert_allclose(pv[0], x.transpose(3, 0, 1, 2).reshape(-1), rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- reference (no thdpack.offline.vision.vlm_setup)


def reference_samples(assets, family: str, rows) -> list[dict]:
    """Each row processed by hand: images by transformers' image processor, videos by
    thdpack.offline.vision.video, every marker expanded here as the family's processor does."""
    tok = transformers.AutoTokenizer.from_pretrained(str(assets / "tok"), local_files_only=True)
    proc = transformers.Qwen2VLImageProcessor(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TPATCH, **PROC_KW)
    frames_are_items = family in ("qwen3_vl", "qwen3_5")
    out = []
    for row in rows:
        sample, texts = {}, {"<image>": [], "<video>": []}
        msgs = [dict(m, content="".join(p.get("text") or ("<video>" if p["type"] == "video" else "<image>")
                                        for p in m["content"]) if isinstance(m["content"], list) else m["content"])
                for m in row["messages"]]
        videos = list(row.get("videos", [])) + [p["video"] for m in row["messages"] if isinstance(m["content"], list)
                                                for p in m["content"] if p["type"] == "video"]
        if row.get("images"):
            enc = proc(images=[Image.open(assets / p).convert("RGB") for p in row["images"]], return_tensors="pt")
            sample["pixel_values"], sample["image_grid_thw"] = enc["pixel_values"], enc["image_grid_thw"]
            texts["<image>"] = [f"<|vision_start|>{'<|image_pad|>' * (int(g.prod()) // MERGE**2)}<|vision_end|>"
                                for g in enc["image_grid_thw"]]
        pvs, grids, spg = [], [], []
        for ref in videos:
            rule = video_rule(family)  # checked against transformers_video below
            v = load_video(assets / ref, ref, VideoOptions(**VIDEO_OPTS), TPATCH, PATCH * MERGE, rule)
            pv, (t, h, w) = video_patches(v.frames, rule.mean, rule.std, PATCH, MERGE, TPATCH)
            pvs.append(pv)
            grids.append([t, h, w])
            spg.append(TPATCH / v.sampled_fps)
            frame = "<|vision_start|>" + "<|video_pad|>" * (h * w // MERGE**2) + "<|vision_end|>"
            if frames_are_items:
                texts["<video>"].append("".join(f"<{s:.1f} seconds>" + frame for s in frame_timestamps(v, TPATCH)))
            else:
                texts["<video>"].append("<|vision_start|>" + "<|video_pad|>" * (t * h * w // MERGE**2) + "<|vision_end|>")
        if videos:
            sample["pixel_values_videos"] = torch.from_numpy(np.concatenate(pvs))
            sample["video_grid_thw"] = torch.tensor(grids)
            sample["second_per_grid_ts"] = torch.tensor(spg, dtype=torch.float32)
        for mark, runs in texts.items():
            it = iter(runs)
            msgs = [dict(m, content=m["content"].split(mark)[0] + "".join(
                next(it) + p for p in m["content"].split(mark)[1:])) for m in msgs]
        enc = tok.apply_chat_template([msgs], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = np.asarray(enc["input_ids"][0]), np.asarray(enc["assistant_masks"][0], bool)
        mask &= (ids != IMG) & (ids != VID)
        sample["input_ids"] = torch.as_tensor(ids)
        sample["labels"] = torch.as_tensor(np.where(mask, ids, IGNORE))
        out.append(sample)
    return out


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("family", FAMILIES)
def test_video_packs_from_disk_equal_build_thd_batch_and_feed_the_model(tmp_path, assets, family):
    res = build_packed(cfg(assets, family), tmp_path / "out", progress=False)
    vision = res.metadata["vision"]
    assert vision["videos"] == 3 and vision["images"] == 1
    ds = load_packed(res.path)
    refs = reference_samples(assets, family, ROWS)
    assert any(float(s["second_per_grid_ts"][0]) != int(s["second_per_grid_ts"][0]) for s in refs if "video_grid_thw" in s)
    model_cfg = json.loads((assets / family / "config.json").read_text())
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(family_config(family)).to(torch.float32).eval()
    collate = ds.collator()
    seen = []
    for k in range(len(ds)):
        batch = collate(ds[k])
        rows = batch.sample_index.tolist()
        seen += rows
        samples = [refs[r] for r in rows]
        assert_same_hf_kwargs(to_hf_kwargs(batch), to_hf_kwargs(build_thd_batch(samples, vlm=get_family(model_cfg))))
        assert_model_equivalent(model, batch, samples)
        assert_mrope_is_transformers(model, family, batch, samples)
    assert sorted(seen) == list(range(len(ROWS)))


@torch.no_grad()
def assert_mrope_is_transformers(model, family: str, batch, samples):
    """Every sample's 3 mRoPE rows in the pack equal the installed transformers'
    ``get_rope_index`` of that sample alone (Qwen2.5-VL: with its fractional
    ``second_per_grid_ts``)."""
    pos = to_hf_kwargs(batch)["position_ids"]  # [4, 1, T]: text positions, then the 3 mRoPE rows
    for i, s in enumerate(samples):
        ids = s["input_ids"].reshape(1, -1)
        kw = {"image_grid_thw": s.get("image_grid_thw"), "video_grid_thw": s.get("video_grid_thw"),
              "mm_token_type_ids": (ids == IMG).int() + 2 * (ids == VID).int()}
        if family == "qwen2_5_vl":
            kw["second_per_grid_ts"] = s.get("second_per_grid_ts")
        want, _ = model.model.get_rope_index(ids, **kw)
        a, n = int(batch.cu_seqlens_padded[i]), int(batch.seq_lens[i])
        assert torch.equal(pos[1:, 0, a:a + n].to(want.dtype), want[:, 0]), (family, i)


# --------------------------------------------------------------------------- bad videos


def test_bad_videos_are_row_errors_named_and_skipped(tmp_path, assets):
    (tmp_path / "junk.mp4").write_bytes(np.random.default_rng(0).bytes(2000))
    write_video(tmp_path / "empty.mp4", 0, 6, 16, 16)
    write_video(tmp_path / "short.mp4", 1, 6, 16, 16)
    write_video(tmp_path / "ok.mp4", *VIDEOS[0])

    def row(video, marks=1):
        return {"messages": [{"role": "user", "content": "<video>" * marks + "?"},
                             {"role": "assistant", "content": "x"}], "videos": [video]}

    path = tmp_path / "bad.jsonl"
    write_rows(path, [row("ok.mp4"), row("missing.mp4"), row("junk.mp4"), row("empty.mp4"), row("short.mp4"),
                      row("ok.mp4", marks=2)])
    with pytest.raises(InputError) as exc:
        build_packed(cfg(assets, input=str(path)), tmp_path / "x", progress=False)
    msg = str(exc.value)
    assert "5 bad row(s)" in msg, msg
    assert f"bad.jsonl:2: video 'missing.mp4' not found (looked at {tmp_path / 'missing.mp4'})" in msg
    assert "bad.jsonl:3: video 'junk.mp4' cannot be decoded" in msg
    assert "bad.jsonl:4: video 'empty.mp4' has no frames" in msg
    assert "bad.jsonl:5: video 'short.mp4': 1 frame(s), fewer than the temporal patch (2) needs" in msg
    assert "bad.jsonl:6: 2 '<video>' marker(s) but 1 video(s)" in msg
    assert not (tmp_path / "x").exists()
    res = build_packed(cfg(assets, input=str(path), skip_bad_rows=True), tmp_path / "y", progress=False)
    assert res.metadata["counts"]["skipped_rows"] == 5 and res.metadata["counts"]["samples"] == 1
    assert res.metadata["vision"]["videos"] == 1
    # the command line: video options as YAML, --skip-bad-rows counts the bad videos
    (tmp_path / "build.yaml").write_text(json.dumps({"image_processor": PROC_KW, "pack_size": 400}))  # YAML 1.2
    args = ["build", "--config", str(tmp_path / "build.yaml"), "--input", str(path), "--tokenizer", str(assets / "tok"),
            "--model-config", str(assets / "qwen2_vl"), "--video", json.dumps(VIDEO_OPTS),
            "--output", str(tmp_path / "cli"), "--skip-bad-rows"]
    assert main(args) == 0
    meta = json.loads((tmp_path / "cli" / "metadata.json").read_text())
    assert meta["counts"]["skipped_rows"] == 5 and meta["vision"]["video"]["max_pixels"] == 256
    assert main(["stats", str(tmp_path / "cli"), "--json"]) == 0
    assert main(["inspect", str(tmp_path / "cli")]) == 0


def test_video_part_in_a_text_build_is_named(tmp_path, assets):
    path = tmp_path / "parts.jsonl"
    write_rows(path, [{"messages": [{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]},
                                    {"role": "assistant", "content": "x"}]}])
    with pytest.raises(InputError, match=r"parts\.jsonl:1: message 0 part 0: a video part in a text build"):
        build_packed(BuildConfig(input=str(path), tokenizer=str(assets / "tok"), pack_size=64), tmp_path / "x",
                     progress=False)


# --------------------------------------------------------------------------- vision budget


def test_video_patches_count_in_the_vision_budget_with_images(tmp_path, assets):
    path = tmp_path / "mixed.jsonl"
    write_rows(path, [ROWS[1]])  # one image and one video
    res = build_packed(cfg(assets, input=str(path), image_dir=str(assets)), tmp_path / "all", progress=False)
    sample = load_packed(res.path).collator()(load_packed(res.path)[0])
    kw = to_hf_kwargs(sample)
    total = int(kw["image_grid_thw"].prod(1).sum() + kw["video_grid_thw"].prod(1).sum())
    assert res.metadata["vision"]["vision_patches"] == total and kw["video_grid_thw"].shape[0] == 1
    with pytest.raises(InputError, match=rf"mixed\.jsonl:1: {total} vision patches, more than vision_budget={total - 1}"):
        build_packed(cfg(assets, input=str(path), image_dir=str(assets), vision_budget=total - 1), tmp_path / "x",
                     progress=False)


def test_a_video_over_the_budget_is_rejected_dropped_or_cut_in_frames(tmp_path, assets):
    path = tmp_path / "long.jsonl"
    write_rows(path, [ROWS[0], ROWS[2]])  # vid/0.mp4: 4 frames of 12 x 16 -> grid (2, 6, 8), 96 patches; text
    base = dict(input=str(path), image_dir=str(assets), vision_budget=60)
    with pytest.raises(InputError, match=r"long\.jsonl:1: 96 vision patches, more than vision_budget=60"):
        build_packed(cfg(assets, **base), tmp_path / "x", progress=False)
    res = build_packed(cfg(assets, **base, overflow="drop"), tmp_path / "drop", progress=False)
    assert res.metadata["counts"]["dropped"]["samples"] == 1 and res.metadata["vision"]["videos"] == 0
    res = build_packed(cfg(assets, **base, overflow="truncate"), tmp_path / "cut", progress=False)
    assert res.metadata["vision"]["video_patches_cut"] == 1 and res.metadata["vision"]["vision_patches"] == 48
    ds = load_packed(res.path)
    batch = ds.collator()(ds[0])
    kw = to_hf_kwargs(batch)
    assert kw["video_grid_thw"].tolist() == [[1, 6, 8]]
    assert int((kw["input_ids"] == VID).sum()) == 48 // MERGE**2
    full = reference_samples(assets, "qwen2_vl", [ROWS[0]])[0]["pixel_values_videos"]
    assert torch.equal(kw["pixel_values_videos"], full[:48])  # the first temporal patch, unchanged
    assert ds[0]["second_per_grid_ts"] == [[pytest.approx(2 / 3)]]  # the frames kept are still 1/3 s apart
    with pytest.raises(InputError, match=r"long\.jsonl:1: video 'vid/0\.mp4': one temporal patch of it "
                                         r"\(48 vision patches\) does not fit in vision_budget \(40 left for it\)"):
        build_packed(cfg(assets, **dict(base, vision_budget=40), overflow="truncate"), tmp_path / "y",
                     progress=False)


# --------------------------------------------------------------------------- shards and merge


def test_video_shards_merge(tmp_path, assets):
    from thdpack.offline.inputs.input_slice import InputSlice
    from thdpack.offline.commands.slice_merge import merge_slices

    c = cfg(assets, family="qwen2_5_vl", shuffle_packs=False, pack_size=200, vision_budget=150)
    single = build_packed(c, tmp_path / "single", progress=False)
    one = build_packed(c, tmp_path / "one-0", progress=False, input_slice=InputSlice(0, 1))
    merged_one = merge_slices([one.path], tmp_path / "merged-one")
    strip = lambda m: {k: v for k, v in m.items() if k not in ("input_slices", "input_slice")}  # noqa: E731
    assert strip(merged_one.metadata) == strip(single.metadata)
    parts = [build_packed(c, tmp_path / f"part-{i}", progress=False, input_slice=InputSlice(i, 2)).path for i in range(2)]
    merged = merge_slices(parts, tmp_path / "merged")
    vision = merged.metadata["vision"]
    shard_visions = [json.loads((p / "metadata.json").read_text())["vision"] for p in parts]
    for key in ("videos", "images", "vision_patches"):
        assert vision[key] == sum(v[key] for v in shard_visions) == single.metadata["vision"][key], key
    assert vision["max_pack_vision_patches"] == max(v["max_pack_vision_patches"] for v in shard_visions)
    ds = load_packed(merged.path)
    refs = reference_samples(assets, "qwen2_5_vl", ROWS)
    model_cfg = json.loads((assets / "qwen2_5_vl" / "config.json").read_text())
    seen = []
    for k in range(len(ds)):
        batch = ds.collator()(ds[k])
        rows = batch.sample_index.tolist()
        seen += rows
        assert_same_hf_kwargs(to_hf_kwargs(batch), to_hf_kwargs(build_thd_batch([refs[r] for r in rows], vlm=get_family(model_cfg))))
    assert sorted(seen) == list(range(len(ROWS)))


def test_bad_video_options_are_named(tmp_path, assets):
    from thdpack.offline import ConfigError

    with pytest.raises(ConfigError, match=r"video: unknown option\(s\) \['fsp'\]; known: .*'fps'"):
        build_packed(cfg(assets, video={"fsp": 1}), tmp_path / "x", progress=False)
    with pytest.raises(ConfigError, match=r"video: need fps > 0 and 1 <= min_frames <= max_frames"):
        build_packed(cfg(assets, video={"fps": 0}), tmp_path / "x", progress=False)
    with pytest.raises(ConfigError, match=r"video: backend must be one of \['auto', 'processor', 'builtin'\], got 'hf'"):
        build_packed(cfg(assets, video={"backend": "hf"}), tmp_path / "x", progress=False)


def test_video_backend_auto_is_recorded_and_processor_without_torchvision_is_named(tmp_path, assets):
    """``auto`` resolves to ``processor`` where transformers' video processor loads (torchvision;
    tests/test_video_processor.py checks that path) and to ``builtin`` elsewhere; the build's
    metadata records which ran."""
    from thdpack.offline import ConfigError
    from thdpack.offline.vision.video_processor import processor_class

    cls, why = processor_class("qwen2_vl")
    path = tmp_path / "one.jsonl"
    write_rows(path, [ROWS[0]])
    res = build_packed(cfg(assets, input=str(path), image_dir=str(assets)), tmp_path / "auto", progress=False)
    assert res.metadata["vision"]["video"]["backend"] == ("builtin" if cls is None else "processor")
    builtin = dict(VIDEO_OPTS, backend="builtin")
    res = build_packed(cfg(assets, input=str(path), image_dir=str(assets), video=builtin), tmp_path / "builtin",
                       progress=False)
    assert res.metadata["vision"]["video"]["backend"] == "builtin"
    if cls is not None:
        pytest.skip("transformers' video processor loads here: backend 'processor' is available")
    with pytest.raises(ConfigError, match=r"video: backend 'processor' needs transformers' video processor for "
                                          r"qwen2_vl, which does not load here \(.+\); install torchvision"):
        build_packed(cfg(assets, input=str(path), video={"backend": "processor"}), tmp_path / "x", progress=False)


# --------------------------------------------------------------------------- transformers' video processors, written out

# transformers 5.24 (the installed one; read in .venv/lib/python3.11/site-packages/transformers/models/):
# - qwen3_vl/video_processing_qwen3_vl.py, Qwen3VLVideoProcessor (Qwen3-VL and Qwen3.5: auto/video_processing_auto.py):
#   image_mean / image_std IMAGENET_STANDARD (0.5); sample_frames: n = int(total / video_fps * fps) clamped to
#   min(max(n, min_frames), max_frames, total), indices linspace(0, total - 1, n).round(); resize (cap_pixels_per_frame
#   unset, i.e. off): the module's smart_resize(n, h, w, temporal_factor, factor, min_pixels, max_pixels) whose bounds
#   are on t_bar·h·w, the whole video; patchify repeats the last frame up to a multiple of the temporal patch.
# - qwen2_vl/video_processing_qwen2_vl.py, Qwen2VLVideoProcessor (Qwen2-VL and Qwen2.5-VL): OPENAI_CLIP mean / std;
#   resize (cap unset): the per-frame smart_resize of qwen2_vl/image_processing_qwen2_vl.py with the size's bounds;
#   it samples no frames by default (do_sample_frames=False), so frames are qwen-vl-utils' smart_nframes.
QWEN3 = ("qwen3_vl", "qwen3_5")


def transformers_video(path, family: str, fps: float = 2.0, min_frames: int = 4, max_frames: int = 768,
                       min_pixels: int = 16, max_pixels: int = 256) -> tuple[np.ndarray, list]:
    """``(pixel_values_videos [t·h·w, 3·TPATCH·PATCH²] float32, grid [t, h, w])`` of one video file as
    the family's transformers video processor prepares it (PIL bicubic for torchvision's)."""
    from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as frame_resize
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as video_resize

    with av.open(str(path)) as c:
        s = c.streams.video[0]
        video_fps = float(s.average_rate)
        frames = [f.to_image() for f in c.decode(s)]
    total, factor = len(frames), PATCH * MERGE
    if family in QWEN3:
        n = min(max(int(total / video_fps * fps), min_frames), max_frames, total)
    else:
        n = min(max(total / video_fps * fps, math.ceil(min_frames / TPATCH) * TPATCH),
                math.floor(min(max_frames, total) / TPATCH) * TPATCH)
        n = math.floor(n / TPATCH) * TPATCH
    idx = np.linspace(0, total - 1, n).round().astype(int)
    w0, h0 = frames[0].size
    if family in QWEN3:
        h, w = video_resize(n, h0, w0, temporal_factor=TPATCH, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
        mean, std = IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD
    else:
        h, w = frame_resize(h0, w0, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
        mean, std = OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
    x = np.stack([np.asarray(frames[i].convert("RGB").resize((w, h), Image.BICUBIC)) for i in idx])
    x = ((x.astype(np.float32) / 255 - np.float32(mean)) / np.float32(std)).transpose(0, 3, 1, 2)  # [n, C, h, w]
    x = np.concatenate([x] + [x[-1:]] * (-n % TPATCH))  # patchify's repeat of the last frame
    t, gh, gw = x.shape[0] // TPATCH, h // PATCH, w // PATCH
    x = x.reshape(t, TPATCH, 3, gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * gh * gw, 3 * TPATCH * PATCH * PATCH), [t, gh, gw]


@pytest.mark.parametrize("family", FAMILIES)
def test_built_video_pixels_follow_the_family_transformers_video_processor(tmp_path, assets, family):
    """vid/0 (8 frames, 16 x 20, 6 fps) and vid/2 (5 frames, 2 fps): Qwen3's whole-video pixel budget gives
    4 x 8 frames where Qwen2's per-frame one gives 12 x 16, Qwen3 keeps 5 frames (Qwen2: 4), and the means differ."""
    path = tmp_path / "two.jsonl"
    write_rows(path, [ROWS[0], ROWS[3]])
    res = build_packed(cfg(assets, family, input=str(path), image_dir=str(assets)), tmp_path / "out", progress=False)
    ds = load_packed(res.path)
    got = {}
    for k in range(len(ds)):
        kw = to_hf_kwargs(ds.collator()(ds[k]))
        pv = kw["pixel_values_videos"].numpy()
        at = 0
        for r, g in zip(ds.collator()(ds[k]).sample_index.tolist(), kw["video_grid_thw"].tolist()):
            got[r] = (pv[at:at + math.prod(g)], g)
            at += math.prod(g)
    for r, ref in [(0, "vid/0.mp4"), (1, "vid/2.mp4")]:
        want_pv, want_grid = transformers_video(assets / ref, family)
        assert got[r][1] == want_grid, (family, ref)
        np.testing.assert_allclose(got[r][0], want_pv, rtol=0, atol=1e-6)
    assert (got[0][1][1:] == [2, 4]) == (family in QWEN3)  # 4 x 8 pixels: the budget is the whole video's
    assert (got[1][1][0] == 3) == (family in QWEN3)  # 5 frames (the last repeated): Qwen3 does not floor to 2


def test_frame_sizes_of_long_videos_and_the_qwen2_only_total_pixels(tmp_path, assets):
    """Qwen2-VL's video processor bounds each frame (no cap by default); qwen-vl-utils' total_pixels cap
    only when asked; Qwen3-VL bounds the whole video with its own smart_resize, and refuses total_pixels."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as frame_resize
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as video_resize

    from thdpack.offline import ConfigError
    from thdpack.offline.vision.video import frame_size

    f = 28
    assert frame_size(720, 1280, 400, VideoOptions(), f, 2) == frame_resize(720, 1280, f, 128 * f * f, 768 * f * f)
    capped = max(min(768 * f * f, 115200 * f * f / 400 * 2), int(128 * f * f * 1.05))
    assert frame_size(720, 1280, 400, VideoOptions(total_pixels=115200 * f * f), f, 2) == frame_resize(
        720, 1280, f, 128 * f * f, capped) != frame_resize(720, 1280, f, 128 * f * f, 768 * f * f)
    f = 32
    got = frame_size(720, 1280, 40, VideoOptions(), f, 2, video_rule("qwen3_5"))
    assert got == video_resize(40, 720, 1280, 2, f, 128 * f * f, 768 * f * f) and 40 * got[0] * got[1] <= 768 * f * f
    with pytest.raises(ConfigError, match=r"video: total_pixels is for Qwen2-VL / Qwen2\.5-VL; qwen3_vl's max_pixels"):
        build_packed(cfg(assets, "qwen3_vl", video=dict(VIDEO_OPTS, total_pixels=4096)), tmp_path / "x",
                     progress=False)


def test_video_builds_tokenize_in_small_batches_and_free_each_pixel_row_once_copied(tmp_path, assets, monkeypatch):
    """Peak memory (benchmarks/video.py): a map batch's float32 pixel rows are held until the batch is written,
    so VLM builds cap the batch at VISION_MAP_BATCH_SIZE rows, and each row's pixels are dropped as soon as
    they are copied into the Arrow column; the bytes written are those of any other batch size."""
    import thdpack.offline.vision.vlm_rows as vlm

    path = tmp_path / "many.jsonl"
    write_rows(path, ROWS * 9)  # 36 rows
    seen, append = [], vlm._append_lists

    def spy(table, name, rows, *args, **kw):
        out = append(table, name, rows, *args, **kw)
        if name in ("pixel_values", "pixel_values_videos"):
            seen.append((name, len(rows), all(r is None for r in rows)))
        return out

    monkeypatch.setattr(vlm, "_append_lists", spy)
    big = build_packed(cfg(assets, input=str(path), image_dir=str(assets), map_batch_size=1000, shuffle_packs=False),
                       tmp_path / "big", progress=False)
    assert seen and max(n for _, n, _ in seen) <= vlm.VISION_MAP_BATCH_SIZE < len(ROWS) * 9, seen
    assert all(freed for _, _, freed in seen), seen
    small = build_packed(cfg(assets, input=str(path), image_dir=str(assets), map_batch_size=3, shuffle_packs=False),
                         tmp_path / "small", progress=False)
    arrows = sorted(p.name for p in big.path.glob("*.arrow"))
    assert arrows and all((big.path / a).read_bytes() == (small.path / a).read_bytes() for a in arrows)


def test_a_video_too_thin_to_resize_is_named(tmp_path):
    write_video(tmp_path / "thin.mp4", 4, 2, 16, 3400)  # aspect ratio 212.5: smart_resize refuses it
    for rule in (None, video_rule("qwen3_vl")):
        with pytest.raises(ValueError, match=r"video 'thin\.mp4' \(3400 x 16\) cannot be resized: absolute aspect"):
            load_video(tmp_path / "thin.mp4", "thin.mp4", VideoOptions(), TPATCH, PATCH * MERGE, rule)
