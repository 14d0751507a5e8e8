"""Hybrid (per-sample) context parallelism without megatron-core (issue 33): the plan's invariants, the shards,
the per-rank FLOPs counts, ``thdpack.batching.padding_mask(batch)`` and the one-line refusals. megatron-core's own code checks
the same objects in tests/test_hybrid_cp_megatron.py."""

from __future__ import annotations

import ast

import numpy as np
import pytest
import torch

import megatron_env  # tests/megatron_env.py
import thdpack
from thdpack import SampleError, build_thd_batch, cp_pad_multiple, plan_hybrid_cp
from thdpack.flops import cp_seqlen_squared_share, model_flops
from thdpack.flops.rank_work import hybrid_cp_rank_flops
from thdpack.integrations.megatron_bridge import to_gpt_forward_kwargs
from thdpack.parallel.hybrid_blocks import block_ranks, block_sizes, check_block
from thdpack.planning.hybrid_cp import HybridCPPlan, schedule_cost
from thdpack.integrations import packed_seq_params_dict
from thdpack.batching import padding_mask

QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936}


def skewed(n: int, seed: int, long=(40, 160)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.integers(1, 30, n), rng.integers(*long, max(1, n // 20))])


def check_plan(plan: HybridCPPlan, budget: int, multiple_of) -> None:
    """The invariants every plan keeps."""
    n, world = plan.num_samples, plan.world_size
    assert sorted(plan.micro_batch_samples.tolist()) == list(range(n))  # every sample in one micro-batch
    for i in range(n):
        k, start = int(plan.cp_sizes[i]), int(plan.block_starts[i])
        check_block(k, start, world)
        m = multiple_of(k)
        assert plan.padded_lengths[i] == -(-plan.lengths[i] // m) * m  # its least valid multiple for its k
        assert plan.padded_lengths[i] // k <= budget
    for j in range(plan.num_micro_batches):
        ids = plan.micro_batch(j)
        blocks = {(int(plan.cp_sizes[i]), int(plan.block_starts[i])) for i in ids}
        assert len(blocks) == 1  # a micro-batch runs on one block
        k, _ = blocks.pop()
        assert int((plan.padded_lengths[ids] // k).sum()) <= budget
    for r in range(world):
        mine = plan.rank_micro_batches(r)
        assert mine  # megatron-core's schedule runs at least one sub-sample on every rank
        sizes = [plan.micro_batch_block(j)[0] for j in mine]
        assert sizes == sorted(sizes, reverse=True)  # largest block first: a block's ranks arrive together


@pytest.mark.parametrize("world", [1, 2, 4, 8, 12, 64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_invariants(world, seed):
    lengths = skewed(40 * max(1, world // 4), seed, long=(20, 28 * block_sizes(world)[-1] + 2))
    plan = plan_hybrid_cp(lengths, world, 32, cost=(1, 0.05), pad_multiple=4 if seed == 1 else None)
    check_plan(plan, 32, lambda k: cp_pad_multiple(k) if seed != 1 else np.lcm(cp_pad_multiple(k), 4))
    assert plan.straggler < 1.25


def test_plan_with_tensor_and_sequence_parallelism_pads_for_both():
    plan = plan_hybrid_cp(skewed(60, 3), 8, 32, tp_size=2, sequence_parallel=True)
    check_plan(plan, 32, lambda k: cp_pad_multiple(k, 2, True))
    assert (plan.padded_lengths[plan.cp_sizes == 1] % 2 == 0).all()  # k = 1 still pads for SP's 2 ranks


def test_least_cp_size_and_long_samples_widen():
    plan = plan_hybrid_cp([250, 120, 60, 31, 3, 2, 2, 1, 1, 1, 4, 5], 8, 32, cost=(0, 1))
    assert plan.cp_sizes[0] == 8  # 256 / 8 = 32: the least that fits
    assert plan.cp_sizes[1] >= 4 and plan.cp_sizes[2] >= 2
    # one long sample and nothing else: it runs on every rank (no rank idle)
    alone = plan_hybrid_cp([20], 8, 32)
    assert alone.cp_sizes.tolist() == [8] and alone.block_starts.tolist() == [0]
    assert alone.padded_lengths.tolist() == [32]


def test_groups_share_a_block_and_a_size():
    lengths = skewed(80, 4)
    groups = np.arange(lengths.size) // 3
    plan = plan_hybrid_cp(lengths, 8, 32, groups=groups)
    for g in np.unique(groups):
        members = np.flatnonzero(groups == g)
        assert len(set(plan.cp_sizes[members].tolist())) == 1 and len(set(plan.block_starts[members].tolist())) == 1


def test_pack_false_is_one_sample_per_micro_batch_and_megatrons_format():
    lengths = skewed(30, 5, long=(20, 100))
    plan = plan_hybrid_cp(lengths, 4, 32, pack=False)
    assert plan.num_micro_batches == plan.num_samples
    (group,) = plan.sample_id_groups()
    assert len(group) == 4 and sorted({i for ids in group for i in ids}) == list(range(plan.num_samples))
    for i in range(plan.num_samples):  # a sample's k is the number of ranks that list it (megatron-core's rule)
        assert sum(i in ids for ids in group) == plan.cp_sizes[i]


def test_schedule_cost_counts_barriers_and_cp_tokens():
    # two groups on 2 ranks: group 0 runs sample 0 on both (k=2), group 1 samples 1 and 2 on one rank each
    got = schedule_cost([[[0], [0]], [[1], [2]]], [4, 2, 1])
    assert got["step"] == 8 + 4 and got["mean"] == (16 + 4 + 1) / 2 and got["cp_tokens"] == 4
    assert got["groups"] == 2 and got["rank_loads"].tolist() == [12.0, 9.0]


@pytest.mark.parametrize("world", [4, 8])
def test_shards_tile_every_micro_batch(world):
    lengths = skewed(30, 6, long=(20, 100))
    g = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(1, 50, (int(s),), generator=g)} for s in lengths]
    plan = plan_hybrid_cp(lengths, world, 32, pad_multiple=2)
    seen = {}
    for r in range(world):
        shards = thdpack.shard(samples, plan=plan, rank=r, pad_multiple=2)
        assert [b.sample_index.tolist() for b in shards] == [plan.micro_batch(j).tolist()
                                                            for j in plan.rank_micro_batches(r)]
        for b in shards:
            k, start = b.shard.cp_size, b.shard.block_start
            whole = build_thd_batch([samples[i] for i in b.sample_index.tolist()], cp_size=k, pad_multiple=2)
            want = whole if k == 1 else thdpack.shard(whole, cp_size=k, cp_rank=r - start)
            for name in ("input_ids", "labels", "position_ids", "loss_mask"):
                assert torch.equal(getattr(b, name), getattr(want, name)), name
            mask = padding_mask(whole)[want.shard.partition_indices] if k > 1 else padding_mask(whole)
            assert torch.equal(padding_mask(b), mask)
            key = tuple(b.sample_index.tolist())
            seen.setdefault(key, []).append(want.shard.partition_indices if k > 1 else torch.arange(whole.num_padded_tokens))
    for key, parts in seen.items():
        total = int(plan.padded_lengths[list(key)].sum())
        assert sorted(torch.cat(parts).tolist()) == list(range(total))  # each slot on exactly one rank


@pytest.mark.parametrize("core", megatron_env.packed_seq_params_params())
def test_packed_seq_params_of_a_hybrid_batch(core, monkeypatch):
    """The same fields whether megatron-core is importable (its PackedSeqParams) or not (a dict)."""
    megatron_env.import_packed_seq_params(monkeypatch, core)
    lengths = [200, 9, 5, 3, 1, 2, 7, 30]
    samples = [{"input_ids": list(range(1, s + 1))} for s in lengths]
    plan = plan_hybrid_cp(lengths, 8, 32)
    seen = set()
    for r in range(8):
        for b in thdpack.shard(samples, plan=plan, rank=r):
            fake = object()
            if b.shard.cp_size == 1:
                d = packed_seq_params_dict(b)
                assert d["local_cp_size"] == 1 and d["cp_group"] is None
                seen.add(1)
                continue
            where = f"position {r - b.shard.block_start} of the block of {b.shard.cp_size} ranks at {b.shard.block_start}"
            with pytest.raises(ValueError, match=f"{where}: pass that block's process group as cp_group="):
                packed_seq_params_dict(b)
            for given in (fake, {b.shard.cp_size: fake}, lambda group_size: {b.shard.cp_size: fake}[group_size]):
                d = packed_seq_params_dict(b, cp_group=given)
                assert d["local_cp_size"] == b.shard.cp_size and d["cp_group"] is fake
                assert torch.equal(d["cu_seqlens_q_padded"], b.cu_seqlens_padded)  # global, as for static CP
            kw = to_gpt_forward_kwargs(b, cp_group=fake)
            params = kw["packed_seq_params"]
            assert isinstance(params, dict) if core is None else isinstance(params, core.PackedSeqParams)
            assert torch.equal(kw["padding_mask"][0], padding_mask(b)) and megatron_env.field(params, "cp_group") is fake
            assert megatron_env.field(params, "local_cp_size") == b.shard.cp_size
            assert torch.equal(megatron_env.field(params, "cu_seqlens_q_padded"), b.cu_seqlens_padded)
            seen.add(b.shard.cp_size)
    assert {1, 8} <= seen
    static = thdpack.shard(build_thd_batch([samples[1]], cp_size=2), cp_size=2, cp_rank=0)
    assert "local_cp_size" not in packed_seq_params_dict(static)  # static CP unchanged
    with pytest.raises(ValueError, match="cp_group is for a hybrid-CP batch"):
        packed_seq_params_dict(static, cp_group=object())


@pytest.mark.parametrize("site", [megatron_env.site_param(megatron_env.CORE_ID)])
def test_gpt_forward_kwargs_are_gpt_models_parameters(site):
    """Every key of to_gpt_forward_kwargs is a parameter of megatron-core 0.19.2's GPTModel.forward (read
    from its source)."""
    tree = ast.parse((site / "megatron" / "core" / "models" / "gpt" / "gpt_model.py").read_text())
    gpt = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GPTModel")
    forward = next(n for n in gpt.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    params = {a.arg for a in forward.args.args + forward.args.kwonlyargs}
    kw = to_gpt_forward_kwargs(build_thd_batch([{"input_ids": [1, 2, 3]}], pad_multiple=4))
    assert set(kw) <= params, set(kw) - params
    assert kw["padding_mask"].tolist() == [[False, False, False, True]]


def test_padding_mask():
    samples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4]}, {"input_ids": [5, 6, 7, 8, 9]}]
    plain = build_thd_batch(samples)
    assert not padding_mask(plain).any() and padding_mask(plain).dtype == torch.bool
    batch = build_thd_batch(samples, pad_multiple=4, pad_to=20)
    want = [False] * 3 + [True] + [False] + [True] * 3 + [False] * 5 + [True] * 7
    assert padding_mask(batch).tolist() == want
    cp = build_thd_batch(samples, cp_size=2, pad_to=24)
    for rank in range(2):
        shard = thdpack.shard(cp, cp_size=2, cp_rank=rank)
        assert torch.equal(padding_mask(shard), padding_mask(cp)[shard.shard.partition_indices])
        direct = build_thd_batch(samples, cp_size=2, pad_to=24, cp_rank=rank)  # the assembler's own shard
        assert torch.equal(padding_mask(direct), padding_mask(shard))
    uly = thdpack.shard(cp, sp_size=2, sp_rank=1)
    assert torch.equal(padding_mask(uly), padding_mask(cp)[uly.shard.partition_indices])
    tree = build_thd_batch([{"input_ids": list(range(1, 40)), "group": 0}, {"input_ids": list(range(1, 38)) + [9],
                                                                           "group": 0}], share_prefix="group")
    with pytest.raises(ValueError, match="^padding_mask .* cannot express a shared-prefix batch") as info:
        padding_mask(tree)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("pad_multiple", [None, 4])
def test_rank_counts_add_up_and_match_the_static_cp_share(pad_multiple):
    lengths = skewed(50, 7)
    plan = plan_hybrid_cp(lengths, 8, 32, pad_multiple=pad_multiple)
    counts = plan.rank_counts()
    assert counts["num_tokens"].sum() == lengths.sum()
    assert counts["num_padded_tokens"].sum() == plan.padded_lengths.sum()
    assert counts["seqlen_squared_sum"].sum() == int((lengths.astype(np.int64) ** 2).sum())
    # a block's ranks get, sample by sample, the static dual-chunk share at cp = k
    want = np.zeros(8, dtype=np.int64)
    for i in range(plan.num_samples):
        k, start = int(plan.cp_sizes[i]), int(plan.block_starts[i])
        for j in range(k):
            share = (cp_seqlen_squared_share([lengths[i]], [0, plan.padded_lengths[i]], k, j) if k > 1
                     else lengths[i] ** 2)
            want[start + j] += int(share)
    assert counts["seqlen_squared_sum"].tolist() == want.tolist()
    flops = hybrid_cp_rank_flops(QWEN3_8B, plan.lengths, plan.padded_lengths, plan.cp_sizes, plan.block_starts, 8)
    whole = model_flops(QWEN3_8B, int(lengths.sum()), int((lengths.astype(np.int64) ** 2).sum()))
    assert flops.sum() == pytest.approx(whole, rel=1e-12)
    padded = hybrid_cp_rank_flops(QWEN3_8B, plan.lengths, plan.padded_lengths, plan.cp_sizes, plan.block_starts, 8,
                                  padded=True)
    assert (padded >= flops).all() and padded.sum() > flops.sum()


def test_block_arithmetic():
    assert block_sizes(8) == (1, 2, 4, 8) and block_sizes(12) == (1, 2, 4) and block_sizes(1) == (1,)
    assert block_ranks(4, 4) == [4, 5, 6, 7] and block_ranks(2, 2, [0, 2, 4, 6]) == [4, 6]


@pytest.mark.parametrize("args, message", [
    ((3, 0, 8), "^sample 5: cp_size=3 is not a power of two"),
    ((4, 2, 8), "^sample 5: a block of 4 ranks at position 2 is not aligned"),
    ((4, 8, 8), "^sample 5: a block of 4 ranks at position 8 is not aligned"),
    ((8, 0, 12), "^sample 5: cp_size=8 does not divide the 12 data-parallel × CP ranks"),
])
def test_bad_blocks_are_one_line_naming_the_sample(args, message):
    with pytest.raises(ValueError, match=message) as info:
        check_block(*args, what="sample 5")
    assert "\n" not in str(info.value)


def test_refusals_are_one_line_naming_the_sample_and_value():
    cases = [
        (lambda: plan_hybrid_cp([10, 300], 8, 32), SampleError,
         "^sample 1 has 300 tokens: more than the 8 data-parallel"),
        (lambda: HybridCPPlan.from_blocks([10, 20], [1, 3], [0, 0], 8), ValueError,
         "^sample 1: cp_size=3 is not a power"),
        (lambda: HybridCPPlan.from_blocks([10, 20], [1, 2], [0, 1], 8), ValueError,
         "^sample 1: a block of 2 ranks at position 1 is not aligned"),
        (lambda: HybridCPPlan.from_blocks([10, 70], [1, 2], [0, 2], 8, max_tokens_per_rank=32), SampleError,
         "^sample 1 has 70 tokens, padded to 72: 36 per rank at cp_size=2, more than max_tokens_per_rank=32"),
        (lambda: plan_hybrid_cp([], 8, 32), ValueError, "needs at least one sample"),
        (lambda: plan_hybrid_cp([0, 3], 8, 32), SampleError, "^sample 0 is empty"),
        (lambda: hybrid_rank_out_of_range(), ValueError, r"^rank must be an integer in \[0, 8\)"),
        (lambda: hybrid_wrong_layout(), ValueError, "^sample 0 has 40 tokens padded to 48 here, 40 padded to 40"),
        (lambda: thdpack.shard([{"input_ids": [1, 2]}], plan=plan_hybrid_cp([2], 2, 4), rank=0, cp_size=2), TypeError,
         "takes no cp_size="),
        (lambda: hybrid_shard_resharded(), ValueError, "is a hybrid-CP batch"),
    ]
    for call, kind, message in cases:
        with pytest.raises(kind, match=message) as info:
            call()
        assert "\n" not in str(info.value), str(info.value)


def hybrid_rank_out_of_range():
    thdpack.shard([{"input_ids": [1]}], plan=plan_hybrid_cp([1], 8, 4), rank=8)


def hybrid_wrong_layout():
    plan = plan_hybrid_cp([40, 1, 1, 1], 4, 64, cost=(0, 1))
    thdpack.shard([{"input_ids": list(range(1, 41))}] + [{"input_ids": [1]}] * 3, plan=plan, rank=0, pad_multiple=16)


def hybrid_shard_resharded():
    (batch,) = thdpack.shard([{"input_ids": [1, 2, 3]}], plan=plan_hybrid_cp([3], 1, 4), rank=0)
    thdpack.shard(batch, cp_size=2, cp_rank=0)


def test_rebalance_hybrid_cp_on_thread_ranks():
    """rebalance_hybrid_cp: each rank's run-time samples gathered, planned, sent to every rank of their block
    (ranks as threads: tests/test_rebalance.py's ThreadComm); groups stay on one block; a rank's bad sample is
    every rank's one-line error naming that rank and its local sample."""
    from test_rebalance import run_threads

    from thdpack.loaders.hybrid_rebalance import HybridCP, rebalance_hybrid_cp

    rng = np.random.default_rng(3)
    world = 4
    local = [[{"input_ids": torch.randint(1, 50, (int(s),)), "labels": torch.randint(1, 50, (int(s),))}
              for s in rng.integers(1, 40, 5 + r)] for r in range(world)]
    local[1].append({"input_ids": torch.randint(1, 50, (110,))})  # needs all 4 ranks
    groups = [np.arange(len(x)) // 2 for x in local]
    out = run_threads(world, lambda comm: rebalance_hybrid_cp(local[comm.rank], HybridCP(32), group=comm,
                                                             groups=groups[comm.rank], pad_multiple=2))
    for got in out:
        if isinstance(got, Exception):
            raise got
    plan, offsets = out[0][1], out[0][2]
    everything = [s for x in local for s in x]
    assert offsets.tolist() == np.cumsum([0] + [len(x) for x in local]).tolist()
    for r, (batches, _, _) in enumerate(out):
        want = thdpack.shard(everything, plan=plan, rank=r, pad_multiple=2)
        assert [b.sample_index.tolist() for b in batches] == [b.sample_index.tolist() for b in want]
        for a, b in zip(batches, want):
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    for r in range(world):  # a rank's group: one block
        for g in np.unique(groups[r]):
            ids = offsets[r] + np.flatnonzero(groups[r] == g)
            assert len({(int(plan.cp_sizes[i]), int(plan.block_starts[i])) for i in ids}) == 1
    assert plan.cp_sizes[offsets[1] + len(local[1]) - 1] == 4
    bad = [list(x) for x in local]
    bad[2][3] = {"input_ids": torch.randint(1, 50, (300,))}
    errors = run_threads(world, lambda comm: rebalance_hybrid_cp(bad[comm.rank], 32, group=comm))
    for e in errors:
        assert isinstance(e, SampleError) and str(e).startswith("sample 3 has 300 tokens")
        assert "(local sample of rank 2)" in str(e)
        assert "\n" not in str(e)


def test_the_worked_example_of_docs_megatron_md():
    import json
    from pathlib import Path

    from thdpack import CostModel

    config = json.loads((Path(__file__).resolve().parents[1] / "configs" / "models" / "qwen3-8b.json").read_text())
    lengths = [65536, 24576, 12288, 9216, 6144, 4096, 4096, 3072, 3072, 2048, 2048, 2048, 1024, 1024, 1024, 1024]
    plan = plan_hybrid_cp(lengths, 8, 16384, cost=CostModel.from_config(config))
    assert plan.sample_id_groups() == [[[0, 3, 12], [0, 4, 5], [0, 2, 6], [0, 2, 7, 13],
                                        [0, 1, 8], [0, 1, 9, 14], [0, 1, 10, 15], [0, 1, 11]]]
    assert plan.cp_sizes[:3].tolist() == [8, 4, 2] and plan.block_starts[:3].tolist() == [0, 4, 2]
    assert round(plan.straggler, 3) == 1.014


def test_rebalance_with_hybrid_cp_is_the_hybrid_plan():
    """``thdpack.rebalance(..., hybrid_cp=...)`` (the run-time entry point users already call) plans the step under
    hybrid CP: the same batches and plan as ``rebalance_hybrid_cp``; ``micro_batches`` other than 1 is refused."""
    from test_rebalance import run_threads

    from thdpack import rebalance
    from thdpack.loaders.hybrid_rebalance import HybridCP, rebalance_hybrid_cp

    rng = np.random.default_rng(5)
    world = 4
    local = [[{"input_ids": torch.randint(1, 50, (int(s),))} for s in rng.integers(1, 40, 4 + r)] for r in range(world)]
    for hybrid in (True, HybridCP(32)):
        got = run_threads(world, lambda comm: rebalance(local[comm.rank], 32, group=comm, hybrid_cp=hybrid))
        want = run_threads(world, lambda comm: rebalance_hybrid_cp(local[comm.rank], 32, group=comm))
        for (gb, gp, go), (wb, wp, wo) in zip(got, want):
            assert np.array_equal(gp.cp_sizes, wp.cp_sizes) and np.array_equal(go, wo)
            assert [b.sample_index.tolist() for b in gb] == [b.sample_index.tolist() for b in wb]
            assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(gb, wb))
    with pytest.raises(ValueError, match="micro_batches must be 1, got 2"):
        rebalance(local[0], 32, hybrid_cp=True, micro_batches=2)
