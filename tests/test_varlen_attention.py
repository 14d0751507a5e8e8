"""PyTorch's varlen kernel as a transformers attention backend (``register_varlen_attention``), issue 31.

On the CPU the backend runs its exact per-sample reference, so these tests hold it to the equivalence rule
through the call a user makes: a tiny Qwen3 / Llama / Qwen2.5-VL built with ``attn_implementation=name`` gives on
the pack the logits, loss and parameter gradients of each sample alone through SDPA (the same weights), with
static shapes and sliding windows too. The kernel call itself (CUDA only) is checked against both of torch's
signatures (2.11: ``is_causal``; 2.13: ``window_size``, ``enable_gqa``) with stand-ins that compute attention the
way the documented kernel does.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import test_equivalence as te  # noqa: E402
import test_vlm as tv  # noqa: E402
from thdpack import build_thd_batch  # noqa: E402
from thdpack.attention.backends import VARLEN_ATTENTION, attention_kind  # noqa: E402
from thdpack.integrations import register_varlen_attention  # noqa: E402
from thdpack.integrations import varlen_attention as va  # noqa: E402
from thdpack.vlm import get_family  # noqa: E402
from thdpack.integrations import to_hf_kwargs  # noqa: E402

NAME = register_varlen_attention()
GRAD_ATOL = 1e-5


def _text_config(family: str, attn: str, window: int | None):
    common = dict(vocab_size=te.VOCAB, **te.TINY_TEXT, max_position_embeddings=512, initializer_range=0.2,
                  attn_implementation=attn)
    if window is not None:  # one windowed layer, one full one
        common.update(sliding_window=window, layer_types=["sliding_attention", "full_attention"],
                      use_sliding_window=True)
    cls = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}[family]
    return cls(**common)


@functools.lru_cache(maxsize=None)
def text_models(family: str, window: int | None = None):
    """The same random weights twice: with the varlen backend, and with SDPA (the reference run alone)."""
    cls = {"qwen3": transformers.Qwen3ForCausalLM, "llama": transformers.LlamaForCausalLM}[family]
    torch.manual_seed(1234)
    varlen = cls(_text_config(family, NAME, window)).float().eval()
    sdpa = cls(_text_config(family, "sdpa", window)).float().eval()
    sdpa.load_state_dict(varlen.state_dict())
    assert varlen.config._attn_implementation == NAME
    return varlen, sdpa


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def assert_pack_equals_alone(model, reference, batch, samples, run_alone=None):
    """Logits of each sample, the token-mean loss and every parameter gradient of the packed step equal each
    sample alone through ``reference`` (its losses summed over tokens, divided by the pack's target count)."""
    out = model(**to_hf_kwargs(batch, attn_implementation=NAME))  # the model's own defaults: use_cache as configured
    out.loss.backward()
    packed_grads = _grads(model)
    targets = int(batch.loss_mask.sum())
    total = 0.0
    for i, sample in enumerate(samples):
        a, s = int(batch.cu_seqlens_padded[i]), int(batch.seq_lens[i])
        with torch.enable_grad():
            logits = _alone_logits(reference, sample, run_alone)
            labels = te.reference_hf_labels(sample)
            ce = F.cross_entropy(logits[:-1], labels[1:], ignore_index=te.IGNORE, reduction="sum")
            (ce / targets).backward()
        total += float(ce.detach())
        diff = (out.logits[0, a:a + s] - logits).abs().max().item()
        assert diff < te.LOGIT_ATOL, f"sample {i}: max |logit diff| {diff:.3g}"
    torch.testing.assert_close(out.loss, torch.tensor(total / targets), rtol=0, atol=te.LOSS_ATOL)
    alone_grads = _grads(reference)
    assert packed_grads.keys() == alone_grads.keys() and packed_grads
    for name, g in packed_grads.items():
        torch.testing.assert_close(g, alone_grads[name], rtol=0, atol=GRAD_ATOL, msg=name)


def _alone_logits(reference, sample, run_alone):
    if run_alone is not None:
        return run_alone(reference, sample)
    ids = te._as_long(sample["input_ids"])
    return reference(input_ids=ids[None], use_cache=False).logits[0]


def _samples(lengths, seed=0):
    return te.prompt_masked_samples(lengths, [min(2, n - 1) for n in lengths], seed=seed)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("layout", [{}, {"pad_multiple": 8}, {"max_num_seqs": 16, "pad_to": 96}],
                         ids=["plain", "aligned", "static"])
def test_text_models_on_the_pack_equal_each_sample_alone(family, layout):
    samples = _samples(te.MIXED_LENGTHS)
    batch = build_thd_batch(samples, **layout)
    if "max_num_seqs" in layout:  # static offsets: [M+1], zero-length sequences at the end
        kw = to_hf_kwargs(batch, attn_implementation=NAME)
        assert kw["cu_seq_lens_q"].shape == (17,) and kw["max_length_q"] == 96
    assert_pack_equals_alone(*text_models(family), batch, samples)


def test_sliding_window_layers_equal_each_sample_alone():
    samples = _samples([3, 12, 1, 9, 15])
    assert_pack_equals_alone(*text_models("qwen3", window=4), build_thd_batch(samples), samples)


def _vlm_alone(model, sample):
    ids = torch.as_tensor(sample["input_ids"]).reshape(1, -1)
    kw = {k: torch.as_tensor(sample[k]) for k in ("pixel_values", "image_grid_thw", "pixel_values_videos",
                                                   "video_grid_thw") if k in sample}
    if "second_per_grid_ts" in sample:
        kw["second_per_grid_ts"] = sample["second_per_grid_ts"]
    return model(input_ids=ids, mm_token_type_ids=tv.token_types(ids), use_cache=False, **kw).logits[0]


def test_qwen2_5_vl_on_the_pack_equals_each_sample_alone():
    """Text layers through the varlen offsets, the vision tower's per-image calls without offsets."""
    cfg = tv.tiny_config("qwen2_5_vl")
    torch.manual_seed(1234)
    reference = transformers.Qwen2_5_VLForConditionalGeneration(cfg).float().eval()
    cfg_varlen = tv.tiny_config("qwen2_5_vl")
    cfg_varlen._attn_implementation = NAME
    for sub in ("text_config", "vision_config"):
        getattr(cfg_varlen, sub)._attn_implementation = NAME
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg_varlen).float().eval()
    model.load_state_dict(reference.state_dict())
    assert model.model.visual.config._attn_implementation == NAME
    samples = tv.mixed_samples("qwen2_5_vl")
    batch = build_thd_batch(samples, vlm=get_family(model.config), pad_multiple=4)
    assert_pack_equals_alone(model, reference, batch, samples, run_alone=_vlm_alone)


def _dense_reference(q, k, v, cu, causal, window, scale):
    """Attention of ``[T, h, d]`` tensors through one ``[T, T]`` block mask (the test's own, not the backend's)."""
    T = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(torch.as_tensor(cu)))
    i = torch.arange(T)
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask &= i[None, :] <= i[:, None]
    if window is not None:
        mask &= i[None, :] > i[:, None] - window
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                          scale=scale, enable_gqa=True).transpose(0, 1)


@st.composite
def _attention_case(draw):
    lengths = draw(st.lists(st.integers(1, 9), min_size=1, max_size=5))
    empty = draw(st.integers(0, 3))  # static offsets: zero-length sequences at the end
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    cu += [cu[-1]] * empty
    kv = draw(st.sampled_from([1, 2, 4]))
    causal = draw(st.booleans())
    window = draw(st.sampled_from([None, 1, 3])) if causal else None
    return cu, kv, causal, window, draw(st.integers(0, 2**16))


@given(_attention_case())
@settings(max_examples=40, deadline=None)
def test_attention_function_equals_a_block_mask(case):
    cu, kv, causal, window, seed = case
    g = torch.Generator().manual_seed(seed)
    T, h, d = cu[-1], 4, 8
    q, k, v = (torch.randn(1, n, T, d, generator=g, dtype=torch.float64) for n in (h, kv, kv))
    module = torch.nn.Module()
    module.is_causal = causal
    out, weights = va.varlen_attention_forward(module, q, k, v, None, scaling=0.3, sliding_window=window,
                                               cu_seq_lens_q=torch.tensor(cu, dtype=torch.int32),
                                               cu_seq_lens_k=torch.tensor(cu, dtype=torch.int32), max_length_q=T)
    want = _dense_reference(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, causal, window, 0.3)
    assert weights is None and out.shape == (1, T, h, d)
    torch.testing.assert_close(out[0], want, rtol=1e-12, atol=1e-12)


def _stand_in(signature: str):
    """A ``varlen_attn`` with torch 2.11's (``is_causal``) or 2.13's (``window_size``, ``enable_gqa``) signature
    that computes what the kernel documents, through the test's own block mask."""
    calls = []
    if signature == "2.11":
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, is_causal=False):
            calls.append({"is_causal": is_causal})
            assert key.shape[1] == query.shape[1], "2.11 has no GQA: the backend repeats the key / value heads"
            return _dense_reference(query, key, value, cu_seq_q.tolist(), is_causal, None, scale)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                        enable_gqa=False):
            calls.append({"window_size": window_size, "enable_gqa": enable_gqa})
            assert enable_gqa == (key.shape[1] != query.shape[1])
            left, right = window_size
            causal = right == 0
            return _dense_reference(query, key, value, cu_seq_q.tolist(), causal, None if left < 0 else left + 1,
                                    scale)
    return varlen_attn, calls


@pytest.mark.parametrize("signature", ["2.11", "2.13"])
@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (True, 3)])
def test_the_kernel_call_in_either_signature(monkeypatch, signature, causal, window):
    import torch.nn.attention.varlen as torch_varlen

    fake, calls = _stand_in(signature)
    monkeypatch.setattr(torch_varlen, "varlen_attn", fake)
    cu = torch.tensor([0, 5, 6, 13, 13], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(13, n, 8, generator=g) for n in (4, 2, 2))
    if window is not None and signature == "2.11":
        assert not va._kernel_takes(window)  # no window in 2.11: the reference runs it
        return
    assert va._kernel_takes(window)
    got = va._varlen_kernel(q, k, v, cu, 7, 0.25, causal, window)
    torch.testing.assert_close(got, va._reference(q, k, v, cu, 0.25, causal, window), rtol=1e-5, atol=1e-6)
    assert calls == ([{"is_causal": causal}] if signature == "2.11" else
                     [{"window_size": ((-1 if window is None else window - 1), 0) if causal else (-1, -1),
                       "enable_gqa": True}])


def test_what_neither_path_can_do_is_refused_by_name():
    module = torch.nn.Module()
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"^attn_implementation='thdpack_varlen' has no attention dropout"):
        va.varlen_attention_forward(module, q, q, q, None, dropout=0.1)
    with pytest.raises(ValueError, match=r"^attn_implementation='thdpack_varlen' reads sample boundaries from "
                                         r"cu_seq_lens_q/k, not an attention_mask"):
        va.varlen_attention_forward(module, q, q, q, torch.ones(1, 4, dtype=torch.bool))
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="takes one packed stream"):
        va.varlen_attention_forward(module, q.expand(2, -1, -1, -1), q, q, None, cu_seq_lens_q=cu)
    tree = build_thd_batch([{"input_ids": [5, 6, 7, 8], "g": 0}, {"input_ids": [5, 6, 7, 9], "g": 0}],
                           share_prefix="g", min_prefix_len=2)
    with pytest.raises(ValueError, match="thdpack_varlen"):  # other varlen kernels cannot read the ancestors
        to_hf_kwargs(tree, attn_implementation="flash_attention_2", include_labels=False)
    kw = to_hf_kwargs(tree, attn_implementation=NAME, include_labels=False)  # thdpack_varlen gathers them (tests/test_varlen_tries.py)
    assert kw["segment_parents"].tolist() == tree.prefix_tree.parents.tolist() and "attention_mask" not in kw


def test_the_name_is_known_without_transformers_registration():
    """A DataLoader worker that never imported transformers still builds the kwargs for the name."""
    assert NAME == VARLEN_ATTENTION and attention_kind(VARLEN_ATTENTION) == "flash"
    kw = to_hf_kwargs(build_thd_batch([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]), attn_implementation=NAME)
    assert "attention_mask" not in kw and kw["cu_seq_lens_q"].tolist() == [0, 3, 5]
