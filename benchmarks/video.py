"""Benchmark: an offline build of short videos, thdpack vs the pipeline users write today.

    python benchmarks/video.py                 # 300 generated videos, Qwen2-VL layout, 5 rounds + 1 warm-up
    python benchmarks/video.py --quick         # 60 videos, 3 rounds + 1 warm-up
    python benchmarks/video.py --repeats 7 --json out.json

The data: ``--videos`` short MPEG-4 files generated here (PyAV; random frames of 112..224
px a side, 12..40 frames at 6..30 fps), each in a chat row ``<video>`` + question +
answer, written once to a temporary directory. Both methods decode with PyAV and prepare
the frames by the same rules (:mod:`thdpack.offline.vision.video`: Qwen2-VL's video processor
rules, qwen-vl-utils' sampling; transformers' video processors need torchvision, which
does not load beside the CPU torch here; thdpack runs with ``video: {backend: builtin}``
wherever it runs), so the comparison is about the pipeline around them. The baseline
imports ``transformers.video_processing_utils``, what the video processor a user calls would
import (``processing_utils`` and with it ``modeling_utils``: ~80 MB anonymous memory), and
thdpack imports ``transformers.image_processing_utils`` (the same modules), which its build
would import constructing the image processor: both sides count them as imports.

  baseline   ``datasets.map`` over the rows, one row at a time: decode + frames +
             patches, chat template and tokenizer per sample, the vision placeholder
             expanded by hand; then a padded collator over batches of ``--batch``
             samples (``input_ids`` / ``labels`` right-padded to ``[B, S_max]``, pixel
             rows and grids concatenated), every batch built once.
  thdpack    ``thdpack build`` (``build_packed``) of the same rows into packs of
             ``--pack-size`` tokens within ``--vision-budget`` patches, then every pack
             read back and collated (``load_packed(path).collator()``).

Both methods read the same files and both write their processed pixel rows to disk once and
read them back (the baseline: ``datasets.map``'s cache file; thdpack: the packed data file);
thdpack's collator also computes each pack's mRoPE positions, which the baseline leaves to
the model's ``get_rope_index``. Every run is a fresh process with its own empty
``HF_DATASETS_CACHE`` (no run reuses another's cached ``datasets`` files). Runs are
interleaved in rounds, the order alternating (baseline first, then thdpack first, ...);
the first ``--warmup`` rounds (page cache, lazy imports compiled to .pyc, numba's cache)
are printed but left out of the figures. Per method: the median and the spread (min -
max) of wall-clock seconds and of CPU seconds (user + sys, the process and its children:
steadier than wall-clock on a shared machine); "ratio" = the median over rounds of
baseline / thdpack of the same round, with its spread. Memory: the process's peak
resident set (``ru_maxrss``) and, of it, what the imports alone took (``imports``: the
peak after importing, before any work); the peak anonymous memory (``RssAnon``: heap,
numpy / Arrow / torch buffers, not the pages of memory-mapped files) and, of it, the
imports'. Also shown: tokens, padded slots of the baseline batches. No assertions: the
script measures and prints.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
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

    from thdpack.offline.vision.video import VideoOptions, load_video, video_patches, video_rule

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
                      image_processor={}, video=dict(VIDEO, backend="builtin"), pack_size=args.pack_size,
                      vision_budget=args.vision_budget, num_proc=args.num_proc, map_batch_size=args.map_batch_size)
    res = build_packed(cfg, Path(tempfile.mkdtemp(dir=d)) / "out", progress=False)
    ds = load_packed(res.path)
    collate = ds.collator()
    tokens = slots = 0
    for k in range(len(ds)):
        batch = collate(ds[k])
        tokens += int(batch.seq_lens.sum())
        slots += int(batch.input_ids.numel())
    return {"tokens": tokens, "slots": slots, "batches": len(ds)}


METHODS = {"baseline": run_baseline, "thdpack": run_thdpack}
IMPORTS = {"baseline": ("datasets", "torch", "transformers", "transformers.video_processing_utils",
                         "thdpack.offline.vision.video"),
           "thdpack": ("datasets", "torch", "transformers", "transformers.image_processing_utils", "thdpack.offline",
                       "thdpack.offline.vision.vlm_setup")}


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class AnonPeak:
    """The largest anonymous resident memory (``RssAnon`` of /proc/self/status: heap, numpy and
    Arrow buffers; not the pages of memory-mapped files, which ``ru_maxrss`` also counts) seen by a
    thread that reads it every ``every`` seconds."""

    def __init__(self, every: float = 0.005):
        import threading

        self.mb, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(every,), daemon=True)
        self._thread.start()

    @staticmethod
    def now() -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024

    def _watch(self, every: float) -> None:
        while not self._stop.wait(every):
            self.mb = max(self.mb, self.now())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.mb, self.now())


def child(args) -> None:
    """One method in this process: times and peak memory (all, and after the imports) as one JSON line."""
    import importlib

    anon = AnonPeak()
    t, c = time.perf_counter(), cpu_seconds()
    for name in IMPORTS[args.method]:
        importlib.import_module(name)
    imports = {"import_seconds": time.perf_counter() - t,
               "import_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "import_anon_mb": anon.now()}
    out = METHODS[args.method](Path(args.data), args)
    out.update(imports, seconds=time.perf_counter() - t, cpu_seconds=cpu_seconds() - c,
               peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, peak_anon_mb=anon.stop())
    print(json.dumps(out))


# ---------------------------------------------------------------------------- main


def run_child(method: str, d: Path, args) -> dict:
    """One run of ``method`` in a fresh process with an empty datasets cache."""
    cmd = [sys.executable, __file__, "--method", method, "--data", str(d), "--batch", str(args.batch),
           "--pack-size", str(args.pack_size), "--vision-budget", str(args.vision_budget),
           "--num-proc", str(args.num_proc), "--map-batch-size", str(args.map_batch_size)]
    with tempfile.TemporaryDirectory(dir=d) as cache:
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=cache)
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{method} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values: list) -> str:
    return f"{statistics.median(values):7.2f} ({min(values):.2f} - {max(values):.2f})"


def summary(rounds: list) -> dict:
    """Medians and spreads of the measured rounds (a list of {method: result})."""
    out = {}
    for m in METHODS:
        runs = [r[m] for r in rounds]
        out[m] = {k: statistics.median(x[k] for x in runs) for k in
                  ("seconds", "cpu_seconds", "import_seconds", "peak_rss_mb", "import_rss_mb", "peak_anon_mb",
                   "import_anon_mb")}
        out[m].update({f"{k}_all": [x[k] for x in runs] for k in ("seconds", "cpu_seconds", "peak_rss_mb")})
        out[m].update({k: runs[0][k] for k in ("tokens", "slots", "batches")})
    for key in ("seconds", "cpu_seconds"):
        ratios = [r["baseline"][key] / r["thdpack"][key] for r in rounds]
        out[f"ratio_{key}"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                               "all": ratios}
    return out


def report(s: dict) -> None:
    print(f"{'':9s} {'wall s: median (min - max)':28s} {'CPU s: median (min - max)':28s} "
          "peak RSS MB (imports) / anonymous (imports)")
    for m in METHODS:
        r = s[m]
        print(f"{m:9s} {spread(r['seconds_all']):28s} {spread(r['cpu_seconds_all']):28s} "
              f"{r['peak_rss_mb']:5.0f} ({r['import_rss_mb']:.0f}) / {r['peak_anon_mb']:.0f} ({r['import_anon_mb']:.0f})   "
              f"{r['batches']} batches, "
              f"{r['tokens']:,} tokens in {r['slots']:,} slots ({r['tokens'] / max(r['slots'], 1):.0%} real)")
    for key, what in (("seconds", "wall-clock"), ("cpu_seconds", "CPU time")):
        r = s[f"ratio_{key}"]
        print(f"ratio baseline / thdpack, {what}: {r['median']:.2f}x (rounds: {r['min']:.2f} - {r['max']:.2f})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--videos", type=int, default=300)
    p.add_argument("--batch", type=int, default=8, help="baseline samples per padded batch")
    p.add_argument("--pack-size", type=int, default=4096)
    p.add_argument("--vision-budget", type=int, default=8192)
    p.add_argument("--num-proc", type=int, default=1)
    p.add_argument("--map-batch-size", type=int, default=1000,
                   help="thdpack's map_batch_size (its default; VLM builds cap it at VISION_MAP_BATCH_SIZE)")
    p.add_argument("--repeats", type=int, default=5, help="measured rounds (each: both methods, fresh processes)")
    p.add_argument("--warmup", type=int, default=1, help="rounds run first and left out of the figures")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="60 videos, 3 measured rounds")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--method", choices=sorted(METHODS), help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.method:
        child(args)
        return 0
    n, repeats = (60, 3) if args.quick else (args.videos, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        t = time.perf_counter()
        make_data(d, n, args.seed)
        print(f"{n} videos generated in {time.perf_counter() - t:.1f} s; {args.warmup} warm-up + {repeats} rounds",
              flush=True)
        rounds = []
        for k in range(args.warmup + repeats):
            order = list(METHODS) if k % 2 == 0 else list(METHODS)[::-1]
            rounds.append({m: run_child(m, d, args) for m in order})
            tag = "warm-up" if k < args.warmup else f"round {k - args.warmup + 1}"
            print(f"{tag:8s} " + "   ".join(f"{m} {rounds[-1][m]['seconds']:.2f} s / {rounds[-1][m]['cpu_seconds']:.2f} "
                                             f"CPU s / {rounds[-1][m]['peak_rss_mb']:.0f} MB / "
                                             f"{rounds[-1][m]['peak_anon_mb']:.0f} MB anon" for m in order), flush=True)
    s = summary(rounds[args.warmup:])
    report(s)
    if args.json:
        Path(args.json).write_text(json.dumps({"videos": n, "warmup": rounds[: args.warmup], **s}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
