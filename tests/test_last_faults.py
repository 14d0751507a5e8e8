"""The last faults of the campaign (issue 38), each with its neighbours: ``inspect`` with a damaged tokenizer,
``stats`` with bad flags, ``stats`` with a model config the FLOPs cannot read, ``ThdCollator(vision_budget=)``
without a VLM model config. Every case ends in the one-line rule the other commands keep (``thdpack CMD: error:
...``, at most a short usage line above it), the CLI cases as subprocesses."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from thdpack import ThdCollator  # noqa: E402
from thdpack.cli import main  # noqa: E402
from thdpack.demo import TOKENIZER_DIR  # noqa: E402
from thdpack.offline.stages import MODEL_CONFIG_NEEDS  # noqa: E402
from thdpack.vlm import get_family  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--config", str(ROOT / "configs" / "demo.yaml"), "--max-rows", "40", "--pack-size", "2048"]


def _run(*args) -> tuple[int, list[str]]:
    """``python -m thdpack ARGS``: the exit status and the stderr lines (no traceback, checked)."""
    done = subprocess.run([sys.executable, "-m", "thdpack", *map(str, args)], capture_output=True, text=True,
                          timeout=120)
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, done.stderr.strip().splitlines()


def _main(capsys, *args) -> tuple[int, list[str]]:
    """``thdpack ARGS`` in this process (for the ``build`` beside a subprocess case): status, stderr lines."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err.strip().splitlines()


def _error(lines: list[str], command: str) -> str:
    """The message of the one error line that ends ``lines`` (``thdpack COMMAND: error: MESSAGE``)."""
    assert lines and lines[-1].startswith(f"thdpack {command}: error: "), lines
    return lines[-1].split(": error: ", 1)[1]


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "small"
    assert main(["build", *SMALL, "--output", str(out), "-q"]) == 0
    return out


def _damaged_tokenizer(tmp_path: Path, how: str) -> Path:
    """A copy of the demo tokenizer whose tokenizer.json is ``truncated`` or ``empty``."""
    tok = tmp_path / f"tok-{how}"
    shutil.copytree(TOKENIZER_DIR, tok)
    text = (tok / "tokenizer.json").read_text(encoding="utf-8")
    (tok / "tokenizer.json").write_text(text[: len(text) // 2] if how == "truncated" else "", encoding="utf-8")
    return tok


@pytest.mark.parametrize("how", ["truncated", "empty"])
def test_inspect_with_a_damaged_tokenizer_says_what_build_says(packed, tmp_path, capsys, how):
    tok = _damaged_tokenizer(tmp_path, how)
    code, lines = _run("inspect", packed, "--pack", 0, "--tokenizer", tok)
    assert code == 2 and len(lines) == 1
    inspected = _error(lines, "inspect")
    assert inspected.startswith(f"tokenizer '{tok}': cannot load {tok}: tokenizer.json ")
    code, lines = _main(capsys, "build", *SMALL, "--tokenizer", tok, "--output", tmp_path / "out", "-q")
    assert code == 2 and len(lines) == 1 and _error(lines, "build") == inspected
    assert not (tmp_path / "out").exists()


def test_inspect_with_a_good_tokenizer_or_ids_still_decodes(packed):
    code, lines = _run("inspect", packed, "--pack", 0, "--tokenizer", TOKENIZER_DIR, "--max-tokens", 4)
    assert code == 0 and lines == []
    done = subprocess.run([sys.executable, "-m", "thdpack", "inspect", str(packed), "--ids", "--max-tokens", "3"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "sample 0" in done.stdout


@pytest.mark.parametrize("command, flags, message", [
    ("stats", ["--cp-size", "0"], "argument --cp-size: must be an integer >= 1, got 0"),
    ("stats", ["--tp-size", "0", "--sequence-parallel"], "argument --tp-size: must be an integer >= 1, got 0"),
    ("stats", ["--pad-multiple", "-1"], "argument --pad-multiple: must be an integer >= 1, got -1"),
    ("stats", ["--pack-size", "x"], "argument --pack-size: must be an integer >= 1, got 'x'"),
    ("build", ["--pack-size", "0"], "argument --pack-size: must be an integer >= 1, got 0"),
])
def test_bad_flags_of_the_long_commands_print_one_usage_line(packed, command, flags, message):
    """``stats`` and ``build`` take every build option as a flag: argparse's usage of them ran to 38 lines;
    above the error now is one line naming the positionals and ``--help``."""
    code, lines = _run(command, *([packed] if command == "stats" else []), *flags)
    positional = " path" if command == "stats" else ""
    assert code == 2 and lines == [f"usage: thdpack {command} [options]{positional} (every option: thdpack {command} "
                                   "--help)", f"thdpack {command}: error: {message}"]


def test_bad_flags_of_a_short_command_keep_argparse_usage(packed):
    code, lines = _run("inspect", packed, "--max-tokens", "0")
    assert code == 2 and 2 <= len(lines) <= 5 and lines[0].startswith("usage: thdpack inspect [-h]")
    assert _error(lines, "inspect") == "argument --max-tokens: must be an integer >= 1, got 0"


@pytest.mark.parametrize("config, missing", [
    ({}, None),
    ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "model_type": "qwen3"}, "vocab_size"),
    ({"hidden_size": 64, "num_hidden_layers": 0, "num_attention_heads": 4, "vocab_size": 100}, "num_hidden_layers"),
])
def test_stats_refuses_a_model_config_the_flops_cannot_read(packed, tmp_path, capsys, config, missing):
    """A packed dataset's ``stats --model-config`` and a raw input's (through the build's options) refuse the
    same configs, naming the file and the key, as ``build`` does."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    code, lines = _run("stats", packed, "--model-config", path)
    assert code == 2 and len(lines) == 1
    message = _error(lines, "stats")
    if missing is None:
        assert message == (f"model_config {path} is empty; give the model's config.json (the build reads "
                           f"{', '.join(MODEL_CONFIG_NEEDS)} from it)")
    else:
        assert message.startswith(f"model_config {path}") and f"'{missing}'" in message
    code, lines = _main(capsys, "build", *SMALL, "--model-config", path, "--output", tmp_path / "out", "-q")
    assert code == 2 and _error(lines, "build") == message


def test_stats_takes_a_complete_model_config(packed, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "vocab_size": 151936, "intermediate_size": 128, "model_type": "qwen3"}))
    capsys.readouterr()
    assert main(["stats", str(packed), "--model-config", str(path), "--json"]) == 0
    assert "overcount" in json.loads(capsys.readouterr().out)["model_flops"]


@pytest.mark.parametrize("model_config, got", [(None, "none"), ({"model_type": "qwen3"}, "'qwen3'")])
def test_a_vision_budget_needs_a_vlm_model_config(tmp_path, capsys, model_config, got):
    """``thdpack build`` with ``vision_budget`` and no VLM's config names the model types it takes; a collator
    without a family says where one comes from, and a config of no VLM family resolves to none."""
    if model_config is None:
        with pytest.raises(ValueError, match=r"^vision_budget needs vlm=, the VLM family: "
                           r"thdpack\.vlm\.get_family\(model_config\)$"):
            ThdCollator(pack_size=4096, vision_budget=2048)
    else:
        with pytest.raises(ValueError, match=r"^unknown VLM model_type 'qwen3'; thdpack\.vlm supports qwen2_5_omni, "
                                             r"qwen2_5_omni_thinker, qwen2_5_vl, "):
            get_family(model_config)
    flags = []
    if model_config is not None:
        path = tmp_path / "config.json"
        path.write_text(json.dumps({**model_config, "hidden_size": 64, "num_hidden_layers": 2,
                                    "num_attention_heads": 4, "vocab_size": 151936}))
        flags = ["--model-config", path]
    code, lines = _main(capsys, "build", *SMALL, *flags, "--vision-budget", 2048, "--output", tmp_path / "out", "-q")
    message = _error(lines, "build")
    assert code == 2 and message.startswith("vision_budget / image_processor need a VLM model_config (model_type one "
                                            "of qwen2_5_omni, qwen2_5_omni_thinker, qwen2_5_vl, ")
    assert message.endswith(f"), got {got}")


def test_a_collator_with_a_vision_budget_and_a_vlm_family_or_none_is_taken():
    assert ThdCollator(pack_size=4096, vision_budget=2048, vlm=get_family({"model_type": "qwen2_vl"})).options.vision_budget
    assert ThdCollator(pack_size=4096).options.vision_budget is None
