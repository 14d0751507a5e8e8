"""Per-sample values (weights, rewards, advantages, domain ids) travel with their sample
through planning, building and CP shards: batch.sample_values[name] [n], batch.token_values(name)
[T] (issue 15 point 2)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import thdpack
from thdpack import SampleError, ThdCollator, build_thd_batch
from thdpack.losses import token_logps


def make_rows(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(1, 50, s), "reward": float(rng.normal()), "domain": int(rng.integers(0, 4)),
             "vec": rng.normal(size=3)} for s in lengths]


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30), cp=st.sampled_from([1, 2, 4]),
       overflow=st.sampled_from(["truncate", "split", "drop"]))
def test_values_follow_their_samples_through_planning_building_and_cp(lengths, cp, overflow):
    rows = make_rows(lengths)
    names = ["reward", "domain", "vec"]
    packs = ThdCollator(pack_size=32, cp_size=cp, overflow=overflow, sample_values=names)(rows)
    for batch in packs:
        src = [rows[i] for i in batch.sample_index.tolist()]  # one call: positions are input rows
        assert batch.sample_values["reward"].tolist() == [r["reward"] for r in src]
        assert batch.sample_values["domain"].dtype == torch.int64
        assert batch.sample_values["domain"].tolist() == [r["domain"] for r in src]
        assert batch.sample_values["vec"].shape == (batch.num_samples, 3)
        tok = batch.token_values("reward")
        assert tok.shape == (batch.num_padded_tokens,)
        cu = batch.cu_seqlens_padded.tolist()
        for j, r in enumerate(src):
            assert (tok[cu[j] : cu[j + 1]] == r["reward"]).all()
        assert batch.token_values("vec").shape == (batch.num_padded_tokens, 3)
        for rank in range(cp):
            shard = thdpack.shard(batch, cp_size=cp, cp_rank=rank) if cp > 1 else batch
            for name in names:
                torch.testing.assert_close(shard.token_values(name), batch.token_values(name)[shard.shard.partition_indices]
                                           if cp > 1 else batch.token_values(name), rtol=0, atol=0)


def test_direct_shard_build_carries_values():
    rows = make_rows([7, 12, 5], seed=1)
    whole = build_thd_batch(rows, cp_size=2, sample_values=["reward"])
    for rank in range(2):
        shard = build_thd_batch(rows, cp_size=2, cp_rank=rank, sample_values=["reward"])
        assert torch.equal(shard.token_values("reward"), whole.token_values("reward")[shard.shard.partition_indices])


def test_values_move_with_the_batch():
    batch = build_thd_batch(make_rows([4, 3]), sample_values=["reward"])
    moved = batch.to("meta")
    assert moved.sample_values["reward"].device.type == "meta"


def test_per_domain_loss_equals_each_domain_alone():
    """Per-domain mean NLL from token_values('domain'), packed, equals the per-sample computation."""
    rows = make_rows([9, 4, 13, 6, 8], seed=2)
    batch = build_thd_batch(rows, sample_values=["domain"], pad_multiple=4)
    logits = torch.randn(batch.num_padded_tokens, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    nll = -token_logps(logits, batch)
    domain = batch.token_values("domain")
    cu = batch.cu_seqlens_padded.tolist()
    for d in set(r["domain"] for r in rows):
        packed = nll[(domain == d) & batch.loss_mask].mean()
        parts = [nll[cu[j] : cu[j + 1]][batch.loss_mask[cu[j] : cu[j + 1]]] for j, r in enumerate(rows) if r["domain"] == d]
        torch.testing.assert_close(packed, torch.cat(parts).mean(), rtol=0, atol=0)


def test_value_errors_name_sample_and_field():
    rows = make_rows([4, 3, 5])
    del rows[1]["reward"]
    with pytest.raises(SampleError, match=r"sample 1 has no 'reward' value"):
        build_thd_batch(rows, sample_values=["reward"])
    rows = make_rows([4, 3])
    rows[1]["reward"] = "high"
    with pytest.raises(SampleError, match=r"sample 1: 'reward' is 'high'; a per-sample value is a number"):
        build_thd_batch(rows, sample_values=["reward"])
    rows = make_rows([4, 3])
    rows[1]["vec"] = [1.0, 2.0]
    with pytest.raises(SampleError, match=r"sample 1: 'vec' has shape \(2,\), sample 0's has \(3,\)"):
        build_thd_batch(rows, sample_values=["vec"])
    with pytest.raises(KeyError, match="batch has no per-sample value 'weight'"):
        build_thd_batch(make_rows([4]), sample_values=["reward"]).token_values("weight")
