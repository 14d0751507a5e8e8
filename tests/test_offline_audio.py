"""Offline omni audio (issue 48 point 4): clips decoded with PyAV, resampled, and turned into the model's own
log-mel features (thdpack/offline/vision/audio_clips.py); each fault a row error naming the clip."""

from __future__ import annotations

import wave

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
av = pytest.importorskip("av")

from thdpack.offline.errors import ConfigError  # noqa: E402
from thdpack.offline.vision.audio_clips import (clip_features, load_clip, load_feature_extractor, max_seconds,  # noqa: E402
                                          row_audios)

MEL = 16


def write_wav(path, rate: int, seconds: float, channels: int = 1, freq: float = 440.0) -> None:
    """A sine tone (int16 PCM) with the stdlib ``wave`` module."""
    t = np.arange(int(rate * seconds)) / rate
    x = (np.sin(2 * np.pi * freq * t) * 0.5 * 32767).astype(np.int16)
    if channels == 2:
        x = np.stack([x, x], 1).reshape(-1)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(x.tobytes())


def write_flac(path, rate: int, seconds: float, freq: float = 440.0) -> None:
    x = (np.sin(2 * np.pi * freq * np.arange(int(rate * seconds)) / rate) * 0.5 * 32767).astype(np.int16)
    with av.open(str(path), "w", format="flac") as c:
        s = c.add_stream("flac", rate=rate)
        s.layout = "mono"
        frame = av.AudioFrame.from_ndarray(x[None, :], format="s16", layout="mono")
        frame.sample_rate = rate
        for p in list(s.encode(frame)) + list(s.encode(None)):
            c.mux(p)


@pytest.fixture(scope="module")
def fe(tmp_path_factory):
    d = tmp_path_factory.mktemp("proc")
    transformers.WhisperFeatureExtractor(feature_size=MEL).save_pretrained(str(d))
    return load_feature_extractor(d, "proc")


def test_features_match_the_processor(tmp_path, fe):
    """The clip's frames are what Qwen2.5-Omni's processor gives (its real frames, by the mask)."""
    write_wav(tmp_path / "a.wav", 16000, 1.3)
    got = row_audios(["a.wav"], tmp_path, fe, max_seconds(fe, None))
    assert got.frames.tolist() == [130] and got.features.shape == (MEL, 130) and got.features.dtype == np.float32
    samples, _ = load_clip("a.wav", tmp_path, 16000)
    with wave.open(str(tmp_path / "a.wav")) as w:
        want_samples = np.frombuffer(w.readframes(w.getnframes()), np.int16) / 32768.0
    np.testing.assert_allclose(samples, want_samples, atol=1e-6)
    out = fe([want_samples.astype(np.float32)], sampling_rate=16000, padding="max_length",
             return_attention_mask=True, return_tensors="np")
    L = int(out["attention_mask"].sum())
    np.testing.assert_allclose(got.features, out["input_features"][0, :, :L], atol=1e-5)
    np.testing.assert_array_equal(clip_features(samples, fe), got.features)


def test_two_clips_resampled_stereo_flac_bytes_array(tmp_path, fe):
    """8 kHz stereo is resampled and averaged (not a fault); flac, bytes and arrays read as files do."""
    write_wav(tmp_path / "a.wav", 16000, 0.5)
    write_wav(tmp_path / "lo.wav", 8000, 0.5, channels=2)
    write_flac(tmp_path / "a.flac", 16000, 0.5)
    ref = row_audios(["a.wav"], tmp_path, fe, 30.0)
    lo = row_audios(["lo.wav"], tmp_path, fe, 30.0)
    assert lo.frames.tolist() == ref.frames.tolist() == [50]
    assert np.abs(lo.features - ref.features).mean() < 0.05  # the same tone, resampled
    both = row_audios(["a.wav", "a.flac"], tmp_path, fe, 30.0)
    assert both.frames.tolist() == [50, 50] and [c.shape for c in both.clips()] == [(MEL, 50)] * 2
    np.testing.assert_allclose(both.clips()[1], ref.features, atol=1e-4)
    data = (tmp_path / "a.wav").read_bytes()
    np.testing.assert_array_equal(row_audios([{"bytes": data}], tmp_path, fe, 30.0).features, ref.features)
    samples, _ = load_clip("a.wav", tmp_path, 16000)
    arr = row_audios([{"array": samples.tolist(), "sampling_rate": 16000}], tmp_path, fe, 30.0)
    np.testing.assert_array_equal(arr.features, ref.features)
    arr8 = row_audios([{"array": samples[::2].tolist(), "sampling_rate": 8000}], tmp_path, fe, 30.0)
    assert arr8.frames.tolist() == [50]


@pytest.mark.parametrize("case, match", [
    ("missing", "not found"),
    ("empty", "cannot be decoded"),
    ("garbage", "cannot be decoded"),
    ("truncated", "is truncated"),
    ("truncated_flac", "cannot be decoded"),
    ("zero", "no samples"),
    ("long", "more than max_audio_seconds=1"),
    ("array_rate", "needs its sampling_rate"),
    ("bad_ref", "an audio must be a path"),
])
def test_faults(tmp_path, fe, case, match):
    write_wav(tmp_path / "ok.wav", 16000, 1.5)
    write_flac(tmp_path / "ok.flac", 16000, 1.0)
    data = (tmp_path / "ok.wav").read_bytes()
    files = {"empty": b"", "garbage": b"not audio" * 50, "truncated": data[: len(data) // 2],
             "truncated_flac": (tmp_path / "ok.flac").read_bytes()[:3000]}
    for name, content in files.items():
        (tmp_path / f"{name}.bin").write_bytes(content)
    write_wav(tmp_path / "zero.wav", 16000, 0.0)
    ref = {"missing": "nope.wav", "zero": "zero.wav", "long": "ok.wav", "array_rate": {"array": [0.1, 0.2]},
           "bad_ref": 7}.get(case, f"{case}.bin")
    with pytest.raises(ValueError, match=match):
        row_audios([ref], tmp_path, fe, 1.0)


def test_options(tmp_path, fe):
    assert max_seconds(fe, None) == 30.0 and max_seconds(fe, 2.5) == 2.5
    with pytest.raises(ConfigError, match="at most the feature extractor's chunk_length"):
        max_seconds(fe, 31)
    with pytest.raises(ConfigError, match="no such directory"):
        load_feature_extractor(tmp_path / "none", "none")


# --------------------------------------------------------------------------- the build: omni thinker rows with audio

import json  # noqa: E402

import torch  # noqa: E402

from thdpack import build_thd_batch  # noqa: E402
from thdpack.demo import TOKENIZER_DIR  # noqa: E402
from thdpack.integrations import to_hf_kwargs  # noqa: E402
from thdpack.offline import BuildConfig, InputError, build_packed, load_packed  # noqa: E402
from thdpack.vlm import get_family  # noqa: E402

IGNORE = -100
OMNI_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
               "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
VS, VE, IMG, VID, ABOS, AUD, AEOS = range(3072, 3079)  # their ids after the demo tokenizer's 3072
ROWS = [
    {"messages": [{"role": "user", "content": "<audio>What is this sound?"},
                  {"role": "assistant", "content": "A tone."}], "audios": ["wav/0.wav"]},
    {"messages": [{"role": "user", "content": "No audio."}, {"role": "assistant", "content": "Fine."}]},
    {"messages": [{"role": "user", "content": "Compare <audio> and <audio>."},
                  {"role": "assistant", "content": "The second is lower."}], "audios": ["wav/1.wav", "wav/2.flac"]},
    {"messages": [{"role": "user", "content": "Hear <audio>"}, {"role": "assistant", "content": "Low."}],
     "audios": ["wav/lo.wav"]},
]


def omni_config() -> dict:
    cfg = transformers.Qwen2_5OmniThinkerConfig(
        audio_config=dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=MEL,
                          n_window=4, output_dim=64, max_source_positions=1500),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0], window_size=16,
                           in_channels=3),
        text_config=dict(vocab_size=3080, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
        audio_token_id=AUD, image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE,
        audio_start_token_id=ABOS, audio_end_token_id=AEOS, position_id_per_seconds=25, seconds_per_chunk=2)
    return cfg.to_dict()


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    d = tmp_path_factory.mktemp("omni")
    tok = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)
    tok.add_tokens(OMNI_TOKENS, special_tokens=True)
    assert tok.convert_tokens_to_ids(OMNI_TOKENS) == list(range(3072, 3079))
    tok.save_pretrained(str(d / "tok"))
    transformers.WhisperFeatureExtractor(feature_size=MEL).save_pretrained(str(d / "proc"))
    (d / "model").mkdir()
    (d / "model" / "config.json").write_text(json.dumps(omni_config()))
    (d / "wav").mkdir()
    write_wav(d / "wav" / "0.wav", 16000, 0.7)
    write_wav(d / "wav" / "1.wav", 16000, 1.1, freq=660)
    write_flac(d / "wav" / "2.flac", 16000, 0.4, freq=220)
    write_wav(d / "wav" / "lo.wav", 8000, 0.9, channels=2)
    (d / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return d


def omni_cfg(d, **kw) -> BuildConfig:
    base = dict(input=str(d / "data.jsonl"), tokenizer=str(d / "tok"), model_config=str(d / "model"),
                audio_processor=str(d / "proc"), pack_size=160, overflow="error")
    return BuildConfig(**{**base, **kw})


def _qwen2_5_tokens(frames: int) -> int:
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def reference(d, rows, tok: str = "tok", proc: str = "proc", audio_tokens=_qwen2_5_tokens) -> list[dict]:
    """Samples built without thdpack.offline: the extractor as the processor calls it, markers expanded
    by the model's rule (``audio_tokens``: Qwen2.5-Omni's by default), transformers' chat template."""
    tok = transformers.AutoTokenizer.from_pretrained(str(d / tok), local_files_only=True)
    fe = transformers.WhisperFeatureExtractor.from_pretrained(str(d / proc), local_files_only=True)
    out = []
    for row in rows:
        clips = []
        for p in row.get("audios", []):
            samples, _ = load_clip(p, d, 16000)  # PyAV decoding, checked against `wave` above
            enc = fe(samples, sampling_rate=16000, padding="max_length", return_attention_mask=True, return_tensors="pt")
            clips.append(enc["input_features"][0, :, : int(enc["attention_mask"].sum())])
        runs = iter("<|audio_bos|>" + "<|AUDIO|>" * audio_tokens(c.shape[1]) + "<|audio_eos|>" for c in clips)

        def sub(text):
            parts = text.split("<audio>")
            return parts[0] + "".join(next(runs) + p for p in parts[1:])

        msgs = [dict(m, content=sub(m["content"])) for m in row["messages"]]
        enc = tok.apply_chat_template([msgs], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = np.asarray(enc["input_ids"][0]), np.asarray(enc["assistant_masks"][0], bool)
        mask &= ~np.isin(ids, [ABOS, AUD, AEOS])
        sample = {"input_ids": torch.as_tensor(ids), "labels": torch.as_tensor(np.where(mask, ids, IGNORE))}
        if clips:
            sample["input_features"] = clips
        out.append(sample)
    return out


def same_kwargs(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_omni_build_packs_equal_build_thd_batch(tmp_path, omni):
    res = build_packed(omni_cfg(omni), tmp_path / "out", progress=False)
    meta = res.metadata
    assert meta["audio"]["clips"] == 4 and meta["vision"]["model_type"] == "qwen2_5_omni_thinker"
    assert {"input_features", "audio_frames", "audio_counts"} <= set(meta["columns"])
    assert (res.path / "feature_extractor" / "preprocessor_config.json").is_file()
    ds = load_packed(res.path)
    refs = reference(omni, ROWS)
    family = get_family(omni_config())
    collate = ds.collator()
    seen = []
    for k in range(len(ds)):
        batch = collate(ds[k])
        rows = batch.sample_index.tolist()
        seen += rows
        want = build_thd_batch([refs[r] for r in rows], vlm=family)
        same_kwargs(to_hf_kwargs(batch), to_hf_kwargs(want))
        assert torch.equal(batch.token_extras["mrope_position_ids"], want.token_extras["mrope_position_ids"])
    assert sorted(seen) == [0, 1, 2, 3]


def test_omni_build_faults_counted(tmp_path, omni):
    write_wav(tmp_path / "long.wav", 16000, 2.5)
    (tmp_path / "cut.wav").write_bytes((omni / "wav" / "0.wav").read_bytes()[:5000])
    (tmp_path / "empty.wav").write_bytes(b"")
    write_wav(tmp_path / "zero.wav", 16000, 0.0)
    ok = ROWS[0] | {"audios": [str(omni / "wav" / "0.wav")]}
    bad = [ok,
           ok | {"audios": [str(tmp_path / "cut.wav")]},
           ok | {"audios": [str(tmp_path / "empty.wav")]},
           ok | {"audios": [str(tmp_path / "zero.wav")]},
           ok | {"audios": [str(tmp_path / "long.wav")]},
           ok | {"audios": []},
           ok | {"audios": [str(omni / "wav" / "0.wav")] * 2}]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in bad))
    with pytest.raises(InputError) as exc:
        build_packed(omni_cfg(omni, input=str(path), max_audio_seconds=2.0), tmp_path / "x", progress=False)
    msg = str(exc.value)
    assert "6 bad row(s)" in msg
    for line, text in [(2, "is truncated"), (3, "cannot be decoded"), (4, "no samples"),
                       (5, "more than max_audio_seconds=2"), (6, "1 '<audio>' marker(s) but 0 audio clip(s)")]:
        assert f"bad.jsonl:{line}: " in msg and text in msg, (line, text, msg)
    assert "(and 1 more)" in msg  # row 7: 1 marker, 2 clips
    res = build_packed(omni_cfg(omni, input=str(path), max_audio_seconds=2.0, skip_bad_rows=True), tmp_path / "y",
                       progress=False)
    assert res.metadata["counts"]["skipped_rows"] == 6 and res.metadata["audio"]["clips"] == 1


def test_omni_build_audio_budget(tmp_path, omni):
    """``audio_budget``: no pack holds more audio feature frames (read back from the stored columns), every row
    is kept, the batches still equal build_thd_batch; a row over the budget is a bad row, dropped by overflow: drop."""
    rows = ROWS * 3
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r | {"audios": [str(omni / a) for a in r.get("audios", [])]}) + "\n"
                            for r in rows))
    res = build_packed(omni_cfg(omni, input=str(path), pack_size=1024, audio_budget=200), tmp_path / "out",
                       progress=False)
    assert res.metadata["audio"]["audio_budget"] == 200 and res.metadata["config"]["audio_budget"] == 200
    ds = load_packed(res.path)
    refs = reference(omni, ROWS)
    family, collate, seen, frames, counts = get_family(omni_config()), ds.collator(), [], [], []
    for k in range(len(ds)):
        row = ds[k]
        frames.append(int(np.asarray(row["audio_frames"]).sum()))
        counts.append(int(np.asarray(row["audio_counts"]).sum()))
        batch = collate(row)
        seen += batch.sample_index.tolist()
        want = build_thd_batch([refs[r % len(ROWS)] for r in batch.sample_index.tolist()], vlm=family)
        same_kwargs(to_hf_kwargs(batch), to_hf_kwargs(want))
    assert sorted(seen) == list(range(len(rows)))
    assert max(frames) <= 200 and sum(frames) == 3 * (70 + 110 + 40 + 90)
    assert sum(counts) == 12 and len(frames) > 2  # the budget, not pack_size, split the packs
    plain = build_packed(omni_cfg(omni, input=str(path), pack_size=1024), tmp_path / "plain", progress=False)
    assert "audio_budget" not in plain.metadata["audio"] and "audio_budget" not in plain.metadata["config"]
    with pytest.raises(InputError, match="more than audio_budget=100"):
        build_packed(omni_cfg(omni, input=str(path), pack_size=1024, audio_budget=100), tmp_path / "x", progress=False)
    dropped = build_packed(omni_cfg(omni, input=str(path), pack_size=1024, audio_budget=100, overflow="drop"),
                           tmp_path / "d", progress=False)
    assert dropped.metadata["audio"]["clips"] == 6  # the rows of 150 frames (two clips) dropped


def test_the_omni_demo_builds_and_loads_as_built_online(tmp_path):
    """``scripts/make_demo.py omni`` (thdpack/demo/omni_demo.py): generated tones, a local feature extractor and a tiny
    thinker config; ``thdpack build --config build.yaml`` packs under its audio_budget, and every loaded pack
    collates to what build_thd_batch(vlm=get_family(cfg)) makes of the same rows built online."""
    from thdpack.cli import main
    from thdpack.demo.omni_demo import AUDIO_BUDGET, write_omni_demo

    config = write_omni_demo(tmp_path / "demo", num_samples=12, seed=1)
    demo = config.parent
    assert main(["build", "--config", str(config), "--output", str(tmp_path / "out")]) == 0
    rows = [json.loads(line) for line in (demo / "data.jsonl").read_text().splitlines()]
    assert any(r.get("audios") for r in rows) and any(not r.get("audios") for r in rows)
    cfg = json.loads((demo / "model" / "config.json").read_text())
    ds = load_packed(tmp_path / "out")
    assert ds.metadata["audio"]["audio_budget"] == AUDIO_BUDGET
    refs, family, collate, seen = reference(demo, rows, "tokenizer", "feature_extractor"), get_family(cfg), ds.collator(), []
    for k in range(len(ds)):
        row = ds[k]
        assert int(np.asarray(row["audio_frames"]).sum()) <= AUDIO_BUDGET
        batch = collate(row)
        seen += batch.sample_index.tolist()
        want = build_thd_batch([refs[r] for r in batch.sample_index.tolist()], vlm=family)
        same_kwargs(to_hf_kwargs(batch), to_hf_kwargs(want))
        assert torch.equal(batch.token_extras["mrope_position_ids"], want.token_extras["mrope_position_ids"])
    assert sorted(seen) == list(range(len(rows)))


def test_a_video_in_an_omni_build_is_a_named_bad_row(tmp_path, omni):
    """Videos are not stored with their video_second_per_grid (nor their audio) in omni builds yet: a row with one
    is a bad row that says so, never a pack whose TMRoPE positions would be silently wrong."""
    from thdpack.demo.videos import write_video

    write_video(tmp_path / "clip.mp4", frames=4, fps=2, h=32, w=32)
    ok = ROWS[0] | {"audios": [str(omni / "wav" / "0.wav")]}
    video = {"messages": [{"role": "user", "content": "<video>What happens?"},
                          {"role": "assistant", "content": "Nothing."}], "videos": [str(tmp_path / "clip.mp4")]}
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [ok, video]))
    with pytest.raises(InputError, match=r"rows.jsonl:2: .*a video in an omni build: not supported yet"):
        build_packed(omni_cfg(omni, input=str(path)), tmp_path / "x", progress=False)


def test_a_qwen3_omni_build_packs_equal_build_thd_batch(tmp_path, omni):
    """A Qwen3-Omni-MoE thinker's build: markers expanded by its own length rule (13 tokens per 100-frame chunk),
    clips of 100 frames or more (its tower is exact on them in any pack: docs/omni.md); the loaded packs equal
    build_thd_batch of the same samples built online, TMRoPE rows included."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    cfg = transformers.Qwen3OmniMoeThinkerConfig(
        audio_config=dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=MEL,
                          output_dim=64, max_source_positions=64, n_window=50, n_window_infer=800,
                          downsample_hidden_size=8, conv_chunksize=500),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           deepstack_visual_indexes=[0], patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                           in_channels=3),
        text_config=dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                         num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=3080, head_dim=16),
        audio_token_id=AUD, image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE,
        audio_start_token_id=ABOS, audio_end_token_id=AEOS, position_id_per_seconds=25).to_dict()
    (tmp_path / "model3").mkdir()
    (tmp_path / "model3" / "config.json").write_text(json.dumps(cfg))
    write_wav(tmp_path / "long.wav", 16000, 1.5, freq=330)
    rows = [ROWS[0] | {"audios": [str(omni / "wav" / "1.wav")]}, ROWS[1],
            ROWS[2] | {"audios": [str(omni / "wav" / "1.wav"), str(tmp_path / "long.wav")]}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = build_packed(omni_cfg(omni, input=str(path), model_config=str(tmp_path / "model3"), pack_size=256),
                       tmp_path / "out", progress=False)
    assert res.metadata["vision"]["model_type"] == "qwen3_omni_moe_thinker" and res.metadata["audio"]["clips"] == 3
    refs = reference(omni, rows, audio_tokens=lambda n: int(_get_feat_extract_output_lengths(torch.tensor([n]), 50)))
    family, ds, seen = get_family(cfg), load_packed(res.path), []
    collate = ds.collator()
    for k in range(len(ds)):
        batch = collate(ds[k])
        seen += batch.sample_index.tolist()
        want = build_thd_batch([refs[r] for r in batch.sample_index.tolist()], vlm=family)
        same_kwargs(to_hf_kwargs(batch), to_hf_kwargs(want))
        assert torch.equal(batch.token_extras["mrope_position_ids"], want.token_extras["mrope_position_ids"])
    assert sorted(seen) == [0, 1, 2]
