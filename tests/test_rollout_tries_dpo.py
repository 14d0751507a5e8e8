"""DPO on rollout tries (issue 46, point 4) on a tiny random Qwen3 (``test_equivalence.tiny_model``, float32).

Preference pairs laid out as ``thdpack.losses.pair_groups`` says (row ``2k`` chosen, ``2k+1`` rejected, the
rows in ``batch.sample_index``) whose prompts share prefixes at several levels: one conversation's pairs
share its system prompt and first turn, then part ways; a pair's chosen and rejected share the whole prompt
and part of the answer. ``build_thd_batch(..., share_prefix="group")`` lays each conversation out as a
trie; pairs that share nothing (a prompt too short to share, or each row its own group) are laid out alone.

Against the unshared batch of the same samples (itself equal to the samples alone,
``tests/test_equivalence.py``; the fixed cases also against each sample run alone through the model, no
thdpack): ``sequence_logps`` of every chosen / rejected (policy and reference), and ``dpo_loss`` with the
reference log-probs from a frozen copy of the model (the usual DPO setup: the copy taken before the policy
moved, run under ``torch.no_grad()`` on the same batch) and the gradient of every policy parameter,
< 1e-5 relative (a parameter's gradient judged against at least 1% of the largest), sdpa and eager (the
dense tree mask). Rows are given in a shuffled order with their dataset rows as ``sample_index``: pairs are
found by row, wherever the trie puts their samples.
"""

from __future__ import annotations

import copy
import functools
from typing import NamedTuple

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import test_equivalence as te  # noqa: E402
from test_rollout_tries import trie_depth  # noqa: E402
from test_rollout_tries_models import assert_close_rel  # noqa: E402
from test_shared_prefix import IGNORE  # noqa: E402
from test_shared_prefix_models import logits_of  # noqa: E402
from thdpack import build_thd_batch  # noqa: E402
from thdpack.losses import dpo_loss, sequence_logps  # noqa: E402

BETA = 0.5
FLOOR_FRACTION = 0.01  # a parameter's gradient judged against at least 1% of the largest (a vanishing one: noise)


# --------------------------------------------------------------------------- preference pairs as conversations


class Pair(NamedTuple):
    """A preference pair after its prompt: ``answer`` tokens its chosen and rejected share at the start of
    their answers, then ``chosen`` / ``rejected`` own answer tokens; targets: the answers, and the prompt from
    token ``loss_from`` on (None: no prompt token; e.g. an earlier assistant turn scored)."""

    answer: int
    chosen: int
    rejected: int
    loss_from: int | None = None


def conversation_pairs(convs, *, seed: int, vocab: int = te.VOCAB) -> list[dict]:
    """Rows of the pairs of ``convs``, pair by pair (row ``2k`` chosen, ``2k+1`` rejected).

    ``convs``: ``[(group, node), ...]``; a node ``(turns, children)`` is a list of turns' token counts, then
    children: nodes (branches of the conversation after these turns) or :class:`Pair` (a pair whose prompt is
    every turn on the path to it). ``group``: the share_prefix group of the conversation's rows, or
    ``"alone"``: every row its own group. Tokens are random per turn (siblings may share some by chance).
    """
    rng = np.random.default_rng(seed)
    draw = lambda n: rng.integers(3, vocab, n).tolist()  # noqa: E731
    rows = []

    def walk(node, prompt, group):
        turns, children = node
        prompt = prompt + [t for n in turns for t in draw(n)]
        for child in children:
            if not isinstance(child, Pair):
                walk(child, prompt, group)
                continue
            shared = draw(child.answer)
            for own in (child.chosen, child.rejected):
                ids = np.asarray((prompt + shared + draw(own)) or draw(1), np.int64)
                labels = ids.copy()
                labels[: len(prompt) if child.loss_from is None else min(child.loss_from, len(prompt))] = IGNORE
                rows.append({"input_ids": ids, "labels": labels,
                             "group": 10_000 + len(rows) if group == "alone" else group})

    for group, node in convs:
        walk(node, [], group)
    return rows


def shuffled(rows, seed: int) -> list[int]:
    """A random order of ``rows`` (``seed`` -1: as they are): the dataset rows, ``sample_index``."""
    order = np.random.default_rng(seed).permutation(len(rows)) if seed >= 0 else np.arange(len(rows))
    return order.tolist()


# A conversation (system prompt 5) whose pairs 0 and 1 share its first turn (user 4, assistant 5) and part at
# the second user turn (pair 0's chosen and rejected share 3 answer tokens, pair 1's none), pair 2 parts after
# the system prompt (its answers share 2 tokens); a pair too short to share (min_prefix_len 3); a pair each of
# whose rows is its own group; a second conversation, one level, loss on its first reply.
MULTI_TURN = [
    (0, ([5], [([4, 5], [([3], [Pair(3, 4, 2)]), ([4], [Pair(0, 3, 5)])]), ([3], [Pair(2, 3, 3)])])),
    (1, ([2], [Pair(0, 3, 4)])),
    ("alone", ([6, 3], [Pair(2, 2, 3)])),
    (2, ([4, 3, 4, 2], [Pair(1, 3, 2, loss_from=7)])),
]


def multi_turn_rows(seed: int = 11) -> list[dict]:
    return conversation_pairs(MULTI_TURN, seed=seed)


# --------------------------------------------------------------------------- models and the loss


@functools.lru_cache(maxsize=None)
def policy_and_reference(attn: str):
    """The policy (the tiny model moved off its initial weights, as after some steps) and the reference: a
    frozen copy taken before it moved. Both copies: ``te.tiny_model`` is cached, shared with other modules."""
    policy = copy.deepcopy(te.tiny_model("qwen3", attn))
    reference = copy.deepcopy(policy).requires_grad_(False)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    return policy, reference


def dpo_step(policy, reference, batch, attn: str):
    """Per-sample policy and reference log-probs, target counts, the DPO loss and its gradient."""
    with torch.no_grad():
        ref_logps = sequence_logps(logits_of(reference, batch, attn), batch)[0]
    logps, counts = sequence_logps(logits_of(policy, batch, attn, grad=True), batch)
    loss = dpo_loss(logps, ref_logps, batch, beta=BETA)
    grads = torch.autograd.grad(loss, list(policy.parameters()))
    return dict(logps=logps.detach(), ref_logps=ref_logps, counts=counts, loss=loss.detach(), grads=grads)


def assert_same_dpo(got: dict, want: dict, policy) -> None:
    assert torch.equal(got["counts"], want["counts"]), "target counts per sample"
    assert_close_rel(got["logps"], want["logps"], "policy sequence_logps")
    assert_close_rel(got["ref_logps"], want["ref_logps"], "reference sequence_logps")
    assert_close_rel(got["loss"], want["loss"], "dpo loss")
    flat_got = torch.cat([g.reshape(-1) for g in got["grads"]])
    flat_want = torch.cat([w.reshape(-1) for w in want["grads"]])
    assert_close_rel(flat_got, flat_want, "dpo gradient")
    floor = FLOOR_FRACTION * float(flat_want.abs().max())
    for (name, _), g, w in zip(policy.named_parameters(), got["grads"], want["grads"]):
        assert_close_rel(g, w, f"dpo gradient of {name}", floor)


def batches(rows, order, **layout):
    """The unshared and the trie batch of ``rows`` given in ``order`` (dataset rows as ``sample_index``)."""
    samples = [rows[i] for i in order]
    flat = build_thd_batch(samples, sample_index=order)
    return flat, build_thd_batch(samples, sample_index=order, share_prefix="group", **layout)


# --------------------------------------------------------------------------- fixed multi-level cases


def alone_dpo(policy, reference, rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """No thdpack: every row run alone, its shifted labels' log-probs summed, DPO pair by pair (rows in
    dataset order). Returns (policy logps, reference logps, loss)."""
    def logps_alone(model, row):
        ids = torch.as_tensor(row["input_ids"])[None]
        logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0, :-1], -1)
        labels = torch.as_tensor(row["labels"])[1:]
        keep = labels != IGNORE
        return logp[keep].gather(1, labels[keep, None]).sum()

    with torch.no_grad():
        ref = torch.stack([logps_alone(reference, r) for r in rows])
        pol = torch.stack([logps_alone(policy, r) for r in rows])
    margin = (pol[0::2] - ref[0::2]) - (pol[1::2] - ref[1::2])
    return pol, ref, -torch.nn.functional.logsigmoid(BETA * margin).mean()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("order_seed", [-1, 3], ids=["in-order", "shuffled"])
def test_multi_turn_pairs_on_a_trie(attn, order_seed):
    """``MULTI_TURN``: DPO and its gradient as unshared, and the log-probs and loss as the rows alone."""
    rows = multi_turn_rows()
    order = shuffled(rows, order_seed)
    flat, tree = batches(rows, order, min_prefix_len=3)
    assert trie_depth(tree) == 3
    pt = tree.prefix_tree
    by_row = {r: j for j, r in enumerate(order)}
    prefix = [int(pt.prefix_lens[by_row[r]]) for r in range(len(rows))]
    # pair 0: its whole prompt (5+4+5+3) and 3 answer tokens; pair 1: its prompt (5+4+5+4); pair 2: its prompt
    # (5+3) and 2 answer tokens; pair 3 too short (2 < 3), pair 4 its own groups: alone; conversation 2: 13+1
    assert prefix == [20, 20, 18, 18, 10, 10, 0, 0, 0, 0, 14, 14]
    assert tree.num_tokens < flat.num_tokens - 40
    policy, reference = policy_and_reference(attn)
    want, got = dpo_step(policy, reference, flat, attn), dpo_step(policy, reference, tree, attn)
    assert_same_dpo(got, want, policy)
    pol, ref, loss = alone_dpo(policy, reference, rows)
    assert_close_rel(got["logps"][[by_row[r] for r in range(len(rows))]], pol, "policy logps vs each row alone")
    assert_close_rel(got["ref_logps"][[by_row[r] for r in range(len(rows))]], ref, "reference logps vs alone")
    assert_close_rel(got["loss"], loss, "dpo loss vs the pairs alone")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_pairs_sharing_nothing_give_the_unshared_batch(attn):
    """A preference batch in which no group shares (prompts under ``min_prefix_len``, or every row its own
    group) is the plain unshared batch, and DPO reads it as such."""
    rows = conversation_pairs([(0, ([2], [Pair(1, 2, 3)])), ("alone", ([5], [Pair(2, 3, 1)])),
                               (1, ([1, 1], [Pair(0, 4, 2)]))], seed=4)
    flat, tree = batches(rows, shuffled(rows, 2), min_prefix_len=4)
    assert tree.prefix_tree is None and torch.equal(tree.input_ids, flat.input_ids)
    policy, reference = policy_and_reference(attn)
    assert_same_dpo(dpo_step(policy, reference, tree, attn), dpo_step(policy, reference, flat, attn), policy)


def test_a_broken_trie_is_caught():
    """The comparison is not vacuous: the trie batch with one pair's chosen and rejected swapped (its
    ``sample_index`` only), or one target dropped from its table, gives another loss / log-probs."""
    rows = multi_turn_rows()
    flat, tree = batches(rows, shuffled(rows, -1), min_prefix_len=3)
    policy, reference = policy_and_reference("sdpa")
    want = dpo_step(policy, reference, flat, "sdpa")
    swapped = copy.copy(tree)
    swapped.sample_index = tree.sample_index.clone()
    swapped.sample_index[[0, 1]] = swapped.sample_index[[1, 0]]
    with pytest.raises(AssertionError, match="dpo loss"):
        assert_same_dpo(dpo_step(policy, reference, swapped, "sdpa"), want, policy)
    pt = tree.prefix_tree
    keep = torch.ones(pt.num_targets, dtype=torch.bool)
    keep[int(torch.nonzero(pt.target_samples == 2)[1])] = False  # pair 1's chosen, a target in its answer
    dropped = copy.copy(tree)
    dropped.prefix_tree = pt.map(lambda t: t)
    for name in ("target_rows", "target_labels", "target_samples"):
        setattr(dropped.prefix_tree, name, getattr(pt, name)[keep])
    got = dpo_step(policy, reference, dropped, "sdpa")
    assert not torch.equal(got["counts"], want["counts"])
    with pytest.raises(AssertionError, match="sequence_logps"):
        assert_close_rel(got["logps"], want["logps"], "policy sequence_logps")


# --------------------------------------------------------------------------- hypothesis


@st.composite
def dpo_tries(draw):
    """Conversations of 1-4 pairs: 1-3 turns per node, nodes two levels deep, shared answer tokens 0-3, own
    answers 0-4 (not both empty), sometimes loss on earlier turns; some conversations each row its own group;
    rows shuffled; alignment and minimum prefix drawn."""
    pair = st.builds(lambda a, c, r, loss_from: Pair(a, c, max(r, int(c == 0)), loss_from), st.integers(0, 3),
                     st.integers(0, 4), st.integers(0, 4), st.one_of(st.none(), st.integers(0, 8)))
    turns = st.lists(st.integers(1, 5), min_size=1, max_size=3)
    branch = st.tuples(turns, st.lists(pair, min_size=1, max_size=2))
    root = st.tuples(turns, st.lists(st.one_of(pair, branch), min_size=1, max_size=3))
    conv = st.tuples(st.sampled_from([0, 1, "alone"]), root)
    return dict(convs=draw(st.lists(conv, min_size=1, max_size=2)), seed=draw(st.integers(0, 1000)),
                order_seed=draw(st.integers(-1, 1000)), pad_multiple=draw(st.sampled_from([1, 4])),
                min_prefix_len=draw(st.integers(1, 3)))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.filterwarnings("ignore:thdpack. a batch of")
@settings(deadline=None, max_examples=10, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=dpo_tries())
def test_random_preference_tries(attn, case):
    """Hypothesis: conversations of pairs (two with one group id are one trie, their prompts sharing tokens
    only by chance), pairs alone, rows shuffled: DPO loss, log-probs and gradients as unshared."""
    rows = conversation_pairs(case["convs"], seed=case["seed"])
    flat, tree = batches(rows, shuffled(rows, case["order_seed"]), min_prefix_len=case["min_prefix_len"], pad_multiple=case["pad_multiple"])
    event(f"depth {trie_depth(tree)}")
    policy, reference = policy_and_reference(attn)
    assert_same_dpo(dpo_step(policy, reference, tree, attn), dpo_step(policy, reference, flat, attn), policy)
