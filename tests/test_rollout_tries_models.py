"""Rollout tries (issue 46, first part) on a tiny random Qwen3 (``test_equivalence.tiny_model``, float32):
every sample's logits at its rows (``prefix_tree.unshared_rows``) equal the sample run alone, and the
token-mean loss, per-sample log-probs and every parameter's gradient equal the unshared batch's (itself
equal to the samples alone: ``tests/test_equivalence.py``), < 1e-5 relative.

sdpa / eager read the dense tree mask (hypothesis: tries of depth 1-4); flex_attention the tree
``BlockMask`` (two fixed tries, one stream length: one compile; FlexAttention has no backward on the CPU,
so its gradients are not taken here). A parameter's gradient is judged against at least 1% of the largest
(one that vanishes, as layer 0's queries when every target row sees one key, is rounding noise).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import test_equivalence as te  # noqa: E402
from test_rollout_tries import trie_depth, trie_nodes, trie_samples  # noqa: E402
from test_shared_prefix_models import flat_rows, logits_of  # noqa: E402
from thdpack import build_thd_batch  # noqa: E402
from thdpack.losses import packed_loss, sequence_logps  # noqa: E402

pytestmark = pytest.mark.usefixtures("static_flex_compiles")  # tests/conftest.py

REL = 1e-5
FLEX_PAD_TO = 128
DEEP = [(8, [(5, [(3, [(2, [(1, []), (2, [])]), (4, [])]), (6, [])]), (7, [])]), (6, [(0, []), (5, [])])]
WIDE = [(3, [(1, [(1, []), (1, []), (3, [])]), (2, [(2, []), (0, [])]), (4, [])])]


def assert_close_rel(got, want, what: str, floor: float = 1e-30) -> None:
    err = float((got - want).abs().max() / want.abs().max().clamp_min(floor))
    assert err < REL, f"{what}: relative error {err:.2e}"


def assert_rows_equal_alone(model, tree, logits, samples) -> None:
    rows = torch.split(tree.prefix_tree.unshared_rows, tree.prefix_tree.sample_lens.tolist())
    with torch.no_grad():
        for j, (s, r) in enumerate(zip(samples, rows)):
            alone = model(input_ids=torch.as_tensor(s["input_ids"])[None], use_cache=False).logits[0]
            assert_close_rel(logits[r], alone, f"sample {j} logits")


def token_mean(logits, batch):
    return packed_loss(logits, batch, "token")


def assert_loss_and_grads_equal(model, flat, tree, attn, floor_fraction: float = 0.01) -> None:
    """Loss, log-probs and gradients of ``tree`` equal ``flat``'s; each parameter's gradient judged against at
    least ``floor_fraction`` of the model's largest."""
    params = list(model.parameters())
    out = []
    for batch in (flat, tree):
        logits = logits_of(model, batch, attn, grad=True)
        loss = token_mean(logits, batch)
        out.append((loss.detach(), sequence_logps(logits, batch)[0].detach(), torch.autograd.grad(loss, params)))
    (want_loss, want_logps, want), (got_loss, got_logps, got) = out
    assert_close_rel(got_loss, want_loss, "token-mean loss")
    assert_close_rel(got_logps, want_logps, "sequence_logps")
    assert_close_rel(torch.cat([g.reshape(-1) for g in got]), torch.cat([w.reshape(-1) for w in want]), "gradient")
    floor = floor_fraction * max(float(w.abs().max()) for w in want)  # a parameter whose gradient (nearly) vanishes: its noise
    for p, g, w in zip(model.named_parameters(), got, want):
        assert_close_rel(g, w, f"gradient of {p[0]}", floor)


def assert_case_exact(model_of, attn: str, case: dict, *, vocab: int | None = None,
                      floor_fraction: float = 0.01) -> None:
    """A :func:`model_tries` case (tokens below ``vocab`` where given): where it makes a trie, every sample's
    logits on ``model_of()`` equal the sample alone, and its loss, log-probs and gradients the unshared batch's."""
    samples = trie_samples(case["tries"], seed=case["seed"], vocab=case["vocab"] if vocab is None else vocab,
                           cuts=case["cuts"])
    tree = build_thd_batch(samples, share_prefix="group", min_prefix_len=case["min_prefix_len"],
                           pad_multiple=case["pad_multiple"])
    event(f"depth {trie_depth(tree)}")
    if tree.prefix_tree is None:
        return
    flat = build_thd_batch(samples)
    model = model_of()
    assert_rows_equal_alone(model, tree, logits_of(model, tree, attn), samples)
    if flat.num_targets:
        assert_loss_and_grads_equal(model, flat, tree, attn, floor_fraction)


@st.composite
def model_tries(draw):
    root = st.tuples(st.integers(1, 6), st.lists(trie_nodes(3), min_size=2, max_size=3))
    return dict(tries=draw(st.lists(root, min_size=1, max_size=2)), seed=draw(st.integers(0, 1000)),
                vocab=draw(st.sampled_from([4, te.VOCAB])), cuts=draw(st.lists(st.integers(0, 8), min_size=1,
                                                                                 max_size=2)),
                pad_multiple=draw(st.sampled_from([1, 4])), min_prefix_len=draw(st.integers(1, 2)))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.filterwarnings("ignore:thdpack. a batch of")
@settings(deadline=None, max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=model_tries())
def test_tries_equal_each_sample_alone(attn, case):
    assert_case_exact(lambda: te.tiny_model("qwen3", attn), attn, case)


@pytest.mark.parametrize("attn, spec, cuts, depth", [
    pytest.param(attn, spec, cuts, depth, id=f"{name}-{attn}")
    for name, spec, cuts, depth in (("deep", DEEP, [3], 4), ("wide", WIDE, [0, 4, 9], 3))
    for attn in ("sdpa", "eager", "flex_attention") if not (name == "wide" and attn == "flex_attention")
])  # flex compiles per shape (seconds each on 2 CPUs): the deeper trie alone
def test_fixed_tries_on_every_mask(spec, cuts, depth, attn):
    """Prompts cut inside the root (deep) or per sample, splitting where targets differ (wide)."""
    samples = trie_samples(spec, seed=7, vocab=te.VOCAB, cuts=cuts)
    flex = attn == "flex_attention"
    tree = build_thd_batch(samples, share_prefix="group", min_prefix_len=1, **({"pad_to": FLEX_PAD_TO} if flex else {}))
    assert trie_depth(tree) == depth
    flat = build_thd_batch(samples)
    model = te.tiny_model("qwen3", attn)
    got = logits_of(model, tree, attn)
    assert_rows_equal_alone(model, tree, got, samples)
    want = logits_of(te.tiny_model("qwen3", "sdpa"), flat, "sdpa")
    assert_close_rel(got[tree.prefix_tree.unshared_rows], want[flat_rows(flat)], "logits vs the unshared batch")
    assert_close_rel(packed_loss(got, tree), packed_loss(want, flat), "token mean")
    assert_close_rel(sequence_logps(got, tree)[0], sequence_logps(want, flat)[0], "sequence_logps")
    if not flex:
        assert_loss_and_grads_equal(model, flat, tree, attn)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_rl_losses_read_a_trie_as_the_unshared_batch(attn):
    """Issue 46 point 4: the sample-mean loss and the GRPO policy-gradient loss (group-normalised
    advantages carried as a per-sample value, token and sample reductions) and their gradients are the
    same on a depth-4 trie as on the unshared batch."""
    from thdpack.losses import group_advantages, policy_gradient_loss

    samples = trie_samples(DEEP, seed=7, vocab=te.VOCAB, cuts=[3])
    rewards = torch.linspace(-1.0, 2.0, len(samples))
    advantages = group_advantages(rewards, [0] * (len(samples) // 2) + [1] * (len(samples) - len(samples) // 2))
    samples = [dict(s, advantage=float(a)) for s, a in zip(samples, advantages)]
    flat = build_thd_batch(samples, sample_values=["advantage"])
    tree = build_thd_batch(samples, share_prefix="group", min_prefix_len=1, sample_values=["advantage"])
    assert trie_depth(tree) == 4
    model = te.tiny_model("qwen3", attn)
    params = list(model.parameters())
    losses = {}
    for name, batch in (("flat", flat), ("tree", tree)):
        logits = logits_of(model, batch, attn, grad=True)
        values = [packed_loss(logits, batch, "sample")]
        values += [policy_gradient_loss(logits, batch, batch.token_values("advantage"), reduction)
                   for reduction in ("token", "sample")]
        losses[name] = [(v.detach(), torch.autograd.grad(v, params, retain_graph=True)) for v in values]
    for what, (want, want_g), (got, got_g) in zip(("sample-mean loss", "GRPO token", "GRPO sample"),
                                                  losses["flat"], losses["tree"]):
        assert_close_rel(got, want, what)
        assert_close_rel(torch.cat([g.reshape(-1) for g in got_g]), torch.cat([w.reshape(-1) for w in want_g]),
                         f"{what} gradient")
