"""What ``thdpack check`` costs on a 0.5B-parameter model on this machine's CPU (docs/check.md, "What it costs").

    python benchmarks/check_cost.py [--tokens 2048] [--threads N]

The model is a Qwen2.5-0.5B-shaped config with random weights, built in code (hidden 896, 24 layers, 14
query / 2 key-value heads, intermediate 4864, vocabulary 151936, tied embeddings: 494M parameters); nothing
is downloaded. The data is one JSON Lines pack of 8 samples (128 to 448 tokens, 2048 in all, random ids).

Each run is a child process of its own, timed from outside (wall seconds) with its peak resident memory
(``ru_maxrss`` of that child, from ``os.wait4``):

- ``load``: building the model alone (random initialisation of 494M float32 parameters), as the check does;
- ``forward``: the same and one packed forward without gradients: what the check is compared to;
- ``check``: ``thdpack check DATA --model DIR --pack-size 2048 --packs 1``, float32, FLOPs counted (the
  default): the packed forward, each sample alone, the FLOPs count;
- ``check --grad``: the same with every parameter's gradient compared (a backward per run, two float32
  copies of the gradients kept).

Runs take minutes on a few CPU cores. Not part of the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN2_5_0_5B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                    intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
                    tie_word_embeddings=True, rope_theta=1000000.0)
LENGTHS = (128, 160, 192, 224, 256, 288, 352, 448)  # 2048 tokens, 8 samples


def write_inputs(work: Path, tokens: int) -> tuple[Path, Path]:
    """The model directory (config.json alone: random weights) and the JSON Lines pack."""
    import numpy as np
    import transformers

    model_dir = work / "qwen2.5-0.5b-shaped"
    transformers.Qwen2Config(**QWEN2_5_0_5B).save_pretrained(model_dir)
    scale = tokens / sum(LENGTHS)
    rng = np.random.default_rng(0)
    data = work / "pack.jsonl"
    with data.open("w") as f:
        for n in LENGTHS:
            f.write(json.dumps({"input_ids": rng.integers(0, QWEN2_5_0_5B["vocab_size"], int(n * scale)).tolist()})
                    + "\n")
    return model_dir, data


def child(mode: str, model_dir: str, data: str) -> None:
    """Child: build the model as ``thdpack check`` does (``load``) and run the pack once, packed, without
    gradients (``forward``)."""
    import torch

    import thdpack
    from thdpack.check.model_loading import load_model
    from thdpack.integrations import packed_model, to_hf_kwargs

    model = load_model(model_dir).model
    if mode == "load":
        return
    samples = [json.loads(line) for line in Path(data).read_text().splitlines()]
    kwargs = to_hf_kwargs(thdpack.build_thd_batch(samples), attn_implementation=model.config._attn_implementation)
    with torch.no_grad():
        packed_model(model)(**kwargs)


def measure(argv: list[str]) -> dict:
    """Run ``argv`` as a child process: its wall seconds, peak RSS (GiB) and exit status."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read()
    proc.stderr.close()
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 1):
        sys.exit(f"{' '.join(argv)} failed ({code}):\n{err}")
    return {"wall_s": round(wall, 1), "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2), "exit": code}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the pack (8 samples)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "MODEL", "DATA"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if args.child:
        child(*args.child)
        return
    import torch

    with tempfile.TemporaryDirectory(prefix="check-cost-") as work:
        model_dir, data = write_inputs(Path(work), args.tokens)
        check = [sys.executable, "-m", "thdpack", "check", str(data), "--model", str(model_dir), "--pack-size",
                 str(args.tokens), "--packs", "1", "-q"]
        runs = {mode: [sys.executable, __file__, "--child", mode, str(model_dir), str(data)]
                for mode in ("load", "forward")}
        runs.update({"check": check, "check --grad": check + ["--grad"]})
        print(f"Qwen2.5-0.5B-shaped model, random weights, float32 on the CPU ({os.cpu_count()} cores, torch "
              f"{torch.__version__}, {torch.get_num_threads()} threads); one pack of {args.tokens} tokens, "
              f"{len(LENGTHS)} samples")
        for name, argv in runs.items():
            print(f"{name:<14} {json.dumps(measure(argv))}", flush=True)


if __name__ == "__main__":
    main()
