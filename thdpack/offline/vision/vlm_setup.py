"""Offline VLM builds, set-up and planning: :func:`vlm_build` / :class:`VlmBuild`, the one object the build calls.

Rows with images (``images_field``, ``<image>`` markers or content parts) and videos (``videos_field``,
``<video>`` markers or parts), in the LLaMA-Factory layout::

    {"messages": [{"role": "user", "content": "<image>What is this?"},
                  {"role": "assistant", "content": "A cat."}],
     "images": ["img/cat.png"]}

The build turns on with a Qwen-VL family ``model_config`` (:func:`thdpack.vlm.supported_model_types`) and
rows with images (or ``vision_budget`` / ``image_processor`` set). Each image goes through the family's image
processor (``pixel_values`` float32 ``[P, D]``, ``image_grid_thw`` int ``[k, 3]``), each marker becomes its
vision tokens (never targets), and planning adds the vision budget; a row with images is never truncated or
split. Per pack, the vision columns (format version 2): ``pixel_values`` / ``image_grid_thw`` /
``image_counts``, and for videos ``pixel_values_videos`` / ``video_grid_thw`` / ``second_per_grid_ts`` /
``video_counts``.

The other stages: :mod:`thdpack.offline.vision.media` (images and videos), :mod:`thdpack.offline.vision.vlm_rows`
(the row tokenizer), :mod:`thdpack.offline.store.vision_columns` (pack columns, metadata, stats),
:mod:`thdpack.offline.store.vision_readback` (read-back). In full: docs/vlm.md, "Offline VLM builds: rows,
steps and columns".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from thdpack.offline.tokenizing.chat_content import IMAGE_PART_TYPES, VIDEO_PART_TYPES
from thdpack.offline.errors import ConfigError
from thdpack.offline.store.schema import VLM_FORMAT_VERSION
from thdpack.offline.vision.media import load_image_processor
from thdpack.offline.inputs.sources import JSON_COLUMN
from thdpack.offline.store.vision_columns import (PROCESSOR_DIR, VISION_COLUMNS, VisionColumns, image_stats,
                                            row_grids, row_vision_patches, vision_metadata)
from thdpack.offline.vision.vlm_rows import VISION_MAP_BATCH_SIZE, VlmRowTokenizer, row_features

# the Qwen-VL families' defaults when a config dict leaves them out
_DEFAULT_VISION_END = {"qwen3_5": 248054, "qwen3_5_moe": 248054}
_DEFAULT_VISION_END_ID = 151653


# ---------------------------------------------------------------------------- set-up


@dataclass(frozen=True)
class RowMedia:
    """What :meth:`VlmBuild.plan_checks` gives an omni build with ``audio_budget``: int64 ``[rows]`` vision
    patches and audio feature frames of every row."""

    patches: np.ndarray
    audio_frames: np.ndarray


@dataclass
class VlmBuild:
    """What a VLM build needs besides the text pipeline (made by :func:`vlm_build`)."""

    model_config: dict
    family: object  # thdpack.vlm family
    processor: object
    pixel_dim: int
    image_placeholder: str
    images_field: str
    image_dir: Path | None
    vision_budget: int | None
    vision_end_token_id: int
    row_dirs: list = field(default_factory=list)  # directory of each input file (for relative image paths)
    videos_field: str = "videos"
    video_placeholder: str = "<video>"
    video_options: object = None  # thdpack.offline.vision.video.VideoOptions
    overflow: str = "error"  # the build's overflow: "truncate" cuts videos over vision_budget to their first frames
    audio: object = None  # an omni build's thdpack.offline.vision.omni_audio.AudioBuild, or None

    # ---- tokenization
    def map_batch_size(self, requested: int) -> int:
        """Rows per tokenization batch: at most :data:`VISION_MAP_BATCH_SIZE`, since a batch's
        float32 pixel rows (a short video: megabytes) are held together until it is written."""
        return min(requested, VISION_MAP_BATCH_SIZE)

    def row_tokenizer(self, fmt: str, opts, tokenizer, columns, source, bpe=None) -> VlmRowTokenizer:
        """The row tokenizer of this build (``opts``: the :class:`~thdpack.offline.stage_options.TokenizeOptions`)."""
        if self.audio is not None:
            from thdpack.offline.vision.omni_audio import OmniRowTokenizer

            return OmniRowTokenizer(fmt, opts, tokenizer, columns, self, source, bpe)
        return VlmRowTokenizer(fmt, opts, tokenizer, columns, self, source, bpe)

    def features(self) -> dict:
        return row_features() if self.audio is None else {**row_features(), **self.audio.features()}

    def input_columns(self) -> list[str]:
        return [self.images_field, self.videos_field] + ([self.audio.field] if self.audio is not None else [])

    # ---- planning
    def plan_checks(self, plan, tokenized, usable: np.ndarray) -> tuple[np.ndarray, list[tuple[int, str]]]:
        """Vision patches of every row (with ``audio_budget``, :class:`RowMedia`: also its audio frames), and
        the usable rows that break a rule of VLM planning (``(row, reason)``): more patches than
        ``vision_budget`` (more audio frames than ``audio_budget``), or too long with images (audio) under
        ``overflow: truncate / split`` (``plan``: the build's :class:`~thdpack.planning.options.PlanOptions`)."""
        stats = image_stats(tokenized.dataset.data.table)
        patches = row_vision_patches(tokenized.dataset.data.table)
        bad = []
        limit = plan.usable_length
        for r in np.flatnonzero(usable).tolist():
            p = int(patches[r])
            if not p or plan.overflow == "drop":
                continue
            if self.vision_budget is not None and p > self.vision_budget:
                bad.append((r, f"{p} vision patches, more than vision_budget={self.vision_budget} allows "
                               f"(overflow={plan.overflow}; use overflow: drop or a larger vision_budget)"))
            elif plan.overflow in ("truncate", "split") and tokenized.lengths[r] > limit:
                bad.append((r, f"{int(tokenized.lengths[r])} tokens, more than pack_size={plan.pack_size} allows, "
                               f"with {int(stats.row_images[r])} image(s): a VLM row cannot be {plan.overflow} "
                               "(its placeholders must match its grids); use overflow: drop or a larger pack_size"))
        if self.audio is not None:
            from thdpack.offline.vision.omni_audio import audio_plan_checks

            bad, frames = audio_plan_checks(plan, tokenized, usable, bad, self.audio.budget)
            if self.audio.budget is not None:
                return RowMedia(patches, frames), bad
        return patches, bad

    def plan_kwargs(self, patches, sample_rows: np.ndarray) -> dict:
        """``plan_packs``' vision (and audio) budget keywords for ``sample_rows`` (``patches``: what
        :meth:`plan_checks` returned)."""
        out = {}
        if isinstance(patches, RowMedia):
            out = {"audio_lengths": patches.audio_frames[sample_rows], "audio_budget": self.audio.budget}
            patches = patches.patches
        if self.vision_budget is not None:
            out.update(vision_lengths=patches[sample_rows], vision_budget=self.vision_budget)
        return out

    # ---- writing
    def writer(self, token_table) -> VisionColumns:
        if self.audio is not None:
            from thdpack.offline.store.audio_columns import AudioColumns

            return AudioColumns(self.pixel_dim, token_table, self.audio.mel)
        return VisionColumns(self.pixel_dim, token_table)

    def packed_grids(self, token_table, rows: np.ndarray) -> np.ndarray:
        """int64 ``[N, 3]`` grids of the images of ``rows`` (in order)."""
        return row_grids(token_table, rows)

    def finish(self, out_dir: Path, meta: dict, token_table, piece_rows: np.ndarray, plan) -> None:
        """Add the vision part of ``metadata.json`` and save the image processor."""
        self.processor.save_pretrained(str(out_dir / PROCESSOR_DIR))
        meta["format_version"] = VLM_FORMAT_VERSION
        meta["columns"] = list(meta["columns"]) + list(VISION_COLUMNS)
        meta["vision"] = vision_metadata(self, token_table, piece_rows, plan)
        if self.audio is not None:
            from thdpack.offline.store.audio_columns import AUDIO_COLUMNS, FEATURE_EXTRACTOR_DIR, audio_metadata

            self.audio.fe.save_pretrained(str(out_dir / FEATURE_EXTRACTOR_DIR))
            meta["columns"] = list(meta["columns"]) + list(AUDIO_COLUMNS)
            meta["audio"] = audio_metadata(self.audio, token_table, piece_rows)

def vlm_build(opts, model_config: dict | None, source) -> VlmBuild | None:
    """The :class:`VlmBuild` of the vision options ``opts`` (:class:`~thdpack.offline.stage_options.VisionOptions`)
    and the build's ``model_config``, or None for a text build."""
    from thdpack.vlm import get_family, supported_model_types
    from thdpack.common.model_config import config_first

    types = supported_model_types()
    if model_config is None or model_config.get("model_type") not in types:
        if opts.audio_budget is not None:
            raise ConfigError("audio_budget needs an omni thinker model_config and audio_processor")
        if opts.vision_budget is not None or opts.image_processor is not None:
            got = "none" if model_config is None else repr(model_config.get("model_type"))
            raise ConfigError(f"vision_budget / image_processor need a VLM model_config (model_type one of "
                              f"{', '.join(types)}), got {got}")
        return None
    if (opts.images_field not in source.columns and opts.videos_field not in source.columns
            and not _rows_have_images(source, opts) and opts.audio_processor is None
            and opts.vision_budget is None and opts.image_processor is None and opts.audio_budget is None):
        return None  # a VL model's config, text rows: a text build
    try:
        family = get_family(model_config)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"model_config: {exc}") from None
    processor = load_image_processor(opts, model_config, family)
    merge = int(getattr(processor, "merge_size", family.spatial_merge_size))
    if merge != family.spatial_merge_size:
        raise ConfigError(
            f"image processor merge_size={merge} but model_config's vision_config.spatial_merge_size="
            f"{family.spatial_merge_size}: the placeholders would not match the model's"
        )
    patch = int(processor.patch_size)
    temporal = int(getattr(processor, "temporal_patch_size", 1) or 1)
    pixel_dim = 3 * temporal * patch * patch
    vc = model_config.get("vision_config") or {}
    want = {"patch_size": vc.get("patch_size"), "temporal_patch_size": vc.get("temporal_patch_size")}
    got = {"patch_size": patch, "temporal_patch_size": temporal}
    for k, v in want.items():
        if v is not None and int(v) != got[k]:
            raise ConfigError(f"image processor {k}={got[k]} but model_config's vision_config.{k}={v}")
    end = config_first(model_config, ("vision_end_token_id", "text_config.vision_end_token_id"),
                       _DEFAULT_VISION_END.get(family.model_type, _DEFAULT_VISION_END_ID))
    from thdpack.offline.vision.omni_audio import audio_build

    audio = audio_build(opts, model_config, family)
    row_dirs = [_file_dir(opts, f) for f in source.files]
    from thdpack.offline.vision.video import VideoOptions
    from thdpack.offline.vision.video_processor import resolve_backend

    try:
        video_options = resolve_backend(VideoOptions.from_config(opts.video), family.model_type)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    return VlmBuild(
        model_config=model_config,
        family=family,
        processor=processor,
        pixel_dim=pixel_dim,
        image_placeholder=opts.image_placeholder,
        images_field=opts.images_field,
        image_dir=opts.image_dir_path,
        vision_budget=opts.vision_budget,
        vision_end_token_id=int(end),
        row_dirs=row_dirs,
        videos_field=opts.videos_field,
        video_placeholder=opts.video_placeholder,
        video_options=video_options,
        overflow=opts.overflow,
        audio=audio,
    )


def _rows_have_images(source, opts, limit: int = 1000) -> bool:
    """Whether one of the first ``limit`` rows has the images field or an image part in
    its messages (``source.columns`` holds the first JSON row's fields only)."""
    import json

    n = min(limit, len(source.dataset))
    if source.is_json:
        col = source.dataset.data.column(JSON_COLUMN)
        rows = []
        for i in range(n):
            try:
                obj = json.loads(col[i].as_py())
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(obj, dict):
                if opts.images_field in obj or opts.videos_field in obj:
                    return True
                rows.append(obj.get(opts.messages_field))
    elif opts.messages_field in source.columns:
        rows = source.dataset.data.column(opts.messages_field).slice(0, n).to_pylist()
    else:
        return False
    return any(isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES + VIDEO_PART_TYPES
               for messages in rows if isinstance(messages, list)
               for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
               for part in m["content"])


def _file_dir(opts, source_file) -> Path:
    """The directory of the input file ``source_file`` (the base directory for demo rows)."""
    if source_file.kind in ("demo",):
        return opts.base_dir
    p = opts.resolve_path(source_file.path)
    return p if p.is_dir() else p.parent
