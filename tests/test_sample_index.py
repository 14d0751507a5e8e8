"""``ThdBatch.sample_index`` traces every sample of a pack back to where it came from: the dataset
row behind ``TokenBudgetBatchSampler`` (through ``IndexedDataset``), the stream position behind
``StreamingPacker``, and the position in the call for a plain list (issue 20 point 6)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from thdpack import IndexedDataset, SampleError, StreamingPacker, ThdCollator, TokenBudgetBatchSampler
from thdpack.loaders.collate import SAMPLE_INDEX_FIELD


def rows(n: int = 40, seed: int = 0) -> list[dict]:
    """Rows whose tokens are globally unique, so a packed sample tells which row it is."""
    lengths = np.random.default_rng(seed).integers(1, 30, n)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return [{"input_ids": np.arange(a, a + n, dtype=np.int64)} for a, n in zip(starts.tolist(), lengths.tolist())]


def samples_of(batch) -> list[np.ndarray]:
    """The real tokens of every sample of ``batch``, in pack order."""
    cu, lens = batch.cu_seqlens_padded.tolist(), batch.seq_lens.tolist()
    return [batch.input_ids[a : a + n].numpy() for a, n in zip(cu, lens)]


def assert_traced(batch, source: list[dict]) -> None:
    """Sample j of ``batch`` is (a piece of) ``source[batch.sample_index[j]]``."""
    assert batch.sample_index.dtype == torch.int64 and batch.sample_index.numel() == batch.num_samples
    for tokens, i in zip(samples_of(batch), batch.sample_index.tolist()):
        whole = source[i]["input_ids"]
        start = int(tokens[0] - whole[0])
        np.testing.assert_array_equal(tokens, whole[start : start + tokens.size])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sampler_batches_name_their_dataset_rows(num_workers):
    dataset = rows()
    lengths = [len(r["input_ids"]) for r in dataset]
    sampler = TokenBudgetBatchSampler(lengths, 64, num_replicas=1, rank=0, seed=3)
    expected = list(sampler)
    sampler.set_epoch(0)
    loader = DataLoader(IndexedDataset(dataset), batch_sampler=sampler, collate_fn=ThdCollator(),
                        num_workers=num_workers)
    batches = list(loader)
    assert [b.sample_index.tolist() for b in batches] == expected
    for batch in batches:
        assert_traced(batch, dataset)
    assert any(b.sample_index.tolist() != list(range(b.num_samples)) for b in batches)  # not positions


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stream_batches_name_their_stream_positions(num_workers):
    stream = rows(60, seed=1)
    packer = StreamingPacker(stream, 16, buffer_size=3, overflow="split", num_replicas=1, rank=0)
    batches = list(DataLoader(packer, batch_size=None, collate_fn=ThdCollator(), num_workers=num_workers))
    seen = []
    for batch in batches:
        assert_traced(batch, stream)
        seen.extend(batch.sample_index.tolist())
    assert sorted(set(seen)) == list(range(len(stream)))  # every stream position, in every worker's share


def test_stream_marks_each_piece_with_its_sample_and_keeps_a_given_index():
    stream = [{"input_ids": np.arange(10)}, {"input_ids": np.arange(3), SAMPLE_INDEX_FIELD: 7}]
    packs = list(StreamingPacker(stream, 4, overflow="split", num_replicas=1, rank=0))
    assert sorted(s[SAMPLE_INDEX_FIELD] for pack in packs for s in pack) == [0, 0, 0, 7]
    assert SAMPLE_INDEX_FIELD not in stream[0]  # the input samples are not changed


def test_planning_collator_maps_packs_to_source_rows():
    dataset = rows(30, seed=2)
    call = [IndexedDataset(dataset)[i] for i in (29, 3, 17, 8, 0, 21)]
    batches = ThdCollator(pack_size=40)(call)
    names = sorted(i for b in batches for i in b.sample_index.tolist())
    assert names == [0, 3, 8, 17, 21, 29]
    for batch in batches:
        assert_traced(batch, dataset)


def test_plain_list_gives_positions_in_the_call():
    samples = rows(6, seed=3)
    batch = ThdCollator()(samples)
    assert batch.sample_index.tolist() == [0, 1, 2, 3, 4, 5]
    packs = ThdCollator(pack_size=40)(samples)
    assert sorted(i for b in packs for i in b.sample_index.tolist()) == [0, 1, 2, 3, 4, 5]
    for b in packs:
        assert_traced(b, samples)


def test_indexed_dataset_reads_batches_in_one_call_and_keeps_the_rows():
    class Rows(list):
        calls = 0

        def __getitems__(self, indices):
            Rows.calls += 1
            return [self[i] for i in indices]

    data = Rows(rows(5))
    got = IndexedDataset(data).__getitems__([4, 1])
    assert Rows.calls == 1 and [s[SAMPLE_INDEX_FIELD] for s in got] == [4, 1]
    assert got[0]["input_ids"] is data[4]["input_ids"] and SAMPLE_INDEX_FIELD not in data[4]
    assert len(IndexedDataset(data)) == 5 and IndexedDataset(rows(3))[2][SAMPLE_INDEX_FIELD] == 2


@pytest.mark.parametrize("bad", [5, None, "rows", {1, 2}])
def test_indexed_dataset_refuses_what_is_not_a_dataset(bad):
    with pytest.raises(TypeError, match=rf"^IndexedDataset takes a map-style dataset \(with __len__ and __getitem__ "
                                        rf"returning samples: a datasets.Dataset, a list of dicts\), got "
                                        rf"{type(bad).__name__}$"):
        IndexedDataset(bad)


def test_some_samples_without_an_index_is_an_error_naming_one():
    samples = [{"input_ids": [1, 2], SAMPLE_INDEX_FIELD: 5}, {"input_ids": [3]}]
    with pytest.raises(SampleError, match=r"^sample 1 has no 'sample_index' field, but sample 0 has one") as err:
        ThdCollator()(samples)
    assert (err.value.sample, err.value.field) == (1, SAMPLE_INDEX_FIELD)


@pytest.mark.parametrize("bad", [-1, 2.0, True, "3", [1]])
def test_a_bad_index_is_an_error_naming_the_sample(bad):
    samples = [{"input_ids": [1, 2], SAMPLE_INDEX_FIELD: 5}, {"input_ids": [3], SAMPLE_INDEX_FIELD: bad}]
    with pytest.raises(SampleError, match=r"^sample 1: 'sample_index' must be an integer >= 0"):
        ThdCollator(pack_size=8)(samples)


def test_numpy_and_torch_integer_indices_are_read():
    samples = [{"input_ids": [1, 2], SAMPLE_INDEX_FIELD: np.int32(4)},
               {"input_ids": [3], SAMPLE_INDEX_FIELD: torch.tensor(9)}]
    assert ThdCollator()(samples).sample_index.tolist() == [4, 9]
