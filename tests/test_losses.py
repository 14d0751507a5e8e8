"""thdpack.losses: reductions on packed batches equal the unpacked per-sample computation,
in value and in *gradient*, across micro-batches (gradient accumulation) and simulated
data-parallel ranks, with the step's normaliser known before the step from the sampler.

The reference side never uses thdpack: each sample is run alone through a tiny random
Qwen3 in float64 (HF shift: position t scores token t+1), its target log-probs are
``log_softmax(...).gather``, and the reductions are written out by hand.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import hypothesis  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import thdpack  # noqa: E402
from thdpack import TokenBudgetBatchSampler, build_thd_batch, plan_packs  # noqa: E402
from thdpack.demo.models import TINY_TEXT  # noqa: E402
from thdpack.losses import (  # noqa: E402
    all_reduce_items,
    count_items,
    dpo_loss,
    group_advantages,
    pair_groups,
    policy_gradient_loss,
    packed_loss,
    sample_target_counts,
    sequence_logps,
    token_logps,
)
from thdpack.integrations import to_hf_kwargs

IGNORE = -100
VOCAB = 64
PACK = 48
REL_TOL = 1e-10


@functools.lru_cache(maxsize=None)
def tiny_model(seed: int = 7) -> torch.nn.Module:
    """A 2-layer random Qwen3 in float64 (initializer 0.2: O(1) logits, far from uniform attention)."""
    config = transformers.Qwen3Config(vocab_size=VOCAB, **TINY_TEXT, max_position_embeddings=256,
                                      initializer_range=0.2, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(config).to(torch.float64).eval()


def make_rows(lengths, prompts, seed: int) -> list[dict]:
    """Rows with random tokens whose first ``prompts[i]`` labels are masked (-100)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for s, p in zip(lengths, prompts):
        ids = torch.randint(1, VOCAB, (s,), generator=g)
        labels = ids.clone()
        labels[: min(p, s)] = IGNORE
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def row_targets(rows) -> np.ndarray:
    """Targets per row, counted as a user would: labels after the first position that are not -100."""
    return np.array([int((r["labels"][1:] != IGNORE).sum()) for r in rows], np.int64)


# --------------------------------------------------------------------------- reference (no thdpack)


def alone_logps(model, row) -> torch.Tensor:
    """``[k]`` log-probs of the row's targets, the row run alone (batch axis 1, no packing)."""
    logits = model(input_ids=row["input_ids"][None], use_cache=False).logits[0, :-1]
    targets = row["labels"][1:]
    keep = targets != IGNORE
    return torch.log_softmax(logits, -1)[keep].gather(1, targets[keep][:, None]).squeeze(1)


def reference_loss(model, rows, reduction: str) -> torch.Tensor:
    """The unpacked loss over ``rows`` as one big batch: token-mean, or mean of per-sample token-means."""
    per_row = [alone_logps(model, r) for r in rows]
    if reduction == "token":
        return -torch.cat(per_row).sum() / sum(p.numel() for p in per_row)
    means = [-p.mean() for p in per_row if p.numel()]
    return torch.stack(means).sum() / len(means)


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# --------------------------------------------------------------------------- token_logps


@pytest.mark.parametrize("chunk", [1, 5, 64, 10_000])
def test_token_logps_matches_log_softmax_gather(chunk):
    g = torch.Generator().manual_seed(0)
    rows = make_rows([7, 3, 12], [2, 0, 5], seed=1)
    batch = build_thd_batch(rows, pad_multiple=4)
    logits = torch.randn(batch.num_padded_tokens, VOCAB, generator=g, dtype=torch.float64, requires_grad=True)
    got = token_logps(logits, batch, chunk_size=chunk)
    naive = torch.log_softmax(logits, -1).gather(1, batch.labels.clamp_min(0)[:, None]).squeeze(1)
    want = torch.where(batch.loss_mask, naive, 0.0)
    assert got.shape == (batch.num_padded_tokens,) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    w = torch.randn(batch.num_padded_tokens, generator=g, dtype=torch.float64)  # any upstream gradient
    (g1,) = torch.autograd.grad((got * w).sum(), logits)
    (g2,) = torch.autograd.grad((want * w).sum(), logits)
    torch.testing.assert_close(g1, g2, rtol=0, atol=1e-12)
    assert int((got != 0).sum()) == batch.num_targets


def test_token_logps_bf16_logits_are_upcast():
    rows = make_rows([9, 6], [0, 0], seed=2)
    batch = build_thd_batch(rows)
    logits = torch.randn(batch.num_padded_tokens, VOCAB).to(torch.bfloat16)
    got = token_logps(logits, batch, chunk_size=4)
    assert got.dtype == torch.float32
    want = torch.log_softmax(logits.float(), -1).gather(1, batch.labels.clamp_min(0)[:, None]).squeeze(1)
    torch.testing.assert_close(got[batch.loss_mask], want[batch.loss_mask], rtol=0, atol=1e-5)


def test_sequence_logps_sums_each_sample_alone():
    model = tiny_model()
    rows = make_rows([5, 11, 2, 8], [1, 4, 0, 8], seed=3)  # the last row has no target
    batch = build_thd_batch(rows, pad_multiple=8)
    with torch.no_grad():
        logits = model(**to_hf_kwargs(batch, include_labels=False), use_cache=False).logits
        logps, counts = sequence_logps(logits, batch, chunk_size=7)
        want = torch.stack([alone_logps(model, r).sum() for r in rows])
    assert counts.tolist() == row_targets(rows).tolist() == [4, 7, 1, 0]
    torch.testing.assert_close(logps, want, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- gradient equivalence


def packed_step_grad(model, rows, lengths, reduction, R, M, step, seed):
    """The gradient of optimizer step ``step`` run packed: R simulated ranks (their gradients
    summed, an all-reduce), each accumulating its M micro-batches, every loss normalised by
    the step's global count from the sampler. Returns ``(grad, rows of the step)``."""
    samplers = [TokenBudgetBatchSampler(lengths, PACK, num_replicas=R, rank=r, micro_batches=M, seed=seed)
                for r in range(R)]
    items = samplers[0].step_items(step, row_targets(rows))
    for other in (s.step_items(step, row_targets(rows)) for s in samplers[1:]):  # every rank knows the same totals
        assert (other.targets, other.samples) == (items.targets, items.samples)
    model.zero_grad()
    step_rows, batches = [], []
    for r, sampler in enumerate(samplers):
        packs = list(sampler)[step * M : (step + 1) * M]
        rank_batches = [build_thd_batch([rows[i] for i in pack], sample_index=pack) for pack in packs]
        # the normaliser known before the step agrees with the batches the step then builds
        assert count_items(rank_batches, "token") == items.rank_targets[r]
        assert count_items(rank_batches, "sample") == items.rank_samples[r]
        batches += rank_batches
        step_rows += [rows[i] for pack in packs for i in pack]
    num_items = all_reduce_items(items.num_items(reduction))  # no process group: the count itself
    if num_items == 0:
        return None, step_rows  # nothing to train in this step: a real loop skips it
    for batch in batches:
        logits = model(**to_hf_kwargs(batch, include_labels=False), use_cache=False).logits
        packed_loss(logits, batch, reduction, num_items).backward()
    return grads(model).clone(), step_rows


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    lengths=st.lists(st.integers(2, 30), min_size=2, max_size=12),
    R=st.integers(1, 3),
    M=st.integers(1, 3),
    reduction=st.sampled_from(["token", "sample"]),
    seed=st.integers(0, 3),
)
def test_packed_step_gradient_equals_unpacked(data, lengths, R, M, reduction, seed):
    prompts = data.draw(st.lists(st.integers(0, 30), min_size=len(lengths), max_size=len(lengths)))
    rows = make_rows(lengths, prompts, seed)
    if row_targets(rows).sum() == 0:
        rows[0]["labels"] = rows[0]["input_ids"].clone()
    model = tiny_model()
    steps = TokenBudgetBatchSampler(lengths, PACK, num_replicas=R, rank=0, micro_batches=M, seed=seed).num_optimizer_steps
    step = data.draw(st.integers(0, steps - 1))
    got, step_rows = packed_step_grad(model, rows, lengths, reduction, R, M, step, seed)
    if got is None:
        assert row_targets(step_rows).sum() == 0
        return
    model.zero_grad()
    reference_loss(model, step_rows, reduction).backward()
    want = grads(model)
    assert rel_err(got, want) < REL_TOL, (reduction, R, M, rel_err(got, want))


def test_batch_mean_is_not_the_step_mean():
    """Why num_items matters: averaging each micro-batch's own mean is not the step's mean
    (this is the ~3x loss / wrong gradient users see); the test above would catch it."""
    model = tiny_model()
    rows = make_rows([30, 3, 4, 28], [0, 0, 0, 20], seed=5)
    b1, b2 = build_thd_batch(rows[:2]), build_thd_batch(rows[2:])
    model.zero_grad()
    for b in (b1, b2):
        logits = model(**to_hf_kwargs(b, include_labels=False), use_cache=False).logits
        (packed_loss(logits, b, "token") / 2).backward()
    naive = grads(model).clone()
    model.zero_grad()
    reference_loss(model, rows, "token").backward()
    assert rel_err(naive, grads(model)) > 1e-3


@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_cp_shards_sum_to_the_whole_batch_loss(reduction):
    """CP 2: each rank's loss on its shard (logits of its local tokens) sums to the whole loss."""
    model = tiny_model()
    rows = make_rows([9, 14, 5], [3, 0, 2], seed=6)
    batch = build_thd_batch(rows, cp_size=2)
    with torch.no_grad():
        logits = model(**to_hf_kwargs(batch, include_labels=False), use_cache=False).logits[0]
        whole = packed_loss(logits, batch, reduction)
        n = count_items([batch], reduction)
        total = 0.0
        for r in range(2):
            shard = thdpack.shard(batch, cp_size=2, cp_rank=r)
            extra = {"sample_targets": sample_target_counts(batch)} if reduction == "sample" else {}
            total = total + packed_loss(logits[shard.shard.partition_indices], shard, reduction, n, **extra)
        torch.testing.assert_close(total, whole, rtol=1e-12, atol=0)
        torch.testing.assert_close(whole, reference_loss(model, rows, reduction), rtol=1e-12, atol=0)


# --------------------------------------------------------------------------- the sampler's normaliser


def test_step_items_counts_every_rank_and_micro_batch():
    lengths = [10, 20, 30, 5, 7, 40, 12, 3]
    targets = [4, 0, 29, 4, 6, 1, 11, 2]
    R, M = 2, 2
    samplers = [TokenBudgetBatchSampler(lengths, 48, num_replicas=R, rank=r, micro_batches=M, shuffle=False)
                for r in range(R)]
    plan = samplers[0].plan()
    for step in range(samplers[0].num_optimizer_steps):
        items = samplers[0].step_items(step, targets)
        for r, s in enumerate(samplers):
            packs = list(s)[step * M : (step + 1) * M]
            rows = [i for p in packs for i in p]
            assert items.rank_targets[r] == sum(targets[i] for i in rows)
            assert items.rank_samples[r] == sum(targets[i] > 0 for i in rows)
        assert items.num_items("token") == items.targets == int(items.rank_targets.sum())
        assert items.num_items("sample") == items.samples == int(items.rank_samples.sum())
    assert len(plan) >= 3
    default = samplers[0].step_items(0)  # plain LM: every token but each row's last
    packs = list(samplers[0])[:M]
    assert default.rank_targets[0] == sum(lengths[i] - 1 for p in packs for i in p)


def test_step_items_with_balance_follows_the_planned_steps():
    lengths = list(np.random.default_rng(0).integers(2, 60, 40))
    R, M = 2, 2
    samplers = [TokenBudgetBatchSampler(lengths, 64, num_replicas=R, rank=r, micro_batches=M, balance="compute")
                for r in range(R)]
    for step in range(samplers[0].num_optimizer_steps):
        items = samplers[0].step_items(step)
        for r, s in enumerate(samplers):
            packs = list(s)[step * M : (step + 1) * M]
            assert items.rank_targets[r] == sum(lengths[i] - 1 for p in packs for i in p)


# --------------------------------------------------------------------------- errors


def test_errors_name_the_argument():
    rows = make_rows([6, 4], [0, 0], seed=0)
    batch = build_thd_batch(rows, cp_size=2)
    logits = torch.randn(batch.num_padded_tokens, VOCAB)
    with pytest.raises(ValueError, match=r"logits have shape \(5, 64\).*T = batch.num_padded_tokens = 12"):
        token_logps(logits[:5], batch)
    with pytest.raises(ValueError, match="reduction must be one of"):
        packed_loss(logits, batch, "mean")
    with pytest.raises(ValueError, match="num_items must be > 0"):
        packed_loss(logits, batch, "token", 0)
    for inf in (float("inf"), torch.tensor(float("inf"))):  # a 0 loss, silently (issue 21 point 1)
        with pytest.raises(ValueError, match="num_items must be finite"):
            packed_loss(logits, batch, "token", inf)
    for beta in (-0.1, 0, float("nan"), float("inf"), "0.1", True, None):
        with pytest.raises(ValueError, match=r"beta must be a positive finite number \(the DPO temperature"):
            dpo_loss(torch.zeros(2), torch.zeros(2), batch, beta=beta)
    with pytest.raises(ValueError, match="chunk_size must be an integer >= 1"):
        token_logps(logits, batch, chunk_size=0)
    with pytest.raises(ValueError, match="outside the logits' vocabulary"):
        token_logps(logits[:, :3], batch)
    shard = thdpack.shard(batch, cp_size=2, cp_rank=1)
    with pytest.raises(ValueError, match="CP shard needs sample_targets="):
        packed_loss(logits[shard.shard.partition_indices], shard, "sample")
    sampler = TokenBudgetBatchSampler([6, 4], 16, shuffle=False)
    with pytest.raises(ValueError, match=r"step=1 is outside epoch 0 of 1 optimizer steps"):
        sampler.step_items(1)
    with pytest.raises(ValueError, match=r"targets\[0\] = 6 but row 0 has 6 tokens"):
        sampler.step_items(0, [6, 1])
    with pytest.raises(ValueError, match="one entry per dataset row"):
        sampler.step_items(0, [1])


def test_empty_batch_loss_is_zero_and_connected():
    rows = make_rows([5], [5], seed=0)
    batch = build_thd_batch(rows)
    logits = torch.randn(batch.num_padded_tokens, VOCAB, requires_grad=True)
    for reduction in ("token", "sample"):
        loss = packed_loss(logits, batch, reduction)
        assert float(loss.detach()) == 0.0 and loss.requires_grad


# --------------------------------------------------------------------------- DPO


def make_pairs(num_pairs: int, seed: int) -> list[dict]:
    """Rows 2k / 2k+1: prompt + chosen / prompt + rejected of pair k, prompt tokens not targets."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_pairs):
        prompt = torch.randint(1, VOCAB, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)
        for _ in range(2):
            answer = torch.randint(1, VOCAB, (int(torch.randint(1, 14, (1,), generator=g)),), generator=g)
            ids = torch.cat([prompt, answer])
            labels = ids.clone()
            labels[: prompt.numel()] = IGNORE
            rows.append({"input_ids": ids, "labels": labels})
    return rows


def reference_dpo(policy, ref, rows, beta) -> torch.Tensor:
    """Mean over pairs of -log σ(β((π_c − ref_c) − (π_r − ref_r))), each sequence run alone."""
    losses = []
    for k in range(len(rows) // 2):
        c, r = rows[2 * k], rows[2 * k + 1]
        with torch.no_grad():
            ref_margin = alone_logps(ref, c).sum() - alone_logps(ref, r).sum()
        margin = alone_logps(policy, c).sum() - alone_logps(policy, r).sum() - ref_margin
        losses.append(-torch.nn.functional.logsigmoid(beta * margin))
    return torch.stack(losses).mean()


def packed_dpo_step(policy, ref, batch, cp_size, beta, num_items, chunk_size=None):
    """One pack's DPO loss, backpropagated: the pack run whole, its logits split into CP shards
    whose partial sequence log-probs are summed (a CP all-reduce). Returns the detached loss."""
    kw = to_hf_kwargs(batch, include_labels=False)
    logits = policy(**kw, use_cache=False).logits[0]
    with torch.no_grad():
        ref_logits = ref(**kw, use_cache=False).logits[0]
    shards = [thdpack.shard(batch, cp_size=cp_size, cp_rank=r) for r in range(cp_size)] if cp_size > 1 else [batch]
    idx = [s.shard.partition_indices if s.is_shard else slice(None) for s in shards]
    chunk = {} if chunk_size is None else {"chunk_size": chunk_size}
    pol = sum(sequence_logps(logits[i], s, **chunk)[0] for i, s in zip(idx, shards))
    refl = sum(sequence_logps(ref_logits[i], s)[0] for i, s in zip(idx, shards))
    loss = dpo_loss(pol, refl, shards[0], beta, num_items=num_items)
    loss.backward()
    return loss.detach()


def packed_dpo_grad(policy, ref, rows, beta, cp_size):
    """Packs planned with pair groups (several pairs per pack); each pack run whole, its logits
    split into CP shards whose partial sequence log-probs are summed (a CP all-reduce)."""
    plan = plan_packs([r["input_ids"].numel() for r in rows], 64, groups=pair_groups(len(rows)),
                      align=2 * cp_size if cp_size > 1 else 1)
    assert max(len(p) for p in plan.packs) >= 4, "several pairs share a pack"
    policy.zero_grad()
    total = 0.0
    for k in range(len(plan)):
        pack = plan.pack(k)
        batch = build_thd_batch([rows[i] for i in pack], sample_index=pack, cp_size=cp_size)
        loss = packed_dpo_step(policy, ref, batch, cp_size, beta, len(rows) // 2, chunk_size=5)
        total = total + loss
    return total, grads(policy).clone()


@pytest.mark.parametrize("cp_size", [1, 2])
def test_packed_dpo_equals_unpacked_pairs(cp_size):
    policy, ref = tiny_model(7), tiny_model(8)
    rows = make_pairs(6, seed=cp_size)
    beta = 0.5
    loss, got = packed_dpo_grad(policy, ref, rows, beta, cp_size)
    policy.zero_grad()
    want_loss = reference_dpo(policy, ref, rows, beta)
    want_loss.backward()
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-12, atol=0)
    assert rel_err(got, grads(policy)) < REL_TOL


def test_dpo_loss_refuses_a_pack_without_a_pair_partner():
    rows = make_pairs(2, seed=0)
    batch = build_thd_batch([rows[0], rows[1], rows[2]], sample_index=[0, 1, 2])
    z = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"row 2 \(chosen of pair 1\) is in the pack without its partner row 3.*groups="):
        dpo_loss(z, z, batch)
    with pytest.raises(ValueError, match=r"policy_logps has shape \(2,\); expected \[4\]"):
        dpo_loss(z[:2], torch.zeros(4), build_thd_batch(rows, sample_index=[0, 1, 2, 3]))


# --------------------------------------------------------------------------- RL groups (GRPO-style)


def test_group_advantages_match_the_formula():
    rewards = [1.0, 0.0, 0.5, 2.0, -1.0, 3.0, 7.0]
    groups = [5, 5, 5, 9, 9, 1, 2]  # group 1 and 2 have one sample each: advantage 0
    got = group_advantages(rewards, groups, eps=1e-6)
    for i, (r, g) in enumerate(zip(rewards, groups)):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == g]
        mean = sum(members) / len(members)
        std = (sum((m - mean) ** 2 for m in members) / (len(members) - 1)) ** 0.5 if len(members) > 1 else 0.0
        assert abs(float(got[i]) - (r - mean) / (std + 1e-6)) < 1e-12
    torch.testing.assert_close(group_advantages(rewards, groups, scale=False)[:3],
                               torch.tensor([0.5, -0.5, 0.0], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"groups must be integers with one id per reward \(7\)"):
        group_advantages(rewards, groups[:3])


def make_rl_rows(lengths, seed):
    """Completions of a few prompts: group id, reward, GRPO advantage, and a per-token old log-prob
    offset (an off-policy sampler), prompt tokens not targets."""
    rows = make_rows(lengths, [min(3, s - 1) for s in lengths], seed)
    g = torch.Generator().manual_seed(seed)
    groups = [i // 3 for i in range(len(rows))]
    rewards = torch.randn(len(rows), generator=g, dtype=torch.float64)
    adv = group_advantages(rewards, groups)
    for r, gid, a in zip(rows, groups, adv.tolist()):
        r.update(group=gid, advantage=a, old_shift=0.3 * torch.randn(r["input_ids"].numel(), generator=g, dtype=torch.float64))
    return rows


def reference_pg(model, rows, reduction, off_policy, clip=0.2):
    per_row = []
    for r in rows:
        logits = model(input_ids=r["input_ids"][None], use_cache=False).logits[0, :-1]
        targets = r["labels"][1:]
        keep = targets != IGNORE
        logp = torch.log_softmax(logits, -1)[keep].gather(1, targets[keep][:, None]).squeeze(1)
        old = (logp + r["old_shift"][:-1][keep]).detach() if off_policy else logp.detach()
        ratio = torch.exp(logp - old)
        a = r["advantage"]
        per_row.append(-torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a))
    if reduction == "token":
        return torch.cat(per_row).sum() / sum(p.numel() for p in per_row)
    means = [p.mean() for p in per_row if p.numel()]
    return torch.stack(means).sum() / len(means)


@pytest.mark.parametrize("off_policy", [False, True])
@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_packed_policy_gradient_equals_unpacked(reduction, off_policy):
    """GRPO-style: advantages carried as a per-sample value, R=2 ranks x M=2 micro-batches, the
    sampler's normaliser; the gradient equals the unpacked per-sample computation."""
    model = tiny_model()
    lengths = [9, 14, 5, 22, 7, 11, 16, 4, 13, 8, 19, 6]
    rows = make_rl_rows(lengths, seed=11)
    R, M = 2, 2
    samplers = [TokenBudgetBatchSampler(lengths, 40, num_replicas=R, rank=r, micro_batches=M, seed=1) for r in range(R)]
    num_items = samplers[0].step_items(0, row_targets(rows)).num_items(reduction)
    model.zero_grad()
    step_rows = []
    for sampler in samplers:
        for pack in list(sampler)[:M]:
            batch = build_thd_batch([rows[i] for i in pack], sample_index=pack, sample_values=["advantage"])
            logits = model(**to_hf_kwargs(batch, include_labels=False), use_cache=False).logits
            old = None
            if off_policy:  # the sampler's log-probs: this policy's, shifted per token (what old_shift says)
                # position t of a row scores its token t+1, as logits[t] alone does (no alignment pads here)
                shift = torch.cat([rows[i]["old_shift"] for i in pack])
                with torch.no_grad():
                    old = token_logps(logits, batch) + torch.where(batch.loss_mask, shift, 0)
            policy_gradient_loss(logits, batch, batch.token_values("advantage"), reduction, num_items,
                                 old_logps=old).backward()
            step_rows += [rows[i] for i in pack]
    got = grads(model).clone()
    model.zero_grad()
    reference_pg(model, step_rows, reduction, off_policy).backward()
    assert rel_err(got, grads(model)) < REL_TOL


def _all_reduce_worker(rank: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        total = all_reduce_items(10 + rank)  # rank 0 counts 10, rank 1 counts 11
        with open(f"{out}.{rank}", "w") as f:
            f.write(str(total))
    finally:
        dist.destroy_process_group()


def test_all_reduce_items_sums_over_ranks(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "total")
    mp.spawn(_all_reduce_worker, args=(str(tmp_path / "init"), out), nprocs=2, join=True)
    assert [int(open(f"{out}.{r}").read()) for r in range(2)] == [21, 21]
    assert all_reduce_items(7) == 7  # no process group: the count itself


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-4000, 4000).map(lambda k: k / 1000), min_size=2, max_size=6), st.integers(-300, 300))
def test_group_advantages_do_not_depend_on_the_rewards_magnitude(rewards, exponent):
    """Scaling every reward by 10**k (up to 1e±300) leaves the advantages (eps 0) unchanged: no r² or
    sum overflows to inf or cancels to 0 (issue 21 point 8). Rewards that are all equal have no spread."""
    hypothesis.assume(len(set(rewards)) > 1)
    groups = [0] * len(rewards)
    want = group_advantages(rewards, groups, eps=0.0)
    got = group_advantages([r * 10.0 ** exponent for r in rewards], groups, eps=0.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_group_advantages_of_huge_rewards_and_non_finite_ones():
    half = 0.5 ** 0.5  # a pair r, -r: (r - 0) / std with std = r·√2
    torch.testing.assert_close(group_advantages([1e200, -1e200], [0, 0]),
                               torch.tensor([half, -half], dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(group_advantages([1.0, -1.0], [0, 0], eps=0.0),
                               torch.tensor([half, -half], dtype=torch.float64), rtol=0, atol=1e-12)
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match=r"rewards must be finite: sample 1 has reward"):
            group_advantages([1.0, bad, 0.0], [0, 0, 0])


def test_dpo_loss_of_a_mixtures_pack_pairs_its_source_and_counts_a_repeated_pair_per_copy():
    """A mixture's pack (batch.source_index): dpo_loss(source=k) pairs only source k's samples, a pair packed
    twice counts twice (the n-th chosen copy with the n-th rejected copy), the other sources are left out; without
    ``source`` the chat sample is an unpaired row and is refused."""
    rows = make_pairs(2, seed=4)
    chat = {"input_ids": torch.arange(5, 12), "labels": torch.arange(5, 12)}
    samples = [rows[0], rows[1], chat, rows[2], rows[3], rows[0], rows[1]]
    batch = build_thd_batch(samples, sample_index=[0, 1, 9, 2, 3, 0, 1], source_index=[1, 1, 0, 1, 1, 1, 1])
    gen = torch.Generator().manual_seed(0)
    pol, ref = torch.randn(7, generator=gen, dtype=torch.float64), torch.randn(7, generator=gen, dtype=torch.float64)
    beta = 0.3

    def pair(c, r):
        return -torch.nn.functional.logsigmoid(beta * ((pol[c] - ref[c]) - (pol[r] - ref[r])))

    want = (pair(0, 1) + pair(3, 4) + pair(5, 6)) / 3
    torch.testing.assert_close(dpo_loss(pol, ref, batch, beta, source=1), want, rtol=1e-12, atol=0)
    assert float(dpo_loss(pol, ref, batch, beta, source=2)) == 0.0  # no pair of that source here
    with pytest.raises(ValueError, match=r"row 9 \(rejected of pair 4\) is in the pack without its partner row 8"):
        dpo_loss(pol, ref, batch, beta)
    lone = build_thd_batch(samples[:6], sample_index=[0, 1, 9, 2, 3, 0], source_index=[1, 1, 0, 1, 1, 1])
    with pytest.raises(ValueError, match=r"row 0 \(chosen of pair 0\) is in the pack without its partner row 1; .*"
                                         r"\(source 1 of the mixture\)"):
        dpo_loss(pol[:6], ref[:6], lone, beta, source=1)
