"""Row formats: ShareGPT (``conversations`` of from/value turns) and TRL's prompt/completion.

- ShareGPT rows build byte for byte as the same conversations written as ``messages``;
- prompt/completion rows give the ids and the completion mask TRL's ``SFTTrainer`` gives:
  the reference below is TRL's rule (``trl/trainer/sft_trainer.py``, ``tokenize_fn`` and
  ``add_eos``, at huggingface/trl f2cd577), computed with ``transformers`` only (TRL is not a
  dependency); with ``loss: all`` they build byte for byte as the equivalent text / messages rows;
- ``format: auto`` picks the format from the fields, ``format:`` overrides it;
- bad rows are row errors naming file:line and the field.

Both the bundled demo tokenizer and the real Qwen3 one (tests/real_tokenizers.py) are used.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

from thdpack.demo import TOKENIZER_DIR, generate_rows, write_jsonl  # noqa: E402
from thdpack.offline import BuildConfig, ConfigError, InputError, build_packed, load_packed, unpack_row  # noqa: E402
from thdpack.offline.tokenizing.row_formats import DETECTION_ORDER, detect_format  # noqa: E402
from thdpack.offline.stages import BuildStages  # noqa: E402
from thdpack.offline.tokenizing.row_conversions import (SHAREGPT_ROLES, prompt_completion, sharegpt_row,  # noqa: E402
                                                    sharegpt_to_messages)

TO_SHAREGPT = {"system": "system", "user": "human", "assistant": "gpt", "tool": "observation"}


@pytest.fixture(scope="module")
def rows():
    return generate_rows(16, seed=5, kind="chat")


@pytest.fixture(scope="module")
def qwen3():
    from real_tokenizers import real_tokenizer

    return str(real_tokenizer("qwen3"))


@pytest.fixture(scope="module")
def tokenizers(request):
    """name -> (directory, loaded tokenizer) for "demo", "qwen3", "llama3.2" (loaded once per module)."""
    cache = {}

    def get(name):
        if name not in cache:
            if name == "llama3.2":  # adds BOS: the prompt's tokens start with it too
                from real_tokenizers import real_tokenizer

                path = str(real_tokenizer("llama3.2"))
            else:
                path = str(TOKENIZER_DIR) if name == "demo" else request.getfixturevalue("qwen3")
            cache[name] = (path, transformers.AutoTokenizer.from_pretrained(path))
        return cache[name]

    return get


def build(tmp_path: Path, path, name: str, tokenizer=str(TOKENIZER_DIR), **kw):
    base = dict(input=str(path), tokenizer=tokenizer, pack_size=16384, overflow="error", shuffle_packs=False)
    if tokenizer != str(TOKENIZER_DIR):  # Qwen's: skip the tiktoken conversion (seconds; never changes the output)
        base.update(tokenizer_backend="hf", save_tokenizer=False)
    base.update(kw)
    return build_packed(BuildConfig(**base), tmp_path / name, progress=False)


def data_bytes(out: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(out.glob("data-*"))}


def built_rows(out: Path) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """input row -> (its token ids, its loss mask) in the packs."""
    ds = load_packed(out)
    got = {}
    for k in range(len(ds)):
        row = ds[k]
        for r, sample in zip(row["sample_index"], unpack_row(row)):
            got[int(r)] = (np.asarray(sample["input_ids"]), np.asarray(sample["loss_mask"], dtype=bool))
    return got


def as_sharegpt(row: dict) -> dict:
    return {"conversations": [{"from": TO_SHAREGPT[m["role"]], "value": m["content"]} for m in row["messages"]]}


def split_last_answer(row: dict) -> tuple[list, list]:
    """(prompt messages, completion messages): the conversation up to its last assistant turn, and that turn."""
    m = row["messages"]
    last = max(j for j, x in enumerate(m) if x["role"] == "assistant")
    return m[:last], m[last : last + 1]


def string_pairs(rows) -> list[dict]:
    """String prompt/completion rows; some prompts end in a space, so a token may merge across the boundary."""
    out = []
    for k, r in enumerate(rows):
        prompt, completion = split_last_answer(r)
        sep = " " if k % 3 == 0 else "\n"
        out.append({"prompt": "Q: " + prompt[-1]["content"] + sep, "completion": completion[0]["content"]})
    return out


# ---------------------------------------------------------------------------- TRL's rule (the reference)


def trl_string_reference(tok, row: dict) -> tuple[list, list]:
    """TRL, non-conversational prompt/completion: EOS text appended to the completion unless it
    ends with it; ids = tok(prompt + completion); mask = 0 for the first len(tok(prompt)) ids."""
    completion = row["completion"] if row["completion"].endswith(tok.eos_token) else row["completion"] + tok.eos_token
    prompt_ids = tok(text=row["prompt"])["input_ids"]
    ids = tok(text=row["prompt"] + completion)["input_ids"]
    return ids, [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))


def trl_chat_reference(tok, row: dict) -> tuple[list, list]:
    """TRL, conversational prompt/completion: prompt ids = apply_chat_template(prompt,
    add_generation_prompt=True); ids = apply_chat_template(prompt + completion); mask as above;
    the row's ``tools`` (JSON text is parsed) passed to both."""
    tools = row.get("tools")
    tools = json.loads(tools) if isinstance(tools, str) else tools
    prompt_ids = tok.apply_chat_template(row["prompt"], tools=tools, tokenize=True, return_dict=True,
                                         add_generation_prompt=True)["input_ids"]
    ids = tok.apply_chat_template(row["prompt"] + row["completion"], tools=tools, tokenize=True,
                                  return_dict=True)["input_ids"]
    return ids, [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))


def assert_rows_match(out: Path, want: list) -> None:
    got = built_rows(out)
    assert sorted(got) == list(range(len(want)))
    for r, (ids, mask) in enumerate(want):
        np.testing.assert_array_equal(got[r][0], ids, err_msg=f"row {r} ids")
        np.testing.assert_array_equal(got[r][1], np.asarray(mask, dtype=bool), err_msg=f"row {r} mask")


# ---------------------------------------------------------------------------- ShareGPT


def test_sharegpt_roles_map_to_messages():
    turns = [
        {"from": "system", "value": "s"}, {"from": "human", "value": "q"},
        {"from": "function_call", "value": json.dumps({"name": "f", "arguments": {"x": 1}})},
        {"from": "observation", "value": "r"}, {"from": "tool", "value": "r2"}, {"from": "gpt", "value": "a"},
        {"from": "user", "value": "q2"}, {"from": "assistant", "value": "a2"},
    ]
    assert sharegpt_to_messages(turns) == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "r"}, {"role": "tool", "content": "r2"}, {"role": "assistant", "content": "a"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"},
    ]
    two = json.dumps([{"name": "f", "arguments": "{}"}, {"name": "g", "arguments": {}}])
    calls = sharegpt_to_messages([{"from": "function_call", "value": two}])[0]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["f", "g"]


@pytest.mark.parametrize("loss", ["assistant", "all"])
def test_sharegpt_packs_byte_identical_to_messages(tmp_path, rows, loss):
    a = build(tmp_path, write_jsonl(rows, tmp_path / "m.jsonl"), "messages", loss=loss)
    b = build(tmp_path, write_jsonl([as_sharegpt(r) for r in rows], tmp_path / "s.jsonl"), "sharegpt", loss=loss)
    assert b.metadata["source"]["format"] == "sharegpt" and a.metadata["source"]["format"] == "chat"
    assert data_bytes(a.path) and data_bytes(a.path) == data_bytes(b.path)
    assert b.metadata["counts"]["skipped_rows"] == 0 and a.metadata["counts"] == b.metadata["counts"]


def test_sharegpt_system_column_from_parquet(tmp_path, rows):
    """LLaMA-Factory's optional ``system`` column is the first message, unless the first turn is a
    system turn (which wins); read from columns (Parquet) as from JSON lines."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sharegpt = [dict(as_sharegpt(r), system=f"Be brief {k}." if k % 2 else None) for k, r in enumerate(rows)]
    messages = []
    for k, r in enumerate(rows):
        m = r["messages"]
        first_is_system = m[0]["role"] == "system"
        messages.append({"messages": m if first_is_system or k % 2 == 0 else
                         [{"role": "system", "content": f"Be brief {k}."}] + m})
    firsts = {(k % 2, r["messages"][0]["role"]) for k, r in enumerate(rows)}
    assert {(1, "system"), (1, "user")} <= firsts  # a system column with and without a system turn
    pq.write_table(pa.Table.from_pylist(sharegpt), tmp_path / "s.parquet")
    a = build(tmp_path, write_jsonl(messages, tmp_path / "m.jsonl"), "messages")
    b = build(tmp_path, tmp_path / "s.parquet", "parquet")
    c = build(tmp_path, write_jsonl(sharegpt, tmp_path / "s.jsonl"), "json")
    assert data_bytes(a.path) and data_bytes(a.path) == data_bytes(b.path) == data_bytes(c.path)


def test_sharegpt_tool_turns_qwen3_byte_identical_to_messages(tmp_path, tokenizers):
    """function_call / observation turns render through Qwen3's template (tool calls, tool
    responses) exactly as the messages they map to."""
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    sharegpt = [{"conversations": [
        {"from": "system", "value": "You are helpful."},
        {"from": "human", "value": f"Weather in city {k}?"},
        {"from": "function_call", "value": json.dumps(call)},
        {"from": "observation", "value": f'{{"temp": {k}}}'},
        {"from": "gpt", "value": f"It is {k} degrees."},
    ]} for k in range(6)]
    messages = [{"messages": sharegpt_to_messages(r["conversations"])} for r in sharegpt]
    qwen3, tok = tokenizers("qwen3")
    a = build(tmp_path, write_jsonl(messages, tmp_path / "m.jsonl"), "messages", qwen3, loss="all")
    b = build(tmp_path, write_jsonl(sharegpt, tmp_path / "s.jsonl"), "sharegpt", qwen3, loss="all")
    assert data_bytes(a.path) == data_bytes(b.path) and b.metadata["counts"]["skipped_rows"] == 0
    text = tok.decode(built_rows(b.path)[0][0])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temp": 0}\n</tool_response>' in text


# ---------------------------------------------------------------------------- prompt / completion


@pytest.mark.parametrize("tokenizer", ["demo", "qwen3", "llama3.2"])
def test_string_prompt_completion_equals_trl(tmp_path, rows, tokenizer, tokenizers):
    tdir, tok = tokenizers(tokenizer)
    pairs = string_pairs(rows)
    res = build(tmp_path, write_jsonl(pairs, tmp_path / "pc.jsonl"), "out", tdir)
    assert res.metadata["source"]["format"] == "prompt_completion"
    if tok.bos_token_id is not None:
        assert all(ids[0] == tok.bos_token_id for ids, _ in built_rows(res.path).values())
    assert_rows_match(res.path, [trl_string_reference(tok, p) for p in pairs])


@pytest.mark.parametrize("tokenizer", ["demo", "qwen3"])
def test_conversational_prompt_completion_equals_trl(tmp_path, rows, tokenizer, tokenizers):
    """Multi-turn prompts (Qwen3's template drops earlier reasoning and adds an empty think
    block to the last answer: the completion's targets still follow TRL's rule)."""
    tdir, tok = tokenizers(tokenizer)
    pairs = [dict(zip(("prompt", "completion"), split_last_answer(r))) for r in rows]
    res = build(tmp_path, write_jsonl(pairs, tmp_path / "pc.jsonl"), "out", tdir)
    want = [trl_chat_reference(tok, p) for p in pairs]
    assert_rows_match(res.path, want)
    assert all(0 < sum(m) < len(ids) for ids, m in want)  # the reference has prompt and completion tokens


def test_conversational_prompt_completion_with_tools_qwen3_equals_trl(tmp_path, tokenizers):
    """A ``tools`` column goes to the template (as TRL passes it); a completion of several
    messages (tool call, tool response, answer) is trained whole."""
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    pairs = []
    for k in range(4):
        completion = [{"role": "assistant", "content": "", "tool_calls": [call]},
                      {"role": "tool", "content": f'{{"temp": {k}}}'},
                      {"role": "assistant", "content": f"It is {k} degrees."}]
        tools = [None, [tool], json.dumps([tool]), [tool]][k]
        pairs.append({"prompt": [{"role": "user", "content": f"Weather in Paris, day {k}?"}],
                      "completion": completion, "tools": tools})
    tdir, tok = tokenizers("qwen3")
    res = build(tmp_path, write_jsonl(pairs, tmp_path / "pc.jsonl"), "out", tdir)
    want = [trl_chat_reference(tok, p) for p in pairs]
    assert_rows_match(res.path, want)
    texts = {r: tok.decode(ids) for r, (ids, _) in built_rows(res.path).items()}
    assert "<tools>" not in texts[0] and all("<tools>" in texts[r] for r in (1, 2, 3))


def test_prompt_completion_with_loss_all_packs_as_text_and_messages_rows(tmp_path, rows):
    """loss: all trains every token: string pairs build byte for byte as text rows of
    prompt + completion (EOS appended), message pairs as the whole conversation's messages rows."""
    pairs = string_pairs(rows)
    a = build(tmp_path, write_jsonl([{"text": p["prompt"] + p["completion"]} for p in pairs], tmp_path / "t.jsonl"), "t")
    b = build(tmp_path, write_jsonl(pairs, tmp_path / "p.jsonl"), "p", loss="all")
    assert data_bytes(a.path) and data_bytes(a.path) == data_bytes(b.path)
    chats = [dict(zip(("prompt", "completion"), split_last_answer(r))) for r in rows]
    whole = [{"messages": c["prompt"] + c["completion"]} for c in chats]
    c = build(tmp_path, write_jsonl(whole, tmp_path / "m.jsonl"), "m", loss="all")
    d = build(tmp_path, write_jsonl(chats, tmp_path / "c.jsonl"), "c", loss="all")
    assert data_bytes(c.path) and data_bytes(c.path) == data_bytes(d.path)


def test_prompt_completion_from_parquet_with_content_parts(tmp_path, rows):
    """Columns (not JSON lines) are read too; content parts are joined as in messages rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    chats = [dict(zip(("prompt", "completion"), split_last_answer(r))) for r in rows]
    parts = [{"prompt": [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in c["prompt"]],
              "completion": c["completion"]} for c in chats]
    pq.write_table(pa.Table.from_pylist(parts), tmp_path / "pc.parquet")
    a = build(tmp_path, write_jsonl(chats, tmp_path / "pc.jsonl"), "json")
    b = build(tmp_path, tmp_path / "pc.parquet", "parquet")
    assert b.metadata["source"]["format"] == "prompt_completion"
    assert data_bytes(a.path) and data_bytes(a.path) == data_bytes(b.path)


# ---------------------------------------------------------------------------- detection and override


def test_detection_order(tmp_path):
    cfg = BuildConfig().tokenize
    assert DETECTION_ORDER == ("chat", "sharegpt", "preference", "prompt_completion", "tokenized", "text")
    assert detect_format(["prompt", "chosen", "rejected", "text"], cfg) == "preference"
    assert detect_format(["messages", "conversations", "prompt", "completion"], cfg) == "chat"
    assert detect_format(["conversations", "prompt", "completion", "text"], cfg) == "sharegpt"
    assert detect_format(["prompt", "completion", "input_ids", "text"], cfg) == "prompt_completion"
    assert detect_format(["prompt", "input_ids", "text"], cfg) == "tokenized"
    assert detect_format(["prompt", "text"], cfg) == "text"
    assert detect_format(["prompt"], cfg) is None
    with pytest.raises(InputError, match=r"cannot tell the row format .*'prompt' \+ 'completion' \(prompt_completion\)"):
        build(tmp_path, write_jsonl([{"prompt": "only"}], tmp_path / "p.jsonl"), "out")


def test_format_option_overrides_detection(tmp_path, rows):
    pairs = [dict(p, text=p["prompt"] + p["completion"]) for p in string_pairs(rows)]
    path = write_jsonl(pairs, tmp_path / "both.jsonl")
    auto = build(tmp_path, path, "auto")
    text = build(tmp_path, path, "text", format="text")
    assert auto.metadata["source"]["format"] == "prompt_completion" and text.metadata["source"]["format"] == "text"
    assert all(m.all() for _, m in built_rows(text.path).values())
    assert not any(m.all() for _, m in built_rows(auto.path).values())
    # role/content turns under 'conversations' are messages rows: format chat + messages_field
    convs = write_jsonl([{"conversations": r["messages"]} for r in rows], tmp_path / "convs.jsonl")
    chat = build(tmp_path, convs, "chat", format="chat", messages_field="conversations")
    plain = build(tmp_path, write_jsonl(rows, tmp_path / "m.jsonl"), "plain")
    assert data_bytes(chat.path) == data_bytes(plain.path)
    with pytest.raises(ConfigError, match="format must be one of"):
        build(tmp_path, path, "bad", format="alpaca")


# ---------------------------------------------------------------------------- the registry of formats

FORMAT_NAMES = ["chat", "sharegpt", "prompt_completion", "preference", "text", "tokenized"]


def format_flag_accepts(name: str) -> bool:
    """Whether ``thdpack build --format NAME`` parses (its choices come from BuildConfig's field)."""
    import argparse

    from thdpack.cli.config_flags import add_config_flags

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_config_flags(parser, only=("format",))
    try:
        return parser.parse_args(["--format", name]).format == name
    except argparse.ArgumentError:
        return False


def test_format_choices_are_auto_and_the_registered_formats():
    """``format``'s choices (the option and the flag) are "auto" + the registered formats, in the order of
    registration; ``auto`` tries every one of them."""
    from thdpack.offline.stage_options import FORMATS
    from thdpack.offline.tokenizing.row_formats import ROW_FORMATS

    assert list(ROW_FORMATS) == FORMAT_NAMES == FORMATS[1:] and sorted(DETECTION_ORDER) == sorted(FORMAT_NAMES)
    for name in ["auto", *FORMAT_NAMES]:
        assert BuildConfig(input="-", format=name).validate().tokenize.format == name and format_flag_accepts(name)
    with pytest.raises(ConfigError, match="^format must be one of auto, chat, sharegpt, prompt_completion, "
                                          "preference, text, tokenized; got 'alpaca'$"):
        BuildConfig(input="-", format="alpaca").validate()
    assert not format_flag_accepts("alpaca")


def test_the_format_choices_are_known_without_importing_the_formats():
    """``BuildConfig`` (the lower layer) states the choices itself: nothing registers into it on import."""
    code = ("import sys; from thdpack.offline.config import BuildConfig; "
            "assert BuildConfig(input='-', format='sharegpt').validate().tokenize.format == 'sharegpt'; "
            "assert 'thdpack.offline.tokenizing.row_formats' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_new_row_format_is_one_registered_class():
    """A class that calls register_format, its name added to ``FORMATS``, is a format: a choice of ``format``
    and ``--format``, and rows the row tokenizer builds by asking it (its fields, the value it encodes, the
    encoder). A class whose name is not a choice is refused."""
    import pyarrow as pa

    from thdpack.offline import stage_options as options
    from thdpack.offline.tokenizing import row_formats
    from thdpack.offline.tokenizing.row_tokenizer import RowTokenizer

    class Shouted(row_formats.TextFormat):
        """Text rows in capitals."""

        name = "shouted"

        def fields(self, cfg):
            return ["line"]

        def value(self, v, field, messages):
            return super().value(v, field, messages).upper()

    with pytest.raises(ValueError, match="^row format 'shouted' is not a choice of 'format': add its name to FORMATS"):
        row_formats.register_format(Shouted)
    saved = dict(row_formats.ROW_FORMATS), list(options.FORMATS)
    try:
        options.FORMATS.append("shouted")
        row_formats.register_format(Shouted)
        cfg = BuildConfig(input="-", tokenizer=str(TOKENIZER_DIR), format="shouted").validate()
        assert format_flag_accepts("shouted")
        tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)
        got = RowTokenizer("shouted", cfg.tokenize, tok, ["line"])(pa.table({"line": ["Hello there", "", "ok"]}))
        want = RowTokenizer("text", cfg.override(format="text").tokenize, tok, ["text"])(
            pa.table({"text": ["HELLO THERE", "", "OK"]}))
        assert got.column("__error__").to_pylist() == [None, "'line' is empty", None]
        assert got.drop_columns(["__error__"]).equals(want.drop_columns(["__error__"]))
    finally:
        row_formats.ROW_FORMATS.clear()
        row_formats.ROW_FORMATS.update(saved[0])
        options.FORMATS[:] = saved[1]
    assert not format_flag_accepts("shouted")


def test_preference_rows_give_two_sequences_and_others_one():
    from thdpack.offline.tokenizing.row_formats import row_format

    pref = row_format("preference")
    values, errors, tools = pref.sequences([("c0", "r0"), None, ("c2", "r2")], [None, "bad", None], ["t0", None, "t2"])
    assert values == ["c0", "r0", None, None, "c2", "r2"] and errors == [None, None, "bad", "bad", None, None]
    assert tools == ["t0", "t0", None, None, "t2", "t2"]
    np.testing.assert_array_equal(pref.sequence_rows(6), [0, 0, 1, 1, 2, 2])
    for name in [n for n in FORMAT_NAMES if n != "preference"]:
        assert row_format(name).sequences(["v"], [None], ["t"]) == (["v"], [None], ["t"])
        np.testing.assert_array_equal(row_format(name).sequence_rows(3), [0, 1, 2])
    with pytest.raises(ValueError, match="^unknown row format 'alpaca'; use one of chat, sharegpt, "):
        row_format("alpaca")


def test_vlm_rows_refuse_formats_whose_text_cannot_hold_images():
    """Tokenized rows (no text to expand the placeholders in) and prompt/completion rows."""
    from thdpack.offline.vision.vlm_rows import VlmRowTokenizer

    cfg = BuildConfig(input="-").tokenize
    with pytest.raises(ConfigError, match=r"^rows with images must be chat or text rows: the image placeholders are "
                                          r"expanded before tokenizing \(already tokenized VLM rows are not supported\)$"):
        VlmRowTokenizer("tokenized", cfg, None, [], None, None)
    for name in ("prompt_completion", "preference"):
        with pytest.raises(ConfigError, match=f"^rows with images must be chat \\(messages or sharegpt\\) or text rows, "
                                              f"not {name}$"):
            VlmRowTokenizer(name, cfg, None, [], None, None)


# ---------------------------------------------------------------------------- bad rows

GOOD_SHAREGPT = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]}
BAD_SHAREGPT = [  # (row, what the error says)
    ({"conversations": [{"value": "hi"}, {"from": "gpt", "value": "ok"}]}, "'conversations' turn 0 has no 'from'"),
    ({"conversations": [{"from": "human"}, {"from": "gpt", "value": "ok"}]}, "'conversations' turn 0 has no 'value'"),
    ({"conversations": [{"from": "bot", "value": "hi"}]}, "'conversations' turn 0: unknown role 'bot' in 'from'"),
    ({"conversations": [{"from": ["human"], "value": "hi"}]}, "'conversations' turn 0: unknown role ['human'] in 'from'"),
    ({"conversations": [{"from": "human", "value": 3}]}, "'conversations' turn 0: 'value' must be a string"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "function_call", "value": "f(x)"}]},
     "'conversations' turn 1: a function_call 'value' must be JSON"),
    ({"conversations": [{"role": "user", "content": "hi"}]}, "'conversations' turn 0 has no 'from'"),
    ({"conversations": []}, "'conversations' must be a non-empty list of turns"),
    ({"conversations": "hi"}, "'conversations' must be a non-empty list of turns"),
    ({"messages": []}, "no 'conversations' field"),
    (dict(GOOD_SHAREGPT, system=["be brief"]), "'system' must be a string (the system prompt)"),
]
GOOD_PC = {"prompt": "Q: hi\n", "completion": "ok"}
BAD_PC = [
    ({"prompt": "Q: hi\n"}, "no 'completion' field"),
    ({"completion": "ok"}, "no 'prompt' field"),
    ({"prompt": 5, "completion": "ok"}, "'prompt' must be a string or a list of messages, got 5"),
    ({"prompt": "Q", "completion": None}, "'completion' must be a string or a list of messages, got None"),
    ({"prompt": "Q", "completion": [{"role": "assistant", "content": "ok"}]},
     "'prompt' and 'completion' must both be strings or both lists of messages"),
    ({"prompt": [{"content": "hi"}], "completion": [{"role": "assistant", "content": "ok"}]},
     "'prompt' message 0 must be an object with a 'role' string"),
    ({"prompt": [{"role": "user", "content": "hi"}], "completion": []},
     "'completion' must be a non-empty list of messages"),
    ({"prompt": [{"role": "user", "content": 7}], "completion": [{"role": "assistant", "content": "ok"}]},
     "'prompt' message 0: 'content' must be a string or a list of content parts"),
    ({"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": [{"text": "a"}]}]},
     "'completion' message 0 part 0: a content part must be an object with a 'type'"),
]


def test_any_json_value_converts_or_is_a_value_error():
    """Whatever JSON a row holds, the conversions return or raise ValueError (a row error), never
    another exception that would stop the build."""
    hypothesis = pytest.importorskip("hypothesis")
    from thdpack.offline.tokenizing.chat_content import flatten_content

    st = hypothesis.strategies
    scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5)
    keys = st.sampled_from(["from", "value", "role", "content", "name", "arguments", "type", "text"])
    json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                               | st.dictionaries(keys | st.text(max_size=3), inner, max_size=4), max_leaves=12)
    roles = st.sampled_from(list(SHAREGPT_ROLES) + ["bot"]) | json_values
    turns = st.lists(st.fixed_dictionaries({}, optional={"from": roles, "value": json_values}) | json_values, max_size=3)

    @hypothesis.settings(max_examples=300, deadline=None, derandomize=True)
    @hypothesis.given(conversations=turns | json_values, system=json_values, prompt=json_values, completion=json_values)
    def check(conversations, system, prompt, completion):
        for convert, row in ((sharegpt_row, {"conversations": conversations, "system": system}),
                             (lambda r: prompt_completion(r, flatten_content), {"prompt": prompt, "completion": completion})):
            try:
                convert(row)
            except ValueError:
                pass

    check()


def write_mixed(tmp_path: Path, good: dict, bad: list, name: str) -> tuple[Path, dict[int, str]]:
    """Good and bad rows alternating; returns the file and {line: expected error}."""
    lines, expected = [], {}
    for row, error in bad:
        lines.append(json.dumps(good))
        lines.append(json.dumps(row))
        expected[len(lines)] = error
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path, expected


@pytest.mark.parametrize("fmt, good, bad", [("sharegpt", GOOD_SHAREGPT, BAD_SHAREGPT),
                                            ("prompt_completion", GOOD_PC, BAD_PC)])
def test_bad_rows_name_file_line_and_field(tmp_path, fmt, good, bad):
    path, expected = write_mixed(tmp_path, good, bad, f"{fmt}.jsonl")
    with pytest.raises(InputError) as err:
        build(tmp_path, path, "out", format=fmt)
    first = min(expected)
    assert f"{len(expected)} bad row(s)" in str(err.value) and f"{path}:{first}: {expected[first]}" in str(err.value)
    res = build(tmp_path, path, "skip", format=fmt, skip_bad_rows=True, num_proc=2, map_batch_size=4)
    examples = res.metadata["skipped_examples"]
    assert res.metadata["counts"]["skipped_rows"] == len(bad) and res.metadata["counts"]["samples"] == len(bad)
    assert [e["where"] for e in examples] == [f"{path}:{line}" for line in sorted(expected)]
    for e, line in zip(examples, sorted(expected)):
        assert e["error"].startswith(expected[line]), (line, e["error"])


def test_messages_without_a_chat_template_are_row_errors(tmp_path):
    """String pairs need no template; message pairs fail with a message saying what to give."""
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_bytes((TOKENIZER_DIR / "tokenizer.json").read_bytes())
    config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    rows = [GOOD_PC, {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "ok"}]}]
    res = build(tmp_path, write_jsonl(rows, tmp_path / "pc.jsonl"), "out", str(tok_dir), skip_bad_rows=True)
    assert res.metadata["counts"]["samples"] == 1
    [skipped] = res.metadata["skipped_examples"]
    assert skipped["where"].endswith("pc.jsonl:2")
    assert "the tokenizer has no chat template; give one with chat_template: FILE" in skipped["error"]


def test_prompt_completion_rows_with_images_are_refused(tmp_path):
    from thdpack.offline.inputs.sources import read_source
    from thdpack.offline.tokenizing.tokenize_step import tokenize_source

    cfg = BuildConfig(input=str(write_jsonl([GOOD_PC], tmp_path / "pc.jsonl")), tokenizer=str(TOKENIZER_DIR))
    stages = BuildStages.from_config(cfg)
    with pytest.raises(ConfigError, match="rows with images must be chat .* not prompt_completion"):
        tokenize_source(stages.tokenize, read_source(stages.inputs, progress=False), tmp_path, progress=False,
                        vlm=object())


def test_missing_column_names_the_file_and_format(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "text": "b"}]), tmp_path / "x.parquet")
    with pytest.raises(InputError, match=r"x\.parquet: no 'completion' column for format 'prompt_completion'"):
        build(tmp_path, tmp_path / "x.parquet", "out", format="prompt_completion")
