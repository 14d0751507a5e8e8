"""Tiny random-weight hybrid causal LMs, one per transformers family with linear-attention, SSM or
short-convolution layers, for the packed-equivalence tests (``tests/test_hybrid.py``).

Each model is 2-3 layers, hidden size 32, float32, eval mode, ``initializer_range`` raised so a leak
across a sample boundary moves the logits far beyond the tolerance. Families the installed
transformers lacks are skipped by the tests (:func:`available_families`).
"""

from __future__ import annotations

import functools

import torch

VOCAB = 96

_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8)
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, max_position_embeddings=512,
               initializer_range=0.2, pad_token_id=0, bos_token_id=None, eos_token_id=None,
               tie_word_embeddings=False)
_GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_num_key_heads=2, linear_num_value_heads=4)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4,
               mamba_expand=2, mamba_chunk_size=8)


def _configs() -> dict:
    """``{family: (config class name, model class name, config kwargs)}``."""
    return {
        "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
            _COMMON, **_ATTN, **_GDN, num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"])),
        "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
            _COMMON, **_ATTN, **_GDN, num_hidden_layers=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
            layer_types=["linear_attention", "full_attention"])),
        "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
            _COMMON, **_ATTN, **_GDN, num_hidden_layers=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
            layer_types=["linear_attention", "full_attention"])),
        "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM", dict(
            _COMMON, **{k: v for k, v in _ATTN.items() if k != "head_dim"}, **_GDN, num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"])),
        "bamba": ("BambaConfig", "BambaForCausalLM", dict(
            _COMMON, **{k: v for k, v in _ATTN.items() if k != "head_dim"}, **_MAMBA2, num_hidden_layers=2,
            attn_layer_indices=[1])),
        "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
            _COMMON, **{k: v for k, v in _ATTN.items() if k != "head_dim"}, **_MAMBA2, num_hidden_layers=2,
            layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
            shared_intermediate_size=32)),
        "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", dict(
            _COMMON, **{k: v for k, v in _ATTN.items() if k != "head_dim"}, **_MAMBA2, num_hidden_layers=2,
            mamba_d_ssm=64)),
        "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(
            {k: v for k, v in _COMMON.items() if k != "intermediate_size"}, **_ATTN, intermediate_size=64,
            layers_block_type=["mamba", "attention", "mlp"], ssm_state_size=8, mamba_num_heads=4,
            mamba_head_dim=16, n_groups=1, conv_kernel=4, expand=2, chunk_size=8)),
        "zamba2": ("Zamba2Config", "Zamba2ForCausalLM", dict(
            {k: v for k, v in _COMMON.items()}, num_attention_heads=4, num_key_value_heads=4,
            num_hidden_layers=2, layers_block_type=["mamba", "hybrid"], mamba_d_state=8, mamba_d_conv=4,
            mamba_expand=2, mamba_ngroups=1, n_mamba_heads=4, chunk_size=8, num_mem_blocks=1)),
        "jamba": ("JambaConfig", "JambaForCausalLM", dict(
            _COMMON, **{k: v for k, v in _ATTN.items() if k != "head_dim"}, num_hidden_layers=2,
            attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
            num_experts=2, num_experts_per_tok=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
            mamba_dt_rank=4, use_mamba_kernels=False)),
        "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(
            _COMMON, **{k: v for k, v in _ATTN.items() if k != "head_dim"}, num_hidden_layers=2,
            layer_types=["conv", "full_attention"], conv_L_cache=3, block_auto_adjust_ff_dim=False)),
        "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", dict(
            _COMMON, **{k: v for k, v in _ATTN.items() if k != "head_dim"}, num_hidden_layers=2,
            moe_intermediate_size=16, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
            layer_types=["conv", "full_attention"], conv_L_cache=3)),
    }


def available_families() -> list[str]:
    """The families of :func:`_configs` whose classes the installed transformers has."""
    import transformers

    return [f for f, (cfg, model, _) in _configs().items()
            if hasattr(transformers, cfg) and hasattr(transformers, model)]


@functools.lru_cache(maxsize=None)
def tiny_hybrid(family: str, attn: str = "sdpa", seed: int = 1234) -> torch.nn.Module:
    """A fresh tiny random-weight model of ``family`` with ``attn_implementation=attn``, float32, eval."""
    import transformers

    cfg_name, model_name, kwargs = _configs()[family]
    config = getattr(transformers, cfg_name)(**kwargs)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    return model
