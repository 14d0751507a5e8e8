"""``thdpack build`` on configs, tokenizers and inputs that are not what they claim, and on data
that would be lost without a word (issue 21, causes 3, 4 and 5). Every case ends in one
``thdpack build: error:`` line (exit 2) naming the file, row or key at fault and what to do, or,
where the input is valid after all, in the same build as before."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from test_cli_robust import _error_line  # noqa: E402

from thdpack.cli import main  # noqa: E402
from thdpack.demo import TOKENIZER_DIR  # noqa: E402
from thdpack.offline import load_packed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOK = Path(TOKENIZER_DIR)
QWEN3_8B = ROOT / "configs" / "models" / "qwen3-8b.json"


def _chat(i: int, role: str = "user") -> dict:
    return {"messages": [{"role": role, "content": f"hi é {i}"}, {"role": "assistant", "content": f"hello there {i}"}]}


def _write_rows(path: Path, rows: list, encoding: str = "utf-8") -> Path:
    path.write_bytes("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode(encoding))
    return path


@pytest.fixture
def chat(tmp_path) -> Path:
    return _write_rows(tmp_path / "chat.jsonl", [_chat(i) for i in range(12)])


def _build(capsys, *args, rc: int = 2) -> str:
    """Run ``thdpack build ARGS -q`` in this process; the error line when ``rc`` is 2 (checked to be one line)."""
    assert main(["build", *map(str, args), "-q"]) == rc, capsys.readouterr().err
    err = capsys.readouterr().err
    return _error_line(err, "build") if rc == 2 else err


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "build.yaml"
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------- 3. config values and files


@pytest.mark.parametrize("key, value, expected", [
    ("tokenizer", "5", "tokenizer must be a non-empty string, got 5"),
    ("tokenizer", "true", "tokenizer must be a non-empty string, got True"),
    ("chat_template", "[a, b]", "chat_template must be a non-empty string, got ['a', 'b']"),
    ("chat_template", "{x: 1}", "chat_template must be a non-empty string"),
    ("text_field", "7", "text_field must be a non-empty string, got 7"),
    ("model_config", "5", "model_config must be a path or a mapping, got 5"),
])
def test_config_value_of_the_wrong_type(tmp_path, chat, capsys, key, value, expected):
    cfg = _config(tmp_path, f"input: {chat}\ntokenizer: {TOK}\n{key}: {value}\n")
    line = _build(capsys, "--config", cfg, "--output", tmp_path / "out")
    assert expected in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model, expected", [
    ("{}", "model_config (inline mapping) is empty; give the model's config.json"),
    ("{model_type: llama}", "model_config (inline mapping) has no 'hidden_size'"),
    ("{hidden_size: abc, num_hidden_layers: 2, num_attention_heads: 2, vocab_size: 10}",
     "'hidden_size' must be an integer >= 1, got 'abc'"),
    ("{hidden_size: 64, num_hidden_layers: -3, num_attention_heads: 2, vocab_size: 10}",
     "'num_hidden_layers' must be an integer >= 1, got -3"),
    ("{hidden_size: 64, num_hidden_layers: 2, num_attention_heads: true, vocab_size: 10}",
     "'num_attention_heads' must be an integer >= 1, got True"),
    ("{hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 2, vocab_size: 10, head_dim: 0}",
     "'head_dim' must be an integer >= 1, got 0"),
    ("{text_config: 3, hidden_size: 64}", "'text_config' must be a mapping"),
])
def test_model_config_without_keys_or_with_nonsense_values(tmp_path, chat, capsys, model, expected):
    cfg = _config(tmp_path, f"input: {chat}\ntokenizer: {TOK}\nmodel_config: {model}\n")
    line = _build(capsys, "--config", cfg, "--output", tmp_path / "out")
    assert expected in line
    assert not (tmp_path / "out").exists()


def test_model_config_file_names_the_file_and_a_real_one_builds(tmp_path, chat, capsys):
    (tmp_path / "m.json").write_text('{"model_type": "qwen3", "hidden_size": 64}')
    line = _build(capsys, "--input", chat, "--tokenizer", TOK, "--model-config", tmp_path / "m.json",
                  "--output", tmp_path / "out")
    assert f"model_config {tmp_path / 'm.json'} has no 'num_hidden_layers'" in line
    _build(capsys, "--input", chat, "--tokenizer", TOK, "--model-config", QWEN3_8B, "--output", tmp_path / "ok", rc=0)
    assert "overcount" in load_packed(tmp_path / "ok").metadata["stats"]["model_flops"]


@pytest.mark.parametrize("text, where, problem", [
    ("tokenizer: [a\n", ":2:1: invalid YAML: expected ',' or ']'", "while parsing a flow sequence at 1:12"),
    ("a: b\n  c: d\n", ":2:4: invalid YAML: mapping values are not allowed here", ""),
    ('pack_size: "12\n', ":2:1: invalid YAML: found unexpected end of stream", "while scanning a quoted scalar at 1:12"),
])
def test_yaml_syntax_error_is_one_line_naming_the_place(tmp_path, capsys, text, where, problem):
    cfg = _config(tmp_path, text)
    line = _build(capsys, "--config", cfg, "--output", tmp_path / "out")
    assert f"{cfg}{where}" in line and problem in line


def test_config_file_not_utf8_or_a_directory(tmp_path, capsys):
    (tmp_path / "latin.yaml").write_bytes("pack_size: 12 # caf\xe9\n".encode("latin-1"))
    line = _build(capsys, "--config", tmp_path / "latin.yaml", "--output", tmp_path / "out")
    assert "latin.yaml: not UTF-8 text (byte 0xe9 at offset 19)" in line
    line = _build(capsys, "--config", tmp_path, "--output", tmp_path / "out")
    assert f"config file {tmp_path} is a directory" in line


def _broken_tokenizer(d: Path, case: str) -> Path:
    d.mkdir()
    if case != "nothing":
        shutil.copy(TOK / "tokenizer_config.json", d)
    data = (TOK / "tokenizer.json").read_bytes()
    if case == "truncated":
        (d / "tokenizer.json").write_bytes(data[:5000])
    elif case == "garbage":
        (d / "tokenizer.json").write_bytes(bytes(range(256)) * 8)
    elif case == "empty":
        (d / "tokenizer.json").write_bytes(b"")
    elif case == "unreadable":  # a directory in its place: unreadable even by root
        (d / "tokenizer.json").mkdir()
    elif case == "bad_config":
        (d / "tokenizer.json").write_bytes(data)
        (d / "tokenizer_config.json").write_text('{"model_max_length": ')
    return d


@pytest.mark.parametrize("case, expected", [
    ("truncated", "tokenizer.json is not valid JSON (Expecting ',' delimiter at line "),
    ("garbage", "tokenizer.json is not UTF-8 text (byte 0x80 at offset 128): damaged"),
    ("empty", "tokenizer.json is empty"),
    ("unreadable", "cannot read tokenizer.json (Is a directory)"),
    ("config_only", "no tokenizer.json (the directory holds tokenizer_config.json); a tokenizer directory needs "
                    "tokenizer.json and tokenizer_config.json"),
    ("nothing", "no tokenizer.json (the directory holds nothing)"),
    ("bad_config", "tokenizer_config.json is not valid JSON"),
])
def test_broken_tokenizer_directory_names_the_file(tmp_path, chat, capsys, case, expected):
    tok = _broken_tokenizer(tmp_path / "tok", case)
    line = _build(capsys, "--input", chat, "--tokenizer", tok, "--output", tmp_path / "out")
    assert f"tokenizer '{tok}': cannot load {tok}: {expected}" in line
    assert not (tmp_path / "out").exists()


def test_tokenizer_path_that_is_a_file(tmp_path, chat, capsys):
    line = _build(capsys, "--input", chat, "--tokenizer", TOK / "tokenizer.json", "--output", tmp_path / "out")
    assert f"{TOK / 'tokenizer.json'} is a file; give the directory holding tokenizer.json" in line
    assert f"({TOK})" in line
    line = _build(capsys, "--input", chat, "--tokenizer", chat, "--output", tmp_path / "out")
    assert f"{chat} is a file" in line


@pytest.mark.parametrize("text", ["", "  \n\n"])
def test_empty_chat_template_file_is_named(tmp_path, chat, capsys, text):
    (tmp_path / "t.jinja").write_text(text)
    line = _build(capsys, "--input", chat, "--tokenizer", TOK, "--chat-template", tmp_path / "t.jinja",
                  "--output", tmp_path / "out")
    assert f"chat_template {tmp_path / 't.jinja'} is empty" in line and "has no chat template" not in line
    line = _build(capsys, "--input", chat, "--tokenizer", TOK, "--chat-template", tmp_path, "--output", tmp_path / "o")
    assert "is a directory; give the template file" in line


# ---------------------------------------------------------------------------- 4. encoding and shape of the input


@pytest.mark.parametrize("encoding, name", [
    ("utf-16", "UTF-16 (it starts with a byte order mark)"), ("utf-16-le", "UTF-16LE (NUL bytes"),
    ("utf-16-be", "UTF-16BE (NUL bytes"), ("utf-32", "UTF-32 (it starts with a byte order mark)"),
    ("utf-32-le", "UTF-32LE (NUL bytes"), ("utf-32-be", "UTF-32BE (NUL bytes"),
])
def test_utf16_and_utf32_inputs_are_named(tmp_path, capsys, encoding, name):
    rows = _write_rows(tmp_path / "rows.jsonl", [_chat(i) for i in range(40)], encoding)
    line = _build(capsys, "--input", rows, "--tokenizer", TOK, "--output", tmp_path / "out")
    assert f"{rows} is {name}" in line and "convert it to UTF-8" in line


def test_utf16_gzip_input_is_named(tmp_path, capsys):
    import gzip

    rows = tmp_path / "rows.jsonl.gz"
    rows.write_bytes(gzip.compress("".join(json.dumps(_chat(i)) + "\n" for i in range(5)).encode("utf-16")))
    line = _build(capsys, "--input", rows, "--tokenizer", TOK, "--output", tmp_path / "out")
    assert f"{rows} is UTF-16" in line


def test_latin1_input_names_the_first_bad_byte(tmp_path, capsys):
    rows = _write_rows(tmp_path / "rows.jsonl", [{"text": "plain"}] + [_chat(i) for i in range(5)], "latin-1")
    line = _build(capsys, "--input", rows, "--tokenizer", TOK, "--output", tmp_path / "out")
    assert f"{rows}:2: not UTF-8: byte 0xe9 at offset 64" in line and "convert the file to UTF-8" in line
    assert "cannot tell the row format" not in line


def test_a_later_non_utf8_row_is_a_row_error(tmp_path, capsys):
    good = "".join(json.dumps(_chat(i), ensure_ascii=False) + "\n" for i in range(1500)).encode()
    assert len(good) > 1 << 16
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(good + json.dumps(_chat(0), ensure_ascii=False).encode("latin-1") + b"\n")
    line = _build(capsys, "--input", rows, "--tokenizer", TOK, "--output", tmp_path / "out")
    assert f"1 bad row(s): {rows}:1501: not UTF-8: byte 0xe9 at column 47; convert the file to UTF-8" in line
    _build(capsys, "--input", rows, "--tokenizer", TOK, "--output", tmp_path / "out", "--skip-bad-rows", rc=0)
    assert load_packed(tmp_path / "out").metadata["counts"]["skipped_rows"] == 1


def test_rows_that_are_no_json_object_are_named(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{bad\n"a string"\n')
    line = _build(capsys, "--input", rows, "--tokenizer", TOK, "--output", tmp_path / "out")
    assert f"none of the first rows is a JSON object ({rows}:1: invalid JSON (Expecting property name" in line
    rows.write_text('"a string"\n')
    line = _build(capsys, "--input", rows, "--tokenizer", TOK, "--output", tmp_path / "out")
    assert f"({rows}:1: a JSON str, not an object)" in line


@pytest.mark.parametrize("skip", [False, True])
def test_deeply_nested_json_is_a_row_error(tmp_path, capsys, skip):
    rows = tmp_path / "rows.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    rows.write_text("".join(json.dumps(_chat(i)) + "\n" for i in range(3)) + deep + "\n" + json.dumps(_chat(9)) + "\n")
    if not skip:
        line = _build(capsys, "--input", rows, "--tokenizer", TOK, "--output", tmp_path / "out")
        assert f"1 bad row(s): {rows}:4: invalid JSON (nested deeper than the JSON parser's recursion limit)" in line
        return
    _build(capsys, "--input", rows, "--tokenizer", TOK, "--output", tmp_path / "out", "--skip-bad-rows", rc=0)
    meta = load_packed(tmp_path / "out").metadata
    assert meta["counts"]["skipped_rows"] == 1 and meta["counts"]["samples"] == 4
    assert meta["skipped_examples"][0]["where"] == f"{rows}:4"


def test_deeply_nested_json_array_file(tmp_path, capsys):
    rows = tmp_path / "rows.json"
    rows.write_text("[" + "[" * 100_000 + "]" * 100_000 + "]")
    line = _build(capsys, "--input", rows, "--tokenizer", TOK, "--output", tmp_path / "out")
    assert f"{rows}: invalid JSON (nested deeper" in line


@pytest.mark.parametrize("row, where", [
    ('{"messages": [{"role": "user", "content": "bad \\ud800 x"}, {"role": "assistant", "content": "ok"}]}',
     "'messages'[0].content holds a lone surrogate '\\ud800'"),
    ('{"text": "bad \\udfff"}', "'text' holds a lone surrogate '\\udfff'"),
    ('{"prompt": "a", "completion": "b \\udc00"}', "'completion' holds a lone surrogate '\\udc00'"),
])
def test_lone_surrogate_is_a_row_error_naming_the_row(tmp_path, capsys, row, where):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(row + "\n" + row.replace("\\ud800", "x").replace("\\udfff", "x").replace("\\udc00", "x") + "\n")
    line = _build(capsys, "--input", rows, "--tokenizer", TOK, "--output", tmp_path / "out")
    assert f"1 bad row(s): {rows}:1: {where}" in line and "TypeError" not in line


def test_a_very_long_row_is_one_line(tmp_path, capsys):
    rows = _write_rows(tmp_path / "rows.jsonl", [{"text": "hello world " * 6000}])
    line = _build(capsys, "--input", rows, "--tokenizer", TOK, "--output", tmp_path / "out")
    assert "have more tokens than pack_size=4096" in line  # and no transformers warning line before it


def test_input_directory_holding_an_earlier_packed_output(tmp_path, chat, capsys):
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(chat, data)
    _build(capsys, "--input", data, "--tokenizer", TOK, "--output", data / "out", rc=0)
    line = _build(capsys, "--input", data, "--tokenizer", TOK, "--output", tmp_path / "again")
    assert (f"input directory '{data}' holds a packed dataset, {data / 'out'} (an earlier thdpack build's output)"
            in line and f"point the input at the row files (e.g. '{data}/*.jsonl')" in line)
    line = _build(capsys, "--input", data / "out", "--tokenizer", TOK, "--output", tmp_path / "again")
    assert f"input '{data / 'out'}' is a packed dataset (thdpack build's output), not rows" in line
    line = _build(capsys, "--input", f"{data}/**/*", "--tokenizer", TOK, "--output", tmp_path / "again")
    assert "matches the files of a packed dataset" in line and "narrow the pattern" in line
    _build(capsys, "--input", f"{data}/*.jsonl", "--tokenizer", TOK, "--output", tmp_path / "again", rc=0)


def test_a_directory_with_a_foreign_metadata_json_is_read(tmp_path, chat, capsys):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    shutil.copy(chat, data / "sub")
    (data / "sub" / "metadata.json").write_text('{"format": "something else"}')
    line = _build(capsys, "--input", data, "--tokenizer", TOK, "--output", tmp_path / "out")
    assert "packed dataset" not in line  # read as an input file like any .json, as before


@pytest.mark.parametrize("name", ["o**x", "o[1]", "o?x", "[*]"])
def test_output_name_with_glob_characters(tmp_path, chat, capsys, name):
    out = tmp_path / name
    _build(capsys, "--input", chat, "--tokenizer", TOK, "--output", out, rc=0)
    _build(capsys, "--input", chat, "--tokenizer", TOK, "--output", out, "--overwrite", rc=0)
    assert load_packed(out).metadata["counts"]["samples"] == 12
    assert main(["stats", str(out)]) == 0


def test_input_pattern_in_a_config_directory_with_glob_characters(tmp_path, chat, capsys):
    d = tmp_path / "we[ir]d*"
    d.mkdir()
    shutil.copy(chat, d / "a.jsonl")
    shutil.copy(chat, d / "b[1].jsonl")
    cfg = d / "build.yaml"
    cfg.write_text(f"input: '*.jsonl'\ntokenizer: {TOK}\n")
    _build(capsys, "--config", cfg, "--output", tmp_path / "out", rc=0)
    assert load_packed(tmp_path / "out").metadata["counts"]["samples"] == 24
    _build(capsys, "--input", d / "b[1].jsonl", "--tokenizer", TOK, "--output", tmp_path / "one", rc=0)  # as named
    assert load_packed(tmp_path / "one").metadata["counts"]["samples"] == 12


# ---------------------------------------------------------------------------- 5. data silently lost


@pytest.fixture
def qwen3(tmp_path) -> Path:
    from real_tokenizers import real_tokenizer

    return real_tokenizer("qwen3")


def test_role_the_template_renders_as_nothing(tmp_path, capsys, qwen3):
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "MAGIC SPELL"},
                          {"role": "assistant", "content": "ok"}]}] + [_chat(i) for i in range(3)]
    path = _write_rows(tmp_path / "rows.jsonl", rows)
    line = _build(capsys, "--input", path, "--tokenizer", qwen3, "--output", tmp_path / "out")
    assert (f"1 bad row(s): {path}:1: message 1 has role 'wizard', which the chat template renders as nothing"
            in line and "use a role it renders" in line)
    _build(capsys, "--input", path, "--tokenizer", qwen3, "--output", tmp_path / "out", "--skip-bad-rows", rc=0)
    meta = load_packed(tmp_path / "out").metadata
    assert meta["counts"]["skipped_rows"] == 1 and meta["counts"]["samples"] == 3
    assert "role 'wizard'" in meta["skipped_examples"][0]["error"]


def test_roles_the_template_renders_are_kept(tmp_path, capsys, qwen3):
    """Roles Qwen3's template names (system, tool) build; a template that prints any role (the demo's) keeps wizard."""
    rows = [{"messages": [{"role": "system", "content": "be kind"}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "ok"}]}]
    _build(capsys, "--input", _write_rows(tmp_path / "a.jsonl", rows), "--tokenizer", qwen3,
           "--output", tmp_path / "a", rc=0)
    wizard = [_chat(0, role="wizard")]
    _build(capsys, "--input", _write_rows(tmp_path / "w.jsonl", wizard), "--tokenizer", TOK,
           "--output", tmp_path / "w", rc=0)
    assert load_packed(tmp_path / "w").metadata["counts"]["samples"] == 1


def test_overflow_drop_of_every_row_stops(tmp_path, chat, capsys):
    line = _build(capsys, "--input", chat, "--tokenizer", TOK, "--pack-size", 8, "--overflow", "drop",
                  "--output", tmp_path / "out")
    assert line.startswith("thdpack build: error: every row is longer than pack_size=8, so overflow=drop dropped all 12")
    assert f"(the longest: {chat}:" in line and "use a larger pack_size, or overflow: truncate or split" in line
    assert not (tmp_path / "out").exists()
    assert main(["stats", str(chat), "--tokenizer", str(TOK), "--pack-size", "8", "--overflow", "drop", "-q"]) == 2
    assert "every row is longer than pack_size=8" in _error_line(capsys.readouterr().err, "stats")


def test_overflow_drop_of_some_rows_builds_and_counts(tmp_path, capsys):
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x" * (900 if i % 2 else 5)}]}
            for i in range(10)]
    path = _write_rows(tmp_path / "rows.jsonl", rows)
    _build(capsys, "--input", path, "--tokenizer", TOK, "--pack-size", 64, "--overflow", "drop",
           "--output", tmp_path / "out", rc=0)
    assert load_packed(tmp_path / "out").metadata["counts"]["dropped"]["samples"] == 5


@pytest.mark.parametrize("flag, value, names", [
    ("--group-column", "gid", "group_column"), ("--sample-values", "reward", "sample_values"),
    ("--sample-values", "score,reward", "sample_values"),
])
def test_a_column_no_row_has_is_reported_once(tmp_path, chat, capsys, flag, value, names):
    line = _build(capsys, "--input", chat, "--tokenizer", TOK, flag, value, "--output", tmp_path / "out")
    missing = value.split(",")[0]
    assert line == (f"thdpack build: error: {chat}: no '{missing}' field in its rows, which {names} names "
                    "(fields: ['messages'])")


def test_a_group_id_missing_from_some_rows_is_a_row_error(tmp_path, capsys):
    rows = [dict(_chat(i), gid=i // 2) for i in range(6)]
    del rows[0]["gid"], rows[3]["gid"]  # the first row too: the field is looked for in the first rows, not the first
    path = _write_rows(tmp_path / "rows.jsonl", rows)
    line = _build(capsys, "--input", path, "--tokenizer", TOK, "--group-column", "gid", "--output", tmp_path / "out")
    assert line.startswith(f"thdpack build: error: 2 bad row(s): {path}:1: 'gid' is None")
    assert f"{path}:4: 'gid' is None" in line
