"""Hybrid (per-sample) context parallelism and MoE padding masks, checked with megatron-core 0.19.2's own code on
8 gloo processes (issue 33).

One subprocess (this file as its runner, megatron-core's wheel importable: tests/megatron_env.py) imports
megatron-core once and forks 8 gloo ranks, which run two layouts of the same processes:

- ``tp1``: tensor parallelism 1, context parallelism 2: 8 data-parallel × CP ranks;
- ``tp2``: tensor parallelism 2, context parallelism 2: two data-parallel × CP groups of 4 ranks
  (``[0, 2, 4, 6]``, ``[1, 3, 5, 7]``), each TP pair holding the same data; the plan pads for sequence
  parallelism (``tp_size=2, sequence_parallel=True``).

For each, megatron-core's ``parallel_state.initialize_model_parallel(hybrid_context_parallel=True)`` makes its
groups, and every rank builds its micro-batches of thdpack's plan of the same global batch
(:func:`thdpack.plan_hybrid_cp`, ``thdpack.shard(samples, plan=, rank=)``) and checks them against megatron-core:

1. the block of every micro-batch is the group ``get_hybrid_data_context_parallel_groups(group_size=k)``
   returns (and thdpack's own ``hybrid_cp_groups`` makes the same groups);
2. for every sample, the rank's tokens, labels, positions and padding mask are what
   ``get_batch_on_this_cp_rank(batch, is_hybrid_cp=True, hybrid_cp_group_func=...)`` gives for that sample's
   micro-batch (megatron-core runs one sample per micro-batch and splits it into ``2k`` chunks);
3. ``to_packed_seq_params(cp_group=...)`` is megatron-core's ``PackedSeqParams`` with ``local_cp_size = k`` and
   the block's group;
4. an all-gather attention over each block (every rank gathers the block's K/V, as TransformerEngine's
   ``cp_comm_type="all_gather"`` does) gives each sample's logits alone, token by token;
5. rank 0 runs megatron-core's ``BalancedCPScheduler(max_seq_len_per_rank, dp_cp_group)
   .get_groups_and_subsamples`` on the same lengths (the test compares the two schedules' stragglers);
6. (``tp1``) MoE: router logits of the rank's shard through megatron-core's ``z_loss_func``,
   ``compute_routing_scores_for_aux_loss``, ``get_tokens_per_expert_and_token_count`` (all-reduced over the
   block group) and ``switch_load_balancing_loss_func``, with ``padding_mask=padding_mask(shard)`` and on the
   same rows without the pad slots.

The test process compares: every token of the global batch runs exactly once, the attention logits equal each
sample alone, the MoE values with the mask equal those without pad rows (and differ without the mask).

What is replaced in the subprocess, and why: the ``__init__`` of ``megatron.core`` (it imports the model zoo)
and of ``megatron.core.pipeline_parallel`` (its ``schedules`` import Triton kernels); the modules below them
(``parallel_state``, ``utils``, ``pipeline_parallel.hybrid_cp_schedule``, ``transformer.moe.moe_utils``,
``packed_seq_params``) load unchanged on Python 3.11 and the CPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import megatron_env  # tests/megatron_env.py
from thdpack.batching import padding_mask

pytestmark = pytest.mark.xdist_group("megatron_hybrid_cp")
ROOT = Path(__file__).resolve().parent.parent
WORLD = 8
VOCAB, EXPERTS, TOPK = 64, 8, 2
LAYOUTS = {
    # name: (tp, lengths of the global batch, max_tokens_per_rank, plan keywords)
    "tp1": (1, [200, 90, 64, 40, 33, 20, 17, 12, 9, 7, 5, 3, 2, 1, 25, 30, 11, 6, 48, 15],
            32, {"pad_multiple": 4}),
    "tp2": (2, [120, 70, 45, 33, 20, 9, 5, 3, 1, 26, 14], 32, {"tp_size": 2, "sequence_parallel": True}),
}


def samples_of(lengths) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": torch.randint(1, VOCAB, (s,), generator=g)} for s in lengths]


def plan_of(name: str):
    from thdpack import plan_hybrid_cp

    tp, lengths, budget, keywords = LAYOUTS[name]
    world = WORLD // tp
    return plan_hybrid_cp(lengths, world, budget, cost=(0, 1), **keywords)


# --------------------------------------------------------------------------- the subprocess


def _stub_packages() -> None:
    import types

    import megatron  # a namespace package: its directory on PYTHONPATH

    root = Path(list(megatron.__path__)[0]).parent
    for name in ("megatron.core", "megatron.core.pipeline_parallel"):
        module = types.ModuleType(name)
        module.__path__ = [str(root / name.replace(".", "/"))]
        sys.modules[name] = module


def _megatron_batch(sample_batch, k: int) -> dict:
    """What megatron-core's ``get_batch`` holds for a micro-batch of one sample under hybrid CP: ``[1, P]``
    tensors of the sample padded for its ``k``, its ``cu_seqlens``, and ``local_cp_size``."""
    b = sample_batch
    return {"tokens": b.input_ids[None].clone(), "labels": b.labels[None].clone(),
            "loss_mask": b.loss_mask[None].float(),
            "position_ids": b.position_ids[None].clone(), "padding_mask": padding_mask(b)[None].clone(),
            "attention_mask": None, "cu_seqlens": b.cu_seqlens[None].clone(),
            "cu_seqlens_padded": b.cu_seqlens_padded[None].clone(), "max_seqlen": torch.tensor([[b.max_seqlen]]),
            "local_cp_size": torch.tensor(k, dtype=torch.int32)}


def _check_against_get_batch(shard, samples, k: int, keywords: dict) -> list[dict]:
    """Per sample of the micro-batch: its slots of the shard against ``get_batch_on_this_cp_rank``."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from thdpack import build_thd_batch

    out = []
    local = shard.shard.local_cu_seqlens_padded if shard.is_shard else shard.cu_seqlens_padded
    for n, i in enumerate(shard.sample_index.tolist()):
        alone = build_thd_batch([samples[i]], cp_size=k, **keywords)
        got = get_batch_on_this_cp_rank(_megatron_batch(alone, k), is_hybrid_cp=True,
                                        hybrid_cp_group_func=ps.get_hybrid_data_context_parallel_groups)
        a, b = int(local[n]), int(local[n + 1])
        mine = {"tokens": shard.input_ids, "labels": shard.labels, "position_ids": shard.position_ids,
                "padding_mask": padding_mask(shard)}
        slots = (shard.shard.partition_indices[a:b] - int(shard.cu_seqlens_padded[n])) if shard.is_shard else \
            torch.arange(b - a)
        out.append({"sample": i, "slots": slots.tolist(),
                    "equal": {key: bool(torch.equal(got[key][0], value[a:b])) for key, value in mine.items()}})
    return out


def _all_gather_attention(shard, group) -> dict:
    """Logits of this rank's real tokens of each sample, from an all-gather attention over the block:
    every rank's K/V gathered and put back at their stream positions, local queries against them (causal
    within each sample, real keys only). ``{sample: (in-sample positions, logits rows)}``."""
    import torch.distributed as dist

    import test_ring_attention as ring  # the ring test's tiny model: weights, RoPE, q/k/v, alone

    w = ring.weights()
    q, key, value = ring.qkv(w, shard.input_ids, shard.position_ids)
    k = shard.shard.cp_size
    parts = [torch.empty_like(torch.cat([key, value], -1)) for _ in range(k)]
    dist.all_gather(parts, torch.cat([key, value], -1).contiguous(), group=group)
    index = [torch.empty_like(shard.shard.partition_indices) for _ in range(k)]
    dist.all_gather(index, shard.shard.partition_indices.contiguous(), group=group)
    total = int(shard.cu_seqlens_padded[-1])
    kv = torch.zeros(total, *parts[0].shape[1:], dtype=parts[0].dtype)
    for part, at in zip(parts, index):
        kv[at] = part
    cu = shard.cu_seqlens_padded.long()
    doc_k = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu[1:] - cu[:-1])
    pos_k = torch.arange(total) - cu[:-1][doc_k]
    real_k = pos_k < shard.seq_lens.long()[doc_k]
    doc_q, pos_q = doc_k[shard.shard.partition_indices], pos_k[shard.shard.partition_indices]
    allowed = (doc_q[:, None] == doc_k[None]) & (pos_k[None] <= pos_q[:, None]) & real_k[None]
    out, _ = ring.block_attention(q, kv[..., :ring.DIM], kv[..., ring.DIM:], allowed)
    logits = out.reshape(-1, ring.HEADS * ring.DIM) @ w["head"]
    real_q = ~padding_mask(shard)
    result = {}
    for n, i in enumerate(shard.sample_index.tolist()):
        rows = (doc_q == n) & real_q
        result[i] = (pos_q[rows].tolist(), logits[rows].tolist())
    return result


def _moe_values(shard, group, samples) -> dict:
    """megatron-core's router functions on this rank's router logits, with ``padding_mask`` and on the rows
    without pad slots; with a block group (k > 1), the token counts and aux loss over the block, and both for
    the whole micro-batch's real tokens in this process alone (``*_alone``)."""
    from megatron.core.transformer.moe.moe_utils import (compute_routing_scores_for_aux_loss,
                                                         get_tokens_per_expert_and_token_count,
                                                         switch_load_balancing_loss_func, z_loss_func)

    table = torch.randn(VOCAB, EXPERTS, generator=torch.Generator().manual_seed(3))
    logits = table[shard.input_ids]  # pad slots hold the pad token: logits like any token's
    pad = padding_mask(shard)
    real = logits[~pad]
    out = {"z_masked": float(z_loss_func(logits, 1.0, padding_mask=pad)), "z_real": float(z_loss_func(real, 1.0)),
           "z_unmasked": float(z_loss_func(logits, 1.0)), "num_pad": int(pad.sum())}
    routing, scores = compute_routing_scores_for_aux_loss(logits, TOPK, "softmax", padding_mask=pad)
    routing_real, scores_real = compute_routing_scores_for_aux_loss(real, TOPK, "softmax")
    out["scores_equal"] = bool(torch.equal(scores[~pad], scores_real) and not scores[pad].any())
    out["routing_equal"] = bool(torch.equal(routing[~pad], routing_real) and not routing[pad].any())
    if group is not None:
        per_expert, local, total = get_tokens_per_expert_and_token_count(routing, group, TOPK, with_padding_mask=True)
        aux = switch_load_balancing_loss_func(scores, per_expert, total, TOPK, EXPERTS, 1.0)
        unmasked = compute_routing_scores_for_aux_loss(logits, TOPK, "softmax")
        per_expert_u, _, total_u = get_tokens_per_expert_and_token_count(unmasked[0], group, TOPK)
        out.update(tokens_per_expert=per_expert.tolist(), local_tokens=float(local), total_tokens=float(total),
                   aux=float(aux), total_tokens_unmasked=float(total_u),
                   tokens_per_expert_unmasked=per_expert_u.tolist())
        whole = table[torch.cat([torch.as_tensor(samples[i]["input_ids"]) for i in shard.sample_index.tolist()])]
        routing_w, scores_w = compute_routing_scores_for_aux_loss(whole, TOPK, "softmax")
        per_expert_w = routing_w.sum(0)
        out.update(tokens_per_expert_alone=per_expert_w.tolist(), total_tokens_alone=whole.shape[0],
                   aux_alone=float(switch_load_balancing_loss_func(scores_w, per_expert_w, whole.shape[0], TOPK,
                                                                   EXPERTS, 1.0)))
    return out


def _layout_results(name: str, rank: int) -> dict:
    """One layout on this rank: megatron-core's groups, thdpack's micro-batches checked against them."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    import thdpack
    from thdpack.integrations import to_packed_seq_params
    from thdpack.parallel.hybrid_blocks import hybrid_cp_groups

    tp, lengths, budget, keywords = LAYOUTS[name]
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=2, hybrid_context_parallel=True,
                                 create_gloo_process_groups=False)
    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    ranks, pos = dist.get_process_group_ranks(dp_cp), dist.get_rank(dp_cp)
    every = [None] * WORLD
    dist.all_gather_object(every, ranks)
    ours = hybrid_cp_groups(sorted({tuple(r) for r in every}))  # thdpack's groups: a collective over all ranks
    plan, samples = plan_of(name), samples_of(lengths)
    out = {"rank": rank, "pos": pos, "ranks": ranks, "tp_rank": ps.get_tensor_model_parallel_rank(),
           "ours": {k: dist.get_process_group_ranks(g) for k, g in ours.items()}, "micro_batches": []}
    if rank == 0:
        scheduler = BalancedCPScheduler(max_seq_len_per_rank=budget, dp_cp_group=dp_cp)
        out["megatron_schedule"] = scheduler.get_groups_and_subsamples(list(enumerate(lengths)), None)[1]
    for shard in thdpack.shard(samples, plan=plan, rank=pos, **keywords):
        k = shard.shard.cp_size
        group = ps.get_hybrid_data_context_parallel_groups(group_size=k) if k > 1 else None
        params = to_packed_seq_params(shard, cp_group=ps.get_hybrid_data_context_parallel_groups)
        mb = {"k": k, "start": shard.shard.block_start, "cp_rank": shard.shard.cp_rank,
              "megatron_group": dist.get_process_group_ranks(group) if group is not None else [rank],
              "params": {"type": type(params).__name__, "is_packed_seq_params": isinstance(params, PackedSeqParams),
                         "local_cp_size": params.local_cp_size,
                         "cp_group": None if params.cp_group is None else dist.get_process_group_ranks(params.cp_group),
                         "seq_idx_len": int(params.seq_idx.shape[-1])},
              "samples": _check_against_get_batch(shard, samples, k, keywords)}
        if k > 1:
            mb["attention"] = _all_gather_attention(shard, group)
            ours_params = to_packed_seq_params(shard, cp_group=ours)
            mb["ours_cp_group"] = dist.get_process_group_ranks(ours_params.cp_group)
        if name == "tp1":
            mb["moe"] = _moe_values(shard, group, samples)
        out["micro_batches"].append(mb)
    if name == "tp1":  # run-time samples: each rank holds every 8th, rebalance_hybrid_cp plans and moves them
        from thdpack.loaders.hybrid_rebalance import rebalance_hybrid_cp

        local = samples[pos::plan.world_size]
        batches, moved, offsets = rebalance_hybrid_cp(local, budget, group=dp_cp, cost=(0, 1), **keywords)
        order = [s for r in range(plan.world_size) for s in samples[r::plan.world_size]]  # global ids' order
        want = thdpack.shard(order, plan=moved, rank=pos, **keywords)
        out["rebalance"] = {"equal": len(batches) == len(want) and all(
            torch.equal(a.input_ids, b.input_ids) and torch.equal(a.sample_index, b.sample_index)
            and torch.equal(a.labels, b.labels) for a, b in zip(batches, want)),
            "same_plan": bool(np.array_equal(np.sort(moved.lengths), np.sort(plan.lengths))),
            "offsets": offsets.tolist()}
    dist.barrier()
    ps.destroy_model_parallel()
    return out


def _rank_main(rank: int, store: str, queue) -> None:
    """One of the 8 forked gloo ranks: megatron-core is already imported."""
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
        queue.put((rank, {name: _layout_results(name, rank) for name in LAYOUTS}, None))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # reported, not hung on
        import traceback

        queue.put((rank, None, traceback.format_exc()))


def _main() -> None:
    import multiprocessing
    import shutil
    import tempfile

    sys.path.insert(0, str(ROOT))
    _stub_packages()
    import megatron.core.parallel_state  # noqa: F401  imported once, before the fork
    import megatron.core.pipeline_parallel.hybrid_cp_schedule  # noqa: F401
    import megatron.core.transformer.moe.moe_utils  # noqa: F401
    import megatron.core.utils  # noqa: F401

    import thdpack  # noqa: F401  imported once, before the fork

    json.loads(sys.stdin.read())
    store_dir = Path(tempfile.mkdtemp(prefix="thdpack_hybrid_cp_"))
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, str(store_dir / "store"), queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        results = sorted((queue.get(timeout=240) for _ in procs), key=lambda r: r[0])
    finally:
        for p in procs:
            p.join(timeout=30)
        shutil.rmtree(store_dir, ignore_errors=True)
    errors = [r[2] for r in results if r[2]]
    print(json.dumps({"error": "\n".join(errors)} if errors else {"ranks": [r[1] for r in results]}))


# --------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def ranks():
    """Every rank's results of both layouts: one subprocess, 8 forked gloo ranks."""
    site = megatron_env.bridge_site()
    if isinstance(site, str):
        pytest.skip(f"megatron-core 0.19.2 is not available here ({site}): its hybrid-CP code is what is checked")
    mp = pytest.MonkeyPatch()
    mp.setattr(megatron_env, "RUNNER", Path(__file__))
    try:
        got = megatron_env.run(site, [], timeout=300)
    finally:
        mp.undo()
    if "error" in got:
        pytest.fail(f"a gloo rank failed:\n{got['error'][-4000:]}")
    return got["ranks"]


def _per_layout(ranks, name):
    return [r[name] for r in ranks]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_blocks_are_megatrons_hybrid_groups(ranks, name):
    plan = plan_of(name)
    for r in _per_layout(ranks, name):
        assert len(r["ranks"]) == plan.world_size
        mine = plan.rank_micro_batches(r["pos"])
        assert len(r["micro_batches"]) == len(mine) >= 1  # every rank runs something
        for mb, j in zip(r["micro_batches"], mine):
            k, start = plan.micro_batch_block(j)
            block = r["ranks"][start:start + k]
            assert (mb["k"], mb["start"], mb["cp_rank"]) == (k, start, r["pos"] - start if k > 1 else 0)
            assert mb["megatron_group"] == (block if k > 1 else [r["rank"]])
            if k > 1:
                assert mb["ours_cp_group"] == block and r["ours"][str(k)] == block


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_shards_equal_get_batch_on_this_cp_rank(ranks, name):
    checked = 0
    for r in _per_layout(ranks, name):
        for mb in r["micro_batches"]:
            for s in mb["samples"]:
                assert all(s["equal"].values()), (r["rank"], mb["k"], s)
                checked += 1
    assert checked >= len(LAYOUTS[name][1])


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_token_runs_exactly_once(ranks, name):
    plan = plan_of(name)
    seen = {i: [] for i in range(plan.num_samples)}
    for r in _per_layout(ranks, name):
        if r["tp_rank"]:
            continue  # a TP peer holds the same slots
        for mb in r["micro_batches"]:
            for s in mb["samples"]:
                seen[s["sample"]] += s["slots"]
    for i, slots in seen.items():
        assert sorted(slots) == list(range(int(plan.padded_lengths[i]))), i


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_packed_seq_params_carries_the_block(ranks, name):
    for r in _per_layout(ranks, name):
        for mb in r["micro_batches"]:
            p = mb["params"]
            assert p["is_packed_seq_params"] and p["local_cp_size"] == mb["k"]
            assert p["cp_group"] == (mb["megatron_group"] if mb["k"] > 1 else None)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_all_gather_attention_over_a_block_equals_each_sample_alone(ranks, name):
    import test_ring_attention as ring

    samples = samples_of(LAYOUTS[name][1])
    w = ring.weights()
    got: dict[int, dict[int, list]] = {}
    for r in _per_layout(ranks, name):
        for mb in r["micro_batches"]:
            for i, (positions, rows) in mb.get("attention", {}).items():
                for p, row in zip(positions, rows):
                    got.setdefault(int(i), {})[p] = row
    assert got, "no sample ran on a block of more than one rank"
    for i, rows in got.items():
        ids = samples[i]["input_ids"]
        want, _ = ring.alone(w, ids)
        assert sorted(rows) == list(range(ids.numel()))  # every real token, once
        torch.testing.assert_close(torch.tensor([rows[p] for p in range(ids.numel())], dtype=torch.float64), want,
                                   rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_plan_is_no_worse_than_balanced_cp_scheduler(ranks, name):
    from thdpack.planning.hybrid_cp import schedule_cost

    lengths = LAYOUTS[name][1]
    megatron = next(r[name]["megatron_schedule"] for r in ranks if r[name]["rank"] == 0)
    theirs, ours = schedule_cost(megatron, lengths), schedule_cost(plan_of(name).sample_id_groups(), lengths)
    seen = sorted(i for group in megatron for ids in group for i in ids)
    assert set(seen) == set(range(len(lengths)))  # megatron's schedule runs every sample
    assert ours["mean"] == pytest.approx(theirs["mean"])  # the same work, dealt differently
    print(f"{name}: BalancedCPScheduler straggler {theirs['straggler']:.4f} ({theirs['groups']} groups, "
          f"{theirs['cp_tokens']} CP tokens), thdpack {ours['straggler']:.4f} ({ours['cp_tokens']} CP tokens)")
    assert ours["step"] <= theirs["step"] * (1 + 1e-9)
    assert ours["cp_tokens"] <= theirs["cp_tokens"]  # not bought by splitting more samples over more ranks


def test_rebalance_hybrid_cp_moves_each_sample_to_its_block(ranks):
    """Run-time samples (each rank holds every 8th): one gather, one all-to-all over the gloo data-parallel × CP
    group, and every rank's micro-batches are those of the whole batch under the same plan."""
    for r in _per_layout(ranks, "tp1"):
        assert r["rebalance"]["equal"] and r["rebalance"]["same_plan"], r["rank"]
        assert r["rebalance"]["offsets"][-1] == len(LAYOUTS["tp1"][1])


def test_moe_padding_mask_keeps_pad_slots_out(ranks):
    """With ``padding_mask=padding_mask(shard)`` megatron-core's z loss, aux-loss scores and routing are those of
    the same rows without pad slots, and the token counts all-reduced over a block those of the micro-batch's
    real tokens alone; without the mask, the pad slots count."""
    padded_seen = blocks_seen = 0
    for r in _per_layout(ranks, "tp1"):
        for mb in r["micro_batches"]:
            m = mb["moe"]
            assert m["scores_equal"] and m["routing_equal"]
            assert m["z_masked"] == pytest.approx(m["z_real"], rel=1e-6)
            if m["num_pad"]:
                padded_seen += 1
                assert m["z_unmasked"] != pytest.approx(m["z_real"], rel=1e-6)
            if "tokens_per_expert" not in m:
                continue
            blocks_seen += 1
            assert m["tokens_per_expert"] == m["tokens_per_expert_alone"]
            assert m["total_tokens"] == m["total_tokens_alone"]
            if m["num_pad"]:
                assert m["total_tokens_unmasked"] > m["total_tokens_alone"]
    assert padded_seen and blocks_seen


def test_moe_aux_loss_over_a_block_is_the_unpadded_micro_batchs(ranks):
    """The aux loss adds up over a block's ranks (each its own probabilities, the block's token counts): with
    the mask their sum is megatron-core's ``switch_load_balancing_loss_func`` on the micro-batch's real tokens
    in one process."""
    blocks: dict[tuple, list] = {}
    for r in _per_layout(ranks, "tp1"):
        for mb in r["micro_batches"]:
            if "aux" in mb["moe"]:
                key = (mb["k"], mb["start"], tuple(s["sample"] for s in mb["samples"]))
                blocks.setdefault(key, []).append(mb["moe"])
    assert blocks
    for (k, _, _), values in blocks.items():
        assert len(values) == k
        assert sum(v["aux"] for v in values) == pytest.approx(values[0]["aux_alone"], rel=1e-5)


if __name__ == "__main__":
    _main()
