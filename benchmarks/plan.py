"""Benchmark: global best-fit-decreasing pack planning, thdpack vs TRL.

    python benchmarks/plan.py            # N = 1,000,000 lengths
    python benchmarks/plan.py --quick    # N = 100,000
    python benchmarks/plan.py --json out.json

Compares ``thdpack.plan_packs(lengths, 4096, algorithm="bfd")`` with
``trl.pack_dataset(ds, seq_length=4096, strategy="bfd")`` run as one global map
batch (``map_kwargs={"batch_size": len(ds)}``, so TRL packs the whole dataset at
once rather than in windows of 1000 rows) over the same lengths.

Lengths: ``numpy.random.default_rng(seed).lognormal(6, 1, N)`` clipped to
[1, 4096], as int. TRL needs real token lists, so its dataset gets an
``input_ids`` column of zeros with those lengths, built at the Arrow level
(one values buffer + offsets); building it is timed but reported separately.

Only the packing call is timed. thdpack is timed warm (numba compiled: a
warm-up call first, then the best of ``--repeats``); its cold first call is
measured in fresh subprocesses, once with an empty numba cache (compile) and
once with the on-disk cache as found. TRL runs in a child process with a time
limit; if it runs past ``--trl-timeout`` or fails (e.g. out of memory), N is
halved until it works and both results are reported.

Memory: peak RSS growth during the timed call (Linux ``VmHWM``, reset through
``/proc/self/clear_refs``; psutil sampling elsewhere) and, for thdpack, the
peak of traced Python/numpy allocations (``tracemalloc``; numba's own buffers
inside the kernel are not traced, the RSS figure includes them).

No timed assertions: the script measures and prints. It exits non-zero only if
a plan is invalid (a pack over 4096 tokens, samples lost or duplicated).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from contextlib import contextmanager

import numpy as np

MiB = 1024 * 1024


# ---------------------------------------------------------------- inputs ----
def make_lengths(n: int, seed: int, pack_size: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=6.0, sigma=1.0, size=n), 1, pack_size).astype(np.int64)


def arrow_dtype(token_dtype: str):
    import pyarrow as pa

    return {"uint8": pa.uint8(), "int8": pa.int8(), "int32": pa.int32(), "int64": pa.int64()}[token_dtype]


def build_dataset(lengths: np.ndarray, token_dtype: str):
    """A ``datasets.Dataset`` with an ``input_ids`` column of zero tokens, one row per length.

    Built as one Arrow values buffer plus offsets: no Python lists, one
    allocation of ``sum(lengths)`` elements of ``token_dtype``.
    """
    import datasets
    import pyarrow as pa

    total = int(lengths.sum())
    tokens = np.empty(total, dtype=np.dtype(token_dtype))
    tokens.fill(0)  # touch every page (np.zeros would leave them unmapped until read)
    values = pa.array(tokens, type=arrow_dtype(token_dtype))  # zero-copy
    large = total >= 2**31
    offsets = np.zeros(lengths.size + 1, dtype=np.int64 if large else np.int32)
    np.cumsum(lengths, out=offsets[1:])
    array_cls = pa.LargeListArray if large else pa.ListArray
    column = array_cls.from_arrays(pa.array(offsets), values)
    table = pa.Table.from_arrays([column], names=["input_ids"])
    # an explicit fingerprint: otherwise datasets fingerprints an in-memory table by
    # pickling all of it (seconds and GBs at 660M tokens); map() still derives its
    # own fingerprint from this one and the transform, as usual
    fingerprint = f"thdpack-bench-{lengths.size}-{total}-{token_dtype}"
    return datasets.Dataset(datasets.table.InMemoryTable(table), fingerprint=fingerprint)


# ---------------------------------------------------------------- memory ----
def _read_status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _can_reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return "VmHWM" in _read_status()
    except OSError:
        return False


def _malloc_trim() -> None:
    """Return freed heap memory to the OS (glibc), so the RSS baseline is not
    padded by memory an earlier call freed but the allocator kept."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@contextmanager
def peak_rss():
    """Yields a dict; on exit it holds ``baseline`` and ``peak_delta`` (bytes) of RSS."""
    result: dict = {}
    import gc

    gc.collect()
    _malloc_trim()
    if _can_reset_hwm():
        base = _read_status()["VmRSS"]
        result["method"] = "VmHWM"
        try:
            yield result
        finally:
            result["baseline"] = base
            result["peak_delta"] = max(0, _read_status()["VmHWM"] - base)
        return
    import psutil  # fallback: poll RSS from a thread

    proc = psutil.Process()
    base = proc.memory_info().rss
    peak = [base]
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            stop.wait(0.001)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    result["method"] = "psutil-poll"
    try:
        yield result
    finally:
        stop.set()
        t.join()
        peak[0] = max(peak[0], proc.memory_info().rss)
        result["baseline"] = base
        result["peak_delta"] = peak[0] - base


# --------------------------------------------------------------- thdpack ----
def check_thdpack_plan(plan, lengths: np.ndarray, pack_size: int) -> None:
    fills = np.add.reduceat(lengths[plan.sample_index], plan.pack_offsets[:-1])
    assert fills.max() <= pack_size, "thdpack: a pack exceeds pack_size"
    assert np.array_equal(np.sort(plan.sample_index), np.arange(lengths.size)), "thdpack: samples lost or repeated"


def bench_thdpack(lengths: np.ndarray, pack_size: int, repeats: int) -> dict:
    import thdpack

    t0 = time.perf_counter()
    plan = thdpack.plan_packs(lengths, pack_size, algorithm="bfd")
    first_call = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = thdpack.plan_packs(lengths, pack_size, algorithm="bfd")
        times.append(time.perf_counter() - t0)
    check_thdpack_plan(plan, lengths, pack_size)

    with peak_rss() as mem:
        thdpack.plan_packs(lengths, pack_size, algorithm="bfd")
    tracemalloc.start()
    thdpack.plan_packs(lengths, pack_size, algorithm="bfd")
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "seconds": min(times),
        "seconds_median": float(np.median(times)),
        "first_call_in_process_seconds": first_call,
        "num_packs": len(plan),
        "efficiency": plan.stats.efficiency,
        "rss_peak_delta_bytes": mem["peak_delta"],
        "rss_method": mem["method"],
        "tracemalloc_peak_bytes": traced_peak,
    }


_COLD_SNIPPET = """
import sys, time
t0 = time.perf_counter()
import numpy as np
import thdpack
t1 = time.perf_counter()
n, seed, pack_size = map(int, sys.argv[1:4])
lengths = np.clip(np.random.default_rng(seed).lognormal(6.0, 1.0, n), 1, pack_size).astype(np.int64)
t2 = time.perf_counter()
plan = thdpack.plan_packs(lengths, pack_size, algorithm="bfd")
t3 = time.perf_counter()
print(f"{t1 - t0:.6f} {t3 - t2:.6f} {len(plan)}")
"""


def thdpack_cold(n: int, seed: int, pack_size: int, fresh_cache: bool) -> dict:
    """First ``plan_packs`` call in a fresh interpreter (``fresh_cache``: empty numba cache dir)."""
    env = dict(os.environ)
    tmp = None
    if fresh_cache:
        tmp = tempfile.mkdtemp(prefix="thdpack-numba-cache-")
        env["NUMBA_CACHE_DIR"] = tmp
    try:
        out = subprocess.run(
            [sys.executable, "-c", _COLD_SNIPPET, str(n), str(seed), str(pack_size)],
            env=env, capture_output=True, text=True, check=True,
        ).stdout.split()
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return {"import_seconds": float(out[0]), "first_call_seconds": float(out[1]), "num_packs": int(out[2])}


# ------------------------------------------------------------------- TRL ----
def _trl_child(conn, n: int, seed: int, pack_size: int, token_dtype: str) -> None:
    try:
        import datasets
        import pyarrow.compute as pc
        import trl

        datasets.disable_progress_bars()
        lengths = make_lengths(n, seed, pack_size)
        # warm-up on a small dataset: the first pack_dataset call in a process pays
        # lazy imports (datasets fingerprinting pulls in transformers/torch/sympy)
        # and Arrow kernel set-up, seconds that have nothing to do with N
        small = build_dataset(lengths[:1000], token_dtype)
        t0 = time.perf_counter()
        trl.pack_dataset(small, seq_length=pack_size, strategy="bfd", map_kwargs={"batch_size": len(small)})
        warmup_seconds = time.perf_counter() - t0
        del small

        with peak_rss() as build_mem:
            t0 = time.perf_counter()
            ds = build_dataset(lengths, token_dtype)
            build_seconds = time.perf_counter() - t0

        with peak_rss() as mem:
            t0 = time.perf_counter()
            packed = trl.pack_dataset(ds, seq_length=pack_size, strategy="bfd", map_kwargs={"batch_size": len(ds)})
            seconds = time.perf_counter() - t0

        table = packed.data.table
        pack_lens = pc.list_value_length(table["input_ids"]).to_numpy()
        seq_lengths = table["seq_lengths"].combine_chunks()
        flat = seq_lengths.flatten().to_numpy()
        per_pack = np.add.reduceat(flat, seq_lengths.offsets.to_numpy()[:-1]) if len(flat) else np.zeros(0)
        ok = bool(
            pack_lens.max() <= pack_size
            and pack_lens.sum() == lengths.sum()
            and flat.size == n
            and np.array_equal(per_pack, pack_lens)
        )
        conn.send({
            "n": n,
            "seconds": seconds,
            "num_packs": len(packed),
            "valid": ok,
            "warmup_first_call_seconds_1000_rows": warmup_seconds,
            "dataset_build_seconds": build_seconds,
            "dataset_build_rss_bytes": build_mem["peak_delta"],
            "rss_peak_delta_bytes": mem["peak_delta"],
            "rss_method": mem["method"],
            "token_dtype": token_dtype,
            "trl_version": trl.__version__,
            "datasets_version": datasets.__version__,
        })
    except BaseException as exc:  # noqa: BLE001 - report anything to the parent
        conn.send({"n": n, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        conn.close()


def bench_trl(n: int, seed: int, pack_size: int, token_dtype: str, timeout: float) -> dict:
    """TRL in a spawned child process, killed after ``timeout`` seconds."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_trl_child, args=(child, n, seed, pack_size, token_dtype))
    t0 = time.perf_counter()
    proc.start()
    child.close()
    result = None
    if parent.poll(timeout):
        try:
            result = parent.recv()
        except EOFError:
            result = None
    proc.join(timeout=5 if result is not None else 0)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if result is None:
        why = f"timed out after {timeout:.0f}s" if time.perf_counter() - t0 >= timeout else f"child exited with code {proc.exitcode} (killed, likely out of memory)"
        result = {"n": n, "error": why}
    return result


# ------------------------------------------------------------------ main ----
def fmt_bytes(b) -> str:
    return "-" if b is None else f"{b / MiB:,.0f} MiB"


def run_size(n: int, args) -> dict:
    lengths = make_lengths(n, args.seed, args.pack_size)
    total = int(lengths.sum())
    thd = bench_thdpack(lengths, args.pack_size, args.repeats)
    return {
        "n": n,
        "total_tokens": total,
        "mean_length": total / n,
        "lower_bound": math.ceil(total / args.pack_size),
        "thdpack": thd,
    }


def print_report(res: dict, pack_size: int) -> None:
    thd, trl = res["thdpack"], res.get("trl")
    print(f"\nN = {res['n']:,} samples, {res['total_tokens']:,} tokens (mean {res['mean_length']:.1f}), "
          f"pack_size = {pack_size}, lower bound ceil(sum/{pack_size}) = {res['lower_bound']:,} packs")
    rows = [("", "thdpack", "TRL", "TRL / thdpack")]
    if trl is None or "error" in trl:
        print(f"TRL: {'not run' if trl is None else trl['error']}")
        trl = None
    ratio = lambda a, b: f"{a / b:,.1f}x" if (a is not None and b) else "-"  # noqa: E731
    t_s = trl["seconds"] if trl else None
    rows.append(("packing time (s)", f"{thd['seconds']:.4f}", f"{t_s:.2f}" if trl else "-", ratio(t_s, thd["seconds"])))
    rows.append(("  thdpack median (s)", f"{thd['seconds_median']:.4f}", "", ""))
    rows.append(("packs", f"{thd['num_packs']:,}", f"{trl['num_packs']:,}" if trl else "-",
                 f"{trl['num_packs'] / thd['num_packs']:.5f}" if trl else "-"))
    rows.append(("packs over lower bound", f"{thd['num_packs'] - res['lower_bound']:,}",
                 f"{trl['num_packs'] - res['lower_bound']:,}" if trl else "-", ""))
    rows.append(("peak RSS growth", fmt_bytes(thd["rss_peak_delta_bytes"]),
                 fmt_bytes(trl["rss_peak_delta_bytes"]) if trl else "-",
                 ratio(trl["rss_peak_delta_bytes"], thd["rss_peak_delta_bytes"]) if trl else "-"))
    rows.append(("peak traced (tracemalloc)", fmt_bytes(thd["tracemalloc_peak_bytes"]), "n/a", ""))
    if trl:
        rows.append(("dataset build (excluded)", "", f"{trl['dataset_build_seconds']:.2f} s, "
                     f"{fmt_bytes(trl['dataset_build_rss_bytes'])}", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    if trl:
        print(f"TRL warm-up (first pack_dataset call in its process, 1,000 rows, excluded): "
              f"{trl['warmup_first_call_seconds_1000_rows']:.2f} s")
        print(f"checks: TRL output valid = {trl['valid']}; TRL packs = {trl['num_packs']:,}; "
              f"thdpack packs <= TRL packs: {thd['num_packs'] <= trl['num_packs']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1_000_000, help="number of sample lengths (default 1,000,000)")
    p.add_argument("--quick", action="store_true", help="N = 100,000")
    p.add_argument("--pack-size", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5, help="warm thdpack timings (best is reported)")
    p.add_argument("--token-dtype", default="uint8", choices=["uint8", "int8", "int32", "int64"],
                   help="dtype of the zero tokens in TRL's input_ids column (default uint8: smallest)")
    p.add_argument("--trl-timeout", type=float, default=900.0, help="seconds before TRL is abandoned at a size")
    p.add_argument("--min-n", type=int, default=10_000, help="smallest N tried when falling back")
    p.add_argument("--no-trl", action="store_true")
    p.add_argument("--no-cold", action="store_true", help="skip the fresh-interpreter cold-call measurements")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args()
    n = 100_000 if args.quick else args.n

    import numba
    import thdpack

    print(f"python {platform.python_version()}, numpy {np.__version__}, numba {numba.__version__}, "
          f"thdpack {thdpack.__version__}, {os.cpu_count()} CPUs")
    out = {"args": vars(args), "results": []}

    cold = None
    if not args.no_cold:
        cold = {
            "compile": thdpack_cold(n, args.seed, args.pack_size, fresh_cache=True),
            "cached": thdpack_cold(n, args.seed, args.pack_size, fresh_cache=False),
        }
        out["thdpack_cold"] = cold

    res = run_size(n, args)
    out["results"].append(res)
    if not args.no_trl:
        res["trl"] = bench_trl(n, args.seed, args.pack_size, args.token_dtype, args.trl_timeout)
        m = n
        while "error" in out["results"][-1]["trl"] and m // 2 >= args.min_n:
            m //= 2
            print(f"TRL failed at N={out['results'][-1]['n']:,} ({out['results'][-1]['trl']['error']}); retrying N={m:,}",
                  flush=True)
            r = run_size(m, args)
            r["trl"] = bench_trl(m, args.seed, args.pack_size, args.token_dtype, args.trl_timeout)
            out["results"].append(r)

    for r in out["results"]:
        print_report(r, args.pack_size)
    if cold:
        print(f"\nthdpack cold first call at N={n:,} (fresh interpreter, import thdpack "
              f"{cold['cached']['import_seconds']:.2f} s not included): "
              f"{cold['compile']['first_call_seconds']:.2f} s with an empty numba cache (JIT compile), "
              f"{cold['cached']['first_call_seconds']:.3f} s with the on-disk cache; "
              f"first call in this process {out['results'][0]['thdpack']['first_call_in_process_seconds']:.3f} s")
    trl0 = out["results"][0].get("trl") or {}
    if "valid" in trl0:
        print(f"TRL packing: trl {trl0['trl_version']}, datasets {trl0['datasets_version']}, "
              f"map batch_size = N (one global batch), token dtype {trl0['token_dtype']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=float)
        print(f"wrote {args.json}")
    bad = [r for r in out["results"] if "valid" in (r.get("trl") or {}) and not r["trl"]["valid"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
