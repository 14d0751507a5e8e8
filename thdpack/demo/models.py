"""Tiny random-weight models for the examples (built from a config: nothing is downloaded)."""

from __future__ import annotations

import torch


# the text tower of every tiny model in the tests and examples: 2 layers, hidden 64, GQA 4/2 heads of 16
TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)


def tiny_qwen3(vocab_size: int, *, max_position_embeddings: int = 32768, seed: int = 0):
    """A 2-layer Qwen3 causal LM (hidden 64, GQA 4/2 heads) with sdpa attention."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        **TINY_TEXT,
        max_position_embeddings=max_position_embeddings,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)
