"""The VLM row tokenizer: :class:`~thdpack.offline.tokenizing.row_tokenizer.RowTokenizer` for rows with
images and videos (the build set up by :mod:`thdpack.offline.vision.vlm_setup`).

Per map batch, three steps, each handing its result to the next as a value:

1. ``_extract`` (the text tokenizer's) gives the rows' values, then ``_media`` runs the
   media stage per row (:mod:`thdpack.offline.vision.media`): the row's images / videos processed
   and each ``<image>`` / ``<video>`` marker (or content part) expanded into the model's
   vision tokens. It returns the batch's vision inputs (:class:`BatchVision`), which the
   text tokenizer hands on to ``_to_table`` as a value;
2. tokenizing, as for text rows;
3. ``_to_table``: each row's vision tokens counted against its grids (a tokenizer that
   splits them fails the row) and taken out of the targets, then the vision columns
   (``pixel_values`` flat float32, ``image_grid_thw`` flat int32, the video columns
   and :data:`~thdpack.offline.store.vision_columns.CUT_COLUMN`) appended.

The rows' numbers in the whole input (for relative paths: the directory of each row's
input file) travel in the batch table as :data:`ROW_COLUMN`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from thdpack.offline.tokenizing.chat_content import flatten_content
from thdpack.offline.errors import ConfigError, InputError
from thdpack.offline.vision.media import RowVideos, row_images, row_videos
from thdpack.offline.tokenizing.row_formats import row_format
from thdpack.offline.tokenizing.row_tokenizer import RowTokenizer, row_error
from thdpack.offline.inputs.sources import JSON_COLUMN
from thdpack.offline.store.vision_columns import CUT_COLUMN
from thdpack.common.align import check_int
from thdpack.common.samples import IGNORE_INDEX

VISION_MAP_BATCH_SIZE = 16  # benchmarks/video.py: 300 videos peak 1169 MB at 64 rows a batch, 1044 MB at 16
ROW_COLUMN = "__thdpack_row__"  # map batches: each row's number in the whole input


def row_features() -> dict:
    """The ``datasets`` features of the vision columns of the tokenized rows."""
    import datasets

    return {
        "pixel_values": datasets.LargeList(datasets.Value("float32")),
        "image_grid_thw": datasets.List(datasets.Value("int32")),
        "pixel_values_videos": datasets.LargeList(datasets.Value("float32")),
        "video_grid_thw": datasets.List(datasets.Value("int32")),
        "second_per_grid_ts": datasets.List(datasets.Value("float32")),
        CUT_COLUMN: datasets.Value("int32"),
    }


@dataclass
class BatchVision:
    """The vision inputs of the rows of one map batch (None: a row without them, or failed)."""

    pixels: list  # per row: float32 [P, pixel_dim]
    grids: list  # per row: int64 [k, 3]
    videos: list  # per row: RowVideos

    @classmethod
    def empty(cls, n: int) -> "BatchVision":
        return cls([None] * n, [None] * n, [None] * n)


class VlmRowTokenizer(RowTokenizer):
    """``datasets.map`` function (batched, Arrow format, ``with_indices``): the text of
    :class:`RowTokenizer` with the row's images processed and their placeholders expanded,
    plus ``pixel_values`` (flat float32) and ``image_grid_thw`` (flat int32) columns."""

    def __init__(self, fmt, opts, tokenizer, columns, vlm, source, bpe=None):
        refused = row_format(fmt).images_refused  # tokenized rows: the placeholders are expanded in the text
        if refused:
            raise ConfigError(refused)
        super().__init__(fmt, opts, tokenizer, [c for c in columns if c not in vlm.input_columns()], bpe)
        self.json_rows = columns == [JSON_COLUMN]
        self.vlm = vlm  # thdpack.offline.vision.vlm_setup.VlmBuild
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
            check_int(tid, f"model_config's {name}", 0, below=vocab, hint=" (a token id of the tokenizer)",
                      error=ConfigError)
            strings[name] = tokenizer.convert_ids_to_tokens(int(tid))
        self.image_str = strings["image_token_id"]
        self.start_str = strings["vision_start_token_id"]
        self.end_str = strings["vision_end_token_id"]
        self.video_str = strings.get("video_token_id")

    def __call__(self, table, indices):
        import pyarrow as pa

        rows = self.row_base + np.asarray(indices, dtype=np.int64)  # rows of the whole input
        return super().__call__(table.append_column(ROW_COLUMN, pa.array(rows)))

    # ---- 1. media: the text values' placeholders expanded; images and videos processed
    def _media(self, table, values: list, errors: list) -> "BatchVision":
        refs = self._refs(table, errors, self.vlm.images_field)
        video_refs = self._refs(table, errors, self.vlm.videos_field)
        rows = table.column(ROW_COLUMN).to_numpy()
        vision = BatchVision.empty(table.num_rows)
        for i in range(table.num_rows):
            if errors[i] is not None:
                continue
            try:
                values[i], vision.pixels[i], vision.grids[i], vision.videos[i] = self._row_media(
                    values[i], refs[i], video_refs[i], int(rows[i]))
            except (ValueError, InputError) as exc:  # ours: the message says it all
                errors[i] = str(exc)
            except Exception as exc:  # noqa: BLE001 - the processor's: reported as a row error
                errors[i] = row_error(exc)
        return vision

    def _row_media(self, value, refs, video_refs, row: int):
        """``(value with its markers expanded, pixels, grid, videos)`` of one row (the
        last three None when the row has no images / videos)."""
        vlm = self.vlm
        refs = _ref_list(refs, vlm.images_field, "image")
        video_refs = _ref_list(video_refs, vlm.videos_field, "video")
        if not isinstance(value, str):
            value, refs, video_refs = self._flatten_parts(value, refs, video_refs)
        for mark, given, kind in ((vlm.image_placeholder, refs, "image"), (vlm.video_placeholder, video_refs, "video")):
            found = _count_markers(value, mark)
            if found != len(given):
                raise ValueError(f"{found} '{mark}' marker(s) but {len(given)} {kind}(s)")
        base = self._base_dir(row)
        pixels = grid = videos = None
        if refs:
            pixels, grid = row_images(refs, base, vlm.processor, vlm.pixel_dim)
            value = _substitute(value, vlm.image_placeholder, self._image_runs(grid))
        if video_refs:
            if self.video_str is None:
                raise ValueError(f"model_config ({vlm.family.model_type}) has no video_token_id: it takes no video")
            videos = row_videos(video_refs, base, vlm, 0 if grid is None else int(grid.prod(1).sum()))
            value = _substitute(value, vlm.video_placeholder, self._video_runs(videos))
        return value, pixels, grid, videos

    def _base_dir(self, row: int):
        """The directory relative image / video paths of input ``row`` start from."""
        if self.vlm.image_dir is not None:
            return self.vlm.image_dir
        return self.vlm.row_dirs[int(np.searchsorted(self.row_offsets, row, side="right") - 1)]

    def _image_runs(self, grid: np.ndarray) -> list[str]:
        """The text each image marker becomes (images ``grid`` ``[k, 3]``)."""
        m2 = self.vlm.family.spatial_merge_size ** 2
        return [self.start_str + self.image_str * int(n) + self.end_str for n in grid.prod(1) // m2]

    def _video_runs(self, videos: RowVideos) -> list[str]:
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
        return messages  # content parts are flattened with the row's media (_row_media, _flatten_parts)

    def _flatten_parts(self, messages: list, refs: list, video_refs: list) -> tuple[list, list, list]:
        """Messages whose content is a list of parts (the ``transformers`` / TRL layout:
        ``[{"type": "image"}, {"type": "text", "text": "..."}]``) with string content
        instead (:func:`~thdpack.offline.tokenizing.chat_content.flatten_content`): each image / video part
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

    # ---- 3. output: checks, vision tokens out of the targets, vision columns
    def _to_table(self, ids, targets, errors, vision: "BatchVision"):
        for i in range(len(ids)):
            if errors[i] is None and ids[i] is not None:
                targets[i], errors[i] = self._vision_targets(ids[i], targets[i], vision.grids[i], vision.videos[i])
        table = super()._to_table(ids, targets, errors, vision)
        return _with_vision_columns(table, vision, {i for i, e in enumerate(errors) if e is None})

    def _vision_targets(self, ids: np.ndarray, targets: np.ndarray, grid, videos) -> tuple[np.ndarray, str | None]:
        """``(targets, error)`` of one row: its image / video tokens taken out of the
        targets (placeholders are inputs, never targets), or an error when their count
        is not the grids' (``grid`` int64 ``[k, 3]`` or None; ``videos`` or None)."""
        m2 = self.vlm.family.spatial_merge_size ** 2
        for tid, tstr, g, kind in ((self.image_id, self.image_str, grid, "images"),
                                   (self.vlm.family.video_token_id, self.video_str,
                                    None if videos is None else videos.grids, "videos")):
            if tid is None:
                continue
            is_pad = ids == tid
            want = int((g.prod(1) // m2).sum()) if g is not None else 0
            if int(is_pad.sum()) != want:
                return targets, (f"{int(is_pad.sum())} {kind[:-1]} tokens ({tstr!r}) after tokenizing but the "
                                 f"{kind} need {want}: the text contains {kind[:-1]} tokens itself, or the tokenizer "
                                 f"does not keep the model's {kind[:-1]} token as one token")
            if is_pad.any():
                targets = (np.where(is_pad, False, targets) if targets.dtype == bool
                           else np.where(is_pad, IGNORE_INDEX, targets))
        return targets, None


# ---------------------------------------------------------------------------- the vision columns of a batch


def _with_vision_columns(table, vision: BatchVision, ok: set):
    """``table`` with the vision columns of the ``ok`` rows (empty for the others)."""
    import pyarrow as pa

    table = _append_lists(table, "pixel_values", _take(vision.pixels, ok), True)
    table = _append_lists(table, "image_grid_thw", _take(vision.grids, ok))
    vids = _take(vision.videos, ok)
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
