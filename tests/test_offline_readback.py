"""Reading VLM packs back: the collator copies a pack's pixels once, into the batch's own tensors.

A packed row's arrays are read-only views of the memory-mapped data file. The
collator hands the samples views of them and lets the pack's concatenation make the
one copy (not a copy per pack and then another one per batch); the batch must still
own writable pixels that equal those of :func:`unpack_row` + ``build_thd_batch``,
including the pack whose pixels are one sample's (nothing to concatenate).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from test_vlm import mixed_samples, tiny_config  # noqa: E402

from thdpack import build_thd_batch  # noqa: E402
from thdpack.offline import PackedRowCollator, unpack_row  # noqa: E402
from thdpack.vlm import get_family  # noqa: E402

FAMILY = "qwen2_5_vl"  # images, videos and second_per_grid_ts


def _flat(samples, field: str, dtype, width: int = 1) -> np.ndarray:
    parts = [np.asarray(s[field], dtype).reshape(-1) for s in samples if field in s]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def packed_row(samples) -> dict:
    """The row a memory-mapped data file gives for a pack of ``samples``: flat, read-only arrays."""
    lens = [len(s["input_ids"]) for s in samples]
    row = {
        "input_ids": _flat(samples, "input_ids", np.int32),
        "labels": _flat(samples, "labels", np.int32),
        "seq_lens": np.asarray(lens, np.int32),
        "sample_index": np.arange(len(samples), dtype=np.int64),
        "sample_start": np.zeros(len(samples), np.int32),
        "pixel_values": _flat(samples, "pixel_values", np.float32),
        "image_grid_thw": _flat(samples, "image_grid_thw", np.int32),
        "image_counts": np.asarray([len(s.get("image_grid_thw", [])) for s in samples], np.int32),
        "pixel_values_videos": _flat(samples, "pixel_values_videos", np.float32),
        "video_grid_thw": _flat(samples, "video_grid_thw", np.int32),
        "video_counts": np.asarray([len(s.get("video_grid_thw", [])) for s in samples], np.int32),
        "second_per_grid_ts": _flat(samples, "second_per_grid_ts", np.float32),
    }
    for v in row.values():
        v.setflags(write=False)
    return row


PACKS = {"several samples with pixels": [0, 1, 2, 3, 4, 5], "one sample with images": [2, 0, 2],
         "one sample with a video": [3], "images of one sample, videos of another": [0, 3]}


@pytest.mark.parametrize("pack", sorted(PACKS))
def test_collated_pixels_are_the_batch_own(pack):
    samples = [mixed_samples(FAMILY)[i] for i in PACKS[pack]]
    row = packed_row(samples)
    cfg = tiny_config(FAMILY)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning about tensors over read-only memory
        batch = PackedRowCollator(model_config=cfg)(row)
    expected = build_thd_batch(unpack_row(row), vlm=get_family(cfg))
    for name in ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "second_per_grid_ts"):
        got, want = batch.extras[name], expected.extras[name]
        assert (got is None) == (want is None), name
        if got is None:
            continue
        assert torch.equal(got, want), name
        if name.startswith("pixel"):
            assert got.is_contiguous() and not np.shares_memory(got.numpy(), row[name]), name
            got.add_(1.0)  # the batch's own memory: writing leaves the row as it was
            assert np.array_equal(row[name], want.numpy().reshape(-1)), name
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens"):
        assert torch.equal(getattr(batch, name), getattr(expected, name)), name
    assert torch.equal(batch.token_extras["mrope_position_ids"], expected.token_extras["mrope_position_ids"])


def test_unpack_row_pixels_are_writable_copies():
    row = packed_row(mixed_samples(FAMILY)[:2])
    samples = unpack_row(row)
    pixels = samples[1]["pixel_values"]
    assert not np.shares_memory(pixels.numpy(), row["pixel_values"])
    pixels.zero_()
    assert row["pixel_values"].any()
