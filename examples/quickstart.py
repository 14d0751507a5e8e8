"""Quickstart: pack a bundled demo sample set and run one packed training step.

    python examples/quickstart.py [--pack-size 2048] [--num-samples 3000]

The demo samples are generated (seeded) chat-like token sequences with a
long-tailed length distribution: a prompt whose labels are masked (-100) and a
response that is trained on. Steps:

1. plan packs with best-fit decreasing and print the plan statistics;
2. feed a DataLoader through ``TokenBudgetBatchSampler`` + ``ThdCollator``;
3. run one packed forward/backward step of a tiny random-weight Qwen3 model
   (needs ``transformers``; skipped with a note when it is not installed):
   ``packed_model(model)`` once, then ``model(**to_hf_kwargs(batch, attn_implementation=...))``
   with the model's own attention backend (docs/hybrid.md);
4. print the attention work a pack-length count would claim versus ``Σ sᵢ²``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch.utils.data import DataLoader

import thdpack
from thdpack.demo.models import tiny_qwen3
from thdpack.integrations import packed_model
from thdpack.integrations import to_hf_kwargs


def demo_samples(num_samples: int, vocab_size: int, seed: int = 0) -> list[dict]:
    """Seeded chat-like samples: ``input_ids`` and ``labels`` as int64 numpy arrays."""
    rng = np.random.default_rng(seed)
    prompt_lens = np.clip(rng.lognormal(4.0, 0.8, num_samples), 1, 1024).astype(np.int64)
    answer_lens = np.clip(rng.lognormal(5.2, 1.0, num_samples), 1, 3072).astype(np.int64)
    samples = []
    for p, a in zip(prompt_lens, answer_lens):
        ids = rng.integers(3, vocab_size, p + a, dtype=np.int64)
        labels = ids.copy()
        labels[:p] = -100  # no loss on the prompt
        samples.append({"input_ids": ids, "labels": labels})
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-samples", type=int, default=3000)
    parser.add_argument("--pack-size", type=int, default=4096)
    parser.add_argument("--algorithm", default="bfd", choices=["bfd", "ffd", "first_fit_shuffle", "sequential"])
    parser.add_argument("--cp-size", type=int, default=1, help="pad every sample for this context-parallel size")
    parser.add_argument("--vocab-size", type=int, default=1024)
    args = parser.parse_args()

    samples = demo_samples(args.num_samples, args.vocab_size)
    lengths = np.array([s["input_ids"].size for s in samples])
    align = thdpack.cp_pad_multiple(args.cp_size)

    t0 = time.perf_counter()
    plan = thdpack.plan_packs(lengths, args.pack_size, algorithm=args.algorithm, align=align, overflow="truncate")
    print(f"planned {len(lengths)} samples in {time.perf_counter() - t0:.3f}s ({args.algorithm}, align {align})")
    print(plan.stats)

    sampler = thdpack.TokenBudgetBatchSampler(
        lengths, args.pack_size, algorithm=args.algorithm, align=align, overflow="truncate", seed=0
    )
    collator = thdpack.ThdCollator(cp_size=args.cp_size, max_length=sampler.max_length)  # pack_size under align
    loader = DataLoader(samples, batch_sampler=sampler, collate_fn=collator)
    # a pack whose samples lost every target to truncation trains nothing (its mean loss is NaN): skip it
    batch = next(b for b in loader if b.num_targets)
    print(
        f"\nfirst pack: {batch.num_samples} samples, {batch.num_tokens} real tokens, "
        f"{batch.num_padded_tokens} in the stream, max_seqlen {batch.max_seqlen}"
    )

    pack_len_count = sum(plan.stats.pack_size**2 for _ in range(len(plan)))
    real_count = int((plan.length.astype(np.int64) ** 2).sum())
    print(
        f"attention work: Σ sᵢ² = {real_count:.3e}; counting each pack as one sequence would claim "
        f"{pack_len_count:.3e} ({pack_len_count / real_count:.1f}x)"
    )

    try:
        model = packed_model(tiny_qwen3(args.vocab_size))  # Qwen3: no layer wrapped; hybrids get their boundaries
    except ImportError:
        print("\ntransformers is not installed: skipping the packed training step (pip install -e '.[hf]')")
        return
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = model(**to_hf_kwargs(batch, attn_implementation=model.config._attn_implementation))
    out.loss.backward()
    optimizer.step()
    print(f"\none packed training step of a tiny Qwen3: loss {out.loss.item():.4f} over {batch.num_targets} target tokens")


if __name__ == "__main__":
    main()
