"""The build's tokenizer: loading it offline, its chat template, what metadata.json records
about it, and whether its tiktoken form (:mod:`thdpack.offline.tokenizing.tiktoken_bpe`) runs instead.

- :func:`load_tokenizer`: ``AutoTokenizer`` from a local directory or the local Hugging Face
  cache only (thdpack never downloads), with ``chat_template`` from a file when the config
  gives one (read once, and checked to be Jinja, by :class:`~thdpack.offline.stages.TokenizeOptions`);
- :func:`tokenizer_info`: a content fingerprint of the vocabulary and template, the special
  token ids and :func:`has_generation_markers` (``{% generation %}`` spans in the template);
- :func:`fast_bpe`: the tiktoken fast path, chosen by ``tokenizer_backend``.
"""

from __future__ import annotations

import re

from thdpack.offline.errors import ConfigError, InputError
from thdpack.offline.stages import TokenizeOptions
from thdpack.offline.store.format import bytes_sha256
from thdpack.offline.tokenizing.formats import row_format
from thdpack.offline.tokenizing.tiktoken_bpe import TiktokenBPE

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def load_tokenizer(opts: TokenizeOptions):
    """``AutoTokenizer`` for ``opts.tokenizer``, from a local directory or the local HF cache only, with
    ``opts.chat_template_text`` as its chat template when the build gives one."""
    from transformers import AutoTokenizer

    spec = opts.tokenizer
    local = opts.tokenizer_path
    target = str(local) if local.exists() else spec
    if not local.exists() and (spec.startswith((".", "/", "~")) or spec.count("/") > 1):
        raise InputError(f"tokenizer {spec!r}: no such directory ({local})")
    try:
        tok = AutoTokenizer.from_pretrained(target, local_files_only=True)
    except (OSError, ValueError) as exc:
        from huggingface_hub.constants import HF_HUB_CACHE

        if local.exists():
            raise InputError(f"tokenizer {spec!r}: cannot load {local} ({exc})") from None
        raise InputError(
            f"tokenizer {spec!r} was not found offline: it is not a local directory "
            f"(relative paths in a config file are relative to the file) and not in the Hugging Face "
            f"cache ({HF_HUB_CACHE}). thdpack never downloads; fetch it once with "
            f"`hf download {spec}` or give a local path."
        ) from None
    if opts.chat_template_text is not None:
        tok.chat_template = opts.chat_template_text
    return tok


def tokenizer_info(tok, spec: str) -> dict:
    """What metadata.json records about the tokenizer (a content fingerprint, not a path)."""
    backend = getattr(tok, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else repr(sorted(tok.get_vocab().items()))
    template = getattr(tok, "chat_template", None)
    return {
        "name_or_path": spec,
        "fingerprint": bytes_sha256(vocab + repr(template)),
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        "chat_template_has_generation_markers": has_generation_markers(template),
    }


def has_generation_markers(template) -> bool:
    """Whether ``template`` (a chat template's text, or None) marks the assistant tokens with
    ``{% generation %}`` spans (then ``return_assistant_tokens_mask`` gives the targets)."""
    return isinstance(template, str) and bool(_GENERATION_TAG.search(template))


def fast_bpe(opts: TokenizeOptions, tok, fmt: str) -> tuple[TiktokenBPE | None, str | None]:
    """``(bpe, note)``: the tiktoken form of ``tok`` (:mod:`thdpack.offline.tokenizing.tiktoken_bpe`) when
    ``opts.tokenizer_backend`` allows it and the tokenizer converts exactly, else None; ``note``
    is the line to log about the choice (None when no tokenizer encodes the rows or ``hf`` is set)."""
    if tok is None or not row_format(fmt).needs_tokenizer or opts.tokenizer_backend == "hf":
        return None, None
    bpe, why = TiktokenBPE.from_tokenizer(tok)
    if bpe is None and opts.tokenizer_backend == "tiktoken":
        raise ConfigError(f"tokenizer_backend: tiktoken, but tokenizer {opts.tokenizer!r} cannot run on it: {why}")
    return bpe, "tokenizer " + ("byte-level BPE through tiktoken (checked against the tokenizer on a sample of rows)"
                                if bpe is not None else f"through transformers ({why})")
