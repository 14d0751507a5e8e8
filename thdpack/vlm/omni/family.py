"""The omni thinkers as a VLM family: Qwen2.5-Omni (``qwen2_5_omni_thinker``) and Qwen3-Omni-MoE
(``qwen3_omni_moe_thinker``), and their whole-model configs (``qwen2_5_omni``, ``qwen3_omni_moe``, whose
``thinker_config`` is read).

A sample may carry, beside ``pixel_values`` / ``image_grid_thw`` and ``pixel_values_videos`` /
``video_grid_thw`` (as for the Qwen-VL families), audio clips: ``input_features`` (``[mel, L]`` one clip, or
``[k, mel, W]`` with ``feature_attention_mask`` ``[k, W]``, the processor's output;
:func:`thdpack.vlm.omni.audio.read_clips`), ``video_second_per_grid`` (``[videos]``, seconds per temporal
grid step; 1 where absent) and ``use_audio_in_video`` (bool; the video's audio interleaved with its frames).
The pack gets:

- the vision fields of :func:`thdpack.vlm.vision_fields.attach_vision` (pixels and grids in pack order);
- ``input_features`` float ``[clips, mel, W]`` and ``feature_attention_mask`` int64 ``[clips, W]``: every clip
  of the pack re-padded to the longest, what the thinker's audio tower reads;
  ``audio_feature_lengths`` int64 ``[clips]``, ``audio_sample_index`` int64 ``[clips]``,
  ``sample_audio_frames`` int64 ``[n]``;
- ``mrope_position_ids`` int64 ``[3, T]``: TMRoPE, sample by sample what the model's ``get_rope_index`` gives
  for the sample alone (:func:`thdpack.vlm.omni.rope.omni_positions`); pad slots continue as text;
- ``mm_token_type_ids`` int32 ``[T]``: 0 text, 1 image, 2 video, 3 audio (not passed to the thinker, which
  takes none).

The number of audio placeholder tokens of every clip is checked against the model's own length rule
(:func:`thdpack.vlm.omni.rope.audio_tokens`): a mismatch is a :class:`thdpack.SampleError` naming the sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from thdpack.common.align import check_int
from thdpack.common.model_config import config_first, config_get
from thdpack.common.samples import SampleError, get_field
from thdpack.vlm.convention import EXACT
from thdpack.vlm.families import register_family
from thdpack.vlm.items import MODE_INT
from thdpack.vlm.omni.audio import feature_lengths, pack_clips, read_clips
from thdpack.vlm.omni.rope import OmniRopeConfig, audio_tokens, omni_positions
from thdpack.vlm.vision_fields import _pack_grids, _read_vision, _to_numpy, _vision_extras, vision_lengths

TEXT, IMAGE, VIDEO, AUDIO = 0, 1, 2, 3


@register_family
@dataclass(frozen=True)
class OmniThinker:
    """An omni thinker's constants (from its config) and the pack's audio, vision and TMRoPE fields."""

    MODEL_TYPES = ("qwen2_5_omni_thinker", "qwen3_omni_moe_thinker", "qwen2_5_omni", "qwen3_omni_moe")
    USES_SECOND_PER_GRID_TS = False  # the thinker's name for it is video_second_per_grid, read here
    VIDEO_FRAMES_ARE_ITEMS = False  # Qwen-Omni's processors: one vision run per video

    model_type: str
    rope: OmniRopeConfig
    spatial_merge_size: int
    patch_shape: tuple[int, int, int] | None = None
    mrope_convention: str = EXACT

    @classmethod
    def from_config(cls, config, mrope_convention: str | None = None) -> "OmniThinker":
        """The family of a thinker config (or a whole omni model's, through its ``thinker_config``)."""
        if config_get(config, "model_type") in ("qwen2_5_omni", "qwen3_omni_moe"):
            config = config_get(config, "thinker_config")
        if mrope_convention not in (None, "transformers-installed", EXACT):
            raise ValueError(f"{config_get(config, 'model_type')}: omni positions follow the installed transformers' "
                             f"get_rope_index; mrope_convention={mrope_convention!r} is not available for them")
        merge = config_get(config, "vision_config.spatial_merge_size", 2)
        patch = config_get(config, "vision_config.patch_size", None)
        channels = config_first(config, ("vision_config.in_channels", "vision_config.in_chans"), 3)
        temporal = config_get(config, "vision_config.temporal_patch_size", 2)
        for key, value in (("vision_config.spatial_merge_size", merge), ("vision_config.patch_size", patch),
                           ("vision_config.in_channels", channels), ("vision_config.temporal_patch_size", temporal)):
            if value is not None:
                check_int(value, f"the model config's {key}", 1)
        return cls(model_type=config_get(config, "model_type"), rope=OmniRopeConfig.from_config(config),
                   spatial_merge_size=int(merge),
                   patch_shape=None if patch is None else (int(channels), int(temporal), int(patch)))

    # ---- what the shared vision reader asks of a family ----------------------------------
    @property
    def image_token_id(self) -> int:
        return self.rope.image_token_id

    @property
    def video_token_id(self) -> int:
        return self.rope.video_token_id

    @property
    def vision_start_token_id(self) -> int:
        return self.rope.vision_start_token_id

    @property
    def supports_video(self) -> bool:
        return True

    @property
    def pixel_width(self) -> int | None:
        if self.patch_shape is None:
            return None
        channels, temporal, patch = self.patch_shape
        return channels * temporal * patch * patch

    def time_intervals(self, second_per_grid_ts, n_videos: int, *, sample: int = 0):
        """Unused spacing for :func:`thdpack.vlm.vision_fields._read_vision` (TMRoPE spaces videos itself)."""
        return np.ones(n_videos, np.float64), np.full(n_videos, MODE_INT, np.int8)

    def vit_segments(self, grid_thw: np.ndarray) -> np.ndarray:
        """int64 patch counts of the vision tower's attention segments: one per frame (``h·w``)."""
        grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
        return np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0])

    # ---- the builder's interface (thdpack.batching.vision_family.VisionFamily) ------------
    def attach(self, batch, samples):
        """Add the pack's vision, audio and TMRoPE fields to ``batch`` (in place; module docstring)."""
        samples = list(samples)
        n = batch.num_samples
        vision = _read_vision(samples, self)
        grids = _pack_grids(vision, n)
        clips = [read_clips(s, i) for i, s in enumerate(samples)]
        self._check_chunk_widths(clips)
        ids = batch.input_ids.numpy()
        cu = batch.cu_seqlens_padded.numpy().astype(np.int64)
        seq = batch.seq_lens.numpy().astype(np.int64)
        positions = np.zeros((3, ids.size), self.rope.position_dtype)  # Qwen3-Omni's are float32, as its own
        token_type = np.zeros(ids.size, np.int32)
        deltas = np.zeros(n, self.rope.position_dtype)
        spg_parts = []
        image_at = np.concatenate([[0], np.cumsum(grids.image_counts)])
        video_at = np.concatenate([[0], np.cumsum(grids.video_counts)])
        for i, sample in enumerate(samples):
            own = ids[cu[i]: cu[i] + seq[i]]
            lengths = feature_lengths(clips[i])
            self._check_audio_tokens(own, lengths, i, batch.tokens_truncated)
            spg = self._second_per_grid(sample, i, int(grids.video_counts[i]))
            spg_parts.append(spg)
            image_grid = grids.image_grid[image_at[i]: image_at[i + 1]]
            video_grid = grids.video_grid[video_at[i]: video_at[i + 1]]
            pos = omni_positions(self.rope, own, image_grid_thw=image_grid if image_grid.size else None,
                                 video_grid_thw=video_grid if video_grid.size else None,
                                 second_per_grid=spg if spg.size else None, audio_feature_lengths=lengths,
                                 use_audio_in_video=_flag(sample, i), sample=i)
            top = pos.max() + 1 if pos.size else 0
            positions[:, cu[i]: cu[i] + seq[i]] = pos
            positions[:, cu[i] + seq[i]: cu[i + 1]] = top + np.arange(cu[i + 1] - cu[i] - seq[i])
            deltas[i] = top - seq[i]
        token_type[ids == self.rope.image_token_id] = IMAGE
        token_type[ids == self.rope.video_token_id] = VIDEO
        token_type[ids == self.rope.audio_token_id] = AUDIO
        real = np.zeros(ids.size, bool)
        for i in range(n):
            real[cu[i]: cu[i] + seq[i]] = True
        token_type[~real] = TEXT
        batch.token_extras["mm_token_type_ids"] = torch.from_numpy(token_type)
        batch.token_extras["mrope_position_ids"] = torch.from_numpy(positions)
        batch.extras.update(_vision_extras(self, vision, grids, deltas))
        batch.extras.update(self._audio_extras(clips, spg_parts, n))
        return batch

    def vision_lengths(self, samples) -> np.ndarray:
        """int64 ``[n]`` vision-tower patches per sample."""
        return vision_lengths(samples)

    def audio_lengths(self, samples) -> np.ndarray:
        """int64 ``[n]`` audio feature frames per sample (the audio encoder's input)."""
        return np.fromiter((int(feature_lengths(read_clips(s, i)).sum()) for i, s in enumerate(samples)), np.int64,
                           count=len(samples))

    def prefix_limit(self, flat):
        raise ValueError(f"{self.model_type}: shared prefixes (share_prefix=) are not supported for omni batches yet; "
                         "pack these samples without share_prefix")

    def attach_tree(self, tree, flat):
        raise ValueError(f"{self.model_type}: shared prefixes (share_prefix=) are not supported for omni batches yet")

    # ---- helpers ------------------------------------------------------------------------
    def _check_audio_tokens(self, ids: np.ndarray, lengths: np.ndarray, i: int, truncated: int) -> None:
        """``SampleError`` unless the sample's audio placeholders are as many as its clips' tokens."""
        expected = audio_tokens(self.rope, lengths)
        found = int((ids == self.rope.audio_token_id).sum())
        if found != int(expected.sum()):
            per = ", ".join(f"{int(f)} frames -> {int(t)}" for f, t in zip(lengths, expected)) or "no clips"
            hint = f" (note: max_length truncation cut {truncated} tokens from this batch's samples)" if truncated else ""
            raise SampleError.at(i, f": has {found} audio placeholder tokens (id {self.rope.audio_token_id}) but its "
                                    f"{lengths.size} audio clip(s) make {int(expected.sum())} ({per}){hint}",
                                 field="input_features")

    def _check_chunk_widths(self, clips: list) -> None:
        """Qwen3-Omni's audio tower pads every chunk of one call to the widest (``min(L, 2·n_window)`` frames of
        the clips) and its stride-2 convolutions read that padding: a clip is exact in the pack only where its own
        widest chunk is the pack's. ``ValueError`` naming two clips that differ (Qwen2.5-Omni masks the padding:
        any clips pack exactly)."""
        if self.rope.n_window is None:
            return
        chunk = 2 * self.rope.n_window
        widths = [(min(int(c.shape[-1]), chunk), i, k, int(c.shape[-1])) for i, per in enumerate(clips)
                  for k, c in enumerate(per)]
        if len({w for w, *_ in widths}) > 1:
            a, b = min(widths), max(widths)
            raise ValueError(f"{self.model_type}: audio clip {a[2]} of sample {a[1]} ({a[3]} frames) and clip {b[2]} of "
                             f"sample {b[1]} ({b[3]} frames) cannot share a pack exactly: the audio tower pads every "
                             f"chunk of a call to the widest ({b[0]} frames) and its convolutions read that padding. "
                             f"Pack clips shorter than {chunk} frames only with clips of their own length")

    @staticmethod
    def _second_per_grid(sample, i: int, n_videos: int) -> np.ndarray:
        """float32 ``[n_videos]`` the sample's ``video_second_per_grid`` (1.0 where absent)."""
        value = get_field(sample, "video_second_per_grid", i)
        if value is None:
            return np.ones(n_videos, np.float32)
        arr = _to_numpy(value).astype(np.float32).reshape(-1)
        if arr.size != n_videos or not np.isfinite(arr).all() or (arr < 0).any():
            raise SampleError.at(i, f": 'video_second_per_grid' must hold one finite value >= 0 per video "
                                    f"({n_videos}), got {arr.tolist()}", field="video_second_per_grid")
        return arr

    @staticmethod
    def _audio_extras(clips: list, spg_parts: list, n: int) -> dict:
        flat = [c for per in clips for c in per]
        counts = np.array([len(per) for per in clips], np.int64)
        lengths = feature_lengths(flat)
        features, mask = pack_clips(flat) if flat else (None, None)
        sample_frames = np.array([int(feature_lengths(per).sum()) for per in clips], np.int64)
        spg = np.concatenate(spg_parts) if spg_parts else np.zeros(0, np.float32)
        return {
            "input_features": features,
            "feature_attention_mask": mask,
            "audio_feature_lengths": torch.from_numpy(lengths),
            "audio_sample_index": torch.from_numpy(np.repeat(np.arange(n, dtype=np.int64), counts)),
            "sample_audio_frames": torch.from_numpy(sample_frames),
            "video_second_per_grid": torch.from_numpy(spg) if spg.size else None,
            "hf_token_types": False,
        }


def _flag(sample, i: int) -> bool:
    value = get_field(sample, "use_audio_in_video", i)
    if value is None:
        return False
    if isinstance(value, torch.Tensor):
        value = value.item()
    if not isinstance(value, (bool, np.bool_)):
        raise SampleError.at(i, f": 'use_audio_in_video' must be a bool, got {value!r}", field="use_audio_in_video")
    return bool(value)
