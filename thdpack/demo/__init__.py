"""Bundled demo: seeded synthetic chat/text rows and a small tokenizer trained on them.

Nothing here is copied from real text: words are made of random syllables from a
seeded generator, so the demo runs offline and is byte-for-byte reproducible.

- :func:`generate_rows` makes the rows (``{"messages": [...]}`` or ``{"text": ...}``).
- :data:`TOKENIZER_DIR` is a Hugging Face ``tokenizers`` tokenizer (byte-level BPE,
  3072 tokens, Qwen-style ``<|im_start|>`` / ``<|im_end|>`` / ``<|endoftext|>`` and a
  chat template with ``{% generation %}`` markers), trained by
  ``scripts/make_demo.py tokenizer`` on generated text.
"""

from pathlib import Path

from thdpack.demo.synthetic import generate_rows, iter_texts, write_jsonl

TOKENIZER_DIR = Path(__file__).resolve().parent / "tokenizer"

__all__ = ["TOKENIZER_DIR", "generate_rows", "iter_texts", "write_jsonl"]
