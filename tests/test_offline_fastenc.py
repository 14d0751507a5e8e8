"""The build's fast encoders give exactly what transformers gives.

``encode_texts`` must equal ``tokenizer(texts)["input_ids"]`` and ``encode_chat`` must
equal ``apply_chat_template(..., return_assistant_tokens_mask=True)``, id for id and
mask bit for mask bit, including non-ASCII text; tokenizers outside the fast path's
assumptions fall back to transformers.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from thdpack.demo import TOKENIZER_DIR, generate_rows  # noqa: E402
from thdpack.offline.tokenizing import chat_render, fastenc  # noqa: E402

UNICODE_CHATS = [
    [{"role": "user", "content": "Café? naïve — ünïcödé"}, {"role": "assistant", "content": "Oui, très bien 😀 ✓"}],
    [{"role": "system", "content": "日本語で答えて"}, {"role": "user", "content": "こんにちは"},
     {"role": "assistant", "content": "こんにちは！元気です。"}, {"role": "user", "content": "e\u0301 (decomposed)"},
     {"role": "assistant", "content": "\u00e9 composed, Ω, ß, 🇫🇷"}],
    [{"role": "user", "content": "empty answer next"}, {"role": "assistant", "content": ""}],
    [{"role": "user", "content": " leading and trailing spaces "}, {"role": "assistant", "content": "  \n\tindented\n"}],
    [{"role": "assistant", "content": "assistant first"}, {"role": "user", "content": "<|im_end|> inside text"},
     {"role": "assistant", "content": "tokens <|im_start|> too"}],
]


def load(tmp_path=None, edit=None):
    tok = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)
    if edit is None:
        return tok
    spec = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())
    edit(spec)
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_text(json.dumps(spec))
    (d / "tokenizer_config.json").write_text((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    return transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True)


def assert_chat_equal(tok, convs):
    got = fastenc.encode_chat(tok, convs)
    ref = tok.apply_chat_template(convs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert len(got["input_ids"]) == len(ref["input_ids"]) == len(convs)
    for i in range(len(convs)):
        np.testing.assert_array_equal(np.asarray(got["input_ids"][i]), np.asarray(ref["input_ids"][i]))
        np.testing.assert_array_equal(np.asarray(got["assistant_masks"][i], bool), np.asarray(ref["assistant_masks"][i], bool))


def test_chat_fast_path_equals_apply_chat_template():
    tok = load()
    convs = [r["messages"] for r in generate_rows(200, seed=11, kind="chat")] + UNICODE_CHATS
    assert_chat_equal(tok, convs)
    assert fastenc._chat_checked[id(tok)][1] is not None  # the fast path was taken
    assert_chat_equal(tok, UNICODE_CHATS)  # non-ASCII rows alone (checked call already made)
    assert any(np.asarray(m).any() for m in fastenc.encode_chat(tok, UNICODE_CHATS)["assistant_masks"])


def test_text_fast_path_equals_tokenizer_call():
    tok = load()
    texts = [r["text"] for r in generate_rows(100, seed=2, kind="text")] + [c[0]["content"] for c in UNICODE_CHATS]
    assert fastenc.encode_texts(tok, texts) == tok(texts, add_special_tokens=True)["input_ids"]
    assert fastenc._checked[(id(tok), True)][1]
    assert fastenc.encode_texts(tok, texts, add_special_tokens=False) == tok(texts, add_special_tokens=False)["input_ids"]
    assert fastenc._checked[(id(tok), False)][1]


def test_nfc_normalizer_rows_that_are_not_nfc_fall_back(tmp_path):
    tok = load(tmp_path, lambda spec: spec.update(normalizer={"type": "NFC"}))
    assert fastenc._byte_lengths(tok).nfc
    assert_chat_equal(tok, UNICODE_CHATS)  # "e\u0301" is not NFC: not checked yet, transformers' path
    assert id(tok) not in fastenc._chat_checked
    assert_chat_equal(tok, UNICODE_CHATS[:1] + [r["messages"] for r in generate_rows(20, seed=4, kind="chat")])
    assert fastenc._chat_checked[id(tok)][1] is not None  # NFC rows: checked, fast
    assert_chat_equal(tok, UNICODE_CHATS)  # a batch with a non-NFC row still falls back


def test_ineligible_tokenizer_falls_back(tmp_path):
    tok = load(tmp_path, lambda spec: spec.update(
        post_processor={"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}))
    assert fastenc._byte_lengths(tok) is None
    assert_chat_equal(tok, UNICODE_CHATS + [r["messages"] for r in generate_rows(20, seed=1, kind="chat")])


# ---------------------------------------------------------------------------- text with character spans


def offsets_reference(tok, texts, spans):
    """Per row: ids and the tokens whose offset_mapping overlaps a span (what the build did row by row)."""
    out = []
    for text, row_spans in zip(texts, spans):
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        off = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(len(enc["input_ids"]), bool)
        for a, b in row_spans:
            mask |= (off[:, 1] > a) & (off[:, 0] < b)
        out.append((np.asarray(enc["input_ids"]), mask))
    return out


def span_cases(tok):
    """Rendered conversations and their assistant spans, plus spans that start or end inside
    a multi-byte character's tokens, empty spans, and rows without spans."""
    convs = [r["messages"] for r in generate_rows(60, seed=7, kind="chat")] + UNICODE_CHATS
    texts = [tok.apply_chat_template(c, tokenize=False) for c in convs]
    rng = np.random.default_rng(3)
    spans = []
    for t in texts:
        cuts = np.sort(rng.integers(0, len(t) + 1, size=2 * int(rng.integers(0, 4))))
        spans.append([(int(a), int(b)) for a, b in cuts.reshape(-1, 2)])
    return texts, spans


@pytest.mark.parametrize("through_tiktoken", [False, True])
def test_spans_fast_path_equals_offsets(through_tiktoken):
    from thdpack.offline.tokenizing.tiktoken_bpe import TiktokenBPE

    tok = load()
    bpe = TiktokenBPE.from_tokenizer(tok)[0] if through_tiktoken else None
    texts, spans = span_cases(tok)
    assert any(not t.isascii() for t in texts) and any(not s for s in spans)
    got = fastenc.encode_with_spans(tok, texts, spans, bpe)
    assert fastenc._span_checked[id(tok)][1] is not None  # the fast path was taken
    for (ids, mask), (ref_ids, ref_mask) in zip(got, offsets_reference(tok, texts, spans)):
        np.testing.assert_array_equal(ids, ref_ids)
        np.testing.assert_array_equal(mask, ref_mask)
    assert sum(int(m.sum()) for _, m in got) > 0


def test_spans_rows_that_are_not_nfc_and_ineligible_tokenizers_fall_back(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    nfc = load(tmp_path / "a", lambda spec: spec.update(normalizer={"type": "NFC"}))
    texts, spans = span_cases(nfc)
    texts.append("cafe\u0301 and more")  # not NFC: this row goes through the offsets path
    spans.append([(0, 6)])
    trims = load(tmp_path / "b", lambda spec: spec.update(
        post_processor={"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}))
    for tok, fast in ((nfc, True), (trims, False)):
        got = fastenc.encode_with_spans(tok, texts, spans)
        assert (fastenc._span_checked[id(tok)][1] is not None) == fast
        for (ids, mask), (ref_ids, ref_mask) in zip(got, offsets_reference(tok, texts, spans)):
            np.testing.assert_array_equal(ids, ref_ids)
            np.testing.assert_array_equal(mask, ref_mask)


@pytest.mark.parametrize("generation_prompt", [False, True])
def test_render_chats_equals_apply_chat_template(generation_prompt):
    tok = load()
    convs = chat_render.normalize_chats([r["messages"] for r in generate_rows(40, seed=9, kind="chat")] + UNICODE_CHATS)
    prefixes = [c[:k] for c in convs for k in range(1, len(c) + 1)]
    want = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=generation_prompt) for c in prefixes]
    assert chat_render.render_chats(tok, prefixes, generation_prompt) == want
    assert chat_render._render_checked[id(tok)][1]  # the batched renderer was taken


def test_render_chats_that_differ_fall_back(monkeypatch):
    tok = load()
    chat_render._render_checked.pop(id(tok), None)
    monkeypatch.setattr(chat_render, "_render_fast", lambda tok, convs, flag: [c + " " for c in chat_render._render_slow(tok, convs, flag)])
    convs = chat_render.normalize_chats([r["messages"] for r in generate_rows(5, seed=1, kind="chat")])
    want = [tok.apply_chat_template(c, tokenize=False) for c in convs]
    assert chat_render.render_chats(tok, convs, False) == want
    assert chat_render._render_checked[id(tok)][1] is False


_SPAN_PIECES = ["hello", " world", "  ", "\n", "\t", "'s", "123", " 42", "<|im_start|>", "<|im_end|>", "café",
                "cafe\u0301", "日本語", "😀", "🇫🇷", "naïve", "ß", "x\u0300", "--", "{}"]


@functools.lru_cache(maxsize=1)
def _span_tokenizer():
    return load()


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_spans_equal_offsets_on_any_text(data):
    from thdpack.offline.tokenizing.tiktoken_bpe import TiktokenBPE

    tok = _span_tokenizer()
    bpe = TiktokenBPE.from_tokenizer(tok)[0]
    texts = data.draw(st.lists(st.one_of(st.lists(st.sampled_from(_SPAN_PIECES), max_size=12).map("".join),
                                         st.text(max_size=30)), min_size=1, max_size=4))
    spans = []
    for t in texts:
        cuts = sorted(data.draw(st.lists(st.integers(0, len(t)), max_size=6)))
        spans.append([(a, b) for a, b in zip(cuts[0::2], cuts[1::2])])
    got = fastenc.encode_with_spans(tok, texts, spans, bpe)
    assert fastenc._span_checked[id(tok)][1] is not None  # checked and taken: no silent fallback
    assert fastenc._spans_fast(tok, texts, spans, fastenc._byte_lengths(tok), bpe) is not None
    for (ids, mask), (ref_ids, ref_mask) in zip(got, offsets_reference(tok, texts, spans)):
        np.testing.assert_array_equal(ids, ref_ids)
        np.testing.assert_array_equal(mask, ref_mask)
