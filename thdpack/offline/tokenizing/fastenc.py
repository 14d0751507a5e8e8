"""Fast, checked equivalents of the ``transformers`` calls the build makes:

- :func:`encode_texts`: ``tokenizer(texts)["input_ids"]`` (text rows);
- :func:`encode_chat`: ``apply_chat_template(..., return_assistant_tokens_mask=True)``
  (chat templates with ``{% generation %}`` markers);
- :func:`encode_with_spans`: ids + the tokens overlapping character spans, as
  ``return_offsets_mapping`` gives them (templates without markers).

Rendering chat templates to text is :mod:`thdpack.offline.tokenizing.chat_render`; the
once-per-process check all of them make is :mod:`thdpack.offline.tokenizing.fast_checks`.

Each one checks itself against the ``transformers`` call on the first rows of a
process (and row by row where it can) and falls back to that call on any doubt. Ids
come from the Rust ``tokenizers`` backend or, for byte-level BPE, from the tiktoken
form of the tokenizer (:mod:`thdpack.offline.tokenizing.tiktoken_bpe`).

``tokenizer(texts)`` of a fast ``transformers`` tokenizer calls the backend's
``encode_batch``, which also computes character offsets, type ids, attention and
special-token masks for every token, and then converts them all to Python. Text rows
need only the ids: ``encode_batch_fast`` (no offsets) gives the same ids about 1.5x
faster. The first call in a process checks, on the first rows, that it gives exactly
the ids ``tokenizer(texts)`` gives (a tokenizer class that pre-processes text in
Python would differ); if not, every call goes through ``tokenizer(texts)``.
"""

from __future__ import annotations

import json

import numpy as np

from thdpack.offline.tokenizing.chat_render import normalize_chats, render_template
from thdpack.offline.tokenizing.fast_checks import CHECK_ROWS, LATER, decided, per_tools
from thdpack.offline.tokenizing.tiktoken_bpe import FastTokenizerMismatch, byte_level_alphabet

# (id(tokenizer), add_special_tokens) -> (tokenizer, fast path usable)
_checked: dict[tuple[int, bool], tuple[object, bool]] = {}


def _checked_byte_lengths(tok, head_fast, head_slow, same):
    """The byte-length table of ``tok`` when the byte-span path (``head_fast(table)``) agrees with
    the transformers call (``head_slow()``) on the first rows; None when the tokenizer is not
    eligible or they disagree; ``LATER`` when those rows cannot take the fast path (not NFC)."""
    table = _byte_lengths(tok)
    if table is None:
        return None
    got = head_fast(table)
    if got is None:
        return LATER
    return table if same(got, head_slow()) else None


def encode_texts(tok, texts: list[str], bpe=None, *, add_special_tokens: bool = True) -> list:
    """``tok(texts, add_special_tokens=...)["input_ids"]``, through the backend when that is equal,
    and through ``bpe`` (a :class:`~thdpack.offline.tokenizing.tiktoken_bpe.TiktokenBPE` of the backend,
    int32 arrays) when given."""
    head = texts[:CHECK_ROWS]
    # (the reference call runs first: it also sets the backend's truncation/padding as transformers does)
    ok = decided(_checked, (id(tok), add_special_tokens), tok,
                  lambda: _slow(tok, head, add_special_tokens) == _fast(tok, head, add_special_tokens))
    if not ok:
        return _slow(tok, texts, add_special_tokens)
    if bpe is not None:
        return bpe.encode(texts, add_special_tokens=add_special_tokens)
    return _fast(tok, texts, add_special_tokens)


def _slow(tok, texts, add_special_tokens=True):
    return tok(texts, add_special_tokens=add_special_tokens, return_attention_mask=False)["input_ids"]


def _fast(tok, texts, add_special_tokens=True):
    backend = getattr(tok, "backend_tokenizer", None)
    encode = getattr(backend, "encode_batch_fast", None)
    if encode is None or not getattr(tok, "is_fast", False):
        return None
    try:
        return [e.ids for e in encode(texts, add_special_tokens=add_special_tokens)]
    except Exception:  # noqa: BLE001 - any backend failure: use the transformers path
        return None


# ---------------------------------------------------------------------------- chat rows with assistant masks
#
# ``apply_chat_template(..., return_assistant_tokens_mask=True)`` renders the template,
# encodes with offsets, converts every token's offsets to Python and walks them in a
# Python loop to mark the tokens overlapping the ``{% generation %}`` spans: for the
# bundled tokenizer, the offsets cost about as much as the encoding itself. For a
# byte-level BPE tokenizer the offsets are implied by the ids: the tokens' bytes are
# the text's UTF-8 bytes in order, so a token's byte span is the running sum of
# per-id byte lengths. :func:`encode_chat` renders with the same function, encodes
# without offsets and marks the same tokens (the overlap rule of transformers' loop,
# on byte spans). Each row is checked (its tokens' bytes must add up to its text's),
# and the first call in a process compares its output with ``apply_chat_template``
# on the first rows; any doubt falls back to ``apply_chat_template``.

_chat_checked: dict[int, tuple[object, object]] = {}  # id(tokenizer) -> (tokenizer, byte lengths by id or None)


def encode_chat(tok, conversations: list, bpe=None, tools: list | None = None) -> dict:
    """``tok.apply_chat_template(conversations, tokenize=True, return_dict=True,
    return_assistant_tokens_mask=True)``: ``{"input_ids": [...], "assistant_masks": [...]}``
    (numpy arrays on the fast path). ``tools``: each conversation's tool schemas (the
    template's ``tools``), None for none."""
    pairs = per_tools(conversations, tools, lambda convs, kw: _encode_chat_group(tok, convs, bpe, kw))
    return {"input_ids": [ids for ids, _ in pairs], "assistant_masks": [mask for _, mask in pairs]}


def _encode_chat_group(tok, conversations, bpe, kw) -> list:
    """``[(ids, assistant mask)]`` of conversations that share their tools (``kw``: ``{"tools": ...}`` or ``{}``)."""
    head = conversations[:CHECK_ROWS]
    table = decided(_chat_checked, id(tok), tok, lambda: _checked_byte_lengths(
        tok, lambda t: _chat_fast(tok, head, t, bpe, **kw), lambda: _chat_slow(tok, head, **kw), _same))
    got = None
    if table is not None and table is not LATER:
        got = _chat_fast(tok, conversations, table, bpe, **kw)
    if got is None:
        got = _chat_slow(tok, conversations, **kw)
    return list(zip(got["input_ids"], got["assistant_masks"]))


def _chat_slow(tok, conversations, tools=None):
    return tok.apply_chat_template(conversations, tools=tools, tokenize=True, return_dict=True,
                                   return_assistant_tokens_mask=True)


def _same(a, b) -> bool:
    return all(
        len(a[k]) == len(b[k]) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a[k], b[k]))
        for k in ("input_ids", "assistant_masks")
    )


def _chat_fast(tok, conversations, byte_len, bpe=None, tools=None):
    try:
        rendered, spans_all = render_template(tok, normalize_chats(conversations), False, assistant_spans=True, tools=tools)
        encodings = _encode_ids(tok, rendered, bpe)
    except FastTokenizerMismatch:
        raise
    except Exception:  # noqa: BLE001 - another transformers version, or a row it rejects: the reference path says
        return None
    ids_out, masks_out = [], []
    for ids, text, spans in zip(encodings, rendered, spans_all):
        bounds = _token_bytes(ids, text, byte_len)
        if bounds is None:
            return None
        starts, ends = bounds
        mask = np.zeros(ids.size, dtype=bool)
        if spans and ids.size:
            sp = _byte_spans(text, spans)
            # transformers: a token is marked when it overlaps the first span ending after its start
            k = np.searchsorted(sp[:, 1], starts, side="right")
            inside = k < sp.shape[0]
            mask[inside] = ends[inside] > sp[k[inside], 0]
        ids_out.append(ids)
        masks_out.append(mask)
    return {"input_ids": ids_out, "assistant_masks": masks_out}


def _encode_ids(tok, texts, bpe=None) -> list:
    """int32 ids of ``texts`` without special tokens added: through ``bpe`` or the backend."""
    if bpe is not None:
        return bpe.encode(texts, add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int32) for e in tok.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)]


def _token_bytes(ids, text: str, byte_len):
    """int64 ``(starts, ends)``: each token's byte span in ``text``'s UTF-8, from the ids alone;
    None when the tokens do not spell the text byte for byte (or it is not NFC under an NFC
    normalizer): then the caller must not use them."""
    import unicodedata

    if ids.size and int(ids.max()) >= byte_len.size:
        return None
    ends = np.cumsum(byte_len[ids])
    ascii_text = text.isascii()
    if (ends[-1] if ids.size else 0) != (len(text) if ascii_text else len(text.encode("utf-8"))):
        return None
    if byte_len.nfc and not ascii_text and not unicodedata.is_normalized("NFC", text):
        return None
    return ends - byte_len[ids], ends


def _byte_spans(text: str, spans) -> "np.ndarray":
    """int64 ``[k, 2]``: character spans of ``text`` as UTF-8 byte spans."""
    if text.isascii():
        return np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    return np.asarray([[len(text[:a].encode("utf-8")), len(text[:b].encode("utf-8"))] for a, b in spans],
                      dtype=np.int64).reshape(-1, 2)


# ---------------------------------------------------------------------------- text with character spans
#
# Chat templates without ``{% generation %}`` markers (Qwen's, Llama 3's): the build finds
# each assistant turn's character span in the rendered text (chat_spans.py), then needs
# the ids of the whole text and which tokens overlap a span. Through transformers that
# is one call per row with offsets; here the rows are encoded together without offsets
# and the overlap is decided on byte spans as above, row by row checked and on the
# first rows compared with the offsets path.

_span_checked: dict[int, tuple[object, object]] = {}  # id(tokenizer) -> (tokenizer, byte lengths by id or None)


def encode_with_spans(tok, texts: list[str], spans: list, bpe=None) -> list:
    """``[(ids, mask)]``: int32 ids of ``tok(text, add_special_tokens=False)`` and a bool mask of
    the tokens whose character offsets overlap one of the text's ``spans`` (``[(a, b), ...]``)."""
    head, head_spans = texts[:CHECK_ROWS], spans[:CHECK_ROWS]
    table = decided(_span_checked, id(tok), tok, lambda: _checked_byte_lengths(
        tok, lambda t: _spans_fast(tok, head, head_spans, t, bpe), lambda: _spans_slow(tok, head, head_spans),
        lambda a, b: all(np.array_equal(x, z) and np.array_equal(y, w) for (x, y), (z, w) in zip(a, b))))
    if table is not None and table is not LATER:
        got = _spans_fast(tok, texts, spans, table, bpe)
        if got is not None:
            return got
    return _spans_slow(tok, texts, spans)


def _spans_fast(tok, texts, spans, byte_len, bpe=None):
    """``encode_with_spans`` on byte spans; rows that fail the byte check go through
    :func:`_spans_slow` one by one. None when the backend rejects the batch."""
    try:
        encoded = _encode_ids(tok, texts, bpe)
    except FastTokenizerMismatch:
        raise
    except Exception:  # noqa: BLE001 - the reference path raises the row's own error
        return None
    out = []
    for ids, text, row_spans in zip(encoded, texts, spans):
        bounds = _token_bytes(ids, text, byte_len)
        if bounds is None:
            out.append(_spans_slow(tok, [text], [row_spans])[0])
            continue
        starts, ends = bounds
        mask = np.zeros(ids.size, dtype=bool)
        for a, b in (_byte_spans(text, row_spans) if row_spans else ()):
            mask |= (ends > a) & (starts < b)
        out.append((ids, mask))
    return out


def _spans_slow(tok, texts, spans):
    out = []
    for text, row_spans in zip(texts, spans):
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int32)
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(ids.size, dtype=bool)
        for a, b in row_spans:  # a token is a target when it overlaps a span
            mask |= (offsets[:, 1] > a) & (offsets[:, 0] < b)
        out.append((ids, mask))
    return out


class _ByteLengths:
    """int64 byte length of every token id (``.size`` ids), and whether the text is NFC-normalized first."""

    def __init__(self, lengths, nfc: bool):
        self.lengths = lengths
        self.size = lengths.size
        self.nfc = nfc

    def __getitem__(self, ids):
        return self.lengths[ids]


def _byte_lengths(tok):
    """Per-id UTF-8 byte lengths when ``tok`` is a byte-level BPE whose tokens spell the
    text byte for byte (no normalizer but NFC, byte-level pre-tokenizer, untrimmed
    offsets, added tokens that strip nothing); else None."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or not getattr(tok, "is_fast", False):
        return None
    try:
        spec = json.loads(backend.to_str())
        model = spec["model"]
        if model.get("type") != "BPE" or model.get("byte_fallback") or model.get("dropout"):
            return None
        norm = spec.get("normalizer")
        if norm is not None and norm.get("type") != "NFC":
            return None
        pre = spec.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
        kinds = [s.get("type") for s in steps]
        if "ByteLevel" not in kinds or any(
            k not in ("ByteLevel", "Split", "Digits") or (k == "Split" and s.get("behavior") == "Removed")
            for k, s in zip(kinds, steps)
        ):
            return None
        post = spec.get("post_processor")
        posts = (post.get("processors", [post]) if post and post.get("type") == "Sequence" else [post]) if post else []
        if any(p.get("type") == "ByteLevel" and p.get("trim_offsets") for p in posts):
            return None
        added = backend.get_added_tokens_decoder()
        if any(a.lstrip or a.rstrip for a in added.values()):
            return None
        vocab = backend.get_vocab(with_added_tokens=True)
        alphabet = set(byte_level_alphabet())
        lengths = np.zeros(max(vocab.values()) + 1, dtype=np.int64)
        for token, i in vocab.items():
            if i in added:
                lengths[i] = len(added[i].content.encode("utf-8"))
            elif set(token) <= alphabet:
                lengths[i] = len(token)  # one byte per byte-level character
            else:
                return None
    except Exception:  # noqa: BLE001 - an unexpected tokenizer layout: not eligible
        return None
    return _ByteLengths(lengths, nfc=norm is not None)
