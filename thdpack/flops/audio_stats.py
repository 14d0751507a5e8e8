"""Audio-encoder counts of the Qwen-Omni thinkers (Qwen2.5-Omni, Qwen3-Omni-MoE) from the clips'
feature frame counts: conv positions, encoder tokens and ``Σ (tokens per attention chunk)²``.

The encoder of one call splits every clip's mel frames into chunks of ``2·n_window`` frames (the
last one shorter), pads all chunks of the call to the longest, runs its stride convs on the padded
chunks, then its transformer layers on the real tokens, attention inside each chunk (Qwen2.5-Omni)
or each ``n_window_infer`` window of chunks (Qwen3-Omni): ``Σ chunk²``, never the clip length squared.
An audio config is read with :func:`thdpack.common.model_config.config_get`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from thdpack.common.align import check_int
from thdpack.common.model_config import config_get, config_int

__all__ = ["AudioStats", "audio_config_of", "audio_family", "audio_seqlen_stats", "feature_length_rows"]


@dataclass(frozen=True)
class AudioStats:
    """Work of a Qwen-Omni audio encoder over the clips of one call (add the stats of several calls).

    Attributes:
        clips: clips with at least one frame.
        frames: real feature (mel) frames ``Σ Lᵢ``.
        chunks: conv chunks (``⌈Lᵢ / 2·n_window⌉`` per clip).
        padded_frames: ``chunks · T``, ``T`` the call's longest chunk: the frames the conv stack runs on
            (every chunk is padded to ``T``).
        padded_frames_2, padded_frames_4, padded_frames_8: ``chunks · ⌈T/2⌉`` (``⌈T/4⌉``, ``⌈T/8⌉``): the
            time positions after one (two, three) stride-2 convs of the padded chunks.
        tokens: tokens through the transformer layers (Qwen2.5: ``⌈c/2⌉`` per chunk of ``c`` frames;
            Qwen3: ``⌈c/8⌉``).
        seqlen_squared_sum: ``Σ`` over attention segments of (tokens in the segment)²: the chunks
            (Qwen2.5-Omni) or the ``n_window_infer`` windows (Qwen3-Omni), as the encoder's ``cu_seqlens``.
        output_tokens: tokens out of the encoder's output projection (Qwen2.5: after the stride-2
            average pool, ``⌊⌈Lᵢ/2⌉ / 2⌋`` per clip; Qwen3: ``tokens``).
    """

    clips: int = 0
    frames: int = 0
    chunks: int = 0
    padded_frames: int = 0
    padded_frames_2: int = 0
    padded_frames_4: int = 0
    padded_frames_8: int = 0
    tokens: int = 0
    seqlen_squared_sum: int = 0
    output_tokens: int = 0

    def __add__(self, other: "AudioStats") -> "AudioStats":
        return AudioStats(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


def audio_config_of(config):
    """The audio encoder's config: ``config.audio_config`` (the thinker config), the whole Qwen-Omni
    config's ``thinker_config.audio_config``, ``config`` itself when it is an audio-encoder config (has
    ``n_window``), else None."""
    audio = config_get(config_get(config, "thinker_config", config), "audio_config", None)
    if audio is None and config_get(config, "n_window", None) is not None:
        audio = config
    return audio


def audio_family(audio_config) -> str | None:
    """``"qwen3_omni"`` (a Conv2d stack: ``downsample_hidden_size``), ``"qwen2_5_omni"`` (two Conv1d:
    ``n_window`` without it), or None for an audio encoder these counts do not cover."""
    if audio_config is None or config_get(audio_config, "n_window", None) is None:
        return None
    model_type = config_get(audio_config, "model_type", "") or ""
    if config_get(audio_config, "downsample_hidden_size", None) is not None or model_type.startswith("qwen3_omni"):
        return "qwen3_omni"
    return "qwen2_5_omni"


def feature_length_rows(feature_lengths) -> np.ndarray:
    """int64 ``[k]`` of per-clip feature frame counts (torch, numpy, a list or one int), each an integer
    >= 0 (:func:`thdpack.common.align.check_int`, naming ``audio_feature_lengths[i]``)."""
    if isinstance(feature_lengths, torch.Tensor):
        feature_lengths = feature_lengths.detach().cpu().numpy()
    rows = np.asarray(feature_lengths, dtype=object).reshape(-1)
    for i, value in enumerate(rows):
        check_int(value.item() if isinstance(value, np.generic) else value, f"audio_feature_lengths[{i}]", 0,
                  hint=" (mel frames of a clip)")
    return rows.astype(np.int64)


def _ceil_div(a: np.ndarray, b: int) -> np.ndarray:
    return -(-a // b)


def audio_seqlen_stats(feature_lengths, audio_config) -> AudioStats:
    """:class:`AudioStats` of the clips of one encoder call, ``feature_lengths`` their mel frame counts
    (``feature_lens`` / ``audio_feature_lengths`` of the model's inputs), ``audio_config`` a Qwen-Omni config,
    its thinker config or its audio config (:func:`audio_config_of`).

    As transformers' ``chunk_and_pad_features``, ``get_audio_cu_seqlens`` and ``get_valid_indices``: chunks of
    ``n = 2·n_window`` frames, all padded to the call's longest chunk ``T``. Qwen2.5-Omni: conv1 (k3, s1),
    conv2 (k3, s2) give ``⌈c/2⌉`` tokens a chunk, attention per chunk, an average pool of 2 per clip before
    ``proj``. Qwen3-Omni: three Conv2d (k3, s2) give ``⌈c/8⌉`` tokens a chunk; attention runs in windows of
    ``⌈n/8⌉ · (n_window_infer // n)`` tokens of each clip (the last partial); transformers writes ``⌈n/8⌉`` as
    13, its value at ``n_window = 50``. A clip of 0 frames adds nothing.
    """
    audio = audio_config_of(audio_config)
    family = audio_family(audio)
    if family is None:
        raise ValueError("the model config has no Qwen-Omni audio encoder (an audio_config with n_window); "
                         "pass a Qwen2.5-Omni or Qwen3-Omni config, its thinker_config or its audio_config")
    lengths = feature_length_rows(feature_lengths)
    lengths = lengths[lengths > 0]
    if lengths.size == 0:
        return AudioStats()
    n = 2 * config_int(audio, "n_window", where="audio_config.")
    full, tail = lengths // n, lengths % n
    chunks = int(full.sum() + (tail > 0).sum())
    longest = n if full.any() else int(tail.max())
    stride = 2 if family == "qwen2_5_omni" else 8  # frames per token after the convs
    per_full, per_tail = -(-n // stride), _ceil_div(tail, stride)
    clip_tokens = full * per_full + per_tail
    if family == "qwen2_5_omni":
        square = int((full * per_full**2 + per_tail**2).sum())
        output = int((clip_tokens // 2).sum())
    else:
        ratio = config_int(audio, "n_window_infer", where="audio_config.") // n
        if ratio < 1:
            raise ValueError(f"audio_config.n_window_infer must be at least 2·n_window = {n} frames")
        window = per_full * ratio
        square = int(((clip_tokens // window) * window**2 + (clip_tokens % window) ** 2).sum())
        output = int(clip_tokens.sum())
    return AudioStats(clips=int(lengths.size), frames=int(lengths.sum()), chunks=chunks,
                      padded_frames=chunks * longest, padded_frames_2=chunks * -(-longest // 2),
                      padded_frames_4=chunks * -(-longest // 4), padded_frames_8=chunks * -(-longest // 8),
                      tokens=int(clip_tokens.sum()), seqlen_squared_sum=square, output_tokens=output)
