"""The build's tokenizer: loading it offline, its chat template, what metadata.json records
about it, and whether its tiktoken form (:mod:`thdpack.offline.tokenizing.tiktoken_bpe`) runs instead.

- :func:`load_tokenizer`: ``AutoTokenizer`` from a local directory or the local Hugging Face
  cache only (thdpack never downloads), with ``chat_template`` from a file when the config
  gives one (read once, and checked to be Jinja, by :class:`~thdpack.offline.stage_options.TokenizeOptions`);
- :func:`tokenizer_info`: a content fingerprint of the vocabulary and template, the special
  token ids and :func:`has_generation_markers` (``{% generation %}`` spans in the template);
- :func:`fast_bpe`: the tiktoken fast path, chosen by ``tokenizer_backend``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from thdpack.offline.errors import ConfigError, InputError
from thdpack.offline.stage_options import TokenizeOptions
from thdpack.offline.store.schema import bytes_sha256
from thdpack.offline.tokenizing.row_formats import row_format
from thdpack.offline.tokenizing.tiktoken_bpe import TiktokenBPE

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def load_tokenizer(opts: TokenizeOptions):
    """``AutoTokenizer`` for ``opts.tokenizer``, from a local directory or the local HF cache only, with
    ``opts.chat_template_text`` as its chat template when the build gives one. InputError naming the
    file when a local tokenizer directory is missing or holds a damaged one (:func:`tokenizer_dir_problem`)."""
    from transformers import AutoTokenizer

    spec = opts.tokenizer
    local = opts.tokenizer_path
    target = str(local) if local.exists() else spec
    if not local.exists() and (spec.startswith((".", "/", "~")) or spec.count("/") > 1):
        raise InputError(f"tokenizer {spec!r}: no such directory ({local})")
    if local.exists() and not local.is_dir():
        raise InputError(f"tokenizer {spec!r}: {local} is a file; give the directory holding {TOKENIZER_FILE} "
                         f"and tokenizer_config.json{f' ({local.parent})' if local.name == TOKENIZER_FILE else ''}")
    try:
        tok = AutoTokenizer.from_pretrained(target, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises a bare Exception on a damaged file
        if local.exists():
            raise damaged_tokenizer(spec, local, exc) from None
        if not isinstance(exc, (OSError, ValueError)):
            raise
        from huggingface_hub.constants import HF_HUB_CACHE

        raise InputError(
            f"tokenizer {spec!r} was not found offline: it is not a local directory "
            f"(relative paths in a config file are relative to the file) and not in the Hugging Face "
            f"cache ({HF_HUB_CACHE}). thdpack never downloads; fetch it once with "
            f"`hf download {spec}` or give a local path."
        ) from None
    if opts.chat_template_text is not None:
        tok.chat_template = opts.chat_template_text
    # packs are planned from the full length; transformers' "longer than the maximum sequence length" warning
    # (a second line on a build that stops for a long row) does not apply
    getattr(tok, "deprecation_warnings", {})["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tok


def damaged_tokenizer(spec: str, local: Path, exc: Exception) -> InputError:
    """The one-line error for tokenizer directory ``local`` (given as ``spec``) that failed to load with ``exc``:
    what is wrong with it (:func:`tokenizer_dir_problem`), else the library's message on one line."""
    problem = tokenizer_dir_problem(local) or " ".join(str(exc).split())[:300]
    return InputError(f"tokenizer {spec!r}: cannot load {local}: {problem}")


TOKENIZER_FILE = "tokenizer.json"
_JSON_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json")
_SLOW_VOCABS = (("vocab.json", "merges.txt"), ("tokenizer.model",), ("vocab.txt",), ("spiece.model",))


def tokenizer_dir_problem(path) -> str | None:
    """What is wrong with tokenizer directory ``path``, for a message (None when nothing is found):
    a tokenizer file that cannot be read, is empty or is not valid JSON (truncated, damaged), or no
    ``tokenizer.json`` (nor a slow tokenizer's vocabulary files) at all. Called only once loading failed."""
    import json

    for name in _JSON_FILES:
        f = path / name
        if not os.path.lexists(f):
            continue
        try:
            data = f.read_bytes()
        except OSError as exc:
            return f"cannot read {name} ({exc.strerror or exc})"
        if not data.strip():
            return f"{name} is empty; copy the tokenizer files again"
        try:
            json.loads(data.decode("utf-8"))
        except UnicodeDecodeError as exc:
            return f"{name} is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}): damaged; copy it again"
        except (json.JSONDecodeError, RecursionError) as exc:
            return f"{name} is not valid JSON ({getattr(exc, 'msg', exc)} at line {getattr(exc, 'lineno', '?')}" \
                   f" column {getattr(exc, 'colno', '?')}): truncated or damaged; copy it again"
    if not (path / TOKENIZER_FILE).exists() and not any(all((path / n).exists() for n in v) for v in _SLOW_VOCABS):
        held = sorted(p.name for p in path.iterdir())[:8] if path.is_dir() else []
        return (f"no {TOKENIZER_FILE} (the directory holds {', '.join(held) if held else 'nothing'}); a tokenizer "
                f"directory needs {TOKENIZER_FILE} and tokenizer_config.json, as save_pretrained writes them")
    return None


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
