"""Rollout tries (issue 46, first part): shared prefixes of any depth, laid out once each.

The references are written from the samples alone (``tests/test_shared_prefix.py``'s helpers): every
sample's tokens and positions at the rows the batch names for it, the dense mask giving the row of its
token t exactly its tokens 0..t, the target table its own shifted labels; torch's ``create_block_mask``
over a brute-force mask (own segment causally, every ancestor's real tokens) gives the BlockMask's tables.
A group whose trie has one level gives today's batch byte for byte (the trie path forced, compared with
the one-level path). The model tests: ``tests/test_rollout_tries_models.py``.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from test_shared_prefix import (IGNORE, assert_block_mask_is_torchs, assert_tree_matches_samples, group_samples,
                                real_slots, shared_counts)
from thdpack import build_thd_batch, plan_packs
from thdpack.batching.shared_prefix import group_shares
from thdpack.attention.tree_mask import MAX_TRIE_DEPTH, dense_tree_mask, tree_block_mask
from thdpack.batching import attention_mask_4d, document_parents, shared_prefix, trie
from thdpack.flops import seqlen_squared_sum

pytestmark = pytest.mark.usefixtures("static_flex_compiles")  # tests/conftest.py


# --------------------------------------------------------------------------- samples from a drawn trie


@st.composite
def trie_nodes(draw, depth: int):
    """``(length, children)``: a node of ``length`` tokens (a leaf may have 0), children below it."""
    if depth == 0 or draw(st.booleans()):
        return (draw(st.integers(0, 6)), [])
    return (draw(st.integers(1, 6)), draw(st.lists(trie_nodes(depth - 1), min_size=1, max_size=3)))


def trie_samples(tries, *, seed: int, vocab: int = 50, cuts=None) -> list[dict]:
    """One sample per leaf of each trie (group g = trie g): its tokens every node's on its path (random per
    node, so siblings may share tokens by chance); labels the tokens, ignored before ``cuts[j]`` (a prompt)."""
    rng = np.random.default_rng(seed)
    samples = []

    def walk(node, tokens, g):
        length, children = node
        tokens = tokens + rng.integers(3, vocab, length).tolist()
        if not children:
            samples.append({"input_ids": np.asarray(tokens or [3], np.int64), "group": g})
        for child in children:
            walk(child, tokens, g)

    for g, node in enumerate(tries):
        walk(node, [], g)
    for j, s in enumerate(samples):
        s["labels"] = s["input_ids"].copy()
        cut = 0 if cuts is None else cuts[j % len(cuts)]
        s["labels"][: min(cut, s["labels"].size)] = IGNORE
    return samples


def trie_depth(batch) -> int:
    tree = batch.prefix_tree
    if tree is None:
        return 0
    parents = tree.parents.tolist()
    depth = [0] * len(parents)
    for d, p in enumerate(parents):  # a parent precedes its children
        depth[d] = 0 if p < 0 else depth[p] + 1
    return max(depth[d] + 1 for d in range(len(parents)) if tree.segment_sample[d] < 0)


@st.composite
def trie_cases(draw):
    root = st.tuples(st.integers(1, 8), st.lists(trie_nodes(3), min_size=1, max_size=3))  # a group of 1+ samples
    return dict(tries=draw(st.lists(root, min_size=1, max_size=3)), seed=draw(st.integers(0, 1000)),
                vocab=draw(st.sampled_from([5, 50])), cuts=draw(st.lists(st.integers(0, 12), min_size=1, max_size=3)),
                pad_multiple=draw(st.sampled_from([1, 4, 8])), extra=draw(st.sampled_from([0, 3])),
                min_prefix_len=draw(st.integers(1, 3)), block_size=draw(st.sampled_from([1, 4, (4, 8), (16, 4)])))


# --------------------------------------------------------------------------- layout, targets, masks


def test_a_trie_three_levels_deep():
    s, t = [3, 4, 5], [6, 7]
    samples = [{"input_ids": np.asarray(ids), "group": 0}
               for ids in (s + t + [8, 9], s + t + [10], s + [11, 12, 13], s + t + [10, 14, 15])]
    batch = build_thd_batch(samples, share_prefix="group", min_prefix_len=1)
    tree = batch.prefix_tree
    assert batch.input_ids.tolist() == [3, 4, 5, 6, 7, 8, 9, 10, 14, 15, 11, 12, 13]
    assert batch.seq_lens.tolist() == [3, 2, 2, 1, 0, 2, 3]
    assert document_parents(batch).tolist() == [-1, 0, 1, 1, 3, 3, 0]
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 5, 6, 7, 3, 4, 5]
    assert tree.prefix_lens.tolist() == [5, 6, 3, 6] and trie_depth(batch) == 3
    assert tree.first_rows.tolist() == [4, -1, 2, 7]  # sample 1 ends where its segment starts
    assert_tree_matches_samples(batch, samples)
    assert_block_mask_is_torchs(batch, 2)


@pytest.mark.filterwarnings("ignore:thdpack. a batch of")
@settings(deadline=None, max_examples=60)
@given(trie_cases())
def test_tries_against_the_samples(case):
    """Hypothesis: tries of depth 1-4, branching 1-3, node lengths down to 1 (leaves down to 0), shared
    prefixes that end mid-turn (siblings sharing tokens by chance, prompts cut anywhere), alignment, ``pad_to``."""
    samples = trie_samples(case["tries"], seed=case["seed"], vocab=case["vocab"], cuts=case["cuts"])
    m = case["pad_multiple"]
    pad_to = sum(-(-len(s["input_ids"]) // m) * m for s in samples) + case["extra"] * m
    batch = build_thd_batch(samples, share_prefix="group", min_prefix_len=case["min_prefix_len"], pad_multiple=m,
                            pad_to=pad_to)
    event(f"depth {trie_depth(batch)}")
    if batch.prefix_tree is None:
        return
    assert batch.num_padded_tokens == pad_to and trie_depth(batch) <= MAX_TRIE_DEPTH
    assert_tree_matches_samples(batch, samples)
    assert_block_mask_is_torchs(batch, case["block_size"])
    counts = shared_counts(batch)
    assert all(length >= case["min_prefix_len"] and k >= 2 for length, k in counts)
    assert batch.num_tokens == int(batch.prefix_tree.sample_lens.sum()) - sum((k - 1) * q for q, k in counts)
    real = real_slots(batch)  # FLOPs: twice the real pairs less the real tokens, at any depth
    assert seqlen_squared_sum(batch) == 2 * int(attention_mask_4d(batch)[0, 0][real][:, real].sum()) - batch.num_tokens
    # the planner's budget: every member's share of its group's layout sums to the stream the build lays out
    layout = group_shares(build_thd_batch(samples), samples, "group", case["min_prefix_len"], m)
    shared, slots = layout.shared, layout.slots
    lens = batch.prefix_tree.sample_lens.numpy()
    assert int((lens - shared).sum()) == batch.num_tokens
    segments = batch.seq_lens.numpy().astype(np.int64)
    assert int(slots.sum()) == int((-(-segments // m) * m).sum())  # each segment padded to the multiple


def one_level_samples(spec, seed, prompt_loss, declare):
    """``group_samples`` whose members' first own tokens differ (their trie has one level)."""
    samples = group_samples(spec, seed=seed, vocab=50, prompt_loss=prompt_loss, declare=declare)
    k = 0
    for g, (p, suffixes) in enumerate(spec):
        for c in suffixes:
            if c > 0:
                samples[k]["input_ids"][p] = 60 + k
                if samples[k]["labels"][p] != IGNORE:
                    samples[k]["labels"][p] = 60 + k
            k += 1
    return samples


@pytest.mark.filterwarnings("ignore:thdpack. a batch of")
@settings(deadline=None, max_examples=40)
@given(st.lists(st.tuples(st.integers(0, 9), st.lists(st.integers(0, 5), min_size=1, max_size=4)), min_size=1,
                max_size=4), st.integers(0, 100), st.sets(st.integers(0, 3)), st.booleans(), st.sampled_from([1, 4]),
       st.integers(1, 3))
def test_one_level_tries_give_todays_batch(spec, seed, prompt_loss, declare, multiple, min_prefix_len):
    """The trie path (forced) and the one-level path give the same tensors, dtypes included."""
    samples = one_level_samples(spec, seed, tuple(prompt_loss), declare)
    kw = dict(share_prefix="group", min_prefix_len=min_prefix_len, pad_multiple=multiple)
    today = build_thd_batch(samples, **kw)
    event(f"shared: {today.prefix_tree is not None}")
    if today.prefix_tree is None:  # nothing shared: the unshared batch (the trie path is not reached)
        return
    forced = mock.patch.object(shared_prefix, "trie_segments",
                               lambda *a, **k: trie.trie_segments(*a, **k, always=True))
    with forced:
        via_trie = build_thd_batch(samples, **kw)
    assert trie_depth(today) == 1
    for name in ("input_ids", "labels", "loss_mask", "position_ids", "cu_seqlens", "cu_seqlens_padded", "seq_lens",
                 "sample_index", "source_index"):
        a, b = getattr(today, name), getattr(via_trie, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert today.max_seqlen == via_trie.max_seqlen
    for name in today.prefix_tree.__dataclass_fields__:
        a, b = getattr(today.prefix_tree, name), getattr(via_trie.prefix_tree, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_padding_keeps_one_level_where_a_trie_would_not_save_slots():
    s = list(range(3, 13))
    samples = [{"input_ids": np.asarray(s + tail), "group": 0} for tail in ([20, 21], [20, 22], [30])]
    deep = build_thd_batch(samples, share_prefix="group", min_prefix_len=1)
    assert trie_depth(deep) == 2 and deep.seq_lens.tolist() == [10, 1, 1, 1, 1]
    flat8 = build_thd_batch(samples, share_prefix="group", min_prefix_len=1, pad_multiple=8)
    assert trie_depth(flat8) == 1 and flat8.seq_lens.tolist() == [10, 2, 2, 1]  # a trie: 16+8+8+8+8 > 16+8+8+8


def test_declared_prefix_keeps_one_level():
    s = list(range(3, 40))
    samples = [{"input_ids": np.asarray(s + tail), "group": 0, "prefix_len": 37} for tail in ([20, 21], [20, 22], [30])]
    assert trie_depth(build_thd_batch(samples, share_prefix="group", min_prefix_len=1)) == 1
    for sample in samples:
        del sample["prefix_len"]
    assert trie_depth(build_thd_batch(samples, share_prefix="group", min_prefix_len=1)) == 2


# --------------------------------------------------------------------------- refusals


def chain_samples(levels: int) -> list[dict]:
    """``levels + 1`` samples whose trie is ``levels`` shared segments deep (sample k leaves after level k)."""
    spine = list(range(3, 3 + levels))
    return [{"input_ids": np.asarray(spine[: k + 1] + [100 + k]), "group": 0} for k in range(levels)] + [
        {"input_ids": np.asarray(spine + [200]), "group": 0}]


def test_depth_limit():
    assert trie_depth(build_thd_batch(chain_samples(MAX_TRIE_DEPTH), share_prefix="group", min_prefix_len=1)) == 16
    with pytest.raises(ValueError, match=r"share prefixes more than MAX_TRIE_DEPTH=16 levels deep"):
        build_thd_batch(chain_samples(MAX_TRIE_DEPTH + 1), share_prefix="group", min_prefix_len=1)
    parents = [-1] + list(range(MAX_TRIE_DEPTH + 1))  # a chain of 18 segments: 17 ancestors for the last
    cu, lens = list(range(len(parents) + 1)), [1] * len(parents)
    for build in (dense_tree_mask, tree_block_mask):
        with pytest.raises(ValueError, match=r"segment 17 has more than MAX_TRIE_DEPTH=16 ancestors"):
            build(cu, lens, parents)
    with pytest.raises(ValueError, match=r"segment 1 has parent 1; a parent must be -1 or an earlier segment"):
        dense_tree_mask([0, 1, 2], [1, 1], [-1, 1])


def test_cp_refuses_a_trie_and_hybrids_need_its_segments():
    """CP cannot split a trie; a hybrid runs one only with its segments (``segment_lens`` / ``segment_parents``:
    its layers fork their states, tests/test_rollout_tries_hybrid.py); without them its positions are refused."""
    samples = chain_samples(3)
    with pytest.raises(ValueError, match="cp_size=2: context-parallel attention"):
        build_thd_batch(samples, share_prefix="group", min_prefix_len=1, cp_size=2, cp_rank=0)
    pytest.importorskip("transformers")
    from hybrid_models import available_families, tiny_hybrid
    from thdpack.integrations import packed_model, to_hf_kwargs
    family = "qwen3_5_text"
    if family not in available_families():
        pytest.skip(f"{family} not in this transformers")
    batch = build_thd_batch(samples, share_prefix="group", min_prefix_len=1)
    assert trie_depth(batch) == 3
    model = packed_model(tiny_hybrid(family, "sdpa"))
    kw = to_hf_kwargs(batch, attn_implementation="sdpa", include_labels=False)
    assert kw["segment_parents"].tolist() == batch.prefix_tree.parents.tolist()
    with torch.no_grad(), pytest.raises(ValueError, match="shared-prefix tree cannot be scanned"):
        model(**{k: v for k, v in kw.items() if k not in ("segment_lens", "segment_parents")})


def test_the_collator_counts_a_trie_against_the_pack_budget():
    """A group whose trie fits the pack but whose one-level layout does not lands in one pack, and the plan's
    tokens are the built stream's (the trie's segments, each once)."""
    from thdpack import ThdCollator

    samples = chain_samples(3)
    tree = build_thd_batch(samples, share_prefix="group", min_prefix_len=1)
    assert trie_depth(tree) == 3
    one_level = build_thd_batch([dict(s, prefix_len=1) for s in samples], share_prefix="group", min_prefix_len=1)
    assert tree.num_tokens < one_level.num_tokens
    collate = ThdCollator(share_prefix="group", min_prefix_len=1, pack_size=tree.num_tokens)
    out = collate(samples + [dict(s, group=1) for s in samples])
    assert len(out) == 2 and [b.num_tokens for b in out] == [tree.num_tokens] * 2
    assert out.stats.real_tokens == 2 * tree.num_tokens
    with pytest.raises(ValueError, match=f"has {tree.num_tokens} tokens .* more than pack_size={tree.num_tokens - 1}"):
        ThdCollator(share_prefix="group", min_prefix_len=1, pack_size=tree.num_tokens - 1)(samples)
    from thdpack import plan_balanced
    from thdpack.planning.prefix_budget import SharedLayout

    layout = group_shares(build_thd_batch(samples), samples, "group", 1)
    lengths = [len(s["input_ids"]) for s in samples]
    balanced = plan_balanced(lengths, tree.num_tokens, num_replicas=1, groups=[0] * len(samples), shared_prefix=layout)
    assert len(balanced.plan) == 1 and balanced.plan.stats.real_tokens == tree.num_tokens
    # a group over two packs counts its one-level prefix in each (the members there may share less)
    split = plan_balanced(lengths, tree.num_tokens - 1, num_replicas=1, micro_batches=3, groups=[0] * len(samples),
                          shared_prefix=layout)
    firsts = split.plan.pack_offsets[:-1]
    assert len(split.plan) > 1 and split.plan.shared_length[firsts].tolist() == [0] * len(split.plan)
    assert set(split.plan.shared_length.tolist()) <= {0, int(layout.prefix[0])} and layout.prefix[0] == 1
    with pytest.raises(ValueError, match=r"SharedLayout: sample 0 \(length 2\) has shared=3"):
        plan_packs(lengths, 64, groups=[0] * len(samples), shared_prefix=SharedLayout([3, 0, 0, 0], [2, 2, 2, 2]))


def test_rebalance_counts_a_trie_against_the_pack_budget():
    """``rebalance(share_prefix=...)`` plans each text group as its build lays it out: groups whose tries fit a
    pack (their one-level layouts do not) run in one pack each, built as that pack's samples alone build."""
    from thdpack import rebalance

    samples = [dict(s, group=g, uid=10 * g + i) for g in range(3)
               for i, s in enumerate(trie_samples([DEEP_GROUP], seed=g, vocab=50, cuts=[2]))]
    trees = [build_thd_batch([s for s in samples if s["group"] == g], share_prefix="group", min_prefix_len=1)
             for g in range(3)]
    flat = [build_thd_batch([dict(s, prefix_len=1) for s in samples if s["group"] == g], share_prefix="group",
                            min_prefix_len=1) for g in range(3)]
    pack_size = max(t.num_tokens for t in trees)
    assert all(trie_depth(t) >= 3 for t in trees) and min(f.num_tokens for f in flat) > pack_size
    batches, handle = rebalance(samples, pack_size, share_prefix="group", min_prefix_len=1, sample_values=["uid"])
    real = [b for b, f in zip(batches, handle.filler) if not f]
    assert len(real) == 3 and sorted(u for b in real for u in b.sample_values["uid"].tolist()) == \
        sorted(s["uid"] for s in samples)
    for batch in real:
        ids = batch.sample_index.tolist()
        alone = build_thd_batch([samples[g] for g in ids], share_prefix="group", min_prefix_len=1)
        assert batch.num_padded_tokens <= pack_size and trie_depth(batch) >= 3
        assert torch.equal(batch.input_ids, alone.input_ids) and torch.equal(batch.prefix_tree.parents,
                                                                             alone.prefix_tree.parents)


DEEP_GROUP = (6, [(4, [(3, [(2, []), (3, [])]), (5, [])]), (4, [(2, []), (6, [])])])
