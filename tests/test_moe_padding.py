"""transformers MoE router aux loss on packed batches with pad slots (issue 33 point 4): what Qwen3-MoE and
Qwen3.5-MoE do with pad slots, and :func:`thdpack.integrations.moe_router.router_aux_loss`, which keeps them
out (docs/megatron.md, "MoE padding mask")."""

from __future__ import annotations

import pytest
import torch

from hybrid_models import tiny_hybrid  # tests/hybrid_models.py
from thdpack import build_thd_batch
from thdpack.integrations.moe_router import router_aux_loss
from thdpack.integrations import to_hf_kwargs
from thdpack.batching import padding_mask

transformers = pytest.importorskip("transformers")
LENGTHS = (7, 3, 10, 5)


def samples(vocab: int = 90):
    g = torch.Generator().manual_seed(7)
    return [{"input_ids": torch.randint(1, vocab, (s,), generator=g)} for s in LENGTHS]


@pytest.fixture(scope="module")
def qwen3_moe():
    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=128, initializer_range=0.2,
        router_aux_loss_coef=0.01, pad_token_id=0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(3)
    return transformers.Qwen3MoeForCausalLM(config).eval()


@torch.no_grad()
def test_qwen3_moe_counts_pad_slots_and_the_mask_keeps_them_out(qwen3_moe):
    """Without a mask (flash kwargs; on the CPU, without a cache, transformers finds the samples from
    position_ids) the aux loss averages over pad slots too; router_aux_loss over the same router logits equals
    transformers' loss on the pack without padding."""
    plain = build_thd_batch(samples())
    padded = build_thd_batch(samples(), pad_multiple=16)
    assert int(padding_mask(padded).sum()) == padded.num_padded_tokens - padded.num_tokens > 0
    want = qwen3_moe(**to_hf_kwargs(plain), use_cache=False, output_router_logits=True)
    out = qwen3_moe(**to_hf_kwargs(padded), use_cache=False, output_router_logits=True)
    real = ~padding_mask(padded)
    for layer_plain, layer_padded in zip(want.router_logits, out.router_logits):  # the real rows route alike
        torch.testing.assert_close(layer_padded[real], layer_plain, rtol=1e-5, atol=1e-5)
    assert abs(float(out.aux_loss) - float(want.aux_loss)) > 1e-4  # the pad slots counted
    fixed = router_aux_loss(qwen3_moe, out.router_logits, padded)
    torch.testing.assert_close(fixed, want.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(router_aux_loss(qwen3_moe, want.router_logits, plain), want.aux_loss)


@torch.no_grad()
def test_qwen3_moe_with_a_document_mask_fails_in_transformers(qwen3_moe):
    """transformers 5.x flattens the [1, 1, T, T] document mask as a [1, T] padding mask in its aux loss: a
    RuntimeError. The decoder alone gives the router logits, and router_aux_loss the loss (module docstring).
    If this starts passing, transformers changed: update docs/megatron.md and thdpack/integrations/moe_router.py."""
    padded = build_thd_batch(samples(), pad_multiple=16)
    kw = to_hf_kwargs(padded, attn_implementation="sdpa")
    with pytest.raises(RuntimeError, match="must match the size"):
        qwen3_moe(**kw, output_router_logits=True)
    kw.pop("labels")
    logits = qwen3_moe.model(**kw, output_router_logits=True).router_logits
    want = qwen3_moe(**to_hf_kwargs(build_thd_batch(samples())), use_cache=False, output_router_logits=True).aux_loss
    torch.testing.assert_close(router_aux_loss(qwen3_moe, logits, padded), want, rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_qwen3_5_moe_router_aux_loss_over_real_tokens():
    """Qwen3.5-MoE (Gated DeltaNet + attention, made exact on packs by packed_model): the decoder's router
    logits of a padded pack, through router_aux_loss, give transformers' own loss function on the unpadded
    pack's logits."""
    from thdpack.integrations import packed_model

    model = packed_model(tiny_hybrid("qwen3_5_moe_text"))
    plain, padded = build_thd_batch(samples()), build_thd_batch(samples(), pad_multiple=8, pad_to=48)
    kw_plain, kw_padded = (to_hf_kwargs(b, include_labels=False, attn_implementation="sdpa") for b in (plain, padded))
    logits_plain = model.model(**kw_plain, output_router_logits=True).router_logits
    logits_padded = model.model(**kw_padded, output_router_logits=True).router_logits
    module = __import__(type(model).__module__, fromlist=["load_balancing_loss_func"])
    want = module.load_balancing_loss_func(logits_plain, model.config.num_experts, model.config.num_experts_per_tok)
    counted = module.load_balancing_loss_func(logits_padded, model.config.num_experts, model.config.num_experts_per_tok)
    assert abs(float(counted) - float(want)) > 1e-4
    torch.testing.assert_close(router_aux_loss(model, logits_padded, padded), want, rtol=1e-5, atol=1e-6)


def test_router_aux_loss_refusals(qwen3_moe):
    batch = build_thd_batch(samples(), pad_multiple=8)
    with pytest.raises(ValueError, match="router_logits\\[0\\] has 3 rows; the batch has 40 slots"):
        router_aux_loss(qwen3_moe, (torch.zeros(3, 8),), batch)
    with pytest.raises(ValueError, match="Linear is not a transformers MoE model"):
        router_aux_loss(torch.nn.Linear(2, 2), (torch.zeros(32, 8),), batch)
