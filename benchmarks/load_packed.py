"""Benchmark: loading stored packs, rows of ``load_packed`` to ``ThdBatch`` es (batches per second).

    python benchmarks/load_packed.py                       # the demo build (configs/demo.yaml), CP 1 and 2
    python benchmarks/load_packed.py --source tokenized --num-samples 20000 --targets labels
    python benchmarks/load_packed.py --json out.json

Builds the packs into a temporary folder with ``thdpack build`` (``--source demo``: configs/demo.yaml, 4000
chat conversations, a loss mask; ``--source tokenized``: seeded pre-tokenized rows, no tokenizer), once per
``--cp`` size, then times the collator of :meth:`PackedDataset.collator` over every row (one row per call,
``DataLoader(batch_size=None)``; the rows are read first, so only the collator is timed): the whole pack, and
with CP > 1 also rank 0's shard (``collator(cp_rank=0)``). Beside it, the split-and-rejoin route the collator
took before issue 44 (``unpack_row`` then ``ThdCollator``, then ``sample_index`` / ``source_index`` patched in),
as the reference: it must give the same batches (input_ids, labels, loss_mask, positions, offsets, indices).

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
from thdpack.offline import load_packed, unpack_row  # noqa: E402

FIELDS = ("input_ids", "labels", "loss_mask", "position_ids", "cu_seqlens", "cu_seqlens_padded", "seq_lens",
          "sample_index", "source_index", "partition_indices", "local_cu_seqlens_padded", "local_seq_lens")


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
    collator = thdpack.ThdCollator(layout=ds.collator(**overrides).collator.layout)

    def collate(row):
        batch = collator(unpack_row(row))
        batch = dataclasses.replace(batch, sample_index=torch.from_numpy(row["sample_index"].astype(np.int64)))
        if "source_index" in row:
            batch = dataclasses.replace(batch, source_index=torch.from_numpy(row["source_index"].astype(np.int64)))
        return batch

    return collate


def same(a, b) -> list[str]:
    """The fields in which batches ``a`` and ``b`` differ (values or dtypes)."""
    bad = [f for f in FIELDS if (getattr(a, f) is None) != (getattr(b, f) is None) or (
        getattr(a, f) is not None and (getattr(a, f).dtype != getattr(b, f).dtype or not torch.equal(getattr(a, f), getattr(b, f))))]
    return bad + [f for f in ("max_seqlen", "cp_size", "cp_rank", "tokens_truncated", "pad_multiple") if getattr(a, f) != getattr(b, f)]


def time_pass(collate, rows) -> float:
    gc.collect()
    t0 = time.perf_counter()
    for row in rows:
        collate(row)
    return time.perf_counter() - t0


def measure(ds, name: str, repeats: int, **overrides) -> dict:
    """Batches per second of the collator and of the split-and-rejoin route over every row of ``ds``."""
    rows = [ds[k] for k in range(len(ds))]
    routes = {"collator": ds.collator(**overrides), "split+rejoin": split_and_rejoin(ds, **overrides)}
    differ = sorted({f for row in rows for f in same(routes["collator"](row), routes["split+rejoin"](row))})
    best = {r: float("inf") for r in routes}
    for _ in range(repeats):
        for r, collate in routes.items():
            best[r] = min(best[r], time_pass(collate, rows))
    tokens = int(ds.pack_num_tokens().sum())
    return dict(case=name, packs=len(rows), tokens_per_pack=tokens / max(len(rows), 1), differ=differ,
                **{f"{r} batches/s": len(rows) / best[r] for r in routes})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", choices=["demo", "tokenized"], default="demo")
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
