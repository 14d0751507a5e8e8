"""Every benchmark script still runs on the current code, in its smallest setting.

They measure speed and memory side by side with a peer (README "Performance"); this test
asserts nothing about speed, only that each script runs to its end, exits 0 (a benchmark
exits non-zero when thdpack's output differs from the peer's) and prints its table. A
refactor that breaks a benchmark (as the pixel-row width check once broke benchmarks/vlm.py)
fails here instead of at the next measurement. The TRL-based peers (benchmarks/build.py's TRL
pipelines, the plan benchmark's TRL column) need the `bench` extra and are left out (benchmarks/build.py
runs thdpack alone on its synthetic tokenized rows); the video benchmark decodes hundreds of videos and
is run by hand.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CASES = {
    "vlm": (["--quick", "--samples", "16", "--families", "all", "--scenarios", "typical", "--no-alloc"], "same output"),
    "plan": (["--n", "20000", "--repeats", "1", "--no-trl", "--no-cold"], "thdpack"),
    "balance": (["--num-samples", "2000", "--no-kk", "--stream-samples", "2000"], "StreamingPacker"),
    "cp": (["--packs", "50", "--repeats", "1"], "shard"),
    "collate": (["--batches", "20", "--warmup", "2", "--repeats", "1"], "same output"),
    "losses": (["--tokens", "256", "--vocab", "1000", "--repeats", "1", "--rounds", "1"], "token_logps"),
    "rebalance": (["--samples-per-rank", "40", "--repeats", "1"], "saved/cost"),
    "torch_cp_balance": (["--packs", "5", "--cp", "2", "4"], "thdpack worst"),
    "layouts": (["--tokens", "2048", "--repeats", "1", "--no-compile", "--inner", "2"], "shard rank 0 / build"),
    "shared_prefix": (["--quick", "--groups", "4", "--pairs", "40"], "ratio"),
    "hybrid_reference": (["--quick"], "packed / alone"),
    "flops_overcount": ([], "whole model"),
    "mixture": (["--samples", "20000", "--steps", "1", "8", "--repeats", "1"], "stratified"),
    "vision_balance": (["--packs", "10", "--cp", "2", "--tower-packs", "1", "--tower-repeats", "1"],
                       "the ranks' shares put together equal the whole tower"),
    "hybrid_cp": (["--ranks", "8", "--samples-per-rank", "20"], "thdpack plan_hybrid_cp"),
    # thdpack alone on synthetic pre-tokenized rows (no TRL, no tokenizer): the driver's measures, the median
    "build": (["--kind", "tokenized", "--num-samples", "2000", "--num-proc", "1", "--trl-style", "none", "--repeats", "1"],
              "driver"),
    "distributed": (["--sizes", "20000", "--slices", "2"], "global plan vs slice-local"),
    # stored packs to batches: the collator against the split-and-rejoin route, on a small tokenized build
    "load_packed": (["--source", "tokenized", "--num-samples", "2000", "--repeats", "1"], "same output"),
    # multi-turn rollouts: unshared, one shared prompt, a trie (issue 46); the three losses must agree
    "rollout_tries": (["--quick"], "losses agree"),
    # one pipeline-parallel step planned five ways, every plan checked (each sample once, the cap) before it is timed
    "pipeline_steps": (["--quick"], "order effect"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_benchmark_runs(name):
    args, expected = CASES[name]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, f"benchmarks/{name}.py failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert expected in done.stdout, done.stdout[-2000:]


def test_the_gpu_proof_runs_on_the_cpu(tmp_path):
    """``benchmarks/gpu_check.py --device cpu --quick`` runs the proof's checks (issue 31) through the same code
    as on a GPU, so it never rots: the varlen backend exact on a pack as built and static, the MFU and paths
    tables filled, Markdown written."""
    import json

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    out, md = tmp_path / "gpu.json", tmp_path / "gpu.md"
    assert gpu_check.main(["--device", "cpu", "--quick", "--checks", "ceiling", "varlen", "mfu", "paths",
                           "--out", str(out), "--markdown", str(md)]) == 0
    results = json.loads(out.read_text())
    assert results["varlen"]["max_abs_diff"] <= 1e-5 and results["varlen"]["static"]["offsets"] > results["varlen"]["samples"] + 1
    row = results["mfu"]["256"]
    assert row["samples"] > 1 and row["tflops_pack_len2"] > row["tflops_sum_si2"] > 0 and row["overcount"] > 0
    assert results["paths"]["256"]["thdpack_tokens_per_s"] > 0
    text = md.read_text()
    assert "| pack | samples | step | TFLOP/s by Σ sᵢ² |" in text and "DataCollatorWithFlattening" in text
