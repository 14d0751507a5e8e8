"""Benchmark: mRoPE positions of a packed VLM step, thdpack vs per-sample ``get_rope_index``.

    python benchmarks/vlm.py                       # 256 samples per step, 10 timed steps, Qwen2.5-VL
    python benchmarks/vlm.py --families all        # Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5
    python benchmarks/vlm.py --quick               # 3 timed steps
    python benchmarks/vlm.py --json out.json

Each step packs ``--samples`` image+text samples (seed ``--seed``), as a processor
returns them: torch ``input_ids`` with the image placeholders expanded (one image
token per merged patch), ``mm_token_type_ids``, ``image_grid_thw`` and
``pixel_values`` (:data:`PIXEL_DIM` = 8 values per patch, the tiny configs' row width: the width
only scales a memcpy; real models have 1176 or 1536).
A sample has 1 image (75%), 2 (20%) or 3 (5%), each 224..1008 px a side at patch
14 / merge 2 (64..1296 image tokens), a system prompt, a question (lognormal, median
~33 tokens) and an answer (lognormal, median ~90 tokens, at most 4096).
The ``long-tail`` scenario adds one 32k-token text sample to every step, so the
padded ``[B, S_max]`` shape is far larger than the stream.

Methods, each from the same list of samples to the concatenated ``input_ids``
``[T]`` and mRoPE rows ``[3, T]``:
  per-sample   what LLaMA-Factory / ms-swift do for packing / padding-free
               batches: call the model class's own ``get_rope_index`` on every
               sample alone, then ``torch.cat`` the positions and the input ids.
  padded BSHD  the padded-batch path: right-pad to ``[B, S_max]``, one batched
               ``get_rope_index(..., attention_mask=...)``, then remove the padding.
  thdpack      ``thdpack.vlm.mrope_for_stream`` on the THD stream, straight from
               the grids (the function ``build_thd_batch`` uses), vectorised over
               the whole pack: no per-sample loop, no model call.
  build        the whole ``build_thd_batch(samples, vlm=get_family(cfg))`` for
               context (labels, position ids, cu_seqlens, token types, mRoPE,
               pixel values and grids concatenated, ViT cu_seqlens).

Time is per step (median and best over ``--steps`` steps, each on fresh samples,
after ``--warmup`` steps). "ratio" is the median over the steps of per-sample
time / thdpack time on the same step (target: at least 10x). The outputs of every method are compared with the per-sample
reference on the first step ("same output").

Allocations (one extra, traced step per method): every torch op output that is a
new storage, via ``torch.utils._python_dispatch.TorchDispatchMode`` (shape and
bytes of the largest; "BSHD" counts tensors with a ``B`` axis and an axis of at
least ``S_max``), and the numpy / Python heap via ``tracemalloc`` (numpy and numba
register their arrays there): the largest growth of the heap inside a single
source line of the method (an upper bound on its largest array). Both are shown
in units of an int64 ``[T]`` array (``8·T`` bytes); an int64 ``[B, S_max]`` array is
``B·S_max/T`` such units. A method that never builds a ``[B, S]`` tensor stays near
a few units however long ``S_max`` is.

No assertions: the script measures and prints (the target is shown for
reference). It exits non-zero only if an output disagrees with the reference.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import tracemalloc

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")
MODEL_CLASSES = {
    "qwen2_vl": "Qwen2VLModel",
    "qwen2_5_vl": "Qwen2_5_VLModel",
    "qwen3_vl": "Qwen3VLModel",
    "qwen3_5": "Qwen3_5Model",
}
# Qwen's token ids; ordinary text is drawn below TEXT_HI
IMG, VID, VS, VE, TEXT_HI = 151655, 151656, 151652, 151653, 151643
MERGE = 2
PIXEL_DIM = 8  # values per pixel_values row: in_channels 1 · temporal_patch_size 2 · patch_size 2² (tiny_model)
TARGET = 10.0
METHODS = ("per-sample", "padded BSHD", "thdpack", "build")


# --------------------------------------------------------------------------- data


def make_steps(num_steps: int, batch: int, seed: int, pixel_dim: int, long_sample: int) -> list[list[dict]]:
    """``num_steps`` lists of ``batch`` processor-style samples (plus one ``long_sample``-token
    text sample per step when ``long_sample > 0``)."""
    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(num_steps):
        samples = []
        for _ in range(batch):
            n_images = int(rng.choice([1, 2, 3], p=[0.75, 0.2, 0.05]))
            # image side 224..1008 px -> patch grid 16..72 (patch 14), a multiple of the merge size
            grid = np.stack([np.ones(n_images, np.int64), *(rng.integers(8, 37, (2, n_images)) * MERGE)], 1)
            parts = [rng.integers(0, TEXT_HI, 20)]  # system prompt
            for t, h, w in grid:
                parts += [[VS], np.full(t * h * w // MERGE**2, IMG), [VE]]
            prompt = int(np.clip(rng.lognormal(3.5, 0.8), 1, 1024))
            answer = int(np.clip(rng.lognormal(4.5, 1.0), 1, 4096))
            parts.append(rng.integers(0, TEXT_HI, prompt + answer))
            samples.append(processor_style(np.concatenate(parts), grid, answer, pixel_dim, rng))
        if long_sample:
            samples.append(processor_style(rng.integers(0, TEXT_HI, long_sample), np.zeros((0, 3), np.int64), 1024, pixel_dim, rng))
        steps.append(samples)
    return steps


def processor_style(ids: np.ndarray, grid: np.ndarray, answer: int, pixel_dim: int, rng) -> dict:
    ids = torch.from_numpy(ids.astype(np.int64))
    labels = ids.clone()
    labels[: ids.numel() - answer] = -100
    sample = {"input_ids": ids, "labels": labels, "mm_token_type_ids": (ids == IMG).to(torch.int32)}
    if grid.shape[0]:
        sample["image_grid_thw"] = torch.from_numpy(grid)
        sample["pixel_values"] = torch.from_numpy(rng.standard_normal((int(grid.prod(1).sum()), pixel_dim), np.float32))
    return sample


def tiny_model(family: str):
    """A small model of ``family`` (get_rope_index only reads the config: merge size,
    tokens per second), with Qwen's image / video / vision-start token ids."""
    import transformers

    text = dict(
        vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
    )
    # in_channels 1 · temporal_patch_size 2 · patch_size 2² = PIXEL_DIM values per pixel_values row, which
    # build_thd_batch checks against the config; get_rope_index reads neither (only the merge size).
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=2, in_channels=1,
                  spatial_merge_size=MERGE, temporal_patch_size=2, out_hidden_size=32)
    ids = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)
    if family == "qwen2_vl":
        vision = dict(vision, embed_dim=32, mlp_ratio=2)
        del vision["intermediate_size"], vision["out_hidden_size"]
        cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
    elif family == "qwen2_5_vl":
        vision = dict(vision, fullatt_block_indexes=[0], tokens_per_second=2)
        cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    elif family == "qwen3_vl":
        text["rope_parameters"] = dict(text["rope_parameters"], mrope_interleaved=True)
        vision = dict(vision, num_position_embeddings=64, deepstack_visual_indexes=[0])
        cfg = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
    else:
        text["rope_parameters"] = dict(text["rope_parameters"], mrope_interleaved=True, partial_rotary_factor=1.0)
        text.update(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8,
                    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2)
        vision = dict(vision, num_position_embeddings=64)
        cfg = transformers.Qwen3_5Config(text_config=text, vision_config=vision, **ids)
    torch.manual_seed(0)
    return getattr(transformers, MODEL_CLASSES[family])(cfg).eval()


# --------------------------------------------------------------------------- methods


def per_sample(model, samples):
    """Per-sample ``get_rope_index`` (the model's own), then concatenate."""
    positions = []
    for s in samples:
        pos, _ = model.get_rope_index(
            s["input_ids"].unsqueeze(0), s["mm_token_type_ids"].unsqueeze(0), image_grid_thw=s.get("image_grid_thw")
        )
        positions.append(pos[:, 0])
    return torch.cat([s["input_ids"] for s in samples]), torch.cat(positions, dim=1)


def padded_bshd(model, samples):
    """Right-pad to ``[B, S_max]``, one batched ``get_rope_index``, remove the padding."""
    lengths = torch.tensor([s["input_ids"].numel() for s in samples])
    B, S = len(samples), int(lengths.max())
    ids = torch.zeros(B, S, dtype=torch.int64)
    types = torch.zeros(B, S, dtype=torch.int32)
    mask = torch.arange(S).unsqueeze(0) < lengths.unsqueeze(1)
    for b, s in enumerate(samples):
        n = s["input_ids"].numel()
        ids[b, :n] = s["input_ids"]
        types[b, :n] = s["mm_token_type_ids"]
    grids = torch.cat([s["image_grid_thw"] for s in samples if "image_grid_thw" in s])
    pos, _ = model.get_rope_index(ids, types, image_grid_thw=grids, attention_mask=mask)
    return ids[mask], pos[:, mask]


def thdpack_positions(family, samples):
    """thdpack's vectorised mRoPE on the THD stream (what build_thd_batch runs), from the samples."""
    from thdpack.vlm import mrope_for_stream

    n = len(samples)
    ids = np.concatenate([s["input_ids"].numpy() for s in samples])
    lengths = np.fromiter((s["input_ids"].numel() for s in samples), np.int64, count=n)
    cu = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=cu[1:])
    grids = [s["image_grid_thw"].numpy() for s in samples if "image_grid_thw" in s]
    counts = np.fromiter((s["image_grid_thw"].shape[0] if "image_grid_thw" in s else 0 for s in samples), np.int64, count=n)
    images = family.image_items(np.concatenate(grids) if grids else np.zeros((0, 3), np.int64))
    videos = family.video_items(np.zeros((0, 3), np.int64))
    rope = mrope_for_stream(family, ids, cu, lengths, images, counts, videos, np.zeros(n, np.int64))
    return torch.from_numpy(ids), torch.from_numpy(rope.positions)


def build(config, samples):
    from thdpack import build_thd_batch
    from thdpack.vlm import get_family

    batch = build_thd_batch(samples, vlm=get_family(config))
    return batch.input_ids, batch.token_extras["mrope_position_ids"]


# --------------------------------------------------------------------------- allocation tracing


class NewTensors(TorchDispatchMode):
    """Every torch op output that is a new storage (not a view of an input)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[tuple[int, ...], int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs)) if t.device.type != "meta"}
        for t in _tensors(out):
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                self.shapes.append((tuple(t.shape), storage.nbytes(), str(func.overloadpacket.__name__)))
        return out


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            yield from _tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x)


class LinePeaks:
    """Largest tracemalloc heap growth inside one executed source line (of any Python frame)."""

    def __init__(self):
        self.best = (0, None)
        self._where = None
        self._start = 0

    def _close(self):
        if self._where is not None:
            grown = tracemalloc.get_traced_memory()[1] - self._start
            if grown > self.best[0]:
                self.best = (grown, self._where)

    def _local(self, frame, event, arg):
        if event in ("line", "return"):
            self._close()
            tracemalloc.reset_peak()
            self._start = tracemalloc.get_traced_memory()[0]
            self._where = (frame.f_code.co_filename, frame.f_lineno) if event == "line" else None
        return self._local

    def _global(self, frame, event, arg):
        if "tracemalloc" in frame.f_code.co_filename:
            return None
        return self._local

    def run(self, fn, *args):
        tracemalloc.start()
        sys.settrace(self._global)
        try:
            fn(*args)
        finally:
            sys.settrace(None)
            self._close()
            tracemalloc.stop()
        grown, (filename, line) = self.best if self.best[1] else (0, ("-", 0))
        return grown, f"{os.path.basename(filename)}:{line}"


def allocations(fn, *args, B: int, S: int) -> dict:
    mode = NewTensors()
    with mode:
        fn(*args)
    big = max(mode.shapes, key=lambda r: r[1], default=((), 0, "-"))
    bshd = sum(1 for shape, _, _ in mode.shapes if len(shape) >= 2 and B in shape and max(shape) >= S)
    heap, line = LinePeaks().run(fn, *args)
    return {"torch_bytes": big[1], "torch_shape": list(big[0]), "torch_op": big[2], "bshd_tensors": bshd,
            "heap_line_bytes": heap, "heap_line": line}


# --------------------------------------------------------------------------- main


def check(ref, got) -> bool:
    return all(a.shape == b.shape and torch.equal(a.to(torch.int64), b.to(torch.int64)) for a, b in zip(ref, got))


def run_family(family: str, scenario: str, steps: list[list[dict]], args) -> dict:
    from thdpack.vlm import get_family

    model = tiny_model(family)
    config = model.config
    fam = get_family(config)
    fns = {
        "per-sample": lambda s: per_sample(model, s),
        "padded BSHD": lambda s: padded_bshd(model, s),
        "thdpack": lambda s: thdpack_positions(fam, s),
        "build": lambda s: build(config, s),
    }
    first = steps[0]
    ref = fns["per-sample"](first)
    same = {m: check(ref, fns[m](first)) for m in METHODS}
    times = {m: [] for m in METHODS}
    with torch.no_grad():
        for k, samples in enumerate(steps):
            for m in METHODS:
                gc.collect()
                t0 = time.perf_counter()
                fns[m](samples)
                if k >= args.warmup:
                    times[m].append(time.perf_counter() - t0)
    lengths = [s["input_ids"].numel() for s in first]
    T, B, S = sum(lengths), len(first), max(lengths)
    allocs = {m: allocations(fns[m], first, B=B, S=S) for m in METHODS} if not args.no_alloc else {}
    return {
        "family": family, "scenario": scenario, "B": B, "T": T, "S_max": S,
        "vision_tokens": int(sum(int((s["input_ids"] == IMG).sum()) for s in first)),
        "median_s": {m: float(np.median(v)) for m, v in times.items()},
        "best_s": {m: float(np.min(v)) for m, v in times.items()},
        # per-step ratios (both methods timed back to back on the same samples), then the median
        "ratio": float(np.median(np.array(times["per-sample"]) / np.array(times["thdpack"]))),
        "same_output": same,
        "alloc": allocs,
    }


def print_tables(results: list[dict]) -> None:
    rows = [("family", "scenario", "B", "T", "per-sample ms", "padded BSHD ms", "thdpack ms", "ratio", "target", "met",
             "build_thd_batch ms", "same output")]
    for r in results:
        med = r["median_s"]
        rows.append((r["family"], r["scenario"], str(r["B"]), f"{r['T']:,}", f"{1e3 * med['per-sample']:.1f}",
                     f"{1e3 * med['padded BSHD']:.1f}", f"{1e3 * med['thdpack']:.2f}", f"{r['ratio']:.1f}x",
                     f">= {TARGET:g}x", "yes" if r["ratio"] >= TARGET else "NO", f"{1e3 * med['build']:.1f}",
                     "OK" if all(r["same_output"].values()) else
                     "MISMATCH: " + ", ".join(m for m, ok in r["same_output"].items() if not ok)))
    _table(rows, "Time per step (median over the timed steps; ratio: median of per-step per-sample / thdpack)")

    rows = [("family", "scenario", "method", "B·S_max/T", "largest torch tensor", "×8T", "op", "BSHD tensors",
             "largest heap line", "×8T", "line")]
    for r in results:
        T = r["T"]
        for m, a in r["alloc"].items():
            rows.append((r["family"], r["scenario"], m, f"{r['B'] * r['S_max'] / T:.1f}",
                         f"{a['torch_shape']} {a['torch_bytes'] / 2**20:.2f} MiB" if a["torch_bytes"] else "none (numpy)",
                         f"{a['torch_bytes'] / (8 * T):.2f}",
                         a["torch_op"], str(a["bshd_tensors"]), f"{a['heap_line_bytes'] / 2**20:.2f} MiB",
                         f"{a['heap_line_bytes'] / (8 * T):.2f}", a["heap_line"]))
    if len(rows) > 1:
        _table(rows, "Allocations of one step (×8T: in units of an int64 [T] array; an int64 [B, S_max] is B·S_max/T units)")


def _table(rows, title):
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print(f"\n{title}")
    for i, row in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=256, help="image+text samples per step (default 256)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--quick", action="store_true", help="3 timed steps, 1 warm-up")
    p.add_argument("--families", default="qwen2_5_vl", help=f"comma-separated, or 'all' ({', '.join(FAMILIES)})")
    p.add_argument("--scenarios", default="typical,long-tail", help="typical, long-tail (one extra 32k-token sample per step)")
    p.add_argument("--long-sample", type=int, default=32768, help="tokens of the long-tail scenario's extra sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--no-alloc", action="store_true", help="skip the allocation tracing")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup = 3, 1
    families = FAMILIES if args.families == "all" else tuple(f.strip() for f in args.families.split(",") if f.strip())
    scenarios = tuple(s.strip() for s in args.scenarios.split(",") if s.strip())
    torch.set_num_threads(args.threads)

    import transformers

    import thdpack

    print(f"python {platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, thdpack {thdpack.__version__}, {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} torch thread(s)")
    results = []
    for scenario in scenarios:
        long_sample = args.long_sample if scenario == "long-tail" else 0
        steps = make_steps(args.warmup + args.steps, args.samples, args.seed, PIXEL_DIM, long_sample)
        print(f"{scenario}: {args.warmup + args.steps} steps ({args.warmup} warm-up) of {len(steps[0])} samples; "
              f"first step {sum(s['input_ids'].numel() for s in steps[0]):,} tokens")
        for family in families:
            results.append(run_family(family, scenario, steps, args))
        del steps
    print_tables(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
        print(f"wrote {args.json}")
    return 0 if all(all(r["same_output"].values()) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
