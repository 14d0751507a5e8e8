"""The examples run end to end (small arguments) and train on a finite loss."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
LOSS = re.compile(r"loss (\S+) over (\d+) target tokens")


def run_script(name: str, *args: str) -> str:
    """Run ``examples/<name>`` as a script; return its stdout (fails on a non-zero exit)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def finite_loss(stdout: str) -> float:
    match = LOSS.search(stdout)
    assert match, f"no loss line in the output:\n{stdout}"
    loss, targets = float(match.group(1)), int(match.group(2))
    assert math.isfinite(loss) and loss > 0, stdout
    assert targets > 0
    return loss


def test_quickstart_script():
    out = run_script("quickstart.py", "--num-samples", "200", "--pack-size", "1024")
    assert re.search(r"^packs\s+\d+ \(lower bound \d+\)", out, re.MULTILINE), out
    assert "first pack:" in out
    finite_loss(out)


def test_vlm_packing_script():
    out = run_script("vlm_packing.py", "--num-samples", "8")
    assert re.search(r"^vision patches\s+\d+ \(most in a pack \d+ of 1024\)", out, re.MULTILINE), out
    assert "position_ids [4, 1, " in out  # text row + 3 mRoPE rows
    diff = float(re.search(r"max \|logit diff\| (\S+)", out).group(1))
    assert diff < 1e-4, out
    finite_loss(out)


@pytest.fixture(scope="module")
def vlm_example():
    spec = importlib.util.spec_from_file_location("vlm_packing_example", EXAMPLES / "vlm_packing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_vlm_packing_main(vlm_example, family, capsys):
    threads = torch.get_num_threads()
    try:
        result = vlm_example.main(["--family", family, "--num-samples", "10", "--pack-size", "512", "--vision-budget", "600"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert result["family"] == family and result["num_samples"] == 10
    assert result["num_packs"] >= 2  # 10 samples do not fit one 512-token / 600-patch pack
    assert result["max_logit_diff"] < 1e-4  # packed logits equal each sample's own
    assert math.isfinite(result["loss"]) and result["target_tokens"] > 0
    assert result["loss_after"] < result["loss"]  # the step trained on the pack
    assert finite_loss(out) == pytest.approx(result["loss"], abs=1e-4)


def test_dpo_packed_script():
    out = run_script("dpo_packed.py", "--num-pairs", "24", "--pack-size", "512")
    m = re.search(r"dpo loss (\S+) over (\d+) pairs \(unpacked, pair by pair: (\S+); \|diff\| \S+\); after one step (\S+)", out)
    assert m, out
    packed, pairs, alone, after = float(m.group(1)), int(m.group(2)), float(m.group(3)), float(m.group(4))
    assert pairs >= 4 and math.isfinite(packed)
    assert abs(packed - alone) < 1e-4, out  # packed DPO equals the pair-by-pair computation
    assert after < packed, out  # the step trained
    assert re.search(r"most pairs in a pack: [2-9]", out), out  # several pairs share a pack


@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_grpo_packed_script(reduction):
    out = run_script("grpo_packed.py", "--num-prompts", "8", "--reduction", reduction)
    m = re.search(r"pg loss (\S+) \(\w+; unpacked, sample by sample: (\S+);", out)
    assert m, out
    assert abs(float(m.group(1)) - float(m.group(2))) < 1e-5, out  # packed equals per-sample
    domains = re.search(r"nll by domain: (.+)", out)
    assert domains and all(math.isfinite(float(part.split()[1])) for part in domains.group(1).split(", ")), out
