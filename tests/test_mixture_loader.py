"""Dataset mixtures on the online path (issue 35): ``MixtureDataset`` is the blend ``plan_mixture`` computes (what the
offline build will compute), its samples carry ``source_index`` into ``ThdBatch.source_index`` through the collator,
shards and shared-prefix trees, resume is exact behind a ``TokenBudgetBatchSampler`` and a ``StreamingPacker`` with
worker processes (plain ``DataLoader`` and ``StatefulDataLoader``), and losses split by source add up."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import thdpack
from thdpack import StreamingPacker, ThdCollator, TokenBudgetBatchSampler, build_thd_batch
from thdpack.common.samples import SampleError
from thdpack.loaders.mixture_dataset import MixtureDataset
from thdpack.losses import packed_loss, packed_loss_by_source, source_totals
from thdpack.planning.mixture import plan_mixture

try:
    from torchdata import stateful_dataloader as stateful
except ImportError:  # torchdata is in the `test` extra
    stateful = None
needs_torchdata = pytest.mark.skipif(stateful is None, reason="torchdata is not installed (pip install -e '.[test]')")

PACK = 64


def _rows(n, offset, seed):
    """Rows whose tokens are globally unique (from ``offset``), so a pack's tokens say which rows it holds."""
    lengths = np.random.default_rng(seed).integers(3, 30, n)
    starts = offset + np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return [{"input_ids": list(range(int(s), int(s + k)))} for s, k in zip(starts, lengths)], lengths


CHAT, CHAT_LEN = _rows(40, 0, 0)
MATH, MATH_LEN = _rows(12, 10_000, 1)
CODE, CODE_LEN = _rows(25, 20_000, 2)


def _entries(seed_lengths=True):
    entries = [{"name": "chat", "dataset": CHAT, "weight": 0.6}, {"name": "math", "dataset": MATH, "epochs": 2.5},
               {"name": "code", "dataset": CODE, "weight": 0.4}]
    if seed_lengths:
        for e, lengths in zip(entries, (CHAT_LEN, MATH_LEN, CODE_LEN)):
            e["lengths"] = lengths
    return entries


def _mixture(seed=3, **kw):
    return MixtureDataset(_entries(), seed=seed, **kw)


def test_the_dataset_is_the_plan_and_tags_every_sample():
    mixture = _mixture()
    offline = [{k: v for k, v in e.items() if k != "dataset"} | {"num_rows": len(e["dataset"])} for e in _entries()]
    plan = plan_mixture(offline, seed=3)  # what an offline build of the same sources, weights and seed computes
    assert mixture.plan.source.tolist() == plan.source.tolist() and mixture.plan.row.tolist() == plan.row.tolist()
    data = (CHAT, MATH, CODE)
    for k in (0, 1, len(mixture) - 1, -1):
        i = int(plan.source[k])
        assert mixture[k] == {**data[i][int(plan.row[k])], "sample_index": k % len(mixture), "source_index": i}
    some = [5, 0, 17, 5, len(mixture) - 1]
    assert mixture.__getitems__(some) == [mixture[k] for k in some]
    assert mixture.lengths.tolist() == [len(mixture[k]["input_ids"]) for k in range(len(mixture))]
    with pytest.raises(IndexError, match="out of range"):
        mixture[len(mixture)]


def test_source_index_travels_through_collator_shards_and_trees():
    rows = [{"input_ids": list(range(1, 9 + i)), "labels": list(range(1, 9 + i)), "source_index": i % 3,
             "group": i // 2} for i in range(6)]
    batch = ThdCollator()(rows)
    assert batch.source_index.tolist() == [0, 1, 2, 0, 1, 2] and batch.source_index.dtype == torch.int64
    packs = ThdCollator(pack_size=32)(rows)
    for b in packs:
        assert b.source_index.tolist() == [i % 3 for i in b.sample_index.tolist()]
    cp_shard = thdpack.shard(build_thd_batch(rows, cp_size=2), cp_size=2, cp_rank=1)
    assert cp_shard.source_index.tolist() == [0, 1, 2, 0, 1, 2]
    assert ThdCollator(cp_size=2, cp_rank=0)(rows).source_index.tolist() == [0, 1, 2, 0, 1, 2]
    assert thdpack.shard(batch, sp_size=2, sp_rank=1).source_index.tolist() == [0, 1, 2, 0, 1, 2]
    tree = build_thd_batch(rows, share_prefix="group", min_prefix_len=4)
    assert tree.prefix_tree is not None and tree.source_index.tolist() == [0, 1, 2, 0, 1, 2]
    assert build_thd_batch(rows, source_index=[5, 4, 3, 2, 1, 0]).source_index.tolist() == [5, 4, 3, 2, 1, 0]
    plain = build_thd_batch([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    assert plain.source_index.tolist() == [0, 0], "one source: every sample's is 0"
    assert plain.to("cpu").source_index.tolist() == [0, 0]


def test_source_index_errors_name_the_sample():
    with pytest.raises(SampleError, match=r"sample 1 has no 'source_index' field, but sample 0 has one"):
        build_thd_batch([{"input_ids": [1, 2], "source_index": 0}, {"input_ids": [3, 4]}])
    for bad in (-1, 1.5, True, "a"):
        with pytest.raises(SampleError, match=r"sample 0: 'source_index' must be an integer >= 0"):
            build_thd_batch([{"input_ids": [1, 2], "source_index": bad}])
    with pytest.raises(ValueError, match=r"source_index must be 2 integers >= 0"):
        build_thd_batch([{"input_ids": [1, 2]}, {"input_ids": [3]}], source_index=[0])


def test_mixture_dataset_errors_name_the_source():
    with pytest.raises(ValueError, match=r"mixture sources 'chat' and 'again' are the same dataset"):
        MixtureDataset([{"name": "chat", "dataset": CHAT}, {"name": "again", "dataset": CHAT, "weight": 2}])
    with pytest.raises(ValueError, match=r"mixture source 'empty' is empty \(0 rows, after filtering\)"):
        MixtureDataset([{"name": "chat", "dataset": CHAT}, {"name": "empty", "dataset": []}])
    with pytest.raises(ValueError, match=r"mixture source 'math': unknown key 'epoch' \(did you mean 'epochs'\?\)"):
        MixtureDataset([{"name": "chat", "dataset": CHAT}, {"name": "math", "dataset": MATH, "epoch": 2}])
    with pytest.raises(ValueError, match=r"mixture source 'math': weight must be a finite number >= 0, got nan"):
        MixtureDataset([{"name": "chat", "dataset": CHAT}, {"name": "math", "dataset": MATH, "weight": float("nan")}])
    with pytest.raises(ValueError, match=r"mixture source 'source1' has no 'dataset'"):
        MixtureDataset([{"dataset": CHAT}, {"weight": 1}])
    with pytest.raises(TypeError, match=r"mixture source 'x': dataset must be map-style"):
        MixtureDataset([{"name": "x", "dataset": iter(CHAT)}])
    with pytest.raises(ValueError, match=r"needs every source's lengths .* give 'lengths' to 'math'"):
        MixtureDataset([{"name": "chat", "dataset": CHAT, "lengths": CHAT_LEN},
                        {"name": "math", "dataset": MATH}]).lengths


def test_datasets_of_one_fingerprint_are_the_same_source():
    datasets = pytest.importorskip("datasets")
    table = {"input_ids": [[1, 2, 3], [4, 5]]}
    a, b = datasets.Dataset.from_dict(table), datasets.Dataset.from_dict(table)
    b._fingerprint = a._fingerprint  # what one file loaded twice gives
    with pytest.raises(ValueError, match=r"mixture sources 'a' and 'b' are the same dataset"):
        MixtureDataset([{"name": "a", "dataset": a}, {"name": "b", "dataset": b}])
    mixture = MixtureDataset([{"name": "a", "dataset": a}, {"name": "b", "dataset": datasets.Dataset.from_dict(
        {"input_ids": [[7, 8]]}), "epochs": 2}])
    assert sorted(mixture.plan.counts.tolist()) == [2, 2]
    assert [mixture[k]["source_index"] for k in range(len(mixture))] == mixture.plan.source.tolist()


# ------------------------------------------------------------------------------------------------------------
# DataLoader paths and exact resume
# ------------------------------------------------------------------------------------------------------------
EPOCHS = 2


def _seen(batch):
    return batch.input_ids.tolist(), batch.source_index.tolist()


def _train_sampler(workers, stop=None, state=None):
    """The documented plain-DataLoader loop over a mixture; stops after ``stop`` batches and saves the sampler."""
    mixture = _mixture()
    sampler = TokenBudgetBatchSampler(mixture.lengths, PACK, seed=1)
    if state is not None:
        sampler.load_state_dict(state)
    loader = DataLoader(mixture, batch_sampler=sampler, collate_fn=ThdCollator(), num_workers=workers)
    seen = []
    while sampler.epoch < EPOCHS:
        for k, batch in enumerate(loader, start=1):
            assert batch.source_index.tolist() == mixture.plan.source[batch.sample_index.numpy()].tolist()
            seen.append(_seen(batch))
            if len(seen) == stop:
                return seen, sampler.state_dict(consumed=k)
    return seen, None


def test_sampler_over_a_mixture_resumes_exactly_with_workers():
    full, _ = _train_sampler(0)
    steps = len(full) // EPOCHS
    assert {s for _, sources in full for s in sources} == {0, 1, 2}
    for cut in (3, steps + 1):
        head, state = _train_sampler(2, stop=cut)
        tail, _ = _train_sampler(2, state=state)
        assert head + tail == full, cut


def _stream_loader(mixture, workers, cls):
    return cls(StreamingPacker(mixture, PACK, buffer_size=2), batch_size=None, collate_fn=ThdCollator(),
               num_workers=workers)


@needs_torchdata
@pytest.mark.parametrize("path", ["sampler", "stream"])
def test_stateful_dataloader_over_a_mixture_resumes_exactly(path):
    def make(seed=3):
        mixture = _mixture(seed)
        if path == "stream":
            return _stream_loader(mixture, 2, stateful.StatefulDataLoader)
        sampler = TokenBudgetBatchSampler(mixture.lengths, PACK, seed=1)
        return stateful.StatefulDataLoader(mixture, batch_sampler=sampler, collate_fn=ThdCollator(), num_workers=2)

    full = [_seen(b) for b in make()]
    if path == "stream":  # every sample of the blend packed exactly once across the workers
        packed = sorted(i for b in make() for i in b.sample_index.tolist())
        assert packed == list(range(len(_mixture())))
    for cut in (2, len(full) - 1):
        loader = make()
        it = iter(loader)
        head = [_seen(next(it)) for _ in range(cut)]
        state = loader.state_dict()
        resumed = make()
        resumed.load_state_dict(state)
        assert head + [_seen(b) for b in resumed] == full, cut


@needs_torchdata
def test_stateful_dataloader_refuses_the_state_of_another_blend():
    def make(seed):
        mixture = _mixture(seed)
        sampler = TokenBudgetBatchSampler(_mixture().lengths, PACK, seed=1)  # one sampler: only the blend differs
        return stateful.StatefulDataLoader(mixture, batch_sampler=sampler, collate_fn=ThdCollator())

    loader = make(3)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    resumed = make(3)
    resumed.load_state_dict(state)
    next(iter(resumed))
    other = make(4)
    with pytest.raises(ValueError, match=r"saved by a MixtureDataset with another blend"):
        other.load_state_dict(state)
        next(iter(other))


def test_mixture_state_is_its_fingerprint():
    mixture = _mixture()
    assert mixture.state_dict() == _mixture().state_dict()
    with pytest.raises(ValueError, match=r"another blend"):
        mixture.load_state_dict(_mixture(seed=9).state_dict())
    with pytest.raises(ValueError, match=r"state_dict is missing key\(s\) 'fingerprint'"):
        mixture.load_state_dict({})


# ------------------------------------------------------------------------------------------------------------
# losses by source
# ------------------------------------------------------------------------------------------------------------
def _batch_and_logits(seed=0, num_sources=3, cp_size=1):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(7):
        n = int(torch.randint(3, 20, (1,), generator=g))
        ids = torch.randint(1, 50, (n,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(0, n, (1,), generator=g))] = -100  # a prompt
        rows.append({"input_ids": ids, "labels": labels, "source_index": i % num_sources})
    rows[4]["labels"][:] = -100  # a sample without targets
    batch = build_thd_batch(rows, cp_size=cp_size)
    logits = torch.randn(batch.num_padded_tokens, 50, generator=g, dtype=torch.float64, requires_grad=True)
    return rows, batch, logits


def _reference(batch, logits, num_sources):
    """Per source: Σ target NLL, targets, Σ sample token-means, samples with targets; written out sample by sample."""
    totals = np.zeros((4, num_sources))
    cu = batch.cu_seqlens_padded.tolist()
    logp = torch.log_softmax(logits.detach(), -1)
    for i in range(batch.num_samples):
        s = int(batch.source_index[i])
        labels, mask = batch.labels[cu[i]:cu[i + 1]], batch.loss_mask[cu[i]:cu[i + 1]]
        nll = -logp[cu[i]:cu[i + 1]][mask].gather(1, labels[mask][:, None]).sum().item()
        count = int(mask.sum())
        totals[:, s] += [nll, count, nll / count if count else 0.0, count > 0]
    return totals


def test_source_totals_and_losses_split_the_packed_loss():
    rows, batch, logits = _batch_and_logits()
    ref = _reference(batch, logits, 3)
    for reduction, (num, den) in (("token", (0, 1)), ("sample", (2, 3))):
        from thdpack.losses import token_logps

        totals, items = source_totals(-token_logps(logits, batch), batch, 3, reduction)
        np.testing.assert_allclose(totals.detach().numpy(), ref[num], rtol=1e-12)
        assert items.tolist() == ref[den].astype(int).tolist() and items.dtype == torch.int64
        by_source = packed_loss_by_source(logits, batch, 3, reduction)  # each source normalised by its own items
        np.testing.assert_allclose(by_source.detach().numpy(), ref[num] / ref[den], rtol=1e-12)
        whole = packed_loss(logits, batch, reduction)  # one normaliser for all: the sources add up to the loss
        split = packed_loss_by_source(logits, batch, 3, reduction, num_items=int(ref[den].sum()))
        torch.testing.assert_close(split.sum(), whole, rtol=1e-12, atol=0)
        grad_whole, = torch.autograd.grad(whole, logits)
        grad_split, = torch.autograd.grad(split.sum(), logits)
        torch.testing.assert_close(grad_split, grad_whole, rtol=1e-12, atol=1e-15)
    per_source = packed_loss_by_source(logits, batch, 4, "token", num_items=[10, 0, 5, 0])
    np.testing.assert_allclose(per_source.detach().numpy(), [ref[0, 0] / 10, 0, ref[0, 2] / 5, 0], rtol=1e-12)


def test_source_totals_on_cp_shards_add_up_to_the_whole_batch():
    from thdpack.losses import sample_target_counts, token_logps

    rows, whole, logits = _batch_and_logits(seed=1, cp_size=2)
    ref_totals, ref_items = source_totals(-token_logps(logits, whole), whole, 3)
    counts = sample_target_counts(whole)
    totals = items = sample_totals = 0
    for rank in (0, 1):
        shard = thdpack.shard(whole, cp_size=2, cp_rank=rank)
        shard_logits = logits.detach()[shard.shard.partition_indices]
        t, n = source_totals(-token_logps(shard_logits, shard), shard, 3)
        s, _ = source_totals(-token_logps(shard_logits, shard), shard, 3, "sample", sample_targets=counts)
        totals, items, sample_totals = totals + t, items + n, sample_totals + s
    torch.testing.assert_close(totals, ref_totals.detach(), rtol=1e-12, atol=1e-12)
    assert items.tolist() == ref_items.tolist()
    ref_sample, _ = source_totals(-token_logps(logits, whole), whole, 3, "sample")
    torch.testing.assert_close(sample_totals, ref_sample.detach(), rtol=1e-12, atol=1e-12)


def test_losses_by_source_refuse_what_does_not_fit():
    rows, batch, logits = _batch_and_logits()
    with pytest.raises(ValueError, match=r"sample 2 of the batch \(sample_index 2\) has source_index 2, but "
                                         r"num_sources=2"):
        packed_loss_by_source(logits, batch, 2)
    with pytest.raises(ValueError, match=r"num_sources must be an integer >= 1, got 0"):
        packed_loss_by_source(logits, batch, 0)
    with pytest.raises(ValueError, match=r"num_items must be one number > 0 or 3 finite numbers >= 0"):
        packed_loss_by_source(logits, batch, 3, num_items=[1, 2])
    with pytest.raises(ValueError, match=r"num_items must be one number > 0 or 3 finite numbers >= 0"):
        packed_loss_by_source(logits, batch, 3, num_items=[1, -2, 3])
    with pytest.raises(ValueError, match=r"num_items must be > 0"):
        packed_loss_by_source(logits, batch, 3, num_items=0)
