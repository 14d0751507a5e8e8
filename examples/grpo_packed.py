"""GRPO-style policy gradient with packing: completions of several prompts packed together,
group-normalised advantages and domain ids carried with each sample, the loss in both
reductions equal to the unpacked per-sample computation, and a per-domain loss log. CPU.

    python examples/grpo_packed.py [--num-prompts 16] [--group-size 4] [--reduction token]

Steps:

1. rows: ``group`` (the prompt), a reward, and a ``domain`` id per completion; advantages
   ``thdpack.losses.group_advantages`` (``(r − mean_g) / (std_g + eps)``);
2. packs from ``TokenBudgetBatchSampler(groups=..., balance="compute")``: a prompt's completions
   run on one rank in one step, a group larger than one pack spanning up to ``micro_batches``
   packs (``--group-size 8`` shows some); the step's normaliser from ``step_items``;
3. ``ThdCollator(sample_values=["advantage", "domain"])``: ``batch.token_values("advantage")``
   feeds ``policy_gradient_loss``; ``batch.token_values("domain")`` splits the NLL per domain;
4. the same loss sample by sample, unpacked, to show they agree; one optimizer step.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from thdpack import ThdCollator, TokenBudgetBatchSampler
from thdpack.demo.models import tiny_qwen3
from thdpack.losses import group_advantages, policy_gradient_loss, token_logps

DOMAINS = ("math", "code", "chat")


def rl_rows(num_prompts: int, group_size: int, vocab_size: int, seed: int = 0) -> list[dict]:
    """``group_size`` completions per prompt: ``input_ids``, ``labels`` (prompt -100), ``group``,
    ``reward`` (a toy one: the share of even tokens in the completion), ``domain``."""
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(num_prompts):
        prompt = rng.integers(3, vocab_size, int(rng.integers(4, 32)))
        domain = int(rng.integers(0, len(DOMAINS)))
        for _ in range(group_size):
            completion = rng.integers(3, vocab_size, int(rng.integers(2, 64)))
            ids = np.concatenate([prompt, completion])
            labels = ids.copy()
            labels[: prompt.size] = -100
            rows.append({"input_ids": ids, "labels": labels, "group": g, "domain": domain,
                         "reward": float((completion % 2 == 0).mean())})
    return rows


def packed_step(model, batches, reduction: str, num_items: int) -> tuple[float, dict]:
    """Accumulate one optimizer step's gradient; returns its loss and per-domain mean NLL."""
    total, nll_sum, nll_count = 0.0, np.zeros(len(DOMAINS)), np.zeros(len(DOMAINS))
    for batch in batches:
        logits = model(**batch.to_hf_kwargs(include_labels=False), use_cache=False).logits
        loss = policy_gradient_loss(logits, batch, batch.token_values("advantage"), reduction, num_items)
        loss.backward()
        total += float(loss.detach())
        with torch.no_grad():  # per-domain logging: the domain of every target token
            nll, domain = -token_logps(logits, batch), batch.token_values("domain")
            for d in range(len(DOMAINS)):
                keep = batch.loss_mask & (domain == d)
                nll_sum[d] += float(nll[keep].sum())
                nll_count[d] += int(keep.sum())
    per_domain = {DOMAINS[d]: nll_sum[d] / nll_count[d] for d in range(len(DOMAINS)) if nll_count[d]}
    return total, per_domain


def groups_over_one_pack(packs, groups) -> int:
    """How many groups of the step have their completions in several of its packs."""
    packs_of = {}
    for k, pack in enumerate(packs):
        for i in pack:
            packs_of.setdefault(groups[i], set()).add(k)
    return sum(len(ks) > 1 for ks in packs_of.values())


@torch.no_grad()
def unpacked_loss(model, rows, reduction: str) -> float:
    """On-policy PG loss sample by sample (value ``−A`` per target token), no thdpack."""
    per_row = []
    for r in rows:
        targets = torch.as_tensor(r["labels"])[1:]
        per_row.append(torch.full((int((targets != -100).sum()),), -r["advantage"], dtype=torch.float64))
    if reduction == "token":
        return float(torch.cat(per_row).sum() / sum(p.numel() for p in per_row))
    return float(torch.stack([p.mean() for p in per_row if p.numel()]).mean())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--pack-size", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--reduction", default="token", choices=["token", "sample"])
    parser.add_argument("--vocab-size", type=int, default=512)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    rows = rl_rows(args.num_prompts, args.group_size, args.vocab_size)
    advantages = group_advantages([r["reward"] for r in rows], [r["group"] for r in rows])
    for r, a in zip(rows, advantages.tolist()):
        r["advantage"] = a
    lengths = [r["input_ids"].size for r in rows]
    groups = [r["group"] for r in rows]  # a group over one pack spans up to micro_batches packs of one rank
    sampler = TokenBudgetBatchSampler(lengths, args.pack_size, groups=groups, balance="compute",
                                      micro_batches=args.micro_batches, seed=0)
    targets = [int((r["labels"][1:] != -100).sum()) for r in rows]  # completion tokens: what is scored
    num_items = sampler.step_items(0, targets).num_items(args.reduction)  # known before the step runs
    packs = [pack for _, pack in zip(range(args.micro_batches), sampler)]
    collate = ThdCollator(sample_values=["advantage", "domain"])
    batches = [collate([rows[i] for i in pack]) for pack in packs]
    step_rows = [rows[i] for pack in packs for i in pack]
    print(f"step 0: {len(batches)} packs, {len(step_rows)} completions, num_items {num_items} ({args.reduction}); "
          f"groups over one pack: {groups_over_one_pack(packs, groups)}")

    model = tiny_qwen3(args.vocab_size, seed=0).eval()
    packed, per_domain = packed_step(model, batches, args.reduction, num_items)
    alone = unpacked_loss(model, step_rows, args.reduction)
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    print(f"pg loss {packed:.6f} ({args.reduction}; unpacked, sample by sample: {alone:.6f}; "
          f"|diff| {abs(packed - alone):.2e})")
    print("nll by domain: " + ", ".join(f"{k} {v:.4f}" for k, v in per_domain.items()))
    return {"loss": packed, "unpacked": alone, "per_domain": per_domain}


if __name__ == "__main__":
    main()
