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
