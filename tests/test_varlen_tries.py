"""Rollout tries on thdpack's varlen backend (issue 46 point 2, the varlen half): ``to_hf_kwargs(tree,
attn_implementation="thdpack_varlen")`` runs a trie as one varlen call over gathered keys, each segment's queries
against its ancestors' real keys and its own, causal bottom-right (thdpack/attention/trie_varlen.py).

On the CPU the backend runs its exact reference (SDPA per segment with the bottom-right mask), so a tiny Qwen3
(float32) gives every sample its logits alone, and the token-mean loss, ``sequence_logps`` and every gradient of
the unshared batch, < 1e-5 relative (tests/test_rollout_tries_models.py's checks); a hybrid (Qwen3.5, through
``packed_model``) gives every sample its logits alone. The attention function equals SDPA over the dense tree
mask, and the kernel call (CUDA only) is checked with a stand-in computing what flash's varlen kernel documents
for ``seqlen_q < seqlen_k`` (bottom-right). Break: a gather that leaves the root's keys out moves the logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from hypothesis import HealthCheck, given, settings  # noqa: E402

import test_equivalence as te  # noqa: E402
from test_rollout_tries import trie_depth, trie_samples  # noqa: E402
from test_rollout_tries_models import (  # noqa: E402
    DEEP, WIDE, assert_case_exact, assert_close_rel, assert_loss_and_grads_equal, assert_rows_equal_alone,
    model_tries,
)
from test_rollout_tries_hybrid import exact_scans  # noqa: E402,F401 (a fixture)
from test_shared_prefix_models import flat_rows, logits_of  # noqa: E402
from thdpack import build_thd_batch  # noqa: E402
from thdpack.attention import trie_varlen  # noqa: E402
from thdpack.attention.tree_mask import dense_tree_mask  # noqa: E402
from thdpack.integrations import packed_model, register_varlen_attention, to_hf_kwargs  # noqa: E402
from thdpack.integrations import varlen_attention as va  # noqa: E402
from thdpack.losses import packed_loss, sequence_logps  # noqa: E402

NAME = register_varlen_attention()


def tree_of(spec, cuts, vocab=te.VOCAB, **layout):
    samples = trie_samples(spec, seed=7, vocab=vocab, cuts=cuts)
    return samples, build_thd_batch(samples, share_prefix="group", min_prefix_len=1, **layout)


# --------------------------------------------------------------------------- the attention function


@pytest.mark.parametrize("spec, cuts, layout", [(DEEP, [0], {}), (DEEP, [0], {"pad_multiple": 4, "pad_to": 128}),
                                                (WIDE, [0, 4, 9], {"pad_multiple": 2})])
def test_the_attention_function_is_the_tree_mask(spec, cuts, layout):
    """Every slot of every segment (its pad slots too) as SDPA over the dense tree mask; gradients of the queries,
    keys and values too (every branch's reaches the shared rows); no slot NaN."""
    _, tree = tree_of(spec, cuts, **layout)
    assert trie_depth(tree) >= 3
    kw = to_hf_kwargs(tree, attn_implementation=NAME, include_labels=False)
    T = tree.input_ids.numel()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, T, 8, generator=g, dtype=torch.float64, requires_grad=True) for n in (4, 2, 2))
    trie = {key: kw[key] for key in ("cu_seq_lens_q", "cu_seq_lens_k", "segment_lens", "segment_parents")}
    got, weights = va.varlen_attention_forward(torch.nn.Module(), q, k, v, None, scaling=0.3, **trie)
    mask = dense_tree_mask(tree.cu_seqlens_padded, tree.seq_lens, tree.prefix_tree.parents, T)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True).transpose(1, 2)
    assert weights is None and got.shape == (1, T, 4, 8) and bool(torch.isfinite(got).all())
    end = int(tree.cu_seqlens_padded[-1])
    torch.testing.assert_close(got[:, :end], want[:, :end], rtol=1e-12, atol=1e-12)
    upstream = torch.randn(got[:, :end].shape, generator=g, dtype=torch.float64)
    got_grads = torch.autograd.grad(got[:, :end], (q, k, v), upstream)
    want_grads = torch.autograd.grad(want[:, :end], (q, k, v), upstream)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_gather_index_is_built_once_per_call(monkeypatch):
    """One index per forward, whatever the layers (and reused while the call's tensors are unchanged)."""
    built = []
    real = trie_varlen.varlen_trie
    monkeypatch.setattr(trie_varlen, "varlen_trie", lambda *a, **k: built.append(1) or real(*a, **k))
    _, tree = tree_of(DEEP, [3])
    model = te.tiny_model("qwen3", NAME)
    assert model.config.num_hidden_layers >= 2
    kw = to_hf_kwargs(tree, attn_implementation=NAME, include_labels=False)
    with torch.no_grad():
        model(**kw, use_cache=False)
        assert len(built) == 1
        model(**kw, use_cache=False)
        assert len(built) == 1
        model(**dict(kw, segment_parents=kw["segment_parents"].clone()), use_cache=False)
    assert len(built) == 2


def _flash_stand_in(signature: str):
    """A ``varlen_attn`` in torch 2.11's or 2.13's signature computing what flash's varlen kernel documents: query
    ``i`` of a ``Lq``-long sequence attends keys ``j`` of its ``Lk``-long one with ``i + Lk - Lq - left <= j <=
    i + Lk - Lq + right`` (causal: ``right = 0``, bottom-right)."""
    calls = []

    def attend(query, key, value, cu_q, cu_k, scale, left, right):
        out = torch.zeros_like(query)
        for (a, b), (c, e) in zip(zip(cu_q.tolist(), cu_q.tolist()[1:]), zip(cu_k.tolist(), cu_k.tolist()[1:])):
            i, j = torch.arange(b - a)[:, None], torch.arange(e - c)[None, :]
            shift = (e - c) - (b - a)
            mask = (j <= i + shift + right) if right >= 0 else torch.ones(b - a, e - c, dtype=torch.bool)
            if left >= 0:
                mask &= j >= i + shift - left
            qs, ks, vs = (t[x:y].transpose(0, 1) for t, x, y in ((query, a, b), (key, c, e), (value, c, e)))
            ks, vs = (t.repeat_interleave(qs.shape[0] // t.shape[0], 0) for t in (ks, vs))
            scores = (qs @ ks.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
            out[a:b] = (scores.softmax(-1) @ vs).transpose(0, 1)
        return out

    if signature == "2.11":
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, is_causal=False):
            calls.append((max_q, max_k, is_causal))
            return attend(query, key, value, cu_seq_q, cu_seq_k, scale, -1, 0 if is_causal else -1)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                        enable_gqa=False):
            calls.append((max_q, max_k, window_size == (-1, 0)))
            return attend(query, key, value, cu_seq_q, cu_seq_k, scale, *window_size)
    return varlen_attn, calls


@pytest.mark.parametrize("signature", ["2.11", "2.13"])
def test_the_kernel_call_on_a_trie(monkeypatch, signature):
    """What CUDA runs: the gathered keys with their own offsets, causal, against the reference."""
    import torch.nn.attention.varlen as torch_varlen

    fake, calls = _flash_stand_in(signature)
    monkeypatch.setattr(torch_varlen, "varlen_attn", fake)
    _, tree = tree_of(DEEP, [0], pad_multiple=4)
    T = tree.input_ids.numel()
    trie = trie_varlen.varlen_trie(tree.cu_seqlens_padded, tree.seq_lens, tree.prefix_tree.parents, T)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(T, n, 8, generator=g) for n in (4, 2, 2))
    k, v = trie_varlen.gather_keys(k, v, trie)
    got = va._varlen_kernel(q, k, v, trie.cu_q, trie.max_q, 0.25, True, None, cu_k=trie.cu_k, max_k=trie.max_k)
    torch.testing.assert_close(got, trie_varlen.trie_reference(q, k, v, trie, 0.25), rtol=1e-5, atol=1e-6)
    assert calls == [(trie.max_q, trie.max_k, True)] and trie.max_k > trie.max_q


# --------------------------------------------------------------------------- models


@pytest.mark.filterwarnings("ignore:thdpack. a batch of")
@settings(deadline=None, max_examples=10, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=model_tries())
def test_tries_equal_each_sample_alone(case):
    assert_case_exact(lambda: te.tiny_model("qwen3", NAME), NAME, case)


@pytest.mark.parametrize("name, spec, cuts, depth, layout", [
    ("deep", DEEP, [3], 4, {"pad_to": 128}), ("wide", WIDE, [0, 4, 9], 3, {"pad_multiple": 2}),
])
def test_fixed_tries_equal_the_unshared_batch(name, spec, cuts, depth, layout):
    samples, tree = tree_of(spec, cuts, **layout)
    assert trie_depth(tree) == depth
    flat = build_thd_batch(samples)
    model = te.tiny_model("qwen3", NAME)
    got = logits_of(model, tree, NAME)
    assert_rows_equal_alone(model, tree, got, samples)
    want = logits_of(te.tiny_model("qwen3", "sdpa"), flat, "sdpa")
    assert_close_rel(got[tree.prefix_tree.unshared_rows], want[flat_rows(flat)], "logits vs the unshared batch")
    assert_close_rel(packed_loss(got, tree), packed_loss(want, flat), "token mean")
    assert_close_rel(sequence_logps(got, tree)[0], sequence_logps(want, flat)[0], "sequence_logps")
    assert_loss_and_grads_equal(model, flat, tree, NAME)


def test_a_hybrid_on_the_varlen_backend():
    """Qwen3.5 through packed_model: its Gated DeltaNet layers fork their states, its attention layers gather."""
    from hybrid_models import VOCAB, available_families, tiny_hybrid

    if "qwen3_5_text" not in available_families():
        pytest.skip("this transformers has no Qwen3.5")
    samples, tree = tree_of(DEEP, [3], vocab=VOCAB)
    model = packed_model(tiny_hybrid.__wrapped__("qwen3_5_text", NAME))
    assert "full_attention" in model.config.layer_types
    assert_rows_equal_alone(model, tree, logits_of(model, tree, NAME), samples)


def test_a_hybrids_gradients_on_the_varlen_backend(exact_scans):
    """Qwen3.5's loss, log-probs and every parameter's gradient on the trie equal the unshared batch's, both on
    the varlen backend: float64 weights with the Gated DeltaNet scan's float32 casts made float64 (its rounding
    otherwise: tests/test_rollout_tries_hybrid.py)."""
    from hybrid_models import VOCAB, available_families, tiny_hybrid

    if "qwen3_5_text" not in available_families():
        pytest.skip("this transformers has no Qwen3.5")
    samples, tree = tree_of(DEEP, [3], vocab=VOCAB)
    model = packed_model(tiny_hybrid.__wrapped__("qwen3_5_text", NAME).to(torch.float64))
    assert_loss_and_grads_equal(model, build_thd_batch(samples), tree, NAME, floor_fraction=0.01)


def test_a_gather_without_an_ancestor_is_caught(monkeypatch):
    """Break on purpose: every non-root segment's gather leaves its root's keys out."""
    real = trie_varlen.ancestor_table

    def without_root(parents):
        anc, depth = real(parents)
        anc = anc.clone()
        anc[depth > 0, 0] = -1
        return anc, depth

    monkeypatch.setattr(trie_varlen, "ancestor_table", without_root)
    samples, tree = tree_of(DEEP, [3])
    model = te.tiny_model("qwen3", NAME)
    with pytest.raises(AssertionError, match="logits"):
        assert_rows_equal_alone(model, tree, logits_of(model, tree, NAME), samples)


# --------------------------------------------------------------------------- refusals


def test_other_varlen_kernels_are_still_refused_and_what_the_trie_cannot_do():
    _, tree = tree_of(DEEP, [3])
    for other in (None, "flash_attention_2", "flash_attention_3", "kernels-community/flash-attn3"):
        with pytest.raises(ValueError, match="cannot express a shared-prefix batch .*'thdpack_varlen'"):
            to_hf_kwargs(tree, attn_implementation=other)
    kw = to_hf_kwargs(tree, attn_implementation=NAME, include_labels=False)
    assert "attention_mask" not in kw and kw["segment_parents"].shape == kw["segment_lens"].shape
    T = tree.input_ids.numel()
    q = torch.randn(1, 2, T, 8)
    trie = {key: kw[key] for key in ("cu_seq_lens_q", "segment_lens", "segment_parents")}
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="sliding-window layer cannot read them"):
        va.varlen_attention_forward(module, q, q, q, None, sliding_window=4, **trie)
    with pytest.raises(ValueError, match="needs cu_seq_lens_q, segment_lens and segment_parents together"):
        va.varlen_attention_forward(module, q, q, q, None, segment_lens=kw["segment_lens"])
    module.is_causal = False
    with pytest.raises(ValueError, match="non-causal layer cannot read them"):
        va.varlen_attention_forward(module, q, q, q, None, **trie)
