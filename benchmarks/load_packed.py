"""Benchmark: loading stored packs, rows of ``load_packed`` to ``ThdBatch`` es (batches per second).

    python benchmarks/load_packed.py                       # the demo build (configs/demo.yaml), CP 1 and 2
    python benchmarks/load_packed.py --source tokenized --num-samples 20000 --targets labels
    python benchmarks/load_packed.py --source vlm          # Qwen2.5-VL packs with images, CP 1 and 2
    python benchmarks/load_packed.py --json out.json

Builds the packs into a temporary folder with ``thdpack build`` (``--source demo``: configs/demo.yaml, 4000
chat conversations, a loss mask; ``--source tokenized``: seeded pre-tokenized rows, no tokenizer), once per
``--cp`` size (``--source vlm``: no build; pack rows made in memory, read-only like a memory-mapped file's, of
``benchmarks/vlm.py``'s processor-style image samples, 1-3 images each, packed greedily to ``--pack-size`` tokens,
collated with a tiny Qwen2.5-VL config: mRoPE rows, token types, pixels and grids), then times the collator of :meth:`PackedDataset.collator` over every row (one row per call,
``DataLoader(batch_size=None)``; the rows are read first, so only the collator is timed): the whole pack, and
with CP > 1 also rank 0's shard (``collator(cp_rank=0)``). Beside it, the split-and-rejoin route the collator
took before issue 44 (``unpack_row`` then ``ThdCollator``, then ``sample_index`` / ``source_index`` patched in),
as the reference: it must give the same batches (every field, extra and dtype).

Batches per second are the best of ``--repeats`` passes over all rows (the routes interleaved), one torch
thread (as in a DataLoader worker). No timed assertions; exits non-zero only if the routes' batches differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import thdpack  # noqa: E402
import thdpack.offline  # noqa: E402
from thdpack.offline import load_packed, unpack_row  # noqa: E402
from thdpack.vlm import get_family  # noqa: E402

def build(out: Path, source: str, cp: int, num_samples: int, targets: str, pack_size: int) -> None:
    """The packs of ``source`` planned for CP ``cp`` into ``out``."""
    cmd = [sys.executable, "-m", "thdpack", "build", "--output", str(out), "--quiet", "--cp-size", str(cp),
           "--targets", targets]
    if source == "demo":
        cmd += ["--config", str(ROOT / "configs" / "demo.yaml")]
    else:
        from build import write_tokenized  # benchmarks/build.py's seeded pre-tokenized rows

        data = out.parent / f"tokenized-{num_samples}.parquet"
        if not data.exists():
            write_tokenized(data, num_samples, 0, pack_size)
        cmd += ["--input", str(data), "--format", "tokenized", "--pack-size", str(pack_size), "--overflow", "truncate"]
    subprocess.run(cmd, check=True)


def split_and_rejoin(ds, **overrides):
    """The route before issue 44: each row's samples (``unpack_row``) through a ``ThdCollator``, then the
    stored ``sample_index`` / ``source_index`` patched in (text packs without shared prefixes)."""
    packed = ds.collator(**overrides)
    collator = thdpack.ThdCollator(**packed.collator.layout.keywords(), vlm=packed.collator.build_kwargs["vlm"])

    def collate(row):
        batch = collator(unpack_row(row))
        batch = dataclasses.replace(batch, sample_index=torch.from_numpy(row["sample_index"].astype(np.int64)))
        if "source_index" in row:
            batch = dataclasses.replace(batch, source_index=torch.from_numpy(row["source_index"].astype(np.int64)))
        return batch

    return collate


class VlmRows:
    """Pack rows of ``num_samples`` processor-style image samples (``benchmarks/vlm.py``), packed greedily to
    ``pack_size`` tokens, in the stored columns (read-only arrays), and their collator (a tiny Qwen2.5-VL)."""

    def __init__(self, cp: int, num_samples: int, pack_size: int):
        from vlm import PIXEL_DIM, make_steps, tiny_model  # noqa: PLC0415

        self.family = get_family(tiny_model("qwen2_5_vl").config)
        self.cp = cp
        samples = make_steps(1, num_samples, 0, PIXEL_DIM, 0)[0]
        packs, tokens = [[]], 0
        for i, s in enumerate(samples):
            n = s["input_ids"].numel()
            if packs[-1] and tokens + n > pack_size:
                packs.append([])
                tokens = 0
            packs[-1].append(i)
            tokens += n
        self.rows = [_vlm_row([samples[i] for i in pack], pack) for pack in packs]

    def collator(self, **overrides):
        return thdpack.offline.PackedRowCollator(model_config=self.family, cp_size=self.cp, **overrides)


def _vlm_row(samples: list[dict], index: list[int]) -> dict:
    """One stored pack row of ``samples`` (columns as ``thdpack build`` writes them), read-only."""
    def cat(field, dtype):
        return np.concatenate([s[field].numpy().reshape(-1) for s in samples if field in s]).astype(dtype)

    row = {"input_ids": cat("input_ids", np.int32), "labels": cat("labels", np.int32),
           "seq_lens": np.array([s["input_ids"].numel() for s in samples], np.int32),
           "sample_index": np.array(index, np.int64), "sample_start": np.zeros(len(samples), np.int32),
           "image_counts": np.array([s["image_grid_thw"].shape[0] for s in samples], np.int32),
           "image_grid_thw": cat("image_grid_thw", np.int32), "pixel_values": cat("pixel_values", np.float32)}
    for value in row.values():
        value.flags.writeable = False
    return row


def same(a, b, name: str = "batch") -> list[str]:
    """The fields in which batches ``a`` and ``b`` differ (values or dtypes), every field and extra compared."""
    if isinstance(b, torch.Tensor):
        return [] if isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b) else [name]
    if isinstance(b, dict):
        if not isinstance(a, dict) or a.keys() != b.keys():
            return [name]
        return [f for k in b for f in same(a[k], b[k], f"{name}[{k}]")]
    if dataclasses.is_dataclass(b):
        return [f for field in dataclasses.fields(b) for f in same(getattr(a, field.name), getattr(b, field.name),
                                                                   field.name if name == "batch" else f"{name}.{field.name}")]
    return [] if type(a) is type(b) and a == b else [name]


def time_pass(collate, rows) -> float:
    gc.collect()
    t0 = time.perf_counter()
    for row in rows:
        collate(row)
    return time.perf_counter() - t0


def measure(ds, name: str, repeats: int, **overrides) -> dict:
    """Batches per second of the collator and of the split-and-rejoin route over every row of ``ds``."""
    rows = [ds[k] for k in range(len(ds))] if isinstance(ds, thdpack.offline.PackedDataset) else ds.rows
    routes = {"collator": ds.collator(**overrides), "split+rejoin": split_and_rejoin(ds, **overrides)}
    differ = sorted({f for row in rows for f in same(routes["collator"](row), routes["split+rejoin"](row))})
    best = {r: float("inf") for r in routes}
    for _ in range(repeats):
        for r, collate in routes.items():
            best[r] = min(best[r], time_pass(collate, rows))
    tokens = sum(row["input_ids"].size for row in rows)
    return dict(case=name, packs=len(rows), tokens_per_pack=tokens / max(len(rows), 1), differ=differ,
                **{f"{r} batches/s": len(rows) / best[r] for r in routes})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", choices=["demo", "tokenized", "vlm"], default="demo")
    ap.add_argument("--num-samples", type=int, default=20000, help="tokenized rows (default 20000)")
    ap.add_argument("--pack-size", type=int, default=4096, help="tokenized packs' size (default 4096)")
    ap.add_argument("--targets", choices=["loss_mask", "labels"], default="loss_mask")
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2], help="CP sizes built and timed (default 1 2)")
    ap.add_argument("--repeats", type=int, default=5, help="timed passes; the best is kept (default 5)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"thdpack {thdpack.__version__}, torch {torch.__version__}, numpy {np.__version__}, "
          f"python {platform.python_version()}, {platform.machine()}; {args.source} build, targets {args.targets}, "
          f"best of {args.repeats}\n")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for cp in args.cp:
            out = Path(tmp) / f"cp{cp}"
            if args.source == "vlm":
                ds = VlmRows(cp, args.num_samples // 20, args.pack_size)
            else:
                build(out, args.source, cp, args.num_samples, args.targets, args.pack_size)
                ds = load_packed(out)
            results.append(measure(ds, f"cp {cp}, whole pack", args.repeats))
            if cp > 1:
                results.append(measure(ds, f"cp {cp}, rank 0 shard", args.repeats, cp_rank=0))
    print(f"{'case':<22} {'packs':>6} {'tokens/pack':>12} {'collator b/s':>13} {'split+rejoin b/s':>17} {'ratio':>6}")
    for r in results:
        print(f"{r['case']:<22} {r['packs']:>6} {r['tokens_per_pack']:>12.0f} {r['collator batches/s']:>13.0f} "
              f"{r['split+rejoin batches/s']:>17.0f} {r['collator batches/s'] / r['split+rejoin batches/s']:>5.2f}x")
    differ = [f"{r['case']}: {', '.join(r['differ'])}" for r in results if r["differ"]]
    print("\nthe routes' batches differ: " + "; ".join(differ) if differ else "\nsame output on every row")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
