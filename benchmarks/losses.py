"""Benchmark: ``thdpack.losses.token_logps`` (chunked over T) against the naive
``log_softmax(logits).gather`` on one pack, time and peak extra memory.

    python benchmarks/losses.py                            # T=32768, V=151936 (needs ~45 GB RAM in float32)
    python benchmarks/losses.py --tokens 4096              # what fits a small CPU machine
    python benchmarks/losses.py --tokens 4096 --backward   # forward + backward
    python benchmarks/losses.py --device cuda --dtype bfloat16

Each case runs in its own subprocess, so that its memory peak is its own:

* ``naive``    ``torch.log_softmax(logits.float(), -1).gather(1, labels)``, masked
* ``chunked``  ``token_logps(logits, batch, chunk_size=--chunk)``

Peak extra memory = the process's peak RSS (``resource.getrusage``, CPU) or
``torch.cuda.max_memory_allocated`` (CUDA) while the case runs, minus what it held once
the logits existed: what the computation itself adds on top of the logits. tracemalloc
does not see torch's allocations. The target: ``chunked`` at least as fast as ``naive``,
and no ``[T, V]`` float32 temporary beyond one chunk (``chunk · V · 4`` bytes, printed
as ``one chunk``). Time: best of ``--repeats`` after a warm-up, over ``--rounds`` alternating subprocess runs. Prints; no assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

import torch

from thdpack import build_thd_batch
from thdpack.losses import DEFAULT_CHUNK, token_logps

CASES = ("naive", "chunked")


def make_batch(tokens: int, vocab: int, seed: int):
    """One pack of ``tokens`` tokens: samples of 512..4096 tokens, a quarter of each a prompt without loss."""
    g = torch.Generator().manual_seed(seed)
    rows, left = [], tokens
    while left:
        n = min(left, int(torch.randint(512, 4097, (1,), generator=g)))
        ids = torch.randint(0, vocab, (n,), generator=g)
        labels = ids.clone()
        labels[: n // 4] = -100
        rows.append({"input_ids": ids, "labels": labels})
        left -= n
    return build_thd_batch(rows)


def naive_logps(logits: torch.Tensor, batch) -> torch.Tensor:
    """The plain way: a full ``[T, V]`` float32 log_softmax, then gather."""
    logp = torch.log_softmax(logits.float(), -1).gather(1, batch.labels.clamp_min(0).to(logits.device)[:, None])
    return torch.where(batch.loss_mask.to(logits.device), logp.squeeze(1), 0.0)


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def run_case(args) -> dict:
    """Time and peak extra memory of one case, in this process."""
    torch.set_num_threads(args.threads or torch.get_num_threads())
    batch = make_batch(args.tokens, args.vocab, args.seed)
    dtype = getattr(torch, args.dtype)
    # made in its dtype on its device: a float32 intermediate would raise the RSS peak before the case runs
    logits = torch.randn(args.tokens, args.vocab, generator=torch.Generator(args.device).manual_seed(args.seed),
                         dtype=dtype, device=args.device).requires_grad_(args.backward)
    fn = naive_logps if args.case == "naive" else lambda x, b: token_logps(x, b, chunk_size=args.chunk)
    cuda = args.device.startswith("cuda")

    def once() -> None:
        out = fn(logits, batch)
        if args.backward:
            out.sum().backward()
            logits.grad = None
        del out
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = current_rss()
    once()  # warm-up; the memory peak is measured on it
    extra = (torch.cuda.max_memory_allocated() if cuda else peak_rss()) - base
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return {"case": args.case, "seconds": min(times), "peak_extra_bytes": max(int(extra), 0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32768, help="tokens in the pack (T)")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary (V); Qwen3's by default")
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="token_logps chunk_size")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--backward", action="store_true", help="time forward + backward")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="subprocess rounds, cases alternating; best kept")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # internal: run one case
    args = p.parse_args()
    if args.case:
        print(json.dumps(run_case(args)))
        return
    results = {}
    for _ in range(args.rounds):  # cases alternate, so that a busy machine slows both alike
        for case in CASES:  # one subprocess each: its own memory peak
            out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--case", case],
                                 check=True, capture_output=True, text=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            best = results.setdefault(case, r)
            best["seconds"] = min(best["seconds"], r["seconds"])
            best["peak_extra_bytes"] = max(best["peak_extra_bytes"], r["peak_extra_bytes"])
    report(args, results)


def report(args, results: dict) -> None:
    gib = 2**30
    one_chunk = args.chunk * args.vocab * 4
    print(f"token_logps vs naive log_softmax+gather: T={args.tokens} V={args.vocab} {args.dtype} on {args.device}"
          f"{' (forward+backward)' if args.backward else ''}, chunk {args.chunk}; {platform.processor() or platform.machine()},"
          f" {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"logits {args.tokens * args.vocab * torch.empty(0, dtype=getattr(torch, args.dtype)).element_size() / gib:.2f} GiB;"
          f" one [T, V] float32 {args.tokens * args.vocab * 4 / gib:.2f} GiB; one chunk {one_chunk / gib:.2f} GiB")
    print(f"{'case':10s} {'seconds':>9s} {'peak extra GiB':>15s}")
    for case, r in results.items():
        print(f"{case:10s} {r['seconds']:9.3f} {r['peak_extra_bytes'] / gib:15.2f}")
    n, c = results["naive"], results["chunked"]
    print(f"speed naive/chunked = {n['seconds'] / c['seconds']:.2f}x (>= 1: chunked at least as fast); "
          f"peak extra chunked/naive = {c['peak_extra_bytes'] / max(n['peak_extra_bytes'], 1):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
