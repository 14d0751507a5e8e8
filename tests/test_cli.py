"""The ``thdpack`` command: build / stats / inspect, the bundled demo config, exit codes
and messages, and interruption of a real build process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from thdpack.cli import main  # noqa: E402
from thdpack.demo import TOKENIZER_DIR, generate_rows, write_jsonl  # noqa: E402
from thdpack.offline import load_packed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"


def run_cli(*args, cwd=ROOT, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "thdpack", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def test_readme_main_command_runs_offline(tmp_path):
    """The README's main job builds and reports on the bundled demo with the hub unreachable.
    (Its speed is measured by benchmarks/build.py, not asserted here: a loaded CI machine is
    no measure; the timeouts only stop a hang.)"""
    out = tmp_path / "demo"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    build = subprocess.run(
        [sys.executable, "-m", "thdpack", "build", "--config", DEMO, "--output", out],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
    )
    stats = subprocess.run(
        [sys.executable, "-m", "thdpack", "stats", out], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env
    )
    assert build.returncode == 0, build.stderr
    assert stats.returncode == 0, stats.stderr
    meta = json.loads((out / "metadata.json").read_text())
    c = meta["counts"]
    # conversations whose answers truncation cuts off have no target token: dropped by default
    assert c["input_rows"] == 4000 and c["samples"] + c["without_targets"]["dropped_samples"] == 4000
    assert c["without_targets"]["dropped_samples"] == c["samples_without_targets"] > 0
    assert c["without_targets"]["packs"] == 0
    assert meta["counts"]["truncated"]["samples"] > 0  # the long tail reaches past a 4k pack
    assert f"packs            {meta['num_packs']} of 4096 tokens" in stats.stdout
    assert f"over-counts by {meta['stats']['attention_flops']['overcount']:.2f}x" in stats.stdout
    assert meta["packing_efficiency"] > 95


def test_build_stats_inspect(tmp_path, capsys):
    out = tmp_path / "small"
    assert main(["build", "--config", str(DEMO), "--output", str(out), "--max-rows", "300", "--pack-size", "2048", "-q"]) == 0
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["config"]["max_rows"] == 300 and meta["pack_size"] == 2048
    capsys.readouterr()

    assert main(["stats", str(out), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    ds = load_packed(out)
    lens, offsets = ds.all_seq_lens()
    assert stats["packs"] == len(ds) == meta["num_packs"]
    assert stats["real_tokens"] == int(lens.sum()) == meta["counts"]["tokens"]
    expected = len(ds) * 2048**2 / float((lens.astype(np.int64) ** 2).sum())
    assert stats["attention_flops"]["overcount"] == pytest.approx(expected)
    # input lengths of the packed samples: rows whose targets truncation cut off are dropped
    assert stats["lengths"]["count"] == 300 - meta["counts"]["without_targets"]["dropped_samples"]

    # padding evaluated at another alignment: cp=4 pads each sample to a multiple of 8
    assert main(["stats", str(out), "--json", "--cp-size", "4"]) == 0
    cp4 = json.loads(capsys.readouterr().out)
    pad = int((-(-lens // 8) * 8 - lens).sum())
    assert cp4["padding"]["multiple"] == 8 and cp4["padding"]["pad_tokens"] == pad

    assert main(["inspect", str(out), "--pack", "1"]) == 0
    text = capsys.readouterr().out
    row = ds[1]
    assert text.startswith(f"pack 1 of {len(ds)}: {row['seq_lens'].size} samples, {row['input_ids'].size} tokens")
    assert text.count("── sample ") == row["seq_lens"].size
    assert "<|im_start|>assistant\n«" in text and "<|im_end|>»" in text  # targets marked

    assert main(["inspect", str(out), "--pack", "-1", "--ids", "--max-tokens", "5"]) == 0
    assert "more tokens)" in capsys.readouterr().out


def test_stats_of_raw_data_matches_the_build(tmp_path, capsys):
    path = write_jsonl(generate_rows(200, seed=11, kind="text"), tmp_path / "raw.jsonl")
    common = ["--tokenizer", str(TOKENIZER_DIR), "--pack-size", "1024", "--overflow", "truncate", "-q"]
    assert main(["stats", str(path), "--json", *common]) == 0
    raw = json.loads(capsys.readouterr().out)
    assert main(["build", "--input", str(path), "--output", str(tmp_path / "o"), *common]) == 0
    capsys.readouterr()
    meta = json.loads((tmp_path / "o" / "metadata.json").read_text())
    assert raw["packs"] == meta["num_packs"]
    assert raw["real_tokens"] == meta["counts"]["tokens"]
    assert raw["truncated"] == meta["counts"]["truncated"]
    assert not (tmp_path / "raw.jsonl").with_suffix("").exists()


def test_errors_exit_2_with_a_message(tmp_path, capsys):
    bad_cfg = tmp_path / "bad.yaml"
    bad_cfg.write_text("input: x.jsonl\npack_sise: 10\n")
    assert main(["build", "--config", str(bad_cfg), "--output", str(tmp_path / "o")]) == 2
    assert "unknown option 'pack_sise' (did you mean 'pack_size'?)" in capsys.readouterr().err

    assert main(["build", "--config", str(DEMO)]) == 2
    assert "--output" in capsys.readouterr().err

    out = tmp_path / "exists"
    out.mkdir()
    (out / "x").write_text("")
    assert main(["build", "--config", str(DEMO), "--output", str(out), "--max-rows", "10", "-q"]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err

    assert main(["stats", str(tmp_path / "nothing-here")]) == 2
    assert "does not exist" in capsys.readouterr().err

    assert main(["inspect", str(out)]) == 2
    assert "no metadata.json" in capsys.readouterr().err


def test_sigint_during_a_build_leaves_nothing(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.Popen(
        [sys.executable, "-m", "thdpack", "build", "--config", str(DEMO), "--output", str(out), "-q"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.time() + 60
    while time.time() < deadline and not list(tmp_path.glob(".demo.tmp-*/_work")):
        time.sleep(0.05)
    assert list(tmp_path.glob(".demo.tmp-*")), "the build never started writing"
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert list(tmp_path.iterdir()) == [], err  # no output, no temporary directory


def test_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "o"
    assert main(["build", "--config", str(DEMO), "--output", str(out), "--max-rows", "100", "-q"]) == 0
    png = tmp_path / "stats.png"
    assert main(["stats", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_console_script_and_module_entry_point():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["thdpack"] == "thdpack.cli:main"
    res = run_cli("--help")
    assert res.returncode == 0 and "build" in res.stdout and "inspect" in res.stdout
