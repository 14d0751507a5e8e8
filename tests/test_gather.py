"""RowPieces copies row pieces out of a chunked, sliced Arrow table exactly as pyarrow reads them."""

from __future__ import annotations

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from thdpack.offline.store.gather import RowPieces  # noqa: E402


@st.composite
def tables(draw):
    """A table of list<int32> ids and list<bool> mask rows split into chunks, some of them
    slices of larger arrays (non-zero offsets, bit offsets that are not byte aligned)."""
    rows = draw(st.lists(st.integers(0, 40), min_size=1, max_size=30))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    ids = [rng.integers(-5, 2**31 - 1, n).astype(np.int32) for n in rows]
    mask = [rng.random(n) < 0.5 for n in rows]
    cuts = sorted(set(draw(st.lists(st.integers(1, len(rows)), max_size=5))) | {len(rows)})
    id_chunks, mask_chunks, a = [], [], 0
    for b in cuts:
        pad = draw(st.integers(0, 3))  # slice the chunk out of a bigger array: offsets into a shifted child
        extra_ids = [np.arange(pad + 1, dtype=np.int32)] * pad
        extra_mask = [np.ones(pad + 1, bool)] * pad
        big_ids = pa.array([x.tolist() for x in extra_ids + ids[a:b]], pa.list_(pa.int32()))
        big_mask = pa.array([x.tolist() for x in extra_mask + mask[a:b]], pa.list_(pa.bool_()))
        if draw(st.booleans()):  # a list slice: its offsets index a child with rows in front
            id_chunks.append(big_ids.slice(pad))
            mask_chunks.append(big_mask.slice(pad))
        else:  # a sliced child: values start ``pad`` elements (bits) into their buffer
            lens = np.array([0] + [len(x) for x in ids[a:b]])
            offs = pa.array(np.cumsum(lens).astype(np.int32))
            flat_ids = np.concatenate([np.full(pad, 7, np.int32)] + ids[a:b])
            flat_mask = np.concatenate([np.ones(pad, bool)] + mask[a:b])
            id_chunks.append(pa.ListArray.from_arrays(offs, pa.array(flat_ids).slice(pad)))
            mask_chunks.append(pa.ListArray.from_arrays(offs, pa.array(flat_mask).slice(pad)))
        a = b
    pixel_chunks = [  # large_list<float32>, as VLM pixel rows are stored
        pa.LargeListArray.from_arrays(pa.array(np.asarray(c.offsets).astype(np.int64)), c.values.cast(pa.float32(), safe=False))
        for c in id_chunks]
    table = pa.table({"input_ids": pa.chunked_array(id_chunks), "loss_mask": pa.chunked_array(mask_chunks),
                      "pixels": pa.chunked_array(pixel_chunks)})
    n_pieces = draw(st.integers(0, 20))
    picks = []
    for _ in range(n_pieces):
        r = draw(st.integers(0, len(rows) - 1))
        start = draw(st.integers(0, rows[r]))
        picks.append((r, start, draw(st.integers(0, rows[r] - start))))
    return table, ids, mask, picks


@settings(max_examples=200, deadline=None)
@given(case=tables())
def test_pieces_equal_pyarrow_slices(case):
    table, ids, mask, picks = case
    rows = np.array([p[0] for p in picks], np.int64)
    starts = np.array([p[1] for p in picks], np.int64)
    lengths = np.array([p[2] for p in picks], np.int64)
    got_ids = RowPieces(table, "input_ids").gather(rows, starts, lengths)
    got_mask = RowPieces(table, "loss_mask").gather(rows, starts, lengths)
    want_ids = np.concatenate([np.zeros(0, np.int32)] + [ids[r][s:s + n] for r, s, n in picks])
    want_mask = np.concatenate([np.zeros(0, bool)] + [mask[r][s:s + n] for r, s, n in picks])
    got_pixels = RowPieces(table, "pixels").gather(rows, starts, lengths)
    assert got_ids.dtype == np.int32 and got_mask.dtype == np.bool_ and got_pixels.dtype == np.float32
    np.testing.assert_array_equal(got_pixels, want_ids.astype(np.float32))
    whole = RowPieces(table, "pixels")
    np.testing.assert_array_equal(whole.lengths, [len(x) for x in ids])
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_array_equal(got_mask, want_mask)
    # and pyarrow's own reading of the same rows agrees with the reference
    for r, s, n in picks[:3]:
        assert table.column("input_ids")[r].as_py()[s:s + n] == ids[r][s:s + n].tolist()


def test_other_column_types_are_refused():
    table = pa.table({"x": pa.array([[1, 2]], pa.list_(pa.int64()))})
    with pytest.raises(TypeError, match="a list of int32, float32 or bool expected"):
        RowPieces(table, "x")
