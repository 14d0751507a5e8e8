"""Shared-prefix batches on real transformers models: logits, losses and their gradients equal the
unshared packed computation of the same samples.

Tiny random-weight Qwen3 / Llama (``test_equivalence.tiny_model``: 2 layers, fp32, eval mode), run on
``to_hf_kwargs(attn_implementation=..., include_labels=False)`` with ``use_cache=False``:

- ``flex_attention`` reads the tree ``BlockMask``; ``sdpa`` / ``eager`` the dense 4D mask (FlexAttention
  has no backward on the CPU, so gradients go through sdpa / eager);
- the reference is the *unshared* batch of the same samples (``build_thd_batch`` without ``share_prefix``),
  run on sdpa, whose per-sample equivalence ``tests/test_equivalence.py`` holds;
- compared: the logits at every sample's rows, ``sequence_logps``, ``packed_loss`` (token and sample
  means), ``dpo_loss`` and ``policy_gradient_loss`` (GRPO advantages, off-policy with clipping), and the
  gradients of the losses with respect to every model parameter, float32, < 1e-5 relative.

Every flex run has one stream length (``FLEX_PAD_TO``): transformers compiles flex_attention once.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import test_equivalence as te  # noqa: E402
from test_shared_prefix import IGNORE, group_samples  # noqa: E402
from thdpack import build_thd_batch  # noqa: E402
from thdpack.losses import (dpo_loss, group_advantages, packed_loss, policy_gradient_loss, sequence_logps,  # noqa: E402
                            token_logps)
from thdpack.integrations import to_hf_kwargs


pytestmark = pytest.mark.usefixtures("static_flex_compiles")  # tests/conftest.py


REL = 1e-5
FLEX_PAD_TO = 384


# --------------------------------------------------------------------------- samples and runs


@functools.lru_cache(maxsize=None)
def grpo_samples():
    """Groups of rollouts: prompts over the default minimum (shared), one member equal to its prompt, loss on
    the prompt in group 1, a group whose prompt is too short to share, a sample alone; advantages."""
    spec = [(40, [6, 0, 11, 3]), (34, [9, 2, 5]), (10, [4, 7]), (12, [8])]
    samples = group_samples(spec, seed=5, vocab=te.VOCAB, prompt_loss=(1,))
    rewards = np.random.default_rng(1).normal(size=len(samples))
    advantages = group_advantages(rewards, [s["group"] for s in samples])
    for s, a in zip(samples, advantages.tolist()):
        s["advantage"] = a
    return samples


@functools.lru_cache(maxsize=None)
def dpo_samples():
    """Three preference pairs (rows 2k chosen, 2k+1 rejected) sharing their prompts, declared."""
    samples = group_samples([(36, [7, 3]), (33, [1, 12]), (45, [5, 5])], seed=9, vocab=te.VOCAB, declare=True)
    return samples


def batches(samples, **layout):
    kw = dict(sample_values=["advantage"]) if "advantage" in samples[0] else {}
    return build_thd_batch(samples, **kw), build_thd_batch(samples, share_prefix="group", **kw, **layout)


def logits_of(model, batch, attn, grad=False):
    with torch.set_grad_enabled(grad):
        return model(**to_hf_kwargs(batch, attn_implementation=attn, include_labels=False), use_cache=False).logits[0]


def flat_rows(batch) -> torch.Tensor:
    """Rows of every sample's real tokens in an unshared batch, samples in order."""
    cu, lens = batch.cu_seqlens_padded.tolist(), batch.seq_lens.tolist()
    return torch.cat([torch.arange(a, a + s) for a, s in zip(cu, lens)])


def assert_close_rel(got, want, what: str) -> None:
    scale = want.abs().max().clamp_min(1e-30)
    err = float((got - want).abs().max() / scale)
    assert err < REL, f"{what}: relative error {err:.2e}"


# --------------------------------------------------------------------------- forward: logits and log-probs


@pytest.mark.parametrize("attn", ["sdpa", "eager", "flex_attention"])
@pytest.mark.parametrize("family", te.FAMILIES)
def test_logits_and_logps_equal_unshared(family, attn):
    if attn == "flex_attention" and family != "qwen3":
        pytest.skip("one flex compile: the tree BlockMask is the same for every family")
    flat, tree = batches(grpo_samples(), **({"pad_to": FLEX_PAD_TO} if attn == "flex_attention" else {}))
    assert tree.prefix_tree.prefix_lens.tolist() == [40] * 4 + [34] * 3 + [0] * 3
    assert tree.num_tokens < flat.num_tokens - 100
    want = logits_of(te.tiny_model(family, "sdpa"), flat, "sdpa")
    got = logits_of(te.tiny_model(family, attn), tree, attn)
    diff = (got[tree.prefix_tree.unshared_rows] - want[flat_rows(flat)]).abs().max().item()
    assert diff < te.LOGIT_ATOL, f"max |logit diff| {diff:.3g}"
    assert_close_rel(sequence_logps(got, tree)[0], sequence_logps(want, flat)[0], "sequence_logps")
    assert torch.equal(sequence_logps(got, tree)[1], sequence_logps(want, flat)[1])
    assert_close_rel(token_logps(got, tree), token_logps(want, flat)[flat.loss_mask], "token_logps")
    for reduction in ("token", "sample"):
        assert_close_rel(packed_loss(got, tree, reduction), packed_loss(want, flat, reduction), reduction)


# --------------------------------------------------------------------------- gradients


def parameter_grads(model, loss_of, batch, attn):
    params = [p for p in model.parameters()]
    loss = loss_of(logits_of(model, batch, attn, grad=True), batch)
    return loss.detach(), torch.autograd.grad(loss, params)


def assert_same_grads(model, loss_of, flat, tree, attn, what):
    want_loss, want = parameter_grads(model, loss_of, flat, attn)  # the model's own backend
    got_loss, got = parameter_grads(model, loss_of, tree, attn)
    assert_close_rel(got_loss, want_loss, f"{what} loss")
    assert_close_rel(torch.cat([g.reshape(-1) for g in got]), torch.cat([g.reshape(-1) for g in want]),
                     f"{what} gradient")


def off_policy(logps: torch.Tensor, batch) -> torch.Tensor:
    """Old log-probs: the current ones moved by a fixed amount per target (every 3rd clipped), per target
    in the order of the unshared batch, laid out as ``token_logps`` of ``batch`` gives them."""
    n = batch.num_targets
    shift = torch.tensor([0.5, -0.4, 0.05])[torch.arange(n) % 3].to(logps.dtype)
    if batch.prefix_tree is not None:
        return logps.detach() + shift
    out = logps.detach().clone()
    out[batch.loss_mask] += shift
    return out


def grpo_loss(reduction):
    def loss(logits, batch):
        logps = token_logps(logits, batch)
        adv = batch.token_values("advantage")
        return policy_gradient_loss(logits, batch, adv, reduction, old_logps=off_policy(logps, batch), clip=0.2)
    return loss


SFT_AND_GRPO = {
    "sequence_logps": lambda logits, batch: (sequence_logps(logits, batch)[0] * torch.linspace(
        -1, 2, batch.num_samples)).sum(),
    "packed_loss token": lambda logits, batch: packed_loss(logits, batch, "token", num_items=50),
    "packed_loss sample": lambda logits, batch: packed_loss(logits, batch, "sample"),
    "grpo token": grpo_loss("token"),
    "grpo sample": grpo_loss("sample"),
}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", te.FAMILIES)
def test_gradients_equal_unshared(family, attn):
    flat, tree = batches(grpo_samples(), pad_multiple=8)
    model = te.tiny_model(family, attn)
    for what, loss_of in SFT_AND_GRPO.items():
        assert_same_grads(model, loss_of, flat, tree, attn, what)


@pytest.mark.parametrize("family", te.FAMILIES)
def test_dpo_loss_and_gradient_equal_unshared(family):
    samples = dpo_samples()
    flat, tree = batches(samples)
    assert tree.prefix_tree.prefix_lens.tolist() == [36, 36, 33, 33, 45, 45]
    model = te.tiny_model(family, "sdpa")
    reference = sequence_logps(logits_of(model, flat, "sdpa"), flat)[0] + torch.tensor([0.3, -0.2, 0.1, 0.4, -0.5, 0.0])

    def loss_of(logits, batch):
        return dpo_loss(sequence_logps(logits, batch)[0], reference, batch, beta=0.5)

    assert_same_grads(model, loss_of, flat, tree, "sdpa", "dpo")


# --------------------------------------------------------------------------- hypothesis


@st.composite
def model_cases(draw):
    groups = draw(st.lists(st.tuples(st.integers(0, 12), st.lists(st.integers(0, 6), min_size=1, max_size=4)),
                           min_size=1, max_size=3))
    return dict(spec=groups, seed=draw(st.integers(0, 100)), prompt_loss=tuple(draw(st.sets(st.integers(0, 2)))),
                pad_multiple=draw(st.sampled_from([1, 4])), min_prefix_len=draw(st.integers(1, 3)))


@pytest.mark.filterwarnings("ignore:thdpack. a batch of")
@settings(deadline=None, max_examples=12)
@given(model_cases())
def test_random_groups_on_qwen3(case):
    """Hypothesis: group sizes, prefix lengths (0; a member equal to the prefix), prompt losses, alignment:
    the tree's log-probs and token-mean loss are the unshared batch's (sdpa, dense tree mask)."""
    samples = group_samples(case["spec"], seed=case["seed"], vocab=te.VOCAB, prompt_loss=case["prompt_loss"])
    flat = build_thd_batch(samples)
    tree = build_thd_batch(samples, share_prefix="group", min_prefix_len=case["min_prefix_len"],
                           pad_multiple=case["pad_multiple"])
    model = te.tiny_model("qwen3", "sdpa")
    want, got = logits_of(model, flat, "sdpa"), logits_of(model, tree, "sdpa")
    rows = tree.prefix_tree.unshared_rows if tree.prefix_tree is not None else flat_rows(tree)
    assert (got[rows] - want[flat_rows(flat)]).abs().max().item() < te.LOGIT_ATOL
    assert_close_rel(sequence_logps(got, tree)[0], sequence_logps(want, flat)[0], "sequence_logps")
    if flat.num_targets:
        assert_close_rel(packed_loss(got, tree), packed_loss(want, flat), "token mean")
