"""The audio columns of an offline omni build (Qwen2.5-Omni / Qwen3-Omni thinker): written beside the vision
columns of :mod:`thdpack.offline.store.vision_columns`, and read back.

The tokenized rows carry, per row, ``input_features`` (flat float32: each clip's ``[mel, L_k]`` row-major, clip
after clip) and ``audio_frames`` (int32, each clip's ``L_k``). Per pack, :class:`AudioColumns` writes
``input_features`` (the pack's clips, flat), ``audio_frames`` (every clip's frames) and ``audio_counts`` (clips
of each sample), as ``pixel_values`` / ``image_grid_thw`` / ``image_counts`` are; :func:`audio_metadata` the
``"audio"`` entry of ``metadata.json``; :func:`add_audio` hands every sample of a packed row its clips back
(``input_features``: a list of float32 tensors ``[mel, L_k]``, what ``build_thd_batch(..., vlm=family)`` reads).
"""

from __future__ import annotations

import json

import numpy as np

from thdpack.offline.store.schema import row_list
from thdpack.offline.store.vision_columns import VisionColumns, whole_rows_column

AUDIO_COLUMNS = ("input_features", "audio_frames", "audio_counts")
FEATURE_EXTRACTOR_DIR = "feature_extractor"  # the feature extractor saved with the dataset


def row_audio_frames(table) -> tuple[np.ndarray, np.ndarray]:
    """``(frames of each row int64 [rows], clips of each row int64 [rows])`` of the tokenized rows
    (a row without audio: 0, 0)."""
    import pyarrow.compute as pc

    frames = np.zeros(table.num_rows, np.int64)
    clips = np.zeros(table.num_rows, np.int64)
    at = 0
    for chunk in table.column("audio_frames").chunks:
        n = len(chunk)
        clips[at: at + n] = pc.fill_null(pc.list_value_length(chunk), 0).to_numpy(zero_copy_only=False)
        values = pc.list_flatten(chunk).to_numpy(zero_copy_only=False).astype(np.int64)
        if values.size:
            parents = pc.list_parent_indices(chunk).to_numpy(zero_copy_only=False)
            np.add.at(frames, parents.astype(np.int64) + at, values)
        at += n
    return frames, clips


class AudioColumns(VisionColumns):
    """:class:`VisionColumns` and the audio columns (:data:`AUDIO_COLUMNS`) of every pack."""

    def __init__(self, pixel_dim: int, token_table, mel: int):
        from thdpack.offline.store.gather import RowPieces

        super().__init__(pixel_dim, token_table)
        self.mel = mel
        table = token_table.data.table if hasattr(token_table, "data") else token_table
        self.audio_readers = [("input_features", RowPieces(table, "input_features"), True),
                              ("audio_frames", RowPieces(table, "audio_frames"), False)]

    def __reduce__(self):
        return AudioColumns, (self.pixel_dim, self._rows, self.mel)

    def fields(self):
        import pyarrow as pa

        return super().fields() + [pa.field("input_features", pa.large_list(pa.float32())),
                                   pa.field("audio_frames", pa.list_(pa.int32())),
                                   pa.field("audio_counts", pa.list_(pa.int32()))]

    def pack_bytes(self, plan, sample_rows: np.ndarray) -> np.ndarray:
        out = super().pack_bytes(plan, sample_rows)
        if not len(plan):
            return out
        per_piece = self.audio_readers[0][1].lengths[sample_rows[plan.sample_index]].astype(np.int64) * 4
        return out + np.add.reduceat(per_piece, plan.pack_offsets[:-1])

    def columns(self, rows: np.ndarray, counts: np.ndarray) -> list:
        import pyarrow as pa

        columns = super().columns(rows, counts)
        rows = np.asarray(rows, dtype=np.int64)
        first = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=first[1:])
        for _, reader, large in self.audio_readers:
            columns.append(whole_rows_column(reader, rows, first, large)[0])
        columns.append(pa.ListArray.from_arrays(pa.array(first.astype(np.int32)),
                                                pa.array(self.audio_readers[1][1].lengths[rows].astype(np.int32))))
        return columns


def audio_metadata(audio, token_table, piece_rows: np.ndarray) -> dict:
    """The ``"audio"`` entry of ``metadata.json`` (``audio``: the build's
    :class:`thdpack.offline.vision.omni_audio.AudioBuild`)."""
    frames, clips = row_audio_frames(token_table)
    rows = np.asarray(piece_rows, np.int64)
    budget = {} if audio.budget is None else {"audio_budget": int(audio.budget)}  # only when set
    return {
        "audio_token_id": audio.audio_token_id,
        "audio_start_token_id": audio.audio_start_token_id,
        "audio_end_token_id": audio.audio_end_token_id,
        "audio_placeholder": audio.placeholder,
        "audios_field": audio.field,
        "clips": int(clips[rows].sum()),
        "audio_frames": int(frames[rows].sum()),
        "num_mel_bins": audio.mel,
        "sampling_rate": int(audio.fe.sampling_rate),
        "max_audio_seconds": audio.limit_seconds,
        "feature_dtype": "float32",
        "feature_extractor": json.loads(audio.fe.to_json_string()),
        "saved_feature_extractor": FEATURE_EXTRACTOR_DIR,
        **budget,
    }


def add_audio(samples: list[dict], row, *, copy: bool = True) -> list[dict]:
    """Give every sample of a packed row its clips: ``input_features``, a list of float32 tensors
    ``[mel, L_k]`` (slices of one writable copy of the pack's, or with ``copy=False`` views of the
    row's, never to be written); samples without audio get none."""
    import warnings

    import torch

    counts = row_list(row["audio_counts"], "audio_counts").astype(np.int64)
    if counts.size != len(samples):
        raise ValueError(f"packed row: audio_counts has {counts.size} entries for {len(samples)} samples")
    if not counts.any():
        return samples
    frames = row_list(row["audio_frames"], "audio_frames").astype(np.int64)
    if frames.size != int(counts.sum()):
        raise ValueError(f"packed row: audio_counts sum to {int(counts.sum())} but audio_frames has {frames.size}")
    flat = np.asarray(row["input_features"])
    total = int(frames.sum())
    if flat.dtype != np.float32 or not total or flat.size % total:
        raise ValueError(f"packed row: input_features ({flat.dtype}, {flat.size} values) do not hold {total} frames")
    mel = flat.size // total
    if copy:
        feats = torch.from_numpy(np.array(flat, copy=True))
    else:  # a view of a read-only memory-mapped row: torch would warn; the collator only concatenates
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            feats = torch.from_numpy(flat)
    ends = np.cumsum(frames * mel)
    clips = [feats[int(e - f * mel): int(e)].view(mel, int(f)) for f, e in zip(frames.tolist(), ends.tolist())]
    first = np.zeros(counts.size + 1, np.int64)
    np.cumsum(counts, out=first[1:])
    for i, s in enumerate(samples):
        if counts[i]:
            s["input_features"] = clips[int(first[i]): int(first[i + 1])]
    return samples
