"""What an offline VLM build writes besides the text: the vision columns of every pack and
the vision part of ``metadata.json``, with the per-row image / video statistics they read.

The tokenized rows (:mod:`thdpack.offline.vision.vlm_rows`) carry, per row, ``pixel_values``
(flat float32), ``image_grid_thw`` (flat int32, 3 per image), the video columns and
:data:`CUT_COLUMN`. From them:

- :func:`image_stats` / :func:`video_stats` / :func:`row_vision_patches`: images, vision
  patches and grids of every row (what planning and the metadata count);
- :class:`VisionColumns`: the ``extra`` of :func:`thdpack.offline.store.writer.write_packs`,
  gathering the rows' vision values into the pack columns of :data:`VISION_COLUMNS`;
- :func:`vision_metadata`: the ``"vision"`` entry of ``metadata.json``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import numpy as np

VIDEO_COLUMNS = ("pixel_values_videos", "video_grid_thw", "video_counts", "second_per_grid_ts")
VISION_COLUMNS = ("pixel_values", "image_grid_thw", "image_counts") + VIDEO_COLUMNS
CUT_COLUMN = "video_patches_cut"  # tokenized rows: temporal patches cut off the row's videos (overflow: truncate)
PROCESSOR_DIR = "image_processor"  # the image processor saved with the dataset


# ---------------------------------------------------------------------------- per-row statistics


@dataclass
class ImageStats:
    row_images: np.ndarray  # int64 [rows] images of each row
    row_patches: np.ndarray  # int64 [rows] vision patches (Σ t·h·w) of each row
    image_offsets: np.ndarray  # int64 [rows + 1] images of row r are grids[image_offsets[r]:image_offsets[r+1]]
    grids: np.ndarray  # int64 [N, 3] every image's grid, row after row


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


def video_stats(table) -> ImageStats:
    """:class:`ImageStats` of the videos (``video_grid_thw``; none in a table without it)."""
    if "video_grid_thw" not in table.column_names:
        z = np.zeros(table.num_rows, np.int64)
        return ImageStats(z, z, np.zeros(table.num_rows + 1, np.int64), np.zeros((0, 3), np.int64))
    return image_stats(table, "video_grid_thw")


def row_vision_patches(table) -> np.ndarray:
    """int64 ``[rows]`` vision patches of every row, images and videos (what ``vision_budget`` counts)."""
    return image_stats(table).row_patches + video_stats(table).row_patches


def row_grids(table, rows: np.ndarray) -> np.ndarray:
    """int64 ``[N, 3]`` grids of the images of ``rows`` (in order)."""
    stats = image_stats(table)
    parts = [stats.grids[stats.image_offsets[r]: stats.image_offsets[r + 1]] for r in np.asarray(rows).tolist()]
    return np.concatenate(parts) if parts else np.zeros((0, 3), np.int64)


def cut_patches(table, rows: np.ndarray) -> int:
    """Temporal patches cut off the videos of ``rows`` to fit ``vision_budget`` (0 for
    tables from before the count)."""
    if CUT_COLUMN not in table.column_names:
        return 0
    return int(table.column(CUT_COLUMN).to_numpy()[np.asarray(rows, np.int64)].sum())


# ---------------------------------------------------------------------------- pack columns


class VisionColumns:
    """The vision columns of :func:`thdpack.offline.store.writer.write_packs` (its ``extra``)."""

    def __init__(self, pixel_dim: int, token_table):
        """``token_table``: the tokenized rows, a ``pyarrow.Table`` or a file-backed ``datasets.Dataset``
        (which pickles as its file paths: an ``engine: ray`` writing task rebuilds the readers from it)."""
        from thdpack.offline.store.gather import RowPieces

        self._rows = token_table
        token_table = token_table.data.table if hasattr(token_table, "data") else token_table
        self.pixel_dim = pixel_dim
        self.row_patches = row_vision_patches(token_table)
        # (column, reader, large list, values per image / video) in the order of fields()
        self.readers = [(name, RowPieces(token_table, name), large, per)
                        for name, large, per in (("pixel_values", True, 0), ("image_grid_thw", False, 3),
                                                 ("pixel_values_videos", True, 0), ("video_grid_thw", False, 3),
                                                 ("second_per_grid_ts", False, 1))]

    def __reduce__(self):
        return VisionColumns, (self.pixel_dim, self._rows)

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
            column, lengths = whole_rows_column(reader, rows, first, large)
            columns.append(column)
            if name.endswith("grid_thw"):  # image_counts / video_counts: images / videos of each piece
                columns.append(pa.ListArray.from_arrays(pa.array(first.astype(np.int32)),
                                                        pa.array((lengths // per).astype(np.int32))))
        return columns


# ---------------------------------------------------------------------------- metadata


def vision_metadata(vlm, token_table, piece_rows: np.ndarray, plan) -> dict:
    """The ``"vision"`` entry of ``metadata.json`` of a build (``vlm``: its
    :class:`thdpack.offline.vision.vlm_setup.VlmBuild`) whose pieces come from the tokenized rows
    ``piece_rows`` (int64 ``[pieces]``, plan order)."""
    family = vlm.family
    rows = np.asarray(piece_rows)
    per_piece = row_vision_patches(token_table)[rows]
    per_pack = np.add.reduceat(per_piece, plan.pack_offsets[:-1]) if len(plan) else np.zeros(0, np.int64)
    return {
        "model_type": family.model_type,
        "image_token_id": family.image_token_id,
        "vision_start_token_id": family.vision_start_token_id,
        "vision_end_token_id": vlm.vision_end_token_id,
        "spatial_merge_size": family.spatial_merge_size,
        "images": int(image_stats(token_table).row_images[rows].sum()),
        "videos": int(video_stats(token_table).row_images[rows].sum()),
        "video_patches_cut": cut_patches(token_table, rows),
        "video_token_id": family.video_token_id,
        "video_placeholder": vlm.video_placeholder,
        "video": dataclasses.asdict(vlm.video_options),
        "vision_patches": int(per_piece.sum()),
        "max_pack_vision_patches": int(per_pack.max()) if per_pack.size else 0,
        "vision_budget": vlm.vision_budget,
        "pixel_dim": vlm.pixel_dim,
        "pixel_dtype": "float32",
        "image_placeholder": vlm.image_placeholder,
        "image_processor": json.loads(vlm.processor.to_json_string()),
        "saved_processor": PROCESSOR_DIR,
    }


def whole_rows_column(reader, rows: np.ndarray, first: np.ndarray, large: bool):
    """``(column, lengths)``: the pack column of a row-list ``reader`` for input ``rows`` taken whole (rows with
    vision or audio are never cut), one list per pack (``first``: int64 ``[packs + 1]`` each pack's first piece),
    a ``LargeListArray`` where ``large``; and int64 ``[rows]`` each row's values."""
    import pyarrow as pa

    lengths = reader.lengths[rows]
    values = reader.gather(rows, np.zeros(rows.size, np.int64), lengths)
    off = np.zeros(rows.size + 1, np.int64)
    np.cumsum(lengths, out=off[1:])
    if large:
        return pa.LargeListArray.from_arrays(pa.array(off[first]), pa.array(values)), lengths
    return pa.ListArray.from_arrays(pa.array(off[first].astype(np.int32)), pa.array(values)), lengths
