"""BuildConfig is the one place an option's type, default and range are stated: the YAML checks
(:meth:`BuildConfig.validate`) and the ``thdpack build`` flags are both read off its fields."""

from __future__ import annotations

import argparse
import dataclasses
import math

import pytest

from thdpack.cli import build_parser
from thdpack.offline import BuildConfig, ConfigError
from thdpack.offline.config import SECTIONS, options

OPTIONS = {o.name: o for o in options()}


def _fields() -> list[tuple[str, dataclasses.Field]]:
    """``(option name, field)`` of every BuildConfig option field, a section's by its flat name (``pack_size``,
    ``ray_address``); a section's derived fields (not options) left out."""
    out = []
    for f in dataclasses.fields(BuildConfig):
        section = f.metadata.get("section")
        if section is not None:
            out += [(SECTIONS[f.name] + g.name, g) for g in dataclasses.fields(section) if "derived" not in g.metadata]
        elif not f.metadata.get("internal"):
            out.append((f.name, f))
    return out


def test_every_field_is_an_option_with_its_default():
    fields = _fields()
    assert [name for name, _ in fields] == list(OPTIONS) == BuildConfig.keys()
    assert all(OPTIONS[name].default == f.default for name, f in fields)
    assert all(BuildConfig().value(OPTIONS[name]) == f.default for name, f in fields)


def test_kinds_come_from_the_type_hints():
    kinds = {name: (o.kind, o.nullable) for name, o in OPTIONS.items()}
    assert kinds["pack_size"] == ("int", False) and kinds["max_rows"] == ("int", True)
    assert kinds["append_eos"] == ("flag", False) and kinds["file_size_mb"] == ("number", False)
    assert kinds["text_field"] == ("text", False) and kinds["tokenizer"] == ("text", True)
    assert kinds["model_config"] == ("value", True) and OPTIONS["seed"].minimum == 0


def _bad_values(option) -> list:
    if option.choices:
        return ["no-such-choice", 3]
    return {"int": [option.minimum - 1, 2.5, True, "4"], "flag": ["yes", 1], "number": [0, -1.5, math.inf, math.nan, "2"],
            "text": ["", 5], "value": [5] if option.accepts else []}[option.kind]


def _good_value(option):
    if option.choices:
        return list(option.choices)[-1]
    return {"int": option.minimum + 3, "flag": True, "number": 2.5, "text": "x", "value": None}[option.kind]


@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_option_refuses_what_its_kind_does_not_allow(name, tmp_path):
    option = OPTIONS[name]
    base = dict(input=str(tmp_path / "rows.jsonl"), pack_size=4096)
    if name.startswith("mixture_"):  # a mixture's options: input as a list of sources (docs/build.md, Mixtures)
        base = dict(base, input=[{"path": str(tmp_path / "a.jsonl")}, {"path": str(tmp_path / "b.jsonl")}],
                    mixture_packing="stratified")
    for value in _bad_values(option):
        cfg = BuildConfig.from_dict({**base, name: value})  # a section's option (mixture_*, ray_*) by its flat key
        with pytest.raises(ConfigError, match=rf"^{name} must be "):
            cfg.validate()
    if name not in ("input", "sample_values", "group_column", "pack_size"):
        BuildConfig.from_dict({**base, name: _good_value(option)}).validate()  # the same field with a valid value passes
    if option.nullable and name != "input":
        BuildConfig.from_dict({**base, name: None}).validate()



@pytest.mark.parametrize("value, message", [
    (5, r"input must be a path, a list of paths or \{demo: \.\.\.\}, got 5"),
    (2.5, r"input must be a path, a list of paths or \{demo: \.\.\.\}, got 2\.5"),
    (True, r"input must be a path, a list of paths or \{demo: \.\.\.\}, got True"),
    (b"rows.jsonl", r"input must be a path, a list of paths or \{demo: \.\.\.\}, got b'rows\.jsonl'"),
    ([], r"input must be a path, a list of paths or \{demo: \.\.\.\}, got \[\]"),
    (["rows.jsonl", 3], r"input must be a path, a list of paths or \{demo: \.\.\.\}, got \['rows\.jsonl', 3\]"),
    ({"rows": "a.jsonl"}, r"input mapping must be \{demo: \{\.\.\.\}\}, got keys \['rows'\]"),
    ({"demo": 5}, r"input: demo options are \['kind', 'num_samples', 'seed'\], got 5"),
    ({"demo": {"rows": 3}}, r"input: demo options are \['kind', 'num_samples', 'seed'\], got \{'rows': 3\}"),
    (None, r"no input: give --input PATH or 'input:' in the config"),
])
def test_input_has_a_type_rule(value, message, tmp_path):
    """``input: 5`` passed validate() and failed later, in the build's reading of the input (issue 30): now
    validate() refuses it, one line naming input, by the rule read_source applies too."""
    from thdpack.offline.inputs.sources import read_source
    cfg = BuildConfig(input=value, base_dir=tmp_path)
    with pytest.raises(ConfigError, match=rf"^{message}$"):
        cfg.validate()
    with pytest.raises(ConfigError, match=rf"^{message}$"):
        read_source(dataclasses.replace(cfg.source, base_dir=cfg.base_dir), progress=False)


@pytest.mark.parametrize("value", ["rows.jsonl", "s3://bucket/rows-*.jsonl", ["a.jsonl", "b.parquet"],
                                   {"demo": None}, {"demo": {"num_samples": 8, "seed": 1, "kind": "text"}}])
def test_inputs_of_the_type_rule_pass_validate(value):
    BuildConfig(input=value).validate()

def _build_args(*argv):
    return build_parser().parse_args(["build", "--output", "o", *argv])


def test_flags_parse_as_their_kind():
    args = _build_args("--pack-size", "3", "--file-size-mb", "1.5", "--no-shuffle-packs", "--tokenizer", "t",
                       "--algorithm", "ffd", "--input", "a", "b")
    assert (args.pack_size, args.file_size_mb, args.shuffle_packs, args.tokenizer) == (3, 1.5, False, "t")
    assert args.algorithm == "ffd" and args.input == ["a", "b"]
    assert all(getattr(_build_args(), name) is None for name in OPTIONS)  # not given: the YAML value stays


def test_every_option_is_a_flag_of_its_kind():
    build = next(a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "build")[1]
    actions = {a.dest: a for a in build._actions}
    for name, option in OPTIONS.items():
        action = actions[name]
        assert action.option_strings == ["--" + name.replace("_", "-")] + (
            ["--no-" + name.replace("_", "-")] if option.kind == "flag" else [])
        if option.kind == "flag":
            assert isinstance(action, argparse.BooleanOptionalAction)
        elif option.kind == "int":  # read as an int and refused below the option's minimum, as the flag is parsed
            assert action.type(str(option.minimum)) == option.minimum, name
            with pytest.raises(argparse.ArgumentTypeError, match=rf"must be an integer >= {option.minimum}"):
                action.type(str(option.minimum - 1))
        else:
            assert action.type is {"number": float}.get(option.kind, option.flag_type), name
        assert list(action.choices or []) == list(option.choices or []), name


@pytest.mark.parametrize("argv, message", [
    (["stats", "out", "--cp-size", "0"], "argument --cp-size: must be an integer >= 1, got 0"),
    (["stats", "out", "--tp-size", "-2"], "argument --tp-size: must be an integer >= 1, got -2"),
    (["build", "-o", "x", "--seed", "-1"], "argument --seed: must be an integer >= 0, got -1"),
    (["inspect", "out", "--max-tokens", "0"], "argument --max-tokens: must be an integer >= 1, got 0"),
    (["inspect", "out", "--max-tokens", "many"], "argument --max-tokens: must be an integer >= 1, got 'many'"),
])
def test_integer_flags_below_their_minimum_are_usage_errors(argv, message, capsys):
    """``stats --cp-size 0`` used to be taken as "not given" and ``inspect --max-tokens 0`` an IndexError
    (issue 21 point 1): the flag is refused as it is read, naming it."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
