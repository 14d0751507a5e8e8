"""Assistant-turn targets on real chat templates (issue 12, point 1).

Chat rows with ``loss: assistant`` / ``last_assistant`` built with the real Qwen3 template
(multi-turn, reasoning inside the content and as ``reasoning_content``, tool calls,
``tool`` messages, a ``tools`` column), Qwen2.5's and Llama 3.1's templates (tests/data)
give exactly the targets of a reference computed here by another, simple method: the
conversation rendered by ``apply_chat_template(..., tokenize=False)``, each assistant
turn found with a regular expression on the rendered text (after its role header,
through its end-of-turn token), and the tokens whose ``offset_mapping`` overlaps a turn.
No row is rejected. Conversations come from a seeded generator.
"""

from __future__ import annotations

import copy
import functools
import json
import random
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

from real_tokenizers import real_tokenizer  # noqa: E402

from thdpack.offline import BuildConfig, ConfigError, build_packed, load_packed, unpack_row  # noqa: E402
from thdpack.offline.tokenizing import chat_render, fastenc  # noqa: E402
from thdpack.offline.inputs.sources import JSON_COLUMN  # noqa: E402
from thdpack.offline.tokenizing.tiktoken_bpe import TiktokenBPE  # noqa: E402
from thdpack.offline.tokenizing.row_tokenizer import RowTokenizer  # noqa: E402

DATA = Path(__file__).parent / "data"
# family -> (tokenizer, template file or None for the tokenizer's own, the turn regex of the reference)
FAMILIES = {
    "qwen3": ("qwen3", None, r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)"),
    "qwen2.5": ("qwen3", DATA / "qwen2_5_chat_template.jinja", r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)"),
    "llama3": ("llama3.2", DATA / "llama3_chat_template.jinja",
               r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n(.*?<\|eot_id\|>)"),
}

# ---------------------------------------------------------------------------- conversations

_WORDS = ["the", "answer", "is", "42", "café", "日本語", "😀", "naïve", "e\u0301", "code:", "{", "}", "def f(x):",
          "return", "x + 1", "\n", "\n\n", "  ", "\t", "**bold**", "<b>", "ß", "Ω", "- item", "1.", "yes", "no"]
_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                      "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                                                      "b": {"type": "number"}}}}},
]


def _text(rng: random.Random, lo: int = 1, hi: int = 12) -> str:
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))
    return rng.choice(["", " ", "\n"]) + words + rng.choice(["", "", " ", "\n"])


def _answer(rng: random.Random, family: str) -> dict:
    """A final assistant message; Qwen3's carries reasoning in its content or as reasoning_content."""
    content = _text(rng)
    way = rng.choice(["plain", "think", "field"]) if family == "qwen3" else "plain"
    if way == "think":
        return {"role": "assistant", "content": f"<think>\n{_text(rng)}\n</think>\n\n{content.lstrip()}"}
    if way == "field":
        return {"role": "assistant", "content": content, "reasoning_content": _text(rng)}
    return {"role": "assistant", "content": content}


def _tool_call(rng: random.Random) -> dict:
    if rng.random() < 0.5:
        return {"type": "function", "function": {"name": "get_weather", "arguments": {"city": rng.choice(["Oslo", "Köln"])}}}
    args = {"a": rng.randint(0, 99), "b": rng.randint(0, 99)}
    return {"type": "function", "function": {"name": "add", "arguments": args if rng.random() < 0.5 else json.dumps(args)}}


def conversation(rng: random.Random, family: str) -> dict:
    """One row: ``messages`` (system?, then 1-4 exchanges, some through tool calls) and, for
    rows with tool calls and some others, ``tools`` (a list, or its JSON text)."""
    messages = [{"role": "system", "content": _text(rng)}] if rng.random() < 0.3 else []
    uses_tools = False
    for _ in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": _text(rng)})
        if rng.random() < 0.3:  # a tool round: call(s), result(s), then the answer
            uses_tools = True
            calls = [_tool_call(rng) for _ in range(1 if family == "llama3" else rng.randint(1, 2))]
            call = {"role": "assistant", "content": "" if family == "llama3" else rng.choice(["", _text(rng)]),
                    "tool_calls": calls}
            if family == "qwen3" and rng.random() < 0.3:
                call["reasoning_content"] = _text(rng)
            messages.append(call)
            messages.extend({"role": "tool", "content": _text(rng, 1, 5)} for _ in calls)
        messages.append(_answer(rng, family))
    row = {"messages": messages}
    if uses_tools or rng.random() < 0.1:
        row["tools"] = _TOOLS if rng.random() < 0.7 else json.dumps(_TOOLS)
    return row


def conversations(family: str, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [conversation(rng, family) for _ in range(n)]


# ---------------------------------------------------------------------------- the reference


@functools.lru_cache(maxsize=None)
def _loaded(name: str):
    """A real tokenizer, loaded once per test session."""
    return transformers.AutoTokenizer.from_pretrained(str(real_tokenizer(name)), local_files_only=True)


@functools.lru_cache(maxsize=None)
def _tiktoken(name: str):
    """Its tiktoken form (the build's default encoder; a few seconds to make, so made once)."""
    return TiktokenBPE.from_tokenizer(_loaded(name))[0]


def load_tokenizer(family: str):
    """The family's tokenizer with its chat template (a copy: each family sets its own)."""
    name, template, _ = FAMILIES[family]
    tok = copy.copy(_loaded(name))
    if template is not None:
        tok.chat_template = template.read_text()
    return tok


def encode(family: str, rows: list[dict], loss: str = "assistant", tiktoken: bool = False):
    """What the build's tokenizing step gives for ``rows`` (JSON lines, as the build reads
    them): ``[(ids, mask) or error message]``; ids from the tokenizer's backend, or from its
    tiktoken form."""
    tok = load_tokenizer(family)
    conf = BuildConfig(input="-", tokenizer="-", format="chat", loss=loss)
    rt = RowTokenizer("chat", conf.tokenize, tok, [JSON_COLUMN], _tiktoken(FAMILIES[family][0]) if tiktoken else None)
    out = []
    for i in range(0, len(rows), 500):
        lines = [json.dumps(r).encode() for r in rows[i:i + 500]]
        table = rt(pa.table({JSON_COLUMN: pa.array(lines, pa.binary())})).to_pylist()
        out.extend(r["__error__"] or (np.asarray(r["input_ids"]), np.asarray(r["loss_mask"], bool)) for r in table)
    return tok, out


def assert_encoded(family: str, rows: list[dict], loss: str, tiktoken: bool = False):
    """Every row is tokenized (none rejected) with the reference's ids and mask."""
    tok, got = encode(family, rows, loss, tiktoken)
    errors = [(r, g) for r, g in enumerate(got) if isinstance(g, str)]
    assert not errors, f"{len(errors)} rejected rows, first: {errors[0]}"
    for r, ((ids, mask), (want_ids, want_mask)) in enumerate(zip(got, references(tok, family, rows, loss))):
        np.testing.assert_array_equal(ids, want_ids, err_msg=f"row {r}")
        np.testing.assert_array_equal(mask, want_mask, err_msg=f"row {r}")
    return tok


def references(tok, family: str, rows: list[dict], loss: str) -> list:
    """Per row (ids, mask): the rendered text tokenized, and the tokens overlapping an
    assistant turn as the family's regex finds it in the text."""
    texts = [_rendered(tok, row) for row in rows]
    out = []
    for row, text, enc in zip(rows, texts, tok(texts, add_special_tokens=False, return_offsets_mapping=True)
                              .encodings):
        spans = [m.span(1) for m in re.finditer(FAMILIES[family][2], text, flags=re.DOTALL)]
        assert len(spans) == sum(m["role"] == "assistant" for m in row["messages"])
        if loss == "last_assistant":
            spans = spans[-1:]
        off = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(len(enc.ids), dtype=bool)
        for a, b in spans:
            mask |= (off[:, 1] > a) & (off[:, 0] < b)
        out.append((np.asarray(enc.ids), mask))
    return out


def _rendered(tok, row: dict) -> str:
    tools = row.get("tools")
    tools = json.loads(tools) if isinstance(tools, str) else tools
    return tok.apply_chat_template(row["messages"], tools=tools, tokenize=False)


def build(tmp_path, family: str, path: Path, name: str = "out", **kw):
    _, template, _ = FAMILIES[family]
    conf = dict(input=str(path), tokenizer=str(real_tokenizer(FAMILIES[family][0])), pack_size=32768,
                overflow="error", num_proc=1, tokenizer_backend="hf", save_tokenizer=False)
    if template is not None:
        conf["chat_template"] = str(template)
    conf.update(kw)
    return build_packed(BuildConfig(**conf), tmp_path / name, progress=False)


def assert_targets(res, tok, family: str, rows: list[dict], loss: str):
    """Every row was built (none rejected) with the reference's ids and mask."""
    ds = load_packed(res.path)
    refs = references(tok, family, rows, loss)
    seen = set()
    for k in range(len(ds)):
        row = ds[k]
        for r, sample in zip(row["sample_index"].tolist(), unpack_row(row)):
            ids, mask = refs[r]
            np.testing.assert_array_equal(sample["input_ids"], ids, err_msg=f"row {r}")
            np.testing.assert_array_equal(sample["loss_mask"], mask, err_msg=f"row {r}")
            seen.add(r)
    assert seen == set(range(len(rows)))  # zero rejected rows


# ---------------------------------------------------------------------------- tests


def test_qwen3_2000_conversations_no_row_rejected():
    rows = conversations("qwen3", 2000, seed=0)
    msgs = [m for r in rows for m in r["messages"]]
    assert any("reasoning_content" in m for m in msgs) and any("<think>" in m.get("content", "") for m in msgs)
    assert any("tool_calls" in m for m in msgs) and any(m["role"] == "tool" for m in msgs)
    assert sum(sum(m["role"] == "assistant" for m in r["messages"]) > 1 for r in rows) > 1000  # multi-turn
    tok = assert_encoded("qwen3", rows, "assistant", tiktoken=True)
    # and through the fast paths: batched rendering, ids from tiktoken with targets on byte spans
    assert chat_render._render_checked[id(tok)][1] and fastenc._span_checked[id(tok)][1] is not None


@pytest.mark.parametrize("family", ["qwen3", "qwen2.5", "llama3"])
@pytest.mark.parametrize("loss", ["assistant", "last_assistant"])
def test_targets_equal_the_reference(family, loss):
    assert_encoded(family, conversations(family, 150, seed=1), loss)


def test_build_end_to_end_from_parquet(tmp_path):
    """The whole build (a Parquet file with a ``tools`` column, datasets, packing) keeps those
    targets. Arrow gives a struct one set of fields: tool arguments and tools as JSON text."""
    import datasets

    rows = conversations("qwen3", 100, seed=2)
    for row in rows:
        for m in row["messages"]:
            for call in m.get("tool_calls", []):
                args = call["function"]["arguments"]
                call["function"]["arguments"] = args if isinstance(args, str) else json.dumps(args)
        row["tools"] = json.dumps(row["tools"]) if isinstance(row.get("tools"), list) else row.get("tools")
    assert sum(r["tools"] is not None for r in rows) > 10
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    res = build(tmp_path, "qwen3", tmp_path / "rows.parquet")
    assert_targets(res, load_tokenizer("qwen3"), "qwen3", rows, "assistant")


def test_qwen3_semantics_reasoning_of_earlier_turns_is_not_in_the_text():
    """The trained text is the conversation rendered once: Qwen3 drops the reasoning of turns
    before the last user message, so it is neither in the text nor a target; the last turn's
    reasoning block is. Each turn's targets start after its header and end with <|im_end|>."""
    row = {"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "greet back"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "<think>\nsay bye\n</think>\n\nCiao"},
    ]}
    tok, [(ids, mask)] = encode("qwen3", [row])
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    turns = [tok.decode(ids[a:b]) for a, b in zip(edges[0::2], edges[1::2])]
    assert turns == ["Hello<|im_end|>", "<think>\nsay bye\n</think>\n\nCiao<|im_end|>"]
    assert "greet back" not in tok.decode(ids)


@pytest.mark.parametrize("template, why", [
    ("{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}{% endif %}{% endfor %}",
     "does not render an assistant message's content once"),
    # DeepSeek-R1 style: the generation prompt opens a <think> block that rendered answers do not have
    ("{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}{% else %}<｜Assistant｜>"
     "{{ m.content }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
     "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}",
     "is not what it renders before an assistant message"),
    ("{{ raise_exception('roles must alternate system/user') }}",
     "fails on a two-message probe conversation (TemplateError: roles must alternate system/user)"),
])
def test_a_template_it_cannot_handle_names_the_option(template, why):
    tok = _with_template("qwen3", template)
    conf = BuildConfig(input="-", tokenizer="-", format="chat", loss="assistant")
    with pytest.raises(ConfigError, match=r"generation %} markers.*`chat_template:`") as err:
        RowTokenizer("chat", conf.tokenize, tok, [JSON_COLUMN], None)
    assert why in str(err.value) and "\n" not in str(err.value)
    RowTokenizer("chat", BuildConfig(input="-", tokenizer="-", format="chat", loss="all").tokenize,
                 tok, [JSON_COLUMN], None)


def test_rows_a_template_cannot_locate_are_row_errors(monkeypatch):
    """A template that renders only the last two messages: the earlier turns are not in the
    text; such rows fail with a message naming the option, the others build."""
    template = ("{% for m in messages[-2:] %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    monkeypatch.setitem(FAMILIES, "last-two", ("qwen3", None, FAMILIES["qwen3"][2]))
    monkeypatch.setattr("test_chat_targets.load_tokenizer", lambda family: _with_template("qwen3", template))
    short = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    long = {"messages": short["messages"] * 2}
    bad_tools = dict(short, tools=5)
    _, got = encode("last-two", [short, long, bad_tools])
    assert not isinstance(got[0], str)
    assert "assistant messages (indices [1, 3])" in got[1] and "chat_template:" in got[1]
    assert got[2].startswith("'tools' must be a list of tool schemas") and "got 5" in got[2]


def test_a_template_that_refuses_the_placeholder_turns_is_a_row_error(monkeypatch):
    """A template that wants a tool message after an assistant tool call renders the row, but not
    with the call replaced: that row fails naming the option, the rows without tools build."""
    template = ("{% for m in messages %}{% if m.role == 'tool' and not messages[loop.index0 - 1].tool_calls %}"
                "{{ raise_exception('a tool message must follow a tool call') }}{% endif %}"
                "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    monkeypatch.setattr("test_chat_targets.load_tokenizer", lambda family: _with_template("qwen3", template))
    plain = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    call = {"messages": [{"role": "user", "content": "a"},
                         {"role": "assistant", "content": "", "tool_calls": [_tool_call(random.Random(0))]},
                         {"role": "tool", "content": "c"}, {"role": "assistant", "content": "d"}]}
    _, got = encode("qwen3", [plain, call, plain])
    assert not isinstance(got[0], str) and not isinstance(got[2], str)
    assert "a tool message must follow a tool call" in got[1] and "`chat_template:`" in got[1]


def _with_template(name: str, template: str):
    tok = copy.copy(_loaded(name))
    tok.chat_template = template
    return tok


def test_generation_markers_give_the_same_targets():
    """Qwen2.5's template with {% generation %} markers (tests/data; it renders the same text)
    goes through apply_chat_template's assistant mask, tools included: same targets as the
    reference on the unmarked template, no row rejected."""
    rows = conversations("qwen2.5", 150, seed=3)
    marked = _with_template("qwen3", (DATA / "qwen2_5_generation_chat_template.jinja").read_text())
    assert [_rendered(marked, r) for r in rows] == [_rendered(load_tokenizer("qwen2.5"), r) for r in rows]
    conf = BuildConfig(input="-", tokenizer="-", format="chat", loss="assistant")
    rt = RowTokenizer("chat", conf.tokenize, marked, [JSON_COLUMN], None)
    assert rt.has_generation
    lines = [json.dumps(r).encode() for r in rows]
    got = rt(pa.table({JSON_COLUMN: pa.array(lines, pa.binary())})).to_pylist()
    for r, (out, (ids, mask)) in enumerate(zip(got, references(marked, "qwen2.5", rows, "assistant"))):
        assert out["__error__"] is None, out["__error__"]
        np.testing.assert_array_equal(out["input_ids"], ids, err_msg=f"row {r}")
        np.testing.assert_array_equal(out["loss_mask"], mask, err_msg=f"row {r}")


_PIECES = ["hi", " ", "\n", "<|im_end|>", "<|im_start|>", "assistant", "user\n", "<|im_end|>\n<|im_start|>user\n",
           "<think>", "</think>", "é", "😀"]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["user", "assistant", "system"]),
                          st.lists(st.sampled_from(_PIECES), max_size=6).map("".join)), min_size=1, max_size=6))
def test_spans_equal_the_generation_spans_on_any_content(messages):
    """The demo ChatML template with and without its {% generation %} markers: the spans found
    in the unmarked render are the marked spans, whatever the content (special-token text,
    header-like text, empty)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from thdpack.offline.tokenizing.chat_spans import assistant_spans, with_sentinels
    from thdpack.offline.tokenizing.row_tokenizer import _turn_marks

    tok = _demo_tokenizer()
    marked = tok.chat_template
    plain = marked.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    conv = [{"role": r, "content": c} for r, c in messages]
    [text], [want] = render_jinja_template([conv], chat_template=marked, return_assistant_tokens_mask=True)
    [again, variant] = render_jinja_template([conv, with_sentinels(conv)], chat_template=plain)[0]
    assert again == text
    turns = [k for k, m in enumerate(conv) if m["role"] == "assistant"]
    marks = _turn_marks(_demo_tokenizer(plain))
    assert assistant_spans(text, variant, turns, marks) == [tuple(s) for s in want]


@functools.lru_cache(maxsize=None)
def _demo_tokenizer(template: str | None = None):
    from thdpack.demo import TOKENIZER_DIR

    tok = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)
    if template is not None:
        tok.chat_template = template
    return tok
