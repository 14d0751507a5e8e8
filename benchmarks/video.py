"""Benchmark: an offline build of short videos, thdpack vs the pipeline users write today.

    python benchmarks/video.py                 # 300 generated videos, Qwen2-VL layout
    python benchmarks/video.py --videos 100 --quick
    python benchmarks/video.py --json out.json

The data: ``--videos`` short MPEG-4 files generated here (PyAV; random frames of 112..224
px a side, 12..40 frames at 6..30 fps), each in a chat row ``<video>`` + question +
answer, written once to a temporary directory. Both methods decode with PyAV and prepare
the frames by the same rules (:mod:`thdpack.offline.video`: Qwen2-VL's video processor
rules, qwen-vl-utils' sampling; transformers' video processors need torchvision, which
does not load beside the CPU torch here), so the comparison is about the pipeline around
them:

  baseline   ``datasets.map`` over the rows, one row at a time: decode + frames +
             patches, chat template and tokenizer per sample, the vision placeholder
             expanded by hand; then a padded collator over batches of ``--batch``
             samples (``input_ids`` / ``labels`` right-padded to ``[B, S_max]``, pixel
             rows and grids concatenated), every batch built once.
  thdpack    ``thdpack build`` (``build_packed``) of the same rows into packs of
             ``--pack-size`` tokens within ``--vision-budget`` patches, then every pack
             read back and collated (``load_packed(path).collator()``).

Each method runs in its own process; the time is wall-clock of the whole method, the
memory the process's peak resident set (``ru_maxrss``). "ratio" = baseline time /
thdpack time. Also shown: tokens, padded slots of the baseline batches. No assertions:
the script measures and prints.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PATCH, MERGE, TPATCH = 14, 2, 2
VIDEO = {"min_pixels": 16 * 28 * 28, "max_pixels": 64 * 28 * 28}


# ---------------------------------------------------------------------------- data


def make_data(d: Path, n: int, seed: int) -> None:
    """``n`` videos under ``d/vid``, ``d/data.jsonl``, the tokenizer and the model config."""
    import transformers

    from thdpack.demo import TOKENIZER_DIR
    from thdpack.demo.videos import write_video

    rng = np.random.default_rng(seed)
    (d / "vid").mkdir(parents=True)
    rows = []
    for i in range(n):
        h, w = (int(x) // 16 * 16 for x in rng.integers(112, 225, 2))
        frames, fps = int(rng.integers(12, 41)), int(rng.integers(6, 31))
        write_video(d / "vid" / f"{i}.mp4", frames, fps, h, w, seed=rng)
        q = " ".join(["what", "happens", "in", "this", "clip"][: int(rng.integers(2, 6))])
        a = " ".join(["the", "noise", "moves", "fast", "and", "then", "slow"] * int(rng.integers(1, 6)))
        rows.append({"messages": [{"role": "user", "content": f"<video>{q}?"}, {"role": "assistant", "content": a}],
                     "videos": [f"vid/{i}.mp4"]})
    (d / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)
    tok.add_tokens(VISION_TOKENS, special_tokens=True)
    tok.save_pretrained(str(d / "tok"))
    ids = tok.convert_tokens_to_ids(VISION_TOKENS)
    cfg = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
        vision_config=dict(patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TPATCH),
        vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3])
    (d / "model").mkdir()
    (d / "model" / "config.json").write_text(json.dumps(cfg.to_dict()))


# ---------------------------------------------------------------------------- methods


def run_baseline(d: Path, args) -> dict:
    """datasets.map (decode + frames + tokenize per row), then padded collation."""
    import datasets
    import torch
    import transformers

    from thdpack.offline.video import VideoOptions, load_video, video_patches, video_rule

    tok = transformers.AutoTokenizer.from_pretrained(str(d / "tok"), local_files_only=True)
    rule = video_rule("qwen2_vl")  # Qwen2VLVideoProcessor's mean / std and resize rule
    mean, std = rule.mean, rule.std
    opts = VideoOptions(**VIDEO)
    vid_id = tok.convert_tokens_to_ids("<|video_pad|>")

    def process(row):
        v = load_video(d / row["videos"][0], row["videos"][0], opts, TPATCH, PATCH * MERGE)
        pv, grid = video_patches(v.frames, mean, std, PATCH, MERGE, TPATCH)
        run = "<|vision_start|>" + "<|video_pad|>" * (int(grid.prod()) // MERGE**2) + "<|vision_end|>"
        msgs = [dict(m, content=m["content"].replace("<video>", run)) for m in row["messages"]]
        enc = tok.apply_chat_template([msgs], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = np.asarray(enc["input_ids"][0]), np.asarray(enc["assistant_masks"][0], bool) & (
            np.asarray(enc["input_ids"][0]) != vid_id)
        return {"input_ids": ids, "labels": np.where(mask, ids, -100), "pixel_values_videos": pv,
                "video_grid_thw": grid[None], "second_per_grid_ts": [TPATCH / v.sampled_fps]}

    ds = datasets.load_dataset("json", data_files=str(d / "data.jsonl"), split="train")
    ds = ds.map(process, remove_columns=ds.column_names, num_proc=args.num_proc).with_format("torch")
    tokens = padded = batches = 0
    for a in range(0, len(ds), args.batch):
        rows = [ds[i] for i in range(a, min(a + args.batch, len(ds)))]
        s_max = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), s_max), tok.pad_token_id or 0, dtype=torch.long)
        labels = torch.full((len(rows), s_max), -100, dtype=torch.long)
        for k, r in enumerate(rows):
            ids[k, : len(r["input_ids"])] = r["input_ids"]
            labels[k, : len(r["labels"])] = r["labels"]
        batch = {"input_ids": ids, "labels": labels, "attention_mask": ids != (tok.pad_token_id or 0),
                 "pixel_values_videos": torch.cat([r["pixel_values_videos"] for r in rows]),
                 "video_grid_thw": torch.cat([r["video_grid_thw"] for r in rows])}
        tokens += sum(len(r["input_ids"]) for r in rows)
        padded += batch["input_ids"].numel()
        batches += 1
    return {"tokens": tokens, "slots": padded, "batches": batches}


def run_thdpack(d: Path, args) -> dict:
    """thdpack build, then every pack read back and collated."""
    from thdpack.offline import BuildConfig, build_packed, load_packed

    cfg = BuildConfig(input=str(d / "data.jsonl"), tokenizer=str(d / "tok"), model_config=str(d / "model"),
                      image_processor={}, video=dict(VIDEO), pack_size=args.pack_size,
                      vision_budget=args.vision_budget, num_proc=args.num_proc, map_batch_size=args.map_batch_size)
    res = build_packed(cfg, Path(tempfile.mkdtemp(dir=d)) / "out", progress=False, log=None)
    ds = load_packed(res.path)
    collate = ds.collator()
    tokens = slots = 0
    for k in range(len(ds)):
        batch = collate(ds[k])
        tokens += int(batch.seq_lens.sum())
        slots += int(batch.input_ids.numel())
    return {"tokens": tokens, "slots": slots, "batches": len(ds)}


METHODS = {"baseline": run_baseline, "thdpack": run_thdpack}


def child(args) -> None:
    """One method in this process: time and peak memory as one JSON line."""
    t = time.perf_counter()
    out = METHODS[args.method](Path(args.data), args)
    out["seconds"] = time.perf_counter() - t
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))


# ---------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--videos", type=int, default=300)
    p.add_argument("--batch", type=int, default=8, help="baseline samples per padded batch")
    p.add_argument("--pack-size", type=int, default=4096)
    p.add_argument("--vision-budget", type=int, default=8192)
    p.add_argument("--num-proc", type=int, default=1)
    p.add_argument("--map-batch-size", type=int, default=1000,
                   help="thdpack's map_batch_size (its default; VLM builds cap it at VISION_MAP_BATCH_SIZE)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="60 videos")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--method", choices=sorted(METHODS), help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.method:
        child(args)
        return 0
    n = 60 if args.quick else args.videos
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        t = time.perf_counter()
        make_data(d, n, args.seed)
        print(f"{n} videos generated in {time.perf_counter() - t:.1f} s", flush=True)
        results = {}
        for method in ("baseline", "thdpack"):
            cmd = [sys.executable, __file__, "--method", method, "--data", str(d), "--batch", str(args.batch),
                   "--pack-size", str(args.pack_size), "--vision-budget", str(args.vision_budget),
                   "--num-proc", str(args.num_proc), "--map-batch-size", str(args.map_batch_size)]
            done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
            if done.returncode:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            results[method] = json.loads(done.stdout.strip().splitlines()[-1])
    for method, r in results.items():
        print(f"{method:9s} {r['seconds']:7.2f} s   peak RSS {r['peak_rss_mb']:7.0f} MB   {r['batches']:4d} batches   "
              f"{r['tokens']:,} tokens in {r['slots']:,} slots ({r['tokens'] / max(r['slots'], 1):.0%} real)")
    ratio = results["baseline"]["seconds"] / results["thdpack"]["seconds"]
    print(f"ratio (baseline time / thdpack time): {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"videos": n, "ratio": ratio, **results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
