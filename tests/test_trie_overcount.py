"""The over-count of a shared-prefix batch counted unshared (issue 46 point 5): ``trie_overcount``.

The reference is written from the samples: each sample's path through the batch (its segments, leaf to root,
whose stream tokens put together are the sample's tokens) gives its prefix lengths at every level
``0 = e₀ < e₁ < ... < e_k = L``; level ``i`` costs ``e_i² − e_{i−1}²`` (``Σ sᵢ²`` convention: the level's
queries against everything above them, causally), split evenly among the samples whose paths hold it (the
sample's share). Every sample's shares added up must be the tree's count, the shares of tokens the tokens laid
out, and the whole levels (no split) the unshared ``Σ Lⱼ²``. A one-level trie's numbers are the one-level
layout's (``Σ Lⱼ² − (k − 1)·p²``).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from test_rollout_tries import trie_depth, trie_nodes, trie_samples
from thdpack import build_thd_batch
from thdpack.flops.overcount import TrieOvercount, trie_overcount


@st.composite
def tries(draw):
    root = st.tuples(st.integers(1, 8), st.lists(trie_nodes(3), min_size=1, max_size=3))
    return dict(tries=draw(st.lists(root, min_size=1, max_size=3)), seed=draw(st.integers(0, 1000)),
                vocab=draw(st.sampled_from([5, 50])), cuts=draw(st.lists(st.integers(0, 12), min_size=1, max_size=3)),
                pad_multiple=draw(st.sampled_from([1, 4])), min_prefix_len=draw(st.integers(1, 3)))


def sample_paths(batch, samples) -> list[list[int]]:
    """Every sample's segments, root first, checked against its tokens."""
    tree = batch.prefix_tree
    parents, lens, cu = tree.parents.tolist(), batch.seq_lens.tolist(), batch.cu_seqlens_padded.tolist()
    ids = batch.input_ids.reshape(-1)
    paths = []
    for j, s in enumerate(samples):
        path, d = [], int(tree.sample_segment[j])
        while d >= 0:
            path.append(d)
            d = parents[d]
        path.reverse()
        tokens = np.concatenate([ids[cu[d]:cu[d] + lens[d]].numpy() for d in path])
        np.testing.assert_array_equal(tokens, np.asarray(s["input_ids"]), err_msg=f"sample {j}'s path")
        paths.append(path)
    return paths


def shares(batch, samples) -> tuple[Fraction, Fraction, int]:
    """``(Σ of every sample's share of the attention, Σ of its share of the tokens, Σ of whole levels)``."""
    paths = sample_paths(batch, samples)
    lens = batch.seq_lens.tolist()
    sharers: dict[int, int] = {}
    for path in paths:
        for d in path:
            sharers[d] = sharers.get(d, 0) + 1
    attention, tokens, whole = Fraction(0), Fraction(0), 0
    for path in paths:
        ends = np.cumsum([0] + [lens[d] for d in path]).tolist()  # the prefix lengths at every level
        for level, d in enumerate(path):
            work = ends[level + 1] ** 2 - ends[level] ** 2
            attention += Fraction(work, sharers[d])
            tokens += Fraction(lens[d], sharers[d])
            whole += work
    return attention, tokens, whole


@pytest.mark.filterwarnings("ignore:thdpack. a batch of")
@settings(deadline=None, max_examples=80)
@given(tries())
def test_the_trie_count_is_the_sum_of_the_samples_shares(case):
    samples = trie_samples(case["tries"], seed=case["seed"], vocab=case["vocab"], cuts=case["cuts"])
    batch = build_thd_batch(samples, share_prefix="group", min_prefix_len=case["min_prefix_len"],
                            pad_multiple=case["pad_multiple"])
    if batch.prefix_tree is None:  # no group shares min_prefix_len tokens: nothing over-counted
        with pytest.raises(ValueError, match="shared-prefix batch"):
            trie_overcount(batch)
        event("no prefix tree")
        return
    report = trie_overcount(batch)
    event(f"depth {report.depth}")
    attention, tokens, whole = shares(batch, samples)
    lengths = [len(s["input_ids"]) for s in samples]
    assert report.attention == attention  # the tree's Σ: every sample's share put together
    assert report.tokens == tokens == int(batch.seq_lens.sum())
    assert report.unshared_attention == whole == sum(n * n for n in lengths)
    assert report.unshared_tokens == sum(lengths)
    assert report.samples == len(samples) and report.segments == batch.seq_lens.numel()
    assert report.depth == max(len(path) for path in sample_paths(batch, samples))
    assert report.token_overcount >= 1 and report.attention_overcount >= 1


@settings(deadline=None, max_examples=40)
@given(st.lists(st.tuples(st.integers(1, 12), st.lists(st.integers(1, 9), min_size=2, max_size=5)), min_size=1,
                max_size=3), st.integers(0, 1000))
def test_a_depth_one_trie_is_the_one_level_shared_prefix(groups, seed):
    """Groups of a prompt of ``p`` tokens and members of ``cⱼ`` own tokens (each member's first one its own):
    the trie's report equals the declared one-level prefix's, and ``Σ Lⱼ² − (k − 1)·p²``."""
    rng = np.random.default_rng(seed)
    samples, want_attention, want_tokens = [], 0, 0
    for g, (p, own) in enumerate(groups):
        prompt = rng.integers(3, 50, p).tolist()
        for k, c in enumerate(own):
            ids = prompt + [50 + k] + rng.integers(3, 50, c - 1).tolist()  # members part at their first own token
            samples.append({"input_ids": ids, "labels": ids, "group": g, "prefix_len": p})
        want_attention += sum((p + c) ** 2 for c in own) - (len(own) - 1) * p * p
        want_tokens += p + sum(own)
    one_level = build_thd_batch(samples, share_prefix="group", min_prefix_len=1)
    as_trie = build_thd_batch([{k: v for k, v in s.items() if k != "prefix_len"} for s in samples],
                              share_prefix="group", min_prefix_len=1)
    got, want = trie_overcount(as_trie), trie_overcount(one_level)
    assert got == want
    assert (got.attention, got.tokens, got.depth) == (want_attention, want_tokens, 2)
    assert got.shared_segments == len(groups)
    assert got.attention_overcount >= 1 and got.token_overcount >= 1


def test_a_batch_without_a_prefix_tree_is_refused():
    samples = trie_samples([(4, [(3, []), (2, [])])], seed=1)
    with pytest.raises(ValueError, match="shared-prefix batch"):
        trie_overcount(build_thd_batch(samples))
    with pytest.raises(ValueError, match="shared-prefix batch"):
        trie_overcount(object())


def test_the_model_count_and_the_text_report():
    transformers = pytest.importorskip("transformers")
    from thdpack.flops import model_flops, tree_length_count
    from thdpack.batching import document_parents

    samples = trie_samples([(6, [(4, [(2, []), (3, [])]), (5, [])]), (3, [(1, []), (2, [])])], seed=3)
    batch = build_thd_batch(samples, share_prefix="group", min_prefix_len=1)
    assert trie_depth(batch) == 2
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                                   use_sliding_window=True)
    report = trie_overcount(batch, cfg)
    assert isinstance(report, TrieOvercount)
    name = "window_square_sum[4]"
    tree_count = tree_length_count(batch.seq_lens, document_parents(batch), name)
    assert report.length_counts[name][0] == tree_count
    assert report.model_flops == model_flops(cfg, report.tokens, report.attention, counts={name: tree_count})
    assert report.model_overcount > 1
    text = "\n".join(report.lines())
    assert "over-count" in text and name in text and "model" in text
    assert trie_overcount(batch).model_flops is None and trie_overcount(batch).model_overcount is None
