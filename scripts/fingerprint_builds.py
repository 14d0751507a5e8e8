"""SHA-256 of what a set of offline builds writes, to compare two checkouts byte for byte.

    python scripts/fingerprint_builds.py WORKDIR > a.json      # in checkout A
    python scripts/fingerprint_builds.py WORKDIR > b.json      # in checkout B (same WORKDIR inputs)
    diff a.json b.json

Every build runs through the ``thdpack`` command (``python -m thdpack``), so the script works on
any checkout whatever its module layout: the bundled demo (Arrow and Parquet, CP 2), a 2-slice
build + ``merge``, the Megatron-Bridge export and the Bridge output format, ``stats`` (text and
``--json``) and ``inspect``, text and tokenized rows, preference rows, a real Qwen3 chat template
(when its tokenizer files are in the test cache), and a Qwen2-VL build of rows with images and a
video. Inputs are generated into ``WORKDIR/inputs`` (seeded); outputs go to ``WORKDIR/out``.
The work directory's and the checkout's paths are written ``WORKDIR`` / ``REPO`` before hashing, so runs in two directories
compare; ``metadata.json`` is hashed with the keys given by ``--ignore-key`` removed (dotted paths).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def run(*args: str, cwd: Path = REPO) -> str:
    proc = subprocess.run([sys.executable, "-m", "thdpack", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONHASHSEED": "0"})
    if proc.returncode != 0:
        raise SystemExit(f"thdpack {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def _drop(meta: dict, dotted: str) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        meta = meta.get(p, {})
        if not isinstance(meta, dict):
            return
    meta.pop(last, None)


def _hash(data: bytes, workdir: Path) -> str:
    """sha256 (16 hex digits) of ``data`` with the work directory written as ``WORKDIR`` and the checkout
    as ``REPO``, so runs in two directories compare."""
    data = data.replace(str(workdir).encode(), b"WORKDIR").replace(str(REPO).encode(), b"REPO")
    return hashlib.sha256(data).hexdigest()[:16]


def digest(out: Path, ignore: list[str], workdir: Path) -> dict:
    files = {}
    for p in sorted(out.rglob("*")):
        if not p.is_file() or p.name.startswith("."):
            continue
        data = p.read_bytes()
        if p.name == "metadata.json":
            meta = json.loads(data)
            for key in ignore:
                _drop(meta, key)
            data = json.dumps(meta, sort_keys=True).encode()
        files[str(p.relative_to(out))] = _hash(data, workdir)
    return files


def make_inputs(d: Path) -> dict[str, Path]:
    from thdpack.demo import TOKENIZER_DIR, generate_rows

    d.mkdir(parents=True, exist_ok=True)
    paths = {}
    with open(d / "text.jsonl", "w") as f:
        for row in generate_rows(300, seed=1, kind="text"):
            f.write(json.dumps(row) + "\n")
    paths["text"] = d / "text.jsonl"
    rng = np.random.default_rng(2)
    with open(d / "tokenized.jsonl", "w") as f:
        for _ in range(200):
            n = int(rng.integers(1, 700))
            ids = rng.integers(0, 3000, n).tolist()
            f.write(json.dumps({"input_ids": ids, "loss_mask": (rng.random(n) < 0.6).astype(int).tolist()}) + "\n")
    paths["tokenized"] = d / "tokenized.jsonl"
    with open(d / "pref.jsonl", "w") as f:
        for i, row in enumerate(generate_rows(60, seed=3, kind="chat")):
            msgs = row["messages"]
            f.write(json.dumps({"prompt": msgs[:1], "chosen": [msgs[1]], "rejected": [{"role": "assistant",
                                "content": f"no {i}"}], "score": float(i) / 7}) + "\n")
    paths["pref"] = d / "pref.jsonl"
    with open(d / "chat.jsonl", "w") as f:
        for row in generate_rows(300, seed=4, kind="chat"):
            f.write(json.dumps(row) + "\n")
    paths["chat"] = d / "chat.jsonl"
    paths.update(make_vlm_inputs(d, TOKENIZER_DIR))
    return paths


def make_vlm_inputs(d: Path, tokenizer_dir: Path) -> dict[str, Path]:
    import transformers
    from PIL import Image

    from thdpack.demo.models import TINY_TEXT
    from thdpack.demo.videos import write_video

    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    tok.add_tokens(VISION_TOKENS, special_tokens=True)
    tok.save_pretrained(str(d / "vlm_tok"))
    (d / "img").mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for i, (h, w) in enumerate([(12, 8), (8, 8), (8, 16), (20, 12)]):
        Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)).save(d / "img" / f"{i}.png")
    write_video(d / "img" / "v.mp4", 8, 6, 16, 20, seed=0)
    rows = [
        {"messages": [{"role": "user", "content": "<image>Describe."}, {"role": "assistant", "content": "Noise."}],
         "images": ["img/0.png"]},
        {"messages": [{"role": "user", "content": "Compare <image> and <image>."},
                      {"role": "assistant", "content": "Sizes differ."}], "images": ["img/1.png", "img/2.png"]},
        {"messages": [{"role": "user", "content": "No image."}, {"role": "assistant", "content": "Fine."}]},
        {"messages": [{"role": "user", "content": "<video>What moves?"}, {"role": "assistant", "content": "All."}],
         "videos": ["img/v.mp4"]},
        {"messages": [{"role": "user", "content": "<image> tall"}, {"role": "assistant", "content": "Yes."}],
         "images": ["img/3.png"]},
    ]
    with open(d / "vlm.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    ids = tok.convert_tokens_to_ids(VISION_TOKENS)
    text = dict(vocab_size=3080, **TINY_TEXT, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    vision = dict(depth=2, num_heads=2, in_channels=3, patch_size=2, spatial_merge_size=2, temporal_patch_size=2,
                  embed_dim=32, hidden_size=64, mlp_ratio=2)
    cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, vision_start_token_id=ids[0],
                                     vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3])
    (d / "qwen2_vl").mkdir(exist_ok=True)
    (d / "qwen2_vl" / "config.json").write_text(json.dumps(cfg.to_dict(), sort_keys=True))
    (d / "vlm.yaml").write_text(
        f"input: {d / 'vlm.jsonl'}\ntokenizer: {d / 'vlm_tok'}\nmodel_config: {d / 'qwen2_vl'}\n"
        "image_processor: {min_pixels: 16, max_pixels: 256}\nvideo: {min_pixels: 16, max_pixels: 256}\n"
        "pack_size: 400\nvision_budget: 400\noverflow: error\n")
    return {"vlm_yaml": d / "vlm.yaml"}


def qwen3_tokenizer() -> Path | None:
    root = os.environ.get("THDPACK_TOKENIZER_CACHE") or Path.home() / ".cache" / "thdpack" / "test-tokenizers"
    path = Path(root) / "qwen3"
    return path if (path / "tokenizer.json").is_file() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--ignore-key", action="append", default=[], help="dotted metadata.json key to leave out")
    ap.add_argument("--build-flags", default="", help="flags added to every thdpack build, e.g. '--engine ray' "
                    "(the digests must equal those of the same checkout without them)")
    args = ap.parse_args()
    extra = shlex.split(args.build_flags)
    inputs = make_inputs(args.workdir / "inputs")
    out = args.workdir / "out"
    shutil.rmtree(out, ignore_errors=True)
    demo = str(REPO / "configs" / "demo.yaml")
    tok = str(REPO / "thdpack" / "demo" / "tokenizer")
    builds = {
        "demo": ["--config", demo],
        "demo_parquet_cp2": ["--config", demo, "--output-format", "parquet", "--cp-size", "2", "--file-size-mb", "1"],
        "demo_split_ffd": ["--config", demo, "--overflow", "split", "--algorithm", "ffd", "--targets", "labels"],
        "demo_bridge": ["--config", demo, "--output-format", "megatron-bridge", "--max-rows", "500"],
        "text": ["--input", str(inputs["text"]), "--tokenizer", tok, "--format", "text", "--pack-size", "1024",
                 "--overflow", "drop"],
        "tokenized": ["--input", str(inputs["tokenized"]), "--format", "tokenized", "--pack-size", "2048",
                      "--algorithm", "first_fit_shuffle", "--without-targets", "keep"],
        "pref": ["--input", str(inputs["pref"]), "--tokenizer", tok, "--format", "preference", "--pack-size", "4096",
                 "--sample-values", "score"],
        "vlm": ["--config", str(inputs["vlm_yaml"])],
    }
    q3 = qwen3_tokenizer()
    if q3 is not None:
        builds["qwen3_chat"] = ["--input", str(inputs["chat"]), "--tokenizer", str(q3), "--format", "chat",
                                "--pack-size", "4096", "--loss", "last_assistant", "--overflow", "truncate"]
    result: dict = {}
    for name, flags in builds.items():
        run("build", *flags, *extra, "--output", str(out / name), "-q")
        result[name] = digest(out / name, args.ignore_key, args.workdir)
    for i in range(2):
        run("build", "--config", demo, "--slice", f"{i}/2", *extra, "--output", str(out / "parts" / "{slice}"), "-q")
    run("merge", str(out / "merged"), str(out / "parts"), "-q")
    result["merged"] = digest(out / "merged", args.ignore_key, args.workdir)
    run("export", str(out / "demo"), "--to", "megatron-bridge", str(out / "exported"), "-q")
    result["exported"] = digest(out / "exported", args.ignore_key, args.workdir)
    for name in ("demo", "merged", "vlm", "pref"):
        result[f"stats:{name}"] = _hash(run("stats", str(out / name)).encode(), args.workdir)
        result[f"stats-json:{name}"] = _hash(run("stats", str(out / name), "--json").encode(), args.workdir)
    result["stats:raw"] = _hash(run("stats", str(inputs["chat"]), "--tokenizer", tok, "--pack-size", "2048",
                                   "--cp-size", "2", "--overflow", "split").encode(), args.workdir)
    result["inspect"] = _hash(run("inspect", str(out / "demo"), "--pack", "3", "--max-tokens", "50").encode(),
                              args.workdir)
    json.dump(result, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
