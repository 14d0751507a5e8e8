"""``thdpack inspect``: one pack of a packed dataset decoded, sample by sample, targets marked."""

from __future__ import annotations

import sys
from pathlib import Path

from thdpack.cli.config_flags import integer_at_least
from thdpack.common.align import check_int
from thdpack.common.samples import IGNORE_INDEX
from thdpack.offline.errors import OfflineError
from thdpack.offline.tokenizing.tokenizer_loading import TOKENIZER_FILE, damaged_tokenizer


def add_parser(sub) -> None:
    i = sub.add_parser("inspect", help="show one pack decoded, sample by sample",
                       description="Show one pack of a packed dataset decoded, sample by sample, targets marked.")
    i.add_argument("path", help="packed dataset directory")
    i.add_argument("--pack", type=int, default=0, help="pack number (negative counts from the end)")
    i.add_argument("--tokenizer", help="tokenizer to decode with (default: the copy saved with the dataset)")
    i.add_argument("--max-tokens", type=integer_at_least(1), default=None, metavar="N",
                   help="show at most N tokens per sample")
    i.add_argument("--ids", action="store_true", help="show token ids instead of text")
    i.set_defaults(func=run, writes=False)


def run(args) -> int:
    from thdpack.offline.store.dataset import load_packed

    ds = load_packed(args.path)
    n = len(ds)
    check_int(args.pack, "--pack", -n, below=n, hint=f" (the dataset has {n} packs)", error=OfflineError)
    row = ds[args.pack]
    samples = ds.samples(args.pack)
    meta = ds.metadata
    decode = None if args.ids else _decoder(args.tokenizer or ds.tokenizer_path, meta)
    total = int(row["input_ids"].size)
    print(f"pack {args.pack % n} of {n}: {len(samples)} samples, {total} tokens "
          f"(fill {total / meta['pack_size']:.3f} of {meta['pack_size']}), targets: {meta['targets']}")
    if decode is not None:
        print("target tokens (trained on) are shown between « and »")
    for j, s in enumerate(samples):
        ids = s["input_ids"]
        is_t = s["loss_mask"] if "loss_mask" in s else s["labels"] != IGNORE_INDEX
        is_t = is_t.astype(bool).copy()
        is_t[0] = False  # a sample's first token is never a target
        start = int(row["sample_start"][j])
        print(f"\n── sample {j}: {_source_of(meta, row, j)}input row {int(row['sample_index'][j])}"
              + (f", tokens {start}..{start + ids.size}" if start else "")
              + f", {ids.size} tokens, {int(is_t.sum())} targets ──")
        shown = ids if args.max_tokens is None else ids[: args.max_tokens]
        if decode is None:
            marks = ["*" if t else "" for t in is_t[: shown.size]]
            print(" ".join(f"{int(i)}{m}" for i, m in zip(shown, marks)) + ("  (* = target)" if is_t.any() else ""))
        else:
            print(_decode_marked(decode, shown, is_t[: shown.size]))
        if shown.size < ids.size:
            print(f"... ({ids.size - shown.size} more tokens)")
    return 0


def _decoder(tokenizer, meta):
    if tokenizer is None:
        name = (meta.get("tokenizer") or {}).get("name_or_path")
        if not name:
            return None
        tokenizer = name
    path = Path(tokenizer)
    if (path / TOKENIZER_FILE).is_file():
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(path / TOKENIZER_FILE))
        except Exception as exc:  # noqa: BLE001 - the tokenizers library raises a bare Exception on a damaged file
            raise damaged_tokenizer(str(tokenizer), path, exc) from None
        return lambda ids: tok.decode([int(i) for i in ids], skip_special_tokens=False)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    except Exception:  # noqa: BLE001 - fall back to ids
        print(f"note: tokenizer {tokenizer} not available offline; showing token ids", file=sys.stderr)
        return None
    return lambda ids: tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _decode_marked(decode, ids, is_target) -> str:
    """Decode runs of target / non-target tokens, wrapping target runs in « »."""
    import numpy as np

    out, a = [], 0
    change = np.flatnonzero(np.diff(is_target.astype(np.int8))) + 1
    for b in list(change) + [ids.size]:
        text = decode(ids[a:b])
        out.append(f"«{text}»" if is_target[a] else text)
        a = b
    return "".join(out)


def _source_of(meta: dict, row, j: int) -> str:
    """``source 'NAME', `` of sample ``j`` of a mixture's pack (its ``source_index``); ``""`` otherwise."""
    if "mixture" not in meta or "source_index" not in row:
        return ""
    return f"source {meta['mixture']['sources'][int(row['source_index'][j])]['name']!r}, "
