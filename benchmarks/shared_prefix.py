"""Benchmark: shared-prefix packing against the unshared layout of the same samples (issue 24 point 3).

    python benchmarks/shared_prefix.py                  # 64 GRPO groups, 2,000 DPO pairs, CPU step timing
    python benchmarks/shared_prefix.py --quick          # small sizes (CI)
    python benchmarks/shared_prefix.py --json out.json

Workloads (random token ids; the prompt of a group is the same tokens in every member, declared by
``prefix_len``; prompt tokens are not targets):

* ``grpo``: groups of ``--rollouts`` (8) completions of one prompt; prompt lengths lognormal with mean
  1,500 (σ 0.5, clipped to [64, 8192]), completions lognormal with mean 500 (σ 0.6, [1, 4096]).
  Packs of 98,304 tokens (the longest group the clipping allows fits one unshared).
* ``dpo``: preference pairs with UltraFeedback-like lengths. *Assumed*, not measured (no dataset is
  read here): prompt lognormal with mean 160 (σ 0.9, [8, 2048]), chosen mean 330 and rejected mean 280
  (σ 0.7, [1, 2048]), roughly what ``HuggingFaceH4/ultrafeedback_binarized`` gives with a Llama-3 /
  Qwen tokenizer. Packs of 8,192 tokens.

Both are packed by ``ThdCollator(pack_size=..., group_field="group")`` (unshared) and
``ThdCollator(pack_size=..., share_prefix="group")`` (the prompt once per group). Columns, all summed
over the step's packs: ``tokens`` (real stream tokens: what the MLP and projections see), ``slots``
(with padding), ``packs``, and Qwen3-8B training FLOPs (``thdpack.flops.FlopsAccumulator.model_flops``
with ``configs/models/qwen3-8b.json``) split into the attention term (``6·L·d_q·Σ``, the tree's
``p² + Σ c·(2p + c)``) and the linear terms (MLP, projections, logits); ``ratio`` is unshared / shared.

Step time: a small Qwen3 (4 layers, hidden 256, vocabulary 4,096, sdpa) on the CPU, forward + backward
of ``packed_loss`` over every pack of one step, the same samples shared (the dense tree mask) and
unshared (transformers' per-sample mask from ``position_ids``), best of ``--repeats``; GRPO groups with
the lengths above divided by ``--step-scale`` (10) so that a step fits a CPU, packs of 4,096 tokens, one
torch thread (``--threads``). The two losses must agree (exit 1 otherwise).
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

from thdpack import ThdCollator
from thdpack.flops import FlopsAccumulator
from thdpack.flops import model_flops_breakdown
from thdpack.losses import packed_loss
from thdpack.integrations import to_hf_kwargs

QWEN3_8B = json.loads((Path(__file__).resolve().parents[1] / "configs" / "models" / "qwen3-8b.json").read_text())


def lognormal(rng, mean: float, sigma: float, size: int, low: int, high: int) -> np.ndarray:
    """Integer lengths, lognormal with the given *mean* (not median), clipped to ``[low, high]``."""
    mu = np.log(mean) - sigma * sigma / 2
    return np.clip(rng.lognormal(mu, sigma, size), low, high).astype(np.int64)


def group_rows(prompts: np.ndarray, answers: np.ndarray, vocab: int, seed: int) -> list[dict]:
    """Samples ``prompt + answer`` per (group, member): ``answers`` is ``[G, k]`` answer lengths."""
    rng = np.random.default_rng(seed)
    rows = []
    for g, (p, lengths) in enumerate(zip(prompts.tolist(), answers.tolist())):
        prompt = rng.integers(3, vocab, p)
        for c in lengths:
            ids = np.concatenate([prompt, rng.integers(3, vocab, c)])
            labels = ids.copy()
            labels[:p] = -100
            rows.append({"input_ids": ids, "labels": labels, "group": g, "prefix_len": p})
    return rows


def grpo_rows(groups: int, rollouts: int, seed: int, scale: float = 1.0, vocab: int = 32000) -> list[dict]:
    rng = np.random.default_rng(seed)
    prompts = lognormal(rng, 1500 / scale, 0.5, groups, max(int(64 / scale), 1), int(8192 / scale))
    answers = lognormal(rng, 500 / scale, 0.6, groups * rollouts, 1, int(4096 / scale)).reshape(groups, rollouts)
    return group_rows(prompts, answers, vocab, seed + 1)


def dpo_rows(pairs: int, seed: int, vocab: int = 32000) -> list[dict]:
    rng = np.random.default_rng(seed)
    prompts = lognormal(rng, 160, 0.9, pairs, 8, 2048)
    answers = np.stack([lognormal(rng, 330, 0.7, pairs, 1, 2048), lognormal(rng, 280, 0.7, pairs, 1, 2048)], 1)
    return group_rows(prompts, answers, vocab, seed + 1)


def layouts(rows: list[dict], pack_size: int) -> dict:
    """``{"unshared": batches, "shared": batches}`` of one step of ``rows``."""
    return {"unshared": ThdCollator(pack_size=pack_size, group_field="group")(rows),
            "shared": ThdCollator(pack_size=pack_size, share_prefix="group")(rows)}


def counts(batches) -> dict:
    acc = FlopsAccumulator()
    for b in batches:
        acc.add(b)
    terms = model_flops_breakdown(QWEN3_8B, acc.tokens, acc.seqlen_squared_sum)
    attention = terms["core_attention"]
    return {"tokens": int(acc.tokens), "slots": int(acc.padded_tokens), "packs": len(batches),
            "attention_tflop": attention / 1e12, "linear_tflop": (sum(terms.values()) - attention) / 1e12,
            "total_tflop": sum(terms.values()) / 1e12}


def workload_rows(name: str, rows: list[dict], pack_size: int) -> list[dict]:
    t0 = time.perf_counter()
    built = layouts(rows, pack_size)
    seconds = time.perf_counter() - t0
    out = {kind: counts(batches) for kind, batches in built.items()}
    ratio = {k: out["unshared"][k] / out["shared"][k] for k in out["shared"] if out["shared"][k]}
    groups = len({r["group"] for r in rows})
    return [{"workload": name, "layout": kind, "samples": len(rows), "groups": groups, **out[kind],
             "build_s": seconds} for kind in out] + [{"workload": name, "layout": "ratio", **ratio}]


# --------------------------------------------------------------------------- step time


def small_qwen3(vocab: int, layers: int, hidden: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8,
                         max_position_embeddings=8192, attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).float().train()


def step(model, batches, num_items: int) -> float:
    """Forward + backward of the step's token-mean loss over ``batches``; the loss."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for b in batches:
        logits = model(**to_hf_kwargs(b, attn_implementation="sdpa", include_labels=False), use_cache=False).logits
        loss = packed_loss(logits, b, "token", num_items=num_items)
        loss.backward()
        total += float(loss.detach())
    return total


def step_rows(args) -> list[dict]:
    rows = grpo_rows(args.step_groups, args.rollouts, args.seed, scale=args.step_scale, vocab=args.step_vocab)
    built = layouts(rows, args.step_pack_size)
    model = small_qwen3(args.step_vocab, args.step_layers, args.step_hidden)
    num_items = sum(b.num_targets for b in built["unshared"])
    out, losses = [], {}
    for kind, batches in built.items():
        step(model, batches, num_items)  # warm-up
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            losses[kind] = step(model, batches, num_items)
            best = min(best, time.perf_counter() - t0)
        out.append({"workload": "step", "layout": kind, "samples": len(rows), "packs": len(batches),
                    "tokens": sum(b.num_tokens for b in batches), "slots": sum(b.num_padded_tokens for b in batches),
                    "seconds": best, "loss": losses[kind]})
    out.append({"workload": "step", "layout": "ratio", "tokens": out[0]["tokens"] / out[1]["tokens"],
                "seconds": out[0]["seconds"] / out[1]["seconds"],
                "loss_rel_diff": abs(losses["shared"] - losses["unshared"]) / abs(losses["unshared"])})
    return out


# --------------------------------------------------------------------------- output


def print_table(rows: list[dict]) -> None:
    cols = ["workload", "layout", "samples", "packs", "tokens", "slots", "attention_tflop", "linear_tflop",
            "total_tflop", "seconds"]
    print("  ".join(f"{c:>15}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            ratio = r["layout"] == "ratio" and isinstance(v, float)
            cells.append(f"{v:>14.2f}x" if ratio else f"{v:>15.4g}" if isinstance(v, float) else f"{v!s:>15}")
        print("  ".join(cells))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=64, help="GRPO groups (prompts) in the step")
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=2000, help="DPO pairs in the step")
    parser.add_argument("--step-groups", type=int, default=8)
    parser.add_argument("--step-scale", type=float, default=10.0)
    parser.add_argument("--step-pack-size", type=int, default=4096)
    parser.add_argument("--step-layers", type=int, default=4)
    parser.add_argument("--step-hidden", type=int, default=256)
    parser.add_argument("--step-vocab", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the step (1: steadier on a shared machine)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="small sizes: 8 groups, 100 pairs, a 2-group step of a 2-layer model")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.groups, args.pairs, args.step_groups, args.repeats, args.step_layers = 8, 100, 2, 1, 2
        args.step_hidden, args.step_vocab = 128, 1024
    torch.set_num_threads(args.threads)
    print(f"python {platform.python_version()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    rows = workload_rows("grpo", grpo_rows(args.groups, args.rollouts, args.seed), 98304)
    rows += workload_rows("dpo", dpo_rows(args.pairs, args.seed), 8192)
    rows += step_rows(args)
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    bad = rows[-1]["loss_rel_diff"] > 1e-4
    if bad:
        print(f"shared and unshared losses differ: {rows[-3]['loss']} vs {rows[-2]['loss']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
