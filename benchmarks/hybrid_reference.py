"""Benchmark: the cost of ``packed_model``'s reference path on the CPU (issue 29, "Performance").

    python benchmarks/hybrid_reference.py                 # Qwen3.5 and Bamba, hidden 256, packs of 512 and 2,048
    python benchmarks/hybrid_reference.py --quick         # seconds: hidden 64, 2 layers, one pack of 128 tokens
    python benchmarks/hybrid_reference.py --out hybrid_reference.json

Where the kernels of a hybrid model's sequence mixers are missing (always on the CPU),
:func:`thdpack.integrations.packed_model` runs each Gated DeltaNet / Mamba-2 layer on every sample's span
alone and concatenates the outputs (the reference path); the other layers (attention with the pack's 4D
document mask, MLPs, projections, logits) run on the whole stream at once. Its peer is what one does
without packing: every sample alone through the same model, one after another (batch axis 1, gradients
accumulated over the samples). Both on the same random-weight model, the same samples, side by side in
one run:

* ``qwen3_5``: transformers' ``Qwen3_5ForCausalLM`` (Gated DeltaNet + full attention);
* ``bamba``: transformers' ``BambaForCausalLM`` (Mamba-2 + attention);

each with ``--layers`` (4) layers, one of them attention (the middle one), hidden ``--hidden`` (256),
vocabulary ``--vocab`` (4,096), float32, sdpa, train mode; packs of ``--pack-sizes`` tokens (512 and 2,048)
holding ``--samples`` samples (12 and 32: lognormal lengths, at least 2 tokens). Modes: ``forward``
(no grad, the loss included) and ``fwd+bwd`` (the token-mean loss and its backward). Times are the best of
``--repeats`` (5) rounds after a warm-up, the pack and the loop taking turns in every round, on ``--threads``
torch threads (1: steadier on a shared machine); ``packed / alone`` is the pack's time over the loop's (below
1: the pack is faster). No target: the ratio is measured, not asserted. The two must give the same loss and
gradients (relative 1e-4, float32): the script exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from thdpack import build_thd_batch  # noqa: E402
from thdpack.integrations import packed_model  # noqa: E402
from thdpack.integrations import to_hf_kwargs  # noqa: E402

TOLERANCE = 1e-4  # relative, float32: loss and every gradient, pack vs alone
MODES = ("forward", "fwd+bwd")


def hybrid_model(family: str, hidden: int, layers: int, vocab: int):
    """A random-weight float32 hybrid causal LM (train mode; no dropout in these configs), ``packed_model``
    applied (unpacked calls are untouched by it)."""
    import transformers

    heads = max(2, hidden // 64)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=8192,
                  use_cache=False, tie_word_embeddings=False, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    d = min(64, hidden // 4)
    if family == "qwen3_5":
        kinds = ["full_attention" if i == layers // 2 else "linear_attention" for i in range(layers)]
        config = transformers.Qwen3_5TextConfig(
            **common, head_dim=hidden // heads, layer_types=kinds, linear_conv_kernel_dim=4, linear_key_head_dim=d,
            linear_value_head_dim=d, linear_num_key_heads=2, linear_num_value_heads=4)
        model_class = transformers.Qwen3_5ForCausalLM
    else:
        mamba_heads = max(2, 2 * hidden // 64)
        config = transformers.BambaConfig(
            **common, attn_layer_indices=[layers // 2], mamba_n_heads=mamba_heads,
            mamba_d_head=2 * hidden // mamba_heads, mamba_n_groups=1, mamba_d_state=d, mamba_d_conv=4,
            mamba_expand=2, mamba_chunk_size=64)
        model_class = transformers.BambaForCausalLM
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return packed_model(model_class(config).float().train())


def pack_lengths(tokens: int, samples: int, seed: int) -> list[int]:
    """``samples`` lognormal lengths (σ 0.8), each at least 2, summing to ``tokens``."""
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(0.0, 0.8, samples)
    lengths = np.maximum(2, np.floor(raw / raw.sum() * tokens)).astype(int)
    lengths[np.argmax(lengths)] += tokens - int(lengths.sum())
    return lengths.tolist()


def samples_of(lengths: list[int], vocab: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(3, vocab, n).tolist()} for n in lengths]


def run_packed(model, kwargs: dict, backward: bool) -> float:
    """The pack's token-mean loss (HF labels of the pack: shifted within each sample), its backward."""
    loss = model(**kwargs).loss
    if backward:
        loss.backward()
    return float(loss.detach())


def run_alone(model, samples: list[dict], backward: bool) -> float:
    """Every sample alone, the same token-mean loss over all targets, gradients accumulated sample by sample."""
    targets = sum(len(s["input_ids"]) - 1 for s in samples)
    total = 0.0
    for s in samples:
        ids = torch.tensor([s["input_ids"]])
        loss = model(input_ids=ids, labels=ids).loss * ((ids.shape[1] - 1) / targets)
        if backward:
            loss.backward()
        total += float(loss.detach())
    return total


def timed(fns: list, model, backward: bool, repeats: int) -> list[tuple[float, float, list]]:
    """``(best seconds, loss, gradients)`` of each ``fn(backward)``: ``repeats`` rounds after a warm-up, the
    functions taking turns in every round (a load burst on a shared machine hits both sides alike)."""
    best, loss, grads = [float("inf")] * len(fns), [None] * len(fns), [[] for _ in fns]
    for i in range(repeats + 1):
        for j, fn in enumerate(fns):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            with torch.set_grad_enabled(backward):
                loss[j] = fn(backward)
            if i:
                best[j] = min(best[j], time.perf_counter() - t0)
            if backward and i == repeats:
                grads[j] = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
    return list(zip(best, loss, grads))


def rel_diff(a: list, b: list) -> float:
    """max |a - b| / max |b| over every gradient (both None: skipped)."""
    num = max((float((x - y).abs().max()) for x, y in zip(a, b) if x is not None and y is not None), default=0.0)
    den = max((float(y.abs().max()) for y in b if y is not None), default=1.0)
    return num / den


def case_rows(family: str, tokens: int, samples: int, args) -> list[dict]:
    model = hybrid_model(family, args.hidden, args.layers, args.vocab)
    rows_in = samples_of(pack_lengths(tokens, samples, args.seed), args.vocab, args.seed + 1)
    kwargs = to_hf_kwargs(build_thd_batch(rows_in), attn_implementation="sdpa")
    out = []
    for mode in MODES:
        backward = mode == "fwd+bwd"
        (packed_s, packed_loss, packed_grads), (alone_s, alone_loss, alone_grads) = timed(
            [lambda b: run_packed(model, kwargs, b), lambda b: run_alone(model, rows_in, b)], model, backward,
            args.repeats)
        out.append({"model": family, "tokens": tokens, "samples": samples, "mode": mode, "packed_s": packed_s,
                    "alone_s": alone_s, "ratio": packed_s / alone_s,
                    "loss_rel_diff": abs(packed_loss - alone_loss) / abs(alone_loss),
                    "grad_rel_diff": rel_diff(packed_grads, alone_grads) if backward else None})
    return out


def print_table(rows: list[dict]) -> None:
    cols = [("model", 8), ("tokens", 7), ("samples", 8), ("mode", 8), ("packed_s", 10), ("alone_s", 10),
            ("packed / alone", 15), ("loss_rel_diff", 14), ("grad_rel_diff", 14)]
    print("  ".join(f"{c:>{w}}" for c, w in cols))
    for r in rows:
        cells = [r["model"], r["tokens"], r["samples"], r["mode"], f"{r['packed_s']:.4f}", f"{r['alone_s']:.4f}",
                 f"{r['ratio']:.2f}x", f"{r['loss_rel_diff']:.1e}",
                 "-" if r["grad_rel_diff"] is None else f"{r['grad_rel_diff']:.1e}"]
        print("  ".join(f"{v!s:>{w}}" for v, (_, w) in zip(cells, cols)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=["qwen3_5", "bamba"], default=["qwen3_5", "bamba"])
    ap.add_argument("--pack-sizes", type=int, nargs="+", default=[512, 2048], help="tokens of each pack")
    ap.add_argument("--samples", type=int, nargs="+", default=[12, 32], help="samples in each pack (one per size)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="seconds: hidden 64, 2 layers, one pack of 128 tokens")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.pack_sizes, args.samples, args.hidden, args.layers, args.vocab, args.repeats = [128], [8], 64, 2, 512, 1
    if len(args.samples) != len(args.pack_sizes):
        ap.error("--samples needs one count per --pack-sizes entry")
    torch.set_num_threads(args.threads)
    print(f"python {platform.python_version()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}, float32, sdpa", flush=True)
    rows = []
    for family in args.models:
        for tokens, samples in zip(args.pack_sizes, args.samples):
            rows += case_rows(family, tokens, samples, args)
    print_table(rows)
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
    bad = [r for r in rows if not r["loss_rel_diff"] <= TOLERANCE
           or (r["grad_rel_diff"] is not None and not r["grad_rel_diff"] <= TOLERANCE)]
    if bad:
        print(f"FAILED: the pack and the samples alone differ (relative tolerance {TOLERANCE}) in "
              f"{', '.join(r['model'] + ' ' + str(r['tokens']) + ' ' + r['mode'] for r in bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
