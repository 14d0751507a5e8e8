"""Benchmark: collating samples into one packed (THD) batch, thdpack vs transformers.

    python benchmarks/collate.py            # 500 batches of 8 samples per input kind
    python benchmarks/collate.py --quick    # 100 batches
    python benchmarks/collate.py --profile  # plus a cProfile of thdpack per input kind
    python benchmarks/collate.py --json out.json

Compares ``thdpack.ThdCollator()`` with
``transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` on the
same sample objects, 8 samples per batch. Sample lengths come from
``lognormal(6, 1)`` clipped to [1, 4096] (seed ``--seed``); token ids are random
in ``[0, vocab)``; ``labels`` are the ids with a random prompt prefix set to -100.

Input kinds (both collators get the very same objects):
  list    ``{"input_ids": list[int], "labels": list[int]}``: a ``datasets.Dataset``
          in its default (python) format, or any tokenizer output.
  numpy   ``int64`` numpy arrays: a ``datasets.Dataset`` with ``.with_format("numpy")``.
  arrow   ``pyarrow.Int64Array`` per field: the row's slice of a ``pa.Table``
          ``list<int64>`` column (``table["input_ids"][i].values``, zero-copy).
          ``DataCollatorWithFlattening`` reads them through ``.tolist()``.
  arrow-scalar (thdpack only) the ``pa.ListScalar`` itself (``table["input_ids"][i]``);
          it has no ``.tolist()``, which ``DataCollatorWithFlattening`` needs.

For the list kind the table also shows a plain conversion, the least a collator of lists
does: each field's lists (``input_ids``, ``labels``) joined and read by numpy as one int64
array (``np.asarray(list(chain(...)))``), nothing else: no positions, no offsets, no checks.

Throughput is real tokens per second over ``--batches`` batches after
``--warmup`` batches, best of ``--repeats`` passes (collators interleaved). A
sanity check compares input_ids, position_ids, cu_seqlens, max_seqlen and the
(HF-convention) labels of both outputs on the first batch of each kind.

No timed assertions: the script measures and prints (targets are shown for
reference). It exits non-zero only if the outputs disagree.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import itertools
import json
import os
import platform
import pstats
import sys
import time

import numpy as np

TARGETS = {"list": 5.0, "numpy": 20.0, "arrow": 20.0}
PLAIN_TARGET = 1.3  # thdpack at least this many times the plain conversion (list kind)


def make_token_data(n: int, seed: int, vocab: int, max_len: int):
    """Flat ``ids`` / ``labels`` (int64) and ``offsets`` of ``n`` samples."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=6.0, sigma=1.0, size=n), 1, max_len).astype(np.int64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = rng.integers(0, vocab, size=int(offsets[-1]), dtype=np.int64)
    labels = ids.copy()
    prompt = (rng.random(n) * 0.5 * lengths).astype(np.int64)  # up to half of each sample is prompt
    mask = np.arange(ids.size) - np.repeat(offsets[:-1], lengths) < np.repeat(prompt, lengths)
    labels[mask] = -100
    return ids, labels, offsets


def make_samples(kind: str, ids: np.ndarray, labels: np.ndarray, offsets: np.ndarray) -> list:
    n = offsets.size - 1
    bounds = list(zip(offsets[:-1].tolist(), offsets[1:].tolist()))
    if kind == "list":
        return [{"input_ids": ids[a:b].tolist(), "labels": labels[a:b].tolist()} for a, b in bounds]
    if kind == "numpy":  # separate arrays, as datasets' numpy format returns
        return [{"input_ids": ids[a:b].copy(), "labels": labels[a:b].copy()} for a, b in bounds]
    import pyarrow as pa

    off = pa.array(offsets.astype(np.int32))
    table = pa.table({
        "input_ids": pa.ListArray.from_arrays(off, pa.array(ids)),
        "labels": pa.ListArray.from_arrays(off, pa.array(labels)),
    })
    col_ids = table.column("input_ids").chunk(0)
    col_lab = table.column("labels").chunk(0)
    if kind == "arrow":
        return [{"input_ids": col_ids[i].values, "labels": col_lab[i].values} for i in range(n)]
    if kind == "arrow-scalar":
        return [{"input_ids": col_ids[i], "labels": col_lab[i]} for i in range(n)]
    raise ValueError(kind)


def batches_of(samples: list, batch_size: int) -> list[list]:
    return [samples[i : i + batch_size] for i in range(0, len(samples) - batch_size + 1, batch_size)]


def plain_conversion(batch: list) -> list:
    """The reference for lists: each field's lists joined, read by numpy (int64 ``[T]``)."""
    return [np.asarray(list(itertools.chain.from_iterable(s[f] for s in batch))) for f in ("input_ids", "labels")]


def time_pass(collate, batches) -> float:
    gc.collect()
    t0 = time.perf_counter()
    for b in batches:
        collate(b)
    return time.perf_counter() - t0


def check_same(thd_out, hf_out) -> list[str]:
    import torch

    from thdpack.integrations.hf_kwargs import hf_labels

    problems = []
    pairs = {
        "input_ids": (thd_out.input_ids, hf_out["input_ids"][0]),
        "position_ids": (thd_out.position_ids, hf_out["position_ids"][0]),
        "cu_seqlens": (thd_out.cu_seqlens.to(torch.int64), torch.as_tensor(hf_out["cu_seq_lens_q"]).to(torch.int64)),
        "labels (HF convention)": (hf_labels(thd_out), hf_out["labels"][0]),
    }
    for name, (a, b) in pairs.items():
        if a.shape != b.shape or not torch.equal(a.to(torch.int64), b.to(torch.int64)):
            problems.append(name)
    if int(thd_out.max_seqlen) != int(hf_out["max_length_q"]):
        problems.append("max_seqlen")
    return problems


def profile_thdpack(collate, batches, top: int) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for b in batches:
        collate(b)
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    lines = buf.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return "\n".join(lines[max(0, start - 3) :])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=500, help="timed batches per pass (default 500)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--warmup", type=int, default=20, help="untimed batches before timing")
    p.add_argument("--repeats", type=int, default=5, help="timed passes; the best is reported")
    p.add_argument("--quick", action="store_true", help="100 batches, 2 passes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--kinds", default="list,numpy,arrow,arrow-scalar")
    p.add_argument("--profile", action="store_true", help="cProfile thdpack per input kind")
    p.add_argument("--profile-top", type=int, default=12)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args()
    if args.quick:
        args.batches, args.repeats = 100, 2

    import torch
    import transformers
    from transformers import DataCollatorWithFlattening

    import thdpack

    print(f"python {platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, thdpack {thdpack.__version__}, {os.cpu_count()} CPUs")
    bs = args.batch_size
    n = (args.batches + args.warmup) * bs
    ids, labels, offsets = make_token_data(n, args.seed, args.vocab, args.max_len)
    lengths = np.diff(offsets)
    warm_tokens = int(offsets[args.warmup * bs])
    timed_tokens = int(offsets[-1]) - warm_tokens
    print(f"{args.batches} timed batches of {bs} samples after {args.warmup} warm-up batches; "
          f"{timed_tokens:,} timed tokens (mean sample {lengths.mean():.0f}, mean batch "
          f"{timed_tokens / args.batches:,.0f} tokens); best of {args.repeats} passes")

    thd = thdpack.ThdCollator()
    hf = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    results, profiles, mismatches = {}, {}, []
    for kind in kinds:
        samples = make_samples(kind, ids, labels, offsets)
        all_batches = batches_of(samples, bs)
        warm, timed = all_batches[: args.warmup], all_batches[args.warmup :]
        run_hf = kind != "arrow-scalar"
        check = "n/a"
        if run_hf:
            problems = check_same(thd(timed[0]), hf(timed[0]))
            check = "OK" if not problems else "MISMATCH: " + ", ".join(problems)
            if problems:
                mismatches.append(kind)
        run_plain = kind == "list"
        for b in warm:
            thd(b)
            if run_hf:
                hf(b)
            if run_plain:
                plain_conversion(b)
        t_thd, t_hf, t_plain = [], [], []
        for _ in range(args.repeats):
            t_thd.append(time_pass(thd, timed))
            if run_hf:
                t_hf.append(time_pass(hf, timed))
            if run_plain:
                t_plain.append(time_pass(plain_conversion, timed))
        r = {
            "thdpack_tokens_per_s": timed_tokens / min(t_thd),
            "thdpack_batches_per_s": len(timed) / min(t_thd),
            "check": check,
        }
        if run_hf:
            r["hf_tokens_per_s"] = timed_tokens / min(t_hf)
            r["hf_batches_per_s"] = len(timed) / min(t_hf)
            r["ratio"] = min(t_hf) / min(t_thd)
        if run_plain:
            r["plain_tokens_per_s"] = timed_tokens / min(t_plain)
            r["plain_ratio"] = min(t_plain) / min(t_thd)
        results[kind] = r
        if args.profile:
            profiles[kind] = profile_thdpack(thd, timed, args.profile_top)
        del samples, all_batches, warm, timed

    rows = [("input", "thdpack tok/s", "HF tok/s", "thdpack/HF", "target", "met", "plain tok/s", "thdpack/plain",
             "target", "met", "thdpack batch/s", "same output")]
    for kind, r in results.items():
        target = TARGETS.get(kind)
        plain = "plain_ratio" in r
        rows.append((
            kind,
            f"{r['thdpack_tokens_per_s'] / 1e6:,.1f} M",
            f"{r['hf_tokens_per_s'] / 1e6:,.1f} M" if "ratio" in r else "n/a",
            f"{r['ratio']:.1f}x" if "ratio" in r else "-",
            f">= {target:g}x" if target else "-",
            ("yes" if r["ratio"] >= target else "NO") if target and "ratio" in r else "-",
            f"{r['plain_tokens_per_s'] / 1e6:,.1f} M" if plain else "n/a",
            f"{r['plain_ratio']:.2f}x" if plain else "-",
            f">= {PLAIN_TARGET:g}x" if plain else "-",
            ("yes" if r["plain_ratio"] >= PLAIN_TARGET else "NO") if plain else "-",
            f"{r['thdpack_batches_per_s']:,.0f}",
            r["check"],
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print()
    for i, row in enumerate(rows):
        print("  ".join(c.ljust(w) if j in (0, len(row) - 1) else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    for kind, text in profiles.items():
        print(f"\ncProfile of thdpack.ThdCollator, input kind {kind!r}, {args.batches} batches:")
        print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "timed_tokens": timed_tokens, "results": results}, f, indent=2)
        print(f"wrote {args.json}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
