"""Shared-prefix packing (issue 24): a group's common prefix laid out once, its members after it.

The references here are written from the samples alone, never from thdpack's layout:

- every sample's tokens and position ids sit at the rows the batch names for it
  (``prefix_tree.unshared_rows``), and the dense tree mask gives the row of its token t exactly the rows
  of its tokens 0..t (nothing of another member, no pad slot): so a causal model computes, at those
  rows, the logits the sample has alone;
- the target table is each sample's own HF labels, shifted within the sample, at those rows;
- torch's ``create_block_mask`` over the same mask gives the tables of ``thdpack.batching.block_mask(batch)``, and
  torch's ``create_mask`` over the BlockMask's mask_mod gives the dense mask;
- FLOPs: the batch's ``seqlen_squared_sum(batch)`` is twice the mask's allowed (real row, real key) pairs less
  the real tokens, the convention of ``Σ sᵢ²``.

The model tests (transformers' tiny Qwen3 / Llama, ``tests/test_shared_prefix_models.py``) check the
logits, losses and gradients against the unshared packed batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask, create_mask

import thdpack
from thdpack import SampleError, ThdCollator, TokenBudgetBatchSampler, build_thd_batch, plan_balanced, plan_packs
from thdpack.batching.shared_prefix import group_prefixes
from thdpack.flops import FlopsAccumulator, seqlen_squared_sum, tree_seqlen_squared_sum
from thdpack.integrations import packed_seq_params_dict, to_hf_kwargs
from thdpack.batching import attention_mask_4d, block_mask, document_parents, seq_idx


pytestmark = pytest.mark.usefixtures("static_flex_compiles")  # tests/conftest.py


IGNORE = -100
MASK_TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
               "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


# --------------------------------------------------------------------------- samples


def group_samples(spec, *, seed=0, vocab=50, prompt_loss=(), declare=False):
    """Samples of groups ``spec = [(prompt_len, [suffix lengths]), ...]``: every member of group g is its
    prompt followed by its own tokens; prompt tokens are not targets unless ``g in prompt_loss``."""
    rng = np.random.default_rng(seed)
    samples = []
    for g, (p, suffixes) in enumerate(spec):
        prompt = rng.integers(3, vocab, p)
        for c in suffixes:
            ids = np.concatenate([prompt, rng.integers(3, vocab, c)]).astype(np.int64)
            if ids.size == 0:
                ids = rng.integers(3, vocab, 1)
            labels = ids.copy()
            if g not in prompt_loss:
                labels[:p] = IGNORE
            sample = {"input_ids": ids, "labels": labels, "group": g}
            if declare:
                sample["prefix_len"] = min(p, ids.size)
            samples.append(sample)
    return samples


def sample_targets(sample) -> list[tuple[int, int]]:
    """``(t, label)``: token t of the sample alone predicts ``label`` (its HF labels shifted by one)."""
    labels = np.asarray(sample.get("labels", sample["input_ids"]))
    return [(t, int(labels[t + 1])) for t in range(labels.size - 1) if labels[t + 1] != IGNORE]


def sample_rows(batch) -> list[torch.Tensor]:
    """The batch's rows of every sample's tokens (``unshared_rows`` cut by the samples' lengths)."""
    tree = batch.prefix_tree
    return list(torch.split(tree.unshared_rows, tree.sample_lens.tolist()))


def assert_tree_matches_samples(batch, samples) -> None:
    """The checks of the module docstring, from ``samples`` alone."""
    rows = sample_rows(batch)
    assert batch.num_samples == len(samples) == len(rows)
    mask = attention_mask_4d(batch)[0, 0]
    for j, (sample, r) in enumerate(zip(samples, rows)):
        ids = torch.as_tensor(np.asarray(sample["input_ids"]))
        assert torch.equal(batch.input_ids[r], ids), f"sample {j}: tokens"
        assert torch.equal(batch.position_ids[r], torch.arange(ids.numel())), f"sample {j}: positions"
        for t in range(ids.numel()):
            seen = torch.nonzero(mask[r[t]])[:, 0]
            assert torch.equal(seen, torch.sort(r[: t + 1]).values), f"sample {j} token {t} sees {seen.tolist()}"
    tree = batch.prefix_tree
    want = [(int(rows[j][t]), label, j) for j, s in enumerate(samples) for t, label in sample_targets(s)]
    got = list(zip(tree.target_rows.tolist(), tree.target_labels.tolist(), tree.target_samples.tolist()))
    assert got == want
    assert batch.num_targets == len(want)


def ancestors_of(parents: list, d: int) -> list[int]:
    out = []
    while parents[d] >= 0:
        d = parents[d]
        out.append(d)
    return out


def reference_mask(batch) -> torch.Tensor:
    """bool ``[T, T]`` from the segments by the rule (own segment causally, every ancestor's real tokens)."""
    cu, lens = batch.cu_seqlens_padded.tolist(), batch.seq_lens.tolist()
    parents = document_parents(batch).tolist()
    T = batch.num_padded_tokens
    out = torch.zeros(T, T, dtype=torch.bool)
    for d in range(len(lens)):
        end = cu[d + 1] if d + 1 < len(lens) else T
        for q in range(cu[d], end):
            out[q, cu[d] : q + 1] = True
            for a in ancestors_of(parents, d):
                out[q, cu[a] : cu[a] + lens[a]] = True
    return out


def is_one_level(batch) -> bool:
    """No tree, or every shared segment a root (today's one-level layout)."""
    tree = batch.prefix_tree
    return tree is None or bool((tree.parents[tree.segment_sample < 0] < 0).all())


def shared_counts(batch) -> list[tuple[int, int]]:
    """``(length, samples below it)`` of every shared segment of a tree (a trie of any depth)."""
    tree = batch.prefix_tree
    parents = tree.parents.tolist()
    below = {}
    for own in tree.sample_segment.tolist():
        for a in ancestors_of(parents, own):
            below[a] = below.get(a, 0) + 1
    return [(int(batch.seq_lens[a]), k) for a, k in sorted(below.items())]


def assert_block_mask_is_torchs(batch, block_size) -> None:
    dense = reference_mask(batch)
    T = dense.shape[0]
    got = block_mask(batch, block_size)

    def mask_mod(b, h, q, kv):
        return dense[q, kv]

    want = create_block_mask(mask_mod, 1, None, T, T, device="cpu", BLOCK_SIZE=block_size)
    for name in MASK_TABLES:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(create_mask(got.mask_mod, 1, 1, T, T, device="cpu")[0, 0], dense)
    assert torch.equal(attention_mask_4d(batch)[0, 0], dense)


def real_slots(batch) -> torch.Tensor:
    cu, lens = batch.cu_seqlens_padded, batch.seq_lens
    slot = torch.arange(batch.num_padded_tokens)
    seg = torch.searchsorted(cu[1:-1].long(), slot, right=True)
    return slot - cu[seg] < lens[seg]


# --------------------------------------------------------------------------- layout


def test_layout_of_a_grpo_group_and_a_sample_alone():
    # group 0: prompt of 4, members of 2, 1, 0 own tokens (the last equals the prompt); sample 3 alone
    samples = group_samples([(4, [2, 1, 0]), (3, [0])], prompt_loss=())
    batch = build_thd_batch(samples, share_prefix="group", min_prefix_len=2)
    tree = batch.prefix_tree
    assert batch.seq_lens.tolist() == [4, 2, 1, 0, 3]  # prefix, its members, the sample alone
    assert document_parents(batch).tolist() == [-1, 0, 0, 0, -1]
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 4, 0, 1, 2]
    assert tree.prefix_lens.tolist() == [4, 4, 4, 0]
    # the prefix's last row (3) predicts the first own token of members 0 and 1, none of member 2
    assert tree.first_rows.tolist() == [3, 3, -1, -1]
    assert tree.first_labels.tolist() == [int(samples[0]["input_ids"][4]), int(samples[1]["input_ids"][4]), IGNORE,
                                          IGNORE]
    assert batch.labels[3] == IGNORE and not batch.loss_mask[:4].any()
    assert batch.num_samples == 4 and batch.num_padded_tokens == 10
    assert_tree_matches_samples(batch, samples)


def test_prefix_targets_count_once_per_member():
    """Loss on the prompt: the shared prefix rows are scored once for every member (as unshared)."""
    samples = group_samples([(5, [3, 2])], prompt_loss=(0,))
    batch = build_thd_batch(samples, share_prefix="group", min_prefix_len=1)
    assert batch.prefix_tree.prefix_lens.tolist() == [5, 5]
    assert batch.num_targets == (8 - 1) + (7 - 1)
    assert batch.loss_mask.sum() < batch.num_targets  # rows 0..3 carry one label for both members
    assert_tree_matches_samples(batch, samples)


def test_found_prefix_stops_where_targets_differ():
    """Member 1 scores its prompt, member 0 not: shared rows would need two labels, so the found prefix
    ends at the first token whose target differs (row 0 predicts token 1: a prefix of 1 token)."""
    samples = group_samples([(6, [2, 3])])
    samples[1]["labels"] = samples[1]["input_ids"].copy()
    batch = build_thd_batch(samples, share_prefix="group", min_prefix_len=1)
    assert batch.prefix_tree.prefix_lens.tolist() == [1, 1]
    assert_tree_matches_samples(batch, samples)


def test_declared_prefix_and_minimum():
    samples = group_samples([(6, [2, 3]), (40, [1, 4, 0])], declare=True)
    batch = build_thd_batch(samples, share_prefix="group")  # default minimum 32: the 6-token prompt is not shared
    assert batch.prefix_tree.prefix_lens.tolist() == [0, 0, 40, 40, 40]
    assert_tree_matches_samples(batch, samples)
    plain = build_thd_batch(samples[:2], share_prefix="group")  # no group shares: the unshared batch itself
    assert plain.prefix_tree is None
    assert torch.equal(plain.input_ids, build_thd_batch(samples[:2]).input_ids)


def test_alignment_pads_every_segment():
    samples = group_samples([(5, [2, 0, 3]), (2, [3])])
    batch = build_thd_batch(samples, share_prefix="group", min_prefix_len=2, pad_multiple=4, pad_to=32)
    assert batch.cu_seqlens_padded.tolist() == [0, 8, 12, 12, 16, 32]
    assert batch.num_padded_tokens == 32
    assert_tree_matches_samples(batch, samples)
    assert_block_mask_is_torchs(batch, 4)


@st.composite
def tree_cases(draw):
    groups = draw(st.lists(st.tuples(st.integers(0, 9), st.lists(st.integers(0, 5), min_size=1, max_size=4)),
                           min_size=1, max_size=4))
    return dict(spec=groups, seed=draw(st.integers(0, 1000)), vocab=draw(st.sampled_from([4, 50])),
                prompt_loss=tuple(draw(st.sets(st.integers(0, 3)))), declare=draw(st.booleans()),
                pad_multiple=draw(st.sampled_from([1, 2, 8])), extra=draw(st.sampled_from([0, 5])),
                min_prefix_len=draw(st.integers(1, 4)),
                block_size=draw(st.sampled_from([1, 4, 8, (4, 8), (16, 4)])))


@pytest.mark.filterwarnings("ignore:thdpack. a batch of")
@settings(deadline=None, max_examples=40)
@given(tree_cases())
def test_tree_layouts_against_the_samples(case):
    """Hypothesis: group sizes, prefixes (0 and a member equal to the prefix included), found or declared,
    small vocabularies (prefixes longer than the prompt), prompt losses, alignment and ``pad_to``."""
    samples = group_samples(case["spec"], seed=case["seed"], vocab=case["vocab"], prompt_loss=case["prompt_loss"],
                            declare=case["declare"])
    aligned = sum(-(-len(s["input_ids"]) // case["pad_multiple"]) * case["pad_multiple"] for s in samples)
    pad_to = aligned + case["extra"] * case["pad_multiple"]  # the unshared stream fits, so the tree does
    batch = build_thd_batch(samples, share_prefix="group", min_prefix_len=case["min_prefix_len"],
                            pad_multiple=case["pad_multiple"], pad_to=pad_to)
    if batch.prefix_tree is None:  # nothing shared: the unshared batch
        assert torch.equal(batch.input_ids, build_thd_batch(samples, pad_multiple=case["pad_multiple"],
                                                            pad_to=pad_to).input_ids)
        return
    assert batch.num_padded_tokens == pad_to
    assert_tree_matches_samples(batch, samples)
    assert_block_mask_is_torchs(batch, case["block_size"])
    tree = batch.prefix_tree
    p, lens = tree.prefix_lens, tree.sample_lens
    assert bool(((p == 0) | (p >= case["min_prefix_len"])).all())
    prefixes = shared_counts(batch)  # (p, samples below) of every shared segment, any depth
    assert batch.num_tokens == int(lens.sum()) - sum((k - 1) * q for q, k in prefixes)  # every prefix once
    # FLOPs: the tree's Σ convention is twice the real pairs less the real tokens, Σ L² − Σ (k − 1)·p²
    real = real_slots(batch)
    pairs = int(attention_mask_4d(batch)[0, 0][real][:, real].sum())
    assert seqlen_squared_sum(batch) == 2 * pairs - batch.num_tokens
    if is_one_level(batch):
        assert seqlen_squared_sum(batch) == int((lens * lens).sum()) - sum((k - 1) * q * q for q, k in prefixes)


# --------------------------------------------------------------------------- bad input and refused dialects


def test_declared_prefix_that_is_not_common_names_the_group():
    samples = group_samples([(3, [1]), (6, [2, 3])], declare=True)
    samples[2]["input_ids"] = samples[2]["input_ids"].copy()
    samples[2]["input_ids"][4] += 1
    with pytest.raises(ValueError, match=r"group 1 \(samples 1, 2\): sample 2's token 4 differs from sample 1's "
                                         r"within the declared prefix_len=6"):
        build_thd_batch(samples, share_prefix="group", min_prefix_len=1)
    samples = group_samples([(6, [2, 3])], declare=True)
    samples[1]["prefix_len"] = 5
    with pytest.raises(ValueError, match=r"group 0 \(samples 0, 1\) declares prefix_len \[5, 6\]"):
        build_thd_batch(samples, share_prefix="group", min_prefix_len=1)
    samples[1]["prefix_len"] = 9
    with pytest.raises(ValueError, match=r"declares prefix_len \[6, 9\]"):
        build_thd_batch(samples, share_prefix="group", min_prefix_len=1)
    for s in samples:
        s["prefix_len"] = 9
    with pytest.raises(ValueError, match=r"group 0 .* declares prefix_len=9, but sample 0 has 8 tokens"):
        build_thd_batch(samples, share_prefix="group", min_prefix_len=1)
    samples = group_samples([(6, [2, 3])], declare=True)
    samples[1]["labels"] = samples[1]["input_ids"].copy()  # targets on the declared prefix differ
    with pytest.raises(ValueError, match=r"sample 1's the target of token 1 differs"):
        build_thd_batch(samples, share_prefix="group", min_prefix_len=1)


def test_bad_arguments_and_fields():
    samples = group_samples([(6, [2, 3])])
    with pytest.raises(ValueError, match="min_prefix_len"):
        build_thd_batch(samples, share_prefix="group", min_prefix_len=0)
    with pytest.raises(TypeError, match="share_prefix must be None or the name of a sample field"):
        build_thd_batch(samples, share_prefix=1)
    with pytest.raises(ValueError, match="cp_size=2: context-parallel attention .* cannot express"):
        build_thd_batch(samples, share_prefix="group", cp_size=2)
    del samples[1]["group"]
    with pytest.raises(SampleError, match="sample 1"):
        build_thd_batch(samples, share_prefix="group")
    samples[1]["group"] = "a"
    with pytest.raises(SampleError, match="'group' must be an integer"):
        build_thd_batch(samples, share_prefix="group")


def test_dialects_that_cannot_express_the_tree_refuse():
    batch = build_thd_batch(group_samples([(6, [2, 3])]), share_prefix="group", min_prefix_len=1)
    for call in (lambda: to_hf_kwargs(batch, include_labels=False),
                 lambda: to_hf_kwargs(batch, attn_implementation="flash_attention_2", include_labels=False),
                 lambda: packed_seq_params_dict(batch), lambda: seq_idx(batch),
                 lambda: thdpack.shard(batch, cp_size=2, cp_rank=0)):
        with pytest.raises(ValueError, match="cannot express a shared-prefix batch .* share_prefix=None"):
            call()
    with pytest.raises(ValueError, match="include_labels=True"):
        to_hf_kwargs(batch, attn_implementation="sdpa")
    kw = to_hf_kwargs(batch, attn_implementation="sdpa", include_labels=False)
    assert kw["attention_mask"].dtype == torch.bool and kw["attention_mask"].shape == (1, 1, 11, 11)
    kw = to_hf_kwargs(batch, attn_implementation="eager", include_labels=False)
    assert kw["attention_mask"].dtype == torch.float32
    kw = to_hf_kwargs(batch, attn_implementation="flex_attention", include_labels=False)
    assert kw["attention_mask"].shape == (1, 1, 11, 11)
    moved = batch.to("cpu")
    assert moved.prefix_tree is not batch.prefix_tree and torch.equal(moved.prefix_tree.target_rows,
                                                                       batch.prefix_tree.target_rows)


# --------------------------------------------------------------------------- planning: each prefix once


def shared_prefix_of(samples, *, min_prefix_len=1, multiple=1):
    """``plan_packs(shared_prefix=)`` of ``samples``: the prefixes the builder will share."""
    flat = build_thd_batch(samples)
    return group_prefixes(flat, samples, "group", min_prefix_len, multiple)


@st.composite
def planning_cases(draw):
    groups = draw(st.lists(st.tuples(st.integers(0, 30), st.lists(st.integers(0, 8), min_size=1, max_size=5)),
                           min_size=1, max_size=6))
    return dict(spec=groups, seed=draw(st.integers(0, 100)), pad_multiple=draw(st.sampled_from([1, 4])),
                min_prefix_len=draw(st.integers(1, 12)), slack=draw(st.integers(0, 40)),
                algorithm=draw(st.sampled_from(["bfd", "sequential"])))


@pytest.mark.filterwarnings("ignore:thdpack. a batch of")
@settings(deadline=None, max_examples=25)
@given(planning_cases())
def test_collator_plans_each_prefix_once(case):
    """Hypothesis over groups, prefixes, budgets and alignment: ``ThdCollator(share_prefix=, pack_size=)``
    keeps every group in one pack, every built pack within the budget (the prefix counted once), and
    every tree batch true to its samples."""
    samples = group_samples(case["spec"], seed=case["seed"])
    m = case["pad_multiple"]
    prefix = shared_prefix_of(samples, min_prefix_len=case["min_prefix_len"], multiple=m)
    groups = np.array([s["group"] for s in samples])
    lens = np.array([len(s["input_ids"]) for s in samples])
    # the largest group laid out as the builder lays it out, plus some slack
    tree_sizes = [sum(-(-(lens[j] - prefix[j]) // m) * m for j in np.flatnonzero(groups == g))
                  + -(-int(prefix[groups == g][0]) // m) * m for g in np.unique(groups)]
    pack_size = -(-(max(tree_sizes) + case["slack"]) // m) * m
    collate = ThdCollator(share_prefix="group", pack_size=pack_size, min_prefix_len=case["min_prefix_len"],
                          pad_multiple=m, algorithm=case["algorithm"])
    out = collate(samples)
    seen = np.concatenate([b.sample_index.numpy() for b in out])
    assert sorted(seen.tolist()) == list(range(len(samples)))
    for batch in out:
        assert batch.num_padded_tokens <= pack_size
        index = batch.sample_index.numpy()
        assert set(groups[index]).isdisjoint(groups[np.setdiff1d(np.arange(len(samples)), index)])
        if batch.prefix_tree is not None:  # a trie shares at least the planned prefix (more where it saves slots)
            assert (batch.prefix_tree.prefix_lens.numpy() >= prefix[index]).all()
            assert_tree_matches_samples(batch, [samples[i] for i in index])
    # the stream's tokens, every shared segment once: the plan counts each group as its build lays it out
    assert out.stats.real_tokens == sum(b.num_tokens for b in out)


def test_a_group_fits_when_its_prefix_counts_once():
    samples = group_samples([(40, [4, 4, 4, 4])])  # 176 tokens unshared, 56 shared
    prefix = shared_prefix_of(samples)
    lens = [len(s["input_ids"]) for s in samples]
    plan = plan_packs(lens, 64, groups=[0] * 4, shared_prefix=prefix)
    assert len(plan) == 1 and plan.shared_length.tolist() == [0, 40, 40, 40] and plan.stats.real_tokens == 56
    with pytest.raises(ValueError, match=r"group 0 \(samples 0, 1, 2, 3\) has 176 tokens \(aligned\), more than "
                                         r"pack_size=64"):
        plan_packs(lens, 64, groups=[0] * 4)
    with pytest.raises(ValueError, match=r"group 0 \(samples 0, 1, 2, 3\) has 56 tokens .* more than pack_size=48"):
        plan_packs(lens, 48, groups=[0] * 4, shared_prefix=prefix)
    with pytest.raises(ValueError, match=r"group 0 \(samples 0, 1, 2, 3\) has shared_prefix values \[39, 40\]"):
        plan_packs(lens, 64, groups=[0] * 4, shared_prefix=[40, 40, 39, 40])
    with pytest.raises(ValueError, match=r"shared_prefix\[0\] is 45, outside \[0, 44\] \(sample 0"):
        plan_packs(lens, 64, groups=[0] * 4, shared_prefix=[45] * 4)
    with pytest.raises(ValueError, match="shared_prefix needs groups="):
        plan_packs(lens, 64, shared_prefix=prefix)
    with pytest.raises(ValueError, match=r"group 0 \(samples 0, 1, 2, 3\) has 56 tokens .* more than pack_size=48"):
        ThdCollator(share_prefix="group", pack_size=48, min_prefix_len=1)(samples)


def test_balanced_costs_are_the_built_batches():
    """``plan_balanced(shared_prefix=)`` costs every pack as the tree it becomes: linear · tokens + quadratic ·
    the batch's ``seqlen_squared_sum(batch)``; a group over one pack (a bundle) too. The sampler plans the same."""
    samples = group_samples([(40, [4, 9, 0, 3]), (33, [20, 2]), (5, [8, 8]), (45, [1]), (60, [30] * 6)], seed=3)
    lens = [len(s["input_ids"]) for s in samples]
    groups = [s["group"] for s in samples]
    prefix = shared_prefix_of(samples, min_prefix_len=1)
    cost = (1.0, 0.01)
    # group 4 takes 240 tokens shared: a bundle of 3 packs of 2 members, each sharing the prompt
    balanced = plan_balanced(lens, 200, num_replicas=2, micro_batches=3, groups=groups, shared_prefix=prefix, cost=cost)
    assert np.diff(balanced.plan.pack_offsets).sum() == len(samples)
    assert balanced.plan.shared_length.sum() == 40 * 3 + 33 + 5 + 60 * 3
    for k in range(len(balanced.plan)):
        batch = build_thd_batch([samples[i] for i in balanced.plan.pack(k)], share_prefix="group", min_prefix_len=1)
        assert batch.num_padded_tokens <= 200
        built = cost[0] * batch.num_tokens + cost[1] * seqlen_squared_sum(batch)
        if is_one_level(batch):
            assert balanced.costs[k] == pytest.approx(built)
        else:  # the plan costs one level; a deeper trie (issue 46) costs less
            assert balanced.costs[k] > built
    sampler = TokenBudgetBatchSampler(lens, 200, groups=groups, shared_prefix=prefix, balance="compute",
                                      micro_batches=3, num_replicas=1, rank=0, shuffle=False)
    collate = ThdCollator(share_prefix="group", min_prefix_len=1)
    assert all(collate([samples[i] for i in pack]).num_padded_tokens <= 200 for pack in sampler)


def test_flops_count_the_tree():
    """``thdpack.flops`` on a shared-prefix batch: the stream's tokens and the tree's ``Σ`` (checked against
    the mask's pairs in ``test_tree_layouts_against_the_samples``); model FLOPs below the unshared batch's."""
    samples = group_samples([(40, [6, 0, 11, 3]), (12, [5])])
    tree = build_thd_batch(samples, share_prefix="group", min_prefix_len=1, pad_multiple=8)
    flat = build_thd_batch(samples, pad_multiple=8)
    acc = FlopsAccumulator().add(tree)
    assert (acc.samples, acc.tokens, acc.padded_tokens) == (5, tree.num_tokens, tree.num_padded_tokens)
    assert acc.seqlen_squared_sum == seqlen_squared_sum(tree) == tree_seqlen_squared_sum(tree.seq_lens,
                                                                                          document_parents(tree))
    p, c = 40, np.array([6, 0, 11, 3])
    assert seqlen_squared_sum(tree) == p * p + int((c * (2 * p + c)).sum()) + 17 * 17
    config = dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128)
    assert acc.model_flops(config) < FlopsAccumulator().add(flat).model_flops(config)


def test_collator_refusals():
    with pytest.raises(ValueError, match="group_field=None or the same"):
        ThdCollator(share_prefix="group", group_field="pair", pack_size=64)
    with pytest.raises(ValueError, match="ulysses_sp_size=2: Ulysses attention .* share_prefix=None"):
        ThdCollator(share_prefix="group", ulysses_sp_size=2)
    with pytest.raises(ValueError, match="cp_size=2: context-parallel attention"):
        ThdCollator(share_prefix="group", cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match="min_prefix_len"):
        ThdCollator(share_prefix="group", min_prefix_len=-1)
    batch = ThdCollator(share_prefix="group", min_prefix_len=1)(group_samples([(6, [2, 3])]))
    assert batch.prefix_tree.prefix_lens.tolist() == [6, 6]
