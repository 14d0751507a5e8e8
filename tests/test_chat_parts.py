"""Chat rows whose message content is a list of OpenAI / transformers content parts.

Text parts are joined in order with nothing between them, so a build of such rows is
byte for byte the build of the same rows with string content, and its tokens are the
ones a template that loops over the parts itself (Qwen2-VL's) gives. Any other content
is a row error naming file:line, counted under ``skip_bad_rows``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

from thdpack.demo import TOKENIZER_DIR, generate_rows, write_jsonl  # noqa: E402
from thdpack.offline import BuildConfig, InputError, build_packed, load_packed, unpack_row  # noqa: E402
from thdpack.offline.tokenizing.chat_content import flatten_content  # noqa: E402

# Qwen2-VL's chat template: list content is rendered part by part, each text part as is.
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def rows():
    return generate_rows(24, seed=11, kind="chat")


def as_text_parts(row: dict) -> dict:
    """``row`` with every message's content cut into 1-3 text parts (mid-word cuts too)."""
    messages = []
    for j, m in enumerate(row["messages"]):
        text = m["content"]
        cuts = sorted({len(text) * c // 7 for c in range(1, 1 + j % 3)})
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        messages.append({"role": m["role"], "content": [{"type": "text", "text": p} for p in pieces]})
    return {"messages": messages}


def build(tmp_path, path, name, **kw):
    base = dict(input=str(path), tokenizer=str(TOKENIZER_DIR), pack_size=1024, overflow="truncate")
    base.update(kw)
    return build_packed(BuildConfig(**base), tmp_path / name, progress=False)


def data_bytes(out: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(out.glob("data-*"))}


def row_tokens(out: Path) -> dict[int, np.ndarray]:
    """input row -> its tokens in the packs (untruncated builds)."""
    ds = load_packed(out)
    got = {}
    for k in range(len(ds)):
        row = ds[k]
        for r, sample in zip(row["sample_index"], unpack_row(row)):
            got[int(r)] = np.asarray(sample["input_ids"])
    return got


# ---------------------------------------------------------------------------- the join


def test_flatten_joins_text_parts_in_order_and_keeps_the_rest():
    messages = [
        {"role": "system", "content": "plain"},
        {"role": "user", "content": [{"type": "text", "text": "Hel"}, "lo", {"type": "text", "text": " world"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]},
        {"role": "user", "content": []},
    ]
    out = flatten_content(messages)
    assert [m.get("content") for m in out] == ["plain", "Hello world", None, ""]
    assert out[2]["tool_calls"] == [{"name": "f"}]
    assert messages[1]["content"][0] == {"type": "text", "text": "Hel"}  # the input is not modified


@pytest.mark.parametrize("loss", ["assistant", "all"])
def test_text_parts_pack_byte_identical_to_string_content(tmp_path, rows, loss):
    plain = write_jsonl(rows, tmp_path / "plain.jsonl")
    parts = write_jsonl([as_text_parts(r) for r in rows], tmp_path / "parts.jsonl")
    a = build(tmp_path, plain, "plain", loss=loss)
    b = build(tmp_path, parts, "parts", loss=loss)
    assert data_bytes(a.path) and data_bytes(a.path) == data_bytes(b.path)
    assert a.metadata["counts"] == b.metadata["counts"]
    assert b.metadata["counts"]["skipped_rows"] == 0


def test_join_gives_the_tokens_of_a_template_that_renders_parts(tmp_path, rows):
    """Qwen2-VL's template renders list content itself: transformers' tokens of the raw
    rows (no thdpack code) are the built rows' tokens (prefix path: no generation markers)."""
    template = tmp_path / "qwen2_vl.jinja"
    template.write_text(QWEN2_VL_TEMPLATE)
    part_rows = [as_text_parts(r) for r in rows]
    path = write_jsonl(part_rows, tmp_path / "parts.jsonl")
    res = build(tmp_path, path, "out", chat_template=str(template), pack_size=8192)
    tok = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)
    want = tok.apply_chat_template([r["messages"] for r in part_rows], tokenize=True, return_dict=True,
                                   chat_template=QWEN2_VL_TEMPLATE)["input_ids"]
    got = row_tokens(res.path)
    assert sorted(got) == list(range(len(rows)))
    for r, ids in got.items():
        np.testing.assert_array_equal(ids, want[r], err_msg=f"row {r}")


# ---------------------------------------------------------------------------- bad content

GOOD_ANSWER = {"role": "assistant", "content": "ok"}
BAD_ROWS = [  # (user message, what the error says)
    ({"role": "user", "content": 5}, "message 0: 'content' must be a string or a list of content parts"),
    ({"role": "user", "content": {"text": "hi"}}, "message 0: 'content' must be a string or a list of content parts"),
    ({"role": "user", "content": [{"text": "hi"}]}, "message 0 part 0: a content part must be an object with a 'type'"),
    ({"role": "user", "content": [{"type": "text", "text": "a"}, 7]},
     "message 0 part 1: a content part must be an object with a 'type'"),
    ({"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]},
     "message 0 part 0: part type 'audio' is not supported"),
    ({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]},
     "message 0 part 0: an image part in a text build; give a Qwen-VL model_config"),
    ({"role": "user", "content": [{"type": "text"}]}, "message 0 part 0: a text part needs a 'text' string"),
    ({"role": "user", "content": [{"type": "text", "text": 3}]}, "message 0 part 0: a text part needs a 'text' string"),
    ({"content": "no role"}, "message 0 must be an object with a 'role' string"),
]


def write_mixed(tmp_path, good_rows) -> tuple[Path, dict[int, str]]:
    """Good and bad rows alternating; returns the file and {line: expected error}."""
    lines, expected = [], {}
    for k, (message, error) in enumerate(BAD_ROWS):
        lines.append(json.dumps(as_text_parts(good_rows[k])))
        lines.append(json.dumps({"messages": [message, GOOD_ANSWER]}))
        expected[len(lines)] = error
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, expected


def test_bad_content_fails_the_build_naming_file_and_line(tmp_path, rows):
    path, expected = write_mixed(tmp_path, rows)
    with pytest.raises(InputError) as err:
        build(tmp_path, path, "out")
    msg = str(err.value)
    assert f"{len(expected)} bad row(s)" in msg and "--skip-bad-rows" in msg
    first = min(expected)
    assert f"{path}:{first}: {expected[first]}" in msg
    assert "TypeError" not in msg and "jinja" not in msg.lower()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("num_proc", [1, 2])
def test_bad_content_is_skipped_and_counted(tmp_path, rows, num_proc):
    path, expected = write_mixed(tmp_path, rows)
    res = build(tmp_path, path, "out", skip_bad_rows=True, num_proc=num_proc, map_batch_size=4)
    counts = res.metadata["counts"]
    assert counts["skipped_rows"] == len(expected) and counts["samples"] == len(BAD_ROWS)
    examples = res.metadata["skipped_examples"]
    assert [e["where"] for e in examples] == [f"{path}:{line}" for line in sorted(expected)]
    for e, line in zip(examples, sorted(expected)):
        assert e["error"].startswith(expected[line]), (line, e["error"])
        assert "\n" not in e["error"]
