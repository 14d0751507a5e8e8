"""Benchmark: an offline packed-dataset build, ``thdpack build`` vs the equivalent TRL pipeline.

    python benchmarks/build.py                          # 200k chat rows, num_proc = CPU count
    python benchmarks/build.py --kind text chat         # both row kinds
    python benchmarks/build.py --num-samples 20000 --json out.json
    python benchmarks/build.py --profile                # plus where thdpack's time goes
    python benchmarks/build.py --tokenizer DIR --tokenizer-backend hf   # another tokenizer; without tiktoken
    python benchmarks/build.py --kind text --trl-style none --tokenizer-backend hf   # thdpack alone
    python benchmarks/build.py --kind chat --tokenizer QWEN3_DIR --chat-template \
        benchmarks/templates/qwen3_training.jinja --reasoning 0.5 --trl-style sft   # real Qwen3 template
    python benchmarks/build.py --engine local ray --num-proc 2   # + engine: ray (a local Ray instance of 2 CPUs)

The same JSONL file (``--num-samples`` rows of thdpack's seeded demo generator,
``thdpack/demo/synthetic.py``, written to a temporary directory) and the bundled
tokenizer go through

- **thdpack**: ``thdpack build --input data.jsonl --tokenizer DIR --pack-size 4096
  --overflow truncate --num-proc N`` (global best-fit decreasing; Arrow data files of
  int32 ids + a 1-bit loss mask; the tokenizer copy is not saved);
- **trl**: ``datasets.load_dataset("json")`` -> ``Dataset.map`` tokenization with the
  same tokenizer, batched (text: ``tokenizer(text + eos)``; chat:
  ``apply_chat_template(..., return_assistant_tokens_mask=True)``), a ``labels``
  column as TRL's ``SFTTrainer`` builds it (ids, -100 outside the assistant turns)
  -> ``trl.pack_dataset(strategy="bfd", map_kwargs={"num_proc": N})`` (TRL's BFD runs
  per ``map`` batch of 1000 rows, as in ``SFTTrainer``) -> ``save_to_disk``.

``--chat-template FILE`` gives both pipelines the same template: thdpack's
``--chat-template``, and ``tokenizer.chat_template`` for TRL, whose assistant masks
(``SFTTrainer``'s ``assistant_only_loss``: ``return_assistant_tokens_mask=True``) need
``{% generation %}`` markers. ``benchmarks/templates/qwen3_training.jinja`` is Qwen3's own
template with those markers: it renders every conversation exactly as Qwen3's does.
``--reasoning P`` puts a ``<think>...</think>`` block before each assistant answer with
probability P (seeded), as Qwen3 reasoning data has it; the template drops it from the
turns before the last user message.

``--engine local ray`` adds **thdpack-ray**: the same ``thdpack build`` with ``--engine ray
--ray-num-cpus N`` (a local Ray instance of ``num_proc`` CPUs, started and stopped by the build, so its
start-up is in the wall time), with its ratio to the local build. For every thdpack run the driver
process alone (the ``thdpack build`` process, not its workers nor a local Ray instance's processes) is
sampled too: its peak RSS (also per million rows) and CPU seconds. ``--kind tokenized`` builds synthetic
pre-tokenized Parquet rows (no tokenizer, no TRL): cheap rows, to see what grows with their number
(``--num-samples 200000`` and ``2000000``; ``benchmarks/distributed.py --build-json`` takes both).

Both truncate rows longer than the pack and use the same ``num_proc``. Each run is a
fresh subprocess with its own empty Hugging Face datasets cache, so nothing is reused;
wall time includes interpreter start and imports for both. Peak memory is the largest
sum of RSS over the process tree (the run and its ``num_proc`` workers), sampled
every 50 ms with psutil (pages shared by forked workers count once per process),
and the largest single-process RSS in that tree (``ru_maxrss`` of the children). CPU
time (user + system of the whole tree) is printed too: on a shared machine it is less
disturbed by other load than wall time. ``--repeats N`` runs every pipeline N times, interleaved
(each once per round, in rotating order), and reports the median of each; the 1-minute load average
before and after every run is printed beside it (a shared machine's other work shows there).

Packs and efficiency (real tokens / (packs x pack_size)) are read back from each
output. No assertions: the script measures and prints; the target (thdpack at
least 3x faster at equal or better efficiency) is shown for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_SPEEDUP = 3.0
TRL_NAMES = {"batched": "trl", "sft": "trl-sft"}
RAY_TARGET = 1.3  # engine: ray within 1.3x of the local build's wall time on one machine (issue 22)


# ---------------------------------------------------------------------------- the TRL pipeline (child process)


def run_trl(data: str, tokenizer: str, out: str, kind: str, pack_size: int, num_proc: int, batch_size: int,
            style: str, chat_template: str | None = None) -> None:
    import numpy as np
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl import pack_dataset

    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    if chat_template:
        tok.chat_template = Path(chat_template).read_text(encoding="utf-8")
    ds = load_dataset("json", data_files=data, split="train")
    procs = num_proc if num_proc > 1 else None
    if style == "sft":
        ds = _sft_style(ds, tok, kind, procs)
        ds = pack_dataset(ds, pack_size, strategy="bfd", map_kwargs={"num_proc": procs})
        ds.save_to_disk(out)
        return

    if kind == "text":
        eos = tok.eos_token

        def tokenize(batch):
            ids = tok([t if t.endswith(eos) else t + eos for t in batch["text"]])["input_ids"]
            return {"input_ids": ids, "labels": ids}
    else:

        def tokenize(batch):
            enc = tok.apply_chat_template(batch["messages"], tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
            labels = [np.where(np.asarray(m, dtype=bool), ids, -100).tolist()
                      for ids, m in zip(enc["input_ids"], enc["assistant_masks"])]
            return {"input_ids": enc["input_ids"], "labels": labels}

    ds = ds.map(tokenize, batched=True, batch_size=batch_size, num_proc=procs, remove_columns=ds.column_names,
                desc="Tokenizing")
    ds = pack_dataset(ds, pack_size, strategy="bfd", map_kwargs={"num_proc": procs})
    ds.save_to_disk(out)


def _sft_style(ds, tok, kind: str, procs):
    """The steps of ``trl.SFTTrainer._prepare_dataset`` (packing, ``assistant_only_loss`` for
    chat), without a model: per-example maps, as SFTTrainer runs them."""
    eos = tok.eos_token
    if kind == "text":
        def add_eos(example):
            if not example["text"].endswith(eos):
                example["text"] = example["text"] + eos
            return example

        ds = ds.map(add_eos, num_proc=procs, desc="Adding EOS")

        def tokenize_fn(example):
            return {"input_ids": tok(text=example["text"])["input_ids"]}
    else:
        def tokenize_fn(example):
            out = tok.apply_chat_template(example["messages"], tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
            return {"input_ids": out["input_ids"], "assistant_masks": out["assistant_masks"]}

    ds = ds.map(tokenize_fn, num_proc=procs, desc="Tokenizing")
    mask_columns = ["assistant_masks"] if kind == "chat" else []

    def build_labels(example):
        masks = [example[c] for c in mask_columns]
        return {"labels": [t if all(bits) else -100 for t, *bits in zip(example["input_ids"], *masks, strict=False)]}

    ds = ds.map(build_labels, remove_columns=mask_columns, num_proc=procs, desc="Building labels")
    return ds.select_columns(["input_ids", "labels"])


# ---------------------------------------------------------------------------- measuring a child


def measure(cmd: list[str], env: dict) -> dict:
    """Run ``cmd``; wall time, peak tree RSS (psutil sampling) and peak single-process RSS."""
    import psutil

    log = tempfile.TemporaryFile()
    rss_file = tempfile.NamedTemporaryFile(suffix=".rss", delete=False)
    rss_file.close()
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    proc = psutil.Popen([sys.executable, __file__, "--_wrap", rss_file.name, *cmd], env=env, stdout=log,
                        stderr=subprocess.STDOUT)
    peak_tree = peak_driver = 0
    driver, driver_cpu = None, 0.0
    while proc.poll() is None:
        try:
            procs = [proc] + proc.children(recursive=True)
            driver = driver or next(iter(proc.children()), None)  # the command itself: the build's driver
            rss = 0
            for p in procs:
                try:
                    rss += p.memory_info().rss
                except psutil.Error:
                    pass
            peak_tree = max(peak_tree, rss)
            if driver is not None:  # the driver process alone (not its workers, not a local Ray's processes)
                peak_driver = max(peak_driver, driver.memory_info().rss)
                times = driver.cpu_times()
                driver_cpu = times.user + times.system
        except psutil.Error:
            pass
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    log.seek(0)
    output = log.read().decode(errors="replace")
    log.close()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-4000:]}")
    usage = json.loads(Path(rss_file.name).read_text())
    os.unlink(rss_file.name)
    return {"wall_s": wall, "cpu_s": usage["cpu_s"], "peak_tree_rss_mb": peak_tree / 2**20,
            "peak_proc_rss_mb": usage["maxrss_kb"] / 1024, "driver_peak_rss_mb": peak_driver / 2**20,
            "driver_cpu_s": driver_cpu, "load_avg_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
            "output": output}


def wrap(usage_file: str, cmd: list[str]) -> int:
    """Run ``cmd``; write the largest RSS (kB) of any process of its tree (``ru_maxrss``) and
    the CPU seconds (user + system) of the whole tree."""
    rc = subprocess.call(cmd)
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    Path(usage_file).write_text(json.dumps({"maxrss_kb": ru.ru_maxrss, "cpu_s": ru.ru_utime + ru.ru_stime}))
    return rc


def thdpack_result(out: Path, pack_size: int) -> dict:
    meta = json.loads((out / "metadata.json").read_text())
    tokens = meta["counts"]["tokens"]
    return {"packs": meta["num_packs"], "tokens": tokens, "efficiency": tokens / (meta["num_packs"] * pack_size),
            "disk_mb": sum(f["num_bytes"] for f in meta["files"]) / 1e6}


def trl_result(out: Path, pack_size: int) -> dict:
    import pyarrow.compute as pc
    from datasets import load_from_disk

    ds = load_from_disk(str(out))
    tokens = int(pc.sum(pc.list_value_length(ds.data.table.column("input_ids"))).as_py())
    disk = sum(p.stat().st_size for p in out.glob("*.arrow"))
    return {"packs": len(ds), "tokens": tokens, "efficiency": tokens / (len(ds) * pack_size), "disk_mb": disk / 1e6}


def stage_lines(output: str) -> list[str]:
    return [line for line in output.splitlines()
            if line.startswith(("read ", "tokenized ", "planned ", "wrote ", "ray: "))]


def driver_peak_mb(output: str) -> float | None:
    """The ``ray: driver peak memory N MB`` of an ``engine: ray`` build's log, or None."""
    for line in output.splitlines():
        if line.startswith("ray: driver peak memory "):
            return float(line.split()[4])
    return None


# ---------------------------------------------------------------------------- main


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--_wrap":
        return wrap(sys.argv[2], sys.argv[3:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-samples", type=int, default=200_000)
    p.add_argument("--kind", nargs="+", choices=["text", "chat", "tokenized"], default=["chat"],
                   help="tokenized: synthetic pre-tokenized Parquet rows (thdpack only: what scales with the rows)")
    p.add_argument("--pack-size", type=int, default=4096)
    p.add_argument("--num-proc", type=int, default=os.cpu_count() or 1, help="same for both pipelines")
    p.add_argument("--map-batch-size", type=int, default=1000, help="rows per tokenization batch, both pipelines")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", help="a local tokenizer directory for both pipelines (default: the bundled one); "
                   "chat rows need a template with {%% generation %%} markers for TRL's assistant masks")
    p.add_argument("--chat-template", metavar="FILE", help="chat rows: this Jinja template for both pipelines "
                   "(thdpack --chat-template, tokenizer.chat_template for TRL); TRL needs {%% generation %%} markers")
    p.add_argument("--reasoning", type=float, default=0.0, metavar="P", help="chat rows: a <think> reasoning "
                   "block before each assistant answer with probability P (default 0: the demo rows as they are)")
    p.add_argument("--tokenizer-backend", choices=["auto", "tiktoken", "hf"], default="auto",
                   help="thdpack's encoder (hf: the tokenizer itself, to see what tiktoken adds)")
    p.add_argument("--trl-style", nargs="+", choices=["batched", "sft", "none"], default=["batched", "sft"],
                   help="batched: one batched datasets.map tokenization (the fastest TRL pipeline); sft: the "
                   "per-example maps of trl.SFTTrainer (add EOS, tokenize, build labels); none: thdpack alone "
                   "(e.g. to compare --tokenizer-backend values without TRL installed)")
    p.add_argument("--engine", nargs="+", choices=["local", "ray"], default=["local"],
                   help="thdpack's engines to run (ray: a local Ray instance of --num-proc CPUs)")
    p.add_argument("--repeats", type=int, default=1, help="runs of every pipeline, interleaved (every pipeline once "
                   "per round, the order rotating); the table shows the median of each (all runs are in --json)")
    p.add_argument("--workdir", help="keep the data and outputs here (default: a temporary directory, removed)")
    p.add_argument("--profile", action="store_true", help="also profile thdpack build (single process) on the data")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--_trl", nargs=6, metavar=("DATA", "TOKENIZER", "OUT", "KIND", "PACK", "STYLE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._trl:
        data, tok, out, kind, pack, style = args._trl
        run_trl(data, tok, out, kind, int(pack), args.num_proc, args.map_batch_size, style, args.chat_template)
        return 0
    if args.chat_template:
        args.chat_template = str(Path(args.chat_template).resolve())

    from thdpack.demo import TOKENIZER_DIR

    tokenizer = str(Path(args.tokenizer).resolve()) if args.tokenizer else str(TOKENIZER_DIR)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="thdpack-bench-build-"))
    work.mkdir(parents=True, exist_ok=True)
    results = {"num_samples": args.num_samples, "pack_size": args.pack_size, "num_proc": args.num_proc,
               "tokenizer": tokenizer, "tokenizer_backend": args.tokenizer_backend,
               "chat_template": args.chat_template, "reasoning": args.reasoning,
               "map_batch_size": args.map_batch_size, "seed": args.seed, "cpus": os.cpu_count(),
               "repeats": args.repeats,
               "python": platform.python_version(), "runs": {}}
    try:
        for kind in args.kind:
            reasoning = args.reasoning if kind == "chat" else 0.0
            data = input_file(work, kind, args.num_samples, args.seed, reasoning, args.pack_size)
            env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TQDM_DISABLE="1")
            names = (["thdpack"] + (["thdpack-ray"] if "ray" in args.engine else [])
                     + [TRL_NAMES[s] for s in args.trl_style if s != "none" and kind != "tokenized"])
            if "local" not in args.engine:
                names.remove("thdpack")
            runs: dict[str, list] = {name: [] for name in names}
            for r in range(args.repeats):  # interleaved: every pipeline once per round, the order rotating
                for name in names[r % len(names):] + names[: r % len(names)]:
                    runs[name].append(run_one(name, kind, data, tokenizer, work, env, args))
            row = {name: median_run(rs) for name, rs in runs.items()}
            compare(row, names)
            if args.profile:
                row["profile"] = profile_thdpack(data, args.pack_size, work, tokenizer, args.tokenizer_backend,
                                                 args.chat_template)
            results["runs"][kind] = row
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def input_file(work: Path, kind: str, n: int, seed: int, reasoning: float, pack_size: int) -> Path:
    """The input of ``kind`` (generated once into ``work``): chat / text JSON Lines of the demo generator,
    or ``tokenized``: Parquet rows of ``input_ids`` and ``loss_mask`` (lognormal lengths, median 32 tokens),
    cheap to make and to tokenize, to measure what scales with the number of rows."""
    from thdpack.demo import generate_rows, write_jsonl

    if kind == "tokenized":
        data = work / f"tokenized-{n}-{seed}.parquet"
        if not data.exists():
            write_tokenized(data, n, seed, pack_size)
        return data
    data = work / f"{kind}-{n}-{seed}-r{reasoning:g}.jsonl"
    if not data.exists():
        t0 = time.perf_counter()
        rows = generate_rows(n, seed=seed, kind=kind)
        write_jsonl(add_reasoning(rows, reasoning, seed) if reasoning else rows, data)
        print(f"generated {data} ({data.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.0f}s",
              file=sys.stderr)
    return data


def write_tokenized(path: Path, n: int, seed: int, pack_size: int, group: int = 100_000) -> None:
    """``n`` seeded pre-tokenized rows as Parquet, one row group per ``group`` rows."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.bool_()))])
    with pq.ParquetWriter(str(path), schema) as writer:
        for a in range(0, n, group):
            lengths = np.clip(rng.lognormal(np.log(32), 0.6, min(group, n - a)), 2, pack_size).astype(np.int64)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            ids = rng.integers(0, 3000, int(offsets[-1]), dtype=np.int32)
            mask = rng.random(int(offsets[-1])) < 0.6
            writer.write_table(pa.table({"input_ids": pa.ListArray.from_arrays(offsets, ids),
                                         "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(mask))}, schema))
    print(f"generated {path} ({path.stat().st_size / 1e6:.0f} MB, {n:,} rows)", file=sys.stderr)


def run_one(name: str, kind: str, data: Path, tokenizer: str, work: Path, env: dict, args) -> dict:
    """One run of pipeline ``name`` on ``data``: :func:`measure`'s result and the output's packs."""
    out = work / f"out-{name}-{kind}"
    shutil.rmtree(out, ignore_errors=True)
    cache = Path(tempfile.mkdtemp(prefix="hf-cache-", dir=work))
    run_env = dict(env, HF_DATASETS_CACHE=str(cache))
    if name.startswith("thdpack"):
        cmd = [sys.executable, "-m", "thdpack", "build", "--input", str(data), "--pack-size", str(args.pack_size),
               "--overflow", "truncate", "--num-proc", str(args.num_proc), "--map-batch-size",
               str(args.map_batch_size), "--seed", str(args.seed), "--no-save-tokenizer", "--output", str(out)]
        if kind == "tokenized":
            cmd += ["--format", "tokenized"]
        else:
            cmd += ["--tokenizer", tokenizer, "--tokenizer-backend", args.tokenizer_backend]
        if args.chat_template and kind == "chat":
            cmd += ["--chat-template", args.chat_template]
        if name == "thdpack-ray":
            cmd += ["--engine", "ray", "--ray-num-cpus", str(args.num_proc)]
    else:
        cmd = [sys.executable, __file__, "--num-proc", str(args.num_proc), "--map-batch-size",
               str(args.map_batch_size), *(["--chat-template", args.chat_template] if args.chat_template
                                           else []), "--_trl", str(data), tokenizer, str(out), kind,
               str(args.pack_size), name.split("-")[-1] if "-" in name else "batched"]
    print(f"running {name} on {kind} (load average {os.getloadavg()[0]:.2f}) ...", file=sys.stderr)
    m = measure(cmd, run_env)
    m.update(thdpack_result(out, args.pack_size) if name.startswith("thdpack") else trl_result(out, args.pack_size))
    if name.startswith("thdpack"):
        m["stages"] = stage_lines(m["output"])
        m["driver_maxrss_mb"] = driver_peak_mb(m["output"])  # ray's own line: ru_maxrss of the driver
    m["rows"] = args.num_samples
    m.pop("output")
    shutil.rmtree(cache, ignore_errors=True)
    if not args.workdir:
        shutil.rmtree(out, ignore_errors=True)
    return m


def median_run(runs: list[dict]) -> dict:
    """The run of median wall time (its packs, stages, ...), with the medians of the measures over ``runs``
    and every run's measures under ``runs``."""
    import statistics

    keys = ("wall_s", "cpu_s", "peak_tree_rss_mb", "peak_proc_rss_mb", "driver_peak_rss_mb", "driver_cpu_s")
    row = dict(sorted(runs, key=lambda m: m["wall_s"])[len(runs) // 2])
    row.update({k: statistics.median(m[k] for m in runs) for k in keys})
    row["runs"] = [{k: m[k] for k in (*keys, "load_avg_1m")} for m in runs]
    row["driver_peak_rss_mb_per_million_rows"] = row["driver_peak_rss_mb"] / (row["rows"] / 1e6)
    return row


def compare(row: dict, names: list[str]) -> None:
    """The ratios of ``row``'s pipelines: engine ray to local, TRL to thdpack (medians)."""
    if "thdpack-ray" in row and "thdpack" in row:
        row["thdpack-ray"]["vs_local"] = row["thdpack-ray"]["wall_s"] / row["thdpack"]["wall_s"]
        row["thdpack-ray"]["target_met"] = row["thdpack-ray"]["vs_local"] <= RAY_TARGET
    for name in [n for n in names if n.startswith("trl")]:
        row[name]["speedup"] = row[name]["wall_s"] / row["thdpack"]["wall_s"]
        row[name]["cpu_ratio"] = row[name]["cpu_s"] / row["thdpack"]["cpu_s"]
        row[name]["target_met"] = (row[name]["speedup"] >= TARGET_SPEEDUP
                                   and row["thdpack"]["efficiency"] >= row[name]["efficiency"])


def add_reasoning(rows: list[dict], p: float, seed: int) -> list[dict]:
    """``rows`` (chat) with a ``<think>\\n...\\n</think>\\n\\n`` block of seeded prose (lognormal,
    median 60 words) before each assistant answer with probability ``p``."""
    from thdpack.demo.synthetic import _Writer

    w = _Writer(seed + 1)
    for row in rows:
        for m in row["messages"]:
            if m["role"] == "assistant" and w.rng.random() < p:
                m["content"] = f"<think>\n{w.prose(w.lognormal_words(60, 0.9, 1500))}\n</think>\n\n{m['content']}"
    return rows


def profile_thdpack(data: Path, pack_size: int, work: Path, tokenizer: str, backend: str = "auto",
                    chat_template: str | None = None) -> str:
    """cProfile of a single-process ``build_packed`` on the first 20k rows: the top functions by own time."""
    import cProfile
    import io
    import pstats

    from thdpack.offline import BuildConfig, build_packed

    cfg = BuildConfig(input=str(data), max_rows=20_000, tokenizer=tokenizer, pack_size=pack_size,
                      overflow="truncate", save_tokenizer=False, tokenizer_backend=backend, chat_template=chat_template)
    pr = cProfile.Profile()
    pr.enable()
    res = build_packed(cfg, work / "profiled", overwrite=True, progress=False)
    pr.disable()
    shutil.rmtree(work / "profiled", ignore_errors=True)
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12)
    stages = ", ".join(f"{k} {v:.2f}s" for k, v in res.timings.items())
    text = f"thdpack stages (20k rows, 1 process): {stages}\n" + s.getvalue()
    print(text, file=sys.stderr)
    return text


def print_table(r: dict) -> None:
    print(f"\nthdpack build vs TRL (datasets.map + pack_dataset bfd + save_to_disk): {r['num_samples']:,} rows, "
          f"pack {r['pack_size']}, num_proc {r['num_proc']} on {r['cpus']} CPUs; the median of {r['repeats']} "
          "interleaved run(s) of each")
    head = (f"{'kind':<10}{'pipeline':<12}{'wall s':>8}{'CPU s':>8}{'peak tree RSS MB':>18}{'peak proc RSS MB':>18}"
            f"{'driver RSS MB':>15}{'packs':>9}{'efficiency':>12}{'disk MB':>9}")
    print(head)
    print("-" * len(head))
    for kind, row in r["runs"].items():
        names = [n for n in ("thdpack", "thdpack-ray", "trl", "trl-sft") if n in row]
        for name in names:
            x = row[name]
            print(f"{kind:<10}{name:<12}{x['wall_s']:>8.1f}{x['cpu_s']:>8.1f}{x['peak_tree_rss_mb']:>18.0f}"
                  f"{x['peak_proc_rss_mb']:>18.0f}{x['driver_peak_rss_mb']:>15.0f}{x['packs']:>9,}"
                  f"{x['efficiency']:>12.4f}{x['disk_mb']:>9.0f}")
        for name in names:
            x = row[name]
            walls = ", ".join(f"{m['wall_s']:.1f}" for m in x["runs"])
            loads = ", ".join(f"{a:.1f}->{b:.1f}" for a, b in (m["load_avg_1m"] for m in x["runs"]))
            print(f"{kind:<10}{name:<12}runs {walls} s; load average (1 min) before->after each: {loads}; driver "
                  f"{x['driver_peak_rss_mb_per_million_rows']:.0f} MB per million rows (peak RSS, sampled), "
                  f"{x['driver_cpu_s']:.1f} CPU s")
        if "thdpack-ray" in row and "vs_local" in row["thdpack-ray"]:
            x = row["thdpack-ray"]
            print(f"{kind:<10}{'ratio':<12}{x['vs_local']:>7.2f}x  thdpack-ray / thdpack local wall time (target <= "
                  f"{RAY_TARGET}x: {'met' if x['target_met'] else 'NOT met'})")
        for name in [n for n in names if n.startswith("trl")]:
            x = row[name]
            verdict = "met" if x["target_met"] else "NOT met"
            print(f"{kind:<10}{'ratio':<12}{x['speedup']:>7.2f}x  thdpack vs {name} (CPU time {x['cpu_ratio']:.2f}x; "
                  f"target >= {TARGET_SPEEDUP:.0f}x wall at equal or better efficiency: {verdict})")
            if "thdpack-ray" in row:
                print(f"{kind:<10}{'ratio':<12}{x['wall_s'] / row['thdpack-ray']['wall_s']:>7.2f}x  thdpack-ray vs {name}")
        for engine in ("thdpack", "thdpack-ray"):
            for line in row.get(engine, {}).get("stages", []):
                print(f"          {engine} {line}")


if __name__ == "__main__":
    sys.exit(main())
