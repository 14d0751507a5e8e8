"""``thdpack.shard``: one verb for a rank's part of a pack, its keywords picking the layout (static CP,
Ulysses, hybrid CP), and a ``TypeError`` naming the calls for a mix of keywords that means nothing (issue 44)."""

import pytest

import thdpack
from thdpack import build_thd_batch, plan_hybrid_cp

SAMPLES = [{"input_ids": list(range(1, 1 + n))} for n in (5, 3, 8)]
BATCH = build_thd_batch(SAMPLES, cp_size=2)
PLAN = plan_hybrid_cp([5, 3, 8], 2, 16)


def test_the_keywords_pick_the_layout():
    assert thdpack.shard(BATCH, cp_size=2, cp_rank=1).shard.layout == "cp"
    assert thdpack.shard(BATCH, sp_size=2, sp_rank=1).shard.layout == "ulysses"
    ring = thdpack.shard(BATCH, sp_size=2, sp_rank=1, cp_size=2, cp_rank=1, pad_token_id=0).shard
    assert (ring.layout, ring.sp_size, ring.sp_rank, ring.cp_size, ring.cp_rank) == ("ulysses", 2, 1, 2, 1)
    micro = [b for r in range(2) for b in thdpack.shard(SAMPLES, plan=PLAN, rank=r)]
    assert micro and {b.shard.layout for b in micro} == {"hybrid-cp"}
    assert sorted({i for b in micro for i in b.sample_index.tolist()}) == [0, 1, 2]  # a block of 2 shares one


@pytest.mark.parametrize("call, message", [
    (lambda: thdpack.shard(BATCH), r"^shard\(\) needs the layout's keywords: shard\(batch, cp_size=, cp_rank=\)"),
    (lambda: thdpack.shard(SAMPLES, cp_size=2, cp_rank=0),
     r"^shard\(batch, cp_size=, cp_rank=\) takes a thdpack.ThdBatch .*got list; samples: build the batch first, "
     r"or give them with plan= and rank="),
    (lambda: thdpack.shard(SAMPLES, sp_size=2, sp_rank=0), r"^shard\(batch, sp_size=, sp_rank=\) takes a "),
    (lambda: thdpack.shard(BATCH, plan=PLAN, rank=0), r"builds the plan's micro-batches from the samples, got a "
                                                       r"thdpack.ThdBatch: pass the samples"),
    (lambda: thdpack.shard(SAMPLES, plan=PLAN, rank=0, cp_size=2), r"takes no cp_size=: the plan decides"),
    (lambda: thdpack.shard(SAMPLES, plan=PLAN, rank=0, cp_rank=1), r"takes no cp_rank=: the plan decides"),
    (lambda: thdpack.shard(SAMPLES, plan=PLAN, rank=0, sp_size=2), r"takes no sp_size=: hybrid CP has no Ulysses"),
    (lambda: thdpack.shard(SAMPLES, plan=PLAN), r"^shard\(\) got plan= without rank=: hybrid CP takes both"),
    (lambda: thdpack.shard(BATCH, rank=0), r"^shard\(\) got rank= without plan=: .*a CP rank is cp_rank="),
    (lambda: thdpack.shard(BATCH, cp_rank=0), r"^shard\(\) got cp_rank= without cp_size="),
    (lambda: thdpack.shard(BATCH, sp_rank=0), r"^shard\(\) got sp_rank= without sp_size="),
    (lambda: thdpack.shard(BATCH, cp_size=2, cp_rank=0, pad_token_id=0),
     r"^shard\(batch, cp_size=, cp_rank=\) got unexpected keyword argument\(s\) 'pad_token_id'"),
    (lambda: thdpack.shard(BATCH, sp_size=2, sp_rank=0, heads=4),
     r"^shard\(batch, sp_size=, sp_rank=\) got unexpected keyword argument\(s\) 'heads': it takes only "
     r"pad_token_id=, num_heads=, num_kv_heads="),
])
def test_a_mix_that_means_nothing_names_the_calls(call, message):
    with pytest.raises(TypeError, match=message) as info:
        call()
    assert "\n" not in str(info.value)


def test_the_old_names_are_gone():
    for name in ("shard_for_cp", "shard_for_ulysses", "hybrid_cp_shards"):
        assert not hasattr(thdpack, name) and name not in thdpack.__all__, name
    assert "shard" in thdpack.__all__
