"""``thdpack check`` (issue 45): a tiny random Qwen3 saved to a directory (with and without its weights) checked
on the bundled demo's packed build, on a build config planned on the fly and on a JSON Lines file of token ids;
exit status 0 and the OK line, ``--json``, exit status 1 and the FAIL line when the check fails, one-line
errors, ``--help``, SIGINT / SIGTERM mid-run; ``thdpack.check.check_dataset`` and the model loading."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

import thdpack.integrations  # noqa: E402
from thdpack.check import check_dataset  # noqa: E402
from thdpack.check.model_loading import load_model  # noqa: E402
from thdpack.check.pack_sources import read_packs  # noqa: E402
from thdpack.cli import main  # noqa: E402
from thdpack.offline import load_packed  # noqa: E402
from thdpack.offline.config import BuildConfig  # noqa: E402
from thdpack.offline.store.dataset import unpack_row  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"
TINY_CONFIG = ROOT / "configs" / "models" / "tiny-qwen3"  # the bundled config without weights (docs/check.md)
SMALL = ["--config", str(DEMO), "--max-rows", "80", "--pack-size", "1024"]


def _tiny_config(vocab_size: int = 3072):
    return transformers.Qwen3Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.2,
                                    max_position_embeddings=4096)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    """A tiny random Qwen3 saved with its weights (vocab 3072: the demo tokenizer's)."""
    path = tmp_path_factory.mktemp("model") / "tiny"
    torch.manual_seed(7)
    transformers.Qwen3ForCausalLM(_tiny_config()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def demo_build(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("build") / "demo"
    assert main(["build", *SMALL, "--output", str(out), "-q"]) == 0
    return out


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory) -> Path:
    rng = np.random.default_rng(3)
    path = tmp_path_factory.mktemp("jsonl") / "tokens.jsonl"
    with path.open("w") as f:
        for _ in range(24):
            ids = rng.integers(1, 3000, int(rng.integers(6, 40))).tolist()
            f.write(json.dumps({"input_ids": ids, "labels": [-100] * 3 + ids[3:]}) + "\n")
    return path


def _lines(capsys) -> tuple[list[str], str]:
    captured = capsys.readouterr()
    return captured.out.strip().splitlines(), captured.err


# ---------------------------------------------------------------------------- the three data sources pass


def test_a_packed_build_passes_on_its_saved_weights(saved_model, demo_build, capsys):
    assert main(["check", str(demo_build), "--model", str(saved_model), "--packs", "2"]) == 0
    out, err = _lines(capsys)
    assert out[-1] == "OK: 2 pack(s), every check holds"
    assert out[0].startswith("model Qwen3ForCausalLM, float32 on cpu, attention sdpa; tolerance 1e-04")
    assert "its saved weights" in err and f"{demo_build}: packed build" in err
    assert sum(line.rstrip().endswith("  ok") for line in out) == 2
    assert any(line.startswith("FLOPs of pack") for line in out)


def test_a_config_planned_on_the_fly_is_the_build_pack_for_pack(demo_build, capsys):
    """The config's packs, planned here, are the packs ``thdpack build`` wrote, numbered alike; CP alignment
    on: the config's cp_size reaches the batch."""
    built = load_packed(demo_build)
    planned = read_packs(BuildConfig.from_yaml(DEMO).override(max_rows=80, pack_size=1024), count=4, seed=1)
    assert planned.total == len(built) and len(planned.packs) == 4
    for pack in planned.packs:
        stored = unpack_row(built[pack.index])
        assert [s["input_ids"].tolist() for s in pack.samples] == [s["input_ids"].tolist() for s in stored]
        assert [np.asarray(s["loss_mask"]).tolist() for s in pack.samples] == \
            [np.asarray(s["loss_mask"]).tolist() for s in stored]
    assert main(["check", *SMALL, "--cp-size", "2", "--model", str(TINY_CONFIG), "--packs", "1", "--no-flops"]) == 0
    out, err = _lines(capsys)
    assert out[-1] == "OK: 1 pack(s), every check holds"
    assert "random weights (seed 0)" in err and "planned" in err and "align 4" in err


def test_a_jsonl_file_of_token_ids_with_grad_and_json(saved_model, jsonl, capsys):
    argv = ["check", str(jsonl), "--pack-size", "96", "--model", str(saved_model), "--grad", "--json",
            "--attn", "thdpack_varlen"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["first_failure"] is None and report["attention"] == "thdpack_varlen"
    assert len(report["packs"]) == 3
    for pack in report["packs"]:
        assert {v["name"] for v in pack["values"]} == {"loss (token mean)", "loss (sample mean)", "gradients"}
        assert all(s["first_failure"] is None for s in pack["samples"])


# ---------------------------------------------------------------------------- a failing check: exit status 1


def _no_boundaries(monkeypatch):
    """A deliberate break: the packed call is the samples concatenated, with no boundary at all (no mask, no
    cu_seq_lens, positions counting on), as packing without thdpack often is."""
    real = thdpack.integrations.to_hf_kwargs

    def broken(batch, **kwargs):
        out = {k: v for k, v in real(batch, **kwargs).items() if k in ("input_ids", "labels")}
        return dict(out, position_ids=torch.arange(out["input_ids"].shape[1])[None])

    monkeypatch.setattr(thdpack.integrations, "to_hf_kwargs", broken)


def test_a_failing_check_exits_1_with_the_first_failure_last(saved_model, jsonl, monkeypatch, capsys):
    _no_boundaries(monkeypatch)
    data = [str(jsonl), "--pack-size", "96", "--model", str(saved_model), "--no-flops"]
    assert main(["check", *data, "--packs", "2"]) == 1
    out, _ = _lines(capsys)
    assert out[-1].startswith("FAIL: pack ") and "first differs at model.layers.0.self_attn (attention" in out[-1]
    assert sum(line.rstrip().endswith("FAIL") for line in out) == 2
    assert main(["check", *data, "--packs", "1", "--json"]) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert not report["ok"] and captured.err.strip().splitlines()[-1] == f"FAIL: {report['first_failure']}"


# ---------------------------------------------------------------------------- help, errors, signals


def test_help(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["check", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: thdpack check") and "--random-weights" in out and "--pack-size" in out


@pytest.mark.parametrize("argv, message", [
    (["--model", "MISSING"], "--model {tmp}/nope: no such file or directory"),
    (["--model", "EMPTY"], "the directory has no config.json"),
    (["--model", "SMALL_VOCAB"], "pack {k}, sample 0 (input row"),
    (["--model", "TINY", "--pack-size", "2048"], "is a packed build: its packs are checked as built"),
    (["--model", "TINY", "--device", "cuda"], "--device cuda: no CUDA device here"),
    (["--model", "TINY", "--dtype", "int8"], "--dtype int8: one of float32, bfloat16, float16"),
    (["--model", "TINY", "--attn", "nonesuch"], 'attn_implementation="nonesuch"` is not supported'),
])
def test_errors_are_one_line_with_exit_status_2(argv, message, demo_build, tmp_path, capsys):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    (tmp_path / "empty").mkdir()
    _tiny_config(vocab_size=64).save_pretrained(tmp_path / "small-vocab")
    where = {"MISSING": tmp_path / "nope", "EMPTY": tmp_path / "empty", "SMALL_VOCAB": tmp_path / "small-vocab",
             "TINY": TINY_CONFIG}
    argv = [str(where.get(a, a)) for a in argv]
    assert main(["check", str(demo_build), *argv, "--packs", "1"]) == 2
    err = capsys.readouterr().err  # the stage lines before it, then the error in one line
    last = err.strip().splitlines()[-1]
    assert last.startswith("thdpack check: error: ") and err.count("error:") == 1 and "Traceback" not in err, err
    first = read_packs(demo_build, count=1).packs[0].index
    assert message.format(tmp=tmp_path, k=first) in last, last
    if "small-vocab" in argv[1]:
        assert "outside the model's vocabulary (64 embeddings)" in last


def test_data_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("input: x.jsonl\npack_sise: 10\n")
    for argv, message in ((["--config", str(bad)], "unknown option 'pack_sise' (did you mean 'pack_size'?)"),
                          ([], "give the data: a packed build directory"),
                          ([str(tmp_path / "none.jsonl")], "none.jsonl does not exist")):
        assert main(["check", *argv, "--model", str(TINY_CONFIG)]) == 2
        err = capsys.readouterr().err
        assert message in err.strip().splitlines()[-1] and err.count("error:") == 1, err


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_run_stops_it_cleanly(signum, demo_build):
    proc = subprocess.Popen([sys.executable, "-m", "thdpack", "check", str(demo_build), "--model", str(TINY_CONFIG),
                             "--packs", "1000", "--grad"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    seen = []
    for line in proc.stderr:  # the stage lines: the model is loaded, the packs are read, checking has begun
        seen.append(line)
        if line.startswith("data "):
            break
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, "".join(seen) + err
    last = err.strip().splitlines()[-1]
    assert last == (f"thdpack check: interrupted by {signal.Signals(signum).name}; the check stopped before its "
                    "report"), err
    assert "Traceback" not in err and out == ""


# ---------------------------------------------------------------------------- Python: check_dataset, load_model


def test_check_dataset_picks_a_seeded_sample_of_packs_and_shows_a_bar_per_pack(saved_model, demo_build, capsys):
    model = load_model(saved_model).model
    report = check_dataset(model, demo_build, packs=2, seed=5, flops=False, progress=True)
    assert report.ok and [p.pack for p in report.packs] == [p.index for p in read_packs(demo_build, count=2, seed=5).packs]
    assert {p.pack for p in report.packs} != {p.index for p in read_packs(demo_build, count=2, seed=6).packs}
    err = capsys.readouterr().err
    assert all(f"pack {p.pack}" in err for p in report.packs)  # the bars (tqdm, on stderr)


def test_load_model_saved_weights_or_random_ones(saved_model):
    saved = transformers.Qwen3ForCausalLM.from_pretrained(saved_model)
    loaded = load_model(saved_model)
    assert "its saved weights" in loaded.source and not loaded.model.training
    assert torch.equal(loaded.model.lm_head.weight, saved.lm_head.weight)
    random = load_model(saved_model, random_weights=True, seed=1, dtype="bfloat16")
    assert "random weights (seed 1)" in random.source and random.model.lm_head.weight.dtype == torch.bfloat16
    again = load_model(saved_model / "config.json", seed=1, dtype="bfloat16").model  # a config.json file alone
    assert torch.equal(random.model.lm_head.weight, again.lm_head.weight)
    with pytest.raises(ValueError, match="no saved weights"):
        load_model(TINY_CONFIG, random_weights=False)
