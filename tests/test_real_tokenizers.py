"""Real tokenizers (Qwen3, Llama 3.2, DeepSeek) through the fast encoder and a real build."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tiktoken")

from real_tokenizers import real_tokenizer  # noqa: E402

from thdpack.offline.tiktoken_bpe import TiktokenBPE  # noqa: E402

NAMES = ("qwen3", "llama3.2", "deepseek")
_loaded: dict = {}


def load(name):
    if name not in _loaded:
        path = real_tokenizer(name)
        tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        _loaded[name] = (path, tok, TiktokenBPE.from_tokenizer(tok))
    return _loaded[name]


@pytest.mark.parametrize("name", NAMES)
def test_fast_path_accepted(name):
    _, _, (bpe, why) = load(name)
    assert bpe is not None, why
