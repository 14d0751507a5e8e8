"""Audio clips of offline omni builds (Qwen2.5-Omni / Qwen3-Omni thinkers): a row's audio references ->
log-mel ``input_features`` ``[mel, L]`` per clip, as the model's own processor makes them.

A reference is a path (relative ones against ``image_dir``, default the directory of the row's input file),
``{"path": ...}``, ``{"bytes": ...}`` (an encoded file, as ``datasets``' ``Audio`` feature stores it), or
``{"array": [...], "sampling_rate": sr}`` (samples, one channel or ``[channels, n]``; ``datasets``' decoded layout).

Decoding is PyAV's (``av``), thdpack's video decoder already (the ``video`` extra): its wheels bundle FFmpeg,
so every container and codec FFmpeg reads (wav, flac, mp3, ogg/opus, m4a/aac, the audio of a video file)
decodes, and ``av.AudioResampler`` (libswresample) converts to the feature extractor's ``sampling_rate``: no
new dependency (no librosa, soundfile or torchaudio). Channels are averaged to mono (``librosa.to_mono``'s
rule: the mean, not FFmpeg's downmix matrix). The features are the model's own feature extractor's
(``WhisperFeatureExtractor``, what the Qwen-Omni processors hold), loaded from a LOCAL processor directory
(:func:`load_feature_extractor`; nothing is downloaded) and called as ``Qwen2_5OmniProcessor`` calls it
(``padding="max_length"``, ``return_attention_mask=True``); each clip keeps its real frames only
(``L`` = the attention mask's sum; no padding kept).

Faults (a ``ValueError`` naming the clip: the row's error, a counted skip under ``skip_bad_rows``):
a missing, unreadable or truncated file (a WAV whose data chunk is shorter than its header says; a
compressed stream the decoder stops in), a clip with no samples, a clip longer than ``max_audio_seconds``
(at most the extractor's ``chunk_length``, 30 s: its processor would cut it). A sample rate other than the
extractor's is resampled, not a fault.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from thdpack.offline.errors import ConfigError

AUDIO_PLACEHOLDER = "<audio>"
FEATURE_EXTRACTOR_DIR = "feature_extractor"  # the feature extractor saved with the dataset


def load_feature_extractor(path: Path, spec: str):
    """The ``WhisperFeatureExtractor`` of the local processor directory ``path`` (``spec``: as the
    config gave it, for errors): ``preprocessor_config.json`` read offline, never from a hub."""
    import transformers

    if not Path(path).is_dir():
        raise ConfigError(f"audio_processor {spec!r}: no such directory ({path})")
    try:
        fe = transformers.WhisperFeatureExtractor.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"audio_processor {spec!r}: cannot load a feature extractor from {path} ({exc})") from None
    return fe


def max_seconds(fe, requested: float | None) -> float:
    """The longest clip a build takes: ``requested`` (``max_audio_seconds``), default and at most the
    extractor's ``chunk_length`` (its processor pads to it and cuts what is longer)."""
    chunk = float(getattr(fe, "chunk_length", 30) or 30)
    if requested is None:
        return chunk
    if not requested > 0 or requested > chunk:
        raise ConfigError(f"max_audio_seconds={requested}: must be > 0 and at most the feature extractor's "
                          f"chunk_length ({chunk:g} s; the processor cuts longer clips)")
    return float(requested)


# ---------------------------------------------------------------------------- decoding


def decode_audio(src, name: str, rate: int) -> np.ndarray:
    """float32 ``[n]`` mono samples at ``rate`` Hz of an audio file (a path or a binary file object):
    its first audio stream decoded and resampled by PyAV, channels averaged. ValueError naming
    the clip (``name``) when it cannot be read, is truncated, or has no audio stream."""
    import av

    try:
        with av.open(src) as container:
            if not container.streams.audio:
                raise ValueError(f"audio {name!r} has no audio stream")
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="fltp", layout=stream.layout, rate=rate)
            chunks = [f.to_ndarray() for frame in container.decode(stream) for f in resampler.resample(frame)]
            chunks += [f.to_ndarray() for f in resampler.resample(None)]
    except (av.error.FFmpegError, OSError, EOFError) as exc:
        raise ValueError(f"audio {name!r} cannot be decoded ({exc}); check the file") from None
    if not chunks:
        return np.zeros(0, np.float32)
    return np.concatenate(chunks, axis=1).mean(axis=0, dtype=np.float32)


def wav_truncated(data: bytes) -> tuple[int, int] | None:
    """``(bytes the header's data chunk says, bytes the file holds)`` of a RIFF/WAVE file cut short
    (FFmpeg reads such a file to its end without a word), else None."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    at = 12
    while at + 8 <= len(data):
        tag, size = data[at: at + 4], struct.unpack("<I", data[at + 4: at + 8])[0]
        if tag == b"data":
            have = len(data) - at - 8
            return (size, have) if have < size and size != 0xFFFFFFFF else None  # 0xFFFFFFFF: a streamed WAV
        at += 8 + size + (size & 1)
    return None


def resample_array(samples: np.ndarray, src_rate: int, rate: int) -> np.ndarray:
    """float32 ``[n]`` mono samples at ``rate`` of an array ``[n]`` or ``[channels, n]`` at ``src_rate``
    (channels averaged first; libswresample as for files)."""
    import av

    x = np.asarray(samples, dtype=np.float32)
    x = x.mean(axis=0, dtype=np.float32) if x.ndim == 2 else x
    if src_rate == rate or x.size == 0:
        return np.ascontiguousarray(x)
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(x[None, :]), format="flt", layout="mono")
    frame.sample_rate = int(src_rate)
    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    out = [f.to_ndarray() for f in resampler.resample(frame)] + [f.to_ndarray() for f in resampler.resample(None)]
    return np.concatenate(out, axis=1)[0] if out else np.zeros(0, np.float32)


def load_clip(ref, base: Path, rate: int) -> tuple[np.ndarray, str]:
    """``(float32 [n] mono samples at rate, name)`` of one audio reference (see the module docstring)."""
    if isinstance(ref, dict) and ref.get("array") is not None:
        src_rate = ref.get("sampling_rate")
        if not isinstance(src_rate, (int, float)) or isinstance(src_rate, bool) or src_rate <= 0:
            raise ValueError(f"an audio array needs its sampling_rate (Hz), got {src_rate!r}")
        x = np.asarray(ref["array"], dtype=np.float32)
        if x.ndim not in (1, 2) or not np.isfinite(x).all():
            raise ValueError(f"an audio array must be finite samples [n] or [channels, n], got shape {x.shape}")
        return resample_array(x, int(src_rate), rate), "audio array"
    if isinstance(ref, dict) and ref.get("bytes") is not None:
        data, name = bytes(ref["bytes"]), "audio bytes"
    else:
        path, name = _resolve(ref, base)
        if not path.is_file():
            raise ValueError(f"audio {name!r} not found (looked at {path})")
        data = path.read_bytes()
    cut = wav_truncated(data)
    if cut is not None:
        raise ValueError(f"audio {name!r} is truncated: its WAV header says {cut[0]} bytes of samples, the file "
                         f"holds {cut[1]}; check the file")
    return decode_audio(io.BytesIO(data), name, rate), name


def _resolve(ref, base: Path) -> tuple[Path, str]:
    if isinstance(ref, dict):
        ref = ref.get("path")
    if not isinstance(ref, str) or not ref:
        raise ValueError(f"an audio must be a path, {{'path': ...}}, {{'bytes': ...}} or "
                         f"{{'array': [...], 'sampling_rate': sr}}, got {ref!r}")
    p = Path(ref).expanduser()
    return (p if p.is_absolute() else base / p), ref


# ---------------------------------------------------------------------------- features


def clip_features(samples: np.ndarray, fe) -> np.ndarray:
    """float32 ``[mel, L]`` log-mel features of mono ``samples`` at the extractor's rate, the real frames
    only, as the Qwen-Omni processors compute them (``padding="max_length"``, the mask giving ``L``)."""
    out = fe(samples, sampling_rate=fe.sampling_rate, padding="max_length", return_attention_mask=True,
             return_tensors="np")
    frames = int(np.asarray(out["attention_mask"])[0].sum())
    return np.ascontiguousarray(np.asarray(out["input_features"], dtype=np.float32)[0, :, :frames])


@dataclass
class RowAudios:
    """The processed clips of one row: ``features`` float32 ``[mel, Σ L_k]`` (clips side by side, in
    order) and ``frames`` int64 ``[k]`` (each clip's ``L_k``)."""

    features: np.ndarray
    frames: np.ndarray

    def clips(self) -> list[np.ndarray]:
        """Each clip's ``[mel, L_k]`` (views)."""
        ends = np.cumsum(self.frames)
        return [self.features[:, e - n: e] for n, e in zip(self.frames.tolist(), ends.tolist())]


def row_audios(refs: list, base: Path, fe, limit_seconds: float) -> RowAudios:
    """A row's clips decoded, resampled and turned into features (``fe``: the feature extractor;
    ``limit_seconds``: :func:`max_seconds`). ValueError naming the clip on a fault (module docstring)."""
    rate = int(fe.sampling_rate)
    feats, frames = [], []
    for ref in refs:
        samples, name = load_clip(ref, base, rate)
        if samples.size == 0:
            raise ValueError(f"audio {name!r} has no samples (a zero-length clip); remove it")
        seconds = samples.size / rate
        if seconds > limit_seconds + 1e-9:
            raise ValueError(f"audio {name!r} is {seconds:.2f} s long, more than max_audio_seconds="
                             f"{limit_seconds:g}; cut it or raise max_audio_seconds")
        f = clip_features(samples, fe)
        if f.shape[1] == 0:
            raise ValueError(f"audio {name!r} ({samples.size} samples) gives no feature frame; remove it")
        feats.append(f)
        frames.append(f.shape[1])
    return RowAudios(np.concatenate(feats, axis=1), np.asarray(frames, np.int64))
