"""Rollout tries on hybrid models (issue 46 point 3): through ``packed_model``, every linear-attention, SSM and
convolution layer runs each trie segment from its parent's final state (thdpack/integrations/hybrid/state_forks.py),
so every sample's logits equal the sample run alone, and the token-mean loss, per-sample log-probs and every
parameter's gradient equal the unshared batch's (itself equal to the samples alone: tests/test_hybrid.py),
< 1e-5 relative, tiny random models of every registered family (tests/hybrid_models.py).

Precision: transformers' Gated DeltaNet scan computes in float32 whatever the weights, and a trie moves its
chunk boundaries (a segment starts a chunk), so in float32 a small, cancelling gradient (Qwen3.5's ``dt_bias``,
2% of the largest) differs from the sample alone by rounding, up to 3e-5 of its own size, and the whole gradient
by up to 1.1e-5 of the largest (eager, padded). So: every family in float32 (the user's dtype), each gradient
judged against the model's largest; the property and layout tests in float64 weights with that scan's float32
casts made float64 (:func:`exact_scans`), each parameter judged on its own scale (floored at 1% of the largest).
A state not carried moves logits by 1e-2 and more.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hypothesis import HealthCheck, given, settings  # noqa: E402

from hybrid_models import VOCAB, available_families, tiny_hybrid  # noqa: E402
from test_rollout_tries import trie_depth, trie_samples  # noqa: E402
from test_rollout_tries_models import (  # noqa: E402
    DEEP, FLEX_PAD_TO, WIDE, assert_case_exact, assert_close_rel, assert_loss_and_grads_equal, assert_rows_equal_alone,
    model_tries,
)
from test_shared_prefix_models import flat_rows, logits_of  # noqa: E402
from thdpack import build_thd_batch  # noqa: E402
from thdpack.integrations import packed_model, to_hf_kwargs  # noqa: E402
from thdpack.integrations.hybrid import state_forks  # noqa: E402

pytestmark = pytest.mark.usefixtures("static_flex_compiles")  # tests/conftest.py

FAMILIES = available_families()
# one family per layer kind: Gated DeltaNet (conv + delta rule), Mamba-2 (conv + SSD scan), short convolution
MAIN = [f for f in ("qwen3_5_text", "bamba", "lfm2") if f in FAMILIES]


def hybrid(family: str, attn: str = "sdpa", dtype: torch.dtype = torch.float32):
    """A fresh prepared tiny model."""
    return packed_model(tiny_hybrid.__wrapped__(family, attn).to(dtype))


@pytest.fixture
def exact_scans(monkeypatch):
    """transformers' Gated DeltaNet scans with their float32 casts made float64, for float64 models (the module
    docstring): their own source, re-executed."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as gdn

    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        monkeypatch.setattr(gdn, name, _in_float64(gdn, name))


def deep_batches(**layout):
    """The depth-4 trie of ``DEEP`` (a one-token leaf under a two-token turn: shorter than every convolution)
    and its unshared batch."""
    samples = trie_samples(DEEP, seed=7, vocab=VOCAB, cuts=[3])
    tree = build_thd_batch(samples, share_prefix="group", min_prefix_len=1, **layout)
    assert trie_depth(tree) == 4
    return samples, tree, build_thd_batch(samples)


def assert_trie_exact(model, samples, tree, flat, attn: str = "sdpa", grads: bool = True,
                      floor_fraction: float = 1.0) -> None:
    assert_rows_equal_alone(model, tree, logits_of(model, tree, attn), samples)
    if grads and flat.num_targets:
        assert_loss_and_grads_equal(model, flat, tree, attn, floor_fraction)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_forks_its_state_on_a_deep_trie(family):
    """Every registered family: Zamba2's one-token step clamps its time step unlike its prefill (a one-token
    segment runs after its parent's tokens), Jamba's Mamba-1 scan ignores a cache's state (its segments replay
    their paths)."""
    samples, tree, flat = deep_batches()
    assert_trie_exact(hybrid(family), samples, tree, flat)


@pytest.mark.parametrize("family", MAIN)
@pytest.mark.filterwarnings("ignore:thdpack. a batch of")
@settings(deadline=None, max_examples=8, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=model_tries())
def test_hybrid_tries_equal_each_sample_alone(family, case, exact_scans):
    """Tries of depth 1-4 (branching 2-3, segments down to one token, prompts cut anywhere, alignment pads)."""
    assert_case_exact(lambda: hybrid(family, dtype=torch.float64), "sdpa", case, vocab=min(case["vocab"], VOCAB))


@pytest.mark.parametrize("family", MAIN)
def test_eager_attention_and_a_static_tail(family, exact_scans):
    """Eager's additive tree mask, segments padded to 4 and a ``pad_to`` tail: pad slots enter no state."""
    samples, tree, flat = deep_batches(pad_multiple=4, pad_to=96)
    assert tree.num_padded_tokens == 96
    assert_trie_exact(hybrid(family, "eager", torch.float64), samples, tree, flat, "eager", floor_fraction=0.01)


def test_flex_attention_on_a_hybrid_trie():
    """The tree ``BlockMask`` goes to the attention layers as a per-layer-type mask (forward: FlexAttention has no
    backward on the CPU)."""
    family = "nemotron_h"  # Mamba-2 layers; transformers' Qwen3.5 does not support flex_attention
    if family not in FAMILIES or not getattr(type(tiny_hybrid(family)), "_supports_flex_attn", False):
        pytest.skip(f"{family} does not support flex_attention in this transformers")
    samples, tree, flat = deep_batches(pad_to=FLEX_PAD_TO)
    model = hybrid(family, "flex_attention")
    got = logits_of(model, tree, "flex_attention")
    assert_rows_equal_alone(model, tree, got, samples)
    want = logits_of(hybrid(family), flat, "sdpa")
    assert_close_rel(got[tree.prefix_tree.unshared_rows], want[flat_rows(flat)], "logits vs the unshared batch")


@pytest.mark.parametrize("family", [f for f in ("qwen3_5_text", "bamba") if f in FAMILIES])
def test_training_mode_with_gradient_checkpointing(family, exact_scans):
    """``model.train()`` and gradient checkpointing: each layer's forward runs again in the backward, its segments
    forking their states again."""
    samples, tree, flat = deep_batches()
    model = hybrid(family, dtype=torch.float64).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert_loss_and_grads_equal(model, flat, tree, "sdpa", floor_fraction=0.01)


def test_a_wide_trie_with_declared_cuts(exact_scans):
    samples = trie_samples(WIDE, seed=7, vocab=VOCAB, cuts=[0, 4, 9])
    tree = build_thd_batch(samples, share_prefix="group", min_prefix_len=1)
    assert trie_depth(tree) == 3
    model = hybrid("qwen3_5_text", dtype=torch.float64)
    assert_trie_exact(model, samples, tree, build_thd_batch(samples), floor_fraction=0.01)


def test_gradients_reach_a_prefix_from_every_branch(exact_scans):
    """A prefix's hidden states get the sum of their branches' gradients: the trie's gradient with respect to the
    input embeddings of a shared row is the sum of that row's gradients in every sample alone."""
    samples, tree, flat = deep_batches()
    model = hybrid("qwen3_5_text", dtype=torch.float64)
    embed = model.get_input_embeddings()
    kw = to_hf_kwargs(tree, attn_implementation="sdpa", include_labels=False)
    inputs = embed(kw.pop("input_ids")).detach().requires_grad_(True)
    logits = model(inputs_embeds=inputs, **kw, use_cache=False).logits[0]
    rows = tree.prefix_tree.unshared_rows
    weights = torch.randn(rows.numel(), logits.shape[-1], generator=torch.Generator().manual_seed(0),
                          dtype=logits.dtype)
    (grad,) = torch.autograd.grad((logits[rows] * weights).sum(), inputs)
    want = torch.zeros_like(grad[0])
    start = 0
    for s, r in zip(samples, torch.split(rows, tree.prefix_tree.sample_lens.tolist())):
        alone = embed(torch.as_tensor(s["input_ids"])[None]).detach().requires_grad_(True)
        out = model(inputs_embeds=alone, use_cache=False).logits[0]
        (g,) = torch.autograd.grad((out * weights[start:start + r.numel()]).sum(), alone)
        want.index_add_(0, r, g[0])
        start += r.numel()
    shared = torch.bincount(rows, minlength=grad.shape[1]) > 1
    assert bool(shared.any())
    assert_close_rel(grad[0], want, "input gradients, summed over the branches")


def _in_float64(module, name: str):
    """``module.name`` re-executed from its source with ``torch.float32`` read as ``torch.float64``."""
    text = open(module.__file__).read()
    start = text.index(f"\ndef {name}(") + 1
    end = min(i for i in (text.find("\ndef ", start), text.find("\nclass ", start), text.find("\n@", start)) if i > 0)
    namespace = dict(vars(module))
    exec(compile(text[start:end].replace("torch.float32", "torch.float64"), module.__file__, "exec"), namespace)
    return namespace[name]


# --------------------------------------------------------------------------- broken on purpose


def test_a_branch_started_from_a_zero_state_is_caught(monkeypatch):
    monkeypatch.setattr(state_forks.ForkCache, "get_recurrent_state", lambda self, layer_idx, state_idx=0: None)
    samples, tree, flat = deep_batches()
    for family in ("qwen3_5_text", "bamba"):
        with pytest.raises(AssertionError, match="logits"):
            assert_trie_exact(hybrid(family), samples, tree, flat, grads=False)


def test_convolution_inputs_carried_off_by_one_are_caught(monkeypatch):
    real = state_forks.ForkCache.update_conv_state

    def shifted(self, conv_states, layer_idx, state_idx=0, conv_kernel_size=None, **kwargs):
        full = real(self, conv_states, layer_idx, state_idx, conv_kernel_size, **kwargs)
        window = torch.nn.functional.pad(full, (1, 0))[..., :-1]  # the window one input too early
        self.conv[state_idx] = window[..., -conv_kernel_size:]
        return full

    monkeypatch.setattr(state_forks.ForkCache, "update_conv_state", shifted)
    samples, tree, flat = deep_batches()
    with pytest.raises(AssertionError, match="logits"):
        assert_trie_exact(hybrid("lfm2"), samples, tree, flat, grads=False)


# --------------------------------------------------------------------------- refusals


def test_a_malformed_trie_call_is_refused():
    samples, tree, _ = deep_batches()
    model = hybrid("qwen3_5_text")
    kw = to_hf_kwargs(tree, attn_implementation="sdpa", include_labels=False)
    parents = kw["segment_parents"].clone()
    parents[1] = 3
    with torch.no_grad():
        with pytest.raises(ValueError, match="segment 1 has parent 3; a parent must be -1 or an earlier segment"):
            model(**dict(kw, segment_parents=parents))
        moved = kw["position_ids"].clone()
        moved[0, int(kw["cu_seq_lens_q"][2])] += 1
        with pytest.raises(ValueError, match="continues its parent .* at position"):
            model(**dict(kw, position_ids=moved))
        with pytest.raises(ValueError, match="needs cu_seq_lens_q, segment_lens and segment_parents together"):
            model(**{k: v for k, v in kw.items() if k != "segment_lens"})
        no_mask = {k: v for k, v in kw.items() if k != "attention_mask"}
        model.config._attn_implementation = "flash_attention_2"
        try:
            with pytest.raises(ValueError, match="cannot attend to a trie's ancestors"):
                model(**no_mask)
        finally:
            model.config._attn_implementation = "sdpa"


def test_a_trie_call_without_a_mask_gets_the_tree_mask():
    """``to_hf_kwargs()`` without ``attn_implementation`` cannot carry a tree mask; a prepared model builds it."""
    samples, tree, _ = deep_batches()
    model = hybrid("bamba")
    kw = to_hf_kwargs(tree, attn_implementation="sdpa", include_labels=False)
    with torch.no_grad():
        got = model(**{k: v for k, v in kw.items() if k != "attention_mask"}, use_cache=False).logits[0]
    assert_rows_equal_alone(model, tree, got, samples)
