"""Exact resume through a DataLoader: ``TokenBudgetBatchSampler`` and ``StreamingPacker`` with
worker processes (prefetching), persistent or not, across epoch boundaries and data-parallel ranks,
with a plain ``DataLoader`` and with torchdata's ``StatefulDataLoader``."""

from __future__ import annotations

import numpy as np
import pytest
from torch.utils.data import DataLoader

from thdpack import StreamingPacker, ThdCollator, TokenBudgetBatchSampler

EPOCHS = 2
PACK = 64


def _dataset(n=60, seed=0):
    """Rows whose tokens are globally unique, so a pack's tokens say which rows it holds."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, 40, size=n)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    rows = [{"input_ids": list(range(int(s), int(s + n_))), "id": i} for i, (s, n_) in enumerate(zip(starts, lengths))]
    return rows, lengths


ROWS, LENGTHS = _dataset()


def _sampler(rank=0, num_replicas=1):
    return TokenBudgetBatchSampler(LENGTHS, PACK, seed=5, num_replicas=num_replicas, rank=rank)


def _loader(sampler, workers, persistent):
    return DataLoader(ROWS, batch_sampler=sampler, collate_fn=ThdCollator(), num_workers=workers,
                      persistent_workers=persistent, prefetch_factor=2 if workers else None)


def _train_plain(workers, persistent, stop=None, state=None, rank=0, num_replicas=1):
    """The documented plain-DataLoader loop; returns the token lists it trained on and, when it
    stops after ``stop`` batches, the sampler state saved the documented way."""
    sampler = _sampler(rank, num_replicas)
    if state is not None:
        sampler.load_state_dict(state)
    loader = _loader(sampler, workers, persistent)
    seen = []
    while sampler.epoch < EPOCHS:
        for k, batch in enumerate(loader, start=1):
            seen.append(batch.input_ids.tolist())
            if len(seen) == stop:
                return seen, sampler.state_dict(consumed=k)
    return seen, None


@pytest.mark.parametrize("workers, persistent", [(0, False), (2, False), (2, True)])
def test_plain_dataloader_resume_is_exact(workers, persistent):
    full, _ = _train_plain(0, False)
    steps = len(_sampler())
    assert len(full) == EPOCHS * steps
    for cut in (3, steps - 1, steps, steps + 2):  # mid epoch, last batches of epoch 0, into epoch 1
        head, state = _train_plain(workers, persistent, stop=cut)
        assert state["epoch"] * steps + state["step"] == cut, "the state records what the loop consumed"
        tail, _ = _train_plain(workers, persistent, state=state)
        assert head + tail == full, f"cut {cut}"


def test_plain_dataloader_resume_with_dp_ranks():
    for rank in (0, 1):
        full, _ = _train_plain(0, False, rank=rank, num_replicas=2)
        steps = len(_sampler(rank, 2))
        for cut in (2, steps + 1):
            head, state = _train_plain(2, False, stop=cut, rank=rank, num_replicas=2)
            tail, _ = _train_plain(2, True, state=state, rank=rank, num_replicas=2)
            assert head + tail == full, (rank, cut)


def test_prefetching_runs_ahead_and_consumed_says_where_training_is():
    """The issue's case: 7 batches consumed behind 2 workers; the sampler has handed out more."""
    sampler = _sampler()
    loader = _loader(sampler, 2, False)
    for k, _ in zip(range(1, 8), loader):
        pass
    assert sampler.state_dict()["step"] > 7, "the loader did not prefetch: this test no longer shows the problem"
    assert (sampler.state_dict(consumed=7)["epoch"], sampler.state_dict(consumed=7)["step"]) == (0, 7)


def test_consumed_beyond_the_pass_is_an_error():
    sampler = _sampler()
    it = iter(sampler)
    next(it)
    with pytest.raises(ValueError, match=r"consumed=2.*1 drawn"):
        sampler.state_dict(consumed=2)
    with pytest.raises(ValueError, match=r"consumed must be an integer >= 0, got -1"):
        sampler.state_dict(consumed=-1)


# --------------------------------------------------------------------------
# torchdata's StatefulDataLoader
# --------------------------------------------------------------------------
try:
    from torchdata import stateful_dataloader as stateful
except ImportError:  # torchdata is in the `test` extra; the plain-DataLoader tests above run without it
    stateful = None
needs_torchdata = pytest.mark.skipif(stateful is None, reason="torchdata is not installed (pip install -e '.[test]')")


def _train_stateful(workers, persistent, stop=None, save_after_epoch=False, ckpt=None):
    """A trainer that checkpoints ``loader.state_dict()`` and its own epoch counter."""
    loader = stateful.StatefulDataLoader(ROWS, batch_sampler=_sampler(), collate_fn=ThdCollator(),
                                         num_workers=workers, persistent_workers=persistent)
    start = 0
    if ckpt is not None:
        loader.load_state_dict(ckpt["loader"])
        start = ckpt["epoch"]
    seen = []
    for epoch in range(start, EPOCHS):
        for batch in loader:
            seen.append(batch.input_ids.tolist())
            if len(seen) == stop and not save_after_epoch:
                return seen, {"loader": loader.state_dict(), "epoch": epoch}
        if len(seen) == stop:
            return seen, {"loader": loader.state_dict(), "epoch": epoch + 1}
    return seen, None


@needs_torchdata
@pytest.mark.parametrize("workers, persistent", [(0, False), (2, False), (2, True)])
def test_stateful_dataloader_resume_is_exact(workers, persistent):
    full, _ = _train_plain(0, False)
    steps = len(_sampler())
    for cut, after in ((3, False), (steps, False), (steps, True), (steps + 2, False)):
        head, ckpt = _train_stateful(workers, persistent, stop=cut, save_after_epoch=after)
        tail, _ = _train_stateful(workers, persistent, ckpt=ckpt)
        assert head + tail == full, (cut, after)


# --------------------------------------------------------------------------
# StreamingPacker: every sample once across workers and ranks, exact resume per worker
# --------------------------------------------------------------------------
def _ids(pack):
    return [row["id"] for row in pack]


def _identity(pack):
    return pack


def _stream_loader(packer, workers, loader_cls=DataLoader, **kw):
    return loader_cls(packer, batch_size=None, collate_fn=_identity, num_workers=workers, **kw)


@pytest.mark.parametrize("workers", [0, 2])
def test_streaming_packer_packs_every_sample_once_with_workers(workers):
    packs = [_ids(p) for p in _stream_loader(StreamingPacker(ROWS, PACK, buffer_size=2), workers)]
    assert sorted(i for p in packs for i in p) == list(range(len(ROWS)))


def test_streaming_packer_packs_every_sample_once_with_ranks_and_workers():
    seen = []
    for rank in (0, 1):
        packer = StreamingPacker(ROWS, PACK, buffer_size=2, num_replicas=2, rank=rank)
        seen += [i for p in _stream_loader(packer, 2) for i in _ids(p)]
    assert sorted(seen) == list(range(len(ROWS)))


@needs_torchdata
@pytest.mark.parametrize("workers, num_replicas, rank", [(0, 1, 0), (2, 1, 0), (2, 2, 1)])
def test_streaming_packer_resume_per_worker_is_exact(workers, num_replicas, rank):
    """StatefulDataLoader saves each worker's packer state inside the worker and restores it there."""
    mk = lambda: _stream_loader(  # noqa: E731
        StreamingPacker(ROWS, PACK, buffer_size=2, num_replicas=num_replicas, rank=rank), workers,
        stateful.StatefulDataLoader)
    full = [_ids(p) for p in mk()]
    per_rank = max(workers, 1)  # stream share of rank r, worker w: r * workers + w, of num_replicas * workers
    mine = [i for i in range(len(ROWS)) if i % (num_replicas * per_rank) // per_rank == rank]
    assert sorted(i for p in full for i in p) == mine
    for cut in (1, 4, len(full) - 1):
        loader = mk()
        it = iter(loader)
        head = [_ids(next(it)) for _ in range(cut)]
        state = loader.state_dict()
        resumed = mk()
        resumed.load_state_dict(state)
        assert head + [_ids(p) for p in resumed] == full, cut


def test_streaming_packer_state_from_the_main_process_is_refused_by_workers():
    """A plain DataLoader copies the main process's packer into every worker: resuming all workers
    from one state would pack samples twice, so the workers refuse it."""
    packer = StreamingPacker(ROWS, PACK, buffer_size=2)
    next(iter(packer))
    resumed = StreamingPacker(ROWS, PACK, buffer_size=2)
    resumed.load_state_dict(packer.state_dict())
    with pytest.raises(ValueError, match=r"share 0 of 1, but this packer reads share \d of 2"):
        list(_stream_loader(resumed, 2))
