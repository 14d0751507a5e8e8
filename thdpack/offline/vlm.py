"""Offline VLM builds: rows with image paths, processed with the family's image processor.

Rows (JSON Lines, Parquet, ...) in the common LLaMA-Factory layout::

    {"messages": [{"role": "user", "content": "<image>What is this?"},
                  {"role": "assistant", "content": "A cat."}],
     "images": ["img/cat.png"]}

(or ``{"text": "... <image> ...", "images": [...]}``). The build turns on when
``model_config`` is a Qwen-VL family config (:func:`thdpack.vlm.supported_model_types`)
and the rows have the ``images_field`` (or ``vision_budget`` / ``image_processor`` is
set). Then, per row:

1. every image is opened (PIL; a path relative to ``image_dir``, default the directory
   of the row's input file; or ``{"bytes": ...}`` / ``{"path": ...}`` as ``datasets``'
   ``Image`` feature stores it) and the row's images go through the image processor:
   ``pixel_values`` ``[P, D]`` float32 and ``image_grid_thw`` ``[k, 3]``;
2. the k-th ``image_placeholder`` marker in the text (messages in order) becomes
   ``<|vision_start|>`` + ``t·h·w / merge²`` × ``<|image_pad|>`` + ``<|vision_end|>`` (the
   tokens of the config's ``vision_start_token_id`` / ``image_token_id`` /
   ``vision_end_token_id``, as Qwen-VL processors expand them); markers and images must
   match one to one;
3. the text is tokenized as any chat / text row; the image tokens are never targets,
   and their count must equal the grids' (a tokenizer that splits them fails the row).

Planning adds the vision budget (``plan_packs(vision_lengths=..., vision_budget=...)``);
a row with images is never truncated or split (its placeholders must match its
grids): a too long one is a bad row, or dropped under ``overflow: drop``.

Per pack, three more columns (format version 2):

=================  ======================  ==========================================
``pixel_values``   large_list<float32>     the pack's images' patches, row-major
                                           ``[P_pack, pixel_dim]``, in sample order
``image_grid_thw`` list<int32>             ``(t, h, w)`` of every image, 3 values each
``image_counts``   list<int32>             images of each sample
=================  ======================  ==========================================

:func:`thdpack.offline.unpack_row` gives every sample its ``pixel_values`` /
``image_grid_thw`` back, and ``load_packed(path).collator()`` passes the saved model
config to :func:`thdpack.build_thd_batch`, so a batch carries the mRoPE rows, token
types and vision inputs that ``to_hf_kwargs()`` feeds the model. The image processor
and the model config are saved with the dataset (``image_processor/``,
``model_config.json``).

Message content may also be a list of parts, as ``transformers`` processors and TRL
take it: ``[{"type": "image"}, {"type": "text", "text": "What is this?"}]`` with the
images in the images field, or ``{"type": "image", "image": "img/cat.png"}`` naming its
own (``"path"`` / ``"url"`` work too; local files only). Each image part stands where a
marker would.

Videos: a ``videos`` field (``videos_field``) with ``<video>`` markers
(``video_placeholder``), or content parts ``{"type": "video", "video": PATH}``, mixed
with images and text. Each video is decoded and its frames prepared as Qwen's
preprocessing and the family's transformers video processor do it
(:mod:`thdpack.offline.video`: PyAV, options in ``video:``), with that video processor's
mean / std (not the image processor's); the marker becomes
``<|vision_start|>`` + ``t·h·w / merge²`` × ``<|video_pad|>`` + ``<|vision_end|>``
(Qwen3-VL / Qwen3.5: per temporal patch ``<{t:.1f} seconds>`` + start + ``h·w / merge²``
pads + end, as their processors write it). Per pack, four more columns:
``pixel_values_videos`` (large_list<float32>), ``video_grid_thw`` (list<int32>),
``second_per_grid_ts`` (list<float32>, ``temporal / sampled fps`` of every video) and
``video_counts`` (list<int32>). Video patches count in ``vision_budget`` with images.

Not covered here: the rows' image / video bytes in the source fingerprint.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from thdpack.offline.errors import ConfigError, InputError
from thdpack.offline.format import VLM_FORMAT_VERSION, row_list
from thdpack.offline.sources import JSON_COLUMN
from thdpack.offline.tokenize import (IMAGE_PART_TYPES, VIDEO_PART_TYPES, RowTokenizer,
                                      flatten_content, _row_error)
from thdpack.samples import IGNORE_INDEX

VIDEO_COLUMNS = ("pixel_values_videos", "video_grid_thw", "video_counts", "second_per_grid_ts")
VISION_COLUMNS = ("pixel_values", "image_grid_thw", "image_counts") + VIDEO_COLUMNS
VISION_MAP_BATCH_SIZE = 16  # benchmarks/video.py: 300 videos peak 1169 MB at 64 rows a batch, 1044 MB at 16
CUT_COLUMN = "video_patches_cut"  # tokenized rows: temporal patches cut off the row's videos (overflow: truncate)
PROCESSOR_DIR = "image_processor"
# the Qwen-VL families' defaults when a config dict leaves them out
_DEFAULT_VISION_END = {"qwen3_5": 248054, "qwen3_5_moe": 248054}
_DEFAULT_VISION_END_ID = 151653
_PROCESSOR_CLASS = "Qwen2VLImageProcessor"  # what every supported family's processor config names


# ---------------------------------------------------------------------------- set-up


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
    video_options: object = None  # thdpack.offline.video.VideoOptions
    overflow: str = "error"  # cfg.overflow: "truncate" cuts videos over vision_budget to their first frames

    # ---- tokenization
    def map_batch_size(self, requested: int) -> int:
        """Rows per tokenization batch: at most :data:`VISION_MAP_BATCH_SIZE`, since a batch's
        float32 pixel rows (a short video: megabytes) are held together until it is written."""
        return min(requested, VISION_MAP_BATCH_SIZE)

    def row_tokenizer(self, fmt: str, cfg, tokenizer, columns, source, bpe=None) -> "VlmRowTokenizer":
        return VlmRowTokenizer(fmt, cfg, tokenizer, columns, self, source, bpe)

    def features(self) -> dict:
        import datasets

        return {
            "pixel_values": datasets.LargeList(datasets.Value("float32")),
            "image_grid_thw": datasets.List(datasets.Value("int32")),
            "pixel_values_videos": datasets.LargeList(datasets.Value("float32")),
            "video_grid_thw": datasets.List(datasets.Value("int32")),
            "second_per_grid_ts": datasets.List(datasets.Value("float32")),
            CUT_COLUMN: datasets.Value("int32"),
        }

    def input_columns(self) -> list[str]:
        return [self.images_field, self.videos_field]

    # ---- planning
    def plan_checks(self, cfg, tokenized, usable: np.ndarray) -> tuple[np.ndarray, list[tuple[int, str]]]:
        """Vision patches of every row, and the usable rows that break a rule of VLM
        planning (``(row, reason)``): more patches than ``vision_budget``, or too long
        with images under ``overflow: truncate / split``."""
        stats = image_stats(tokenized.dataset.data.table)
        patches = row_vision_patches(tokenized.dataset.data.table)
        bad = []
        limit = cfg.pack_size // cfg.align * cfg.align
        for r in np.flatnonzero(usable).tolist():
            p = int(patches[r])
            if not p or cfg.overflow == "drop":
                continue
            if self.vision_budget is not None and p > self.vision_budget:
                bad.append((r, f"{p} vision patches, more than vision_budget={self.vision_budget} allows "
                               f"(overflow={cfg.overflow}; use overflow: drop or a larger vision_budget)"))
            elif cfg.overflow in ("truncate", "split") and tokenized.lengths[r] > limit:
                bad.append((r, f"{int(tokenized.lengths[r])} tokens, more than pack_size={cfg.pack_size} allows, "
                               f"with {int(stats.row_images[r])} image(s): a VLM row cannot be {cfg.overflow} "
                               "(its placeholders must match its grids); use overflow: drop or a larger pack_size"))
        return patches, bad

    def plan_kwargs(self, patches: np.ndarray, sample_rows: np.ndarray) -> dict:
        if self.vision_budget is None:
            return {}
        return {"vision_lengths": patches[sample_rows], "vision_budget": self.vision_budget}

    # ---- writing
    def writer(self, token_table) -> "VisionColumns":
        return VisionColumns(self.pixel_dim, token_table)

    def packed_grids(self, token_table, rows: np.ndarray) -> np.ndarray:
        """int64 ``[N, 3]`` grids of the images of ``rows`` (in order)."""
        stats = image_stats(token_table)
        parts = [stats.grids[stats.image_offsets[r]: stats.image_offsets[r + 1]] for r in np.asarray(rows).tolist()]
        return np.concatenate(parts) if parts else np.zeros((0, 3), np.int64)

    def finish(self, out_dir: Path, meta: dict, token_table, piece_rows: np.ndarray, plan) -> None:
        """Add the vision part of ``metadata.json`` and save the image processor."""
        import dataclasses
        import json

        self.processor.save_pretrained(str(out_dir / PROCESSOR_DIR))
        stats = image_stats(token_table)
        rows = np.asarray(piece_rows)
        videos = video_stats(token_table)
        per_piece = row_vision_patches(token_table)[rows]
        per_pack = np.add.reduceat(per_piece, plan.pack_offsets[:-1]) if len(plan) else np.zeros(0, np.int64)
        meta["format_version"] = VLM_FORMAT_VERSION
        meta["columns"] = list(meta["columns"]) + list(VISION_COLUMNS)
        meta["vision"] = {
            "model_type": self.family.model_type,
            "image_token_id": self.family.image_token_id,
            "vision_start_token_id": self.family.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "spatial_merge_size": self.family.spatial_merge_size,
            "images": int(stats.row_images[rows].sum()),
            "videos": int(videos.row_images[rows].sum()),
            "video_patches_cut": _cut_patches(token_table, rows),
            "video_token_id": self.family.video_token_id,
            "video_placeholder": self.video_placeholder,
            "video": dataclasses.asdict(self.video_options),
            "vision_patches": int(per_piece.sum()),
            "max_pack_vision_patches": int(per_pack.max()) if per_pack.size else 0,
            "vision_budget": self.vision_budget,
            "pixel_dim": self.pixel_dim,
            "pixel_dtype": "float32",
            "image_placeholder": self.image_placeholder,
            "image_processor": json.loads(self.processor.to_json_string()),
            "saved_processor": PROCESSOR_DIR,
        }


def vlm_build(cfg, model_config: dict | None, source) -> VlmBuild | None:
    """The :class:`VlmBuild` of ``cfg``, or None for a text build."""
    from thdpack.vlm import get_family, supported_model_types
    from thdpack.model_config import config_first

    if model_config is None or model_config.get("model_type") not in supported_model_types():
        if cfg.vision_budget is not None or cfg.image_processor is not None:
            raise ConfigError(
                "vision_budget / image_processor need a VLM model_config (model_type one of "
                f"{', '.join(supported_model_types())}), got "
                + ("none" if model_config is None else repr(model_config.get("model_type")))
            )
        return None
    if (cfg.images_field not in source.columns and cfg.videos_field not in source.columns
            and not _rows_have_images(source, cfg)
            and cfg.vision_budget is None and cfg.image_processor is None):
        return None  # a VL model's config, text rows: a text build
    try:
        family = get_family(model_config)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"model_config: {exc}") from None
    processor = load_image_processor(cfg, model_config, family)
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
    row_dirs = [_file_dir(cfg, f) for f in source.files]
    from thdpack.offline.video import VideoOptions, video_rule

    try:
        video_options = VideoOptions.from_config(cfg.video)
        video_options.check(video_rule(family.model_type), family.model_type)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    return VlmBuild(
        model_config=model_config,
        family=family,
        processor=processor,
        pixel_dim=pixel_dim,
        image_placeholder=cfg.image_placeholder,
        images_field=cfg.images_field,
        image_dir=cfg.resolve_path(cfg.image_dir) if cfg.image_dir else None,
        vision_budget=cfg.vision_budget,
        vision_end_token_id=int(end),
        row_dirs=row_dirs,
        videos_field=cfg.videos_field,
        video_placeholder=cfg.video_placeholder,
        video_options=video_options,
        overflow=cfg.overflow,
    )


def _rows_have_images(source, cfg, limit: int = 1000) -> bool:
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
                if cfg.images_field in obj or cfg.videos_field in obj:
                    return True
                rows.append(obj.get(cfg.messages_field))
    elif cfg.messages_field in source.columns:
        rows = source.dataset.data.column(cfg.messages_field).slice(0, n).to_pylist()
    else:
        return False
    return any(isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES + VIDEO_PART_TYPES
               for messages in rows if isinstance(messages, list)
               for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
               for part in m["content"])


def _file_dir(cfg, source_file) -> Path:
    if source_file.kind in ("demo",):
        return cfg.base_dir
    p = cfg.resolve_path(source_file.path)
    return p if p.is_dir() else p.parent


def load_image_processor(cfg, model_config: dict, family):
    """The image processor: a local directory (``AutoImageProcessor``, offline), or the
    family's processor class built from ``image_processor`` keyword arguments, with
    ``patch_size`` / ``temporal_patch_size`` / ``merge_size`` from the model config."""
    import transformers

    spec = cfg.image_processor
    if isinstance(spec, str):
        path = cfg.resolve_path(spec)
        if not path.is_dir():
            raise ConfigError(f"image_processor {spec!r}: no such directory ({path})")
        try:
            return transformers.AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"image_processor {spec!r}: cannot load {path} ({exc})") from None
    kwargs = dict(spec or {})
    vc = model_config.get("vision_config") or {}
    defaults = {"patch_size": vc.get("patch_size"), "temporal_patch_size": vc.get("temporal_patch_size"),
                "merge_size": vc.get("spatial_merge_size", family.spatial_merge_size)}
    for k, v in defaults.items():
        if v is not None:
            kwargs.setdefault(k, v)
    from transformers.utils import is_torchvision_available

    name = _PROCESSOR_CLASS if is_torchvision_available() else _PROCESSOR_CLASS + "Pil"
    cls = getattr(transformers, name, None) or getattr(transformers, _PROCESSOR_CLASS)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"image_processor {kwargs}: cannot build {cls.__name__} ({exc})") from None


# ---------------------------------------------------------------------------- rows


class VlmRowTokenizer(RowTokenizer):
    """``datasets.map`` function (batched, Arrow format, ``with_indices``): the text of
    :class:`RowTokenizer` with the row's images processed and their placeholders expanded,
    plus ``pixel_values`` (flat float32) and ``image_grid_thw`` (flat int32) columns."""

    def __init__(self, fmt, cfg, tokenizer, columns, vlm: VlmBuild, source, bpe=None):
        if fmt == "tokenized":
            raise ConfigError("rows with images must be chat or text rows: the image placeholders are expanded "
                              "before tokenizing (already tokenized VLM rows are not supported)")
        super().__init__(fmt, cfg, tokenizer, [c for c in columns if c not in vlm.input_columns()], bpe)
        self.json_rows = columns == [JSON_COLUMN]
        self.vlm = vlm
        self.row_offsets = np.asarray(source.row_offsets)
        self.row_base = int(getattr(source, "row_start", 0))  # a build shard's first row in the whole input
        fam = vlm.family
        self.image_id = fam.image_token_id
        vocab = len(tokenizer)
        strings = {}
        for name, tid in (("image_token_id", fam.image_token_id), ("vision_start_token_id", fam.vision_start_token_id),
                          ("vision_end_token_id", vlm.vision_end_token_id), ("video_token_id", fam.video_token_id)):
            if tid is None and name == "video_token_id":
                continue  # a family without video: a row with a video fails
            if tid is None or not 0 <= tid < vocab:
                raise ConfigError(f"model_config's {name}={tid} is not a token of the tokenizer ({vocab} tokens)")
            strings[name] = tokenizer.convert_ids_to_tokens(int(tid))
        self.image_str = strings["image_token_id"]
        self.start_str = strings["vision_start_token_id"]
        self.end_str = strings["vision_end_token_id"]
        self.video_str = strings.get("video_token_id")
        self._pending = None

    def __call__(self, table, indices):
        self._rows = [self.row_base + int(i) for i in indices]  # rows of the whole input
        return super().__call__(table)

    # ---- values: text with the placeholders expanded; images processed
    def _extract(self, table):
        values, errors = super()._extract(table)
        refs = self._refs(table, errors, self.vlm.images_field)
        video_refs = self._refs(table, errors, self.vlm.videos_field)
        n = table.num_rows
        pixels, grids, videos = [None] * n, [None] * n, [None] * n
        for i in range(n):
            if errors[i] is not None:
                continue
            try:
                row_refs = _ref_list(refs[i], self.vlm.images_field, "image")
                row_videos = _ref_list(video_refs[i], self.vlm.videos_field, "video")
                if not isinstance(values[i], str):
                    values[i], row_refs, row_videos = self._flatten_parts(values[i], row_refs, row_videos)
                for mark, given, kind in ((self.vlm.image_placeholder, row_refs, "image"),
                                          (self.vlm.video_placeholder, row_videos, "video")):
                    found = _count_markers(values[i], mark)
                    if found != len(given):
                        raise ValueError(f"{found} '{mark}' marker(s) but {len(given)} {kind}(s)")
                if row_refs:
                    images = [self._open(r, self._rows[i]) for r in row_refs]
                    out = self.vlm.processor(images=images, return_tensors="np")
                    pv = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
                    grid = np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(-1, 3)
                    if pv.ndim != 2 or pv.shape[1] != self.vlm.pixel_dim or pv.shape[0] != int(grid.prod(1).sum()):
                        raise ValueError(f"image processor gave pixel_values {pv.shape} for grids {grid.tolist()}")
                    values[i] = _substitute(values[i], self.vlm.image_placeholder, self._image_runs(grid))
                    pixels[i], grids[i] = pv, grid
                if row_videos:
                    used = 0 if grids[i] is None else int(grids[i].prod(1).sum())
                    videos[i] = self._videos(row_videos, self._rows[i], used)
                    values[i] = _substitute(values[i], self.vlm.video_placeholder, self._video_runs(videos[i]))
            except (ValueError, InputError) as exc:  # ours: the message says it all
                errors[i] = str(exc)
            except Exception as exc:  # noqa: BLE001 - the processor's: reported as a row error
                errors[i] = _row_error(exc)
        self._pending = (pixels, grids, videos)
        return values, errors

    def _videos(self, refs: list, row: int, used: int) -> "RowVideos":
        """The row's videos decoded, sampled and cut into patches (:mod:`thdpack.offline.video`).
        ``used``: vision patches of the row's images. Under ``overflow: truncate`` a video
        that would take the row over ``vision_budget`` keeps its first temporal patches
        that fit (at least one, or the row fails)."""
        from thdpack.offline.video import frame_timestamps, load_video, video_patches, video_rule

        if self.video_str is None:
            raise ValueError(f"model_config ({self.vlm.family.model_type}) has no video_token_id: it takes no video")
        proc, fam = self.vlm.processor, self.vlm.family
        patch, temporal = int(proc.patch_size), int(getattr(proc, "temporal_patch_size", 1) or 1)
        merge, rule = fam.spatial_merge_size, video_rule(fam.model_type)
        pv, grids, spg, stamps, cut = [], [], [], [], 0
        for ref in refs:
            path, name = self._resolve(ref, row, "video")
            video = load_video(path, name, self.vlm.video_options, temporal, patch * merge, rule)
            if self.vlm.overflow == "truncate" and self.vlm.vision_budget is not None:
                video, k = _fit_budget(video, self.vlm.vision_budget - used, temporal, patch, name)
                cut += k
            p, g = video_patches(video.frames, rule.mean, rule.std, patch, merge, temporal)
            used += int(g.prod())
            pv.append(p)
            grids.append(g)
            spg.append(temporal / video.sampled_fps)
            stamps.append(frame_timestamps(video, temporal))
        return RowVideos(np.concatenate(pv), np.stack(grids), np.asarray(spg, np.float32), stamps, cut)

    def _image_runs(self, grid: np.ndarray) -> list[str]:
        """The text each image marker becomes (images ``grid`` ``[k, 3]``)."""
        m2 = self.vlm.family.spatial_merge_size ** 2
        return [self.start_str + self.image_str * int(n) + self.end_str for n in grid.prod(1) // m2]

    def _video_runs(self, videos: "RowVideos") -> list[str]:
        """The text each video marker becomes: one run (Qwen2-VL, Qwen2.5-VL), or per
        temporal patch its timestamp and a run (Qwen3-VL, Qwen3.5: their processors' text)."""
        m2 = self.vlm.family.spatial_merge_size ** 2
        runs = []
        for (t, h, w), stamps in zip(videos.grids.tolist(), videos.timestamps):
            frame = self.start_str + self.video_str * (h * w // m2) + self.end_str
            if self.vlm.family.VIDEO_FRAMES_ARE_ITEMS:
                runs.append("".join(f"<{stamps[k]:.1f} seconds>" + frame for k in range(t)))
            else:
                runs.append(self.start_str + self.video_str * (t * h * w // m2) + self.end_str)
        return runs

    def _refs(self, table, errors, name: str) -> list:
        """Every row's value of field ``name`` (None where absent)."""
        import json

        n = table.num_rows
        if self.json_rows:
            out = [None] * n
            raw = table.column(JSON_COLUMN).to_pylist()
            for i, line in enumerate(raw):
                if errors[i] is None:
                    out[i] = json.loads(line).get(name)
            return out
        if name not in table.column_names:
            return [None] * n
        return table.column(name).to_pylist()

    def _chat_messages(self, messages: list) -> list:
        return messages  # content parts are flattened in _extract, with the row's images (_flatten_parts)

    def _flatten_parts(self, messages: list, refs: list, video_refs: list) -> tuple[list, list, list]:
        """Messages whose content is a list of parts (the ``transformers`` / TRL layout:
        ``[{"type": "image"}, {"type": "text", "text": "..."}]``) with string content
        instead (:func:`~thdpack.offline.tokenize.flatten_content`): each image / video part
        becomes its placeholder marker. A part may name its image or video (``"image"`` /
        ``"video"``, ``"path"`` or ``"url"``: a local path, or ``{"bytes": ...}``); then every
        part of that kind must, and the row's images / videos field must be empty.
        Returns ``(messages, image refs, video refs)``, each in marker order."""
        kinds = {"image": (self.vlm.image_placeholder, self.vlm.images_field, ("image", "path", "url", "image_url"), [], []),
                 "video": (self.vlm.video_placeholder, self.vlm.videos_field, ("video", "path", "url", "video_url"), [], [])}

        def part_ref(kind):
            mark, _, keys, inline, bare = kinds[kind]

            def take(part) -> str:
                ref = next((part[key] for key in keys if part.get(key) is not None), None)
                if isinstance(ref, dict) and "url" in ref and "bytes" not in ref:  # OpenAI style {"url": ...}
                    ref = ref["url"]
                (bare if ref is None else inline).append(ref)
                return mark
            return take

        out = flatten_content(messages, part_ref("image"), part_ref("video"))
        given = {"image": refs, "video": video_refs}
        for kind, (_, fname, _, inline, bare) in kinds.items():
            if not inline:
                continue
            if bare:
                raise ValueError(f"{len(inline)} {kind} part(s) name their {kind} and {len(bare)} do not; "
                                 "name all or none")
            if given[kind]:
                raise ValueError(f"{kind}s are named both in the {kind} parts ({len(inline)}) and in "
                                 f"'{fname}' ({len(given[kind])}); give them in one place")
            given[kind] = inline
        return out, given["image"], given["video"]

    def _open(self, ref, row: int):
        from PIL import Image

        if isinstance(ref, dict) and ref.get("bytes") is not None:
            return self._load(Image, io.BytesIO(ref["bytes"]), "image bytes")
        p, name = self._resolve(ref, row, "image")
        if not p.is_file():
            raise ValueError(f"image {name!r} not found (looked at {p})")
        return self._load(Image, p, name)

    def _resolve(self, ref, row: int, kind: str) -> tuple[Path, str]:
        """``(path, name as given)`` of an image / video reference: a path, or ``{"path": ...}``,
        relative ones against ``image_dir`` or the row's input file's directory."""
        if isinstance(ref, dict):
            if ref.get("bytes") is not None and kind == "video":
                raise ValueError("a video must be a file path ({'bytes': ...} videos are not supported)")
            ref = ref.get("path")
        if not isinstance(ref, str) or not ref:
            raise ValueError(f"an {kind} must be a path, or {{'bytes': ...}} / {{'path': ...}}, got {ref!r}"
                             if kind == "image" else f"a video must be a path or {{'path': ...}}, got {ref!r}")
        p = Path(ref).expanduser()
        if not p.is_absolute():
            base = self.vlm.image_dir
            if base is None:
                k = int(np.searchsorted(self.row_offsets, row, side="right") - 1)
                base = self.vlm.row_dirs[k]
            p = base / p
        return p, ref

    def _load(self, Image, src, name):
        try:
            with Image.open(src) as im:
                return im.convert("RGB") if getattr(self.vlm.processor, "do_convert_rgb", True) else im.copy()
        except OSError as exc:
            raise ValueError(f"image {name!r} cannot be read ({exc})") from None

    # ---- output: checks, image tokens out of the targets, vision columns
    def _to_table(self, ids, targets, errors):
        import pyarrow as pa

        pixels, grids, videos = self._pending
        self._pending = None
        m2 = self.vlm.family.spatial_merge_size ** 2
        for i in range(len(ids)):
            if errors[i] is not None or ids[i] is None:
                continue
            placeholders = ((self.image_id, self.image_str, grids[i], "images"),
                            (self.vlm.family.video_token_id, self.video_str,
                             None if videos[i] is None else videos[i].grids, "videos"))
            for tid, tstr, grid, kind in placeholders:
                if tid is None:
                    continue
                is_pad = ids[i] == tid
                want = int((grid.prod(1) // m2).sum()) if grid is not None else 0
                if int(is_pad.sum()) != want:
                    errors[i] = (f"{int(is_pad.sum())} {kind[:-1]} tokens ({tstr!r}) after tokenizing but the "
                                 f"{kind} need {want}: the text contains {kind[:-1]} tokens itself, or the tokenizer "
                                 f"does not keep the model's {kind[:-1]} token as one token")
                    break
                if is_pad.any():  # placeholders are inputs, never targets
                    t = targets[i]
                    targets[i] = np.where(is_pad, False, t) if t.dtype == bool else np.where(is_pad, IGNORE_INDEX, t)
        table = super()._to_table(ids, targets, errors)
        ok = {i for i, e in enumerate(errors) if e is None}
        table = _append_lists(table, "pixel_values", _take(pixels, ok), True)
        table = _append_lists(table, "image_grid_thw", _take(grids, ok))
        vids = _take(videos, ok)
        table = _append_lists(table, "pixel_values_videos", _take_video_pixels(vids), True)
        table = _append_lists(table, "video_grid_thw", [v and v.grids for v in vids])
        table = _append_lists(table, "second_per_grid_ts", [v and v.second_per_grid_ts for v in vids], dtype=np.float32)
        cut = np.array([0 if v is None else v.patches_cut for v in vids], np.int32)
        return table.append_column(CUT_COLUMN, pa.array(cut))


def _take(rows: list, ok: set) -> list:
    """The entries of ``rows`` at ``ok`` (None elsewhere); ``rows`` is emptied, so that
    :func:`_append_lists` can free each entry once it is copied."""
    out = [r if i in ok else None for i, r in enumerate(rows)]
    rows.clear()
    return out


def _take_video_pixels(videos: list) -> list:
    """Every row's ``RowVideos.pixels`` (None for a row without videos), taken out of it."""
    out = [v and v.pixels for v in videos]
    for v in videos:
        if v is not None:
            v.pixels = None
    return out


def _append_lists(table, name: str, rows: list, large: bool = False, dtype=None):
    """``table`` with a list column ``name`` of ``rows`` (arrays flattened; None: empty);
    int32 values unless ``dtype`` or ``large`` (float32 pixels). ``rows`` is emptied as each
    entry is copied into the column, so a batch's pixels are held about once, not three times."""
    import pyarrow as pa

    dtype = dtype or (np.float32 if large else np.int32)
    lens = np.array([0 if r is None else np.asarray(r).size for r in rows], np.int64)
    off = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(lens, out=off[1:])
    flat = np.empty(int(off[-1]), dtype)
    for k, r in enumerate(rows):
        if r is not None:
            flat[off[k]:off[k + 1]] = np.asarray(r).reshape(-1)
            rows[k] = None
    values = pa.array(flat)
    arr = (pa.LargeListArray.from_arrays(pa.array(off), values) if large
           else pa.ListArray.from_arrays(pa.array(off.astype(np.int32)), values))
    return table.append_column(name, arr)


@dataclass
class RowVideos:
    """The processed videos of one row."""

    pixels: np.ndarray  # float32 [P, pixel_dim] every video's patches, in order
    grids: np.ndarray  # int64 [k, 3]
    second_per_grid_ts: np.ndarray  # float32 [k] temporal / sampled fps
    timestamps: list  # per video, seconds of each temporal patch
    patches_cut: int = 0  # temporal patches cut off to fit vision_budget (overflow: truncate)


def _fit_budget(video, budget: int, temporal: int, patch: int, name: str):
    """``(video, temporal patches cut)``: ``video`` with its first temporal patches that fit in
    ``budget`` vision patches (all of them when they do)."""
    import dataclasses

    frames = video.frames
    per_grid = (frames.shape[1] // patch) * (frames.shape[2] // patch)  # patches of one temporal patch
    have = -(-frames.shape[0] // temporal)
    keep = min(have, max(budget, 0) // per_grid)
    if keep < 1:
        raise ValueError(f"video {name!r}: one temporal patch of it ({per_grid} vision patches) does not fit in "
                         f"vision_budget ({budget} left for it); use a larger vision_budget or smaller max_pixels")
    n = keep * temporal
    return dataclasses.replace(video, frames=frames[:n], indices=video.indices[:n]), have - keep


def _ref_list(value, field_name: str, kind: str) -> list:
    """A row's images / videos field as a list (missing: empty)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"'{field_name}' must be a list of {kind} paths, got {type(value).__name__}")
    return value


def _count_markers(value, mark: str) -> int:
    """Placeholder markers in a text row or in flattened messages (string or no content)."""
    if isinstance(value, str):
        return value.count(mark)
    return sum(m["content"].count(mark) for m in value if isinstance(m.get("content"), str))


def _substitute(value, mark: str, runs: list[str]):
    """A text row or flattened messages with the k-th ``mark`` replaced by ``runs[k]``."""
    it = iter(runs)

    def sub(text: str) -> str:
        parts = text.split(mark)
        return parts[0] + "".join(next(it) + p for p in parts[1:])

    if isinstance(value, str):
        return sub(value)
    return [dict(m, content=sub(m["content"])) if isinstance(m.get("content"), str) else m for m in value]


# ---------------------------------------------------------------------------- per-row image statistics


@dataclass
class ImageStats:
    row_images: np.ndarray  # int64 [rows] images of each row
    row_patches: np.ndarray  # int64 [rows] vision patches (Σ t·h·w) of each row
    image_offsets: np.ndarray  # int64 [rows + 1] images of row r are grids[image_offsets[r]:image_offsets[r+1]]
    grids: np.ndarray  # int64 [N, 3] every image's grid, row after row


def _cut_patches(table, rows: np.ndarray) -> int:
    """Temporal patches cut off the videos of ``rows`` to fit ``vision_budget`` (0 for
    tables from before the count)."""
    if CUT_COLUMN not in table.column_names:
        return 0
    return int(table.column(CUT_COLUMN).to_numpy()[np.asarray(rows, np.int64)].sum())


def video_stats(table) -> ImageStats:
    """:class:`ImageStats` of the videos (``video_grid_thw``; none in a table without it)."""
    if "video_grid_thw" not in table.column_names:
        z = np.zeros(table.num_rows, np.int64)
        return ImageStats(z, z, np.zeros(table.num_rows + 1, np.int64), np.zeros((0, 3), np.int64))
    return image_stats(table, "video_grid_thw")


def row_vision_patches(table) -> np.ndarray:
    """int64 ``[rows]`` vision patches of every row, images and videos (what ``vision_budget`` counts)."""
    return image_stats(table).row_patches + video_stats(table).row_patches


def image_stats(table, column: str = "image_grid_thw") -> ImageStats:
    """:class:`ImageStats` of a table with a flat ``image_grid_thw`` list column (3 per image)."""
    lens, vals = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for chunk in table.column(column).chunks:
        o = np.asarray(chunk.offsets).astype(np.int64)  # a sliced chunk's offsets index its whole child array
        lens.append(np.diff(o))
        vals.append(chunk.values.to_numpy(zero_copy_only=False)[o[0]: o[-1]].astype(np.int64))
    image_offsets = np.zeros(sum(x.size for x in lens) + 1, np.int64)
    np.cumsum(np.concatenate(lens) // 3, out=image_offsets[1:])
    grids = np.concatenate(vals).reshape(-1, 3)
    patches = grids.prod(axis=1)
    cum = np.zeros(patches.size + 1, np.int64)
    np.cumsum(patches, out=cum[1:])
    return ImageStats(np.diff(image_offsets), cum[image_offsets[1:]] - cum[image_offsets[:-1]], image_offsets, grids)


# ---------------------------------------------------------------------------- writing


class VisionColumns:
    """The vision columns of :func:`thdpack.offline.writer.write_packs` (its ``extra``)."""

    def __init__(self, pixel_dim: int, token_table):
        from thdpack.offline.gather import RowPieces

        self.pixel_dim = pixel_dim
        self.row_patches = row_vision_patches(token_table)
        # (column, reader, large list, values per image / video) in the order of fields()
        self.readers = [(name, RowPieces(token_table, name), large, per)
                        for name, large, per in (("pixel_values", True, 0), ("image_grid_thw", False, 3),
                                                 ("pixel_values_videos", True, 0), ("video_grid_thw", False, 3),
                                                 ("second_per_grid_ts", False, 1))]

    def fields(self):
        import pyarrow as pa

        return [pa.field("pixel_values", pa.large_list(pa.float32())),
                pa.field("image_grid_thw", pa.list_(pa.int32())),
                pa.field("image_counts", pa.list_(pa.int32())),
                pa.field("pixel_values_videos", pa.large_list(pa.float32())),
                pa.field("video_grid_thw", pa.list_(pa.int32())),
                pa.field("video_counts", pa.list_(pa.int32())),
                pa.field("second_per_grid_ts", pa.list_(pa.float32()))]

    def pack_bytes(self, plan, sample_rows: np.ndarray) -> np.ndarray:
        """int64 ``[num_packs]`` bytes of pixel values of every pack (plan order)."""
        if not len(plan):
            return np.zeros(0, np.int64)
        per_piece = self.row_patches[sample_rows[plan.sample_index]] * (4 * self.pixel_dim)
        return np.add.reduceat(per_piece, plan.pack_offsets[:-1])

    def columns(self, rows: np.ndarray, counts: np.ndarray) -> list:
        """The vision arrays of packs whose pieces come from input ``rows`` (pack after
        pack, ``counts`` pieces per pack), in the order of :meth:`fields`."""
        import pyarrow as pa

        rows = np.asarray(rows, dtype=np.int64)
        first = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=first[1:])  # first piece of each pack
        columns = []
        for name, reader, large, per in self.readers:
            lengths = reader.lengths[rows]  # VLM rows are never cut: whole rows
            values = reader.gather(rows, np.zeros(rows.size, np.int64), lengths)
            off = np.zeros(rows.size + 1, np.int64)
            np.cumsum(lengths, out=off[1:])
            if large:
                columns.append(pa.LargeListArray.from_arrays(pa.array(off[first]), pa.array(values)))
            else:
                columns.append(pa.ListArray.from_arrays(pa.array(off[first].astype(np.int32)), pa.array(values)))
            if name.endswith("grid_thw"):  # image_counts / video_counts: images / videos of each piece
                columns.append(pa.ListArray.from_arrays(pa.array(first.astype(np.int32)),
                                                        pa.array((lengths // per).astype(np.int32))))
        return columns


# ---------------------------------------------------------------------------- loading


def add_vision(samples: list[dict], row) -> list[dict]:
    """Give every sample of a packed row (:func:`thdpack.offline.unpack_row`) its
    ``pixel_values`` (float32 tensor ``[P_i, pixel_dim]``) and ``image_grid_thw`` (int64
    tensor ``[k_i, 3]``), and for videos ``pixel_values_videos``, ``video_grid_thw`` and
    ``second_per_grid_ts`` (float32 tensor ``[v_i]``); samples without them get neither."""
    import torch

    counts = _add_kind(samples, row, "image_counts", "image_grid_thw", "pixel_values")
    if "video_counts" in row:  # datasets built before videos have no video columns
        counts = _add_kind(samples, row, "video_counts", "video_grid_thw", "pixel_values_videos")
        spg = np.asarray(row["second_per_grid_ts"], dtype=np.float32).reshape(-1)
        if spg.size != int(counts.sum()):
            raise ValueError(f"packed row: video_counts sum to {int(counts.sum())} but second_per_grid_ts "
                             f"has {spg.size} values")
        first = np.zeros(counts.size + 1, np.int64)
        np.cumsum(counts, out=first[1:])
        for i, s in enumerate(samples):
            if counts[i]:
                s["second_per_grid_ts"] = torch.from_numpy(spg[first[i]: first[i + 1]].copy())
    return samples


def _add_kind(samples: list[dict], row, count_col: str, grid_col: str, pixel_col: str) -> np.ndarray:
    """Give the samples their ``grid_col`` / ``pixel_col`` tensors of one kind (images or
    videos) from a packed row; returns int64 ``[n]`` items of each sample."""
    import torch

    counts = row_list(row[count_col], count_col).astype(np.int64)
    if counts.size != len(samples):
        raise ValueError(f"packed row: {count_col} has {counts.size} entries for {len(samples)} samples")
    if not counts.any():
        return counts
    grids = row_list(row[grid_col], grid_col).astype(np.int64).reshape(-1, 3)
    if grids.shape[0] != int(counts.sum()):
        raise ValueError(f"packed row: {count_col} sum to {int(counts.sum())} but {grid_col} has {grids.shape[0]} items")
    patches = grids.prod(axis=1)
    total = int(patches.sum())
    pv = np.asarray(row[pixel_col])
    if pv.dtype != np.float32 or pv.size % total:
        raise ValueError(f"packed row: {pixel_col} ({pv.dtype}, {pv.size} values) do not hold {total} patches")
    pv = torch.from_numpy(np.array(pv, copy=True).reshape(total, pv.size // total))  # one writable copy per pack
    img = np.zeros(counts.size + 1, np.int64)
    np.cumsum(counts, out=img[1:])
    cum = np.zeros(patches.size + 1, np.int64)
    np.cumsum(patches, out=cum[1:])
    for i, s in enumerate(samples):
        if counts[i]:
            a, b = int(img[i]), int(img[i + 1])
            s[grid_col] = torch.from_numpy(grids[a:b].copy())
            s[pixel_col] = pv[int(cum[a]): int(cum[b])]
    return counts


def all_image_grids(ds) -> np.ndarray:
    """int64 ``[N, 3]`` grids of every image of packed dataset ``ds``, pack after pack."""
    parts = []
    for b in range(len(ds._batches)):
        offsets, values = ds._column(b, "image_grid_thw")
        parts.append(np.asarray(values[offsets[0]: offsets[-1]], dtype=np.int64))
    return (np.concatenate(parts) if parts else np.zeros(0, np.int64)).reshape(-1, 3)
